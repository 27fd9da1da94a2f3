"""Engine adapters, importable as ``lmtier.connectors.*``.

Each adapter is a thin layer over the engine-neutral core (``lmtier.store``,
``lmtier.keys``, ``lmtier.transfer``): it translates the engine's calls and block tables,
and holds no caching policy of its own.
"""
