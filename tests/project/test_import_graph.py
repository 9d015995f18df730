"""The package's layering: modules import each other without cycles, lazy (function-level)
imports included, and the folders form layers that import only downward
(docs/architecture.md, "Layout"): a module imports its own folder or a folder below it,
never one above. A cycle or an upward arrow means a module reaches into a stage it should
be called by."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Source folders and the package each installs as (pyproject's package-dir).
FOLDERS = {"jaxserve": "jaxserve", "models": "jaxserve.models",
           "kernels_pallas": "jaxserve.kernels_pallas",
           "kernels_triton": "jaxserve.kernels_triton", "server": "jaxserve.server"}
# The layers, lowest first. A module belongs to the longest package (or module) below that
# names it; the package root (`jaxserve`: __init__, llm) holds the public names; only the
# benchmarks' library and the command line are above it.
LAYERS = [
    ("jaxserve.kernels_pallas", "jaxserve.kernels_triton"),
    ("jaxserve.models",),
    ("jaxserve.config",),
    ("jaxserve.inputs",),
    ("jaxserve.parsers",),
    ("jaxserve.core",),
    ("jaxserve.backends",),
    ("jaxserve.engine",),
    # The server: its own modules (errors, the async engine, bodies, metrics) at the bottom,
    # then one folder per API, then the app that mounts them and the launch that runs it.
    ("jaxserve.server",),
    ("jaxserve.server.openai", "jaxserve.server.grpc"),
    ("jaxserve.server.responses", "jaxserve.server.pooling"),
    ("jaxserve.server.app",),
    ("jaxserve.server.launch",),
    ("jaxserve",),
    ("jaxserve.benchmarks",),  # benchmark and device-check code: uses everything but the CLI
    ("jaxserve.cli",),  # the command line: the top, used by none
]
# Twins that never import each other (a backend, or a model, of one kind never needs the
# other kind's).
SIBLINGS = [("jaxserve.backends.jax", "jaxserve.backends.torch"),
            ("jaxserve.models.jax", "jaxserve.models.torch"),
            # APIs of the same layer: each is served alone, on the server's own modules
            ("jaxserve.server.openai", "jaxserve.server.grpc"),
            ("jaxserve.server.responses", "jaxserve.server.pooling"),
            ("jaxserve.server.responses", "jaxserve.server.grpc"),
            ("jaxserve.server.pooling", "jaxserve.server.grpc")]


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in FOLDERS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
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


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, set(found)) - {name} for name, path in found.items()}


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest package naming `module`."""
    best, index = "", None
    for i, packages in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and len(package) > len(best):
                best, index = package, i
    assert index is not None, module
    return index


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import of a module in a higher layer, or of a sibling twin."""
    found = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(source):
                found.append(f"{source} -> {target}")
            for pair in SIBLINGS:
                for mine, other in (pair, pair[::-1]):
                    if source.startswith(mine + ".") and target.startswith(other + "."):
                        found.append(f"{source} -> {target} (twins)")
    return found


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
    g = graph()
    assert len(g) > 60  # the walk sees the whole package, subfolders included
    assert "jaxserve.backends.jax.runner" in g["jaxserve.backends.selection"]  # lazy imports
    cycle = find_cycle(g)
    assert cycle is None, " -> ".join(cycle)


def test_folders_import_only_downward():
    g = graph()
    named = {package for layer in LAYERS for package in layer}
    for module, path in modules().items():  # a new folder joins the table before it is used
        if path.name != "__init__.py" or module.count(".") < 1:
            continue
        parts = module.split(".")
        if parts[1] in ("models", "kernels_pallas", "kernels_triton"):
            continue  # the model and kernel folders' subfolders are device code of one layer
        # jaxserve/<folder>/ and server/<API>/ each have a row; deeper folders belong to theirs
        depth = 3 if parts[1] == "server" else 2
        if len(parts) <= depth:
            assert module in named, f"{module} is missing from LAYERS"
    assert upward_imports(g) == []


@pytest.mark.parametrize("source,target", [
    ("jaxserve.core.scheduler", "jaxserve.engine.llm_engine"),  # core reaching up
    ("jaxserve.config.mesh", "jaxserve.backends.jax.runner"),
    ("jaxserve.backends.torch.runner", "jaxserve.backends.jax.sampler"),  # twins
    ("jaxserve.server.errors", "jaxserve.server.openai.protocol"),  # server root to an API
    ("jaxserve.server.openai.serving", "jaxserve.server.responses.serving"),
    ("jaxserve.server.responses.serving", "jaxserve.server.pooling.serving"),  # twins
    ("jaxserve.server.grpc.servicer", "jaxserve.server.openai.serving"),  # twins
    ("jaxserve.server.app", "jaxserve.server.launch"),
    ("jaxserve.engine.llm_engine", "jaxserve.server.async_engine"),
    ("jaxserve.benchmarks.workloads", "jaxserve.cli.serve"),
    ("jaxserve.llm", "jaxserve.cli.common"),
])
def test_an_added_upward_import_fails(source, target):
    g = graph()
    g[source] = g[source] | {target}
    assert any(line.startswith(f"{source} -> {target}") for line in upward_imports(g))


def test_the_walk_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
