"""The quantized KV cache (kv_cache_dtype fp8 / int8): formats, every attention
implementation on the kernels' test matrix, the engine, plan and flags.

Stated tolerances (max abs error / max abs expected output, as attention_cases.assert_close):
against the float64 oracle on the UNQUANTIZED cache, fp8 (e4m3, 3 mantissa bits) stays
within QUANT_TOL["fp8"] and int8 within QUANT_TOL["int8"]; against the oracle on the
dequantized cache (the values the kernel really reads), every implementation is as exact as
with an unquantized cache (attention_cases.TOL), so the kernels add no error of their own.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import MATRIX, TOL, f64, numpy_attention, padded_case

from jaxserve import LLM, SamplingParams
from jaxserve.backends.jax import kv_quant
from jaxserve.config.engine_config import CacheConfig
from jaxserve.kernels_pallas import (
    cpu_attention,
    gpu_ragged_paged_attention,
    ragged_paged_attention,
    ref,
)

QUANT_TOL = {"fp8": 0.08, "int8": 0.03}
IMPLS = {
    "reference": ref.ragged_paged_attention,
    "cpu": cpu_attention.ragged_paged_attention,
    "tpu-interpret": functools.partial(ragged_paged_attention.ragged_paged_attention,
                                       interpret=True),
    "gpu-interpret": functools.partial(gpu_ragged_paged_attention.ragged_paged_attention,
                                       interpret=True),
}


def test_quantize_saturates_and_rounds():
    scale = jnp.asarray([0.5, 2.0], jnp.float32)  # [K]
    x = jnp.asarray([[[1000.0, -1000.0, 0.74], [3.0, -3.0, 0.5]]], jnp.float32)  # [T, K, H]
    fp8 = kv_quant.quantize(x, scale, jnp.float8_e4m3fn).astype(jnp.float32)
    assert np.isfinite(np.asarray(fp8)).all()  # a plain cast would give NaN past 448
    np.testing.assert_array_equal(fp8[0, 0, :2], [448.0, -448.0])
    i8 = kv_quant.quantize(x, scale, jnp.int8)
    assert i8.dtype == jnp.int8
    np.testing.assert_array_equal(i8[0, 0], [127, -127, 1])  # 0.74 / 0.5 = 1.48 -> 1
    np.testing.assert_array_equal(i8[0, 1], [2, -2, 0])  # 3 / 2 = 1.5 -> 2 (to even)
    # A scale maps the calibrated largest value below the format's largest, with headroom;
    # a head that was all zeros in calibration still gets a usable scale.
    for name, largest in (("fp8", 448.0), ("int8", 127.0)):
        s = np.asarray(kv_quant.scales_from_amax(jnp.asarray([2.0, 0.0]), name))
        assert s[0] * largest > 2.0 and s[1] > 0


def _quantized_case(impl_name, fmt, case_index):
    kind, block_size, ratio, head_dim, dtype = MATRIX[case_index]
    rng = np.random.default_rng(100 + case_index)
    q, k_cache, v_cache, batch = padded_case(rng, kind, block_size, ratio, head_dim, dtype)
    values = kv_quant.value_dtype(fmt, dtype)
    flat = (-1,) + k_cache.shape[2:]
    amax = lambda c: jnp.abs(c.astype(jnp.float32)).max((0, 1, 3))  # [K]
    k_scale = kv_quant.scales_from_amax(amax(k_cache), fmt)
    v_scale = kv_quant.scales_from_amax(amax(v_cache), fmt)
    storage = ref.kv_storage_dtype(values, "cpu")  # fp8: its bits as uint8, as on the CPU

    def stored(cache, s):
        quant = kv_quant.quantize(cache.reshape(flat), s, values).reshape(cache.shape)
        return quant if storage == values else jax.lax.bitcast_convert_type(quant, storage)

    kq, vq = stored(k_cache, k_scale), stored(v_cache, v_scale)
    scale = 1.0 / math.sqrt(head_dim)
    fn = jax.jit(lambda q, k, v, b: kv_quant.scale_output(IMPLS[impl_name](
        kv_quant.scale_queries(q, k_scale), k, v, b, scale=scale, kv_dtype=values), v_scale))
    got = fn(q, kq, vq, batch)
    dequant = lambda c, s: (ref.values(c, values).astype(jnp.float32)
                            * s[None, None, :, None])
    return got, batch, dtype, scale, (q, k_cache, v_cache), (dequant(kq, k_scale),
                                                             dequant(vq, v_scale))


def _error(got, want, batch):
    real = int(np.asarray(batch.cu_q_lens)[int(np.asarray(batch.num_seqs)[0])])
    got = f64(got)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[real:], 0.0)
    return np.abs(got[:real] - want[:real]).max() / np.abs(want[:real]).max()


# Every implementation x both formats; the matrix's cases split over them (each case and
# each implementation seen with both formats and both dtypes) to bound compile time. The
# first case of each (implementation, format) runs by default, the others with -m slow.
QUANT_MATRIX = [(impl, fmt, i) for n, impl in enumerate(IMPLS) for fmt in ("fp8", "int8")
                for i in range(len(MATRIX)) if (i + n + (fmt == "int8")) % 4 == 0]
_FIRST = {}
for _impl, _fmt, _i in QUANT_MATRIX:
    _FIRST.setdefault((_impl, _fmt), _i)
QUANT_PARAMS = [pytest.param(impl, fmt, i, id=f"{impl}-{fmt}-{'-'.join(map(str, MATRIX[i]))}",
                             marks=() if _FIRST[impl, fmt] == i else pytest.mark.slow)
                for impl, fmt, i in QUANT_MATRIX]


@pytest.mark.parametrize("impl,fmt,case", QUANT_PARAMS)
def test_quantized_cache_matrix(impl, fmt, case):
    got, batch, dtype, scale, (q, k_cache, v_cache), (kd, vd) = _quantized_case(impl, fmt, case)
    assert got.dtype == q.dtype and got.shape == q.shape
    exact = numpy_attention(q, kd, vd, batch, scale=scale)  # what the kernel really reads
    assert _error(got, exact, batch) <= TOL[dtype]
    unquantized = numpy_attention(q, k_cache, v_cache, batch, scale=scale)
    assert _error(got, unquantized, batch) <= QUANT_TOL[fmt]


def test_the_tolerance_is_not_loose():
    """An int8 cache is an order of magnitude closer to the unquantized attention than
    fp8 here, and a cache with a wrong scale (every key scale doubled) is far outside
    QUANT_TOL: the matrix's bound can fail."""
    errors = {}
    for fmt in ("fp8", "int8"):
        got, batch, _, scale, (q, k, v), _ = _quantized_case("reference", fmt, 0)
        errors[fmt] = _error(got, numpy_attention(q, k, v, batch, scale=scale), batch)
    assert errors["int8"] < errors["fp8"] / 3
    got, batch, _, scale, (q, k, v), _ = _quantized_case("reference", "int8", 0)
    wrong = numpy_attention(q, 2 * f64(k), v, batch, scale=scale)
    assert _error(got, wrong, batch) > 3 * QUANT_TOL["int8"]


