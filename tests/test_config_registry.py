"""Configuration precedence, the tier URL registry, and opening a configured list of tiers."""

from __future__ import annotations

import ast
import gc
import json
import os
from dataclasses import fields
from pathlib import Path

import pytest

from lmtier.config import (
    Config,
    Parser,
    ServerConfig,
    StoreConfig,
    load,
    load_config,
    load_server_config,
    public_view,
    resolve_chunk_tokens,
)
from lmtier.errors import ConfigError, MissingDependency, TierError
from lmtier.store.tiered import TieredStore
from lmtier.testing.redis_server import free_port
from lmtier.tiers.base import TierContext, TierURL, known_schemes, open_tier, register_tier
from lmtier.tiers.deferred import DeferredTier


def test_defaults_are_one_gib_of_host_memory():
    cfg = load_config(env={})
    assert cfg == StoreConfig()
    assert cfg.tiers == ("cpu://?size=1GiB",)


def test_precedence_file_then_environment_then_arguments(tmp_path):
    toml = tmp_path / "lmtier.toml"
    toml.write_text('[lmtier]\ntiers = ["cpu://?size=2GiB"]\nchunk_tokens = 512\nsalt = "file"\n')
    env = {"LMTIER_CONFIG": str(toml), "LMTIER_SALT": "env", "LMTIER_TOKEN": "not a setting"}
    cfg = load_config(env=env)
    assert (cfg.tiers, cfg.chunk_tokens, cfg.salt) == (("cpu://?size=2GiB",), 512, "env")
    cfg = load_config(env=env, salt="arg", chunk_tokens=None)
    assert (cfg.salt, cfg.chunk_tokens) == ("arg", 512)


def test_json_files_and_whitespace_separated_tier_lists(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"tiers": ["cpu://?size=4MiB"], "write_queue": 3}))
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
        ({"LMTIER_WRITE_QUEUE": "0"}, "write_queue must be at least 1"),
        ({"LMTIER_MIN_TOKENS": "512"}, "min_tokens applies to save_policy=min_tokens or reuse"),
        ({"LMTIER_SAVE_POLICY": "min_tokens"}, "save_policy=min_tokens needs min_tokens"),
    ],
)
def test_bad_settings_are_refused(env, match):
    with pytest.raises(ConfigError, match=match):
        load_config(env=env)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"LMTIER_SAVE_POLICY": "reus"}, "got 'reus' (set by save_policy: LMTIER_SAVE_POLICY in the environment)"),
        ({"LMTIER_WRITE_QUEUE": "0"}, "got 0 (set by write_queue: LMTIER_WRITE_QUEUE in the environment)"),
        ({"LMTIER_SERVER_WORKERS": "0"}, "LMTIER_SERVER_WORKERS in the environment"),
    ],
)
def test_a_setting_refused_with_others_says_where_it_was_set(env, says):
    with pytest.raises(ConfigError) as refused:
        load(env=env)
    assert says in str(refused.value)


# What the kubelet puts in every pod of a namespace with Services named lmtier and lmtier-server.
KUBERNETES_SERVICE_LINKS = {
    "LMTIER_SERVICE_HOST": "10.96.0.10",
    "LMTIER_SERVICE_PORT": "50051",
    "LMTIER_SERVICE_PORT_GRPC": "50051",
    "LMTIER_PORT": "tcp://10.96.0.10:50051",
    "LMTIER_PORT_50051_TCP": "tcp://10.96.0.10:50051",
    "LMTIER_PORT_50051_TCP_PROTO": "tcp",
    "LMTIER_PORT_50051_TCP_PORT": "50051",
    "LMTIER_PORT_50051_TCP_ADDR": "10.96.0.10",
    "LMTIER_SERVER_SERVICE_HOST": "10.96.12.34",
    "LMTIER_SERVER_SERVICE_PORT": "50051",
    "LMTIER_SERVER_SERVICE_PORT_METRICS": "9400",
    "LMTIER_SERVER_PORT": "tcp://10.96.12.34:50051",
    "LMTIER_SERVER_PORT_9400_TCP": "tcp://10.96.12.34:9400",
    "LMTIER_SERVER_PORT_9400_TCP_PROTO": "tcp",
    "LMTIER_SERVER_PORT_9400_TCP_PORT": "9400",
    "LMTIER_SERVER_PORT_9400_TCP_ADDR": "10.96.12.34",
}


