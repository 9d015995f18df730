"""A quantized latent cache (kv_cache_dtype fp8 / int8 on DeepSeek's multi-head latent
attention): the layer's own path (attend_mla.make_attend_latent: quantize the step's
entries with a scale for the latent and one for the rope key, write them, fold the scales
into the queries and the output) through each MLA implementation, against the float64
oracle; and the engine on the tiny DeepSeek-V3 checkpoint.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from support.attention_cases import SPECS, assert_close, f64
from support.mla_cases import make_mla_case, mla_scale, numpy_mla

from jaxserve import LLM, SamplingParams
from jaxserve.backends.jax import kv_quant
from jaxserve.backends.jax.attend_mla import make_attend_latent
from jaxserve.config.mesh import DATA, MODEL
from jaxserve.kernels_pallas import gpu_ragged_paged_mla, mla_ref, ragged_paged_mla, ref

IMPLS = {
    "reference": mla_ref.ragged_paged_mla,
    "tpu-interpret": functools.partial(ragged_paged_mla.ragged_paged_mla, interpret=True),
    "gpu-interpret": functools.partial(gpu_ragged_paged_mla.ragged_paged_mla, interpret=True),
}
ONE_DEVICE = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), (DATA, MODEL))
# max |error| / max |expected| against the unquantized cache (a random N(0, 1) cache: the
# latent and rope parts each quantized by their largest value)
QUANT_TOL = {"fp8": 0.08, "int8": 0.03}


def _quantized_case(impl, fmt, dtype, *, r_scale_factor=1.0):
    """(got, batch, unquantized oracle, dequantized oracle): the step's entries go through
    attend_latent with the scales of the case's cache; earlier tokens' entries are in the
    cache already, quantized the same way."""
    rng = np.random.default_rng(7)
    latent, rope = 64, 16
    specs = SPECS["mixed"](rng, 16)
    q_latent, q_rope, cache, batch = make_mla_case(
        rng, specs, block_size=16, num_heads=4, latent=latent, rope=rope, dtype=dtype,
        num_rows=len(specs) + 2, num_tokens=sum(q for q, _ in specs) + 3)
    values = kv_quant.value_dtype(fmt, dtype)
    amax = lambda part: jnp.abs(part.astype(jnp.float32)).max()[None]  # f32[1]
    c_scale = kv_quant.scales_from_amax(amax(cache[..., :latent]), fmt)
    r_scale = kv_quant.scales_from_amax(amax(cache[..., latent:]), fmt)
    flat = cache.reshape(-1, latent + rope)
    stored = jnp.concatenate([kv_quant.quantize(flat[:, None, :latent], c_scale, values),
                              kv_quant.quantize(flat[:, None, latent:], r_scale, values)],
                             axis=-1)[:, 0].reshape(cache.shape)
    storage = ref.kv_storage_dtype(values, "cpu")  # fp8: its bits as uint8, as on the CPU
    if storage != values:
        stored = jax.lax.bitcast_convert_type(stored, storage)
    entry = flat[np.asarray(batch.slot_mapping)]  # the step's own entries, unquantized
    attend = make_attend_latent(IMPLS[impl], ONE_DEVICE, values)
    scale = mla_scale(latent, rope)
    out, (written, *_) = jax.jit(functools.partial(attend, scale=scale))(
        q_latent, q_rope, entry, (stored, c_scale, r_scale * r_scale_factor), batch)
    assert written.dtype == storage and written.shape == cache.shape
    dequantized = jnp.concatenate(
        [ref.values(stored[..., :latent], values).astype(jnp.float32) * c_scale,
         ref.values(stored[..., latent:], values).astype(jnp.float32) * r_scale], axis=-1)
    return (out, batch, numpy_mla(q_latent, q_rope, cache, batch, scale=scale),
            numpy_mla(q_latent, q_rope, dequantized, batch, scale=scale))


def _error(got, want, batch):
    real = int(np.asarray(batch.cu_q_lens)[int(np.asarray(batch.num_seqs)[0])])
    return np.abs(f64(got)[:real] - want[:real]).max() / np.abs(want[:real]).max()


# Every implementation with both formats; bf16 on the reference and one kernel each.
CASES = [("reference", "fp8", "float32"), ("reference", "int8", "bfloat16"),
         ("tpu-interpret", "fp8", "bfloat16"), ("tpu-interpret", "int8", "float32"),
         ("gpu-interpret", "fp8", "float32"), ("gpu-interpret", "int8", "bfloat16")]


@pytest.mark.parametrize("impl,fmt,dtype", CASES)
def test_quantized_latent_cache_through_the_layer(impl, fmt, dtype):
    got, batch, unquantized, exact = _quantized_case(impl, fmt, dtype)
    assert got.dtype == jnp.dtype(dtype)
    assert_close(got, exact, batch, dtype)  # what the kernel really reads
    assert _error(got, unquantized, batch) <= QUANT_TOL[fmt]


def test_the_tolerance_is_not_loose():
    """int8 is several times closer to the unquantized attention than fp8, and a rope-key
    scale off by 2x (the latent's right) is far outside the bound."""
    errors = {}
    for fmt in ("fp8", "int8"):
        got, batch, unquantized, _ = _quantized_case("reference", fmt, "float32")
        errors[fmt] = _error(got, unquantized, batch)
    assert errors["int8"] < errors["fp8"] / 3, errors
    got, batch, unquantized, _ = _quantized_case("reference", "int8", "float32",
                                                 r_scale_factor=2.0)
    assert _error(got, unquantized, batch) > 3 * QUANT_TOL["int8"]


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_one_byte_latent_cache_lowers(platform, fmt):
    """The MLA kernels read a one-byte cache in a V3 mixed bucket (bf16 queries, 16 heads):
    Mosaic's lowering for the TPU and Triton's for CUDA, without a device."""
    from jax import export
    from support.abstract_cases import abstract_mla_case

    values = kv_quant.value_dtype(fmt, jnp.bfloat16)
    q_latent, q_rope, cache, batch = abstract_mla_case(512, 64, 16, 16, 4096, 128,
                                                       jnp.dtype("bfloat16"))
    cache = jax.ShapeDtypeStruct(cache.shape, values)
    module = ragged_paged_mla if platform == "tpu" else gpu_ragged_paged_mla
    fn = jax.jit(functools.partial(module.ragged_paged_mla, scale=mla_scale(512, 64),
                                   kv_dtype=values))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = export.export(fn, platforms=[platform], disabled_checks=checks)(
        q_latent, q_rope, cache, batch)
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in \
        exported.mlir_module()
    assert exported.out_avals[0].dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- the engine


def _prompt_logprobs(llm, prompts) -> np.ndarray:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return np.array([entry[token].logprob for o, p in zip(outs, prompts)
                     for entry, token in zip(o.prompt_logprobs[1:], p[1:])])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_a_quantized_latent_cache(dtype, tiny_checkpoints):
    """fp8 and int8 latent caches on the tiny DeepSeek-V3: one byte per value, two positive
    calibrated scales per layer, a quarter (float32) or half (bfloat16) of the cache's bytes
    per block, and teacher-forced logprobs near the unquantized cache's (int8 nearer than
    fp8); chunked prefill so that later chunks read quantized entries. (The layer's path is
    checked exactly above; this checks the engine's wiring: calibration, sizing, caches.)"""
    common = dict(dtype=dtype, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4,
                  precompile=False)
    folder = str(tiny_checkpoints["deepseek_v3"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, n).tolist() for n in (90, 47)]
    base = LLM(folder, **common)
    want, base_bytes = _prompt_logprobs(base, prompts), base.engine.runner.bytes_per_block
    del base
    gaps = {}
    for fmt, storage in (("fp8", jnp.uint8), ("int8", jnp.int8)):
        llm = LLM(folder, kv_cache_dtype=fmt, **common)
        runner = llm.engine.runner
        cache, c_scale, r_scale = runner.kv_caches[0]
        assert cache.dtype == storage  # fp8: its bits on the CPU
        assert c_scale.shape == r_scale.shape == (1,)
        assert float(c_scale[0]) > 0 and float(r_scale[0]) > 0
        assert runner.bytes_per_block * jnp.dtype(dtype).itemsize == base_bytes
        got = _prompt_logprobs(llm, prompts)
        gaps[fmt] = np.abs(got - want).mean()
        del llm
    # This random model's logprobs are fragile: bfloat16 itself moves them by ~0.37 from
    # float32, fp8 by ~1.0 and int8 by ~0.6; a rope-key scale left out of the queries moves
    # them by ~4.2.
    assert gaps["int8"] < gaps["fp8"] < 1.5, gaps


@pytest.mark.slow  # three meshes in a subprocess: the suite's time budget
def test_quantized_latent_cache_tokens_do_not_depend_on_the_mesh(tiny_checkpoints):
    """The scales go into shard_map replicated beside the latent cache: 1x2 (heads split)
    and 1x4 with expert parallelism give the one-device tokens, fp8 and int8."""
    from support.mesh import mesh_runs

    runs = mesh_runs(tiny_checkpoints["deepseek_v3"],
                     ["1x1:fp8kv", "1x2:fp8kv", "1x1:int8kv", "1x4:ep,int8kv"])
    assert runs["1x1:fp8kv"]["cache_dtype"] == "uint8"  # fp8's bits on the CPU
    assert runs["1x2:fp8kv"]["tokens"] == runs["1x1:fp8kv"]["tokens"]
    assert runs["1x4:ep,int8kv"]["tokens"] == runs["1x1:int8kv"]["tokens"]


@pytest.mark.slow  # a full step compiled per format (the suite's time budget)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantized_latent_step_never_touches_the_whole_cache(tiny_checkpoints, fmt):
    """As for a multi-head cache: the compiled step of a one-byte latent cache converts,
    copies or quantizes no more than the step's own pages."""
    from support.cache_hlo import NUM_BLOCKS, whole_cache_arrays

    llm = LLM(str(tiny_checkpoints["deepseek_v3"]), dtype="bfloat16", num_kv_blocks=NUM_BLOCKS,
              kv_cache_dtype=fmt, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
              precompile=False, compilation_cache_dir=None)
    runner = llm.engine.runner
    hlo = runner._compile_step(16, 2).as_text()
    assert whole_cache_arrays(hlo, runner.kv_caches[0][0].size) == []
