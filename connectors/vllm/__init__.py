"""``LMTierConnector``: lmtier as a vLLM (v1, 0.32) KV connector.

    --kv-transfer-config '{"kv_connector": "LMTierConnector",
                           "kv_connector_module_path": "lmtier.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"tiers": ["cpu://?size=4GiB",
                                                                   "file:///var/lib/lmtier?size=100GiB"]}}'

Extra-config keys (all optional): ``tiers``, ``chunk_tokens``, ``hash``, ``salt``,
``write_queue``, ``write_mode``, ``save_policy``, ``min_tokens`` (which chunks are
stored where: ``lmtier.store.admission``), ``metrics_port`` (Prometheus ``/metrics`` from the
engine's processes: the scheduler on this port, worker rank r on ``port + 1 + r``),
``load_deadline`` (seconds a step's loads may take; the rest is recomputed),
``layer_loads`` (GPU: copy loads layer by layer beside the forward pass),
``handoff_timeout`` and ``save_decoded`` (prefill/decode disaggregation:
``connectors/vllm/pd.py``), ``config`` (a config file), ``model_id`` (the model's name in
the namespace; default: the engine's model path or name). Unset keys come from
``LMTIER_*`` environment variables, then lmtier's defaults.

``kv_role``: ``kv_both`` caches as a colocated engine does (looks up, loads, stores);
``kv_producer`` (a prefill instance) only stores, and answers once its chunks are
readable; ``kv_consumer`` (a decode instance) only loads (``connectors/vllm/pd.py``).

A request can opt out with ``kv_transfer_params`` (``SamplingParams(extra_args=
{"kv_transfer_params": {"lmtier": {"save": false}}})``, or the same field in an OpenAI
API request): ``"save": false`` keeps its KV out of the store (private documents),
``"load": false`` makes it ignore stored KV.

Failure is a recompute, never wrong output: a chunk that is missing, fails verification
or does not arrive is reported through ``get_block_ids_with_load_errors``, and vLLM
recomputes those blocks. Set ``kv_load_failure_policy="recompute"`` in the
``KVTransferConfig`` (``--kv-transfer-config '{..., "kv_load_failure_policy": "recompute"}'``);
lmtier sets it itself when the engine lets it.

Deciding and moving live apart, as vLLM splits them:

    connector  LMTierConnector: the state both halves read, the store each process shares
    settings   the extra-config keys (EXTRA_KEYS), checked before anything opens
    lookup     scheduler half (engine core): how much of a prompt can load; hand-off waits
    scheduler  scheduler half: plans per step, when a request's blocks go back
    plans      what the halves pass each step (LMTierMetadata, LoadPlan, SavePlan, ...)
    worker     worker half (each worker): the paged cache, loads into it
    saves      worker half: saves out of it on a background thread, blocks held until copied
    groups     hybrid models: the KV cache groups lmtier stores (lanes)
    pd         prefill/decode disaggregation: roles and the hand-off a router forwards
    events     lmtier's tiers in vLLM's KV event stream, for routers
    stats      lmtier's figures in vLLM's own metrics
"""

from lmtier.connectors.vllm.connector import LMTierConnector, flush_all
from lmtier.connectors.vllm.plans import LMTierMetadata, LMTierWorkerMeta, LoadPlan, SavePlan
from lmtier.connectors.vllm.settings import EXTRA_KEYS

__all__ = [
    "EXTRA_KEYS",
    "LMTierConnector",
    "LMTierMetadata",
    "LMTierWorkerMeta",
    "LoadPlan",
    "SavePlan",
    "flush_all",
]
