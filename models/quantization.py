"""int8 weights (`quantization="int8"`, `--quantization int8`): the linear layers' kernels
stored as int8 with one float32 scale per output channel, quantized when the weights load;
activations stay in the model's dtype.

A kernel w [..] with contracted (input) axes C becomes q = round(w / s) in [-127, 127] with
s = max |w| over C / 127 (symmetric, per output channel; s has w's shape with size 1 on C).
The models compute x @ q in their dtype and scale the result by s, which equals x @ (q * s):
the weights a step reads are int8, half of bfloat16's bytes. Mixture-of-experts kernels are
dequantized inside the step (q * s) before the expert computation.

Which kernels: the attention and MLP projections and the experts (not the embeddings, the
lm_head, the router or the norms, which are small or sensitive, as in vLLM's weight-only
int8 schemes).

This module is host side (numpy): the names, the checks and the quantization itself; the
models' int8 parameters and products are in models/jax/quantized.py.
"""

from __future__ import annotations

import numpy as np

QUANTIZATIONS = ("int8",)
SCALE_SUFFIX = "_scale"
# Contracted (input) axes of each quantized kernel, by parameter name.
CONTRACTED = {
    "wq": (0,), "wk": (0,), "wv": (0,),  # [D, N|K, H]
    "wo": (0, 1),  # [N, H, D]
    "w_gate": (0,), "w_up": (0,), "w_down": (0,),  # [D, F], [F, D]
    "experts_gate": (1,), "experts_up": (1,), "experts_down": (1,),  # [E, D, F], [E, F, D]
}


def check_quantization(value) -> str | None:
    """None or a supported method; ValueError naming the argument otherwise."""
    if value is None or value in QUANTIZATIONS:
        return value
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None (the "
                     f"checkpoint's own weights), got {value!r}; int8 quantizes the linear "
                     "layers' weights per output channel when they load.")


def scale_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    contracted = CONTRACTED[name]
    return tuple(1 if i in contracted else n for i, n in enumerate(shape))


def quantize_int8(value: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Host side: (int8 kernel, float32 scale) of one float kernel, per output channel."""
    w = np.asarray(value, np.float32)
    amax = np.max(np.abs(w), axis=CONTRACTED[name], keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def kernel_shapes(path: tuple, shape: tuple[int, ...],
                  quantization: str | None) -> dict[tuple, tuple[tuple[int, ...], str | None]]:
    """A kernel parameter's entries in a model's parameter table (path -> (shape, dtype), None
    for the model's dtype): the kernel itself, or its int8 values and float32 scale."""
    if quantization is None:
        return {path: (shape, None)}
    name = path[-1]
    return {path: (shape, "int8"),
            path[:-1] + (name + SCALE_SUFFIX,): (scale_shape(name, shape), "float32")}
