"""Checkpoints published quantized in the torch models: the twin of models/jax/quantized.py.

A checkpoint-quantized kernel is a QuantizedKernel module holding its stored components
(quantization.stored_shapes) as parameters named like them, so its parameter
"layers.0.attn.wq.values" is the JAX model's ("layers", 0, "attn", "wq", "values") and both
backends load the same components through checkpoint.parameter_values. The step
dequantizes it, w = (codes - zero) * scale in float32 per group of input rows and output
column, cast to the activations' dtype (bit for bit the JAX kernel's), and multiplies
(dequantize-then-matmul). Activations are rounded as the checkpoint's scheme says (per
token, per token and column group, or with the static input_scale), with JAX's formula.
Per-channel 8-bit kernels (FP8, W8A8) multiply codes by codes and scale the product, as the
JAX path does (the codes product in float32: exact while its partial sums stay below 2**24).
Grouped kernels are multiplied dequantized, the same sum that the JAX backend's group by
group products take in another order.

The models call `kernel` to build a kernel parameter (plain when the scheme does not cover
it), `matmul` for a projection, `weight` for a kernel (or one expert's) in a dtype, and
`activation_quantizer` for the rows entering a mixture of experts' matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from jaxserve.models.mxfp4 import FP4_VALUES
from jaxserve.models.quant_config import LinearQuant
from jaxserve.models.quantization import CONTRACTED, stored_shapes

_LIMITS = {"float8_e4m3fn": 448.0, "int8": 127.0}
_RECIPROCALS = {codes: torch.tensor(1 / limit, dtype=torch.float32).item()
                for codes, limit in _LIMITS.items()}  # float32 1 / limit
_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8, "uint8": torch.uint8,
           "int32": torch.int32, "float32": torch.float32}


_FP4_TABLES: dict = {}  # device -> f32[16]: e2m1 codes' values (made outside a graph capture)


def _fp4_table(device) -> torch.Tensor:
    if device not in _FP4_TABLES:
        _FP4_TABLES[device] = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return _FP4_TABLES[device]


def _param(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(tuple(shape), dtype=dtype), requires_grad=False)


class QuantizedKernel(nn.Module):
    """One kernel of a checkpoint's scheme: its stored components as parameters (values,
    scale, and as the scheme says zero, g_idx, input_scale), and the engine shape it
    dequantizes to."""

    def __init__(self, name: str, shape: tuple[int, ...], quant: LinearQuant) -> None:
        super().__init__()
        self.shape, self.quant, self.kernel_name = tuple(shape), quant, name
        for part, (part_shape, dtype) in stored_shapes(name, shape, quant).items():
            setattr(self, part, _param(part_shape, _DTYPES[dtype]))

    @property
    def lead(self) -> int:
        """Leading (expert) axes of the engine shape."""
        return CONTRACTED[self.kernel_name][0]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[c] for c in CONTRACTED[self.kernel_name])

    def _part(self, name: str, index: int | None):
        value = getattr(self, name)
        return value if index is None else value[index]

    def codes(self, index: int | None = None) -> torch.Tensor:
        """f32[*lead, C, O]: the stored codes as numbers (zero not yet taken away); one
        expert's [C, O] with `index`."""
        values = self._part("values", index)
        if self.quant.packed:  # two codes per byte: the even row low, the odd row high
            values = torch.stack([values & 0xF, values >> 4], dim=-2)
            values = values.reshape(*values.shape[:-3], -1, values.shape[-1])
        if self.quant.codes == "e2m1":
            return _fp4_table(values.device)[values.long()]
        return values.to(torch.float32)

    def per_row(self, group_values: torch.Tensor) -> torch.Tensor:
        """[*lead, G, O] -> [*lead, C, O]: each input row's value of its group."""
        if self.quant.act_order:
            return group_values.index_select(-2, self.g_idx.long())
        if group_values.shape[-2] == 1:
            return group_values
        repeated = group_values.repeat_interleave(self.quant.group_size, dim=-2)
        return repeated[..., :self.rows, :]

    def group_scales(self, index: int | None = None) -> torch.Tensor:
        """f32[*lead, G, O]."""
        scale = self._part("scale", index)
        if self.quant.codes == "e2m1":  # e8m0 exponents, bias 127
            one = torch.ones(scale.shape, dtype=torch.float32, device=scale.device)
            return torch.ldexp(one, scale.to(torch.int32) - 127)
        return scale.to(torch.float32)

    def dequantized(self, dtype, index: int | None = None) -> torch.Tensor:
        """The kernel in its engine shape and `dtype` (one expert's slice with `index`)."""
        codes = self.codes(index)
        if self.quant.zero_point:
            codes = codes - self.per_row(self._part("zero", index).to(torch.float32))
        elif self.quant.zero:
            codes = codes - self.quant.zero
        w = codes * self.per_row(self.group_scales(index))
        return w.to(dtype).reshape(self.shape if index is None else self.shape[1:])

    def scales_product(self) -> bool:
        """Per-channel 8-bit codes without zeros: the product is scaled instead."""
        return (not self.quant.packed and not self.quant.zero_point and not self.quant.zero
                and self.scale.shape[-2] == 1 and self.quant.codes != "uint8")

    def input_scale_or_none(self):
        return getattr(self, "input_scale", None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., C] (the contracted axes flattened) times the kernel as [C, O] -> [..., O]
        in x's dtype, activations quantized as the scheme says."""
        if self.lead:
            raise ValueError(f"{self.kernel_name}: stacked experts multiply one expert at a "
                             "time (weight(..., index=e)).")
        if self.scales_product() and self.quant.activations in ("none", "dynamic-token",
                                                                "static"):
            return self._quantized_product(x)
        x = quantize_activations(x, self.quant, self.input_scale_or_none())
        return x @ self.dequantized(x.dtype).reshape(self.rows, -1)

    def _quantized_product(self, x: torch.Tensor) -> torch.Tensor:
        """JAX's _quantized_product: x's codes times the kernel's codes (float32 products,
        float32 accumulation), scaled by both scales; with activations unquantized, x times
        the codes in x's dtype, scaled per output channel."""
        w_scale = self.group_scales().reshape(-1)  # f32[O]
        codes = self.values.reshape(self.rows, -1)
        if self.quant.activations == "none":
            y = x @ codes.to(x.dtype)
            return (y.float() * w_scale).to(x.dtype)
        q, x_scale = _rounded_rows(x, self.quant, self.input_scale_or_none())
        y = q.reshape(x.shape) @ codes.to(torch.float32)
        if x_scale.dim():
            x_scale = x_scale.reshape(*x_scale.shape[:-2], 1)
        return (y * x_scale * w_scale).to(x.dtype)


