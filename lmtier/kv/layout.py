"""``KVLayout``: the shape of one model's KV cache, and what it costs in bytes.

The canonical chunk layout that lmtier stores is, per chunk of ``T`` tokens::

    MHA / GQA / MQA: [layers, 2 (K, V), T, kv_heads, head_dim]
    MLA:             [layers, T, latent]          (one compressed latent per token)

so the bytes of one token are ``layers x 2 x kv_heads x head_dim x dtype bytes`` (MLA:
``layers x latent x dtype bytes``). Presets cover common models; ``from_hf_config`` reads
a Hugging Face ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lmtier.errors import ConfigError, LayoutError

# Bounds no model reaches (the largest have ~200 layers, 128 KV heads, 1k-wide heads): a
# layout past them is malformed input, refused before anything is sized or copied.
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 2048, 1024, 16384
# Canonical dtype name -> bytes per element.
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def canonical_dtype(dtype: Any) -> str:
    """``"bf16"``, ``"torch.bfloat16"`` or ``torch.bfloat16`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_SIZES:
        raise LayoutError(f"unsupported KV dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """The KV cache shape of one model (of one tensor-parallel rank)."""

    num_layers: int
    num_kv_heads: int  # MLA: 1
    head_dim: int  # MLA: the latent width (kv_lora_rank + rope dim)
    dtype: str = "bfloat16"
    mla: bool = False
    # Only names the attention kind (MHA / GQA); not part of equality or the bytes.
    num_attention_heads: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.mla and self.num_kv_heads != 1:
            raise LayoutError("an MLA layout stores one latent per token: num_kv_heads must be 1")
        for name, most in (("num_layers", MAX_LAYERS), ("num_kv_heads", MAX_HEADS), ("head_dim", MAX_HEAD_DIM)):
            if getattr(self, name) > most:  # no model has more; far more would make every copy a long loop
                raise LayoutError(f"KVLayout.{name} of {getattr(self, name)} is past any model's ({most} at most)")

    # -- sizes ------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def kv_factor(self) -> int:
        """2 for separate K and V, 1 for an MLA latent."""
        return 1 if self.mla else 2

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv_factor * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def token_row_bytes(self) -> int:
        """Bytes of one token in one layer for K (or V, or the latent)."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    def chunk_bytes(self, chunk_tokens: int) -> int:
        return self.bytes_per_token * chunk_tokens

    @property
    def attention(self) -> str | None:
        """``"MHA"``, ``"GQA"``, ``"MQA"`` or ``"MLA"``, from the query heads per KV head of a
        whole model's layout; None where the layout cannot tell. A stored chunk's layout
        records its KV heads only (the query heads do not change a byte), and 8 KV heads are
        MHA with 8 query heads, GQA with 64: guessing "MHA" there named Llama-3 wrongly. (A
        tensor-parallel shard keeps the model's query heads but not its KV heads: ask of the
        whole model.)"""
        if self.mla:
            return "MLA"
        heads, kv = self.num_attention_heads, self.num_kv_heads
        if not heads or heads < kv:
            return None  # unknown, or not a count of query heads
        if heads == kv:
            return "MHA"
        return "MQA" if kv == 1 else "GQA"

    # -- shapes -----------------------------------------------------------------------
    def tensor_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of the KV of ``num_tokens`` tokens in the canonical order."""
        if self.mla:
            return (self.num_layers, num_tokens, self.head_dim)  # [layers, tokens, latent]
        # [layers, 2, tokens, kv_heads, head_dim]
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def token_axis(self) -> int:
        return 1 if self.mla else 2

    def byte_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """The canonical shape seen as bytes: ``[layers, kv_factor, tokens, row_bytes]``.

        This 4-d uint8 view is how the core moves KV without knowing the dtype.
        """
        return (self.num_layers, self.kv_factor, num_tokens, self.token_row_bytes)

    # -- variants and serialization ---------------------------------------------------
    def with_dtype(self, dtype: Any) -> KVLayout:
        return replace(self, dtype=dtype)

    def shard(self, tp_size: int) -> KVLayout:
        """The layout held by one of ``tp_size`` tensor-parallel ranks.

        KV heads are split across ranks; with fewer KV heads than ranks each rank holds one
        replicated head. An MLA latent is replicated on every rank.
        """
        if tp_size <= 0:
            raise LayoutError(f"tp_size must be positive, got {tp_size}")
        if self.mla or tp_size == 1:
            return self
        if self.num_kv_heads >= tp_size and self.num_kv_heads % tp_size:
            raise LayoutError(f"{self.num_kv_heads} KV heads do not split over {tp_size} ranks")
        return replace(self, num_kv_heads=max(1, self.num_kv_heads // tp_size))

    def to_dict(self) -> dict[str, Any]:
        """The fields that change the bytes (``num_attention_heads`` does not). Written
        out rather than ``asdict`` (which deep-copies): every frame header holds one."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "mla": self.mla,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        try:
            return cls(
                num_layers=data["num_layers"],
                num_kv_heads=data["num_kv_heads"],
                head_dim=data["head_dim"],
                dtype=data["dtype"],
                mla=bool(data.get("mla", False)),
            )
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"malformed layout {data!r}: {exc}") from exc

    def describe(self, attention: str | None = None) -> str:
        """``80 layers x 8 KV heads x 128 head dim (GQA), bfloat16``: the attention kind is
        ``attention`` when given (``lmtier inspect`` knows it from the model, not the chunk),
        else the layout's own, and left out when neither knows it."""
        kind = attention or self.attention
        label = f" ({kind})" if kind else ""
        if self.mla:
            return f"{self.num_layers} layers x {self.head_dim}-wide latent{label}, {self.dtype}"
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} head dim{label}, {self.dtype}"
        )


# Published architectures. bf16 is the default KV dtype of all of them.
PRESETS: dict[str, KVLayout] = {
    "llama-3-8b": KVLayout(32, 8, 128, num_attention_heads=32),
    "llama-3-70b": KVLayout(80, 8, 128, num_attention_heads=64),
    "llama-3-405b": KVLayout(126, 8, 128, num_attention_heads=128),
    "llama-2-7b": KVLayout(32, 32, 128, num_attention_heads=32),
    "llama-2-13b": KVLayout(40, 40, 128, num_attention_heads=40),
    "mistral-7b": KVLayout(32, 32, 128, num_attention_heads=32),  # v0.1 read as MHA
    "qwen2.5-7b": KVLayout(28, 4, 128, num_attention_heads=28),
    "qwen2.5-72b": KVLayout(80, 8, 128, num_attention_heads=64),
    "deepseek-v3": KVLayout(61, 1, 576, mla=True, num_attention_heads=128),
}


def preset(name: str) -> KVLayout:
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(
            f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))} "
            "(a model of your own: --config DIR/config.json)"
        )
    return PRESETS[key]


def from_hf_config(source: str | Path | dict[str, Any], dtype: Any = None) -> KVLayout:
    """Read the KV layout from a Hugging Face ``config.json`` (a path or a parsed dict).

    Uses ``num_hidden_layers``, ``num_key_value_heads`` (default: attention heads) and
    ``head_dim`` (default: ``hidden_size // num_attention_heads``). A config with
    ``kv_lora_rank`` is MLA, with a latent of ``kv_lora_rank + qk_rope_head_dim``.
    Multimodal configs are read from their ``text_config``.
    """
    if isinstance(source, dict):
        cfg = source
    else:
        try:
            cfg = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read model config {source}: {exc}") from exc
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg.get("num_attention_heads") or 0) or None
        if dtype is None:
            dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        if cfg.get("kv_lora_rank"):
            latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
            return KVLayout(layers, 1, latent, dtype, mla=True, num_attention_heads=heads)
        if heads is None:
            raise KeyError("num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or 0) or int(cfg["hidden_size"]) // heads
        return KVLayout(layers, kv_heads, head_dim, dtype, num_attention_heads=heads)
    except KeyError as exc:
        raise ConfigError(f"model config lacks {exc.args[0]!r}") from exc