# ----------------------------------------------------------------------------- the engine


def _greedy(llm, prompts, tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return np.array([o.outputs[0].token_ids
                     for o in llm.generate(prompts, params, use_tqdm=False)])


PROMPTS = ["def merge(a, b):\n    ", "import os\nimport sys\n\n", "class Config:\n    \"\"\"",
           "for i in range(10):\n", "    return self.", "# Copyright (c) 2024\n"]


def _perplexity(llm, windows) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(windows, params, use_tqdm=False)
    nll = [-entry[token].logprob for out, window in zip(outs, windows)
           for entry, token in zip(out.prompt_logprobs[1:], window[1:])]
    return float(np.exp(np.mean(nll)))


@pytest.mark.slow  # three engines of the built-in model, ~90 s cold (the suite's budget)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_builtin_model_quality(dtype):
    """fp8 and int8 caches against the model's own cache dtype, on the built-in (trained)
    model: perplexity of held-out code (the standard library's json package, which it never
    trained on) within 1%; int8 in float32 keeps >= 90% of greedy positions, and every
    format well over half (a broken read-back agrees on almost none). The caches are one
    byte per element, with a positive scale per kv head."""
    import json
    import pathlib

    common = dict(dtype=dtype, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
                  precompile=False)
    base = LLM(**common)
    text = (pathlib.Path(json.__file__).parent / "decoder.py").read_text()
    ids = base.get_tokenizer().encode(text)
    windows = [ids[i:i + 96] for i in range(0, 8 * 96, 96)]
    want_ppl, want = _perplexity(base, windows), _greedy(base, PROMPTS)
    del base
    for fmt, storage in (("fp8", jnp.uint8), ("int8", jnp.int8)):
        llm = LLM(kv_cache_dtype=fmt, **common)
        runner = llm.engine.runner
        assert runner.kv_caches[0][0].dtype == storage  # fp8: its bits on the CPU
        k_scale = runner.kv_caches[0][2]
        assert k_scale.shape == (runner.arch.num_kv_heads,)
        assert (np.asarray(k_scale) > 0).all()
        rise = _perplexity(llm, windows) / want_ppl - 1
        assert abs(rise) < 0.01, f"{fmt} {dtype}: perplexity {100 * rise:+.2f}%"
        agree = (_greedy(llm, PROMPTS) == want).mean()
        floor = 0.9 if (fmt, dtype) == ("int8", "float32") else 0.6
        assert agree >= floor, f"{fmt} {dtype}: {agree:.1%} of greedy positions agree"


@pytest.mark.slow  # a full step compiled per format, ~14 s cold each (the suite's budget)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantized_step_never_touches_the_whole_cache(tiny_checkpoint, fmt):
    """As test_kv_cache_dtype.py checks for bf16: the compiled step of a one-byte cache
    converts, copies or quantizes no more than the step's own pages."""
    from support.cache_hlo import NUM_BLOCKS, whole_cache_arrays

    llm = LLM(str(tiny_checkpoint), dtype="bfloat16", num_kv_blocks=NUM_BLOCKS,
              kv_cache_dtype=fmt, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64, precompile=False, compilation_cache_dir=None)
    runner = llm.engine.runner
    k_cache = runner.kv_caches[0][0]
    hlo = runner._compile_step(16, 2).as_text()
    assert whole_cache_arrays(hlo, k_cache.size) == []


def test_blocks_per_gib_double_against_bf16(tiny_checkpoint):
    """The same KV budget holds twice the blocks with a one-byte cache; the runner, the
    engine's block manager and `jaxserve plan` agree."""
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.config.kv_sizing import bytes_per_block
    from jaxserve.config.plan import make_plan
    from jaxserve.config.plan_text import format_plan

    config = EngineConfig.create(str(tiny_checkpoint), dtype="bfloat16", max_model_len=128)
    arch = config.model.hf_config
    per_block = bytes_per_block(arch["num_hidden_layers"], 16, arch["num_key_value_heads"],
                                arch["hidden_size"] // arch["num_attention_heads"],
                                "bfloat16")
    budget = 20 * per_block  # 20 bf16 blocks; below the host's cap of max_num_seqs' worth
    common = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=64, precompile=False, kv_cache_memory_bytes=budget)
    blocks = {}
    for fmt in ("auto", "fp8", "int8"):
        llm = LLM(str(tiny_checkpoint), kv_cache_dtype=fmt, **common)
        runner = llm.engine.runner
        blocks[fmt] = runner.num_blocks
        config = EngineConfig.create(str(tiny_checkpoint), dtype="bfloat16",
                                     max_model_len=128, kv_cache_memory_bytes=budget,
                                     kv_cache_dtype=fmt)
        plan = make_plan(config, 16 << 30)
        assert plan.bytes_per_block == runner.bytes_per_block
        assert plan.num_blocks == runner.num_blocks
        assert llm.engine.kv_manager.capacity_tokens == (runner.num_blocks - 1) * 16
        if fmt != "auto":
            assert "1 B " in format_plan(plan) and "scale per layer" in format_plan(plan)
    assert blocks == {"auto": 20, "fp8": 40, "int8": 40}


