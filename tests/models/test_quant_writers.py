"""The quantized-checkpoint writers of quant_checkpoints.py against the reference libraries
(compressed-tensors' packers, quantize and decompress; AutoAWQ's and AutoGPTQ's packing
loops, transcribed) and against jaxserve's readers (models/quant_config.py,
models/quant_tensors.py): every quantized module read back and dequantized equals the
dequantized folder bit for bit. No engine runs here."""

from __future__ import annotations

import importlib.util
import json

import ml_dtypes
import numpy as np
import pytest
from support.quant_checkpoints import (
    AWQ_ORDER,
    PROJECTION,
    load_tensors,
    pack_awq,
    pack_int32,
    write_quantized,
)

from jaxserve.models.quant_config import checkpoint_quant
from jaxserve.models.quant_tensors import combine, pieces

torch = pytest.importorskip("torch")  # load_tensors reads fp8 / bf16 through safetensors.torch
needs_ct = pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None,
    reason="the reference library compressed-tensors is not installed")

CASES = {  # id: (scheme, write_quantized kwargs)
    "fp8-block": ("fp8-block", {}),
    "fp8-block-48-bf16": ("fp8-block", {"block": (48, 48), "dtype": "bfloat16"}),
    "fp8-tensor": ("fp8-tensor", {}),
    "fp8-tensor-static": ("fp8-tensor", {"activations": "static"}),
    "ct-fp8-channel": ("ct-fp8", {}),
    "ct-fp8-tensor-static-bf16": ("ct-fp8", {"strategy": "tensor", "activations": "static",
                                             "dtype": "bfloat16"}),
    "ct-fp8-block": ("ct-fp8", {"strategy": "block", "block": (16, 32)}),
    "ct-fp8-weight-only": ("ct-fp8", {"activations": None}),
    "ct-int8": ("ct-int8", {}),
    "ct-int8-bf16": ("ct-int8", {"dtype": "bfloat16"}),
    "ct-w4a16": ("ct-w4a16", {}),
    "ct-w4a16-asym-actorder": ("ct-w4a16", {"symmetric": False, "act_order": True}),
    "ct-w8a16-channel": ("ct-w4a16", {"bits": 8, "group_size": 0}),
    "ct-w8a16-asym-bf16": ("ct-w4a16", {"bits": 8, "group_size": 16, "symmetric": False,
                                        "dtype": "bfloat16"}),
    "awq": ("awq", {}),
    "awq-channel-bf16": ("awq", {"group_size": 0, "dtype": "bfloat16"}),
    "gptq": ("gptq", {}),
    "gptq-v2-asym-actorder": ("gptq", {"gptq_format": "gptq_v2", "symmetric": False,
                                       "act_order": True}),
    "gptq-8bit-asym": ("gptq", {"bits": 8, "symmetric": False}),
    "gptq-channel-asym-bf16": ("gptq", {"group_size": 0, "symmetric": False,
                                        "dtype": "bfloat16"}),
}


@pytest.fixture(scope="module")
def written(tiny_checkpoints, tmp_path_factory):
    """id -> (quantized folder, dequantized folder), written on first use."""
    cache = {}

    def get(case, arch="llama"):
        if (case, arch) not in cache:
            scheme, kwargs = CASES[case]
            root = tmp_path_factory.mktemp(f"{case}-{arch}")
            write_quantized(tiny_checkpoints[arch], root / "q", root / "d", scheme, **kwargs)
            cache[case, arch] = root / "q", root / "d"
        return cache[case, arch]
    return get


def _config(folder):
    return json.loads((folder / "config.json").read_text())


def _torch(a: np.ndarray):
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.array(a))


def _bytes(t) -> bytes:
    if isinstance(t, np.ndarray):
        return t.tobytes()
    raw = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}.get(t.dtype)
    return (t.view(raw) if raw else t).contiguous().numpy().tobytes()


def _reader_dequantize(qt, quant) -> np.ndarray:
    """w = (codes - zero) * scale per element from a QuantTensor, as [O, C]."""
    codes = qt.codes.astype(np.float32)
    axis = qt.in_axis % codes.ndim
    cols = codes.shape[axis]
    idx = qt.g_idx if qt.g_idx is not None else np.arange(cols) // (quant.group_size or cols)
    scale = np.take(qt.scale, idx, axis=axis)
    zero = (np.take(qt.zero, idx, axis=axis).astype(np.float32) if qt.zero is not None
            else np.float32(quant.zero))
    w = (codes - zero) * scale
    return w if axis == codes.ndim - 1 else np.swapaxes(w, -1, -2)


