"""The ``lmtier`` command: ``serve``, ``stats``, ``match``, ``inspect``, ``size``, ``plan``, ``keys``, ``demo``
(and ``bench``, deprecated: it forwards to ``benchmarks/run.py``). Errors are one line on
stderr and a non-zero exit, a missing optional dependency too (named with the extra that
brings it); ``--json`` where a program reads the output. ``lmtier = "lmtier.cli:main"``.

    parser   build_parser, main: the parser of every subcommand, errors as one line and an exit status
    args     what several commands share: the model arguments, the optional-dependency check
    size     size: a model's KV memory plan
    plan     plan: a trace replayed through a fleet (lmtier.plan)
    keys     keys: a prompt's namespace and chunk keys; the engine namespaces match uses too
    reports  stats, match, inspect: what a running server or a disk tier holds
    serve    serve: the shared cache server, its flags over the config file
    demo     demo, and bench (deprecated): the commands that run tooling
"""

from lmtier._moved import forward
from lmtier.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]

__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)
