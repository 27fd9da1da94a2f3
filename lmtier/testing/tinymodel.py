"""A small Llama with random weights and a word-level tokenizer, built offline.

For the demo, the engine tests and the benchmarks: no model hub is needed, and the KV
shapes are those of a real Llama (grouped-query attention, bf16).

    python -m lmtier.testing.tinymodel DIR [--layers 4] [--hidden 256] [--kv-heads 2] ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmtier.errors import MissingDependency

VOCAB = 512


def build(
    out: str | Path, layers: int = 4, hidden: int = 256, seed: int = 0, kv_heads: int = 2, sliding_window: int = 0
) -> Path:
    """A random-weight Llama of ``layers`` layers; its KV is ``layers x kv_heads x 256`` bytes per token.
    With ``sliding_window``, every second layer (1, 3, ...) attends to that many tokens
    only: a hybrid model, whose cache vLLM splits into a full-attention and a
    sliding-window group."""
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
    if sliding_window:
        config.layer_types = ["sliding_attention" if i % 2 else "full_attention" for i in range(layers)]
        config.sliding_window = sliding_window
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1", bos_token="t2").save_pretrained(
        out
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line: ``build``'s arguments as flags. An argument parser rather than
    ``sys.argv[1]``, which took ``--help`` for a directory and built a model there."""
    parser = argparse.ArgumentParser(
        prog="python -m lmtier.testing.tinymodel",
        description="Build a small random-weight Llama and its word-level tokenizer, offline, in DIR.",
    )
    parser.add_argument("dir", metavar="DIR", help="where the model goes (created; its files are overwritten)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size; query heads = hidden / 64 (default 256)")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="tokens every second layer attends to (default 0: all layers full)",
    )
    args = parser.parse_args(argv)
    try:
        out = build(args.dir, args.layers, args.hidden, args.seed, args.kv_heads, args.sliding_window)
    except ModuleNotFoundError as exc:  # torch, transformers and tokenizers come with vLLM
        parser.exit(2, f"{parser.prog}: error: {MissingDependency(exc.name or 'torch', 'vllm')}\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