def test_the_variables_kubernetes_sets_for_lmtier_services_are_not_settings():
    """A pod in a namespace with a Service named lmtier-server gets LMTIER_SERVER_PORT=tcp://...
    (enableServiceLinks): neither an error nor the server's port."""
    config = load(env=KUBERNETES_SERVICE_LINKS)
    assert config.server.port == ServerConfig().port and config.store == StoreConfig()
    assert load(env={**KUBERNETES_SERVICE_LINKS, "LMTIER_SERVER_PORT": "6000"}).server.port == 6000
    with pytest.raises(ConfigError, match="LMTIER_SERVER_PROT"):
        load(env={**KUBERNETES_SERVICE_LINKS, "LMTIER_SERVER_PROT": "6000"})


def test_unknown_settings_in_a_file_are_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("chunk_tokenz = 3\n")
    with pytest.raises(ConfigError, match="chunk_tokenz"):
        load_config(path, env={})


def test_one_yaml_file_configures_the_engine_side_and_the_server(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# tenants\ns3cret=alice\n")
    path = tmp_path / "lmtier.yaml"
    path.write_text(
        "tiers: ['cpu://?size=2GiB', 'grpc://127.0.0.1:50051']\n"
        "chunk_tokens: auto\n"
        "metrics_port: 9500\n"
        "server:\n"
        "  port: 50052\n"
        "  tiers: ['cpu://?size=1GiB']\n"
        "  max_chunk_bytes: 8MiB\n"
        "  metrics_port: 9400\n"
        f"  token_file: {tokens}\n"
    )
    env = {"LMTIER_SERVER_PORT": "50053", "LMTIER_WRITE_QUEUE": "7"}
    cfg = load(path, env=env, server={"grace": 2.5})
    assert isinstance(cfg, Config)
    assert cfg.store.tiers == ("cpu://?size=2GiB", "grpc://127.0.0.1:50051")
    assert (cfg.store.chunk_tokens, cfg.store.metrics_port, cfg.store.write_queue) == (0, 9500, 7)
    assert (cfg.server.port, cfg.server.max_chunk_bytes, cfg.server.metrics_port) == (50053, 8 << 20, 9400)
    assert cfg.server.tokens == (("s3cret", "alice"),) and cfg.server.grace == 2.5
    view = public_view(cfg)
    assert view["server"]["tokens"] == ["alice"] and "s3cret" not in json.dumps(view)
    assert load_server_config(path, env={}).port == 50052
    # a file wrapped in one "lmtier:" key reads the same
    wrapped = tmp_path / "wrapped.yml"
    wrapped.write_text("lmtier:\n  salt: x\n  server: {workers: 3}\n")
    cfg = load(wrapped, env={})
    assert (cfg.store.salt, cfg.server.workers) == ("x", 3)


@pytest.mark.parametrize(
    ("text", "env", "match"),
    [
        ("tiers: [cpu://]\nserver: {prot: 1}\n", {}, "prot"),
        ("server: {port: many}\n", {}, "port .* must be an integer"),
        ("server: {max_chunk_bytes: lots}\n", {}, "max_chunk_bytes"),
        ("write_queue: 1.5\n", {}, "write_queue"),
        ("tiers: 3\n", {}, "tiers"),
        ("server: [1, 2]\n", {}, "server"),
        ("- a list\n", {}, "mapping"),
        (": : :\n", {}, "cannot read"),
        ("", {"LMTIER_TEIRS": "cpu://"}, "LMTIER_TEIRS"),
        ("", {"LMTIER_SERVER_PORT": "-1"}, "port"),
        ("", {"LMTIER_METRICS_PORT": "70000"}, "metrics_port"),
    ],
)
def test_unknown_keys_and_bad_values_name_the_key(tmp_path, text, env, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load(path, env=env)


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


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@cache:6379/2", "redis://:***@cache:6379/2"),
        ("redis://user:pw@cache:6379?timeout=1", "redis://user:***@cache:6379?timeout=1"),
        ("rediss://user@cache", "rediss://***@cache"),
        ("grpc://cache:50051?token=t0k&timeout=2", "grpc://cache:50051?token=***&timeout=2"),
        (
            "grpcs://cache:50051?tls_key=/etc/k.pem&tls_ca=/etc/ca.pem",
            "grpcs://cache:50051?tls_key=***&tls_ca=/etc/ca.pem",
        ),
        ("redis://cache?password=pw&token_env=LMTIER_TOKEN", "redis://cache?password=***&token_env=LMTIER_TOKEN"),
        ("file:///var/lib/lmtier?size=1GiB", "file:///var/lib/lmtier?size=1GiB"),
        ("cache:6379?password=pw", "cache:6379"),
        ("redis://:PW2/SECRET@127.0.0.1:6399", "redis://:***@127.0.0.1:6399"),  # unencoded '/', '#', '?'
        ("redis://:PW3#SECRET@h:1", "redis://:***@h:1"),
        ("redis://:PW4?SECRET@h:1?timeout=1", "redis://:***@h:1?timeout=1"),
        # an '@' inside a secret option's value is not the end of user info
        ("redis://cache:6379/0?password=pa@SECRETTAIL", "redis://cache:6379/0?password=***"),
        ("grpc://cache:50051?token=ab@TOKENTAIL&timeout=1", "grpc://cache:50051?token=***&timeout=1"),
        ("redis://:pw@cache?PASSWORD=pa@x#frag", "redis://:***@cache?PASSWORD=***"),
    ],
)
def test_urls_are_shown_without_their_secrets(url, shown):
    from lmtier.tiers.base import redact_url

    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "tokens",
    [
        '{"ALICETOK": "alice", "BOBTOK": "bob"}',  # a map: its keys alone would be one tenant
        '[{"secret": "ALICETOK", "tenant": "alice"}]',  # "secret" itself would become a token
        '["ALICETOK=alice", 12345]',
    ],
)
def test_tokens_in_a_file_are_secret_equals_tenant_strings_or_a_clear_error(tmp_path, tokens):
    from lmtier.config import load
    from lmtier.errors import ConfigError

    path = tmp_path / "lmtier.json"
    path.write_text(f'{{"server": {{"tokens": {tokens}}}}}')
    with pytest.raises(ConfigError) as info:
        load(path, env={})
    assert "SECRET=TENANT" in str(info.value) and "ALICETOK" not in str(info.value)


