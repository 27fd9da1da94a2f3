"""Wait while lmtier clients in other containers still hold a shared-memory segment here.

The sidecar's preStop hook (k8s/sidecar/deployment.yaml). On a pod's deletion the kubelet
sends SIGTERM to the engine at once, while this runs in the sidecar: the engine drains its
requests, then lmtier's connector flushes its last saves, through the sidecar. The sidecar
must outlive those writes. Each client (each engine process with a ``grpc://`` tier on
loopback) holds a shared lock on its segment in ``/dev/shm`` for as long as it lives, and
the kernel drops the lock when the process ends: so this waits until no segment is held
by anyone but the server itself, or until ``--timeout`` seconds. The server's own segments
(its memory tier's slab) are those it holds a lock on, which /proc/<pid>/fdinfo shows; it
also has its clients' segments open (mapped, while they send it chunks), without a lock.
The engine, in another container, has another PID namespace: its processes are not in
this /proc, but their locks are on the shared files.

    python await_clients.py [--shm-dir /dev/shm] [--server-pid 1] [--timeout 60]

Exit status 0 whatever happened: a preStop hook that fails only delays the SIGTERM it
precedes; this one's worst case is its timeout (also what it waits where /proc does not
show the server's files: then it is a sleep of ``--timeout`` seconds).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lmtier.transport import shm


def locked_files(pid: int) -> set[str]:
    """The paths ``pid`` holds a file lock on, through one of its descriptors (empty if
    /proc does not say): a locked descriptor's fdinfo has a ``lock:`` line."""
    fds = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fds)
    except OSError:
        return set()
    paths = set()
    for fd in names:
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                if "lock:" in info.read():
                    paths.add(os.readlink(os.path.join(fds, fd)))
        except OSError:  # closed since the listing
            continue
    return paths


def clients(shm_dir: str, server_pid: int) -> list[str]:
    """Segments in ``shm_dir`` that a live process other than the server holds."""
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    own = locked_files(server_pid)
    return [n for n in names if os.path.join(shm_dir, n) not in own and shm.alive(shm_dir, n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--shm-dir", default=shm.DEFAULT_DIR)
    p.add_argument("--server-pid", type=int, default=1, help="the server's process (PID 1 of the sidecar)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait at most")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between looks")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    held = clients(args.shm_dir, args.server_pid)
    if held:
        print(f"waiting for {len(held)} client segment(s) in {args.shm_dir}", flush=True)
    while held and time.monotonic() < deadline:
        time.sleep(args.interval)
        held = clients(args.shm_dir, args.server_pid)
    print(f"{len(held)} client segment(s) still held after {args.timeout:.0f} s" if held else "no client left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
