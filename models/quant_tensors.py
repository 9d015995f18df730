"""The tensors of a quantized checkpoint (quant_config.py says which format) read into the
engine's stored layout, numpy only.

A quantized linear module `X` arrives as several tensors (`X.weight` + `X.weight_scale_inv`,
`X.qweight` + `X.qzeros` + `X.scales` + `X.g_idx`, ...). `pieces` names the ones each format
stores; once a module's have all arrived, `combine` reads them into a QuantTensor: the
per-element codes (4-bit ones unpacked to one per byte) in the layout the unquantized tensor
`X.weight` would have, with a scale (and zero) per group of input rows and output column.
The model family then maps `X.weight` to its parameter(s) with its usual transform
(transposes, head reshapes, kv-head repeats, fused-projection slices), and `engine_layout`
carries the codes, scales and zeros through that same transform: every stored kernel is
[*lead, C, O] (lead: the expert axis of stacked experts; C: the contracted input rows,
flattened; O: the outputs, flattened), 4-bit codes packed two per byte along C, scales and
zeros [*lead, G, O] for G groups of C.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from jaxserve.models.quant_config import LinearQuant

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: the output column of each nibble, per word
_PIECES = {
    "fp8-block": (("weight", "weight_scale_inv"), ("input_scale",)),
    "fp8": (("weight", "weight_scale"), ("input_scale",)),
    "ct-float": (("weight", "weight_scale"), ("input_scale", "weight_g_idx")),
    "ct-int": (("weight", "weight_scale"), ("input_scale", "weight_zero_point",
                                            "weight_g_idx")),
    "ct-pack": (("weight_packed", "weight_scale", "weight_shape"),
                ("weight_zero_point", "weight_g_idx")),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
}


@dataclasses.dataclass
class QuantTensor:
    """One quantized kernel as read from the checkpoint, in the unquantized tensor's layout.

    codes: the quantized values (uint8 0..15 for 4-bit, float8_e4m3fn, int8 or uint8);
    in_axis: the input (contracted) axis of codes; scale: codes' shape with in_axis of size
    G (float32, or uint8 e8m0 exponents for MXFP4); zero: like scale (uint8) or None;
    g_idx: i32[C] group of each input row, or None; input_scale: f32 static activation
    scale, or None."""

    codes: np.ndarray
    in_axis: int
    scale: np.ndarray
    zero: np.ndarray | None = None
    g_idx: np.ndarray | None = None
    input_scale: np.ndarray | None = None

    @property
    def shape(self) -> tuple:
        return self.codes.shape


def pieces(quant: LinearQuant, module: str, names: set[str]) -> tuple[str, ...] | None:
    """The tensor suffixes module `module` stores under `quant`'s format (its required ones
    and the optional ones present in `names`), or None when `module` is not stored
    quantized (its plain `.weight` is a float tensor: checked by the loader)."""
    if quant.format == "mxfp4":
        return None  # GPT-OSS's family maps its own *_blocks / *_scales (gpt_oss_arch.py)
    required, optional = _PIECES[quant.format]
    if f"{module}.{required[0]}" not in names or not any(
            f"{module}.{p}" in names for p in required[1:]):
        return None
    return required + tuple(p for p in optional if f"{module}.{p}" in names)


def is_piece(quant: LinearQuant, suffix: str) -> bool:
    return quant.format != "mxfp4" and suffix in (lambda r, o: r + o)(*_PIECES[quant.format])


def combine(quant: LinearQuant, got: dict[str, np.ndarray], where: str) -> QuantTensor:
    """One module's pieces (suffix -> array) read into a QuantTensor; ValueError naming the
    module and the fault when they do not fit together."""
    try:
        return _READERS[quant.format](quant, got)
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: its {quant.method} tensors ({', '.join(sorted(got))}) do "
                         f"not fit together: {e}") from None


def _float(array) -> np.ndarray:
    return np.asarray(array).astype(np.float32)


def _expand_rows(scale: np.ndarray, rows: int, out: int) -> np.ndarray:
    """Block scales [..., ceil(O / rows), G] as one row per output channel [..., O, G]."""
    if scale.shape[-2] != -(-out // rows):
        raise ValueError(f"scales have {scale.shape[-2]} row blocks, but {out} rows in blocks "
                         f"of {rows} need {-(-out // rows)}")
    return np.repeat(scale, rows, axis=-2)[..., :out, :]


def _per_channel(scale: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """A per-tensor ([], [1]) or per-channel ([..., O, 1] / [..., O]) scale as [..., O, G]."""
    scale = _float(scale)
    out = codes.shape[:-1]
    if scale.size == 1:
        return np.full(out + (1,), scale.reshape(()), np.float32)
    if scale.shape == out:
        scale = scale[..., None]
    return scale


def _check_groups(scale: np.ndarray, codes: np.ndarray, group: int) -> None:
    rows, cols = codes.shape[-2], codes.shape[-1]
    groups = -(-cols // group) if group else 1
    if scale.shape[-2:] != (rows, groups):
        raise ValueError(f"scales {scale.shape} do not fit codes {codes.shape} in groups of "
                         f"{group or cols} input columns (expected [..., {rows}, {groups}])")


def _fp8_codes(weight) -> np.ndarray:
    if weight.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"weight is {weight.dtype}, not float8_e4m3fn (F8_E4M3)")
    return np.asarray(weight)


def _input_scale(got: dict, quant: LinearQuant) -> np.ndarray | None:
    if quant.activations != "static":
        return None
    if "input_scale" not in got:
        raise ValueError("input_scale is missing (static activation scales)")
    scale = _float(got["input_scale"])
    if scale.size != 1:
        raise ValueError(f"input_scale has shape {scale.shape}; one value per kernel is read")
    return scale.reshape(())


def _g_idx(got: dict, quant: LinearQuant, cols: int, key: str) -> np.ndarray | None:
    """The row -> group map when the scheme uses activation order; without it a stored
    g_idx must be the plain one (row // group_size)."""
    g_idx = got.get(key)
    if g_idx is None:
        if quant.act_order:
            raise ValueError(f"{key} is missing (activation order)")
        return None
    g_idx = np.asarray(g_idx).astype(np.int32).reshape(-1)
    if g_idx.shape != (cols,):
        raise ValueError(f"{key} has {g_idx.size} entries for {cols} input columns")
    if quant.act_order:
        return g_idx
    plain = np.arange(cols, dtype=np.int32) // (quant.group_size or cols)
    if not np.array_equal(g_idx, plain):
        raise ValueError(f"{key} reorders the input columns, but quantization_config does not "
                         "say activation order (desc_act / actorder)")
    return None


def _read_fp8_block(quant: LinearQuant, got: dict) -> QuantTensor:
    codes = _fp8_codes(got["weight"])
    scale = _float(got["weight_scale_inv"])
    scale = _expand_rows(scale, quant.block_rows, codes.shape[-2])
    _check_groups(scale, codes, quant.group_size)
    return QuantTensor(codes, -1, scale)


def _read_float(quant: LinearQuant, got: dict) -> QuantTensor:
    """fp8 per tensor, compressed-tensors float-quantized and int-quantized."""
    codes = got["weight"]
    if quant.codes == "float8_e4m3fn":
        codes = _fp8_codes(codes)
    elif codes.dtype != np.int8:
        raise ValueError(f"weight is {codes.dtype}, not int8")
    scale = got["weight_scale"]
    if quant.block_rows:
        scale = _expand_rows(_float(scale), quant.block_rows, codes.shape[-2])
    scale = _per_channel(scale, codes) if not quant.group_size else _float(scale)
    _check_groups(scale, codes, quant.group_size)
    if "weight_zero_point" in got and np.any(np.asarray(got["weight_zero_point"]) != 0):
        raise ValueError("weight_zero_point is nonzero but the weights are symmetric")
    return QuantTensor(codes, -1, scale, g_idx=_g_idx(got, quant, codes.shape[-1],
                                                      "weight_g_idx"),
                       input_scale=_input_scale(got, quant))


def _unpack_int32(packed: np.ndarray, bits: int, count: int, axis: int) -> np.ndarray:
    """compressed-tensors' dense little-endian packing: element i at bit i * bits of the
    int32 words along `axis` (8 per word for 4 bits, 4 for 8); the first `count`."""
    words = np.asarray(packed).astype(np.int64) & 0xFFFFFFFF
    per = 32 // bits
    shifts = np.arange(per, dtype=np.int64) * bits
    moved = np.moveaxis(words, axis, -1)
    values = ((moved[..., None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8)
    values = values.reshape(moved.shape[:-1] + (-1,))
    if values.shape[-1] < count:
        raise ValueError(f"{moved.shape[-1]} packed words hold {values.shape[-1]} values, "
                         f"fewer than {count}")
    return np.moveaxis(values[..., :count], -1, axis)


def _read_ct_pack(quant: LinearQuant, got: dict) -> QuantTensor:
    shape = [int(n) for n in np.asarray(got["weight_shape"]).reshape(-1)]
    packed = np.asarray(got["weight_packed"])
    if packed.dtype != np.int32:
        raise ValueError(f"weight_packed is {packed.dtype}, not int32")
    if len(shape) != packed.ndim or shape[:-1] != list(packed.shape[:-1]):
        raise ValueError(f"weight_shape {shape} does not fit weight_packed {packed.shape}")
    codes = _unpack_int32(packed, quant.bits, shape[-1], -1)
    scale = _float(got["weight_scale"])
    if not quant.group_size:
        scale = _per_channel(scale, codes)
    _check_groups(scale, codes, quant.group_size)
    zero = None
    if quant.zero_point:
        if "weight_zero_point" not in got:
            raise ValueError("weight_zero_point is missing (asymmetric weights)")
        zero = _unpack_int32(got["weight_zero_point"], quant.bits, codes.shape[-2], -2)
        if zero.shape != scale.shape:
            raise ValueError(f"weight_zero_point {zero.shape} does not match the scales "
                             f"{scale.shape}")
    return QuantTensor(codes, -1, scale, zero,
                       _g_idx(got, quant, codes.shape[-1], "weight_g_idx"))


def _unpack_awq(packed: np.ndarray) -> np.ndarray:
    """AutoAWQ's int32 words [..., R, O / 8] -> u8[..., R, O]: nibble i of word k holds
    column 8 k + AWQ_ORDER[i]."""
    words = np.asarray(packed).astype(np.int64) & 0xFFFFFFFF
    out = np.empty(words.shape[:-1] + (words.shape[-1], 8), np.uint8)
    for i, column in enumerate(AWQ_ORDER):
        out[..., column] = (words >> (4 * i)) & 0xF
    return out.reshape(words.shape[:-1] + (-1,))


def _read_awq(quant: LinearQuant, got: dict) -> QuantTensor:
    qweight, qzeros = np.asarray(got["qweight"]), np.asarray(got["qzeros"])
    if qweight.dtype != np.int32 or qzeros.dtype != np.int32:
        raise ValueError(f"qweight and qzeros must be int32, got {qweight.dtype} and "
                         f"{qzeros.dtype}")
    codes = _unpack_awq(qweight)  # [C, O]: AWQ stores [in, out]
    zero = _unpack_awq(qzeros)
    scale = _float(got["scales"])
    _check_groups(np.swapaxes(scale, -1, -2), np.swapaxes(codes, -1, -2), quant.group_size)
    if zero.shape != scale.shape:
        raise ValueError(f"qzeros unpack to {zero.shape}, scales are {scale.shape}")
    return _as_weight(QuantTensor(codes, -2, scale, zero))


def _read_gptq(quant: LinearQuant, got: dict) -> QuantTensor:
    qweight, qzeros = np.asarray(got["qweight"]), np.asarray(got["qzeros"])
    if qweight.dtype != np.int32 or qzeros.dtype != np.int32:
        raise ValueError(f"qweight and qzeros must be int32, got {qweight.dtype} and "
                         f"{qzeros.dtype}")
    scale = _float(got["scales"])  # [G, O]
    rows = qweight.shape[-2] * 32 // quant.bits
    codes = _unpack_int32(qweight, quant.bits, rows, -2)  # [C, O]: packed along the rows
    zero = _unpack_int32(qzeros, quant.bits, scale.shape[-1], -1).astype(np.int16)
    zero = zero + quant.gptq_zero_offset
    if zero.max(initial=0) > 255:
        raise ValueError("zeros exceed 8 bits")
    zero = zero.astype(np.uint8)
    g_idx = _g_idx(got, quant, rows, "g_idx")
    groups = -(-rows // quant.group_size) if quant.group_size else 1
    if scale.shape[-2:] != (groups, codes.shape[-1]) or zero.shape != scale.shape:
        raise ValueError(f"scales {scale.shape} / zeros {zero.shape} do not fit {rows} rows "
                         f"and {codes.shape[-1]} columns in {groups} groups")
    return _as_weight(QuantTensor(codes, -2, scale, zero, g_idx))


def _as_weight(qt: QuantTensor) -> QuantTensor:
    """AWQ's and GPTQ's [..., in, out] tensors in the [..., out, in] layout of `X.weight`."""
    swap = lambda a: None if a is None else np.swapaxes(a, -1, -2)
    return QuantTensor(swap(qt.codes), -1, swap(qt.scale), swap(qt.zero), qt.g_idx)


_READERS = {"fp8-block": _read_fp8_block, "fp8": _read_float, "ct-float": _read_float,
            "ct-int": _read_float, "ct-pack": _read_ct_pack, "awq": _read_awq,
            "gptq": _read_gptq}


def mxfp4_tensor(blocks: np.ndarray, scales: np.ndarray) -> QuantTensor:
    """GPT-OSS's MXFP4 pieces (models/mxfp4.py: blocks u8[..., O, C/32, 16], scales
    u8[..., O, C/32]) kept 4-bit, in the [..., C, O] layout mxfp4.dequantize returns."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}.")
    if blocks.ndim < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}: "
                         "blocks are [..., rows, groups, 16] and scales [..., rows, groups].")
    codes = np.empty(blocks.shape[:-1] + (32,), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = blocks & 0x0F, blocks >> 4
    codes = codes.reshape(blocks.shape[:-2] + (-1,))  # [..., O, C]
    return QuantTensor(np.swapaxes(codes, -1, -2), -2, np.swapaxes(scales, -1, -2))


def engine_layout(qt: QuantTensor, transform, contracted: tuple[int, ...],
                  quant: LinearQuant) -> dict[str, np.ndarray]:
    """The stored components (models/quantization.py: values, scale, zero, g_idx,
    input_scale) of one kernel whose unquantized tensor `transform` maps into the engine's
    layout, `contracted` its contracted axes there (the expert axis, if any, before them).
    The transform must move whole input rows (it may transpose, reshape, slice and repeat
    outputs); ValueError otherwise."""
    transform = transform or (lambda w: w)
    codes = qt.codes
    if codes.size == 0 or codes.ndim < 2:
        raise ValueError(f"a quantized weight of shape {codes.shape} holds no matrix")
    axis = qt.in_axis % codes.ndim
    cols = codes.shape[axis]
    flat = [1 if i == axis else n for i, n in enumerate(codes.shape)]
    outs = np.arange(math.prod(flat), dtype=np.int32).reshape(flat)
    ins = np.arange(cols, dtype=np.int32).reshape([cols if i == axis else 1
                                                   for i in range(codes.ndim)])
    out_map = np.asarray(transform(np.broadcast_to(outs, codes.shape)))
    in_map = np.asarray(transform(np.broadcast_to(ins, codes.shape)))
    values = np.asarray(transform(codes))
    first, last = contracted[0], contracted[-1]
    lead = math.prod(values.shape[:first])
    rows = math.prod(values.shape[first:last + 1])
    out = math.prod(values.shape[last + 1:])
    out_map, in_map = out_map.reshape(lead, rows, out), in_map.reshape(lead, rows, out)
    if rows != cols or not np.array_equal(in_map, np.broadcast_to(
            np.arange(cols, dtype=np.int32)[None, :, None], in_map.shape)) or not np.array_equal(
            out_map, np.broadcast_to(out_map[:, :1], out_map.shape)):
        raise ValueError("this parameter's layout mixes input and output positions; its "
                         "quantized weights cannot be kept")
    columns = out_map[:, 0]  # [L, O]: each stored column's position in the checkpoint
    values = values.reshape(lead, rows, out)
    if quant.packed:
        if rows % 2:
            raise ValueError(f"{rows} input rows cannot pack two 4-bit codes per byte")
        values = values[:, 0::2] | (values[:, 1::2] << 4)
    if quant.codes in ("uint4", "uint8", "e2m1"):
        values = values.astype(np.uint8)

    def per_column(array):  # [..., G along in_axis, ...] -> [L, G, O]
        moved = np.moveaxis(array, axis, 0)
        return np.moveaxis(moved.reshape(moved.shape[0], -1)[:, columns], 0, 1)

    parts = {"values": values,
             "scale": per_column(qt.scale).astype(
                 np.uint8 if quant.scale_dtype == "uint8" else np.float32)}
    if quant.zero_point:
        parts["zero"] = per_column(qt.zero).astype(np.uint8)
    if quant.act_order:
        if lead > 1:
            raise ValueError("activation order (g_idx) on stacked experts is not supported")
        parts["g_idx"] = qt.g_idx.astype(np.int32)[None]
    if quant.activations == "static":
        parts["input_scale"] = np.full((lead,), qt.input_scale, np.float32)
    if first == 0:  # no expert axis: drop the leading 1
        parts = {k: v[0] for k, v in parts.items()}
    return parts
