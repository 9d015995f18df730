"""Random ragged attention cases and a float64 numpy oracle, shared by the attention tests.

The oracle walks each sequence's block-table row position by position into a dense
[L, K, H] array and runs an ordinary softmax per query token in float64, so it shares no
code or tricks (online softmax, page groups, masks, tiles) with the implementations it checks.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.benchmarks.ragged_batch import jax_batch, make_batch

TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max abs error / max abs expected output


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
    assert all(1 <= q <= kv <= max_model_len for q, kv in specs)
    needed = sum(-(-kv // block_size) for _, kv in specs)
    P = num_pages or needed + 8 + 1
    layout = make_batch(specs, block_size=block_size, rng=rng, num_tokens=num_tokens,
                        num_rows=num_rows, width=-(-max_model_len // block_size), pool=P - 1,
                        junk_tables=junk_tables)
    jdt = jnp.dtype(dtype)
    T = layout.slot_mapping.shape[0]
    q = jnp.asarray(rng.standard_normal((T, num_heads, head_dim)), jdt)
    k_cache = jnp.asarray(rng.standard_normal((P, block_size, num_kv_heads, head_dim)), jdt)
    v_cache = jnp.asarray(rng.standard_normal((P, block_size, num_kv_heads, head_dim)), jdt)
    batch = jax_batch(layout, token_ids=jnp.asarray(rng.integers(0, 1000, T), jnp.int32))
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
                    sinks=None, dense_kv=None):
    """float64 ragged paged attention; rows of padding tokens stay zero. sinks ([N]): one
    more logit per head in each softmax's denominator, with no value.

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
            top = s.max(-1, keepdims=True)
            if sinks is not None:
                top = np.maximum(top, f64(sinks)[:, None])
            w = np.exp(s - top)
            denom = w.sum(-1, keepdims=True)
            if sinks is not None:
                denom += np.exp(f64(sinks)[:, None] - top)
            w /= denom
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

# The kernels' test matrix (test_pallas_kernels.py, test_triton_kernels.py):
# (kind, block_size, gqa ratio, head_dim, dtype): every value of each axis, each kind with
# both dtypes, without the full product's compile time.
MATRIX = [
    ("decode", 16, 1, 64, "float32"),
    ("decode", 32, 8, 128, "bfloat16"),
    ("decode", 16, 4, 64, "float32"),
    ("prefill", 32, 2, 128, "float32"),
    ("prefill", 16, 1, 128, "bfloat16"),
    ("mixed", 16, 4, 128, "bfloat16"),
    ("mixed", 32, 8, 64, "float32"),
    ("mixed", 32, 2, 64, "bfloat16"),
]


# Attention sinks (GPT-OSS) on every kind of batch, one windowed: (kind, sliding_window,
# dtype), run by each implementation's tests in padded buckets; the kernels (interpret
# mode) run SLOW_SINK_CASES with -m slow only (the suite's time budget).
SINK_CASES = [("decode", None, "float32"), ("prefill", None, "bfloat16"),
              ("mixed", None, "float32"), ("mixed", 20, "bfloat16")]
SLOW_SINK_CASES = SINK_CASES[:3]  # by default the windowed mixed bucket, the richest


def kernel_sink_cases():
    """SINK_CASES as pytest params, SLOW_SINK_CASES marked slow."""
    import pytest

    return [pytest.param(*case, marks=pytest.mark.slow) if case in SLOW_SINK_CASES else case
            for case in SINK_CASES]


def random_sinks(rng, num_heads: int):
    """f32[N] sinks from -2 to 6: the small ones barely matter, the large ones outweigh most
    of a short context's keys (scores here are ~N(0, 1))."""
    return jnp.asarray(rng.uniform(-2.0, 6.0, num_heads), jnp.float32)


def padded_case(rng, kind, block_size, ratio, head_dim, dtype):
    """A padded (T, R) bucket: num_seqs < R, padding tokens with loud queries, junk block
    table entries; lengths start and end mid-block."""
    specs = SPECS[kind](rng, block_size)
    real = sum(q for q, _ in specs)
    q, k_cache, v_cache, batch = make_case(
        rng, specs, block_size=block_size, num_kv_heads=2, num_heads=2 * ratio,
        head_dim=head_dim, dtype=dtype, num_rows=len(specs) + 3, num_tokens=real + 5,
        junk_tables=True)
    return q.at[real:].mul(1e3), k_cache, v_cache, batch
