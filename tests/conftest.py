"""Shared fixtures: tiny random-weight HF checkpoints, built once and cached on disk."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import sys
import tempfile

import pytest
from support import pooling_helpers
from support.pooling_helpers import KINDS, make_pooling_checkpoint

from jaxserve.benchmarks import checkpoint_checks, checkpoints


def pytest_configure(config):
    """The suite runs on the CPU: JAX_PLATFORMS=cpu unless set, or unless the run selects
    the accelerator tests (-m accelerator). With libtpu installed (the dev extra, for the
    compile-only TPU targets) every JAX start-up would otherwise look for a TPU first and
    warn that it found none."""
    # libtpu takes a lock for the TPU it would drive; the compile-only TPU targets of the
    # kernel and compile tests open none, and the suite's workers load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    selected = config.getoption("markexpr") or ""
    if "accelerator" in selected.replace("not accelerator", ""):
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
    root.mkdir(parents=True, exist_ok=True)

    def build(tmp: pathlib.Path) -> None:
        tmp.chmod(0o755)
        for arch in checkpoints.ARCHS:
            checkpoints.make_checkpoint(arch, tmp / arch)

    final = _built_once(root / _cache_key(), build)  # every checkpoint or none
    return {arch: final / arch for arch in checkpoints.ARCHS}


@pytest.fixture(scope="session")
def mesh_checkpoints(tiny_checkpoints) -> dict[str, pathlib.Path]:
    """llama and qwen2 with 8 query heads (2 kv heads), for meshes up to model=8; built
    once beside the tiny checkpoints."""
    folders = {}
    for arch in ("llama", "qwen2"):
        folders[arch] = _built_once(
            tiny_checkpoints[arch].parent / f"mesh-{arch}",
            lambda tmp, arch=arch: checkpoints.make_checkpoint(
                arch, tmp, overrides=checkpoints.MESH_OVERRIDES))
    return folders


@pytest.fixture(scope="session")
def api_server(tiny_checkpoints, tmp_path_factory):
    """One `jaxserve serve` of the tiny llama as "tiny" (small buckets, gRPC, the engine core
    process, per-request log lines), shared by the server test modules: each leaves it healthy, and each checks its
    log holds no ERROR line.
    Yielded once /health answers: the first tests run while the background warm-up still
    compiles the other buckets (test_server_api checks what happens after it)."""
    from support.server_helpers import SHARED_READ_TIMEOUT, running_server

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


@pytest.fixture(scope="session")
def pooling_checkpoints(tiny_checkpoints) -> dict[str, pathlib.Path]:
    """kind -> folder (pooling_helpers.KINDS), the tiny pooling checkpoints, built once beside
    the tiny checkpoints (named by pooling_helpers.py's hash: a change there builds them
    again)."""
    tokenizer = tiny_checkpoints["llama"]
    digest = hashlib.sha256(pathlib.Path(pooling_helpers.__file__).read_bytes()).hexdigest()
    folders = {}
    for kind in KINDS:
        folders[kind] = _built_once(
            tokenizer.parent / f"pooling-{kind}-{digest[:8]}",
            lambda tmp, kind=kind: make_pooling_checkpoint(kind, tmp, tokenizer))
    return folders


def _built_once(final: pathlib.Path, build) -> pathlib.Path:
    """final, built by build(folder) in a temporary folder beside it and renamed into place
    (so that concurrent test processes never see half a checkpoint), unless it exists."""
    if not final.is_dir():
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
        try:
            build(tmp)
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not just another process finishing first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
