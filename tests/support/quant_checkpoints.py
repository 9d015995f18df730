"""Test helpers: a tiny float Hugging Face checkpoint written (a) quantized in a published
format, tensor for tensor as the reference library writes it, and (b) as the exact
dequantization of (a) in a plain float checkpoint, so that a test can compare the engine's
greedy tokens on (a) with those on (b).

Every linear projection weight `X.weight` (attention q/k/v/o, dense and shared-expert MLP
gate/up/down, per-expert gate/up/down or Mixtral w1/w2/w3) is quantized by round to
nearest; routers, norms, embeddings and lm_head are copied (floats cast to `dtype`). The
dequantized folder holds `X.weight` = (codes - zero) * scale computed per element in
float32 from the *stored* scales, then cast to `dtype`, and no quantization_config.

Schemes and the convention each follows:

* fp8-block: DeepSeek-V3 / Hugging Face FineGrainedFP8 (`weight_scale_inv` f32 per block,
  scale = block amax / 448, w = q * scale_inv);
* fp8-tensor: vLLM / AutoFP8 `quant_method: fp8` (one f32 `weight_scale` []; with static
  activations an f32 `input_scale` [] = `input_scale`, a fixed guess since no calibration
  data exists: 0.05 lets activations up to 22.4 through);
* ct-fp8, ct-int8, ct-w4a16: compressed-tensors 0.20 (`calculate_qparams`, `quantize` and
  `pack_to_int32` in compressed_tensors): symmetric scale = amax / ((qmax - qmin) / 2)
  (448 for fp8, 127.5 for int8, 7.5 for int4), asymmetric scale = (max - min) / (qmax -
  qmin) with a signed zero = round(qmin - min / scale), min <= 0 <= max; q = round(clamp(w
  / scale + zero, qmin, qmax)); scales stored in the model dtype as the library does;
  weight-only fp8 is written `naive-quantized`, as the library names it;
* awq: AutoAWQ `pseudo_quantize_tensor` + `WQLinear_GEMM.from_linear` (f16 scales,
  nibble order 0 2 4 6 1 3 5 7 along the outputs);
* gptq: AutoGPTQ / GPTQModel `Quantizer.find_params` + `QuantLinear.pack` (f16 scales,
  codes packed along the input rows, zeros along the outputs, v1 storing zero - 1).

Only act-order permutations use the seeded RNG (one permutation per module, in name
order): input column i belongs to group perm_position(i) // group_size, as GPTQ's
desc_act writes g_idx, so every group has exactly group_size columns.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

SCHEMES = ("fp8-block", "fp8-tensor", "ct-fp8", "ct-int8", "ct-w4a16", "awq", "gptq")
FP8, BF16, F32 = ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16, np.float32
FP8_MAX = 448.0
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i]
PROJECTION = re.compile(
    r"(self_attn\.([qkvo]|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?"  # MHA and DeepSeek's MLA
    r"|mlp\.(shared_experts?\.|experts\.\d+\.)?(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
ROUTERS = {"mlp.gate.weight": "re:.*mlp.gate$",
           "block_sparse_moe.gate.weight": "re:.*block_sparse_moe.gate$",
           "shared_expert_gate.weight": "re:.*shared_expert_gate$"}


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file as numpy arrays (bf16 / fp8 as ml_dtypes), read with torch."""
    import torch
    from safetensors.torch import load_file

    views = {torch.bfloat16: (torch.int16, BF16), torch.float8_e4m3fn: (torch.uint8, FP8)}
    out = {}
    for name, t in load_file(str(path)).items():
        if t.dtype in views:
            raw, dt = views[t.dtype]
            out[name] = t.view(raw).numpy().view(dt)
        else:
            out[name] = t.numpy()
    return out