def kernel(module: nn.Module, name: str, shape: tuple[int, ...], dtype, quantization) -> None:
    """Give `module` the kernel parameter `name`: plain, or, for a checkpoint's LinearQuant
    that covers it, a QuantizedKernel. (int8 quantized while loading runs on the JAX backend
    only: EngineConfig refuses it on torch.)"""
    if quantization is not None and not isinstance(quantization, LinearQuant):
        raise ValueError(f"quantization={quantization!r} runs on the JAX backend only; the "
                         "torch models take a checkpoint's scheme (LinearQuant) or None.")
    if quantization is not None and quantization.covers(name):
        setattr(module, name, QuantizedKernel(name, shape, quantization))
    else:
        setattr(module, name, _param(shape, dtype))


def weight(module: nn.Module, name: str, dtype, index: int | None = None) -> torch.Tensor:
    """The kernel `name` in its engine shape (one expert's slice with `index`), dequantized
    to `dtype` when quantized."""
    w = getattr(module, name)
    if isinstance(w, QuantizedKernel):
        return w.dequantized(dtype, index)
    return w if index is None else w[index]


def matmul(x: torch.Tensor, module: nn.Module, name: str) -> torch.Tensor:
    """x [..., C] times the kernel `name` as [C, O] (its contracted axes and its output axes
    flattened) -> [..., O]: a quantized kernel as its scheme runs it (QuantizedKernel.matmul)."""
    w = getattr(module, name)
    if isinstance(w, QuantizedKernel):
        return w.matmul(x)
    rows = math.prod(w.shape[c] for c in CONTRACTED[name])
    return x @ w.reshape(rows, -1)