@pytest.mark.slow  # three engines, ~90 s cold (the suite's budget)
def test_with_prefix_caching_preemption_and_speculation(tiny_checkpoint, monkeypatch):
    """A quantized cache under pressure (few blocks: preemption; shared prefixes: prefix
    cache hits; chunked prefill) and with n-gram speculation gives the same greedy tokens as
    the same quantized engine without pressure: blocks are written and read back the same
    way on every path."""
    shared = "import os\nimport sys\nimport json\n\n\ndef main(argv):\n    "
    prompts = [shared + f"value_{i} = {i} * {i + 1}\n" * 2 for i in range(6)]
    common = dict(dtype="float32", max_model_len=128, precompile=False, kv_cache_dtype="int8")
    plain = LLM(str(tiny_checkpoint), max_num_seqs=8, max_num_batched_tokens=256, **common)
    outs = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                  ignore_eos=True), use_tqdm=False)
    want = np.array([o.outputs[0].token_ids for o in outs])
    tight = LLM(str(tiny_checkpoint), max_num_seqs=6, max_num_batched_tokens=16,
                num_kv_blocks=20, block_size=8, **common)
    np.testing.assert_array_equal(_greedy(tight, prompts, 24), want)
    assert tight.engine.num_preemptions > 0 and tight.engine.stats().prefix_cache_hits > 0
    # Proposals: the known continuations, 30% corrupted (a tiny random model rarely repeats
    # itself, so real n-gram proposals would hardly ever be kept).
    from support.spec_helpers import KnownContinuations

    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", KnownContinuations(sequences))
    spec = LLM(str(tiny_checkpoint), max_num_seqs=8, max_num_batched_tokens=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_max": 3}, **common)
    np.testing.assert_array_equal(_greedy(spec, prompts, 24), want)
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 10 and stats.spec_draft_tokens > stats.spec_accepted_tokens


@pytest.mark.slow  # three meshes in a subprocess, ~90 s (the suite's time budget)
def test_quantized_cache_tokens_do_not_depend_on_the_mesh(mesh_checkpoints):
    """The scales are calibrated per kv head and split with the cache's heads: an fp8 cache
    on one device and split over 4 (kv heads replicated up to one per device), an int8 one
    on one device and on 2 replicas x 2, give the same greedy tokens."""
    from support.mesh import mesh_runs

    runs = mesh_runs(mesh_checkpoints["llama"], ["1x1:fp8kv", "1x4:fp8kv", "2x2:int8kv",
                                                  "1x1:int8kv"])
    assert runs["1x1:fp8kv"]["tokens"] == runs["1x4:fp8kv"]["tokens"]
    assert runs["1x1:int8kv"]["tokens"] == runs["2x2:int8kv"]["tokens"]
    assert runs["1x4:fp8kv"]["cache_dtype"] == "uint8"  # fp8 bits on the CPU
    assert runs["2x2:int8kv"]["cache_dtype"] == "int8"


def test_kv_cache_dtype_is_validated_and_on_the_command_line(tiny_checkpoint):
    from jaxserve.config.engine_args import EngineArgs

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(tiny_checkpoint), kv_cache_dtype="float16")
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli(parser.parse_args(["--kv-cache-dtype", "fp8"])).kv_cache_dtype \
        == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp4"])


