"""Quantized kernels in the Flax models: int8 weights quantized while loading
(models/quantization.py) and checkpoints published quantized (models/quant_config.py),
with their parameters, products and dequantized kernels.

A checkpoint-quantized kernel is a QuantizedKernel holding its stored components
(quantization.stored_shapes). The step dequantizes it, w = (codes - zero) * scale in float32
per group of input rows and output column, cast to the activations' dtype, so the weights a
step reads stay in the checkpoint's bytes (1 per element for FP8 and INT8, 1/2 for 4-bit).
Activations are quantized as the checkpoint's scheme says (per token, per token and column
group, or with the static input_scale). Per-channel 8-bit kernels (FP8, W8A8) then multiply
codes by codes in an fp8 / int8 dot and scale the product, as the int8 path does; the
others round the activations to their codes, scale them back and multiply by the
dequantized kernel (the same numbers a blockwise fp8 matmul multiplies).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.jax.lora import ATTRIBUTE
from jaxserve.models.mxfp4 import FP4_VALUES
from jaxserve.models.quant_config import LinearQuant
from jaxserve.models.quantization import CONTRACTED, SCALE_SUFFIX, scale_shape, stored_shapes

_LIMITS = {"float8_e4m3fn": 448.0, "int8": 127.0}


class QuantizedKernel(nnx.Module):
    """One kernel of a checkpoint's scheme: its stored components as parameters, and the
    engine shape it dequantizes to."""

    def __init__(self, name: str, shape: tuple[int, ...], quant: LinearQuant) -> None:
        self.shape, self.quant, self.kernel_name = tuple(shape), quant, name
        for part, (part_shape, dtype) in stored_shapes(name, shape, quant).items():
            setattr(self, part, nnx.Param(jnp.zeros(part_shape, jnp.dtype(dtype))))

    @property
    def rows(self) -> int:
        return math.prod(self.shape[c] for c in CONTRACTED[self.kernel_name])

    def codes(self):
        """f32[*lead, C, O]: the stored codes as numbers (zero not yet taken away)."""
        values = self.values[...]
        if self.quant.packed:  # two codes per byte: the even row low, the odd row high
            values = jnp.stack([values & 0xF, values >> 4], axis=-2)
            values = values.reshape(values.shape[:-3] + (-1, values.shape[-1]))
        if self.quant.codes == "e2m1":
            return jnp.asarray(FP4_VALUES)[values]
        return values.astype(jnp.float32)

    def per_row(self, group_values):
        """[*lead, G, O] -> [*lead, C, O]: each input row's value of its group."""
        if self.quant.act_order:
            return jnp.take(group_values, self.g_idx[...], axis=-2)
        groups, rows = group_values.shape[-2], self.rows
        if groups == 1:
            return group_values
        return jnp.repeat(group_values, self.quant.group_size, axis=-2,
                          total_repeat_length=rows)

    def group_scales(self):
        """f32[*lead, G, O]."""
        scale = self.scale[...]
        if self.quant.codes == "e2m1":  # e8m0 exponents, bias 127
            return jnp.ldexp(jnp.float32(1), scale.astype(jnp.int32) - 127)
        return scale.astype(jnp.float32)

    def dequantized(self, dtype):
        """The kernel in its engine shape and `dtype`. Whole groups broadcast their scale
        over a [G, group, O] view of the codes (a gather per row, as jnp.repeat lowers to,
        would materialize a float32 copy of the kernel on the TPU)."""
        codes = self.codes()
        zero = (self.zero[...].astype(jnp.float32) if self.quant.zero_point
                else jnp.float32(self.quant.zero))
        scale = self.group_scales()
        group, rows = self.quant.group_size, self.rows
        if not self.quant.act_order and group and rows % group == 0 and rows > group:
            view = codes.reshape(codes.shape[:-2] + (rows // group, group, codes.shape[-1]))
            if self.quant.zero_point:
                zero = zero[..., None, :]
            w = (view - zero) * scale[..., None, :]
        else:
            if self.quant.zero_point:
                zero = self.per_row(zero)
            w = (codes - zero) * self.per_row(scale)
        return w.astype(dtype).reshape(self.shape)

    def scales_product(self) -> bool:
        """Per-channel 8-bit codes without zeros: the product is scaled instead."""
        return (not self.quant.packed and not self.quant.zero_point and not self.quant.zero
                and self.scale[...].shape[-2] == 1 and self.quant.codes != "uint8")


def kernel(module: nnx.Module, name: str, shape: tuple[int, ...], dtype,
           quantization) -> None:
    """Give `module` the kernel parameter `name`: plain; int8 with its `name`_scale; or, for
    a checkpoint's LinearQuant that covers it, a QuantizedKernel."""
    if isinstance(quantization, LinearQuant) and quantization.covers(name):
        setattr(module, name, QuantizedKernel(name, shape, quantization))
        return
    if quantization is None or isinstance(quantization, LinearQuant):
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


def _rounded_rows(x, quant: LinearQuant, contracted: int, input_scale=None):
    """(q, scale): x's last `contracted` axes flattened and grouped (the last
    group padded with zeros), [*lead, G, size] f32 divided by their scale [*lead, G, 1] and
    rounded to the activation codes' grid."""
    limit = _LIMITS[quant.activation_codes]
    xf = x.astype(jnp.float32)
    flat = xf.reshape(xf.shape[:xf.ndim - contracted] + (-1,))
    if quant.activations == "static":
        scale = input_scale.astype(jnp.float32)
        grouped = flat[..., None, :]
    else:
        size = quant.activation_group if quant.activations == "dynamic-group" else flat.shape[-1]
        padding = -flat.shape[-1] % size  # a last, partial group: zeros change no maximum
        flat = jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, padding)])
        grouped = flat.reshape(flat.shape[:-1] + (-1, size))
        amax = jnp.max(jnp.abs(grouped), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / limit, 1.0)
    q = jnp.clip(grouped / scale, -limit, limit)
    if quant.activation_codes == "int8":
        q = jnp.round(q)
    else:
        q = q.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return q, scale


