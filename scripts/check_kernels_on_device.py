"""Check the ragged paged attention kernels against the reference, then time them on the device.

    python scripts/check_kernels_on_device.py [--quick] [--max-seconds 240] [--json OUT]

One run says whether the Pallas kernels are right and how fast they are on the machine at
hand, and prints the versions it ran with (Pallas moves between JAX releases):

* correctness: every kernel the platform runs (GPU: the Triton-lowered kernel; TPU: the
  Mosaic one; CPU: both in interpret mode, small shapes) against kernels_pallas/ref.py on
  random ragged batches (decode-only, prefill-only, mixed, sliding window + soft cap, and
  pages beyond 4 GiB into the cache) in float32 and bfloat16. Error = max |kernel - ref| /
  max |ref| over the real tokens, against ref on the float32 upcast of the same inputs.
  jax's own GPU paged_attention is checked on a decode batch too, to prove the layout
  conversion its timing uses.
* timing (accelerators only): decode (batch 1-256 x context 512-32k, head dim 128, GQA 8:1,
  bf16) and mixed prefill + decode batches; achieved HBM bandwidth (K/V bytes read plus q
  and out) against the device's measured copy bandwidth, and the time of
  `jax.experimental.pallas.ops.gpu.paged_attention` on the decode shapes.
* quantized KV caches (kv_cache_dtype fp8 / int8): each kernel over one-byte caches with
  the engine's scales folded into q and out (kv_quant), against ref on the dequantized
  values (the bfloat16 tolerance), with the error against the unquantized cache reported;
  on a device, a decode batch (64 x 4096 context) timed with bf16, fp8 and int8 caches.
* KV-cache write: ref.write_kv jitted with donated caches, for caches of 1x, 4x and 16x the
  pages at a fixed T: a flat time, the output in the input's buffer, and aliased bytes in
  the compiled memory analysis mean in place; the undonated call is timed beside it to
  show what a copy of the cache costs.
* the torch backend's Triton kernels (kernels_triton/), after all of the above and only when
  torch and triton import: scripts/check_triton_kernels.py's checks and GPU timing, in this
  process (--triton-max-seconds budget; --skip-triton leaves them out). Their section is
  "triton" in the --json report; its "status" says "ran", "skipped: ..." or "error: ...".
  The report is written once before they start, so a crash there cannot lose the JAX part.

Exits non-zero if any kernel check fails (the Triton ones included).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import math
import pathlib
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends.jax import kv_quant
from jaxserve.backends.jax.batch import Batch
from jaxserve.kernels_pallas import ref

KERNELS = {"gpu": "jaxserve.kernels_pallas.gpu_ragged_paged_attention",
           "tpu": "jaxserve.kernels_pallas.ragged_paged_attention"}
TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max abs error / max abs reference output
OPTS = ("scale", "sliding_window", "soft_cap")
# (kind, dtype, S block size, K kv heads, N query heads, H head dim, sliding_window, soft_cap)
CPU_CHECKS = [("decode", "float32", 16, 1, 8, 128, None, None),
              ("prefill", "bfloat16", 16, 2, 4, 64, None, None),
              ("mixed", "float32", 32, 1, 8, 128, None, None),
              ("mixed", "bfloat16", 16, 2, 4, 64, 24, 5.0),
              ("far-decode", "bfloat16", 16, 1, 8, 128, None, None)]
DEVICE_CHECKS = [(kind, dtype, 16, 8, 64, 128, None, None)
                 for kind in ("decode", "prefill", "mixed")
                 for dtype in ("float32", "bfloat16")]
DEVICE_CHECKS += [("mixed", dtype, 32, 2, 16, 64, 700, 30.0) for dtype in ("float32", "bfloat16")]
DEVICE_CHECKS += [("far-decode", "bfloat16", 16, 8, 64, 128, None, None)]
# far-decode: a decode batch on pages past this many bytes into each cache, so 32-bit
# element offsets (2**32 bytes of bf16 and up) would go wrong; on the CPU only the plumbing
FAR_BYTES = {"cpu": 1 << 20, "device": (1 << 32) + (1 << 28)}
# caches of 1x, 4x, 16x base_pages (device: 256 MiB to 4 GiB each), T tokens written, (S, K, H)
WRITE_KV = {"cpu": dict(base_pages=64, num_tokens=32, dims=(16, 2, 64), dtype="float32"),
            "device": dict(base_pages=8192, num_tokens=256, dims=(16, 8, 128), dtype="bfloat16")}
BENCH = dict(block_size=16, kv_heads=8, q_heads=64, head_dim=128, dtype="bfloat16")
# Quantized KV caches (kv_cache_dtype): (kind, S, K, N, H) in bfloat16, each with fp8 and
# int8; device timing: a decode batch of QUANT_TIMING = (rows, context) with BENCH's dims.
QUANT_CHECKS = {"cpu": [("decode", 16, 2, 8, 64), ("mixed", 16, 1, 4, 128)],
                "device": [("decode", 16, 8, 64, 128), ("mixed", 16, 8, 64, 128)]}
QUANT_FORMATS = ("fp8", "int8")
QUANT_TIMING = (64, 4096)


# ----------------------------------------------------------------------------- setup


def versions() -> dict:
    info = {"python": platform.python_version(), "jax": jax.__version__}
    for dist in ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                 "jax-cuda13-pjrt", "jax-rocm60-plugin", "libtpu", "triton"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    device = jax.devices()[0]
    info.update(platform=device.platform, device_kind=device.device_kind,
                num_devices=jax.device_count())
    try:
        info["platform_version"] = device.client.platform_version
    except AttributeError:
        pass
    return info


def platform_kind() -> str:
    name = jax.devices()[0].platform
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def load_kernel(name: str, interpret: bool):
    """The kernel `name` as fn(q, k_cache, v_cache, batch, **opts); interpret mode on the CPU
    (each kernel picks its own interpreter: plain for GPU-style, DMA-simulating for TPU)."""
    fn = importlib.import_module(KERNELS[name]).ragged_paged_attention
    return functools.partial(fn, interpret=True) if interpret else fn


# ----------------------------------------------------------------------------- batches


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def make_batch(specs, *, block_size: int, num_tokens: int, num_rows: int, rng):
    """A ragged Batch from specs [(q_len, kv_len)] of the real rows, on shuffled pages.

    Rows beyond len(specs) and tokens beyond the real ones are padding (kv_len 0; slot 0 of
    the null page). Returns (batch, P = pages the cache needs, null page included)."""
    S = block_size
    counts = [-(-kv // S) for _, kv in specs]
    width = max(counts)  # B
    assert num_rows >= len(specs) and num_tokens >= sum(q for q, _ in specs)
    cu = np.zeros(num_rows + 1, np.int32)  # i32[R+1]
    cu[1:len(specs) + 1] = np.cumsum([q for q, _ in specs])
    cu[len(specs) + 1:] = cu[len(specs)]
    kv_lens = np.zeros(num_rows, np.int32)  # i32[R]
    kv_lens[:len(specs)] = [kv for _, kv in specs]
    tables = np.zeros((num_rows, width), np.int32)  # i32[R, B]
    positions = np.zeros(num_tokens, np.int32)  # i32[T]
    slots = np.zeros(num_tokens, np.int32)  # i32[T]
    pages = rng.permutation(np.arange(1, sum(counts) + 1, dtype=np.int32))
    used = 0
    for row, ((q_len, kv_len), count) in enumerate(zip(specs, counts)):
        tables[row, :count] = pages[used:used + count]
        used += count
        pos = np.arange(kv_len - q_len, kv_len)
        positions[cu[row]:cu[row + 1]] = pos
        slots[cu[row]:cu[row + 1]] = tables[row, pos // S] * S + pos % S
    batch = Batch(token_ids=jnp.zeros(num_tokens, jnp.int32), positions=jnp.asarray(positions),
                  slot_mapping=jnp.asarray(slots), cu_q_lens=jnp.asarray(cu),
                  kv_lens=jnp.asarray(kv_lens), block_tables=jnp.asarray(tables),
                  num_seqs=jnp.array([len(specs)], jnp.int32),
                  logits_indices=jnp.asarray(np.maximum(cu[1:] - 1, 0)))
    return batch, used + 1


def check_specs(kind: str, rng, S: int, long: bool):
    """[(q_len, kv_len)] for a decode-only, prefill-only or mixed batch; contexts end
    mid-page and start at 1 and S + 1. long: contexts up to ~2k, else a few pages."""
    hi, n = (2048, 12) if long else (5 * S, 3)
    decode = [(1, 1), (1, S + 1)] + [(1, int(c)) for c in rng.integers(2, hi, n)]
    fresh = [(int(q),) * 2 for q in rng.integers(2, hi // 4, max(1, n // 3))]
    chunks = [(int(q), int(q + c)) for q, c in zip(rng.integers(2, hi // 4, max(1, n // 3)),
                                                   rng.integers(1, hi, n))]
    if kind == "decode":
        return decode
    if kind == "prefill":
        return fresh + chunks
    rows = decode + fresh + chunks
    return [rows[i] for i in rng.permutation(len(rows))]


def random_case(kind, dtype, S, K, N, H, rng, long, far_bytes):
    """(q [T, N, H], k_cache, v_cache [P, S, K, H], batch); mixed batches come padded."""
    if kind == "far-decode":
        return far_case(random_case("decode", dtype, S, K, N, H, rng, long, 0), far_bytes, rng)
    specs = check_specs(kind, rng, S, long)
    real = sum(q for q, _ in specs)
    pad = kind == "mixed"
    batch, pages = make_batch(specs, block_size=S, rng=rng,
                              num_tokens=next_pow2(real + 1) if pad else real,
                              num_rows=next_pow2(len(specs) + 1) if pad else len(specs))
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch.slot_mapping.shape[0], N, H), dtype)
    k_cache = jax.random.normal(kk, (pages + 3, S, K, H), dtype)  # + unused pages
    v_cache = jax.random.normal(kv, (pages + 3, S, K, H), dtype)
    return q, k_cache, v_cache, batch


def far_case(case, far_bytes: int, rng):
    """The same batch moved to pages that start far_bytes into bigger caches."""
    q, k_cache, v_cache, batch = case
    S = k_cache.shape[1]
    offset = -(-far_bytes // k_cache[0].nbytes)  # pages
    shape = (offset + k_cache.shape[0],) + k_cache.shape[1:]
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 2)
    caches = [fill_cache(key, shape, k_cache.dtype) for key in keys]
    tables = jnp.where(batch.block_tables > 0, batch.block_tables + offset, 0)
    slots = jnp.where(batch.slot_mapping >= S, batch.slot_mapping + offset * S, 0)
    return q, *caches, dataclasses.replace(batch, block_tables=tables, slot_mapping=slots)


# ----------------------------------------------------------------------------- correctness


def relative_error(got, want, batch) -> float:
    """max |got - want| / max |want| over real tokens; inf if any output row is not finite."""
    real = int(batch.cu_q_lens[int(batch.num_seqs[0])])
    got = np.asarray(got.astype(jnp.float32), np.float64)
    want = np.asarray(want, np.float64)[:real]
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.abs(got[:real] - want).max() / np.abs(want).max())


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


def jax_paged_attention_on_cache(q, k_cache, v_cache, batch, **kw):
    return jax_paged_attention(q, to_head_major(k_cache), to_head_major(v_cache), batch, **kw)


def run_checks(kernels: dict, cases, *, long: bool, with_pa: bool, interpret: bool, far_bytes,
               rng):
    """Every kernel on every case against ref; returns a list of result dicts."""
    ref_fn = jax.jit(ref.ragged_paged_attention, static_argnames=OPTS)
    results = []
    for kind, dtype, S, K, N, H, window, cap in cases:
        case = random_case(kind, jnp.dtype(dtype), S, K, N, H, rng, long, far_bytes)
        opts = dict(scale=1.0 / math.sqrt(H), sliding_window=window, soft_cap=cap)
        with jax.default_matmul_precision("highest"):  # no TF32 in the reference on GPUs
            want = ref_fn(*(x.astype(jnp.float32) for x in case[:3]), case[3], **opts)
        runs = {name: jax.jit(functools.partial(fn, **opts)) for name, fn in kernels.items()}
        # jax's kernel takes no window and its float32 dots may run in TF32 on a GPU
        if with_pa and kind == "decode" and window is None and (interpret or dtype != "float32"):
            runs["jax-paged-attention"] = functools.partial(
                jax_paged_attention_on_cache, scale=opts["scale"], interpret=interpret,
                k_splits=2 if interpret else 16)
        for name, run in runs.items():
            result = dict(kernel=name, kind=kind, dtype=dtype, S=S, K=K, N=N, H=H,
                          T=case[0].shape[0], R=case[3].kv_lens.shape[0],
                          sliding_window=window, soft_cap=cap, tol=TOL[dtype],
                          informational=name == "jax-paged-attention")
            print(check_label(result), end=" ", flush=True)  # a crash shows what ran
            start = time.perf_counter()
            try:
                result["error"] = relative_error(run(*case), want, case[3])
                result["ok"] = result["error"] <= TOL[dtype]
            except Exception as exc:  # a failing kernel is a result, not the end of the run
                result.update(ok=False, exception=f"{type(exc).__name__}: {exc}"[:400])
            result["seconds"] = time.perf_counter() - start
            print(check_verdict(result), flush=True)
            results.append(result)
    return results


def check_label(r: dict) -> str:
    extra = ""
    if r["sliding_window"] is not None or r["soft_cap"] is not None:
        extra = f" window={r['sliding_window']} cap={r['soft_cap']}"
    shape = f"S={r['S']} K={r['K']} N={r['N']} H={r['H']} T={r['T']} R={r['R']}{extra}"
    return f"check {r['kernel']:20} {r['kind']:10} {r['dtype']:8} {shape:44}"


def check_verdict(r: dict) -> str:
    if "exception" in r:
        verdict = f"FAIL {r['exception']}"
    else:
        verdict = f"err {r['error']:.2e} (tol {r['tol']:.0e}) " + ("ok" if r["ok"] else "FAIL")
    if r["informational"] and not r["ok"]:
        verdict += " (informational: jax's kernel, not ours)"
    return f"{verdict} [{r['seconds']:.1f}s]"


# ----------------------------------------------------------------------------- quantized KV


def quantize_case(case, fmt: str, platform_name: str):
    """A case's caches quantized as the engine stores them (kv_quant, scales from each kv
    head's largest value in the cache itself): (kernel inputs q, k_q, v_q, batch; k_scale, v_scale; the dequantized
    float32 caches the kernel really reads; the value dtype)."""
    q, k_cache, v_cache, batch = case
    values = kv_quant.value_dtype(fmt, q.dtype)
    storage = ref.kv_storage_dtype(values, platform_name)
    flat = (-1,) + k_cache.shape[2:]
    scales, stored, dequant = [], [], []
    for cache in (k_cache, v_cache):
        amax = jnp.abs(cache.astype(jnp.float32)).max((0, 1, 3))
        scale = kv_quant.scales_from_amax(amax, fmt)
        quant = kv_quant.quantize(cache.reshape(flat), scale, values).reshape(cache.shape)
        dequant.append(quant.astype(jnp.float32) * scale[None, None, :, None])
        stored.append(quant if storage == values else jax.lax.bitcast_convert_type(quant,
                                                                                   storage))
        scales.append(scale)
    return (q, *stored, batch), scales, dequant, values


def quantized_attention(kernel, k_scale, v_scale, values, **opts):
    """The engine's attention over a quantized cache (kv_quant): scales folded into q and out."""
    def run(q, k_cache, v_cache, batch):
        out = kernel(kv_quant.scale_queries(q, k_scale), k_cache, v_cache, batch,
                     kv_dtype=values, **opts)
        return kv_quant.scale_output(out, v_scale)
    return jax.jit(run)


