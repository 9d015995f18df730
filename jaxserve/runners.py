"""Backend choice: the one place that picks and builds a device runner.

The host side imports this module, never a backend: the backend is imported when a runner
is built, so the engine, the scheduler and the server load without jax or torch. The JAX
runner (runner.py) is the only backend today; the PyTorch/Triton runner joins here.
"""

from __future__ import annotations

import logging

from jaxserve.config import EngineConfig
from jaxserve.runner_api import Runner

logger = logging.getLogger(__name__)


def create_runner(config: EngineConfig, rank: int = 0) -> Runner:
    """The runner of `config` on data-parallel replica `rank`'s devices."""
    from jaxserve.runner import ModelRunner, replica_mesh

    return ModelRunner(config, replica_mesh(config, rank))


def run_worker(config: EngineConfig) -> None:
    """A multi-host run's non-zero host (distributed.py): build the runner and run host 0's
    steps until it stops."""
    import jax

    runner = create_runner(config)
    if config.precompile:
        runner.warm_up(background=config.precompile == "background")
    logger.info("Host %d: following host 0's steps.", jax.process_index())
    steps = runner.follow()
    logger.info("Host %d: host 0 stopped after %d steps.", jax.process_index(), steps)
