"""The import layering of python/pagellm (docs/structure.md), read from the source with `ast`:
nothing is imported, so it runs without the C++ extension.

Every `import` / `from ... import` counts, at module level or inside a function (a lazy import
still ties the two modules together). An edge goes to the module named: `from pagellm.x import y`
is an edge to `pagellm.x.y` when that is a module, else to `pagellm.x`; a parent package's
`__init__` is not counted as imported too, and string imports (`importlib.import_module`) are not
seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

PYTHON_ROOT = Path(__file__).resolve().parents[1] / "python"
COMPILED_MODULES = {"pagellm._C"}  # no .py source, still a module an edge can name
KERNEL_MODULES = ("pagellm._C", "pagellm.ops")  # models reach these only through pagellm.layers

# (importer, imported) edges that break a rule below and are to be fixed; the lead empties this list.
# test_known_violations_are_still_real fails once one is fixed, so the entry is removed with the fix.
KNOWN_VIOLATIONS_TO_REMOVE: list[tuple[str, str]] = [
]


def _source_modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, is a package)."""
    modules = {}
    for path in sorted((PYTHON_ROOT / "pagellm").rglob("*.py")):
        parts = list(path.relative_to(PYTHON_ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imported_modules(name: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The pagellm modules one module imports, anywhere in its source."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from ..x import y` inside package a.b -> a.x
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in known else module)
    return {m for m in found if _is_under(m, "pagellm") and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _source_modules()
    known = set(modules) | COMPILED_MODULES
    return {name: _imported_modules(name, path, is_pkg, known) for name, (path, is_pkg) in modules.items()}


def _without_known_violations(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: deps - {dst for src, dst in KNOWN_VIOLATIONS_TO_REMOVE if src == m} for m, deps in graph.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_through(graph, set(c), min(c)) for c in components]


def _cycle_through(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside one strongly connected component."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is not on a cycle")


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


# ---------------------------------------------------------------------------- the rules
def test_no_import_cycles():
    cycles = find_cycles(_without_known_violations(import_graph()))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_engine_does_not_import_models():
    graph = _without_known_violations(import_graph())
    bad = [(m, d) for m, deps in graph.items() if _is_under(m, "pagellm.engine")
           for d in sorted(deps) if _is_under(d, "pagellm.models")]
    assert not bad, "pagellm.engine imports pagellm.models (go through pagellm.model_loader):\n" + "\n".join(
        f"{m} -> {d}" for m, d in bad)


def test_models_do_not_import_kernels():
    graph = _without_known_violations(import_graph())
    bad = [(m, d) for m, deps in graph.items() if _is_under(m, "pagellm.models")
           for d in sorted(deps) if any(_is_under(d, k) for k in KERNEL_MODULES)]
    assert not bad, "models import kernel modules directly (go through pagellm.layers):\n" + "\n".join(
        f"{m} -> {d}" for m, d in bad)


def test_openai_server_never_reaches_the_serve_command():
    """serve.py builds the app from api_server; nothing under entrypoints/openai imports serve back."""
    graph = import_graph()
    for module in graph:
        if _is_under(module, "pagellm.entrypoints.openai"):
            assert "pagellm.entrypoints.serve" not in _reachable(graph, module), module


def test_known_violations_are_still_real():
    graph = import_graph()
    fixed = [(src, dst) for src, dst in KNOWN_VIOLATIONS_TO_REMOVE if dst not in graph.get(src, set())]
    assert not fixed, f"fixed, remove from KNOWN_VIOLATIONS_TO_REMOVE: {fixed}"


# ---------------------------------------------------------------------------- the checker itself
def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_lazy_and_relative_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from pagellm import _C\n    from . import y\n    import pagellm.z.w\n")
    known = {"pagellm._C", "pagellm.x.y"}
    assert _imported_modules("pagellm.x.m", src, False, known) == {"pagellm._C", "pagellm.x.y", "pagellm.z.w"}