# ----------------------------------------------------------------------------- torch backend


TORCH_CASES = [("triton", "fp8", 0), ("ref", "int8", 1), ("triton", "int8", 5),
               ("triton", "fp8", 6), ("ref", "fp8", 3)]
TORCH_PARAMS = [pytest.param(impl, fmt, i, id=f"{impl}-{fmt}-{'-'.join(map(str, MATRIX[i]))}",
                             marks=() if n < 2 else pytest.mark.slow)
                for n, (impl, fmt, i) in enumerate(TORCH_CASES)]


@pytest.mark.parametrize("impl,fmt,case", TORCH_PARAMS)
def test_torch_quantized_cache_matrix(impl, fmt, case):
    """The torch backend's attention (the Triton kernel in interpret mode, the PyTorch
    reference) over a quantized cache, through the torch kv_quant.attend_quantized: as exact as
    unquantized against the values it reads, within QUANT_TOL of the unquantized cache."""
    import torch
    from support.triton_helpers import to_torch, torch_batch

    from jaxserve.backends.kv_formats import scales_from_amax
    from jaxserve.backends.torch import kv_quant as torch_kv_quant
    from jaxserve.kernels_triton import attention
    from jaxserve.kernels_triton import ref as torch_ref

    kind, block_size, ratio, head_dim, dtype = MATRIX[case]
    rng = np.random.default_rng(200 + case)
    q, k_cache, v_cache, batch = padded_case(rng, kind, block_size, ratio, head_dim, dtype)
    qt, kt, vt = (to_torch(x) for x in (q, k_cache, v_cache))
    values = torch_kv_quant.value_dtype(fmt, qt.dtype)
    scales, stored, dequant = [], [], []
    for cache in (kt, vt):
        amax = cache.float().abs().amax(dim=(0, 1, 3)).numpy()
        scale = torch.from_numpy(scales_from_amax(amax, fmt))
        quant = torch_kv_quant.quantize(cache.flatten(0, 1), scale, values).view(cache.shape)
        scales.append(scale)
        stored.append(quant)
        dequant.append((quant.float() * scale[None, None, :, None]).numpy())
    attend_fn = (torch_ref.ragged_paged_attention if impl == "ref" else
                 lambda *a, **kw: attention.ragged_paged_attention(*a, interpret=True, **kw))
    attend = torch_kv_quant.attend_quantized(lambda *args: None, attend_fn)
    zeros = torch.zeros((qt.shape[0],) + kt.shape[2:], dtype=qt.dtype)
    scale = 1.0 / math.sqrt(head_dim)
    tb = torch_batch(batch)
    tb.slot_mapping = to_torch(batch.slot_mapping)
    got = attend(qt, zeros, zeros, (*stored, *scales), tb, scale=scale)
    assert got.dtype == qt.dtype and got.shape == qt.shape
    got = got.float().numpy()
    assert _error(got, numpy_attention(q, *dequant, batch, scale=scale), batch) <= TOL[dtype]
    unquantized = numpy_attention(q, k_cache, v_cache, batch, scale=scale)
    assert _error(got, unquantized, batch) <= QUANT_TOL[fmt]


