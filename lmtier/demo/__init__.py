"""The demo behind ``make demo`` / ``lmtier demo``: tooling, not the product.

``vllm``: two vLLM engines on a tiny random-weight model, the second loading what the first
saved (the default). ``embedded``: the same story on the embedded API alone
(``lmtier demo --store-only``). Nothing in the product imports this package; the CLI
reaches it lazily when asked for the demo.
"""