def test_every_setting_names_its_parser():
    """How a key is parsed is declared beside its default, for every key."""
    for cls in (StoreConfig, ServerConfig):
        for f in fields(cls):
            assert isinstance(f.metadata.get("parser"), Parser), f"{cls.__name__}.{f.name} names no parser"


def test_a_rejected_setting_never_shows_a_secret(tmp_path):
    from lmtier.config import load
    from lmtier.errors import ConfigError

    path = tmp_path / "lmtier.json"
    path.write_text('{"server": {"tiers": ["redis://:YAMLPW@127.0.0.1:6379", 5]}}')
    with pytest.raises(ConfigError) as info:
        load(path, env={})
    assert "YAMLPW" not in str(info.value) and "redis://:***@127.0.0.1:6379" in str(info.value)

    with pytest.raises(ConfigError, match="host") as info:  # a URL list under any key
        load(env={}, server={"host": ["redis://:ARGPW@127.0.0.1:6379"]})
    assert "ARGPW" not in str(info.value)

    for nested in ({"a": "redis://:MAPPW@h"}, [{"a": "rediss://u:LISTPW@h"}]):  # maps of URLs, however deep
        with pytest.raises(ConfigError, match="tiers") as info:
            load(env={}, store={"tiers": nested})
        assert "MAPPW" not in str(info.value) and "LISTPW" not in str(info.value) and "***" in str(info.value)


