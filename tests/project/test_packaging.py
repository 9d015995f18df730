"""Packaging: the wheel holds every module under jaxserve.*, and nothing else at top level."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOT_PACKAGES = {"tests", "scripts", "build", "dist"}


def source_modules() -> set[str]:
    """Every module the wheel must hold, as its path inside the wheel."""
    expected = set()
    for folder in sorted(ROOT.iterdir()):
        if folder.name in NOT_PACKAGES or not (folder / "__init__.py").is_file():
            continue
        prefix = "jaxserve" if folder.name == "jaxserve" else f"jaxserve/{folder.name}"
        for path in folder.rglob("*.py"):
            expected.add(f"{prefix}/{path.relative_to(folder).as_posix()}")
    return expected


def test_wheel_holds_every_module(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                    "dist", "tiny-llama")
    shutil.copytree(ROOT, src, ignore=ignore)
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("jaxserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {n for n in names if n.endswith(".py")}
    expected = source_modules()
    assert "jaxserve/models/jax/llama.py" in expected and "jaxserve/kernels_pallas/ref.py" in expected
    assert expected - modules == set(), "modules missing from the wheel (list them in pyproject)"
    top_level = {n.split("/")[0] for n in names}
    assert all(t == "jaxserve" or t.endswith(".dist-info") for t in top_level), top_level
    for data in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert f"jaxserve/default_model/{data}" in names, data
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "jaxserve = jaxserve.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_no_import_escapes_the_package():
    """Absolute imports only, through jaxserve.* (ruff's banned-api rule, checked here too)."""
    offenders = []
    for path in ROOT.glob("*/**/*.py"):
        if path.parts[len(ROOT.parts)] in NOT_PACKAGES | {".venv"}:
            continue
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import models", "from models", "import server",
                                    "from server", "from .", "import kernels_",
                                    "from kernels_")):
                offenders.append(f"{path.relative_to(ROOT)}: {stripped}")
    assert offenders == []
