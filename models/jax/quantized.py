"""int8 kernels in the Flax models (models/quantization.py says what is quantized and
how): the parameters, the scaled products and dequantized kernels."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.models.quantization import CONTRACTED, SCALE_SUFFIX, scale_shape


def kernel(module: nnx.Module, name: str, shape: tuple[int, ...], dtype,
           quantization: str | None) -> None:
    """Give `module` the kernel parameter `name` (and, quantized, its `name`_scale)."""
    if quantization is None:
        setattr(module, name, nnx.Param(jnp.zeros(shape, dtype)))
        return
    setattr(module, name, nnx.Param(jnp.zeros(shape, jnp.int8)))
    setattr(module, name + SCALE_SUFFIX,
            nnx.Param(jnp.ones(scale_shape(name, shape), jnp.float32)))


def is_quantized(module: nnx.Module, name: str) -> bool:
    return hasattr(module, name + SCALE_SUFFIX)


def output_scale(module: nnx.Module, name: str):
    """The kernel's scale over its output axes only (to multiply a product by)."""
    scale = getattr(module, name + SCALE_SUFFIX)[...]
    return jnp.squeeze(scale, axis=CONTRACTED[name])


def matmul(spec: str, x, module: nnx.Module, name: str):
    """einsum(spec, x, kernel) in x's dtype; an int8 kernel's product is scaled per output
    channel (the kernel's axes must end the output, as in every projection here)."""
    w = getattr(module, name)[...]
    if not is_quantized(module, name):
        return jnp.einsum(spec, x, w)
    y = jnp.einsum(spec, x, w.astype(x.dtype))
    return (y.astype(jnp.float32) * output_scale(module, name)).astype(x.dtype)


def dequantized(module: nnx.Module, name: str, dtype):
    """The kernel in `dtype` (q * s when quantized)."""
    w = getattr(module, name)[...]
    if not is_quantized(module, name):
        return w
    return (w.astype(jnp.float32) * getattr(module, name + SCALE_SUFFIX)[...]).astype(dtype)
