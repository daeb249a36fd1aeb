"""The package's import graph: every `import` and `from ... import` inside pycomm/, at module level or
deferred inside a function, read from the source (no module is imported). Imports of the package root
(`import pycomm`, which a module does to reach the public API at call time) are left out: the root
re-exports everything by design.

Cycles between modules are listed here and nowhere else; a new one fails the test. None is left.
"""
import ast
import os
from typing import Dict, List, Set

import pycomm

ROOT = os.path.dirname(pycomm.__file__)

KNOWN_CYCLES = []


def modules() -> Dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


def imports_of(name: str, path: str, mods: Dict[str, str]) -> Set[str]:
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out: Set[str] = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = base + ("." + node.module if node.module else "")
            else:
                target = node.module or ""
            for a in node.names:  # `from pkg import mod` imports the module pkg.mod
                full = f"{target}.{a.name}"
                out.add(full if full in mods else target)
    return {m for m in out if m in mods and m != name and m != "pycomm"}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_reader_sees_relative_and_deferred_imports():
    mods = modules()
    assert "pycomm.cost_model" in imports_of("pycomm.tools.tune", mods["pycomm.tools.tune"], mods)
    assert "pycomm.compression" in imports_of("pycomm.compressors", mods["pycomm.compressors"], mods)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_but_the_known_ones():
    mods = modules()
    graph = {m: imports_of(m, p, mods) for m, p in mods.items()}
    assert cycles(graph) == KNOWN_CYCLES
