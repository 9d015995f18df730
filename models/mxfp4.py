"""MXFP4 (OCP microscaling FP4) tensors as GPT-OSS checkpoints store their experts, numpy only.

A weight [..., rows, cols] is stored as `*_blocks` u8[..., rows, cols / 32, 16] (each byte
two e2m1 values, the low nibble first) and `*_scales` u8[..., rows, cols / 32] (one e8m0
exponent per 32 values, biased by 127): value = FP4[nibble] * 2 ** (scale - 127).
GPT-OSS stores each expert's weight as [out, in]; dequantize returns the [in, out] layout
of the unquantized checkpoint tensor in bfloat16 (transformers' convert_moe_packed_tensors
does the same). quantize is its inverse for values on the grid, used by tests to write MXFP4
folders.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# e2m1 values by nibble: sign bit 3, then exponent and mantissa
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values per shared exponent


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """bf16[..., cols, rows] from blocks u8[..., rows, G, 16] and scales u8[..., rows, G]
    (cols = 32 G): the stored [out, in] weight, transposed to [in, out]. Every e2m1 value
    times a power of two is exact in bfloat16 (its exponent range is float32's); computed
    one leading slice (expert) at a time, so the float32 work stays one expert's size."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}.")
    if blocks.ndim < 3 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}: "
                         "blocks are [..., rows, groups, 16] and scales [..., rows, groups].")
    lead, (rows, groups) = scales.shape[:-2], scales.shape[-2:]
    out = np.empty(lead + (groups * BLOCK, rows), ml_dtypes.bfloat16)
    flat_blocks = blocks.reshape((-1, rows, groups, BLOCK // 2))
    flat_scales = scales.reshape((-1, rows, groups))
    flat_out = out.reshape((-1, groups * BLOCK, rows))
    for i in range(flat_out.shape[0]):
        values = np.empty((rows, groups, BLOCK), np.float32)
        values[..., 0::2] = FP4_VALUES[flat_blocks[i] & 0x0F]
        values[..., 1::2] = FP4_VALUES[flat_blocks[i] >> 4]
        with np.errstate(over="ignore"):  # exponents past float32's give inf, as in HF
            values = np.ldexp(values, flat_scales[i].astype(np.int32)[..., None] - 127)
        flat_out[i] = values.reshape(rows, groups * BLOCK).T
    return out


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of a weight [..., cols, rows] (the [in, out] layout dequantize
    returns; cols a multiple of 32): each group of 32 scaled so that its largest magnitude
    fits 6, then rounded to the nearest e2m1 value."""
    stored = np.swapaxes(np.asarray(weight, np.float32), -1, -2)  # [..., rows, cols]
    if stored.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 groups {BLOCK} values; {stored.shape[-1]} is not a multiple.")
    groups = stored.reshape(stored.shape[:-1] + (-1, BLOCK))
    amax = np.abs(groups).max(-1)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0)
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    nibbles = np.abs(np.abs(scaled)[..., None] - FP4_VALUES[:8]).argmin(-1).astype(np.uint8)
    nibbles |= np.where(scaled < 0, 8, 0).astype(np.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return (np.ascontiguousarray(blocks, np.uint8),
            np.ascontiguousarray(exponent + 127, np.uint8))
