"""The object store of the peer benchmark (bench_peer.py's ``s3`` backend): one SeaweedFS
both systems write to, lmtier path-style under its own prefix, LMCache virtual-hosted.

LMCache 0.5.6's S3 adapter takes only a virtual-hosted endpoint (``bucket.host``, the Host
header its requests are signed and routed by), so the bucket needs a host name of its own
that resolves to the loopback. ``in_hosts_namespace`` runs the benchmark again inside a
mount namespace (root, ``unshare``) whose /etc/hosts says so: nothing outside it changes.

    in_hosts_namespace(argv)        None when the name resolves; else runs argv there, returns its exit
    start(tmp) -> S3Server          the store, answering for DOMAIN
    lmtier_url(server) / lmcache_l2(server)   each system's configuration of it
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from lmtier.testing.s3_server import ACCESS_KEY, S3_TEST_KEYS, SECRET_KEY, S3Server

DOMAIN = "s3.lmtier.test"
BUCKET = "lmtier"


def resolves() -> bool:
    try:
        return socket.gethostbyname(f"{BUCKET}.{DOMAIN}") == "127.0.0.1"
    except OSError:
        return False


def in_hosts_namespace(argv: list[str]) -> int | None:
    if resolves():
        return None
    if os.geteuid() != 0 or not shutil.which("unshare"):
        raise SystemExit(
            f"the s3 backend needs {BUCKET}.{DOMAIN} to resolve to 127.0.0.1 (LMCache's adapter is "
            "virtual-hosted only): run as root (a mount namespace of its own is made) or add it to /etc/hosts"
        )
    hosts = Path(os.environ.get("TMPDIR", "/tmp")) / f"lmtier-peer-hosts-{os.getpid()}"
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {DOMAIN} {BUCKET}.{DOMAIN}\n")
    inner = f'mount --bind "{hosts}" /etc/hosts && exec "$0" "$@"'
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", inner, sys.executable, *argv], check=False).returncode
    finally:
        hosts.unlink(missing_ok=True)


def start(tmp: Path) -> S3Server:
    os.environ.update(S3_TEST_KEYS)  # lmtier's engines read them through the AWS chain
    return S3Server.start(tmp / "s3", bucket=BUCKET, domain=DOMAIN)


def lmtier_url(server: S3Server) -> str:
    return server.url("lmtier-peer", size="8GiB", relist=0)


def lmcache_l2(server: S3Server) -> dict:
    """LMCache's S3 adapter: virtual-hosted, no TLS on loopback, the store's keys (its other
    way to credentials, boto3, is not in its environment), no HTTP/2 (TLS only)."""
    return {
        "type": "s3",
        "s3_endpoint": f"{BUCKET}.{DOMAIN}:{server.port}",
        "s3_region": "us-east-1",
        "disable_tls": True,
        "s3_prefer_http2": False,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
        "max_capacity_gb": 8,
    }
