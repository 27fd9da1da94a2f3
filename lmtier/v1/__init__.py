"""Generated code of lmtier's wire contract, ``protos/lmtier/v1/cache.proto``.

Regenerate with ``scripts/gen-protos.sh``; ``tests/test_protos.py`` fails when these files
are stale against the ``.proto``. Nothing here is edited by hand.
"""
