"""Configuration precedence, and the tier URL registry."""

from __future__ import annotations

import json

import pytest

from lmtier.config import StoreConfig, load_config, resolve_chunk_tokens
from lmtier.errors import ConfigError, MissingDependency
from lmtier.tiers.base import TierURL, known_schemes, open_tier, register_tier


def test_defaults_are_one_gib_of_host_memory():
    cfg = load_config(env={})
    assert cfg == StoreConfig()
    assert cfg.tiers == ("cpu://?size=1GiB",)


def test_precedence_file_then_environment_then_arguments(tmp_path):
    toml = tmp_path / "lmtier.toml"
    toml.write_text('[lmtier]\ntiers = ["cpu://?size=2GiB"]\nchunk_tokens = 512\nsalt = "file"\n')
    env = {"LMTIER_CONFIG": str(toml), "LMTIER_SALT": "env", "LMTIER_UNRELATED": "x"}
    cfg = load_config(env=env)
    assert (cfg.tiers, cfg.chunk_tokens, cfg.salt) == (("cpu://?size=2GiB",), 512, "env")
    cfg = load_config(env=env, salt="arg", chunk_tokens=None)
    assert (cfg.salt, cfg.chunk_tokens) == ("arg", 512)


def test_json_files_and_whitespace_separated_tier_lists(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"tiers": ["cpu://?size=1MiB"], "write_queue": 3}))
    assert load_config(path, env={}).write_queue == 3
    cfg = load_config(env={"LMTIER_TIERS": "cpu://?size=1MiB  file:///tmp/x?size=1GiB"})
    assert cfg.tiers == ("cpu://?size=1MiB", "file:///tmp/x?size=1GiB")


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"LMTIER_CHUNK_TOKENS": "many"}, "integer"),
        ({"LMTIER_CHUNK_TOKENS": "-64"}, "positive"),
        ({"LMTIER_HASH": "md5"}, "hash"),
        ({"LMTIER_TIERS": ""}, "at least one tier"),
    ],
)
def test_bad_settings_are_refused(env, match):
    with pytest.raises(ConfigError, match=match):
        load_config(env=env)


def test_unknown_settings_in_a_file_are_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("chunk_tokenz = 3\n")
    with pytest.raises(ConfigError, match="chunk_tokenz"):
        load_config(path, env={})


def test_urls_parse_typed_options():
    url = TierURL.parse("cpu://?size=8GiB&name=a")
    assert url.typed_options({"size": int if False else str, "name": str}) == {"size": "8GiB", "name": "a"}
    with pytest.raises(ConfigError, match="given twice"):
        TierURL.parse("cpu://?size=1&size=2")
    with pytest.raises(ConfigError, match="no scheme"):
        TierURL.parse("/just/a/path")
    with pytest.raises(ConfigError, match="bad value for 'size'"):
        open_tier("cpu://?size=huge")


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(ConfigError, match="cpu"):
        open_tier("ftp://somewhere")
    assert "cpu" in known_schemes()


def test_a_missing_optional_dependency_names_the_extra():
    register_tier("needsdep", "_missing_dep_tier:Tier", extra="redis")
    with pytest.raises(MissingDependency, match=r"pip install 'lmtier\[redis\]'"):
        open_tier("needsdep://host")


def test_chunk_tokens_auto_follows_the_engine_block_and_the_kv_size():
    assert load_config(env={"LMTIER_CHUNK_TOKENS": "auto"}).chunk_tokens == 0
    assert load_config(env={}).chunk_tokens == 0  # auto is the default
    assert resolve_chunk_tokens(128, 16, 1 << 20) == 128  # configured: kept
    assert resolve_chunk_tokens(0) == 256  # no engine: 256
    assert resolve_chunk_tokens(0, 16, 128 * 1024) == 16  # Llama-3-8B, vLLM GPU block: one block is 2 MiB
    assert resolve_chunk_tokens(0, 64, 4096) == 64  # a small model: 64 x 4 KiB = 256 KiB
    assert resolve_chunk_tokens(0, 16, 1024) == 256  # tiny KV: capped at 256 tokens
    assert resolve_chunk_tokens(0, 96, 64) == 288  # the cap rounds up to whole blocks