# -- TieredStore.open: a configured list of tiers, opened whole or not at all -------------------
def held(root: Path) -> list[str]:
    """Files under ``root`` that this process holds open."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed meanwhile
            pass
    return [t for t in targets if t.startswith(f"{root}/")]


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("cpu://?sise=1MiB", r"unknown option\(s\) sise"),
        ("file://relative/path?size=1MiB", "absolute path"),
        ("ftp://somewhere", "unknown tier scheme 'ftp'"),
    ],
)
def test_a_bad_url_leaves_no_tier_open(tmp_path, bad, says):
    """A memory tier with its slab in shared memory, a disk tier, then a URL that cannot
    work: the start fails with that URL's own error, and the two tiers opened before it
    are closed: the slab's segment removed and unlocked, the disk index's files let go.
    (Garbage collection alone would do neither: the segment's lock is a bare descriptor.)"""
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    opened = []

    def opening(tier):
        if tier.scheme == "cpu":
            assert tier.shared_name  # the slab, made now, as a starting server's warm-up makes it
        opened.append(tier.scheme)
        assert held(tmp_path), f"{tier.name} holds no file: the check below would prove nothing"
        return tier

    urls = ["cpu://?size=1MiB&slot=64KiB", f"file://{disk}?size=1MiB", bad]
    with pytest.raises(ConfigError, match=says):
        TieredStore.open(urls, first=TierContext(shared_dir=str(shm)), wrap=opening)
    gc.collect()  # the slab's mapping lives as long as its tier object (leased views may use it)
    assert opened == ["cpu", "file"]
    assert held(tmp_path) == [] and os.listdir(shm) == []


def test_tiers_the_store_refuses_are_closed_too(tmp_path):
    disk = tmp_path / "disk"
    with pytest.raises(ConfigError, match="write-back needs a first tier"):
        TieredStore.open([f"file://{disk}?size=1MiB", "cpu://?size=4MiB"], write_mode="back")
    assert held(tmp_path) == []
    with TieredStore.open([f"file://{disk}?size=1MiB", "cpu://?size=4MiB"]) as store:
        assert held(tmp_path) and [t.name for t in store.tiers] == ["disk", "cpu"]


def test_unreachable_tiers_are_deferred_where_asked():
    """An engine defers every tier; a server all but the first, which it serves from."""
    down = f"redis+cluster://127.0.0.1:{free_port()}?connect_timeout=0.2&timeout=0.2"
    with TieredStore.open(["cpu://?size=4MiB", down], defer="lower") as store:
        assert isinstance(store.tiers[1], DeferredTier)
    with TieredStore.open([down, "cpu://?size=4MiB"], defer=True) as store:
        assert isinstance(store.tiers[0], DeferredTier)
    for defer in (False, "lower"):
        with pytest.raises(TierError, match="CLUSTER SLOTS"):
            TieredStore.open([down, "cpu://?size=4MiB"], defer=defer)
    with pytest.raises(ValueError, match="defer"):
        TieredStore.open(["cpu://?size=4MiB"], defer="all")


def test_the_product_opens_configured_tiers_in_one_place():
    """``open_tier`` stays public; inside lmtier only ``TieredStore.open`` calls it (or
    ``open_or_defer``, which opens it the same way or defers it), and the package's face,
    whose ``lmtier.open_tier`` forwards to one of the two."""
    root = Path(__file__).resolve().parents[1]
    callers = set()
    for path in [*(root / "lmtier").rglob("*.py"), *(root / "connectors").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node.func, "id", getattr(node.func, "attr", "")) if isinstance(node, ast.Call) else ""
            if name in ("open_tier", "open_or_defer"):
                callers.add(str(path.relative_to(root)))
    assert callers == {"lmtier/store/tiered.py", "lmtier/__init__.py"}