def _rounded_rows(x: torch.Tensor, quant: LinearQuant, input_scale=None):
    """(q, scale): x's last axis grouped (the last group padded with zeros), [*lead, G, size]
    f32 divided by their scale [*lead, G, 1] and rounded to the activation codes' grid."""
    limit = _LIMITS[quant.activation_codes]
    flat = x.to(torch.float32)
    if quant.activations == "static":
        scale = input_scale.to(torch.float32)
        grouped = flat[..., None, :]
    else:
        size = quant.activation_group if quant.activations == "dynamic-group" else flat.shape[-1]
        padding = -flat.shape[-1] % size  # a last, partial group: zeros change no maximum
        if padding:
            flat = F.pad(flat, (0, padding))
        grouped = flat.reshape(*flat.shape[:-1], -1, size)
        amax = grouped.abs().amax(dim=-1, keepdim=True)
        # amax / limit as XLA computes it (a division by a constant becomes a product by its
        # float32 reciprocal), so that the scales are the JAX backend's bit for bit
        scale = torch.where(amax > 0, amax * _RECIPROCALS[quant.activation_codes],
                            torch.ones_like(amax))
    q = torch.clamp(grouped / scale, -limit, limit)
    if quant.activation_codes == "int8":
        q = torch.round(q)
    else:
        q = q.to(torch.float8_e4m3fn).to(torch.float32)
    return q, scale


def quantize_activations(x: torch.Tensor, quant: LinearQuant, input_scale=None):
    """x [..., C] rounded to the scheme's activation codes and scaled back: per row (token),
    per row and column group, or by the static input_scale (the numbers an fp8 / int8
    matmul multiplies). x itself when activations stay unquantized."""
    if quant.activations == "none":
        return x
    q, scale = _rounded_rows(x, quant, input_scale)
    rows = (q * scale).reshape(*q.shape[:-2], -1)[..., :x.shape[-1]]
    return rows.reshape(x.shape).to(x.dtype)


def activation_quantizer(module: nn.Module, names: tuple[str, ...]):
    """For a mixture of experts: the function that quantizes an expert matmul's input rows
    as the experts' scheme says (dynamic schemes only), or None."""
    first = getattr(module, names[0])
    quant = first.quant if isinstance(first, QuantizedKernel) else None
    if quant is None or quant.activations == "none":
        return None
    return lambda rows: quantize_activations(rows, quant)


def component_names(model: nn.Module) -> set[str]:
    """The parameter names of every QuantizedKernel's components in `model`."""
    return {f"{prefix}.{part}" for prefix, module in model.named_modules()
            if isinstance(module, QuantizedKernel) for part, _ in module.named_parameters()}


@torch.no_grad()
def fill_dummy_component(param: torch.Tensor, part: str, generator) -> None:
    """Random stored component (load_format dummy), as the JAX backend makes them
    (backends/jax/weights.py): codes over their whole range, zeros at the middle, scales
    making magnitudes near 1e-3 (MXFP4: exponent 2**-10), groups in row order."""
    if part == "values":
        if param.dtype == torch.uint8:
            param.random_(0, 256, generator=generator)
        elif param.dtype == torch.int8:
            param.random_(-127, 128, generator=generator)
        else:
            codes = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            param.copy_(codes.uniform_(-448, 448, generator=generator).to(param.dtype))
    elif part == "scale":
        param.fill_(117 if param.dtype == torch.uint8 else 1e-3 / 8)
    elif part == "zero":
        param.fill_(8)
    elif part == "g_idx":
        param.zero_()
    else:  # input_scale
        param.fill_(1e-2)
