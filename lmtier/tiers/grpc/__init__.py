"""``grpc://host:port``: a client of ``lmtier serve``, the shared cache server.

    grpc://cache:50051?token=...            grpcs://cache:50051?tls_ca=/etc/lmtier/ca.crt

    tier      GrpcTier: the Tier primitives as calls to the server, typed errors, counters
    channel   Channel: one process's channel and its method callables; what failures mean
    stream    the bytes of the bulk calls: chunks into Put messages, Get messages into chunks
    memory    SharedMemory: the same-host data plane (our segment, the server's memory)
    published DirectoryReads: same-host reads through the server's published directory
    data      DataChannel: loads and saves of another host on the server's bulk data channel

Options: ``token`` (or the environment variable named by ``token_env``, default
``LMTIER_TOKEN``: keeps the secret out of config files), ``timeout`` (seconds a small call
may take; bulk calls get more in proportion to their bytes, default 5), ``retries``
(retries of a retryable failure, default 2), ``tls`` / ``tls_ca`` / ``tls_cert`` /
``tls_key`` (mutual TLS) / ``tls_server_name``, ``shm`` (``auto``, ``on``, ``off``),
``shm_size`` (default 256MiB), ``shm_dir`` (default ``/dev/shm``), ``piece`` (largest
message of a chunk's bytes), ``name``.

Failures are the store's to handle, as for every tier: a call that fails raises
``RetryableError`` when trying again may work (server restarting, overloaded, a deadline
passed, no connection) and ``TierError`` otherwise, after returning whatever the call had
received. The ``TieredStore`` retries the first kind as the tier's ``backoff`` says (built
from ``retries``), opens its circuit breaker for a server that keeps failing, and turns
what is left into misses: what the engine sees is misses, never errors. One channel per
process is reused for every call (HTTP/2 multiplexes them), made anew after ``fork``.

Same-host fast path (``lmtier.transport.shm``): with ``shm=auto`` and a server on a loopback address,
the tier creates a shared-memory segment and moves frame bytes through it, gRPC carrying
only slot references; a server on another host (it cannot see the segment) answers
``FAILED_PRECONDITION`` and the tier makes the call again over plain gRPC, trying shared
memory again a minute later. That is protocol, not failure: it stays inside the tier.
Chunks read through the segment are views of its slots (no copy), held until released.

Every frame is checked by its reader: the server when it stores, the tier when the engine
reads the chunk (lazily, while the bytes are copied into the engine's cache).
"""

from lmtier.tiers.grpc.tier import GrpcTier

__all__ = ["GrpcTier"]