def quantize_activations(x, quant: LinearQuant, contracted: int, input_scale=None):
    """x with its last `contracted` axes (one row per token) rounded to the scheme's
    activation codes and scaled back: per token, per token and column group, or by the
    static input_scale (the numbers an fp8 / int8 matmul multiplies). x itself when
    activations stay unquantized."""
    if quant.activations == "none":
        return x
    q, scale = _rounded_rows(x, quant, contracted, input_scale)
    columns = math.prod(x.shape[x.ndim - contracted:])
    rows = (q * scale).reshape(q.shape[:-2] + (-1,))[..., :columns]
    return rows.reshape(x.shape).astype(x.dtype)


def _quantized_product(spec: str, x, w: QuantizedKernel, contracted: int):
    """A per-channel 8-bit kernel's product: x's codes (per token or static scale) times the
    kernel's codes in an fp8 / int8 dot (f32 / i32 accumulation, the accelerator's
    low-precision matmul where XLA has one), scaled by both scales; or, with activations
    unquantized, x times the codes in x's dtype, scaled per output channel."""
    out_shape = w.shape[CONTRACTED[w.kernel_name][-1] + 1:]
    w_scale = w.group_scales().reshape(out_shape)
    if w.quant.activations == "none":
        y = jnp.einsum(spec, x, w.values[...].astype(x.dtype).reshape(w.shape))
        return (y.astype(jnp.float32) * w_scale).astype(x.dtype)
    q, x_scale = _rounded_rows(x, w.quant, contracted,
                               w.input_scale[...] if hasattr(w, "input_scale") else None)
    codes = jnp.dtype(w.quant.activation_codes)
    accumulate = jnp.int32 if codes == jnp.int8 else jnp.float32
    y = jnp.einsum(spec, q.reshape(x.shape).astype(codes),
                   w.values[...].reshape(w.shape).astype(codes),
                   preferred_element_type=accumulate).astype(jnp.float32)
    x_scale = x_scale.reshape(x_scale.shape[:-2] + (1,) * len(out_shape))
    return (y * x_scale * w_scale).astype(x.dtype)


# A grouped kernel's product is taken group by group on its codes (_grouped_product) while
# the per-group partial products [T, G, O] in float32 are no larger than the float32 codes
# a dequantized kernel writes out (T <= group size): the codes' conversion fuses into the
# dot, and at decode sizes nothing kernel-sized is written at all (XLA:TPU compile-only,
# a 4096 x 14336 int4 kernel in groups of 128: 0 MB of temporaries at 8 tokens and 118 MB
# at 64, against 470 MB dequantized).


def _groupable(w: QuantizedKernel, tokens: int) -> bool:
    quant, group, rows = w.quant, w.quant.group_size, w.rows
    if (quant.act_order or quant.codes == "e2m1" or not group or tokens > group
            or rows % group or rows == group or (quant.packed and group % 2)):
        return False
    return quant.activations == "none" or (quant.activations == "dynamic-group"
                                           and quant.activation_group == group)


def _accumulable(a, b):
    """Dot operands that accumulate in float32: as they are, but 16-bit floats in float32 on
    the CPU (XLA:CPU has no bf16 x bf16 -> f32 dot; it computes bf16 in f32 anyway)."""
    if jax.default_backend() == "cpu" and a.dtype in (jnp.bfloat16, jnp.float16):
        return a.astype(jnp.float32), b.astype(jnp.float32)
    return a, b


