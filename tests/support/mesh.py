"""mesh_runs(folder, meshes): greedy generation on several meshes of 8 fake CPU devices, run
by support/mesh_runs.py in a subprocess (the device count is fixed when JAX starts)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

RUNS = pathlib.Path(__file__).with_name("mesh_runs.py")  # the script, beside this file


def mesh_runs(folder, meshes) -> dict:
    """mesh -> its run (support/mesh_runs.py in a subprocess with 8 fake CPU devices)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, str(RUNS), str(folder), *meshes], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {run["mesh"]: run for run in map(json.loads, proc.stdout.splitlines())}
