"""One host<->device transfer per step: many small arrays packed into one int32 buffer.

A step's inputs are ~20 small arrays; putting them on the device one by one costs more than
the step itself for small models. The host packs them into one flat int32 buffer (float32
and uint32 bit-cast, bool widened) with a static layout (the input builder writes a step's
values straight into such a buffer: core/input_builder.py's PackedStep), and the jitted
step unpacks it with free slices. Results go the other way the same way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# (name, shape, dtype name) per array, in packing order. Hashable: a static jit argument.
Layout = tuple[tuple[str, tuple[int, ...], str], ...]


def layout_of(arrays: dict[str, np.ndarray]) -> Layout:
    return tuple((name, tuple(a.shape), a.dtype.name) for name, a in arrays.items())


def unpack(buffer: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    """Device side (inside jit): the arrays back, by static slices."""
    out, offset = {}, 0
    for name, shape, dtype in layout:
        size = math.prod(shape)
        part = buffer[offset: offset + size]
        if dtype == "bool":
            part = part != 0
        elif dtype != "int32":
            part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        out[name] = part.reshape(shape)
        offset += size
    return out


def pack_device(arrays) -> jax.Array:
    """Device side: a pytree of 32-bit arrays as one flat f32 buffer."""
    leaves = jax.tree_util.tree_leaves(arrays)
    return jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.float32).reshape(-1)
                            if x.dtype != jnp.float32 else x.reshape(-1) for x in leaves])


def unpack_host(buffer: np.ndarray, like):
    """Host side: the pytree `like` (of shape/dtype structs) rebuilt from a pack_device
    buffer, as numpy views."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    out, offset = [], 0
    for leaf in leaves:
        size = math.prod(leaf.shape)
        out.append(buffer[offset: offset + size].view(leaf.dtype).reshape(leaf.shape))
        offset += size
    return jax.tree_util.tree_unflatten(treedef, out)
