"""`lmtier size`: the figures users check against published model cards."""

from __future__ import annotations

import json

import pytest

from lmtier.cli import main
from lmtier.errors import ConfigError
from lmtier.kv.layout import KVLayout, from_hf_config, preset
from lmtier.kv.sizing import plan
from lmtier.units import parse_count, parse_size

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def size_json(capsys, *args: str) -> dict:
    assert main(["size", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("model", "per_token", "tokens", "total"),
    [
        ("llama-3-8b", 128 * KiB, "8Ki", 1 * GiB),
        ("llama-3-8b", 128 * KiB, "128Ki", 16 * GiB),
        ("llama-3-70b", 327_680, "8Ki", int(2.5 * GiB)),
        ("llama-3-70b", 320 * KiB, "128Ki", 40 * GiB),
        ("llama-3-405b", 504 * KiB, "1Ki", 504 * KiB * 1024),
        ("llama-3-70b", 320 * KiB, "100k", 100_000 * 320 * KiB),
        ("mistral-7b", 512 * KiB, "4096", 2 * GiB),
        ("llama-2-7b", 512 * KiB, "4096", 2 * GiB),
    ],
)
def test_published_figures(capsys, model, per_token, tokens, total):
    for dtype, factor in (("bf16", 1), ("fp16", 1), ("fp8", 2)):
        out = size_json(capsys, "--model", model, "--tokens", tokens, "--dtype", dtype)
        assert out["bytes_per_token"] == per_token // factor
        assert out["total_bytes"] == total // factor
        assert out["bytes_per_chunk"] == 256 * per_token // factor


def test_llama_3_70b_at_100k_tokens_is_about_32_8_gb(capsys):
    out = size_json(capsys, "--model", "llama-3-70b", "--tokens", "100000")
    assert out["total_bytes"] == 32_768_000_000
    assert round(out["total_bytes"] / 1e9, 1) == 32.8
    assert main(["size", "--model", "llama-3-70b", "--tokens", "100000"]) == 0
    assert "32.8 GB" in capsys.readouterr().out


def test_deepseek_v3_is_mla_with_one_latent_per_token(capsys):
    out = size_json(capsys, "--model", "deepseek-v3", "--tokens", "128k")
    assert out["attention"] == "MLA"
    assert out["bytes_per_token"] == 61 * 576 * 2
    assert out["layout"]["mla"] is True


def test_batch_and_tier_capacities(capsys):
    out = size_json(
        capsys,
        "--model",
        "llama-3-70b",
        "--tokens",
        "128Ki",
        "--batch",
        "4",
        "--cpu",
        "64GiB",
        "--disk",
        "2TiB",
        "--chunk-tokens",
        "512",
    )
    assert out["total_bytes"] == 4 * 40 * GiB
    assert out["bytes_per_chunk"] == 512 * 320 * KiB
    cpu, disk = out["tiers"]
    assert (cpu["name"], cpu["capacity_bytes"]) == ("cpu", 64 * GiB)
    assert cpu["chunks"] == 64 * GiB // (512 * 320 * KiB) == 409
    assert cpu["tokens"] == 409 * 512
    assert cpu["contexts"] == 1
    assert disk["contexts"] == 2 * 1024 // 40  # 51 full 128k contexts in 2 TiB
    assert cpu["requests"] is None and disk["requests"] is None


def test_an_object_store_tier_says_what_a_context_costs_in_requests(capsys):
    out = size_json(capsys, "--model", "llama-3-8b", "--tokens", "128K", "--s3", "50TiB")
    (s3,) = out["tiers"]
    # 32 MiB chunks in 8 MiB parts: 4 ranged GETs each, a multipart upload of 4 parts + 2 each
    assert out["bytes_per_chunk"] == 32 * MiB and s3["chunks"] == 50 * 1024 * 1024 // 32
    assert s3["requests"] == {"gets_per_context": 512 * 4, "puts_per_context": 512 * 6, "gets_per_gb": 119}
    small = size_json(capsys, "--model", "llama-3-8b", "--tokens", "4096", "--chunk-tokens", "4", "--s3", "1TiB")
    assert small["bytes_per_chunk"] == 512 * KiB  # one GET and one PUT per chunk
    assert small["tiers"][0]["requests"] == {"gets_per_context": 1024, "puts_per_context": 1024, "gets_per_gb": 1907}
    main(["size", "--model", "llama-3-8b", "--tokens", "4096", "--chunk-tokens", "4", "--s3", "1TiB"])
    assert "cost more in requests than in bytes" in capsys.readouterr().out


def test_text_output_names_every_figure(capsys):
    assert main(["size", "--model", "llama-3-8b", "--tokens", "8Ki", "--cpu", "8GiB"]) == 0
    text = capsys.readouterr().out
    for fragment in ("128 KiB", "131,072 B", "1 GiB", "8,192 tokens", "tier cpu", "65,536 tokens"):
        assert fragment in text


@pytest.mark.parametrize(
    ("config", "layers", "kv_heads", "head_dim", "mla"),
    [
        (
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "torch_dtype": "bfloat16",
            },
            32,
            8,
            128,
            False,
        ),
        ({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}, 32, 32, 128, False),
        (
            {
                "num_hidden_layers": 28,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "hidden_size": 1024,
            },
            28,
            8,
            128,
            False,
        ),
        (
            {
                "num_hidden_layers": 61,
                "num_attention_heads": 128,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "hidden_size": 7168,
            },
            61,
            1,
            576,
            True,
        ),
        (
            {
                "architectures": ["X"],
                "text_config": {
                    "num_hidden_layers": 4,
                    "num_attention_heads": 8,
                    "num_key_value_heads": 2,
                    "hidden_size": 512,
                },
            },
            4,
            2,
            64,
            False,
        ),
    ],
)
def test_hugging_face_configs(tmp_path, capsys, config, layers, kv_heads, head_dim, mla):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    layout = from_hf_config(path)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.mla) == (layers, kv_heads, head_dim, mla)
    out = size_json(capsys, "--config", str(path), "--tokens", "1k")
    assert out["bytes_per_token"] == layers * (1 if mla else 2) * kv_heads * head_dim * 2


