"""Sleep mode and weight updates of the JAX runner: vLLM's sleep / wake_up, and the weight
updates reinforcement-learning trainers make between generation phases.

sleep(1) deletes the KV cache's device arrays and moves the weights to host memory (numpy
copies, then the device arrays deleted); sleep(2) deletes the weights without a copy.
wake_up brings each back: the weights from the host copy, or after level 2 from the model's
folder through the loader that started the runner (ModelRunner._load_model: the Hugging
Face checkpoint, an Orbax folder, or load_format="dummy"'s random weights), unless weight
updates meanwhile gave every parameter; the KV cache as zeros of its shape and sharding,
made by the compiled function that made it at start-up. The sampler's state, the LoRA slots
and a quantized cache's scales stay on the device (small); the compiled steps stay too.

update_weights replaces the parameters that the given tensors map to: a dict {Hugging Face
tensor name: host array} or a folder of safetensors, mapped by the family's param_path
through checkpoint.named_values / parameter_values as loading maps them (fused tensors,
kv heads repeated for tensor parallelism, int8 kernels quantized on the host:
weights.stored_values). Every tensor is checked, and every value made, before any
parameter is replaced. Each new array takes its parameter's shape, dtype and sharding, so
the compiled functions run on it as they are: nothing recompiles. While the weights sleep,
an update replaces the host copy (level 1) or gives the weights wake_up places (level 2).

A replica over several hosts (its lead host sends each step to the others) refuses both:
its other hosts' weights would not follow.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from flax import nnx

from jaxserve.backends.checkpoint import named_values, parameter_values
from jaxserve.backends.jax.weights import place, stored_values, weight_shapes
from jaxserve.models import model_family

WEIGHTS, KV_CACHE = "weights", "kv_cache"  # wake_up's tags, as vLLM's


class RunnerSleep:
    """One runner's sleep state: where its weights are ("device"; "host": level 1, in
    `host`; "dropped": level 2) and whether its KV cache is on the device."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.weights = "device"
        self.kv_on_device = True
        self.host: dict[tuple, np.ndarray] | None = None  # path -> value (level 1)
        self.given: dict[tuple, np.ndarray] = {}  # path -> value an update gave (level 2)

    @property
    def sleeping(self) -> bool:
        """Whether the weights or the KV cache are off the device."""
        return self.weights != "device" or not self.kv_on_device

    @property
    def level(self) -> int:
        """0 awake, 1 weights on the host, 2 weights dropped (the KV cache may be back)."""
        return {"device": 0, "host": 1, "dropped": 2}[self.weights]

    def sleep(self, level: int) -> None:
        """Free the KV cache, and the weights' device memory (level 1: copied to the host
        first). A level at or below the current one changes nothing but a KV cache woken
        alone; level 2 after level 1 drops the host copy."""
        runner = self.runner
        self._check_one_host("sleep")
        jax.block_until_ready([a for a in jax.tree.leaves(runner.kv_caches) if a is not None])
        if self.weights == "device":
            flat = _flat(runner.params)
            if level == 1:
                self.host = {path: np.asarray(jax.device_get(a)) for path, a in flat.items()}
            for array in flat.values():
                array.delete()
            runner.params = None
            self.weights = "host" if level == 1 else "dropped"
        elif self.weights == "host" and level == 2:
            self.host, self.weights = None, "dropped"
        if self.kv_on_device:
            n = runner.cache_tensors  # K and V, or one latent cache; then any scales
            for entry in runner.kv_caches:
                for array in entry[:n]:
                    array.delete()
            runner.kv_caches = [(None,) * n + tuple(entry[n:]) for entry in runner.kv_caches]
            self.kv_on_device = False

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Bring back what `tags` name (WEIGHTS, KV_CACHE) and is asleep: the weights
        first, so the KV cache's zeros come after them on the device."""
        runner = self.runner
        if WEIGHTS in tags and self.weights != "device":
            runner.params = self._weights_back()
            self.weights, self.host, self.given = "device", None, {}
        if KV_CACHE in tags and not self.kv_on_device:
            n = runner.cache_tensors
            runner.kv_caches = [tuple(runner._kv_zeros() for _ in range(n)) + tuple(entry[n:])
                                for entry in runner.kv_caches]
            self.kv_on_device = True

    def update_weights(self, weights: str | dict) -> int:
        """Replace the parameters the tensors of `weights` (a folder, or a dict of tensor
        name -> host array) map to; how many parameters (int8 scales not counted)."""
        scheme = self.runner.config.model.weights_scheme
        if scheme is not None and scheme != "int8":
            raise ValueError(f"update_weights: this model's checkpoint is published "
                             f"quantized ({self.runner.config.model.weights_label}); weight "
                             "updates take float tensors: serve a float checkpoint "
                             "(quantization='int8' quantizes the updates as it loads).")
        self._check_one_host("update_weights")
        values, count = self._new_values(weights)  # every tensor checked before any change
        if self.weights == "device":
            self.runner.params = _replaced(self.runner.params, values)
        elif self.weights == "host":
            self.host.update(values)
        else:
            self.given.update(values)
        return count

    # ---- helpers ------------------------------------------------------------------------
    def _check_one_host(self, what: str) -> None:
        if self.runner.channel is not None:
            raise ValueError(f"{what}: this data-parallel replica spans several hosts, whose "
                             "weights would no longer agree; sleep mode and weight updates "
                             "run on replicas of one host (a smaller model axis).")

    def _weights_back(self):
        """The parameters on the device again: the host copy, the parameters updates gave
        (when they gave all), or the model's folder with those given over it."""
        runner, spec = self.runner, self.runner._params_spec
        if self.weights == "host":
            return _placed(spec, self.host)
        if set(self.given) >= set(_flat(spec)):
            return _placed(spec, self.given)
        _, params = nnx.split(runner._load_model(nnx.merge(runner.graphdef, spec)))
        return _replaced(params, self.given) if self.given else params

    def _new_values(self, weights) -> tuple[dict[tuple, np.ndarray], int]:
        """{parameter path: host value in its stored dtype} for `weights`, int8 scales
        beside their kernels, and the number of parameters; ValueError naming the first
        tensor that does not fit."""
        runner = self.runner
        spec = _flat(runner._params_spec)
        shapes = weight_shapes(runner._params_spec)
        family = model_family(runner.config.model.hf_config)
        path_of = functools.partial(family.param_path, arch=runner.arch)
        dtype = np.dtype(runner.dtype)
        if isinstance(weights, (str, os.PathLike)):
            mapped = parameter_values(weights, path_of, shapes, dtype, partial=True)
        else:
            mapped = named_values(weights, path_of, shapes, dtype)
        values, count = {}, 0
        for path, value in mapped:
            count += 1
            for part, stored in stored_values(path, value, spec[path].dtype):
                values[part] = np.ascontiguousarray(stored, dtype=spec[part].dtype)
        return values, count


def _flat(state) -> dict[tuple, object]:
    """path -> leaf (array or ShapeDtypeStruct) of a parameter state."""
    return {tuple(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def _placed(spec, values: dict[tuple, np.ndarray]):
    """A parameter state of `values` placed as spec's ShapeDtypeStructs say."""
    return nnx.from_flat_state([
        (tuple(path), var.replace(place(values[tuple(path)], var.get_value().sharding)))
        for path, var in nnx.to_flat_state(spec)])


def _replaced(state, values: dict[tuple, np.ndarray]):
    """state with the parameters of `values` replaced, each new array on the old one's
    sharding; the old one deleted as soon as its successor is placed (the device holds one
    parameter twice at most)."""
    flat = []
    for path, var in nnx.to_flat_state(state):
        path = tuple(path)
        if path in values:
            old = var.get_value()
            var = var.replace(place(values[path], old.sharding))
            old.delete()
        flat.append((path, var))
    return nnx.from_flat_state(flat)
