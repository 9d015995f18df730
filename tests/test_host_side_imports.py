"""The host/device line (docs/architecture.md): host-side modules import with jax, jaxlib,
flax and torch blocked.

Each check runs in a fresh interpreter whose meta-path finder refuses those packages, so a
stray `import jax` anywhere in a host module's import chain fails the test. The engine
reaches a backend only through runner_api.create_runner, which imports it when called.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

BLOCKER = textwrap.dedent("""
    import importlib.abc
    import sys

    BLOCKED = ("jax", "jaxlib", "flax", "torch", "triton")

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

HOST_MODULES = [
    "jaxserve.request",
    "jaxserve.kv_cache_manager",
    "jaxserve.scheduler",
    "jaxserve.sampling_params",
    "jaxserve.input_builder",
    "jaxserve.detokenizer",
    "jaxserve.outputs",
    "jaxserve.request_outputs",
    "jaxserve.engine",
    "jaxserve.engine_stats",
    "jaxserve.engine_args",
    "jaxserve.runner_api",
    "jaxserve.runners",
    "jaxserve.kv_sizing",
    "jaxserve.model_path",
    "jaxserve.data_parallel",
    "jaxserve.llm",
    "jaxserve.server.protocol",
    "jaxserve.server.chat_messages",
    "jaxserve.server.schema_base",
    "jaxserve.server.async_engine",
    "jaxserve.admission",
    "jaxserve.request_limits",
    "jaxserve.bounded_json",
    "jaxserve.grammar_checks",
    "jaxserve.grammar_sandbox",
    "jaxserve.chat_template",
]


def run_blocked(code: str) -> subprocess.CompletedProcess:
    script = BLOCKER + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("module", HOST_MODULES)
def test_host_module_imports_without_jax(module):
    proc = run_blocked(f"""
        import importlib
        importlib.import_module({module!r})
        assert_nothing_blocked_loaded()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        f"{module} needs jax/jaxlib/flax at import time:\n{proc.stderr}")


def test_package_root_and_sampling_params_import_without_jax():
    proc = run_blocked("""
        from jaxserve import SamplingParams
        from jaxserve.outputs import RequestOutput
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

        for name in ("jax", "jaxlib", "flax", "jax.numpy", "jaxserve.runner"):
            try:
                importlib.import_module(name)
            except ImportError as e:
                assert "is blocked" in str(e), (name, e)
            else:
                raise SystemExit(f"importing {name} should have failed")
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
