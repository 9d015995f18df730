"""Backend choice: the one place that picks and builds a device runner.

The host side imports this module, never a backend: the backend is imported when a runner
is built, so the engine, the scheduler and the server load without jax or torch. Two
backends implement protocol.Runner: JAX (backends/jax/runner.py, any mesh) and PyTorch/Triton
(backends/torch/runner.py, one device), chosen by EngineConfig.backend.
"""

from __future__ import annotations

import logging

from jaxserve.backends.protocol import Runner
from jaxserve.config.backend_capabilities import supports
from jaxserve.config.engine_config import EngineConfig

logger = logging.getLogger(__name__)


TORCH_EXTRA = ("The torch backend needs PyTorch and Triton: pip install torch triton (a CUDA "
               "or ROCm build of torch for a GPU; in a clone of jaxserve: pip install -e "
               "'.[torch]').")


def import_torch():
    """torch, or an ImportError that says which extra to install."""
    try:
        import torch
    except ImportError as err:
        raise ImportError(f"{TORCH_EXTRA} ({err})") from None
    return torch


def on_accelerator(backend: str) -> bool:
    """Whether `backend` (auto, jax or torch) would run on an accelerator here: the
    defaults that depend on it (dtype, max_model_len, batch sizes) are resolved from this."""
    if backend == "torch":
        return import_torch().cuda.is_available()
    import jax

    return jax.default_backend() != "cpu"


def create_runner(config: EngineConfig, rank: int = 0) -> Runner:
    """The runner of `config` on data-parallel replica `rank`'s devices."""
    if config.backend == "torch":
        import_torch()
        try:
            from jaxserve.backends.torch.runner import TorchRunner
        except ImportError as err:  # triton, or a torch build without it
            raise ImportError(f"{TORCH_EXTRA} ({err})") from None
        return TorchRunner(config)
    from jaxserve.backends.jax.distributed import replica_mesh
    from jaxserve.backends.jax.runner import ModelRunner

    return ModelRunner(config, replica_mesh(config, rank))


def replica_hosts(config: EngineConfig) -> list[list[int]]:
    """Per data-parallel replica, the processes (hosts) that run it, its lead host first:
    [[0]] * D in one process or on a backend without multi-host serving; on several hosts,
    the JAX backend's layout (backends/jax/distributed.py)."""
    size = config.parallel.data_parallel_size
    if not supports(config.backend, "multi_host") or not multi_host():
        return [[0] for _ in range(size)]
    from jaxserve.backends.jax import distributed

    return distributed.replica_hosts(size, config.parallel.mesh.model)


def multi_host() -> bool:
    """Whether this process is one of several hosts joined by jax.distributed."""
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def process_index() -> int:
    """This host's index among the joined hosts (0 when alone)."""
    if not multi_host():
        return 0
    import jax

    return jax.process_index()


def host_links():
    """The connections between the joined hosts (distributed.HostLinks)."""
    from jaxserve.backends.jax import distributed

    return distributed.links()
