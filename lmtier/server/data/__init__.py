"""The cache server's bulk data channel: loads and saves of other hosts on a connection of
their own, beside gRPC (the wire format: ``lmtier.transport.datachannel``; the client:
``lmtier.tiers.grpc.data``).

    channel  DataChannel: the listener, tickets issued for OpenData, connections, loads
    limits   Tickets (good once, bound to a tenant) and Places (connections per source, in all)
    saves    frames read off a client's connection straight into the memory tier, paced
"""

from lmtier._moved import forward

__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)
