"""Tests for kernels_pallas.ref: ragged paged attention and write_kv against plain numpy.

The numpy oracle walks each sequence's block-table row position by position into a dense
[L, K, H] array and runs an ordinary softmax per query token in float64, so it shares no
code or tricks (online softmax, page groups, masks) with the reference it checks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.batch import Batch
from jaxserve.kernels_pallas import cpu_attention
from jaxserve.kernels_pallas.ref import KV_TOKENS_PER_STEP, ragged_paged_attention, write_kv

jax.config.update("jax_enable_x64", False)

TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max abs error / max abs expected output

# The reference and the XLA:CPU versions must all match the numpy oracle.
IMPLS = {"ref": ragged_paged_attention,
         "cpu": cpu_attention.ragged_paged_attention}
JITTED = {name: jax.jit(fn, static_argnames=("scale", "sliding_window", "soft_cap"))
          for name, fn in IMPLS.items()}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return request.param


# ----------------------------------------------------------------------------- batch builder


def make_case(rng, specs, *, block_size, num_kv_heads, num_heads, head_dim, dtype="float32",
              num_rows=None, num_tokens=None, max_model_len=256, num_pages=None,
              junk_tables=False):
    """A random ragged batch: specs is [(q_len, kv_len)] of the real sequences, in order.

    Each sequence gets distinct random pages (never the null page 0) from a pool bigger than
    needed; the whole cache, null page included, holds random values. Rows beyond len(specs)
    are padding (kv_len 0, q_len 0) and tokens beyond the last real one are padding too.
    With junk_tables, unused block-table entries point at random pages instead of page 0.
    """
    S = block_size
    num_seqs = len(specs)
    R = num_rows or num_seqs
    real_tokens = sum(q for q, _ in specs)
    T = num_tokens or real_tokens
    B = -(-max_model_len // S)
    assert R >= num_seqs and T >= real_tokens
    assert all(1 <= q <= kv <= max_model_len for q, kv in specs)
    needed = sum(-(-kv // S) for _, kv in specs)
    P = num_pages or needed + 8 + 1
    assert P - 1 >= needed

    ids = rng.permutation(np.arange(1, P)).astype(np.int32)  # distinct, never page 0
    tables = np.zeros((R, B), np.int32)
    if junk_tables:
        tables[:] = rng.integers(0, P, size=(R, B))
    cu = np.zeros(R + 1, np.int32)
    kv_lens = np.zeros(R, np.int32)
    used = 0
    for i, (q_len, kv_len) in enumerate(specs):
        n = -(-kv_len // S)
        tables[i, :n] = ids[used:used + n]
        used += n
        cu[i + 1] = cu[i] + q_len
        kv_lens[i] = kv_len
    cu[num_seqs + 1:] = cu[num_seqs]

    positions = np.zeros(T, np.int32)
    slots = np.zeros(T, np.int32)  # padding tokens write into slot 0 of the null page
    logits_indices = np.zeros(R, np.int32)
    for i, (q_len, kv_len) in enumerate(specs):
        for j in range(q_len):
            t = cu[i] + j
            p = kv_len - q_len + j
            positions[t] = p
            slots[t] = tables[i, p // S] * S + p % S
        logits_indices[i] = cu[i + 1] - 1

    jdt = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((T, num_heads, head_dim)), jdt)
    k_cache = jnp.asarray(rng.standard_normal((P, S, num_kv_heads, head_dim)), jdt)
    v_cache = jnp.asarray(rng.standard_normal((P, S, num_kv_heads, head_dim)), jdt)
    batch = Batch(
        token_ids=jnp.asarray(rng.integers(0, 1000, T), jnp.int32),
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(slots),
        cu_q_lens=jnp.asarray(cu),
        kv_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(tables),
        num_seqs=jnp.asarray([num_seqs], jnp.int32),
        logits_indices=jnp.asarray(logits_indices),
    )
    return q, k_cache, v_cache, batch


def f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


# ----------------------------------------------------------------------------- numpy oracle


def gather_dense(cache, table_row, kv_len, block_size):
    """[P, S, K, H] cache -> [L, K, H]: walk the block table one position at a time."""
    if kv_len == 0:
        return np.zeros((0,) + cache.shape[2:], cache.dtype)
    return np.stack([cache[table_row[p // block_size], p % block_size] for p in range(kv_len)])


def numpy_attention(q, k_cache, v_cache, batch, *, scale, sliding_window=None, soft_cap=None,
                    dense_kv=None):
    """float64 ragged paged attention; rows of padding tokens stay zero.

    dense_kv, if given, maps a sequence index to its own ([L, K, H], [L, K, H]) keys/values
    instead of gathering them from the caches.
    """
    q, k_cache, v_cache = f64(q), f64(k_cache), f64(v_cache)
    cu = np.asarray(batch.cu_q_lens)
    kv_lens = np.asarray(batch.kv_lens)
    tables = np.asarray(batch.block_tables)
    num_seqs = int(np.asarray(batch.num_seqs)[0])
    T, N, H = q.shape
    S, K = k_cache.shape[1], k_cache.shape[2]
    kv_head = np.arange(N) // (N // K)  # GQA: query head n reads kv head n // (N // K)
    out = np.zeros((T, N, H))
    for i in range(num_seqs):
        L = int(kv_lens[i])
        q_len = int(cu[i + 1] - cu[i])
        if dense_kv is None:
            keys = gather_dense(k_cache, tables[i], L, S)
            values = gather_dense(v_cache, tables[i], L, S)
        else:
            keys, values = (f64(a) for a in dense_kv[i])
        keys, values = keys[:, kv_head], values[:, kv_head]  # [L, N, H]
        for j in range(q_len):
            t = cu[i] + j
            pos = L - q_len + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            s = np.einsum("nh,lnh->nl", q[t], keys[lo:pos + 1]) * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[t] = np.einsum("nl,lnh->nh", w, values[lo:pos + 1])
    return out


def assert_close(got, want, batch, dtype):
    """Compare the real tokens' rows, error relative to the expected output's scale.

    Rows of padding tokens must be finite; the reference documents them as zeros.
    """
    real = int(np.asarray(batch.cu_q_lens)[int(np.asarray(batch.num_seqs)[0])])
    got, pad = f64(got)[:real], f64(got)[real:]
    want = want[:real]
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(pad))
    np.testing.assert_array_equal(pad, 0.0)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= TOL[str(jnp.dtype(dtype))], f"relative max error {err:.3g}"


def run_and_check(impl, q, k_cache, v_cache, batch, dtype, **kw):
    kw.setdefault("scale", 1.0 / math.sqrt(q.shape[-1]))
    got = JITTED[impl](q, k_cache, v_cache, batch, **kw)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = numpy_attention(q, k_cache, v_cache, batch, **kw)
    assert_close(got, want, batch, dtype)
    return got


# ----------------------------------------------------------------------------- spec makers


def mid(rng, lo, hi, S):
    """A random integer in [lo, hi) that is not a multiple of S (ends mid-block)."""
    while True:
        n = int(rng.integers(lo, hi))
        if n % S:
            return n


def decode_specs(rng, S, n=5):
    specs = [(1, 1), (1, S + 1)]  # first token; first token of a fresh block
    specs += [(1, mid(rng, 2, 3 * S, S)) for _ in range(n - 2)]
    return specs


def prefill_specs(rng, S):
    ctx = mid(rng, 1, 2 * S, S)  # the chunk starts mid-block ...
    chunk = mid(rng, 2, 2 * S, S)
    if (ctx + chunk) % S == 0:  # ... and ends mid-block
        chunk += 1
    return [(mid(rng, 2, 2 * S, S),) * 2, (chunk, ctx + chunk), (3, 3)]


def mixed_specs(rng, S):
    d = decode_specs(rng, S, n=3)
    p = prefill_specs(rng, S)
    return [d[0], p[1], d[2], p[0], d[1]]


SPECS = {"decode": decode_specs, "prefill": prefill_specs, "mixed": mixed_specs}

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


@pytest.mark.parametrize("block_size", [16, 32])
def test_long_sequences_span_several_loop_steps(block_size, impl):
    """Contexts > KV_TOKENS_PER_STEP, ending in the last (zero-padded) group of pages."""
    rng = np.random.default_rng(block_size)
    max_model_len = 400  # B = 25 or 13: not a multiple of pages_per_step (8 or 4)
    assert 389 > 3 * KV_TOKENS_PER_STEP
    specs = [(1, 389), (150, 389 - 2 * block_size), (1, 2), (130, 130 + 7)]
    case = make_case(rng, specs, block_size=block_size, num_kv_heads=2, num_heads=4,
                     head_dim=64, max_model_len=max_model_len, junk_tables=True)
    run_and_check(impl, *case, "float32")


@pytest.mark.parametrize("window", [1, 37, 200])
def test_sliding_window(window, impl):
    rng = np.random.default_rng(window)
    S = 16
    specs = [(1, 300), (70, 261), (1, 3), (20, 20), (1, 129)]
    case = make_case(rng, specs, block_size=S, num_kv_heads=2, num_heads=4, head_dim=64,
                     max_model_len=320)
    run_and_check(impl, *case, "float32", sliding_window=window)


@pytest.mark.parametrize("soft_cap,window,dtype", [(2.0, None, "float32"), (3.0, 48, "bfloat16")])
def test_soft_cap(soft_cap, window, dtype, impl):
    rng = np.random.default_rng(7)
    S = 32
    specs = [(1, 150), (40, 99), (1, 1), (5, 5)]
    case = make_case(rng, specs, block_size=S, num_kv_heads=1, num_heads=2, head_dim=64,
                     dtype=dtype, max_model_len=160)
    # Scaled scores ~ N(0, 16), far beyond the cap; scale != 1 tells scaled from raw scores.
    run_and_check(impl, *case, dtype, scale=0.5, soft_cap=soft_cap, sliding_window=window)


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
