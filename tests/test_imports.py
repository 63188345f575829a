"""No import cycle in the project: the modules of ``xlnet_fast/``, ``kernels/`` (installed as
``xlnet_fast.kernels``) and ``bench/`` import each other along a graph without cycles.

The graph is read from the sources (``ast``), not by importing them: every ``import`` statement
counts, at module level or inside a function (a function-level import that dodges a cycle is still
one). ``from P import n`` is an edge to the submodule ``P.n`` when there is one, else to ``P`` (its
``__init__``); the implicit import of a module's parent packages is not an edge.
"""

import ast
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (directory under the root, the dotted name its modules are imported as)
PACKAGES = (("xlnet_fast", "xlnet_fast"), ("kernels", "xlnet_fast.kernels"), ("bench", "bench"))


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` of ``PACKAGES`` under ``root`` (the
    checkout's ``xlnet_fast/kernels`` link to ``kernels/`` is not followed)."""
    modules: dict[str, Path] = {}
    for directory, dotted in PACKAGES:
        base = root / directory
        for dirpath, dirnames, filenames in os.walk(base):  # os.walk does not follow directory links
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not (Path(dirpath) / d).is_symlink())
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                parts = Path(dirpath, name).relative_to(base).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join((dotted, *parts))] = Path(dirpath, name)
    return modules


def _imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules) -> set[str]:
    """The project modules that the statement ``node`` of ``module`` imports: ``import P.m`` -> P.m;
    ``from P import a, b`` -> P.a and P.b where they are modules, and P itself for any other name."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules
    if node.level:  # relative: from the module's package (a package's __init__ is its own package)
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
    else:
        base = node.module
    names = {f"{base}.{alias.name}" for alias in node.names}
    return (names & modules) | ({base} & modules if names - modules else set())


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in its source)."""
    modules = project_modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= _imported_modules(node, module, is_package, modules.keys()) - {module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the first module of ``component``, as ``[a, b, ..., a]`` (breadth-first:
    a shortest one)."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def import_cycles(root: Path = ROOT) -> list[str]:
    """One line per import cycle in the tree at ``root``: ``a -> b -> a``."""
    graph = import_graph(root)
    return [" -> ".join(a_cycle(graph, c)) for c in strongly_connected(graph) if len(c) > 1]


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "xlnet_fast.kernels" in graph and "bench.runner" in graph and "xlnet_fast.pretrain.loop" in graph
    assert "xlnet_fast.pretrain.errors" in graph["xlnet_fast.pretrain.loop"]  # from .errors import ...
    assert "xlnet_fast.model" in graph["xlnet_fast.pretrain.loop"]  # from ..model import (a package's name)
    assert "xlnet_fast.pretrain.summary" in graph["xlnet_fast.cli"]  # inside a function
    assert "xlnet_fast" not in graph["xlnet_fast.pretrain.loop"]  # parent packages are not edges


def test_cycles_are_found_and_printed(tmp_path):
    """A cycle through a function-level ``from . import`` of a submodule, and one through a
    package's ``__init__``."""
    pkg = tmp_path / "xlnet_fast"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import thing\n")
    (pkg / "sub" / "__init__.py").write_text("from .inner import thing\n")
    (pkg / "sub" / "inner.py").write_text("import xlnet_fast.c\nthing = 1\n")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    (pkg / "c.py").write_text("from .sub import thing\n")
    assert sorted(import_cycles(tmp_path)) == ["xlnet_fast.a -> xlnet_fast.b -> xlnet_fast.a",
                                               "xlnet_fast.c -> xlnet_fast.sub -> xlnet_fast.sub.inner -> xlnet_fast.c"]


def test_no_import_cycle():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


if __name__ == "__main__":  # python tests/test_imports.py [ROOT]: the cycles of another checkout
    found = import_cycles(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print("\n".join(found) or "no import cycle")
    sys.exit(1 if found else 0)
