"""The package's modules import each other without cycles, lazy (function-level) imports
included: each module has one place in the layering (docs/architecture.md), and a cycle
means two modules each reach into the other."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"jaxserve": "jaxserve", "models": "jaxserve.models",
           "kernels_pallas": "jaxserve.kernels_pallas",
           "kernels_triton": "jaxserve.kernels_triton", "server": "jaxserve.server"}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules `path` imports anywhere in its body (the deepest known name)."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` imports the module; `from module import name`
            # the module that defines name.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                     else node.module for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                targets.add(name)
    return targets


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    found = modules()
    graph = {name: imports_of(path, set(found)) - {name} for name, path in found.items()}
    assert len(graph) > 30  # the walk sees the package
    assert "jaxserve.runner" in graph["jaxserve.runners"]  # lazy imports count
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_walk_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
