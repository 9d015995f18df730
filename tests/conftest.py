"""Shared fixtures: tiny random-weight HF checkpoints, built once and cached on disk."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

from jaxserve.benchmarks import checkpoint_checks, checkpoints


def pytest_addoption(parser):
    parser.addoption(
        "--checkpoint-cache", default=None, metavar="DIR",
        help="folder for the tiny test checkpoints (default ~/.cache/jaxserve-tests)",
    )


def _cache_key() -> str:
    # The tokenizer is trained on this Python's stdlib and saved by this transformers.
    import transformers

    h = hashlib.sha256(pathlib.Path(checkpoints.__file__).read_bytes())
    h.update(f"{sys.version_info[:2]} {transformers.__version__}".encode())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def tiny_checkpoints(pytestconfig) -> dict[str, pathlib.Path]:
    """arch -> folder of a tiny HF checkpoint (config, model.safetensors, tokenizer)."""
    root = pathlib.Path(
        pytestconfig.getoption("--checkpoint-cache") or "~/.cache/jaxserve-tests"
    ).expanduser()
    final = root / _cache_key()
    if not final.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        tmp.chmod(0o755)
        try:
            for arch in checkpoints.ARCHS:
                checkpoints.make_checkpoint(arch, tmp / arch)
            os.rename(tmp, final)  # atomic: readers see all checkpoints or none
        except OSError:
            if not final.is_dir():  # not just another process finishing first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {arch: final / arch for arch in checkpoints.ARCHS}


@pytest.fixture(scope="session")
def mesh_checkpoints(tiny_checkpoints) -> dict[str, pathlib.Path]:
    """llama and qwen2 with 8 query heads (2 kv heads), for meshes up to model=8; built
    once beside the tiny checkpoints."""
    folders = {}
    for arch in ("llama", "qwen2"):
        final = tiny_checkpoints[arch].parent / f"mesh-{arch}"
        if not final.is_dir():
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
            try:
                checkpoints.make_checkpoint(arch, tmp, overrides=checkpoints.MESH_OVERRIDES)
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        folders[arch] = final
    return folders


@pytest.fixture(scope="session")
def api_server(tiny_checkpoints, tmp_path_factory):
    """One `jaxserve serve` of the tiny llama as "tiny" (small buckets, gRPC, the engine core
    process, per-request log lines), shared by the server test modules: each leaves it healthy, and each checks its
    log holds no ERROR line.
    Yielded once /health answers: the first tests run while the background warm-up still
    compiles the other buckets (test_server_api checks what happens after it)."""
    from server_helpers import SHARED_READ_TIMEOUT, running_server

    # The engine in its own process, as `serve` runs it on hosts of 4 or more CPUs (this
    # machine's 2 would choose a thread): every server test goes through the engine core.
    with running_server(tiny_checkpoints["llama"], "--request-read-timeout",
                        str(SHARED_READ_TIMEOUT), "--engine-process", "--enable-log-requests",
                        wait_for="/health",
                        grpc=True,
                        log_dir=tmp_path_factory.mktemp("api-server")) as server:
        yield server


@pytest.fixture
def tiny_checkpoint(request, tiny_checkpoints) -> pathlib.Path:
    """One checkpoint; parametrize indirectly with the arch name (default llama)."""
    return tiny_checkpoints[getattr(request, "param", "llama")]


@pytest.fixture(scope="session")
def checkpoint_script():
    """jaxserve.benchmarks.checkpoint_checks: check_prompts, greedy_margins, ... (the tiny
    checkpoints' prompts, once in scripts/make_tiny_checkpoint.py)."""
    return checkpoint_checks