def _check_reader(q_dir, d_dir, src):
    quant = checkpoint_quant(_config(q_dir))
    q, d, s = (load_tensors(f / "model.safetensors") for f in (q_dir, d_dir, src))
    modules = {n[: -len(".weight")] for n in s if PROJECTION.search(n)}
    assert modules and set(d) == set(s)
    dtype = d["model.norm.weight"].dtype
    for module in sorted(modules):
        suffixes = pieces(quant, module, set(q))
        assert suffixes is not None, module
        qt = combine(quant, {p: q[f"{module}.{p}"] for p in suffixes}, module)
        got = _reader_dequantize(qt, quant).astype(dtype)
        assert got.tobytes() == d[f"{module}.weight"].tobytes(), module
    plain = {n for n in q if not any(n.startswith(m + ".") for m in modules)}
    assert plain == {n for n in d if not any(n.startswith(m + ".") for m in modules)}
    for name in plain:
        assert q[name].dtype == d[name].dtype == dtype and np.array_equal(q[name], d[name])
        assert np.array_equal(d[name], s[name].astype(dtype)), name
    return quant, modules


DEFAULT_CASES = ("fp8-block-48-bf16", "ct-fp8-tensor-static-bf16", "ct-int8",
                 "ct-w4a16-asym-actorder", "awq", "gptq-v2-asym-actorder")


@pytest.mark.parametrize("case", [c if c in DEFAULT_CASES else pytest.param(
    c, marks=pytest.mark.slow) for c in CASES])
def test_reader_dequantizes_to_the_dequantized_folder(case, written, tiny_checkpoints):
    q_dir, d_dir = written(case)
    dtype = CASES[case][1].get("dtype", "float32")
    assert "quantization_config" not in _config(d_dir)
    assert _config(q_dir)["dtype"] == _config(d_dir)["torch_dtype"] == dtype
    _check_reader(q_dir, d_dir, tiny_checkpoints["llama"])


@pytest.mark.parametrize("arch,case", [("qwen2_moe", "ct-w4a16"), ("mixtral", "awq"),
                                       ("qwen2_moe", "gptq-8bit-asym")])
def test_moe_experts_quantized_routers_kept(arch, case, written, tiny_checkpoints):
    q_dir, d_dir = written(case, arch)
    _, modules = _check_reader(q_dir, d_dir, tiny_checkpoints[arch])
    q = load_tensors(q_dir / "model.safetensors")
    assert any(".experts.7." in m for m in modules)
    routers = [n for n in q if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                                           "shared_expert_gate.weight"))]
    assert routers and all(q[n].dtype == np.float32 for n in routers)
    if arch == "qwen2_moe":
        assert any("shared_expert.down_proj" in m for m in modules)
    if case.startswith("ct"):
        assert "re:.*mlp.gate$" in _config(q_dir)["quantization_config"]["ignore"]


@needs_ct
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_int32_matches_compressed_tensors(bits, dim):
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    rng = np.random.default_rng(bits + dim)
    shape = (70, 5) if dim == 0 else (5, 70)  # 70: a partly filled last word
    signed = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), shape).astype(np.int8)
    mine = pack_int32(signed.astype(np.int32) + (1 << (bits - 1)), bits, dim)
    ref = pack_to_int32(torch.from_numpy(signed), bits, packed_dim=dim)
    assert mine.dtype == np.int32 and np.array_equal(mine, ref.numpy())
    back = unpack_from_int32(torch.from_numpy(mine), bits, torch.Size(shape), packed_dim=dim)
    assert np.array_equal(back.numpy(), signed)