def run_quantized_checks(kernels: dict, cases, *, interpret: bool, rng, repeats: int,
                         deadline: float) -> list:
    """Each kernel over fp8 / int8 caches against ref on the dequantized float32 caches (the
    values it reads: the bf16 tolerance), and against ref on the unquantized cache (what
    quantization costs, reported); on a device, the decode time of each format beside bf16."""
    ref_fn = jax.jit(ref.ragged_paged_attention, static_argnames=OPTS)
    platform_name = "cpu" if interpret else platform_kind()
    results = []
    for kind, S, K, N, H in cases:
        case = random_case(kind, jnp.bfloat16, S, K, N, H, rng, not interpret, 0)
        opts = dict(scale=1.0 / math.sqrt(H))
        with jax.default_matmul_precision("highest"):
            plain = ref_fn(*(x.astype(jnp.float32) for x in case[:3]), case[3], **opts)
        for fmt in QUANT_FORMATS:
            inputs, (k_scale, v_scale), (kd, vd), values = quantize_case(case, fmt,
                                                                         platform_name)
            with jax.default_matmul_precision("highest"):
                want = ref_fn(case[0].astype(jnp.float32), kd, vd, case[3], **opts)
            for name, kernel in kernels.items():
                result = dict(kernel=name, kind=kind, dtype=f"bf16+{fmt}-kv", S=S, K=K, N=N,
                              H=H, T=case[0].shape[0], R=case[3].kv_lens.shape[0],
                              sliding_window=None, soft_cap=None, tol=TOL["bfloat16"],
                              informational=False)
                print(check_label(result), end=" ", flush=True)
                start = time.perf_counter()
                try:
                    got = quantized_attention(kernel, k_scale, v_scale, values, **opts)(
                        *inputs)
                    result["error"] = relative_error(got, want, case[3])
                    result["error_vs_unquantized"] = relative_error(got, plain, case[3])
                    result["ok"] = result["error"] <= TOL["bfloat16"]
                except Exception as exc:  # noqa: BLE001
                    result.update(ok=False, exception=f"{type(exc).__name__}: {exc}"[:400])
                result["seconds"] = time.perf_counter() - start
                verdict = check_verdict(result)
                if "error_vs_unquantized" in result:
                    verdict += f"; vs unquantized {result['error_vs_unquantized']:.2e}"
                print(verdict, flush=True)
                results.append(result)
    if interpret:
        return results
    rows, context = QUANT_TIMING
    dims = BENCH
    specs = [(1, context)] * rows
    for name, kernel in kernels.items():
        if time.monotonic() > deadline:
            print("quantized timing: skipped (time budget)")
            break
        batch, pages = make_batch(specs, block_size=dims["block_size"], num_tokens=rows,
                                  num_rows=rows, rng=rng)
        shape = (pages, dims["block_size"], dims["kv_heads"], dims["head_dim"])
        keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
        q = jax.random.normal(keys[0], (rows, dims["q_heads"], dims["head_dim"]),
                              jnp.bfloat16)
        case = (q, fill_cache(keys[1], shape, jnp.bfloat16),
                fill_cache(keys[2], shape, jnp.bfloat16), batch)
        opts = dict(scale=1.0 / math.sqrt(dims["head_dim"]))
        row = dict(kernel=name, kind="quantized-timing", rows=rows, context=context)
        row["bf16_s"] = time_call(jax.jit(functools.partial(kernel, **opts)), case, repeats)
        line = f"time {name:8} decode {rows} x ctx {context}: bf16 {1e3 * row['bf16_s']:.3f} ms"
        for fmt in QUANT_FORMATS:
            try:
                inputs, scales, _, values = quantize_case(case, fmt, platform_name)
                row[f"{fmt}_s"] = time_call(quantized_attention(kernel, *scales, values,
                                                                **opts), inputs, repeats)
                line += (f", {fmt} {1e3 * row[f'{fmt}_s']:.3f} ms "
                         f"({row['bf16_s'] / row[f'{fmt}_s']:.2f}x)")
            except Exception as exc:  # noqa: BLE001
                row[f"{fmt}_error"] = f"{type(exc).__name__}: {exc}"[:400]
                line += f", {fmt} FAILED {row[f'{fmt}_error']}"
        print(line, flush=True)
        results.append(row)
    return results


