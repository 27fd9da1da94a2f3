"""The standalone cache server (``lmtier serve``): see ``app`` for the wiring, ``service``
for the calls, ``auth`` for tenants."""

from lmtier.server.app import CacheServer, create_server, serve

__all__ = ["CacheServer", "create_server", "serve"]
