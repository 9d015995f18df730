"""The layout of tests/: every test module in one of the folders that mirror the package, the
helpers they share in the support package, and no test module importing another (a helper
two modules need belongs in support/)."""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"kernels", "models", "config", "inputs", "parsers", "core", "backends", "engine",
           "server", "cli", "benchmarks", "project"}
SOURCES = sorted(path for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts)


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an import statement names, at any depth (imports inside functions too):
    `import a.b` -> a.b, `from a import b` -> a and a.b."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_module_imports_a_test_module():
    offenders = []
    for path in SOURCES:
        for name in imported_modules(ast.parse(path.read_text(), str(path))):
            if any(part.startswith("test_") for part in name.split(".")):
                offenders.append(f"{path.relative_to(TESTS)}: {name}")
    assert offenders == [], "move what they share into tests/support/: " + ", ".join(offenders)


def test_every_test_module_sits_in_a_package_folder():
    misplaced = [path.relative_to(TESTS).as_posix() for path in SOURCES
                 if path.name.startswith("test_")
                 and (len(path.relative_to(TESTS).parts) != 2 or path.parent.name not in FOLDERS)]
    assert misplaced == [], f"not in one of {sorted(FOLDERS)}: {misplaced}"


def test_helpers_live_in_support():
    outside = [path.relative_to(TESTS).as_posix() for path in SOURCES
               if not path.name.startswith("test_") and path != TESTS / "conftest.py"
               and path.parent != TESTS / "support"]
    assert outside == [], f"non-test modules outside tests/support/: {outside}"
    assert (TESTS / "support" / "__init__.py").is_file()


def test_test_basenames_are_unique():
    """No __init__.py in the test folders: pytest imports each test module by its basename."""
    names = [path.name for path in SOURCES if path.name.startswith("test_")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not any((TESTS / folder / "__init__.py").exists() for folder in FOLDERS)
