"""The shape of the tree, as docs/architecture.md draws it.

- The product's modules import only from their own layer or the layers below it, in
  DESIGN.md's order (foundations, then layout, keys, chunk, codec, the wire formats, tiers,
  store and transfer, configuration, the embedded API, the server and the adapters, the
  CLI on top).
- Tooling (``lmtier.demo``, ``lmtier.testing``) may use the product; the product never
  imports tooling. The one door is the CLI's ``demo`` command, which loads the demo when
  asked for it.
- No source file is longer than about 400 lines unless it says at its top why.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module belongs to the first layer with a prefix of its name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundations",
        (
            "lmtier.errors",
            "lmtier.units",
            "lmtier.metrics",
            "lmtier.breaker",
            "lmtier.buffers",
            "lmtier.admission",
            "lmtier.fairqueue",
        ),
    ),
    ("layout", ("lmtier.layout",)),
    ("keys", ("lmtier.keys",)),
    ("chunk", ("lmtier.chunk",)),
    ("codec", ("lmtier.codec",)),
    ("wire formats", ("lmtier.shm", "lmtier.directory", "lmtier.pieces", "lmtier.datachannel", "lmtier.v1")),
    ("tiers", ("lmtier.tiers",)),
    (
        "store and transfer",
        ("lmtier.events", "lmtier.store", "lmtier.transfer", "lmtier.layerload", "lmtier.devicecopy"),
    ),
    ("configuration", ("lmtier.config", "lmtier.sizing")),
    ("embedded API", ("lmtier.api",)),
    ("server and adapters", ("lmtier.server", "lmtier.connectors")),
    ("entry points", ("lmtier.cli", "lmtier.__main__", "lmtier._moved", "lmtier")),
]
TOOLING = ("lmtier.demo", "lmtier.testing")
# (importing module, function) pairs allowed to reach tooling: `lmtier demo` runs the demo.
TOOLING_DOORS = {("lmtier.cli", "cmd_demo")}
LONG = 420  # "about 400 lines"
LONG_REASON = "Longer than 400 lines:"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "connectors":
        parts.insert(0, "lmtier")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*(ROOT / "lmtier").rglob("*.py"), *(ROOT / "connectors").rglob("*.py")]
    return {_module_name(p): p for p in files}


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or (prefix != "lmtier" and name.startswith(prefix + "."))


def _layer(name: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(_matches(name, p) for p in prefixes):
            return i
    raise AssertionError(f"module {name} is in no layer of tests/test_tree.py: place it")


def _is_tooling(name: str) -> bool:
    return any(_matches(name, p) for p in TOOLING)


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported lmtier module, enclosing function or "", line) for every import in a file,
    at module level or inside functions (lazy imports count too)."""
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Import):
                found.extend((a.name, function, child.lineno) for a in child.names if a.name.startswith("lmtier"))
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("lmtier"):
                for alias in child.names:  # `from lmtier import codec` names a module
                    sub = f"{child.module}.{alias.name}"
                    found.append((sub if sub in modules else child.module, function, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text()), "")
    return found


def test_every_product_module_imports_only_its_layer_or_below():
    modules = _sources()
    wrong = []
    for name, path in sorted(modules.items()):
        if _is_tooling(name):
            continue
        mine = _layer(name)
        for target, _function, line in _imports(path, modules):
            if _is_tooling(target):
                continue  # the next test's business
            if _layer(target) > mine:
                where, above = LAYERS[mine][0], LAYERS[_layer(target)][0]
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({where}) imports {target} ({above})")
    assert not wrong, "imports from a layer above:\n" + "\n".join(wrong)


def test_the_product_never_imports_tooling():
    modules = _sources()
    assert any(_is_tooling(n) for n in modules), "the tooling packages moved: update TOOLING"
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for name, path in sorted(modules.items())
        if not _is_tooling(name)
        for target, function, line in _imports(path, modules)
        if _is_tooling(target) and (name, function) not in TOOLING_DOORS
    ]
    assert not wrong, "the product imports tooling:\n" + "\n".join(wrong)


def test_importing_the_product_loads_no_tooling():
    """What a user's process imports (the package, the server, every tier, the CLI) leaves
    the tooling packages unloaded."""
    code = (
        "import sys, lmtier, lmtier.server, lmtier.cli, lmtier.tiers.cpu, lmtier.tiers.disk, "
        "lmtier.tiers.redis, lmtier.tiers.grpc, lmtier.connectors.sglang\n"
        "print(sorted(m for m in sys.modules if m.startswith(('lmtier.demo', 'lmtier.testing'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def _source_files() -> list[Path]:
    files = []
    for folder in ("lmtier", "connectors", "benchmarks", "tests", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*.py") if "v1" not in p.relative_to(ROOT).parts]
    return sorted(files)


def test_a_long_file_says_why_at_its_top():
    files = _source_files()
    assert len(files) > 50, "no sources found: update _source_files"
    silent = []
    for path in files:
        lines = path.read_text().splitlines()
        if len(lines) > LONG and LONG_REASON not in "\n".join(lines[:40]):
            silent.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert not silent, f"split these or say why at the top ('{LONG_REASON} ...'):\n" + "\n".join(silent)


def test_old_module_names_still_import_with_a_deprecation_warning(tmp_path):
    """Every module that moved in the restructuring answers to its old name for a release,
    as the same module object, and ``python -m`` runs it (the README once said
    ``python -m lmtier.tinymodel DIR``)."""
    import importlib
    import warnings

    from lmtier._moved import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old
    out = subprocess.run(
        [sys.executable, "-m", "lmtier.tinymodel", str(tmp_path / "model")], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lmtier.testing.tinymodel" in out.stderr  # the warning says where it lives now
    assert (tmp_path / "model" / "config.json").is_file()
