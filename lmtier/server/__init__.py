"""The standalone cache server (``lmtier serve``).

app       CacheServer, create_server, serve: the wiring, probes, metrics port, shutdown
service   CacheService: the gRPC methods (``methods/``: reads, saves, control) over a TieredStore
calls     what every call goes through: parsing, tenant, admission, failures as statuses
auth      tokens and certificates to tenants
data/     the bulk data channel, for other hosts' loads and saves
leases    server memory lent to same-host clients; ``published``: the memory tier's directory
watchdog  calls stalled on their client, or over their time, cancelled
health    the standard grpc.health.v1 service; ``match``: a prompt's held tokens, for routers
chain     another cache server as a tier, keys re-tagged per hop
budget    ReceiveBudget: the memory half-received chunks may hold, all Puts together
"""

from lmtier.server.app import CacheServer, create_server, serve

__all__ = ["CacheServer", "create_server", "serve"]
