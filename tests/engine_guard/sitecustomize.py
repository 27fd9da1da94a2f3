"""Put on the PYTHONPATH of ``make check`` (tests that need no engine): a process that
starts a vLLM engine fails at once, saying so, so that a test that starts one without the
``engine`` mark cannot slip into the inner loop unseen.

vLLM's configuration, scheduler and connector API import freely (the connector's unit
tests build them in-process); what an engine needs beyond them, its engine core (for
``vllm.LLM`` and ``vllm serve`` alike), is what cannot be imported.
"""

import importlib.abc
import sys

ENGINE_MODULES = ("vllm.v1.engine.core", "vllm.v1.engine.core_client")


class _NoEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ENGINE_MODULES:
            raise ImportError(
                f"{name}: `make check` starts no vLLM engine; a test that needs one carries "
                "@pytest.mark.engine (`make test` runs it)",
                name=name,
            )
        return None


sys.meta_path.insert(0, _NoEngine())
