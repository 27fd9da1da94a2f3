"""Throwaway certificates for tests and benchmarks: a CA, a server certificate for
127.0.0.1 / localhost, and client certificates whose common name is a tenant (needs
``openssl``)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _signed(directory: Path, name: str, subject: str, paths: dict[str, str], extfile: str | None = None) -> None:
    key, csr, crt = (str(directory / f"{name}.{ext}") for ext in ("key", "csr", "crt"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", key, "-out", csr)
    args = ["x509", "-req", "-in", csr, "-CA", paths["ca.crt"], "-CAkey", paths["ca.key"], "-CAcreateserial"]
    args += ["-days", "2", "-out", crt]
    if extfile:
        args += ["-extfile", extfile]
    _openssl(*args)
    paths[f"{name}.key"], paths[f"{name}.crt"] = key, crt


def make_certificates(
    directory: Path, clients: Sequence[str] = (), alt_names: dict[str, str] | None = None
) -> dict[str, str]:
    """Paths of ``ca.crt``, ``ca.key``, ``server.crt``, ``server.key`` and, per client
    name, ``client-NAME.crt`` / ``client-NAME.key`` (common name NAME). ``alt_names``:
    clients with no common name, only subject alternative names (``{"spiffe":
    "URI:spiffe://example.org/ns/a/sa/b"}``: ``client-spiffe.crt``), as SPIFFE/SPIRE and
    cert-manager issue them."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"ca.crt": str(directory / "ca.crt"), "ca.key": str(directory / "ca.key")}
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=lmtier-test-ca",
        "-keyout",
        paths["ca.key"],
        "-out",
        paths["ca.crt"],
    )
    _signed(directory, "server", "/CN=localhost", paths, str(ext))
    for name in clients:
        _signed(directory, f"client-{name}", f"/CN={name}", paths)
    for name, alt in (alt_names or {}).items():
        extfile = directory / f"ext-{name}.cnf"
        extfile.write_text(f"subjectAltName={alt}\n")
        _signed(directory, f"client-{name}", "/O=lmtier-test", paths, str(extfile))
    return paths
