"""A quantized checkpoint's kernels carried into the engine's layout (quant_tensors.py:
engine_layout through each family's transform) and dequantized in the step
(models/jax/quantized.py), against the float tensor the same codes stand for; the
checkpoint's quantization_config read or refused by name (quant_config.py)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.models import llama_arch, mixtral_arch
from jaxserve.models.jax.quantized import QuantizedKernel, quantize_activations
from jaxserve.models.mxfp4 import FP4_VALUES
from jaxserve.models.quant_config import LinearQuant, checkpoint_quant
from jaxserve.models.quant_tensors import QuantTensor, engine_layout, mxfp4_tensor
from jaxserve.models.quantization import CONTRACTED, stored_shapes

ARCH = llama_arch.LlamaArch(
    vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
    num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
    rope_scaling=(("rope_type", "default"),), attention_bias=False, qk_norm=False,
    tie_word_embeddings=False, sliding_windows=(None,), kv_replicas=2)  # 2 kv heads, x2

SCHEMES = {
    "int4-groups-zero": LinearQuant("awq", "awq", "uint4", group_size=8, zero_point=True),
    "int4-channel-sym": LinearQuant("compressed-tensors", "ct-pack", "uint4", zero=8),
    "int4-act-order": LinearQuant("gptq", "gptq", "uint4", group_size=8, zero_point=True,
                                  act_order=True),
    "uint8-groups": LinearQuant("gptq", "gptq", "uint8", group_size=16, zero_point=True),
    "fp8-blocks": LinearQuant("fp8", "fp8-block", "float8_e4m3fn", group_size=16,
                              block_rows=16),
    "int8-channel": LinearQuant("compressed-tensors", "ct-int", "int8"),
}


def random_tensor(quant: LinearQuant, shape: tuple, rng, in_axis: int = -1) -> QuantTensor:
    """Codes, scales, zeros (and a g_idx) of the scheme for a tensor of `shape`."""
    cols = shape[in_axis]
    groups = -(-cols // quant.group_size) if quant.group_size else 1
    if quant.codes == "float8_e4m3fn":
        codes = rng.normal(size=shape).astype(ml_dtypes.float8_e4m3fn)
    elif quant.codes == "int8":
        codes = rng.integers(-127, 128, size=shape, dtype=np.int8)
    else:
        codes = rng.integers(0, 16 if quant.packed else 256, size=shape, dtype=np.uint8)
    group_shape = list(shape)
    group_shape[in_axis] = groups
    scale = rng.uniform(0.01, 0.1, size=group_shape).astype(np.float32)
    zero = (rng.integers(0, 16, size=group_shape, dtype=np.uint8) if quant.zero_point
            else None)
    g_idx = (rng.permutation(cols) % groups).astype(np.int32) if quant.act_order else None
    return QuantTensor(codes, in_axis, scale, zero, g_idx)


def float_of(qt: QuantTensor, quant: LinearQuant) -> np.ndarray:
    """The float tensor the codes stand for, in the checkpoint's layout."""
    axis = qt.in_axis % qt.codes.ndim
    cols = qt.codes.shape[axis]
    rows = (qt.g_idx if qt.g_idx is not None else
            np.arange(cols) // (quant.group_size or cols))
    expand = lambda a: np.take(a, rows, axis=axis).astype(np.float32)
    codes = (FP4_VALUES[qt.codes] if quant.codes == "e2m1" else qt.codes.astype(np.float32))
    zero = expand(qt.zero) if qt.zero is not None else np.float32(quant.zero)
    scale = expand(qt.scale)
    if quant.codes == "e2m1":
        scale = np.ldexp(np.float32(1), scale.astype(np.int32) - 127)
    return (codes - zero) * scale


def device_dequantized(name: str, shape: tuple, parts: dict, quant: LinearQuant):
    kernel = QuantizedKernel(name, shape, quant)
    for part, value in parts.items():
        getattr(kernel, part).set_value(jnp.asarray(value))
    return np.asarray(kernel.dequantized(jnp.float32))


def check(name: str, transform, quant: LinearQuant, qt: QuantTensor, index=None) -> None:
    """engine_layout of qt through transform, dequantized on the device, equals transform of
    the float tensor; the parts have stored_shapes' shapes."""
    contracted = tuple(c - (index is not None) for c in CONTRACTED[name])
    parts = engine_layout(qt, transform, contracted, quant)
    want = np.asarray(transform(float_of(qt, quant)))
    engine_shape = want.shape if index is None else want.shape
    stored = stored_shapes(name, (1,) * (index is not None) + engine_shape, quant)
    for part, value in parts.items():
        assert value.shape == tuple(stored[part][0][index is not None:]), part
    got = device_dequantized(name, engine_shape, parts,
                             quant) if index is None else None
    if index is not None:  # one expert's slice: dequantize it as a stack of one
        stacked = {k: v[None] for k, v in parts.items()}
        got = device_dequantized(name, (1,) + engine_shape, stacked, quant)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("scheme,tensor", [  # every scheme on wo; the rest with -m slow
    (s, t) if t == "o_proj" or (t, s) == ("k_proj", "int4-groups-zero") else pytest.param(
        s, t, marks=pytest.mark.slow)
    for s in sorted(SCHEMES) for t in ("q_proj", "k_proj", "o_proj", "down_proj")])
def test_llama_kernels_keep_their_codes_through_the_layout(scheme, tensor):
    quant = SCHEMES[scheme]
    if quant.act_order and tensor == "k_proj":
        quant = dataclasses.replace(quant, act_order=False)
    name = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
            "o_proj": "self_attn.o_proj", "down_proj": "mlp.down_proj"}[tensor]
    path, transform = llama_arch.hf_param_path(f"model.layers.0.{name}.weight", ARCH)
    d, f, h = ARCH.hidden_size, ARCH.intermediate_size, ARCH.head_dim
    shape = {"q_proj": (4 * h, d), "k_proj": (2 * h, d), "o_proj": (d, 4 * h),
             "down_proj": (d, f)}[tensor]
    check(path[-1], transform, quant, random_tensor(quant, shape, np.random.default_rng(0)))


