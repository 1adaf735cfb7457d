"""The package's import graph has no cycle and no module is over 600 lines (issue 25).

The graph is built from the source (``ast``), so it sees every import: at module level and inside
functions (a lazy import hides a cycle from Python, not from the design). Rules: ``import a.b.c`` and
``from a.b import c`` (``c`` a module) depend on ``a.b.c``; ``from a.b import name`` on ``a.b``;
importing a module runs its parent packages' ``__init__`` first, so an edge to ``a.b.c`` is also one
to ``a.b`` unless that package contains the importer. Imports under ``if TYPE_CHECKING:`` are
annotations only (never executed) and are left out; so are ``__main__`` modules (entry points that
nothing imports)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "megatrain_jax"
MAX_LINES = 600


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _runtime_imports(tree: ast.AST):
    """Import nodes anywhere in the module except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}."""
    mods = modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module
                for a in node.names:
                    targets.append(f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src)
            for t in targets:
                while t and t not in mods:  # megatrain_jax.x.attr -> megatrain_jax.x; third-party -> ""
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].setdefault(t, node.lineno)
                t = t.rpartition(".")[0]
                while t and t != mod and not mod.startswith(t + "."):  # its parent packages, unless they hold it
                    graph[mod].setdefault(t, node.lineno)
                    t = t.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in graph:
        if state.get(root):
            continue
        path, iters = [root], [iter(graph[root])]
        state[root] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(graph[nxt]))
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, int]], mods: dict[str, Path]) -> str:
    return "\n".join(f"  {a} -> {b}  ({mods[a].relative_to(PKG.parent)}:{graph[a][b]})"
                     for a, b in zip(cycle, cycle[1:]))


def test_the_graph_sees_lazy_imports_and_parent_packages():
    graph = import_graph()
    assert "megatrain_jax.engine" in graph["megatrain_jax.trainer"]  # module level
    assert "megatrain_jax.plan" in graph["megatrain_jax.trainer"]  # inside Trainer methods only
    assert "megatrain_jax.hf" in graph["megatrain_jax.cli"]  # parent package of hf.* too


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n" + describe(cycle, graph, modules())


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {}}) in (
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"])
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"b": 1}}) is None


def test_no_module_over_600_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
