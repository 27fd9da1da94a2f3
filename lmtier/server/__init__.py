"""The standalone cache server (``lmtier serve``): ``app`` for the wiring, ``service`` for
the methods, ``calls`` for what every call goes through (parsing, tenant, admission,
failures as statuses), ``leases`` for memory lent to same-host clients, ``auth`` for
tenants, ``chain`` for another cache server as a tier."""

from lmtier.server.app import CacheServer, create_server, serve

__all__ = ["CacheServer", "create_server", "serve"]
