"""Every ragged paged attention implementation, and write_kv, against the float64 numpy oracle
of attention_cases.py: the reference, the XLA:CPU version, and both Pallas kernels in
interpret mode (TPU-style with simulated DMA, GPU-style). test_pallas_kernels.py adds the
kernels' own matrix (GQA ratios, head dims, tile sizes) and their CUDA/TPU lowering.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import (
    SINK_CASES,
    SPECS,
    assert_close,
    f64,
    gather_dense,
    make_case,
    numpy_attention,
    padded_case,
    random_sinks,
)

from jaxserve.kernels_pallas import (
    cpu_attention,
    gpu_ragged_paged_attention,
    ragged_paged_attention,
    ref,
)
from jaxserve.kernels_pallas.ref import KV_TOKENS_PER_STEP, write_kv

jax.config.update("jax_enable_x64", False)

IMPLS = {"ref": ref.ragged_paged_attention,
         "cpu": cpu_attention.ragged_paged_attention,
         "tpu-interpret": functools.partial(ragged_paged_attention.ragged_paged_attention,
                                            interpret=True),
         "gpu-interpret": functools.partial(gpu_ragged_paged_attention.ragged_paged_attention,
                                            interpret=True)}
JITTED = {name: jax.jit(fn, static_argnames=("scale", "sliding_window", "soft_cap"))
          for name, fn in IMPLS.items()}


XLA_IMPLS = ("ref", "cpu")
KERNEL_IMPLS = ("tpu-interpret", "gpu-interpret")


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return request.param


def run_and_check(impl, q, k_cache, v_cache, batch, dtype, **kw):
    kw.setdefault("scale", 1.0 / math.sqrt(q.shape[-1]))
    got = JITTED[impl](q, k_cache, v_cache, batch, **kw)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = numpy_attention(q, k_cache, v_cache, batch, **kw)
    assert_close(got, want, batch, dtype)
    return got


# (kind, block_size, num_kv_heads, num_heads, head_dim, dtype): every value of each axis
# appears without paying the full product's compile time (~0.8 s per shape on 2 cores).
CASES = [
    ("decode", 16, 2, 2, 64, "float32"),
    ("prefill", 32, 2, 4, 128, "float32"),
    ("mixed", 16, 1, 4, 64, "float32"),
    ("mixed", 32, 1, 8, 128, "float32"),
    ("decode", 32, 2, 2, 128, "bfloat16"),
    ("mixed", 16, 1, 8, 64, "bfloat16"),
]

# ----------------------------------------------------------------------------- attention


def cases(values, kernel_values):
    """(value, impl) pairs: every value on the XLA implementations, kernel_values on the
    kernels with -m slow (test_pallas_kernels.py covers long contexts, windows, soft caps and
    padded buckets on them by default: its matrix and tile cases; the suite's time budget)."""
    return [(v, impl) for v in values for impl in XLA_IMPLS] + \
        [pytest.param(v, impl, marks=pytest.mark.slow)
         for v in kernel_values for impl in KERNEL_IMPLS]


# The kernels' own matrix (test_pallas_kernels.py) covers these kinds more widely.
@pytest.mark.parametrize("impl", XLA_IMPLS)
@pytest.mark.parametrize("kind,block_size,kv_heads,heads,head_dim,dtype", CASES)
def test_matches_numpy(kind, block_size, kv_heads, heads, head_dim, dtype, impl):
    rng = np.random.default_rng(CASES.index((kind, block_size, kv_heads, heads, head_dim, dtype)))
    specs = SPECS[kind](rng, block_size)
    padding = kind == "mixed"  # padded to a (T, R) bucket, as the runner does
    case = make_case(rng, specs, block_size=block_size, num_kv_heads=kv_heads,
                     num_heads=heads, head_dim=head_dim, dtype=dtype,
                     num_rows=8 if padding else None,
                     num_tokens=sum(q for q, _ in specs) + 3 if padding else None)
    run_and_check(impl, *case, dtype)


@pytest.mark.parametrize("block_size,impl", cases([16, 32], [16]))
def test_long_sequences_span_several_loop_steps(block_size, impl):
    """Contexts > KV_TOKENS_PER_STEP, ending in the last (zero-padded) group of pages."""
    rng = np.random.default_rng(block_size)
    max_model_len = 400  # B = 25 or 13: not a multiple of pages_per_step (8 or 4)
    assert 389 > 3 * KV_TOKENS_PER_STEP
    specs = [(1, 389), (150, 389 - 2 * block_size), (1, 2), (130, 130 + 7)]
    case = make_case(rng, specs, block_size=block_size, num_kv_heads=2, num_heads=4,
                     head_dim=64, max_model_len=max_model_len, junk_tables=True)
    run_and_check(impl, *case, "float32")


@pytest.mark.parametrize("window,impl", cases([1, 37, 200], [1]))
def test_sliding_window(window, impl):
    rng = np.random.default_rng(window)
    S = 16
    specs = [(1, 300), (70, 261), (1, 3), (20, 20), (1, 129)]
    case = make_case(rng, specs, block_size=S, num_kv_heads=2, num_heads=4, head_dim=64,
                     max_model_len=320)
    run_and_check(impl, *case, "float32", sliding_window=window)


@pytest.mark.parametrize("settings,impl", cases([(2.0, None, "float32"), (3.0, 48, "bfloat16")],
                                               [(3.0, 48, "bfloat16")]))
def test_soft_cap(settings, impl):
    soft_cap, window, dtype = settings
    rng = np.random.default_rng(7)
    S = 32
    specs = [(1, 150), (40, 99), (1, 1), (5, 5)]
    case = make_case(rng, specs, block_size=S, num_kv_heads=1, num_heads=2, head_dim=64,
                     dtype=dtype, max_model_len=160)
    # Scaled scores ~ N(0, 16), far beyond the cap; scale != 1 tells scaled from raw scores.
    run_and_check(impl, *case, dtype, scale=0.5, soft_cap=soft_cap, sliding_window=window)


@pytest.mark.parametrize("impl", XLA_IMPLS)
@pytest.mark.parametrize("kind,window,dtype", SINK_CASES)
def test_attention_sinks(kind, window, dtype, impl):
    """A learned logit per head in every softmax's denominator (GPT-OSS), in padded
    buckets: padding rows stay zero. (The kernels: test_pallas_kernels.py.)"""
    rng = np.random.default_rng(SINK_CASES.index((kind, window, dtype)))
    case = padded_case(rng, kind, 16, 4, 64, dtype)
    run_and_check(impl, *case, dtype, sinks=random_sinks(rng, case[0].shape[1]),
                  sliding_window=window)


def test_calibration_attend_with_sinks():
    """The fp8/int8 KV calibration pass attends one fresh sequence as the reference does."""
    from jaxserve.backends.jax.kv_quant import calibration_attend

    rng = np.random.default_rng(5)
    q, k_cache, v_cache, batch = make_case(rng, [(37, 37)], block_size=16, num_kv_heads=2,
                                           num_heads=4, head_dim=64)
    sinks = random_sinks(rng, 4)
    keys = jnp.asarray(gather_dense(np.asarray(k_cache), np.asarray(batch.block_tables)[0],
                                    37, 16))
    values = jnp.asarray(gather_dense(np.asarray(v_cache), np.asarray(batch.block_tables)[0],
                                      37, 16))
    zeros = jnp.zeros(2, jnp.float32)
    got, _ = calibration_attend(q, keys, values, (zeros, zeros), None, scale=0.125,
                                sliding_window=20, sinks=sinks)
    want = numpy_attention(q, k_cache, v_cache, batch, scale=0.125, sliding_window=20,
                           sinks=sinks)
    assert_close(got, want, batch, "float32")


@pytest.mark.parametrize("impl", [*XLA_IMPLS, *(pytest.param(k, marks=pytest.mark.slow)
                                                 for k in KERNEL_IMPLS)])
def test_padded_batch(impl):
    """num_seqs < R and T > the real tokens: padding rows come out finite (zeros)."""
    rng = np.random.default_rng(11)
    specs = [(1, 40), (9, 23), (1, 17)]
    q, k_cache, v_cache, batch = make_case(
        rng, specs, block_size=16, num_kv_heads=2, num_heads=4, head_dim=64,
        num_rows=8, num_tokens=32, junk_tables=True)
    q = q.at[11:].mul(1e3)  # loud padding queries must not leak anywhere
    got = run_and_check(impl, q, k_cache, v_cache, batch, "float32")
    pad = f64(got)[11:]
    assert pad.shape[0] == 21 and np.all(np.isfinite(pad))
    np.testing.assert_array_equal(pad, 0.0)


def test_jit_traces_once_for_dynamic_batch_contents(impl):
    """num_seqs, kv_lens, cu_q_lens and tables are data: one trace serves every batch."""
    traces = []

    def step(q, k_cache, v_cache, batch):
        traces.append(None)
        return IMPLS[impl](q, k_cache, v_cache, batch, scale=0.125)

    step = jax.jit(step)
    rng = np.random.default_rng(3)
    dims = dict(block_size=16, num_kv_heads=1, num_heads=2, head_dim=64, num_rows=4,
                num_tokens=24, max_model_len=160, num_pages=24)
    for specs in ([(1, 5), (10, 10)], [(1, 150), (3, 20), (1, 1), (13, 40)], [(2, 17)]):
        q, k_cache, v_cache, batch = make_case(rng, specs, **dims)
        got = step(q, k_cache, v_cache, batch)
        want = numpy_attention(q, k_cache, v_cache, batch, scale=0.125)
        assert_close(got, want, batch, "float32")
    assert len(traces) == 1


# ----------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_writes_exactly_the_slots(dtype):
    rng = np.random.default_rng(13)
    S, K, H = 16, 2, 64
    specs = [(1, 33), (12, 20), (5, 5)]
    q, k_cache, v_cache, batch = make_case(
        rng, specs, block_size=S, num_kv_heads=K, num_heads=4, head_dim=H, dtype=dtype,
        num_rows=4, num_tokens=24)
    T = q.shape[0]
    real = sum(n for n, _ in specs)
    k_new = rng.standard_normal((T, K, H)).astype(np.float32)  # cast on the way in
    v_new = rng.standard_normal((T, K, H)).astype(np.float32)
    slots = np.asarray(batch.slot_mapping)
    assert np.all(slots[real:] == 0) and np.all(slots[:real] >= S)  # never the null page
    # slot = page * S + offset, from the block table and each token's position
    positions, cu = np.asarray(batch.positions), np.asarray(batch.cu_q_lens)
    tables = np.asarray(batch.block_tables)
    for t in range(real):
        i = int(np.searchsorted(cu[1:], t, side="right"))
        assert slots[t] == tables[i, positions[t] // S] * S + positions[t] % S

    k_out, v_out = jax.jit(write_kv)(k_cache, v_cache, jnp.asarray(k_new), jnp.asarray(v_new),
                                     batch.slot_mapping)
    for old, new, out in ((k_cache, k_new, k_out), (v_cache, v_new, v_out)):
        assert out.shape == old.shape and out.dtype == old.dtype
        old = f64(old).reshape(-1, K, H)
        new = f64(jnp.asarray(new).astype(dtype))
        out = f64(out).reshape(-1, K, H)
        np.testing.assert_array_equal(out[slots[:real]], new[:real])
        assert any(np.array_equal(out[0], new[t]) for t in range(real, T))
        untouched = np.ones(len(old), bool)
        untouched[slots] = False
        np.testing.assert_array_equal(out[untouched], old[untouched])


def test_write_then_attend(impl):
    """A step writes its new K/V at slot_mapping, then attends over context + itself."""
    rng = np.random.default_rng(17)
    S, K, N, H = 16, 2, 4, 64
    specs = [(1, 37), (19, 50), (7, 7), (1, 16)]
    q, k_cache, v_cache, batch = make_case(
        rng, specs, block_size=S, num_kv_heads=K, num_heads=N, head_dim=H, num_rows=6,
        num_tokens=32)
    T = q.shape[0]
    k_new = jnp.asarray(rng.standard_normal((T, K, H)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((T, K, H)), jnp.float32)
    tables, cu = np.asarray(batch.block_tables), np.asarray(batch.cu_q_lens)
    dense = {}
    for i, (q_len, kv_len) in enumerate(specs):  # old context from the cache, then the step's
        ctx = kv_len - q_len
        dense[i] = tuple(
            np.concatenate([gather_dense(f64(c), tables[i], ctx, S),
                            f64(new)[cu[i]:cu[i + 1]]])
            for c, new in ((k_cache, k_new), (v_cache, v_new)))
    k_cache, v_cache = write_kv(k_cache, v_cache, k_new, v_new, batch.slot_mapping)
    got = JITTED[impl](q, k_cache, v_cache, batch, scale=0.125)
    want = numpy_attention(q, k_cache, v_cache, batch, scale=0.125, dense_kv=dense)
    assert_close(got, want, batch, "float32")


def test_write_kv_updates_donated_caches_in_place():
    """With the caches donated (as the runner's step does), the scatter writes into the same
    buffers: the compiled program aliases them and the output keeps the input's address,
    so a step never copies the whole cache."""
    rng = np.random.default_rng(19)
    q, k_cache, v_cache, batch = make_case(rng, [(1, 33), (12, 20)], block_size=16,
                                           num_kv_heads=2, num_heads=4, head_dim=64,
                                           num_pages=4096)  # 32 MiB per cache
    T = q.shape[0]
    k_new = jnp.asarray(rng.standard_normal((T, 2, 64)), jnp.float32)
    write = jax.jit(write_kv, donate_argnums=(0, 1))
    compiled = write.lower(k_cache, v_cache, k_new, k_new, batch.slot_mapping).compile()
    assert "input_output_alias" in compiled.as_text()
    addresses = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    k_out, v_out = write(k_cache, v_cache, k_new, k_new, batch.slot_mapping)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == addresses
    assert k_cache.is_deleted() and v_cache.is_deleted()


def test_engine_steps_keep_the_cache_buffers(tiny_checkpoint):
    """The runner's step donates the caches, so every layer's K/V cache stays at its
    address through prefill and decode steps: no step copies a cache."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(str(tiny_checkpoint), dtype="float32", max_model_len=128, precompile=False)

    def addresses():
        return [a.unsafe_buffer_pointer() for pair in llm.engine.runner.kv_caches for a in pair]

    before = addresses()
    llm.generate(["a prompt of a few words", "another"],
                 SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert addresses() == before