# ----------------------------------------------------------------------------- timing


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


def attention_work(specs, N, K, H, itemsize):
    """(bytes, flops) one step must move and compute: each row's K/V read once, q and out
    once; 4 N H flops per (query token, visible key)."""
    kv_tokens = sum(kv for _, kv in specs)
    q_tokens = sum(q for q, _ in specs)
    nbytes = (2 * kv_tokens * K * H + 2 * q_tokens * N * H) * itemsize
    visible = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in specs)
    return nbytes, 4 * N * H * visible


def time_case(name, specs, kernel, *, repeats, copy_bw, with_pa, rng):
    """Time one batch on the bench shapes; the cache is sized for this case and freed."""
    S, K, N, H = (BENCH[k] for k in ("block_size", "kv_heads", "q_heads", "head_dim"))
    dtype = jnp.dtype(BENCH["dtype"])
    pad = len(specs) != sum(q for q, _ in specs)  # mixed batches come padded to buckets
    real = sum(q for q, _ in specs)
    batch, pages = make_batch(specs, block_size=S, rng=rng,
                              num_tokens=next_pow2(real) if pad else real,
                              num_rows=next_pow2(len(specs)) if pad else len(specs))
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


def bench_cases(quick: bool, max_kv_gib: float):
    """{name: specs}: the decode grid (within max_kv_gib of K+V) and mixed batches."""
    S, K, H = BENCH["block_size"], BENCH["kv_heads"], BENCH["head_dim"]
    per_token = 2 * K * H * jnp.dtype(BENCH["dtype"]).itemsize
    batches = (1, 32, 256) if quick else (1, 8, 32, 128, 256)
    contexts = (512, 32768) if quick else (512, 4096, 32768)
    cases = {f"decode {b} x ctx {c}": [(1, c)] * b for b in batches for c in contexts
             if b * -(-c // S) * S * per_token <= max_kv_gib * 2**30}
    ragged = [(1, int(c)) for c in np.geomspace(512, 32768, 252)]
    cases["mixed 4 x chunk 512 @ 4k + 252 decodes 512..32k"] = [(512, 4096)] * 4 + ragged
    if not quick:
        cases["mixed 1 x 2048 fresh + 127 decodes @ 4k"] = [(2048, 2048)] + [(1, 4096)] * 127
        cases["prefill 8 x 2048 fresh"] = [(2048, 2048)] * 8
    return cases


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


# ----------------------------------------------------------------------------- Triton


def load_triton_checks():
    """scripts/check_triton_kernels.py as a module (it imports torch and triton)."""
    here = str(pathlib.Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("check_triton_kernels")


def run_triton_section(args) -> tuple[dict, list]:
    """(section, failures) of the torch backend's Triton kernels; never raises: torch or
    triton missing is a skip, anything going wrong inside is one failure."""
    if args.skip_triton:
        print("\ntriton kernels skipped: --skip-triton")
        return {"status": "skipped: --skip-triton"}, []
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        status = f"skipped: torch/triton not installed ({exc})"
        print(f"\ntriton kernels {status}")
        return {"status": status}, []
    try:
        section, failures = load_triton_checks().run(
            quick=args.quick, max_seconds=args.triton_max_seconds, repeats=args.repeats,
            max_kv_gib=args.max_kv_gib, copy_gib=args.copy_gib)
    except Exception as exc:
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"[:400]
        print(f"triton kernels FAILED: {error}", flush=True)
        return {"status": f"error: {error}"}, [f"triton kernels: {error}"]
    return {"status": "ran", **section}, list(failures)


def write_report(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


# ----------------------------------------------------------------------------- main


def load_kernels(names, interpret: bool, report: dict) -> dict:
    """{name: kernel} of those that import; a kernel that does not is a failed check."""
    kernels = {}
    for name in names:
        try:
            kernels[name] = load_kernel(name, interpret)
        except Exception as exc:
            print(f"check {name:20} FAIL cannot load {KERNELS[name]}: {exc}")
            report["checks"].append(dict(kernel=name, ok=False, informational=False,
                                         exception=f"load: {exc}"))
    return kernels


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing shapes")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--max-seconds", type=float, default=240,
                        help="skip the remaining timing cases after this many seconds")
    parser.add_argument("--max-kv-gib", type=float, default=40, help="skip bigger decode KV")
    parser.add_argument("--copy-gib", type=float, default=2, help="copy-bandwidth array size")
    parser.add_argument("--kernels", nargs="*", choices=list(KERNELS),
                        help="kernels to check (default: the platform's; CPU: all)")
    parser.add_argument("--json", metavar="OUT", help="write every result here")
    parser.add_argument("--triton-max-seconds", type=float,
                        help="budget of the Triton part (default 150, --quick 60)")
    parser.add_argument("--skip-triton", action="store_true",
                        help="leave out the torch backend's Triton kernels")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    deadline = time.monotonic() + args.max_seconds
    info = versions()
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    kind = platform_kind()
    interpret = kind not in ("gpu", "tpu")
    names = args.kernels or (list(KERNELS) if interpret else [kind])
    rng = np.random.default_rng(0)
    report = dict(versions=info, checks=[], attention=[], write_kv=[])
    kernels = load_kernels(names, interpret, report)
    with_pa = kind in ("gpu", "cpu")
    print(f"\ncorrectness vs ref ({'interpret mode' if interpret else 'compiled'})")
    report["checks"] += run_checks(kernels, CPU_CHECKS if interpret else DEVICE_CHECKS,
                                   long=not interpret, with_pa=with_pa, interpret=interpret,
                                   far_bytes=FAR_BYTES["cpu" if interpret else "device"],
                                   rng=rng)
    print("\nquantized KV caches (fp8, int8) vs ref on the values they hold")
    report["quantized"] = run_quantized_checks(
        kernels, QUANT_CHECKS["cpu" if interpret else "device"], interpret=interpret, rng=rng,
        repeats=args.repeats, deadline=deadline)
    report["write_kv"] = check_write_kv(**WRITE_KV["cpu" if interpret else "device"],
                                        repeats=args.repeats, rng=rng)
    if not interpret and kind in kernels:
        report["copy_bandwidth_gbs"], report["attention"] = run_timing(
            kernels[kind], quick=args.quick, repeats=args.repeats, max_kv_gib=args.max_kv_gib,
            copy_gib=args.copy_gib, with_pa=kind == "gpu", deadline=deadline, rng=rng)
    failed = [c for c in report["checks"] if not c["ok"] and not c["informational"]]
    failed += [w for w in report["write_kv"] if not w["ok"]]
    failed += [a for a in report["attention"] if "error" in a]
    failed += [q for q in report["quantized"] if q.get("ok") is False
               or any(k.endswith("_error") for k in q)]
    if args.json:  # the JAX part, in case the torch part takes the process down
        write_report(args.json, {**report, "triton": {"status": "running"}})
    report["triton"], triton_failed = run_triton_section(args)
    failed += triton_failed
    print(f"\n{'FAILED: ' + str(len(failed)) if failed else 'all checks passed'} "
          f"({time.monotonic() - deadline + args.max_seconds:.0f}s)")
    if args.json:
        write_report(args.json, report)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
