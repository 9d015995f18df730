"""Sleep mode and weight updates, engine side: vLLM's sleep / wake_up / is_sleeping, and the
weight updates reinforcement-learning trainers make between generation phases.

The engine's side is LLMEngine's own methods (sleep, wake_up, is_sleeping, update_weights:
they act on its config, runner, KV manager, tracked requests and steps in flight); the
runner does the device work (backends/jax/sleep.py). This module holds what every front end
shares: the argument checks and errors. The data-parallel front end, the engine core client
(a utility call to the core process) and the server (server/engine_calls.py,
server/dev_routes.py) check with the same functions.

Choices where vLLM leaves it open: sleeping again at the same or a lower level, and waking
what is awake, change nothing; a deeper level (2 after 1) drops the host copy of the weights.
sleep() refuses while requests are unfinished (RequestsUnfinishedError), and a sleeping
engine refuses new requests and steps (EngineSleepingError). Whatever woke up, the prefix
cache is reset: the cached blocks' contents are gone, and after a weight update they were
computed with other weights.
"""

from __future__ import annotations

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