def test_fused_projections_split_their_rows():
    arch = dataclasses.replace(ARCH, kv_replicas=1, num_kv_heads=2)
    quant = SCHEMES["int4-groups-zero"]
    rows = (4 + 2 + 2) * arch.head_dim
    qt = random_tensor(quant, (rows, arch.hidden_size), np.random.default_rng(1))
    for path, transform in llama_arch.hf_param_path("model.layers.0.self_attn.qkv_proj.weight",
                                                    arch):
        check(path[-1], transform, quant, qt)


def test_experts_per_expert_and_stacked():
    arch = mixtral_arch.MixtralArch(**{f.name: getattr(ARCH, f.name)
                                       for f in dataclasses.fields(ARCH)}, num_experts=3,
                                    top_k=2, moe_intermediate_size=16, norm_topk_prob=True,
                                    cast_routing_weights=False, shared_expert_size=0,
                                    sparse_layers=(True,))
    quant = SCHEMES["fp8-blocks"]
    rng = np.random.default_rng(2)
    path, transform, index = mixtral_arch.hf_param_path(
        "model.layers.0.mlp.experts.1.down_proj.weight", arch)
    check(path[-1], transform, quant, random_tensor(quant, (32, 16), rng), index=index)
    fused = random_tensor(quant, (3, 32, 32), rng)  # transformers 5's [E, 2F, D]
    for path, transform in mixtral_arch.hf_param_path("model.layers.0.mlp.experts.gate_up_proj",
                                                      arch):
        check(path[-1], transform, quant, fused)


def test_mxfp4_experts_stay_four_bit():
    from jaxserve.models.mxfp4 import dequantize, quantize

    rng = np.random.default_rng(3)
    weight = rng.normal(size=(2, 64, 32)).astype(np.float32)  # [E, in, out]
    blocks, scales = quantize(weight)
    qt = mxfp4_tensor(blocks, scales)
    quant = checkpoint_quant({"quantization_config": {"quant_method": "mxfp4"}})
    np.testing.assert_array_equal(float_of(qt, quant), dequantize(blocks, scales))
    parts = engine_layout(qt, lambda w: w[..., ::2], CONTRACTED["experts_gate"], quant)
    assert parts["values"].shape == (2, 32, 16) and parts["scale"].dtype == np.uint8
    got = device_dequantized("experts_gate", (2, 64, 16), parts, quant)
    np.testing.assert_array_equal(got, np.asarray(dequantize(blocks, scales),
                                                  np.float32)[..., ::2])