def test_llama_3_8b_config_matches_the_preset(tmp_path):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert from_hf_config(cfg) == preset("llama-3-8b")


def test_clear_errors(tmp_path, capsys):
    assert main(["size", "--model", "no-such-model", "--tokens", "1k"]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    assert main(["size", "--model", "llama-3-8b", "--tokens", "lots"]) == 2
    assert "cannot parse count" in capsys.readouterr().err
    (tmp_path / "c.json").write_text('{"hidden_size": 5}')
    assert main(["size", "--config", str(tmp_path / "c.json"), "--tokens", "1k"]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        parse_size("12 parsecs")


def test_units():
    assert parse_size("8GiB") == 8 * GiB
    assert parse_size("500GB") == 500 * 10**9
    assert parse_size("1.5MiB") == 3 * 512 * KiB
    assert parse_count("100000") == 100_000


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("100k", 100_000),  # lowercase: decimal
        ("128k", 128_000),
        ("128K", 131_072),  # uppercase: binary, as vLLM's --max-model-len 128K
        ("8K", 8_192),
        ("1.5k", 1_500),
        ("1M", 1_048_576),
        ("2m", 2_000_000),
        ("1G", 1024**3),
        ("128Ki", 131_072),
        ("8ki", 8_192),
        ("1Mi", 1_048_576),
        ("100000", 100_000),
    ],
)
def test_token_counts_read_as_vllm_reads_max_model_len(capsys, text, tokens):
    """vLLM's own parser is the reference: one context length, one number in both commands."""
    from vllm.utils.argparse_utils import human_readable_int

    if text[-1] not in "iI":
        assert human_readable_int(text) == tokens
    assert parse_count(text) == tokens
    assert size_json(capsys, "--model", "llama-3-8b", "--tokens", text)["tokens"] == tokens


def test_byte_sizes_keep_their_units_and_counts_take_no_bytes(capsys):
    assert (parse_size("1k"), parse_size("1KB"), parse_size("1KiB"), parse_size("1Ki")) == (1000, 1000, 1024, 1024)
    assert parse_size("2TiB") == 2 * 1024**4 and parse_size("2TB") == 2 * 10**12
    assert main(["size", "--model", "llama-3-8b", "--tokens", "8KiB"]) == 2
    assert "k, m, g (powers of 1000), K, M, G or Ki, Mi, Gi (powers of 1024)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("heads", "kv_heads", "kind"),
    [(64, 8, "GQA"), (16, 2, "GQA"), (32, 32, "MHA"), (32, None, "MHA"), (32, 1, "MQA"), (1, 1, "MHA")],
)
def test_size_names_the_attention_of_a_hugging_face_config(tmp_path, capsys, heads, kv_heads, kind):
    config = {"num_hidden_layers": 4, "num_attention_heads": heads, "hidden_size": 64 * heads}
    if kv_heads:
        config["num_key_value_heads"] = kv_heads
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert size_json(capsys, "--config", str(path), "--tokens", "1k")["attention"] == kind
    assert main(["size", "--config", str(path), "--tokens", "1k"]) == 0
    assert f"head dim ({kind})" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(
    ("model", "kind"), [("llama-3-70b", "GQA"), ("qwen2.5-7b", "GQA"), ("llama-2-7b", "MHA"), ("deepseek-v3", "MLA")]
)
def test_size_names_the_attention_of_a_preset(capsys, model, kind):
    assert size_json(capsys, "--model", model, "--tokens", "1k")["attention"] == kind
    assert preset(model).attention == kind and f"({kind})" in preset(model).describe()


def test_a_layout_without_query_heads_names_no_attention_kind():
    """A stored chunk's layout has its KV heads only: 8 of them are MHA or GQA, no telling."""
    stored = KVLayout(80, 8, 128)
    assert stored.attention is None
    assert stored.describe() == "80 layers x 8 KV heads x 128 head dim, bfloat16"
    assert stored.describe("GQA") == "80 layers x 8 KV heads x 128 head dim (GQA), bfloat16"
    assert KVLayout(4, 1, 64).attention is None  # one KV head: MQA, or one rank's share of GQA
    assert KVLayout(61, 1, 576, mla=True).attention == "MLA"


def test_plan_of_a_tensor_parallel_rank():
    layout = preset("llama-3-70b").shard(8)
    assert layout.num_kv_heads == 1
    assert plan("x", layout, 1024).bytes_per_token == 320 * KiB // 8
    assert KVLayout(4, 2, 8).shard(4).num_kv_heads == 1  # fewer heads than ranks: replicated


def test_128K_is_the_well_known_tables_40_gib_for_llama_3_70b(capsys):
    """``--tokens 128K`` is vLLM's ``--max-model-len 128K``: 131,072 tokens, 40 GiB of
    KV for Llama-3-70B in bfloat16 (80 layers x 8 KV heads x 128 x 2 x 2 B per token)."""
    assert main(["size", "--model", "llama-3-70b", "--tokens", "128K"]) == 0
    context = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("context"))
    assert context.split()[1:3] == ["40", "GiB"] and "131,072 tokens" in context
