"""Sleep mode and weight updates, engine side: vLLM's sleep / wake_up / is_sleeping, and the
weight updates reinforcement-learning trainers make between generation phases.

SleepMode is LLMEngine's part (a mixin on the engine's own state: its config, runner, KV
manager, tracked requests and steps in flight); the runner does the device work
(backends/jax/sleep.py). The argument checks here are every front end's: the data-parallel
front end, the engine core client (a utility call to the core process) and the server
(server/engine_calls.py, server/dev_routes.py) check with the same functions.

Choices where vLLM leaves it open: sleeping again at the same or a lower level, and waking
what is awake, change nothing; a deeper level (2 after 1) drops the host copy of the weights.
sleep() refuses while requests are unfinished (RequestsUnfinishedError), and a sleeping
engine refuses new requests and steps (EngineSleepingError). Whatever woke up, the prefix
cache is reset: the cached blocks' contents are gone, and after a weight update they were
computed with other weights.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping

import ml_dtypes
import numpy as np

TAGS = ("weights", "kv_cache")  # what wake_up can bring back, as vLLM's tags
SLEEPING = "the engine is sleeping (LLM.sleep): call wake_up() first"


class EngineSleepingError(RuntimeError):
    """A request or a step reached an engine that is sleeping."""

    def __init__(self, message: str = SLEEPING) -> None:
        super().__init__(message)


class RequestsUnfinishedError(ValueError):
    """sleep() while requests are unfinished."""


def check_level(level) -> int:
    if isinstance(level, bool) or not isinstance(level, int) or level not in (1, 2):
        raise ValueError(f"level must be 1 (the weights to host memory, the KV cache "
                         f"dropped) or 2 (both dropped), got {level!r:.40}.")
    return level


def check_tags(tags) -> tuple[str, ...]:
    """wake_up's tags: None (both) or a list of TAGS."""
    if tags is None:
        return TAGS
    if isinstance(tags, (str, bytes)) or not isinstance(tags, (list, tuple, set, frozenset)):
        raise ValueError(f"tags must be a list of {' and '.join(map(repr, TAGS))}, or None "
                         f"for both; got {type(tags).__name__}.")
    unknown = [tag for tag in tags if tag not in TAGS]
    if unknown:
        raise ValueError(f"tags: unknown tag {unknown[0]!r:.40}; wake_up takes "
                         f"{' and '.join(map(repr, TAGS))} (None: both).")
    if not tags:
        raise ValueError("tags is empty: name what to wake up ('weights', 'kv_cache'), or "
                         "give None for both.")
    return tuple(tag for tag in TAGS if tag in tags)


def check_enabled(config) -> None:
    if not config.enable_sleep_mode:
        raise ValueError("sleep needs enable_sleep_mode=True when the engine is made (vLLM's "
                         "flag; serve: --enable-sleep-mode).")


def unfinished(count: int) -> RequestsUnfinishedError:
    return RequestsUnfinishedError(
        f"sleep: {count} request{'s are' if count != 1 else ' is'} unfinished; let "
        f"{'them' if count != 1 else 'it'} finish or abort {'them' if count != 1 else 'it'} "
        "first.")


def host_weights(weights) -> str | dict[str, np.ndarray]:
    """update_weights' argument checked and in host memory: an existing folder (its absolute
    path: every safetensors tensor in it), or {tensor name: numpy array} from a mapping of
    numpy, torch or jax arrays (bfloat16 kept exact)."""
    if isinstance(weights, (str, os.PathLike)):
        folder = os.fspath(weights)
        if not os.path.isdir(folder):
            raise ValueError(f"weights: {folder!r:.200} is not a directory; give a folder of "
                             "*.safetensors files or a dict {tensor name: array}.")
        return os.path.abspath(folder)
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a dict {{Hugging Face tensor name: array}} or a "
                         f"folder of *.safetensors files; got {type(weights).__name__}.")
    if not weights:
        raise ValueError("weights is empty: give at least one tensor.")
    out = {}
    for name, value in weights.items():
        if not isinstance(name, str):
            raise ValueError(f"weights: tensor names are strings (the checkpoint's, e.g. "
                             f"model.layers.0.mlp.up_proj.weight); got {name!r:.80}.")
        out[name] = _host_array(name, value)
    return out


def _host_array(name: str, value) -> np.ndarray:
    if type(value).__module__.split(".")[0] == "torch":
        torch = sys.modules["torch"]
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, as ml_dtypes'
            array = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            array = tensor.numpy()
    elif isinstance(value, np.ndarray) or hasattr(value, "__array__"):  # numpy, jax
        array = np.asarray(value)
    else:
        array = None
    if array is None or not (array.dtype.kind in "fiu"
                             or array.dtype.type.__module__ == "ml_dtypes"):
        raise ValueError(f"weights[{name!r:.120}]: {type(value).__name__} is not a numeric "
                         "array; give numpy, torch or jax arrays.")
    return array


class SleepMode:
    """LLMEngine's sleep mode and weight updates (see the module's docstring)."""

    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the KV cache and of the weights (level 1: kept in host
        memory; level 2: dropped, read again at wake_up). Needs enable_sleep_mode and no
        unfinished request."""
        level = check_level(level)
        check_enabled(self.config)
        if self._tracked:
            raise unfinished(len(self._tracked))
        self._settle()
        self.runner.sleep(level)
        self.kv_manager.reset_prefix_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what tags name ("weights", "kv_cache"; None: both) and sleeps: the
        weights from host memory, or from the model's folder after level 2 (unless updates
        gave them all); the KV cache as zeros of the same shape (nothing recompiles). The
        prefix cache starts empty."""
        tags = check_tags(tags)
        if self.is_sleeping():
            self.runner.wake_up(tags)
        self.kv_manager.reset_prefix_cache()

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are off the device (partly woken counts)."""
        return bool(getattr(self.runner, "sleeping", False))

    def update_weights(self, weights) -> int:
        """Replace the weights the given tensors map to (a dict {Hugging Face tensor name:
        array}, or a folder of safetensors: every tensor in it), each new value of its
        parameter's shape, placed on its sharding and dtype: nothing recompiles. Every
        tensor is checked before any weight changes (ValueError naming it). Asleep, it
        replaces the host copy (level 1) or gives the weights wake_up uses (level 2). The
        prefix cache is reset. Returns how many parameters changed."""
        weights = host_weights(weights)
        update = getattr(self.runner, "update_weights", None)
        if update is None:
            raise ValueError(f"update_weights runs on the JAX backend; this engine runs "
                             f"backend={self.config.backend!r}.")
        self._wait_for_steps()
        count = update(weights)
        self.kv_manager.reset_prefix_cache()
        return count

    def _check_awake(self) -> None:
        if getattr(self.runner, "sleeping", False):
            raise EngineSleepingError()

    def _settle(self) -> None:
        """Collect the steps still on the device (with no request left, asynchronous
        scheduling may have launched one past the last finish), before their arrays go."""
        parts, self._older, self._in_flight = self._older + self._in_flight, [], []
        self._launched_ahead = False
        self._collect(parts)

    def _wait_for_steps(self) -> None:
        """Wait for the steps in flight (their results stay to be collected), so no device
        work reads a weight while it is replaced."""
        for _, handle, _ in self._older + self._in_flight:
            with contextlib.suppress(Exception):  # (a failed step is the collector's news)
                self.runner.fetch(handle)
