"""The docs name only things that exist: every file path and every `jaxserve.x.y` module in
README.md, CONTRIBUTING.md and every docs/*.md page, and every `module.name` that
docs/architecture.md cites (a module of the tree defining that name). A move or a rename
that leaves a page behind fails here."""

from __future__ import annotations

import fnmatch
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARCHITECTURE = "docs/architecture.md"
DOCS = sorted({ARCHITECTURE, "README.md", "CONTRIBUTING.md",
               *(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md"))})
CODE_FOLDERS = ["jaxserve", "models", "kernels_pallas", "kernels_triton", "server", "scripts",
                "tests"]
PATH = re.compile(r"(?<![\w./-])((?:[\w*-]+/)*[\w*-]+\.py)\b")
MODULE = re.compile(r"(?<![\w.])(jaxserve(?:\.\w+)+)")
CITED = re.compile(r"`([a-z_]+)\.([A-Za-z_]\w*)")


def code_files() -> dict[str, list[pathlib.Path]]:
    """File name -> the code files of that name."""
    found: dict[str, list[pathlib.Path]] = {}
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            found.setdefault(path.name, []).append(path)
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_path_exists(doc):
    text = (ROOT / doc).read_text()
    files = code_files()
    missing = []
    for path in sorted(set(PATH.findall(text))):
        if "/" in path:
            exists = any(ROOT.glob(path)) or any((ROOT / "jaxserve").glob(path))
        else:
            exists = any(fnmatch.fnmatch(name, path) for name in files)
        if not exists:
            missing.append(path)
    assert missing == [], f"{doc} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_exists(doc):
    missing = []
    for name in sorted(set(MODULE.findall((ROOT / doc).read_text()))):
        # a module, or a module's attribute (the last component)
        if importlib.util.find_spec(name.rstrip(".")) is None and \
                importlib.util.find_spec(name.rpartition(".")[0]) is None:
            missing.append(name)
    assert missing == [], f"{doc} names modules that do not exist: {missing}"


def test_every_page_is_checked():
    assert {"README.md", "CONTRIBUTING.md", ARCHITECTURE, "docs/usage.md", "docs/serving.md",
            "docs/performance.md"} <= set(DOCS)


def test_every_cited_name_is_defined():
    """`kv_quant.attend_quantized`: some kv_quant.py in the tree defines attend_quantized."""
    files = code_files()
    missing = []
    for module, name in sorted(set(CITED.findall((ROOT / ARCHITECTURE).read_text()))):
        if f"{module}.py" not in files or name == "py":
            continue  # not a module of ours (lax.cond, jax.sharding), or a file name
        definition = re.compile(
            rf"^\s*(def|class)\s+{name}\b|^\s*{name}\s*[:=]|self\.{name}\s*[:=]", re.M)
        if not any(definition.search(path.read_text()) for path in files[f"{module}.py"]):
            missing.append(f"{module}.{name}")
    assert missing == [], f"docs/architecture.md cites names no module defines: {missing}"
