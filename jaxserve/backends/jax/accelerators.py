"""Notice when the engine runs on the CPU of a machine that has a GPU or TPU.

A plain install brings jax's CPU build only; the accelerator builds come with jax's own extras
(`jax[cuda12]`, `jax[tpu]`, `jax[rocm7-local]`; jaxserve's `.[cuda]` and `.[tpu]` extras
delegate to the first two). A user who forgot them would otherwise see a silently slow engine.
(The name `jaxserve` on PyPI belongs to an unrelated project: hints name jax's extras, or
jaxserve's own from a clone of its repository.)
"""

from __future__ import annotations

import glob
import logging
import os

logger = logging.getLogger(__name__)

# (device node pattern, what it is, the install command that makes JAX use it)
_DEVICE_NODES = (
    ("/dev/nvidia[0-9]*", "an NVIDIA GPU",
     'pip install -U "jax[cuda12]"  (in a clone of jaxserve: pip install -e ".[cuda]")'),
    ("/dev/accel[0-9]*", "a TPU",
     'pip install -U "jax[tpu]"  (in a clone of jaxserve: pip install -e ".[tpu]")'),
    ("/dev/vfio/[0-9]*", "a TPU (vfio)",
     'pip install -U "jax[tpu]"  (in a clone of jaxserve: pip install -e ".[tpu]")'),
    ("/dev/kfd", "an AMD GPU",
     'pip install -U "jax[rocm7-local]"  (with ROCm 7 installed; see AMD\'s JAX install guide)'),
)


def unused_accelerator(dev_root: str = "/") -> tuple[str, str] | None:
    """(what, install command) for the first accelerator device node found, else None."""
    for pattern, what, command in _DEVICE_NODES:
        if glob.glob(os.path.join(dev_root, pattern.lstrip("/"))):
            return what, command
    return None


def warn_if_cpu_fallback(platform: str, dev_root: str = "/") -> bool:
    """Log a WARNING when the engine runs on the CPU but the machine has an accelerator;
    True when it warned."""
    if platform != "cpu":
        return False
    found = unused_accelerator(dev_root)
    if found is None:
        return False
    what, command = found
    logger.warning("This machine has %s, but JAX runs on the CPU: the engine will be slow. "
                   "Install JAX's accelerator build: %s", what, command)
    return True
