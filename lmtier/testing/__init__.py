"""Fixtures for tests that run real components: tooling, not the product.

    redis_server   throwaway ``redis-server`` processes, free ports, ``redis-cli``
    redis_cluster  a Redis Cluster with replicas, each node on a host of its own where the
                   machine allows it, and what an operator does to one (kill, cut, reshard)
    netns          hosts in network namespaces: a pair on a shaped link, or many on a switch
    slow_link      a TCP forwarder that holds what a client sends (a far-away tier)
    cache_server   an ``lmtier serve`` in a child process, waited on until it is SERVING
    certs          a throwaway CA, server and client certificates (openssl)
    engine         a vLLM engine in a child process running a scripted scenario
    enginefork     the tests' engines forked from one process that imported vLLM once
    vllm_serve     ``vllm serve`` in a child process, asked for greedy completions
    layouts        synthetic paged KV caches laid out as vLLM lays them out (no vLLM needed)
    tinymodel      a small random-weight Llama (model and tokenizer) for engine tests

lmtier's own tests and benchmarks use them, and so can a user's: like redis-py's and
grpc's test helpers they start the real thing, never a mock. Nothing in the product imports
this package (``tests/test_tree.py`` checks).
"""
