"""Timing of the Pallas attention kernels on an accelerator, for
scripts/check_kernels_on_device.py: the decode and mixed grid's achieved bandwidth against
the device's copy bandwidth (beside jax's own GPU paged_attention), and the in-place
KV-cache write (ref.write_kv with donated caches) against a copying one.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.benchmarks.kernel_checks import BENCH, attention_work, bench_cases, next_pow2
from jaxserve.benchmarks.ragged_batch import jax_batch, make_batch
from jaxserve.kernels_pallas import ref

# caches of 1x, 4x, 16x base_pages (device: 256 MiB to 4 GiB each), T tokens written, (S, K, H)
WRITE_KV = {"cpu": dict(base_pages=64, num_tokens=32, dims=(16, 2, 64), dtype="float32"),
            "device": dict(base_pages=8192, num_tokens=256, dims=(16, 8, 128), dtype="bfloat16")}

def time_call(fn, args, repeats: int) -> float:
    """Median seconds per call after a warm-up; calls are looped to hide dispatch cost."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = max(1, min(50, int(0.01 / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return float(np.median(times))


@functools.partial(jax.jit, static_argnums=(1, 2))
def fill_cache(key, shape, dtype):
    """A random [P, S, K, H] cache made of one repeated block of <= 1024 random pages, so a
    cache of tens of GiB costs no more memory than itself to make."""
    base = jax.random.normal(key, (min(shape[0], 1024),) + shape[1:], dtype)
    reps = -(-shape[0] // base.shape[0])
    tiled = jnp.broadcast_to(base, (reps,) + base.shape)
    return tiled.reshape((reps * base.shape[0],) + shape[1:])[:shape[0]]


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of x + 1 on a bf16 array of nbytes: every byte read once and written once."""
    x = jnp.ones(nbytes // 2, jnp.bfloat16)
    seconds = time_call(jax.jit(lambda a: a + 1), (x,), repeats)
    del x
    return 2 * nbytes / seconds


def jax_paged_attention(q, k_pages, v_pages, batch, *, scale, interpret=False, k_splits=16):
    """jax.experimental.pallas.ops.gpu.paged_attention on a decode-only batch (T == R).

    k_pages, v_pages: [K, P, S, H] (our cache transposed once, outside any timing). jax's
    kernel applies no scale, so q is scaled here; block tables are padded with the null page
    to the multiples its k_splits / pages_per_compute_block (8) split needs."""
    from jax.experimental.pallas.ops.gpu import paged_attention as pa
    tables = batch.block_tables  # i32[R, B]
    width = tables.shape[1]
    k_splits = min(k_splits, next_pow2(width))
    padded = -(-width // k_splits) * k_splits
    if padded // k_splits > 8:
        padded = -(-width // (k_splits * 8)) * k_splits * 8
    tables = jnp.pad(tables, ((0, 0), (0, padded - width)))
    return pa.paged_attention((q * scale).astype(q.dtype), k_pages, v_pages, tables,
                              batch.kv_lens, k_splits=k_splits, interpret=interpret)


def to_head_major(cache):
    return jnp.transpose(cache, (2, 0, 1, 3))  # [P, S, K, H] -> [K, P, S, H]


def time_case(name, specs, kernel, *, repeats, copy_bw, with_pa, rng):
    """Time one batch on the bench shapes; the cache is sized for this case and freed."""
    S, K, N, H = (BENCH[k] for k in ("block_size", "kv_heads", "q_heads", "head_dim"))
    dtype = jnp.dtype(BENCH["dtype"])
    pad = len(specs) != sum(q for q, _ in specs)  # mixed batches come padded to buckets
    real = sum(q for q, _ in specs)
    layout = make_batch(specs, block_size=S, rng=rng,
                        num_tokens=next_pow2(real) if pad else real,
                        num_rows=next_pow2(len(specs)) if pad else len(specs))
    batch, pages = jax_batch(layout), layout.num_pages
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    k_cache = fill_cache(keys[0], (pages, S, K, H), dtype)
    v_cache = fill_cache(keys[1], (pages, S, K, H), dtype)
    q = jax.random.normal(keys[2], (batch.slot_mapping.shape[0], N, H), dtype)
    scale = 1.0 / math.sqrt(H)
    nbytes, flops = attention_work(specs, N, K, H, dtype.itemsize)
    row = dict(case=name, T=q.shape[0], R=batch.kv_lens.shape[0], kv_gib=2 * k_cache.nbytes / 2**30)
    fn = jax.jit(functools.partial(kernel, scale=scale))
    try:
        seconds = time_call(fn, (q, k_cache, v_cache, batch), repeats)
        row.update(ms=seconds * 1e3, gbs=nbytes / seconds / 1e9,
                   pct_copy=100 * nbytes / seconds / copy_bw, tflops=flops / seconds / 1e12)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    if with_pa:
        k_cache = to_head_major(k_cache)  # one at a time: peak memory 1.5 caches, not 2
        v_cache = to_head_major(v_cache)
        fn = jax.jit(functools.partial(jax_paged_attention, scale=scale))
        try:
            row["pa_ms"] = time_call(fn, (q, k_cache, v_cache, batch), repeats) * 1e3
        except Exception as exc:
            row["pa"] = f"n/a: {type(exc).__name__}: {exc}"[:200]
    del k_cache, v_cache, q
    return row


def print_row(row: dict) -> None:
    if "error" in row:
        timing = f"FAIL {row['error']}"
    else:
        timing = (f"{row['ms']:9.3f} {row['gbs']:8.0f} {row['pct_copy']:6.1f}% "
                  f"{row['tflops']:7.1f}")
    pa = row.get("pa", "")
    if "pa_ms" in row:
        pa = f"{row['pa_ms']:9.3f}" + (f" ({row['pa_ms'] / row['ms']:.2f}x)" if "ms" in row else "")
    print(f"{row['T']:6} {row['R']:4} {row['kv_gib']:6.2f} {timing} {pa}", flush=True)


def run_timing(kernel, *, quick, repeats, max_kv_gib, copy_gib, with_pa, deadline, rng):
    copy_bw = copy_bandwidth(int(copy_gib * 2**30), repeats)
    print(f"\ndevice copy bandwidth (x + 1, {copy_gib:g} GiB bf16, read + write): "
          f"{copy_bw / 1e9:.0f} GB/s")
    print(f"attention, S={BENCH['block_size']} K={BENCH['kv_heads']} N={BENCH['q_heads']} "
          f"H={BENCH['head_dim']} {BENCH['dtype']}; GB/s = (K/V read + q/out) / time")
    print(f"{'case':46} {'T':>6} {'R':>4} {'KV GiB':>6} {'ms':>9} {'GB/s':>8} {'%copy':>7} "
          f"{'TFLOP/s':>7} {'jax PA ms (PA/ours)' if with_pa else ''}")
    rows = []
    for name, specs in bench_cases(quick, max_kv_gib).items():
        if time.monotonic() > deadline:
            print(f"{name:46} skipped: --max-seconds reached")
            continue
        print(f"{name:46}", end=" ", flush=True)  # a crash shows what ran
        rows.append(time_case(name, specs, kernel, repeats=repeats, copy_bw=copy_bw,
                              with_pa=with_pa and name.startswith("decode"), rng=rng))
        print_row(rows[-1])
    return copy_bw, rows


# ----------------------------------------------------------------------------- KV write


def time_donated(fn, caches, rest, repeats: int):
    """Median seconds per call of caches = fn(*caches, *rest), each call donating the last."""
    caches = jax.block_until_ready(fn(*caches, *rest))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            caches = fn(*caches, *rest)
        jax.block_until_ready(caches)
        times.append((time.perf_counter() - start) / 10)
    return float(np.median(times)), caches


def check_write_kv(*, base_pages: int, num_tokens: int, dims, dtype, repeats: int, rng):
    """write_kv on caches of 1x, 4x, 16x base_pages at fixed T: correct, in place, flat time."""
    S, K, H = dims
    donated = jax.jit(ref.write_kv, donate_argnums=(0, 1))
    copying = jax.jit(ref.write_kv)
    print(f"\nKV-cache write (ref.write_kv, XLA scatter), T={num_tokens} S={S} K={K} H={H} "
          f"{dtype}")
    print(f"{'pages':>8} {'cache MiB':>10} {'donated ms':>11} {'copy ms':>9} "
          f"{'same buffer':>11} {'aliased MiB':>11}  check")
    rows = []
    for mult in (1, 4, 16):
        pages = base_pages * mult
        keys = jax.random.split(jax.random.key(mult), 4)
        caches = [fill_cache(k, (pages, S, K, H), jnp.dtype(dtype)) for k in keys[:2]]
        new = [jax.random.normal(k, (num_tokens, K, H), dtype) for k in keys[2:]]
        slots = jnp.asarray(rng.choice(np.arange(S, pages * S), num_tokens, replace=False),
                            jnp.int32)  # distinct, never the null page
        copy_ms = time_call(copying, (*caches, *new, slots), repeats) * 1e3
        compiled = donated.lower(*caches, *new, slots).compile()
        stats = compiled.memory_analysis()
        aliased = getattr(stats, "alias_size_in_bytes", -1) if stats is not None else -1
        pointer = caches[0].unsafe_buffer_pointer()
        out = compiled(*caches, *new, slots)
        same = out[0].unsafe_buffer_pointer() == pointer and caches[0].is_deleted()
        written = all(bool(jnp.array_equal(c.reshape(-1, K, H)[slots], n))
                      for c, n in zip(out, new))
        seconds, out = time_donated(compiled, out, (*new, slots), repeats)
        nbytes = 2 * pages * S * K * H * jnp.dtype(dtype).itemsize
        row = dict(pages=pages, cache_mib=nbytes / 2**20, donated_ms=seconds * 1e3,
                   copy_ms=copy_ms, same_buffer=same, aliased_mib=aliased / 2**20,
                   ok=written and same and aliased >= nbytes)
        print(f"{pages:8} {row['cache_mib']:10.1f} {row['donated_ms']:11.4f} {copy_ms:9.4f} "
              f"{'yes' if same else 'NO':>11} {row['aliased_mib']:11.1f}  "
              f"{'ok' if row['ok'] else 'FAIL'}" + ("" if written else " (wrong values)"),
              flush=True)
        rows.append(row)
        del caches, out
    return rows


