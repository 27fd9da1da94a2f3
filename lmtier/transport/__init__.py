"""The wire between a client and the cache server, beside gRPC's control calls.

    pieces       a chunk's frame cut into pieces for gRPC messages, and rebuilt, without copies
    shm          shared-memory segments: the same-host data plane (made and locked; opened by name, checked)
    directory    the published directory of a one-tenant server's memory tier (no call at all)
    datachannel  the bulk data channel's items: hello and ticket, requests, frames

Both ends use these: the ``grpc://`` tier (``lmtier.tiers.grpc``) and the server
(``lmtier.server``); the memory and disk tiers use ``shm`` for a slab others can map.
"""
