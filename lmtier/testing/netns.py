"""Two hosts on one machine: network namespaces joined by a veth pair (iproute2), for tests
and benchmarks of what crosses a network.

    reason = unavailable()              why namespaces cannot be made here (None: they can)
    with HostPair(rate="10gbit") as net:
        net.server_ip, net.client_ip    the two ends' addresses
        net.run("server", argv)         a process inside the server's namespace (Popen)
        net.call("client", argv)        run one to its end inside the client's (CompletedProcess)
        net.down() / net.up()           cut the link / bring it back
    with Switch() as net:               hosts on one switch, each in a namespace of its own
        ns, ip = net.add_host()         a new host: its namespace and address
        net.command(ns, argv)           argv, to run inside it
        net.cut(ns) / net.mend(ns)      take the host off the network / put it back

Each ``HostPair`` end's link is shaped by ``tc``'s token bucket filter (``tbf``) when ``rate`` is given,
so that the link, not the memory bus, is the ceiling (veth alone moves bytes at memory
speed). Names are random, and everything made is removed on ``close`` (and at exit).
Making namespaces needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip``.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence

IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces joined by veth (None: it can)."""
    if not os.path.exists(IP):
        return "iproute2's ip is not installed"
    name = f"lmt-probe-{secrets.token_hex(3)}"
    try:
        _sh(IP, "netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"cannot make a network namespace ({detail.strip()}): needs root or CAP_SYS_ADMIN"
    try:
        _sh(IP, "link", "add", f"{name[-6:]}a", "type", "veth", "peer", "name", f"{name[-6:]}b", "netns", name)
        _sh(IP, "link", "del", f"{name[-6:]}a")
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot make a veth pair: {getattr(exc, 'stderr', exc)}"
    finally:
        subprocess.run([IP, "netns", "del", name], capture_output=True, timeout=30)
    return None


class HostPair:
    """A server namespace and a client namespace, one veth link between them."""

    def __init__(self, rate: str | None = "10gbit", subnet: int | None = None) -> None:
        tag = secrets.token_hex(3)
        self.ns = {"server": f"lmt-s-{tag}", "client": f"lmt-c-{tag}"}
        self.links = {"server": f"lmts{tag}", "client": f"lmtc{tag}"}
        octet = subnet if subnet is not None else 16 + secrets.randbelow(200)
        self.server_ip, self.client_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
        self.rate = rate
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        for ns in self.ns.values():
            _sh(IP, "netns", "add", ns)
        s, c = self.links["server"], self.links["client"]
        _sh(IP, "link", "add", s, "netns", self.ns["server"], "type", "veth", "peer", "name", c, "netns",
            self.ns["client"])  # fmt: skip
        for end, ip in (("server", self.server_ip), ("client", self.client_ip)):
            ns, link = self.ns[end], self.links[end]
            _sh(IP, "-n", ns, "addr", "add", f"{ip}/30", "dev", link)
            _sh(IP, "-n", ns, "link", "set", link, "up")
            _sh(IP, "-n", ns, "link", "set", "lo", "up")
            if self.rate:
                _sh(IP, "netns", "exec", ns, TC, "qdisc", "add", "dev", link, "root", "tbf", "rate", self.rate,
                    "burst", "4mb", "latency", "50ms")  # fmt: skip

    def command(self, end: str, argv: Sequence[str]) -> list[str]:
        return [IP, "netns", "exec", self.ns[end], *argv]

    def run(self, end: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(end, argv), **kw)
        self._procs.append(proc)
        return proc

    def call(self, end: str, argv: Sequence[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(end, argv), timeout=timeout, **kw)

    def down(self) -> None:
        _sh(IP, "-n", self.ns["server"], "link", "set", self.links["server"], "down")

    def up(self) -> None:
        _sh(IP, "-n", self.ns["server"], "link", "set", self.links["server"], "up")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for ns in self.ns.values():  # the veth pair goes with its namespaces
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=30)

    def __enter__(self) -> HostPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sweep() -> None:
    """Remove the namespaces of switches whose process is gone (killed before ``close``)."""
    listed = subprocess.run([IP, "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listed.splitlines():
        found = re.fullmatch(r"(lmt-[wh]\d*-(\d+)-[0-9a-f]{6})", line.split(" ")[0])
        if found and not os.path.exists(f"/proc/{found.group(2)}"):
            subprocess.run([IP, "netns", "del", found.group(1)], capture_output=True, timeout=30)


class Switch:
    """Hosts on one switch: each host a network namespace with one veth into a bridge, the
    bridge in a namespace of its own, and this process on the switch through one more veth
    (``ip``: its address). Unshaped: veth moves bytes at memory speed. The namespaces'
    names carry the creating process's id: a new switch removes those of one killed
    before it could close its own."""

    def __init__(self, subnet: int | None = None) -> None:
        _sweep()
        tag = secrets.token_hex(3)
        self.tag, self.ns = tag, f"lmt-w-{os.getpid()}-{tag}"
        octet = subnet if subnet is not None else 16 + secrets.randbelow(200)
        self.prefix = f"10.214.{octet}."
        self.ip = self.prefix + "254"
        self.hosts: list[str] = []
        self._closed = False
        atexit.register(self.close)
        try:
            _sh(IP, "netns", "add", self.ns)
            _sh(IP, "-n", self.ns, "link", "add", "br0", "type", "bridge")
            _sh(IP, "-n", self.ns, "link", "set", "br0", "up")
            self._plug(None, f"lmtw{tag}", "up0")
            _sh(IP, "addr", "add", f"{self.ip}/24", "dev", f"lmtw{tag}")
            _sh(IP, "link", "set", f"lmtw{tag}", "up")
        except BaseException:
            self.close()
            raise

    def _plug(self, ns: str | None, end: str, port: str) -> None:
        """A veth pair: ``end`` in ``ns`` (None: this namespace), ``port`` on the bridge."""
        where = ["-n", ns] if ns else []
        _sh(IP, *where, "link", "add", end, "type", "veth", "peer", "name", port, "netns", self.ns)
        _sh(IP, "-n", self.ns, "link", "set", port, "master", "br0")
        _sh(IP, "-n", self.ns, "link", "set", port, "up")

    def add_host(self) -> tuple[str, str]:
        """A new host on the switch: (its namespace, its address)."""
        if len(self.hosts) >= 200:
            raise RuntimeError("a switch holds 200 hosts")
        n = len(self.hosts) + 1
        ns = f"lmt-h{n}-{os.getpid()}-{self.tag}"
        _sh(IP, "netns", "add", ns)
        self.hosts.append(ns)
        self._plug(ns, "eth0", f"p{n}")
        _sh(IP, "-n", ns, "addr", "add", f"{self.prefix}{n}/24", "dev", "eth0")
        _sh(IP, "-n", ns, "link", "set", "eth0", "up")
        _sh(IP, "-n", ns, "link", "set", "lo", "up")
        return ns, f"{self.prefix}{n}"

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        return [IP, "netns", "exec", ns, *argv]

    def cut(self, ns: str) -> None:
        """The host's link down: what it sends and what is sent to it goes nowhere, as for
        a host whose switch port or cable failed (its processes live on)."""
        _sh(IP, "-n", ns, "link", "set", "eth0", "down")

    def mend(self, ns: str) -> None:
        _sh(IP, "-n", ns, "link", "set", "eth0", "up")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ns in [*self.hosts, self.ns]:  # each veth goes with its namespace
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=30)

    def __enter__(self) -> Switch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
