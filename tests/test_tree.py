"""The shape of the tree, as docs/architecture.md draws it.

- The product's modules import only from their own layer or the layers below it, in
  DESIGN.md's order (foundations, then layout, keys, chunk, codec, the wire formats, tiers,
  store and transfer, configuration, the embedded API, the server and the adapters, the
  CLI on top).
- Tooling (``lmtier.demo``, ``lmtier.testing``) may use the product; the product never
  imports tooling. The one door is the CLI's ``demo`` command, which loads the demo when
  asked for it.
- Every file is at most 450 lines (the product, its tests and benchmarks), with no
  exemption: a file a reader holds in mind.
- No import circles: no module reaches itself through imports, lazy ones included.
- Every module says its one job in a docstring at its top, and none only re-exports
  another (a package's ``__init__`` may name its package's public API).
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
        ("lmtier.errors", "lmtier.units", "lmtier.metrics", "lmtier.breaker", "lmtier.buffers", "lmtier._moved"),
    ),
    ("the KV and its format", ("lmtier.kv",)),
    ("the wire", ("lmtier.transport", "lmtier.v1")),
    ("tiers", ("lmtier.tiers",)),
    ("store and engine side", ("lmtier.store", "lmtier.engine")),
    ("configuration", ("lmtier.config",)),
    ("planning", ("lmtier.plan",)),
    ("embedded API", ("lmtier.api",)),
    ("server and adapters", ("lmtier.server", "lmtier.connectors")),
    ("entry points", ("lmtier.cli", "lmtier.__main__", "lmtier")),
]
TOOLING = ("lmtier.demo", "lmtier.testing")
# (importing module, function) pairs allowed to reach tooling: `lmtier demo` runs the demo.
TOOLING_DOORS = {("lmtier.cli.demo", "cmd_demo")}
LONGEST = 450  # lines of a product file


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


def _product_files() -> dict[str, Path]:
    """Every product and tooling module (lmtier/, connectors/), the generated code aside."""
    return {name: path for name, path in _sources().items() if not _matches(name, "lmtier.v1")}


def _all_sources() -> list[Path]:
    """Every Python file of the tree but the generated code: the product, tooling, tests,
    benchmarks, scripts and deploy helpers."""
    files = []
    for folder in ("lmtier", "connectors", "tests", "benchmarks", "scripts", "deploy"):
        files += [p for p in (ROOT / folder).rglob("*.py") if "v1" not in p.relative_to(ROOT).parts]
    return sorted(files)


def test_no_file_is_longer_than_450_lines():
    """The product's files and everything around them (tests, benchmarks): none with an
    exemption."""
    files = _all_sources()
    assert len(files) > 150 and len(_product_files()) > 80, "no sources found: update _all_sources"
    long = sorted(
        f"{path.relative_to(ROOT)}: {n} lines" for path in files if (n := len(path.read_text().splitlines())) > LONGEST
    )
    assert not long, f"split these by responsibility (at most {LONGEST} lines):\n" + "\n".join(long)


def _import_graph() -> dict[str, set[str]]:
    modules = _product_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, _function, _line in _imports(path, modules):
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["e", "f"]]


def test_no_import_circles():
    """A circle hides which module is the lower one; lazy imports inside functions count
    too (they only postpone the circle to the first call)."""
    graph = _import_graph()
    circles = _circles(graph)
    described = [
        " <-> ".join(circle) + ": " + "; ".join(f"{a} -> {b}" for a in circle for b in sorted(graph[a]) if b in circle)
        for circle in circles
    ]
    assert not circles, "import circles:\n" + "\n".join(described)


def _defines_something(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.If | ast.Try | ast.With):
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(not (isinstance(t, ast.Name) and t.id == "__all__") for t in targets):
                return True
        if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant):
            return True  # a call made at import (a registration, a main)
    return False


def test_every_module_says_its_job_and_none_only_re_exports():
    silent, hollow = [], []
    for path in _product_files().values():
        tree = ast.parse(path.read_text())
        if path.name != "__main__.py" and not (ast.get_docstring(tree) or "").strip():
            silent.append(str(path.relative_to(ROOT)))
        if path.name not in ("__init__.py", "__main__.py") and not _defines_something(tree):
            hollow.append(str(path.relative_to(ROOT)))
    assert not silent, "modules without a docstring saying their job:\n" + "\n".join(silent)
    assert not hollow, "modules that define nothing (re-exports belong in a package's __init__):\n" + "\n".join(hollow)


def test_old_module_names_still_import_with_a_deprecation_warning(tmp_path):
    """Every module that moved in a restructuring answers to its old name for a release,
    as the same module object, and ``python -m`` runs it (the README once said
    ``python -m lmtier.tinymodel DIR``); every name that left a module whose name stayed
    is found through it, with a warning naming its new home."""
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
    from lmtier._moved import NAMES

    for old, moved in NAMES.items():
        module = importlib.import_module(old)
        for name, new in moved.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = getattr(module, name)
            assert value is getattr(importlib.import_module(new), name), (old, name)
            assert any(issubclass(w.category, DeprecationWarning) and f"{new}.{name}" in str(w.message) for w in caught)
    out = subprocess.run(
        [sys.executable, "-m", "lmtier.tinymodel", str(tmp_path / "model")], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lmtier.testing.tinymodel" in out.stderr  # the warning says where it lives now
    assert (tmp_path / "model" / "config.json").is_file()
