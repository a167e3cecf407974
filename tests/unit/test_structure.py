"""The package's shape: no module under kvmesh/ grows past MAX_LINES, and kvmesh's modules import each other without
a cycle, counting imports inside functions (a lazy import that dodges a cycle at load time is still a cycle in the
design: one module needs the other's insides either way). Imports under `if TYPE_CHECKING:` never run and are not
counted. Part of `make lint`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvmesh"
MAX_LINES = 500


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package's name is its __init__'s)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, wherever in the file the import stands."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            for child in getattr(node, "orelse", []):
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                # `from kvmesh.dataplane import fetcher`: the submodule (its package is already being imported, or
                # needs nothing of it); `from kvmesh.match import Match`: the module the name is defined in
                sub = f"{target}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif target in known:
                    found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as a cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(_path_through(sorted(comp), edges))

    import sys

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def _path_through(comp: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One cycle inside a strongly connected set, from its first module back to it (for the failure message)."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def test_no_module_is_over_the_line_limit():
    over = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by what they own): {over}"


def test_the_import_graph_has_no_cycle():
    found = cycles(graph())
    assert not found, "import cycles (function-local imports included):\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_finds_lazy_and_relative_imports(tmp_path):
    # the guard itself: a cycle closed by an import inside a function, and one through a relative import
    pkg = tmp_path / "kvmesh"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvmesh import b\n")
    (pkg / "b.py").write_text("def f():\n    from kvmesh.a import x\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import y\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvmesh.a import z\n"
                                      "from . import d\n")
    (pkg / "sub" / "d.py").write_text("import kvmesh.sub.c\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, pkg
    try:
        found = cycles(graph())
    finally:
        PACKAGE = saved
    assert sorted(sorted(c[:-1]) for c in found) == [["kvmesh.a", "kvmesh.b"], ["kvmesh.sub.c", "kvmesh.sub.d"]]