@pytest.mark.parametrize("fmt,attention_backend", [
    ("int8", "reference"), pytest.param("fp8", "triton-interpret", marks=pytest.mark.slow)])
def test_backends_store_and_read_the_same_quantized_cache(tiny_checkpoint, fmt,
                                                          attention_backend):
    """The JAX backend and the torch backend (the PyTorch reference, or the Triton kernels
    in interpret mode) calibrate the same scales and give the same greedy tokens on a
    quantized cache, float32."""
    prompts = ["def add(a, b):", "import os\nimport sys\n"]
    common = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                  precompile=False, dtype="float32")
    jax_llm = LLM(str(tiny_checkpoint), kv_cache_dtype=fmt, **common)
    want = _greedy(jax_llm, prompts, 12)
    torch_llm = LLM(str(tiny_checkpoint), kv_cache_dtype=fmt, backend="torch",
                    attention_backend=attention_backend, **common)
    np.testing.assert_array_equal(_greedy(torch_llm, prompts, 12), want)
    jax_scale = np.asarray(jax_llm.engine.runner.kv_caches[0][2])
    torch_scale = torch_llm.engine.runner.kv_caches[0][2].numpy()
    np.testing.assert_allclose(torch_scale, jax_scale, rtol=1e-5)
    assert torch_llm.engine.runner.bytes_per_block == jax_llm.engine.runner.bytes_per_block
