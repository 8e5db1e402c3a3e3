"""No import circle through the engine's modules (adaspark/*.py: engine, batch, sequence,
speculative, request, ...): a reader can learn them bottom up, and none needs an import hidden
under TYPE_CHECKING or inside a function to load. Read from the source with ast, so every
import counts: top level, under TYPE_CHECKING and inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import adaspark

PACKAGE = Path(adaspark.__file__).parent


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module of the package."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules this file imports, anywhere in it (`from m import name` counts as
    m.name where that is a module, else m)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found & modules.keys()


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def circle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """An import path from `start` back to itself, or None."""
    parent: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt not in parent:
                parent[nxt] = node
                todo.append(nxt)
    return None


def engine_modules(graph: dict[str, set[str]]) -> list[str]:
    """The modules directly under adaspark/ (the engine's), not its subpackages'."""
    return sorted(name for name in graph if name.count(".") == 1)


def test_no_import_circle_through_the_engine_modules():
    graph = import_graph()
    assert {"adaspark.engine", "adaspark.batch", "adaspark.sequence",
            "adaspark.speculative"} <= set(engine_modules(graph))
    circles = {name: circle for name in engine_modules(graph)
               if (circle := circle_through(graph, name)) is not None}
    assert not circles, "import circles: " + "; ".join(
        " -> ".join(c) for c in circles.values())


def test_a_circle_hidden_under_type_checking_is_found(tmp_path):
    """The check itself: a TYPE_CHECKING import back to the importer closes a circle."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text("from pkg.step import Step\n")
    (package / "step.py").write_text("from typing import TYPE_CHECKING\n"
                                     "if TYPE_CHECKING:\n    from pkg.engine import Timing\n")
    (package / "leaf.py").write_text("import pkg.step\n")
    graph = import_graph(package)
    assert graph == {"pkg": set(), "pkg.engine": {"pkg.step"}, "pkg.step": {"pkg.engine"},
                     "pkg.leaf": {"pkg.step"}}
    assert circle_through(graph, "pkg.engine") == ["pkg.engine", "pkg.step", "pkg.engine"]
    assert circle_through(graph, "pkg.leaf") is None
