"""The device's LoRA adapter slots (enable_lora) and the host cache that fills them.

For every kernel an adapter may target (the attention's and the dense MLP's projections,
models/lora.py), max_loras slots live on the device from the start, so the KV cache is
sized with them counted and no shape ever changes: A [S, *in, R] and B [S, R, *out]
(models/jax/lora.py), in the model's dtype, split on the mesh as their kernel is. Loading
an adapter into a slot is one compiled function (`write`, warmed up with the steps) that
sets the slot's values of every target, zeros where the adapter has none; the step reads the
arrays as they are, so adapters come and go without a compilation.

`AdapterCache` keeps up to max_cpu_loras adapters read from their folders (models/lora.py's
engine layout, as numpy in the model's dtype), the least recently used dropped first.
"""

from __future__ import annotations

import collections
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.backends.jax.weights import device_bytes, place
from jaxserve.config.lora import LoraConfig
from jaxserve.models.lora import load_adapter, lora_targets
from jaxserve.models.quantization import CONTRACTED

logger = logging.getLogger(__name__)

class AdapterCache:
    """Adapters read from their folders, by LoRARequest, max_cpu_loras at most."""

    def __init__(self, capacity: int, read) -> None:
        self.capacity, self._read = capacity, read  # read(lora) -> weights
        self._held: collections.OrderedDict = collections.OrderedDict()

    def get(self, lora):
        weights = self._held.pop(lora, None)
        if weights is None:
            weights = self._read(lora)
            while len(self._held) >= self.capacity:
                self._held.popitem(last=False)
        self._held[lora] = weights
        return weights


class DeviceLoras:
    """The adapter slots on the device, and which adapter each holds."""

    def __init__(self, config: LoraConfig, hf_config: dict, arch, shapes: dict, spec_of,
                 mesh: Mesh, dtype, np_dtype, allocate=lambda make: make()) -> None:
        """shapes: the family's param_shapes(arch) (unquantized); spec_of(kernel path) ->
        the kernel's PartitionSpec; arch: the runner's (kv heads as replicated); allocate:
        the runner's (its arrays, or their shapes when compiling only)."""
        self.config, self.mesh, self.np_dtype = config, mesh, np_dtype
        self.targets = lora_targets(shapes)
        slots, rank = config.max_loras, config.max_lora_rank
        self.holds: list = [None] * slots  # the adapter whose weights each slot has
        self.arrays, self.value_shardings, self._value_shapes = {}, {}, {}
        for key, (path, inputs, outputs) in self.targets.items():
            spec = tuple(spec_of(path)) + (None,) * (len(inputs) + len(outputs))
            in_spec = tuple(spec[i] for i in range(len(inputs) + len(outputs))
                            if i in CONTRACTED[path[-1]])
            out_spec = tuple(spec[i] for i in range(len(inputs) + len(outputs))
                             if i not in CONTRACTED[path[-1]])
            a_spec, b_spec = in_spec + (None,), (None,) + out_spec
            a_shape, b_shape = inputs + (rank,), (rank,) + outputs
            self._value_shapes[key] = (a_shape, b_shape)
            self.value_shardings[key] = (NamedSharding(mesh, PartitionSpec(*a_spec)),
                                         NamedSharding(mesh, PartitionSpec(*b_spec)))
            self.arrays[key] = tuple(allocate(
                jax.jit(functools.partial(jnp.zeros, (slots,) + shape, dtype),
                        out_shardings=NamedSharding(mesh, PartitionSpec(None, *part))))
                for shape, part in ((a_shape, a_spec), (b_shape, b_spec)))
        read = functools.partial(self._read, hf_config, arch)
        self.cache = AdapterCache(config.host_capacity, read)
        self._shardings = jax.tree.map(lambda a: a.sharding, self.arrays)
        self._write = jax.jit(_write_slot, out_shardings=self._shardings)
        logger.info("LoRA: %d adapter slots of rank %d over %d kernels (%.2f MiB per device).",
                    slots, rank, len(self.targets), self.device_bytes() / 2**20)

    def device_bytes(self) -> int:
        return device_bytes(self.arrays)

    def _read(self, hf_config: dict, arch, lora) -> dict:
        """An adapter's values for every target (zeros where it has none), as numpy."""
        loaded = load_adapter(lora.lora_path, hf_config, self.config.max_lora_rank,
                              arch=arch, dtype=self.np_dtype)  # (every value checked finite)
        values = {}
        for key, (path, _, _) in self.targets.items():
            a_shape, b_shape = self._value_shapes[key]
            pair = loaded.get(path)
            if pair is None:
                values[key] = (np.zeros(a_shape, self.np_dtype), np.zeros(b_shape, self.np_dtype))
            else:
                values[key] = (np.asarray(pair[0], self.np_dtype),
                               np.asarray(pair[1], self.np_dtype))
        logger.info("LoRA adapter %r (id %d) read from %s.", lora.lora_name, lora.lora_int_id,
                    lora.lora_path)
        return values

    def loads_for(self, requests) -> list[tuple[int, object]]:
        """(slot, adapter) for each slot a step's requests use whose weights are not the
        adapter's yet."""
        loads = {}
        for req in requests:
            slot = req.lora_slot
            if slot >= 0 and self.holds[slot] != req.lora:
                loads[slot] = req.lora
        return sorted(loads.items())

    def write(self, slot: int, lora, write) -> None:
        """Write an adapter's weights into a slot; write: the compiled _write_slot."""
        values = self.cache.get(lora)
        placed = {key: (place(a, self.value_shardings[key][0]),
                        place(b, self.value_shardings[key][1])) for key, (a, b) in values.items()}
        self.holds[slot] = None  # (until it is written)
        self.arrays = write(self.arrays, place(np.asarray(slot, np.int32), self._replicated),
                            placed)
        self.holds[slot] = lora

    @property
    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def lower_write(self) -> jax.stages.Lowered:
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        arrays = jax.tree.map(spec, self.arrays)
        values = {key: tuple(jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)
                             for shape, leaf, sharding in zip(
                                 self._value_shapes[key], self.arrays[key],
                                 self.value_shardings[key]))
                  for key in self.arrays}
        slot = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
        return self._write.lower(arrays, slot, values)


def _write_slot(arrays: dict, slot, values: dict) -> dict:
    """Every target's slot `slot` set to the adapter's values."""
    return {key: (a.at[slot].set(values[key][0]), b.at[slot].set(values[key][1]))
            for key, (a, b) in arrays.items()}
