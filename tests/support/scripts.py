"""The repository's scripts/ folder, and load_script(name): one of its scripts imported as a
module (benchmarks/test_bench_scripts.py, benchmarks/test_bench_mla.py)."""

from __future__ import annotations

import importlib.util
import pathlib

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
