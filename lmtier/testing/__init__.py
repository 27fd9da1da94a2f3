"""Fixtures for tests that run real components: tooling, not the product.

    redis_server   throwaway ``redis-server`` processes and Redis Clusters
    cache_server   an ``lmtier serve`` in a child process, waited on until it is SERVING
    certs          a throwaway CA, server and client certificates (openssl)
    engine         a vLLM engine in a child process running a scripted scenario
    tinymodel      a small random-weight Llama (model and tokenizer) for engine tests

lmtier's own tests and benchmarks use them, and so can a user's: like redis-py's and
grpc's test helpers they start the real thing, never a mock. Nothing in the product imports
this package (``tests/test_tree.py`` checks).
"""
