"""The demo behind ``make demo`` / ``lmtier demo``: tooling, not the product.

    vllm      two vLLM engines on a tiny random-weight model, the second loading what the
              first saved (the default)
    embedded  the same story on the embedded API alone (``lmtier demo --store-only``)
    pd        prefill/decode disaggregation with two ``vllm serve`` (``lmtier demo pd``)
    pd_proxy  the reference prefill/decode proxy: what the routers do, small enough to read

Nothing in the product imports this package; the CLI reaches it lazily when asked for the
demo.
"""
