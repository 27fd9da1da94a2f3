"""A small Llama with random weights and a word-level tokenizer, built offline.

For the demo, the engine tests and the benchmarks: no model hub is needed, and the KV
shapes are those of a real Llama (grouped-query attention, bf16)."""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 512


def build(out: str | Path, layers: int = 4, hidden: int = 256, seed: int = 0, kv_heads: int = 2) -> Path:
    """A random-weight Llama of ``layers`` layers; its KV is ``layers x kv_heads x 256`` bytes per token."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=16384,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1", bos_token="t2").save_pretrained(
        out
    )
    return out


if __name__ == "__main__":
    build(sys.argv[1])
