"""Redis tier: one value per chunk in a shared Redis or Redis Cluster, at wire speed.

    redis://[user:password@]host:6379/0        rediss:// for TLS
    unix:///run/redis.sock?db=0
    redis+cluster://h1:7000,h2:7001,h3:7002     (any reachable masters; the rest is discovered)

Options: ``prefix`` (default ``lmtier:``), ``ttl`` (seconds, 0 = none), ``timeout``
(seconds without progress on one call before it fails, default 2), ``connect_timeout``
(default 1), ``pool`` (connections per node, default 4), ``user`` / ``password`` (or in
the URL), ``db``, ``tls_ca`` / ``tls_cert`` / ``tls_key`` / ``tls_verify``, ``name``.

Each chunk is one Redis value, the codec's frame (preamble, header, payload), under
``prefix + hex(key)``. Chunk keys already carry the namespace (model, layout, ranks, tenant):
one Redis serves many models and tenants without collisions.

Speed. redis-py joins header and payload into one ``bytes`` before sending and builds a
new ``bytes`` for every reply: two copies per value. This tier speaks RESP itself on
plain sockets: a SET goes out with ``sendmsg`` of the command header, the frame's own
buffers (views of the chunk, never joined) and CRLF; a GET reply is read with
``recv_into`` straight into a reused, pooled buffer that the returned chunk is a view of.
Batches are pipelined (one round trip per node and connection) and a large batch is
spread over up to ``pool`` connections in parallel. ``benchmarks/bench_redis_tier.py``
measures this against redis-py's own pipeline on the same work, in the same run.
redis-py is used for what it does well and this package does not redo: the cluster key
slot function.

Eviction is Redis's own: give the server ``maxmemory`` and an eviction policy
(``allkeys-lru``); chunks it evicts are misses. A full server without eviction answers
``OOM``: the chunks are not stored and the failure is counted, nothing is raised to the
engine. Reads and lookups on a node that is down or slow fail after ``timeout`` and the
node is skipped (its chunks are misses) for a backoff that doubles up to 30 s; the
``TieredStore``'s circuit breaker does the same for the tier as a whole.

The package, bottom up, one idea a module:

    resp.py       RESP2 on one socket: commands out, replies (and values into buffers) in
    conn.py       one server: connect (TLS, AUTH, SELECT), a bounded pool, a backoff
    cluster.py    which server holds a key (CLUSTER SLOTS), keys grouped per server
    pipeline.py   the batch loop every operation shares: group, spread, pipeline, gather
    tier.py       RedisTier: contains, get, put, delete, stats
"""

from lmtier.tiers.redis.resp import ReplyError
from lmtier.tiers.redis.tier import RedisTier

__all__ = ["RedisTier", "ReplyError"]