def _grouped_product(x, w: QuantizedKernel, contracted: int):
    """x times a grouped kernel, group by group: y[t, o] = sum_g s[g, o] (P[t, g, o] -
    z[g, o] X[t, g]) with P the product of x's columns of group g and the group's codes (two
    dots over the even and odd rows for two codes per byte) and X their sum; with
    activations rounded per group (block fp8), P is the fp8 dot of the codes scaled by the
    activations' group scales. The same sum as x times the dequantized kernel."""
    lead, out_shape = x.shape[:x.ndim - contracted], w.shape[CONTRACTED[w.kernel_name][-1] + 1:]
    rows, group = w.rows, w.quant.group_size
    groups, cols = rows // group, math.prod(out_shape)
    x2 = x.reshape(-1, rows)
    values = w.values[...].reshape(-1, cols)
    dot = lambda a, b: jnp.einsum("tgk,gko->tgo", *_accumulable(a, b),
                                  preferred_element_type=jnp.float32)
    if w.quant.activations == "dynamic-group":
        q, x_scale = _rounded_rows(x2, w.quant, 1)  # [T, G, group], [T, G, 1]
        codes = jnp.dtype(w.quant.activation_codes)
        products = dot(q.astype(codes), values.astype(codes).reshape(groups, group, cols))
        products = products * x_scale
    elif w.quant.packed:  # row 2j in the low nibble of packed row j, row 2j + 1 in the high
        pairs = x2.reshape(-1, groups, group // 2, 2)
        packed = values.reshape(groups, group // 2, cols)
        products = (dot(pairs[..., 0], (packed & 0xF).astype(x.dtype))
                    + dot(pairs[..., 1], (packed >> 4).astype(x.dtype)))
    else:
        products = dot(x2.reshape(-1, groups, group),
                       values.astype(x.dtype).reshape(groups, group, cols))
    if w.quant.zero_point or w.quant.zero:
        zero = (w.zero[...].astype(jnp.float32).reshape(groups, cols) if w.quant.zero_point
                else jnp.float32(w.quant.zero))
        sums = x2.astype(jnp.float32).reshape(-1, groups, group).sum(-1)[..., None]
        products = products - zero * sums
    y = (products * w.group_scales().reshape(groups, cols)).sum(1)
    return y.reshape(lead + out_shape).astype(x.dtype)


def matmul(spec: str, x, module: nnx.Module, name: str):
    """einsum(spec, x, kernel) in x's dtype; an int8 kernel's product is scaled per output
    channel (the kernel's axes must end the output, as in every projection here); a
    checkpoint-quantized kernel quantizes x as its scheme says: per-channel 8-bit kernels
    multiply codes by codes (_quantized_product), the others are dequantized in the step.
    With LoRA adapters in the step (models/jax/lora.py), their delta is added."""
    y = _product(spec, x, module, name)
    lora = getattr(module, ATTRIBUTE, None)
    delta = lora.delta(spec, x, name) if lora is not None else None
    return y if delta is None else y + delta.astype(y.dtype)


def _product(spec: str, x, module: nnx.Module, name: str):
    w = getattr(module, name)
    if isinstance(w, QuantizedKernel):
        contracted = len(CONTRACTED[name])
        if w.scales_product() and w.quant.activations in ("none", "dynamic-token", "static"):
            return _quantized_product(spec, x, w, contracted)
        if _groupable(w, math.prod(x.shape[:x.ndim - contracted])):
            return _grouped_product(x, w, contracted)
        x = quantize_activations(x, w.quant, contracted,
                                 w.input_scale[...] if hasattr(w, "input_scale") else None)
        return jnp.einsum(spec, x, w.dequantized(x.dtype))
    w = w[...]
    if not is_quantized(module, name):
        return jnp.einsum(spec, x, w)
    y = jnp.einsum(spec, x, w.astype(x.dtype))
    return (y.astype(jnp.float32) * output_scale(module, name)).astype(x.dtype)


def dequantized(module: nnx.Module, name: str, dtype):
    """The kernel in `dtype` (q * s when quantized)."""
    w = getattr(module, name)
    if isinstance(w, QuantizedKernel):
        return w.dequantized(dtype)
    w = w[...]
    if not is_quantized(module, name):
        return w
    return (w.astype(jnp.float32) * getattr(module, name + SCALE_SUFFIX)[...]).astype(dtype)


def activation_quantizer(module: nnx.Module, names: tuple[str, ...]):
    """For a mixture of experts: the function that quantizes an expert matmul's input rows
    as the experts' scheme says (dynamic schemes only), or None."""
    kernels = [getattr(module, n) for n in names]
    quant = kernels[0].quant if isinstance(kernels[0], QuantizedKernel) else None
    if quant is None or quant.activations == "none":
        return None
    return lambda rows: quantize_activations(rows, quant, 1)