def pack_int32(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned `bits`-bit values packed densely into int32 along `axis`, element i at bit
    i * bits (compressed-tensors' pack_to_int32 after its +2**(bits-1) offset, and GPTQ's
    sequential packing); the last word is zero-padded."""
    per = 32 // bits
    v = np.moveaxis(np.asarray(values).astype(np.uint64), axis, -1)
    pad = -v.shape[-1] % per
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)]).reshape(v.shape[:-1] + (-1, per))
    words = (v << (np.arange(per, dtype=np.uint64) * bits)).sum(-1).astype(np.uint32)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def pack_awq(values: np.ndarray) -> np.ndarray:
    """AutoAWQ GEMM packing of u4 [R, O] -> int32 [R, O / 8] in AWQ_ORDER."""
    v = values.astype(np.uint32).reshape(values.shape[0], -1, 8)
    words = sum(v[..., c] << np.uint32(4 * i) for i, c in enumerate(AWQ_ORDER))
    return words.astype(np.uint32).view(np.int32)


def _groups(cols: int, group: int, act_order: bool, rng) -> np.ndarray:
    """i32[cols]: each input column's group (column // group, or with act order its
    position in a random permutation // group); group 0: one group."""
    group = group or cols
    if cols % group:
        raise ValueError(f"{cols} input columns do not split into groups of {group}")
    order = rng.permutation(cols) if act_order else np.arange(cols)
    g_idx = np.empty(cols, np.int32)
    g_idx[order] = np.arange(cols) // group
    return g_idx


def _minmax(w: np.ndarray, g_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per output row and group: (min, max) over the group's columns, [O, G] each."""
    groups = range(int(g_idx.max()) + 1)
    return (np.stack([w[:, g_idx == k].min(1) for k in groups], 1),
            np.stack([w[:, g_idx == k].max(1) for k in groups], 1))


def _nonzero(scale: np.ndarray) -> np.ndarray:
    return np.where(scale == 0, np.ones_like(scale), scale)


def _blocks(w: np.ndarray, bn: int, bk: int) -> tuple[np.ndarray, Callable]:
    """(per-block amax [ceil(O/bn), ceil(C/bk)], expand: block array -> [O, C])."""
    out, cols = w.shape
    p = np.pad(np.abs(w), ((0, -out % bn), (0, -cols % bk)))
    amax = p.reshape(p.shape[0] // bn, bn, p.shape[1] // bk, bk).max((1, 3))
    return amax, lambda s: np.repeat(np.repeat(s, bn, 0), bk, 1)[:out, :cols]


def _deq(q: np.ndarray, zero: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(q - zero) * scale from integer codes and zeros (so that q == zero gives +0.0, as
    every reader computes it), in float32."""
    return (q.astype(np.int32) - np.asarray(zero).astype(np.int32)).astype(F32) * scale


def _fp8(w: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 codes, f32 dequantized) of w against a broadcastable f32 scale."""
    q = np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return q, q.astype(F32) * scale


def _ct_int(w, g_idx, bits, symmetric, sdt):
    """compressed-tensors int quantization per group of columns: (signed int8 codes, scale
    [O, G] stored dtype, signed zero [O, G] int8 or None, f32 dequantized)."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    lo, hi = _minmax(w, g_idx)
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    if symmetric:
        scale = _nonzero((np.maximum(-lo, hi) / ((qmax - qmin) / 2)).astype(sdt))
        zero = np.zeros_like(lo)
    else:
        scale = _nonzero(((hi - lo) / (qmax - qmin)).astype(sdt))
        zero = np.round(np.clip(qmin - lo / scale.astype(F32), qmin, qmax))
    s, z = scale.astype(F32)[:, g_idx], zero[:, g_idx]
    q = np.round(np.clip(w / s + z, qmin, qmax))
    return (q.astype(np.int8), scale, None if symmetric else zero.astype(np.int8),
            _deq(q, z, s))


def _ct_activations(kind: str, activations: str | None, sdt, input_scale: float):
    """compressed-tensors input_activations args and the extra tensors they need."""
    if activations is None:
        return None, {}
    args = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True,
            "strategy": "token"}
    if activations == "dynamic":
        return args, {}
    if activations != "static":
        raise ValueError(f"activations must be None, 'dynamic' or 'static', got {activations!r}")
    return ({**args, "dynamic": False, "strategy": "tensor"},
            {"input_scale": np.array([input_scale], sdt)})


def _ct_config(fmt: str, weights: dict, acts: dict | None, ignore: list) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": ignore,
            "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None, "format": fmt}}}


def _scheme(scheme, sdt, o, ignore):
    """(quantization_config, quantize: (w f32 [O, C], rng) -> (pieces, f32 dequantized))."""
    bn, bk = o["block"]
    group, bits, sym, act_order = o["group_size"], o["bits"], o["symmetric"], o["act_order"]
    if scheme == "fp8-block":
        def quantize(w, rng):
            amax, expand = _blocks(w, bn, bk)
            scale = _nonzero((amax / FP8_MAX).astype(F32))
            q, deq = _fp8(w, expand(scale))
            return {"weight": q, "weight_scale_inv": scale}, deq
        return ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [bn, bk]}, quantize)
    if scheme == "fp8-tensor":
        static = o["activations"] == "static"

        def quantize(w, rng):
            scale = _nonzero(np.array(np.abs(w).max() / FP8_MAX, F32))
            q, deq = _fp8(w, scale)
            extra = {"input_scale": np.array(o["input_scale"], F32)} if static else {}
            return {"weight": q, "weight_scale": scale, **extra}, deq
        return ({"quant_method": "fp8", "fmt": "e4m3",
                 "activation_scheme": "static" if static else "dynamic"}, quantize)
    if scheme == "ct-fp8":
        strategy = o["strategy"]
        acts, extra = _ct_activations("float", o["activations"], sdt, o["input_scale"])
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                   "dynamic": False, **({"block_structure": [bn, bk]}
                                        if strategy == "block" else {})}

        def quantize(w, rng):
            if strategy == "block":
                amax, expand = _blocks(w, bn, bk)
            elif strategy in ("channel", "tensor"):
                amax = np.abs(w).max(1, keepdims=True)
                amax = amax if strategy == "channel" else amax.max().reshape(1)
                expand = lambda s: s
            else:
                raise ValueError(f"ct-fp8 strategy must be channel, tensor or block, got "
                                 f"{strategy!r}")
            scale = _nonzero((amax / FP8_MAX).astype(sdt))
            q, deq = _fp8(w, expand(scale.astype(F32)))
            return {"weight": q, "weight_scale": scale, **extra}, deq
        fmt = "float-quantized" if acts else "naive-quantized"
        return _ct_config(fmt, weights, acts, ignore), quantize
    if scheme == "ct-int8":
        acts, extra = _ct_activations("int", o["activations"], sdt, o["input_scale"])
        if acts is None:
            raise ValueError("weight-only int8 is compressed-tensors' pack-quantized: use "
                             "ct-w4a16 with bits=8")
        weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True,
                   "dynamic": False}

        def quantize(w, rng):
            q, scale, _, deq = _ct_int(w, np.zeros(w.shape[1], np.int32), 8, True, sdt)
            return {"weight": q, "weight_scale": scale, **extra}, deq
        return _ct_config("int-quantized", weights, acts, ignore), quantize
    if scheme == "ct-w4a16":
        if act_order and not group:
            raise ValueError("compressed-tensors activation order needs group_size > 0")
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
                   **({"strategy": "group", "group_size": group} if group
                      else {"strategy": "channel"}),
                   **({"actorder": "group"} if act_order else {})}

        def quantize(w, rng):
            g_idx = _groups(w.shape[1], group, act_order, rng)
            q, scale, zero, deq = _ct_int(w, g_idx, bits, sym, sdt)
            off = 1 << (bits - 1)
            pieces = {"weight_packed": pack_int32(q.astype(np.int32) + off, bits, 1),
                      "weight_scale": scale, "weight_shape": np.array(w.shape, np.int64)}
            if not sym:
                pieces["weight_zero_point"] = pack_int32(zero.astype(np.int32) + off, bits, 0)
            if act_order:
                pieces["weight_g_idx"] = g_idx
            return pieces, deq
        return _ct_config("pack-quantized", weights, None, ignore), quantize
    if scheme == "awq":
        if bits != 4 or act_order:
            raise ValueError("AutoAWQ GEMM writes 4-bit weights without activation order")

        def quantize(w, rng):
            g_idx = _groups(w.shape[1], group, False, rng)
            lo, hi = _minmax(w, g_idx)
            scale = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)
            s = scale.astype(F32)
            zero = np.clip(-np.round(lo / s), 0, 15)
            s, z = s[:, g_idx], zero[:, g_idx]
            q = np.clip(np.round(w / s) + z, 0, 15)
            return {"qweight": pack_awq(q.T), "qzeros": pack_awq(zero.T),
                    "scales": np.ascontiguousarray(scale.T)}, _deq(q, z, s)
        return ({"quant_method": "awq", "bits": 4, "group_size": group or -1,
                 "zero_point": True, "version": "gemm", "modules_to_not_convert": None},
                quantize)
    if scheme == "gptq":
        if o["gptq_format"] not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq_format must be gptq or gptq_v2, got {o['gptq_format']!r}")
        v1 = o["gptq_format"] == "gptq"
        maxq = (1 << bits) - 1

        def quantize(w, rng):
            g_idx = _groups(w.shape[1], group, act_order, rng)
            lo, hi = _minmax(w, g_idx)
            lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
            if sym:
                hi = np.maximum(-lo, hi)
                lo = np.where(lo < 0, -hi, lo)
            both = (lo == 0) & (hi == 0)
            lo, hi = np.where(both, -1, lo), np.where(both, 1, hi)
            scale = ((hi - lo) / maxq).astype(np.float16)
            s = scale.astype(F32)
            # v1 stores zero - 1 in `bits` bits: a zero of 0 cannot be written (AutoGPTQ's
            # own packer corrupts the word), so v1 zeros are kept in 1..maxq.
            zero = (np.full_like(s, (maxq + 1) // 2) if sym
                    else np.clip(np.round(-lo / s), 1 if v1 else 0, maxq))
            s, z = s[:, g_idx], zero[:, g_idx]
            q = np.clip(np.round(w / s) + z, 0, maxq)
            return {"qweight": pack_int32(q.T, bits, 0),
                    "qzeros": pack_int32(zero.T - v1, bits, 1),
                    "scales": np.ascontiguousarray(scale.T), "g_idx": g_idx}, _deq(q, z, s)
        return ({"quant_method": "gptq", "bits": bits, "group_size": group or -1,
                 "desc_act": act_order, "sym": sym, "lm_head": False,
                 "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
                 "checkpoint_format": o["gptq_format"]}, quantize)
    raise ValueError(f"unknown scheme {scheme!r}; one of {SCHEMES}")


def write_quantized(src: Path, quantized: Path, dequantized: Path, scheme: str, *,
                    dtype: str = "float32", group_size: int = 32, block: tuple = (32, 32),
                    symmetric: bool = True, act_order: bool = False,
                    activations: str | None = "dynamic", bits: int = 4,
                    gptq_format: str = "gptq", seed: int = 0, strategy: str = "channel",
                    input_scale: float = 0.05) -> None:
    """Write `src` (config.json, model.safetensors, tokenizer files) quantized with
    `scheme` (SCHEMES) to `quantized` and its exact dequantization to `dequantized`.

    group_size: input columns per scale (0: per output channel) for ct-w4a16, awq, gptq;
    block: (rows, columns) of fp8-block and ct-fp8 strategy "block"; symmetric / act_order /
    bits (4 or 8): ct-w4a16 and gptq; activations (None, "dynamic", "static"): fp8-tensor,
    ct-fp8, ct-int8; strategy: ct-fp8's weight strategy (channel, tensor, block);
    input_scale: the static activation scale written; gptq_format: gptq (v1) or gptq_v2."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    src, quantized, dequantized = Path(src), Path(quantized), Path(dequantized)
    sdt = F32 if dtype == "float32" else BF16
    tensors = load_tensors(src / "model.safetensors")
    ignore = ["lm_head"] + [r for suffix, r in ROUTERS.items()
                            if any(n.endswith("." + suffix) for n in tensors)]
    opts = dict(group_size=group_size, block=tuple(block), symmetric=symmetric,
                act_order=act_order, activations=activations, bits=bits,
                gptq_format=gptq_format, strategy=strategy, input_scale=input_scale)
    quant_config, quantize = _scheme(scheme, sdt, opts, ignore)
    rng = np.random.default_rng(seed)
    q_out, d_out = {}, {}
    for name in sorted(tensors):
        array = tensors[name]
        if PROJECTION.search(name):
            module = name[: -len(".weight")]
            pieces, deq = quantize(np.asarray(array, F32), rng)
            q_out.update({f"{module}.{k}": np.asarray(v, order="C") for k, v in pieces.items()})
            d_out[name] = deq.astype(sdt)
        else:
            if np.issubdtype(array.dtype, np.floating) or array.dtype == BF16:
                array = array.astype(sdt)
            q_out[name] = d_out[name] = np.asarray(array, order="C")
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config.update(torch_dtype=dtype, dtype=dtype)
    for folder, out, qc in ((quantized, q_out, quant_config), (dequantized, d_out, None)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json" and not f.name.startswith("model."):
                shutil.copy(f, folder / f.name)
        save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
        written = {**config, **({"quantization_config": qc} if qc else {})}
        (folder / "config.json").write_text(json.dumps(written, indent=2) + "\n")


def without_activations(quantization, hf, model="the model"):
    """checkpoint_scheme as jaxserve reads it, with activations="none": for comparing a
    scheme that quantizes activations with its weights alone."""
    import dataclasses

    from jaxserve.models.quantization import checkpoint_scheme

    scheme = checkpoint_scheme(quantization, hf, model)
    return dataclasses.replace(scheme, activations="none")
