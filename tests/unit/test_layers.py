"""The package's layers and its import graph, read from the source (no module of pycomm is imported, no MPI).

Every `import` and `from ... import` inside pycomm/ counts: at module level or deferred inside a function,
relative or absolute. `from P import n` is an edge to the module P.n when there is one, else to P; `import
pycomm`, which a module does to reach the public API at call time, is an edge to the package root, whose
__init__ imports the runtime. Only the imports a file writes count: the parent packages Python loads first
are not edges (every module would otherwise depend on the root).

Two rules:
- no import cycles: every module can be loaded, and understood, after the ones it imports;
- the runtime never imports the tools: pycomm.tools imports the runtime, never the other way round. The
  runtime is every module but pycomm.tools and the deprecated aliases (pycomm.algorithms, pycomm.tune,
  .launcher, .build_info, .benchmark, .train, .testbed), which only forward to their new names.
"""
import ast
import os
from typing import Dict, List, Optional, Set

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pycomm")
TOOLS = "pycomm.tools"
DEPRECATED_ALIASES = ("pycomm.algorithms", "pycomm.tune", "pycomm.launcher", "pycomm.build_info",
                      "pycomm.benchmark", "pycomm.train", "pycomm.testbed")


def modules(root: str = PACKAGE_DIR) -> Dict[str, Optional[str]]:
    """Module name -> source file (None for an extension module such as pycomm._C)."""
    found: Dict[str, Optional[str]] = {}
    top = os.path.dirname(root)
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in files:
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, top)
            if f.endswith(".py"):
                name = rel[:-3].replace(os.sep, ".")
                found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
            elif f.endswith(".so") or f.endswith(".pyd"):
                found[rel.split(".", 1)[0].replace(os.sep, ".")] = None  # _C.cpython-311-....so -> _C
    return found


def _named(target: str, mods: Dict[str, Optional[str]]) -> Optional[str]:
    """The module `import target` binds to: target itself, else its longest prefix that is a module."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in mods:
            return name
    return None


def imports_of(name: str, path: str, mods: Dict[str, Optional[str]]) -> Set[str]:
    """The pycomm modules that the file `path` (module `name`) imports, anywhere in it."""
    package = name if os.path.basename(path) == "__init__.py" else name.rsplit(".", 1)[0]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(filter(None, (_named(a.name, mods) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the top-level package")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = base + ("." + node.module if node.module else "")
            else:
                target = node.module or ""
            for a in node.names:  # `from pkg import mod` imports the module pkg.mod
                full = f"{target}.{a.name}"
                found = full if full in mods else _named(target, mods)
                if found:
                    out.add(found)
    out.discard(name)
    return out


def import_graph(root: str = PACKAGE_DIR) -> Dict[str, Set[str]]:
    mods = modules(root)
    return {m: (imports_of(m, p, mods) if p else set()) for m, p in mods.items()}


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
        for w in sorted(graph.get(v, ())):
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


def cycle_path(graph: Dict[str, Set[str]], component: List[str]) -> List[str]:
    """One closed path a -> b -> ... -> a through a strongly connected component, for the message."""
    members = set(component)
    start = component[0]
    parent: Dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def is_tool(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def is_runtime(name: str) -> bool:
    return not is_tool(name) and not any(name == a or name.startswith(a + ".") for a in DEPRECATED_ALIASES)


def test_the_reader_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pycomm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\nfrom .sub import b\n")
    (pkg / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (pkg / "a.py").write_text("from . import _C\n\ndef f():\n    import pycomm\n    from pycomm.sub.b import x\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("x = 1\n\nclass C:\n    def m(self):\n        from ..a import f\n"
                                      "        from .. import _C\n        import pycomm.sub.c.d\n")
    (pkg / "sub" / "c.py").write_text("def g():\n    from . import b\n")
    graph = import_graph(str(pkg))
    assert graph["pycomm"] == {"pycomm.a", "pycomm.sub.b"}
    assert graph["pycomm.a"] == {"pycomm._C", "pycomm", "pycomm.sub.b"}
    assert graph["pycomm.sub.b"] == {"pycomm.a", "pycomm._C", "pycomm.sub.c"}
    assert graph["pycomm.sub.c"] == {"pycomm.sub.b"}
    assert graph["pycomm._C"] == set()
    assert cycles(graph) == [["pycomm", "pycomm.a", "pycomm.sub.b", "pycomm.sub.c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycle_path({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_the_reader_sees_pycomm_itself():
    graph = import_graph()
    assert "pycomm.cost_model" in graph["pycomm.tools.tune"]  # module level, relative
    assert "pycomm" in graph["pycomm.tools.tune"]  # `import pycomm` inside a function
    assert "pycomm.compression" in graph["pycomm.compressors"]
    assert "pycomm._C" in graph["pycomm.runtime"]
    assert {"pycomm.runtime", "pycomm.collectives", "pycomm.training"} <= graph["pycomm"]


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles in pycomm: " + "; ".join(
        f"{' -> '.join(cycle_path(graph, c))} (modules in this knot: {', '.join(c)})" for c in found)


def test_the_runtime_never_imports_the_tools():
    graph = import_graph()
    assert any(is_tool(m) for m in graph) and is_runtime("pycomm.runtime") and is_runtime("pycomm")
    bad = sorted(f"{m} imports {', '.join(sorted(t for t in deps if is_tool(t)))}"
                 for m, deps in graph.items() if is_runtime(m) and any(is_tool(t) for t in deps))
    assert not bad, "the runtime imports pycomm.tools: " + "; ".join(bad)