def test_a_layout_that_mixes_inputs_and_outputs_is_refused():
    quant = SCHEMES["int8-channel"]
    qt = random_tensor(quant, (8, 16), np.random.default_rng(4))
    with pytest.raises(ValueError, match="mixes input and output"):
        engine_layout(qt, lambda w: w.reshape(16, 8), (0,), quant)


@pytest.mark.parametrize("codes,activations,group", [
    ("float8_e4m3fn", "dynamic-token", 0), ("float8_e4m3fn", "dynamic-group", 8),
    ("int8", "dynamic-token", 0), ("int8", "static", 0)])
def test_activations_round_to_the_codes_grid(codes, activations, group):
    quant = LinearQuant("x", "x", codes, activations=activations, activation_codes=codes,
                        activation_group=group)
    x = np.random.default_rng(5).normal(size=(3, 4, 8)).astype(np.float32)
    scale = np.float32(0.02)
    got = np.asarray(quantize_activations(jnp.asarray(x), quant, 2, jnp.asarray(scale)))
    flat = x.reshape(3, -1)
    size = group or flat.shape[1]
    grouped = flat.reshape(3, -1, size)
    limit = 448.0 if codes == "float8_e4m3fn" else 127.0
    s = scale if activations == "static" else np.abs(grouped).max(-1, keepdims=True) / limit
    q = np.clip(grouped / s, -limit, limit)
    q = np.round(q) if codes == "int8" else q.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_allclose(got, (q * s).reshape(x.shape), rtol=1e-6, atol=1e-7)


# ---- quantization_config ---------------------------------------------------------------

def config(qc) -> dict:
    return {"num_hidden_layers": 2, "quantization_config": qc}


@pytest.mark.parametrize("method,name", [("gguf", "GGUF"), ("bitsandbytes", "bitsandbytes"),
                                         ("hqq", "HQQ"), ("aqlm", "AQLM"),
                                         ("something_new", "'something_new'")])
def test_unsupported_methods_are_refused_by_name(method, name):
    with pytest.raises(ValueError, match=f"{name} checkpoints are not supported"):
        checkpoint_quant(config({"quant_method": method}))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3}, "bits 3"),
    ({"quant_method": "gptq", "lm_head": True}, "quantized lm_head"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}},
     "nvfp4-pack-quantized"),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8},
      "config_groups": {}}, "kv_cache_scheme"),
    ({"quant_method": "awq", "modules_to_not_convert": ["model.layers.0.self_attn"]},
     "layer 1 differently"),
])
def test_unsupported_variants_are_refused_naming_the_field(qc, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_quant(config(qc))


def test_ignore_lists_leave_whole_classes_unquantized():
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {
              "num_bits": 8, "type": "float", "strategy": "channel"}}}}
    quant = checkpoint_quant(config(ct))
    assert quant.kinds == ("mlp", "experts") and quant.codes == "float8_e4m3fn"
    assert not quant.covers("wq") and quant.covers("w_down") and quant.covers("experts_up")
    assert checkpoint_quant({"quantization_config": None}) is None


