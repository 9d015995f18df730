"""Weight loading for the JAX backend: checkpoint parameters (checkpoint.py) placed straight
into device arrays on their shardings, one parameter at a time; or random weights made on the
devices.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.backends.checkpoint import parameter_values
from jaxserve.config.progress import progress
from jaxserve.models.quant_config import LinearQuant
from jaxserve.models.quantization import COMPONENTS, SCALE_SUFFIX, quantize_int8


def place(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array onto its sharding, each device taking only its slice. With several
    processes (multi-host) every process holds the same value and fills its own devices."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def device_bytes(tree) -> int:
    """Bytes of one device's shard of every array (or ShapeDtypeStruct with a sharding) of
    tree: the shardings here split evenly."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree))


def load_params(abstract_model: nnx.Module, folder: str | Path, path_of, dtype, mesh: Mesh,
                spec_of=lambda path: PartitionSpec(),
                quant: LinearQuant | None = None) -> nnx.Module:
    """Fill an abstract (eval_shape'd) model with the checkpoint's tensors (path_of as
    checkpoint.parameter_values), each placed on its sharding as soon as it is read; an int8
    kernel (quantization.py) is quantized on the host first and placed with its scale; a
    checkpoint-quantized kernel's components (quant: the checkpoint's LinearQuant) are
    placed as read. spec_of(path) -> PartitionSpec for that parameter on `mesh`."""
    graphdef, state = nnx.split(abstract_model)
    expected = {tuple(path): var for path, var in nnx.to_flat_state(state)}
    shapes = weight_shapes(state)
    put = lambda path, value: place(value, NamedSharding(mesh, spec_of(path)))
    loaded = {}
    for path, value in parameter_values(folder, path_of, shapes, dtype, quant):
        for part, stored in stored_values(path, value, expected[path].get_value().dtype):
            loaded[part] = put(part, stored)
    flat = [(path, var.replace(loaded[path])) for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def weight_shapes(state) -> dict[tuple, tuple]:
    """path -> shape of the parameters a checkpoint gives (parameter_values' `shapes`) in a
    model's state (arrays or ShapeDtypeStructs): every one but an int8 kernel's scale, which
    is made with its kernel (a checkpoint-quantized kernel's components are given)."""
    return {tuple(path): var.get_value().shape for path, var in nnx.to_flat_state(state)
            if path[-1] in COMPONENTS or not str(path[-1]).endswith(SCALE_SUFFIX)}


def stored_values(path: tuple, value: np.ndarray, dtype) -> list[tuple[tuple, np.ndarray]]:
    """A parameter's host value as the engine stores it (dtype: its array's): a
    checkpoint-quantized kernel's component in its own dtype; an int8 kernel quantized on
    the host (quantization.py), its scale beside it; any other as it comes."""
    if path[-1] in COMPONENTS:
        return [(path, value.astype(dtype))]
    if dtype == np.int8:
        value, scale = quantize_int8(value, str(path[-1]))
        return [((*path[:-1], str(path[-1]) + SCALE_SUFFIX), scale), (path, value)]
    return [(path, value)]


def random_params(abstract_model: nnx.Module, mesh: Mesh, seed: int,
                  spec_of=lambda path: PartitionSpec()) -> nnx.Module:
    """Fill an abstract model with random weights made on the devices, each device drawing
    only its own shard (load_format="dummy": a model's shape without its checkpoint, for
    benchmarks). Values are uniform in [-1e-3, 1e-3], as vLLM's dummy weights."""
    graphdef, state = nnx.split(abstract_model)
    flat = []
    key = jax.random.key(seed)
    makers = {}  # one compiled maker per (shape, dtype, sharding): layers share them
    leaves = list(nnx.to_flat_state(state))
    for i, (path, var) in enumerate(progress(leaves, desc="Random weights", unit="tensor")):
        like = var.get_value()
        sharding = NamedSharding(mesh, spec_of(path))
        part = str(path[-1]) if path[-1] in COMPONENTS else None
        signature = (like.shape, jax.numpy.dtype(like.dtype), sharding,
                     str(path[-1]).endswith(SCALE_SUFFIX) and part is None, part)
        if part is not None and signature not in makers:
            makers[signature] = _component_maker(part, like, sharding)
        if signature not in makers:
            if like.dtype == np.int8:  # an int8 kernel: its scales below make it +-1e-3
                make = lambda k, shape=like.shape: jax.random.randint(k, shape, -127, 128,
                                                                       np.int8)
            elif signature[3]:
                make = lambda k, shape=like.shape: jax.numpy.full(shape, 1e-3 / 127,
                                                                  np.float32)
            else:
                make = lambda k, shape=like.shape, dtype=like.dtype: jax.random.uniform(
                    k, shape, dtype, -1e-3, 1e-3)
            makers[signature] = jax.jit(make, out_shardings=sharding)
        flat.append((path, var.replace(makers[signature](jax.random.fold_in(key, i)))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _component_maker(part: str, like, sharding):
    """Random stored components of a checkpoint-quantized kernel (load_format dummy): codes
    over their whole range, zeros at the middle, unit-scale magnitudes near 1e-3 (MXFP4:
    exponent 2**-10), groups in row order."""
    shape, dtype = like.shape, like.dtype
    if part == "values":
        if dtype == np.uint8:
            make = lambda k: jax.random.randint(k, shape, 0, 256, np.int32).astype(np.uint8)
        elif dtype == np.int8:
            make = lambda k: jax.random.randint(k, shape, -127, 128, np.int8)
        else:
            make = lambda k: jax.random.uniform(k, shape, np.float32, -448, 448).astype(dtype)
    elif part == "scale":
        fill = 117 if dtype == np.uint8 else 1e-3 / 8
        make = lambda k: jax.numpy.full(shape, fill, dtype)
    elif part == "zero":
        make = lambda k: jax.numpy.full(shape, 8, dtype)
    elif part == "g_idx":
        make = lambda k: jax.numpy.arange(shape[0], dtype=dtype) * 0
    else:
        make = lambda k: jax.numpy.full(shape, 1e-2, dtype)
    return jax.jit(make, out_shardings=sharding)
