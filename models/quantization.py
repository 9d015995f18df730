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

Checkpoints published quantized (quant_config.py: FP8, compressed-tensors, AWQ, GPTQ,
MXFP4) keep their own codes instead: each quantized kernel becomes a group of stored
components (stored_shapes) that the step dequantizes.

This module is host side (numpy): the names, the checks and the quantization itself; the
models' quantized parameters and products are in models/jax/quantized.py.
"""

from __future__ import annotations

import math

import numpy as np

from jaxserve.models.quant_config import LinearQuant

QUANTIZATIONS = ("int8",)
# `quantization` may also name the checkpoint's own format (as vLLM's --quantization does):
# it must then match the checkpoint's quantization_config (checkpoint_scheme).
CHECKPOINT_METHODS = {"fp8": "fp8", "compressed-tensors": "compressed-tensors",
                      "compressed_tensors": "compressed-tensors", "awq": "awq",
                      "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
                      "mxfp4": "mxfp4"}
SCALE_SUFFIX = "_scale"
# Contracted (input) axes of each quantized kernel, by parameter name.
CONTRACTED = {
    "wq": (0,), "wk": (0,), "wv": (0,),  # [D, N|K, H]
    "wo": (0, 1),  # [N, H, D]
    "w_gate": (0,), "w_up": (0,), "w_down": (0,),  # [D, F], [F, D]
    "experts_gate": (1,), "experts_up": (1,), "experts_down": (1,),  # [E, D, F], [E, F, D]
    # multi-head latent attention (DeepSeek): [D, Q], [Q, N, P + R], [D, C + R], [C, N, P|V]
    "wq_a": (0,), "wq_b": (0,), "wkv_a": (0,), "wk_b": (0,), "wv_b": (0,),
}


def check_quantization(value) -> str | None:
    """None or a supported method; ValueError naming the argument otherwise."""
    if value is None or value in QUANTIZATIONS or value in CHECKPOINT_METHODS:
        return value
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None (the "
                     f"checkpoint's own weights, quantized or not), or the checkpoint's own "
                     f"format ({', '.join(CHECKPOINT_METHODS)}), got {value!r}; int8 quantizes "
                     "the linear layers' weights per output channel when they load.")


def checkpoint_scheme(quantization: str | None, hf_config: dict, model: str = "the model"):
    """The weights' scheme a model is built with: None (the checkpoint's float weights),
    "int8" (quantized while loading) or the checkpoint's LinearQuant; ValueError when the
    checkpoint's quantization_config is unsupported or `quantization` contradicts it."""
    from jaxserve.models.quant_config import checkpoint_quant

    quant = checkpoint_quant(hf_config)
    if quantization is None:
        return quant
    if quantization in QUANTIZATIONS:
        if quant is not None:
            raise ValueError(f"quantization={quantization!r} quantizes float weights while "
                             f"they load, but {model} is already quantized ({quant.label}). "
                             "Drop quantization to serve it as published.")
        return quantization
    method = CHECKPOINT_METHODS[quantization]
    if quant is None:
        raise ValueError(f"quantization={quantization!r} names a checkpoint format, but "
                         f"{model}'s config.json has no quantization_config (its weights are "
                         "unquantized). Drop quantization, or use 'int8' to quantize the "
                         "weights while they load.")
    if method != quant.method:
        raise ValueError(f"quantization={quantization!r} does not match {model}'s "
                         f"quantization_config ({quant.method}: {quant.label}); drop "
                         f"quantization or pass {quant.method!r}.")
    return quant


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


# A checkpoint-quantized kernel's stored parts (stored_shapes), under the kernel's path.
COMPONENTS = ("values", "scale", "zero", "g_idx", "input_scale")
CODE_DTYPES = {"float8_e4m3fn": "float8_e4m3fn", "int8": "int8", "uint8": "uint8",
               "uint4": "uint8", "e2m1": "uint8"}


def stored_shapes(name: str, shape: tuple[int, ...],
                  quant: LinearQuant) -> dict[str, tuple[tuple[int, ...], str]]:
    """The stored components of kernel `name` of engine shape `shape` under a checkpoint's
    scheme, {component: (shape, dtype)}: values [*lead, C, O] (C / 2 for two 4-bit codes
    per byte), scale (and zero) [*lead, G, O], g_idx i32[C] with activation order,
    input_scale f32[*lead] with static activation scales. lead: the expert axis; C: the
    contracted axes flattened; O: the output axes flattened; G: groups of C."""
    contracted = CONTRACTED[name]
    lead = tuple(shape[:contracted[0]])
    rows = math.prod(shape[c] for c in contracted)
    out = math.prod(shape[contracted[-1] + 1:])
    groups = -(-rows // quant.group_size) if quant.group_size else 1
    parts = {"values": (lead + (rows // 2 if quant.packed else rows, out),
                        CODE_DTYPES[quant.codes]),
             "scale": (lead + (groups, out), quant.scale_dtype)}
    if quant.zero_point:
        parts["zero"] = (lead + (groups, out), "uint8")
    if quant.act_order:
        if lead:
            raise ValueError("activation order (g_idx) on stacked experts is not supported; "
                             "the checkpoint's quantization_config asks for it.")
        parts["g_idx"] = ((rows,), "int32")
    if quant.activations == "static":
        if lead:
            raise ValueError("static activation scales on experts are not supported; use a "
                             "checkpoint with dynamic activation quantization.")
        parts["input_scale"] = (lead, "float32")
    return parts


def kernel_shapes(path: tuple, shape: tuple[int, ...],
                  quantization) -> dict[tuple, tuple[tuple[int, ...], str | None]]:
    """A kernel parameter's entries in a model's parameter table (path -> (shape, dtype), None
    for the model's dtype): the kernel itself, its int8 values and float32 scale, or (a
    checkpoint's LinearQuant covering it) its stored components under its path."""
    if quantization is None:
        return {path: (shape, None)}
    name = path[-1]
    if isinstance(quantization, LinearQuant):
        if not quantization.covers(name):
            return {path: (shape, None)}
        return {path + (part,): entry
                for part, entry in stored_shapes(name, shape, quantization).items()}
    return {path: (shape, "int8"),
            path[:-1] + (name + SCALE_SUFFIX,): (scale_shape(name, shape), "float32")}
