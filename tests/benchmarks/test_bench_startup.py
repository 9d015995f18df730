"""scripts/bench_startup.py: the start-up benchmark runs end to end on the built-in model.

Timing is loosely checked only where the direction is certain: a warm start (the persistent
XLA cache filled by the cold one) is not much slower than a cold one, and the first
completion cannot come before the server is healthy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_startup.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_startup", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_command_and_fresh_env(tmp_path, monkeypatch):
    script = load_script()
    argv = script.readme_generate_command()
    assert argv[:2] == ["jaxserve", "generate"] and len(argv) >= 3
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
    monkeypatch.setenv("XDG_CACHE_HOME", "/elsewhere")
    env = script.fresh_env(tmp_path)
    assert env["HOME"] == str(tmp_path)
    assert env["XDG_CACHE_HOME"] == str(tmp_path / ".cache")
    assert "JAX_COMPILATION_CACHE_DIR" not in env
    assert str(pathlib.Path(sys.executable).parent) in env["PATH"].split(os.pathsep)


@pytest.mark.slow
def test_bench_startup_builtin(tmp_path):
    report = tmp_path / "startup.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--models", "builtin", "--json",
                          str(report)], capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    assert "generate (README command)" in out.stdout
    data = json.loads(report.read_text())

    gen = data["generate"]
    for label in ("cold", "warm"):
        assert gen[label]["ok"] and gen[label]["returncode"] == 0, gen[label]
        assert gen[label]["wall_s"] > 0 and gen[label]["completion"].strip()
    assert gen["warm"]["wall_s"] <= 1.5 * gen["cold"]["wall_s"], gen

    serve = data["serve"]["builtin"]
    assert serve["model"] is None
    for label in ("cold", "warm"):
        run = serve[label]
        assert run["ok"], run
        assert run["health_s"] > 0 and run["first_completion_s"] > 0, run
        assert run["first_completion_s"] >= run["health_s"], run
        assert run["served_model"] and isinstance(run["completion"], str)
        if run["ready_available"]:
            assert run["ready_s"] > 0
        else:
            assert run["ready_s"] is None
