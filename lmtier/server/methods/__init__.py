"""The cache server's gRPC methods by family, composed into ``CacheService``
(``lmtier.server.service``).

    checks   RequestChecks: what every method checks first (keys, tenant scope, a segment's region)
    reads    Lookup, Get (frames, or regions of shared memory), Release, Directory
    saves    Put: frames in, landed in place in the memory tier where a segment carries them
    control  Delete, List, Match, Stats, OpenData: small calls about what is held
"""