JSON = st.recursive(st.none() | st.booleans() | st.integers(-300, 300) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
KEYS = st.sampled_from(["quant_method", "bits", "group_size", "version", "zero_point",
                        "desc_act", "sym", "checkpoint_format", "fmt", "activation_scheme",
                        "weight_block_size", "format", "config_groups", "ignore",
                        "quantization_status", "modules_to_not_convert", "dynamic"])
METHODS = st.sampled_from(["fp8", "awq", "gptq", "compressed-tensors", "mxfp4", "gguf"])


@settings(max_examples=100, deadline=None)
@given(method=METHODS, fields=st.dictionaries(KEYS, JSON, max_size=6))
def test_fuzzed_quantization_configs_load_or_fail_with_a_value_error(method, fields):
    qc = {"quant_method": method, **{k: v for k, v in fields.items() if k != "quant_method"}}
    try:
        quant = checkpoint_quant(config(json.loads(json.dumps(qc))))
    except ValueError:
        return
    assert quant is None or isinstance(quant, LinearQuant)


PIECES = {"awq": {"qweight": ((16, 4), np.int32), "qzeros": ((2, 4), np.int32),
                  "scales": ((2, 32), np.float16)},
          "gptq": {"qweight": ((2, 32), np.int32), "qzeros": ((2, 4), np.int32),
                   "scales": ((2, 32), np.float16), "g_idx": ((16,), np.int32)},
          "ct-pack": {"weight_packed": ((32, 2), np.int32), "weight_scale": ((32, 2), np.float32),
                      "weight_shape": ((2,), np.int64)},
          "fp8-block": {"weight": ((32, 16), ml_dtypes.float8_e4m3fn),
                        "weight_scale_inv": ((2, 1), np.float32)}}
QUANTS = {"awq": SCHEMES["int4-groups-zero"], "gptq": dataclasses.replace(
              SCHEMES["uint8-groups"], codes="uint4", group_size=8),
          "ct-pack": LinearQuant("compressed-tensors", "ct-pack", "uint4", group_size=8, zero=8),
          "fp8-block": SCHEMES["fp8-blocks"]}
DTYPES = st.sampled_from([np.int32, np.int64, np.uint8, np.int8, np.float16, np.float32,
                          ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
SHAPES = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=100, deadline=None)
@given(fmt=st.sampled_from(sorted(PIECES)), data=st.data())
def test_fuzzed_quantized_tensors_load_or_fail_with_a_value_error(fmt, data):
    """A module's pieces with any of them swapped for an array of another shape or dtype:
    read and laid out, or refused with a ValueError, never another exception."""
    from jaxserve.models.quant_tensors import combine

    got = {k: np.zeros(shape, dtype) for k, (shape, dtype) in PIECES[fmt].items()}
    if fmt == "ct-pack":
        got["weight_shape"] = np.array([32, 16])
    for key in data.draw(st.sets(st.sampled_from(sorted(got)), max_size=2)):
        got[key] = np.zeros(data.draw(SHAPES), data.draw(DTYPES))
    quant = QUANTS[fmt]
    try:
        qt = combine(quant, got, "x")
        engine_layout(qt, lambda w: w.T, (0,), quant)
    except ValueError:
        pass


@pytest.mark.parametrize("scheme", ["int4-groups-zero", "fp8-blocks-activations",
                                    *(pytest.param(s, marks=pytest.mark.slow) for s in (
                                        "uint8-groups", "fp8-blocks", "int4-sym"))])
def test_few_tokens_take_the_grouped_product_with_the_same_result(scheme):
    """Decode-sized steps multiply group by group on the codes (no dequantized kernel
    written out); the result is x times the dequantized kernel, up to float rounding."""
    from jaxserve.models.jax import quantized
    from jaxserve.models.jax.quantized import matmul

    quant = {"fp8-blocks-activations": dataclasses.replace(
                 SCHEMES["fp8-blocks"], activations="dynamic-group",
                 activation_codes="float8_e4m3fn", activation_group=16),
             "int4-sym": SCHEMES["int4-channel-sym"].__class__(
                 "compressed-tensors", "ct-pack", "uint4", group_size=8, zero=8)}.get(
        scheme) or SCHEMES[scheme]
    rng = np.random.default_rng(6)
    qt = random_tensor(quant, (4 * 8, 32), rng)  # wq of 4 heads x 8 from D = 32
    path, transform = llama_arch.hf_param_path("model.layers.0.self_attn.q_proj.weight",
                                               dataclasses.replace(ARCH, kv_replicas=1))
    parts = engine_layout(qt, transform, CONTRACTED["wq"], quant)

    class Holder:  # matmul reads getattr(module, name)
        pass

    holder = Holder()
    holder.wq = QuantizedKernel("wq", (32, 4, 8), quant)
    for part, value in parts.items():
        getattr(holder.wq, part).set_value(jnp.asarray(value))
    x = jnp.asarray(rng.normal(size=(3, 32)), jnp.float32)
    assert quantized._groupable(holder.wq, 3)
    grouped = matmul("td,dnh->tnh", x, holder, "wq")
    want = quantized.quantize_activations(x, quant, 1) @ holder.wq.dequantized(
        jnp.float32).reshape(32, 32)
    np.testing.assert_allclose(np.asarray(grouped).reshape(3, 32), np.asarray(want),
                               rtol=2e-5, atol=2e-5)
