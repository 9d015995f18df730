"""The host/device line (docs/architecture.md): host-side modules import with jax, jaxlib,
flax and torch blocked.

Each check runs in a fresh interpreter whose meta-path finder refuses those packages, so a
stray `import jax` anywhere in a host module's import chain fails the test. The engine
reaches a backend only through selection.create_runner, which imports it when called.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

BLOCKER = textwrap.dedent("""
    import importlib.abc
    import sys

    BLOCKED = {blocked!r}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: host-side code must not import it")
            return None

    for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
        del sys.modules[name]
    sys.meta_path.insert(0, Blocker())

    def assert_nothing_blocked_loaded():
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
""")

# The host side, by folder: every module in these folders (not their subfolders) imports
# with jax, flax and torch blocked. A backend's own folder (backends/jax, backends/torch,
# models/jax, models/torch), the kernels and the benchmarks are the only places they may be
# imported at module level.
HOST_FOLDERS = ["jaxserve", "jaxserve/config", "jaxserve/inputs", "jaxserve/parsers",
                "jaxserve/core", "jaxserve/engine", "jaxserve/backends", "jaxserve/cli",
                "jaxserve/benchmarks/serve", "models", "server", "server/openai",
                "server/responses", "server/pooling", "server/grpc"]
# The folders that may import jax, flax or torch at module level.
DEVICE_FOLDERS = ["jaxserve/backends/jax", "jaxserve/backends/torch", "jaxserve/benchmarks",
                  "models/jax", "models/torch", "kernels_pallas", "kernels_triton"]
SOURCE_ROOTS = ["jaxserve", "models", "server", "kernels_pallas", "kernels_triton"]


def package_of(folder: str) -> str:
    """The import package of a source folder (pyproject's package-dir)."""
    if folder.split("/")[0] in ("models", "server", "kernels_pallas", "kernels_triton"):
        folder = "jaxserve/" + folder
    return folder.replace("/", ".")


def host_modules() -> list[str]:
    found = []
    for folder in HOST_FOLDERS:
        package = package_of(folder)
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.stem == "__main__":  # runs the command when imported
                continue
            found.append(package if path.stem == "__init__" else f"{package}.{path.stem}")
    return found


HOST_MODULES = host_modules()


def test_every_source_folder_is_on_one_side():
    """A new folder says which side it is on (here) before its modules can escape the check."""
    folders = {path.parent.relative_to(ROOT).as_posix()
               for root in SOURCE_ROOTS for path in (ROOT / root).rglob("*.py")}
    folders = {f for f in folders if "default_model" not in f}
    assert sorted(folders - set(HOST_FOLDERS) - set(DEVICE_FOLDERS)) == []
    assert set(HOST_FOLDERS).isdisjoint(DEVICE_FOLDERS)


def run_blocked(code: str, blocked=("jax", "jaxlib", "flax", "torch", "triton")
                ) -> subprocess.CompletedProcess:
    script = BLOCKER.replace("{blocked!r}", repr(tuple(blocked))) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def import_errors() -> dict[str, str]:
    """Every host module imported in one blocked interpreter: module -> the error its import
    raised ("" when it imported). A module whose import chain reaches jax fails there, and so
    does every later module that imports it (a failed import leaves nothing in sys.modules),
    so each module's whole chain is checked, as in an interpreter of its own."""
    proc = run_blocked(f"""
        import importlib
        import json
        import traceback

        errors = {{}}
        for module in {HOST_MODULES!r}:
            try:
                importlib.import_module(module)
                errors[module] = ""
            except BaseException:
                errors[module] = traceback.format_exc()
        assert_nothing_blocked_loaded()
        print(json.dumps(errors))
    """)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", HOST_MODULES)
def test_host_module_imports_without_jax(module, import_errors):
    assert import_errors[module] == "", (
        f"{module} needs jax/jaxlib/flax at import time:\n{import_errors[module]}")


def test_package_root_and_sampling_params_import_without_jax():
    proc = run_blocked("""
        from jaxserve import SamplingParams
        from jaxserve.engine.outputs import RequestOutput
        import jaxserve

        assert SamplingParams(max_tokens=3).max_tokens == 3
        assert jaxserve.RequestOutput is RequestOutput
        assert_nothing_blocked_loaded()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_blocker_blocks():
    proc = run_blocked("""
        import importlib

        for name in ("jax", "jaxlib", "flax", "jax.numpy", "jaxserve.backends.jax.runner"):
            try:
                importlib.import_module(name)
            except ImportError as e:
                assert "is blocked" in str(e), (name, e)
            else:
                raise SystemExit(f"importing {name} should have failed")
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_plan_runs_without_jax(tmp_path):
    """`jaxserve plan` counts weights from the family's numpy parameter table."""
    config = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
              "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = run_blocked(f"""
        import json
        from jaxserve.cli import main

        main(["plan", {str(tmp_path)!r}, "--mesh", "1x8", "--device-memory", "80GB",
              "--quantization", "int8", "--json"])
        assert_nothing_blocked_loaded()
    """)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["num_params"] > 46e9, plan  # Mixtral 8x7B


def test_the_torch_backend_never_imports_jax_or_flax():
    proc = run_blocked("""
        import jaxserve.backends.torch.runner
        import jaxserve.backends.torch.sampler
        import jaxserve.backends.torch.kv_quant
        import jaxserve.models.torch.llama
        assert_nothing_blocked_loaded()
        print("ok")
    """, blocked=("jax", "jaxlib", "flax"))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