def test_awq_and_gptq_packing_match_reference_loops():
    """AutoAWQ WQLinear_GEMM.from_linear and AutoGPTQ QuantLinear.pack, transcribed."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (24, 16)).astype(np.int64)  # [in, out]
    awq = np.zeros((24, 2), np.int64)
    for col in range(2):
        for i in range(8):
            awq[:, col] |= codes[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    assert np.array_equal(pack_awq(codes), awq.astype(np.uint32).view(np.int32))
    for bits in (4, 8):
        per = 32 // bits
        codes = rng.integers(0, 1 << bits, (24, 16)).astype(np.uint32)
        qweight = np.zeros((24 // per, 16), np.uint32)
        for row in range(24 // per):
            for j in range(row * per, row * per + per):
                qweight[row] |= codes[j] << np.uint32(bits * (j - row * per))
        assert np.array_equal(pack_int32(codes, bits, 0), qweight.view(np.int32))
        qzeros = np.zeros((24, 16 // per), np.uint32)
        for col in range(16 // per):
            for j in range(col * per, col * per + per):
                qzeros[:, col] |= codes[:, j] << np.uint32(bits * (j - col * per))
        assert np.array_equal(pack_int32(codes, bits, 1), qzeros.view(np.int32))


@needs_ct
@pytest.mark.parametrize("case", [c if c in DEFAULT_CASES else pytest.param(
    c, marks=pytest.mark.slow) for c in CASES if c.startswith("ct-")])
def test_compressed_tensors_compress_and_decompress_agree(case, written, tiny_checkpoints):
    """The library's config models accept the config; its compress (given the written scale
    and zero) writes the same codes, and its decompress gives the dequantized folder."""
    from compressed_tensors.compressors import (
        FloatQuantizationCompressor,
        IntQuantizationCompressor,
        NaiveQuantizationCompressor,
        PackedQuantizationCompressor,
    )
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    q_dir, d_dir = written(case)
    qc = _config(q_dir)["quantization_config"]
    group = dict(qc["config_groups"]["group_0"])
    weights = dict(group["weights"])
    act_order = weights.pop("actorder", None) == "group"  # removed from compressed-tensors
    group["weights"] = weights
    if not act_order:
        QuantizationConfig.model_validate(qc)
    scheme = QuantizationScheme.model_validate(group)
    compressor = {"float-quantized": FloatQuantizationCompressor,
                  "naive-quantized": NaiveQuantizationCompressor,
                  "int-quantized": IntQuantizationCompressor,
                  "pack-quantized": PackedQuantizationCompressor}[qc["format"]]
    q, d = load_tensors(q_dir / "model.safetensors"), load_tensors(d_dir / "model.safetensors")
    src = load_tensors(tiny_checkpoints["llama"] / "model.safetensors")
    bits = weights["num_bits"]
    for module in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        stored = {k.split(".")[-1]: _torch(v) for k, v in q.items()
                  if k.startswith(module + ".")}
        g_idx = stored.pop("weight_g_idx", None)
        w = torch.from_numpy(src[module + ".weight"])
        if qc["format"] == "pack-quantized":
            shape = tuple(stored["weight_shape"].tolist())
            codes = unpack_from_int32(stored["weight_packed"], bits, torch.Size(shape))
            zp = stored.get("weight_zero_point")
            if zp is not None:
                groups = stored["weight_scale"].shape[1]
                zp = unpack_from_int32(zp, bits, torch.Size((shape[0], groups)), packed_dim=0)
            if g_idx is not None:  # contiguous groups in the permuted column order
                perm = torch.argsort(g_idx, stable=True)
                w, codes = w[:, perm], codes[:, perm]
            state = {"weight": w, "weight_scale": stored["weight_scale"]}
            if zp is not None:
                state["weight_zero_point"] = zp
            packed = compressor.compress(state, scheme)["weight_packed"]
            assert torch.equal(unpack_from_int32(packed, bits, torch.Size(shape)), codes)
        else:
            got = compressor.compress({"weight": w, "weight_scale": stored["weight_scale"]},
                                      scheme)["weight"]
            assert _bytes(got) == _bytes(stored["weight"]), module
        if g_idx is None:
            deq = compressor.decompress(stored, scheme)["weight"]
            assert _bytes(deq) == _bytes(d[module + ".weight"]), module


def test_write_refuses_unwritable_choices(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama"]
    for scheme, kwargs in [("ct-int8", {"activations": None}), ("awq", {"bits": 8}),
                           ("gptq", {"group_size": 48}), ("ct-w4a16", {"bits": 3}),
                           ("gguf", {})]:
        with pytest.raises(ValueError):
            write_quantized(src, tmp_path / "q", tmp_path / "d", scheme, **kwargs)
