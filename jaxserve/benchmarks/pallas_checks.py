"""Correctness of the Pallas attention kernels against kernels_pallas/ref.py, for
scripts/check_kernels_on_device.py: random ragged batches (decode, prefill, mixed, sliding
window + soft cap, pages far into the cache) in float32 and bfloat16, jax's own GPU
paged_attention on a decode batch (the layout conversion its timing uses), and the kernels
over fp8 / int8 KV caches (kv_quant), timed beside bf16 on a device; the multi-head latent
attention (MLA) kernel against kernels_pallas/mla_ref.py, and on a device its decode time
and bandwidth beside the MHA kernel on the MHA-equivalent shape.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends.jax import kv_quant
from jaxserve.benchmarks.kernel_checks import (
    BENCH,
    MLA_TIMING,
    TOL,
    attention_work,
    check_label,
    check_specs,
    check_verdict,
    mla_work,
    next_pow2,
    random_sinks,
    relative_error,
)
from jaxserve.benchmarks.pallas_timing import (
    fill_cache,
    jax_paged_attention,
    time_call,
    to_head_major,
)
from jaxserve.benchmarks.ragged_batch import jax_batch, make_batch
from jaxserve.kernels_pallas import mla_ref, ref

OPTS = ("scale", "sliding_window", "soft_cap")
# (kind, dtype, S block size, K kv heads, N query heads, H head dim, sliding_window, soft_cap,
# attention sinks)
CPU_CHECKS = [("decode", "float32", 16, 1, 8, 128, None, None, False),
              ("prefill", "bfloat16", 16, 2, 4, 64, None, None, False),
              ("mixed", "float32", 32, 1, 8, 128, None, None, False),
              ("mixed", "bfloat16", 16, 2, 4, 64, 24, 5.0, True),
              ("far-decode", "bfloat16", 16, 1, 8, 128, None, None, False)]
# Quantized KV caches (kv_cache_dtype): (kind, S, K, N, H) in bfloat16, each with fp8 and
# int8; device timing: a decode batch of QUANT_TIMING = (rows, context) with BENCH's dims.
QUANT_CHECKS = {"cpu": [("decode", 16, 2, 8, 64), ("mixed", 16, 1, 4, 128)],
                "device": [("decode", 16, 8, 64, 128), ("mixed", 16, 8, 64, 128)]}
QUANT_FORMATS = ("fp8", "int8")
QUANT_TIMING = (64, 4096)


def platform_kind() -> str:
    name = jax.devices()[0].platform
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def check_layout(kind, S, rng, long):
    """The ragged batch layout of a check kind (check_specs); mixed batches padded to powers
    of two in tokens and rows."""
    specs = check_specs(kind, rng, S, long)
    real = sum(q for q, _ in specs)
    pad = kind == "mixed"
    return make_batch(specs, block_size=S, rng=rng,
                      num_tokens=next_pow2(real + 1) if pad else real,
                      num_rows=next_pow2(len(specs) + 1) if pad else len(specs))


def random_case(kind, dtype, S, K, N, H, rng, long, far_bytes):
    """(q [T, N, H], k_cache, v_cache [P, S, K, H], batch); mixed batches come padded."""
    if kind == "far-decode":
        return far_case(random_case("decode", dtype, S, K, N, H, rng, long, 0), far_bytes, rng)
    layout = check_layout(kind, S, rng, long)
    batch, pages = jax_batch(layout), layout.num_pages
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


def output_error(got, want, batch) -> float:
    """relative_error of a kernel's output against the reference's, over the batch's real
    tokens, in float64 on the host."""
    real = int(batch.cu_q_lens[int(batch.num_seqs[0])])
    return relative_error(np.asarray(got.astype(jnp.float32), np.float64),
                          np.asarray(want, np.float64), real)


def jax_paged_attention_on_cache(q, k_cache, v_cache, batch, **kw):
    return jax_paged_attention(q, to_head_major(k_cache), to_head_major(v_cache), batch, **kw)


def run_checks(kernels: dict, cases, *, long: bool, with_pa: bool, interpret: bool, far_bytes,
               rng):
    """Every kernel on every case against ref; returns a list of result dicts."""
    ref_fn = jax.jit(ref.ragged_paged_attention, static_argnames=OPTS)
    results = []
    for kind, dtype, S, K, N, H, window, cap, sinks in cases:
        case = random_case(kind, jnp.dtype(dtype), S, K, N, H, rng, long, far_bytes)
        opts = dict(scale=1.0 / math.sqrt(H), sliding_window=window, soft_cap=cap)
        if sinks:
            opts["sinks"] = jnp.asarray(random_sinks(rng, N))
        with jax.default_matmul_precision("highest"):  # no TF32 in the reference on GPUs
            want = ref_fn(*(x.astype(jnp.float32) for x in case[:3]), case[3], **opts)
        runs = {name: jax.jit(functools.partial(fn, **opts)) for name, fn in kernels.items()}
        # jax's kernel takes no window (nor sinks); its float32 dots may run in TF32 on a GPU
        if with_pa and kind == "decode" and window is None and not sinks and (
                interpret or dtype != "float32"):
            runs["jax-paged-attention"] = functools.partial(
                jax_paged_attention_on_cache, scale=opts["scale"], interpret=interpret,
                k_splits=2 if interpret else 16)
        for name, run in runs.items():
            result = dict(kernel=name, kind=kind, dtype=dtype, S=S, K=K, N=N, H=H,
                          T=case[0].shape[0], R=case[3].kv_lens.shape[0],
                          sliding_window=window, soft_cap=cap, sinks=sinks, tol=TOL[dtype],
                          informational=name == "jax-paged-attention")
            print(check_label(result), end=" ", flush=True)  # a crash shows what ran
            start = time.perf_counter()
            try:
                result["error"] = output_error(run(*case), want, case[3])
                result["ok"] = result["error"] <= TOL[dtype]
            except Exception as exc:  # a failing kernel is a result, not the end of the run
                result.update(ok=False, exception=f"{type(exc).__name__}: {exc}"[:400])
            result["seconds"] = time.perf_counter() - start
            print(check_verdict(result), flush=True)
            results.append(result)
    return results


def quantize_case(case, fmt: str, platform_name: str):
    """A case's caches quantized as the engine stores them (kv_quant, scales from each kv
    head's largest value in the cache itself): (kernel inputs q, k_q, v_q, batch; k_scale,
    v_scale; the dequantized float32 caches the kernel really reads; the value dtype)."""
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
                    result["error"] = output_error(got, want, case[3])
                    result["error_vs_unquantized"] = output_error(got, plain, case[3])
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
        layout = make_batch(specs, block_size=dims["block_size"], num_tokens=rows,
                            num_rows=rows, rng=rng)
        batch, pages = jax_batch(layout), layout.num_pages
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


# ----------------------------------------------------------------------------- MLA


def random_mla_case(kind, dtype, S, N, C, R, rng, long):
    """(q_latent [T, N, C], q_rope [T, N, R], cache [P, S, C + R], batch): random_case's
    batches (mixed ones padded) over a latent cache of random entries (drawn by numpy:
    nothing to compile per shape)."""
    layout = check_layout(kind, S, rng, long)
    T = layout.slot_mapping.shape[0]
    shapes = ((T, N, C), (T, N, R), (layout.num_pages + 3, S, C + R))  # + unused pages
    return (*(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes),
            jax_batch(layout))


def mla_result(name, kind, dtype, S, N, C, R, case) -> dict:
    """A check's result dict in run_checks' fields (K 1: the latent is one kv head shared by
    every head; H "C+R"; R the batch's rows, as there), latent C and rope R beside them."""
    return dict(kernel=name, kind=kind, dtype=dtype, S=S, K=1, N=N, H=f"{C}+{R}", latent=C,
                rope=R, T=case[0].shape[0], R=case[3].kv_lens.shape[0], sliding_window=None,
                soft_cap=None, tol=TOL[dtype], informational=False)


def run_mla_checks(kernels: dict, cases, *, long: bool, rng) -> list:
    """Each MLA kernel (fn(q_latent, q_rope, cache, batch, *, scale)) on every case
    (kernel_checks.MLA_CHECKS) against mla_ref on the float32 upcast of the same inputs."""
    ref_fn = jax.jit(mla_ref.ragged_paged_mla, static_argnames=("scale",))
    results = []
    for kind, dtype, S, N, C, R, *fmt in cases:
        case = random_mla_case(kind, jnp.dtype(dtype), S, N, C, R, rng, long)
        scale = 1.0 / math.sqrt(C + R)  # scores ~N(0, 1)
        run = functools.partial(kernel_call, scale=scale)
        if fmt:  # a one-byte cache: the kernel reads it, ref its dequantized values
            run = functools.partial(quantized_mla, scale=scale, fmt=fmt[0])
            case, dequantized = quantize_mla_case(case, fmt[0], long)
        with jax.default_matmul_precision("highest"):
            want = ref_fn(*(x.astype(jnp.float32) for x in case[:2]),
                          dequantized if fmt else case[2].astype(jnp.float32), case[3],
                          scale=scale)
        for name, kernel in kernels.items():
            result = mla_result(name, kind, dtype, S, N, C, R, case)
            if fmt:
                result["dtype"] = f"{'bf16' if dtype == 'bfloat16' else dtype}+{fmt[0]}-kv"
            print(check_label(result), end=" ", flush=True)  # a crash shows what ran
            start = time.perf_counter()
            try:
                got = run(kernel, *case)
                result["error"] = output_error(got, want, case[3])
                result["ok"] = result["error"] <= TOL[dtype]
            except Exception as exc:  # noqa: BLE001 (a failing kernel is a result)
                result.update(ok=False, exception=f"{type(exc).__name__}: {exc}"[:400])
            result["seconds"] = time.perf_counter() - start
            print(check_verdict(result), flush=True)
            results.append(result)
    return results


def kernel_call(kernel, *case, scale):
    return jax.jit(functools.partial(kernel, scale=scale))(*case)


def quantize_mla_case(case, fmt: str, on_device: bool):
    """An MLA case with its latent cache in fp8 / int8 as the engine stores it (attend_mla:
    a scale for the latent, one for the rope key; fp8's bits as uint8 on the CPU):
    ((q_latent, q_rope, stored cache, batch, c_scale, r_scale), dequantized f32 cache)."""
    q_latent, q_rope, cache, batch = case
    latent = q_latent.shape[-1]
    values = kv_quant.value_dtype(fmt, q_latent.dtype)
    parts, scales, dequant = [], [], []
    for part in (cache[..., :latent], cache[..., latent:]):
        s = kv_quant.scales_from_amax(jnp.abs(part.astype(jnp.float32)).max()[None], fmt)
        quant = kv_quant.quantize(part.reshape(-1, 1, part.shape[-1]), s, values)
        parts.append(quant.reshape(part.shape))
        dequant.append(quant.reshape(part.shape).astype(jnp.float32) * s)
        scales.append(s)
    stored = jnp.concatenate(parts, axis=-1)
    storage = ref.kv_storage_dtype(values, platform_kind() if on_device else "cpu")
    if storage != values:
        stored = jax.lax.bitcast_convert_type(stored, storage)
    return (q_latent, q_rope, stored, batch, *scales), jnp.concatenate(dequant, axis=-1)


def quantized_mla(kernel, q_latent, q_rope, cache, batch, c_scale, r_scale, *, scale, fmt):
    """The engine's latent attention over a one-byte cache: scales folded into the queries
    and the output (attend_mla.make_attend_latent)."""
    values = kv_quant.value_dtype(fmt, q_latent.dtype)

    def run(q_latent, q_rope, cache, batch):
        out = kernel(kv_quant.scale_queries(q_latent, c_scale),
                     kv_quant.scale_queries(q_rope, r_scale), cache, batch, scale=scale,
                     kv_dtype=values)
        return kv_quant.scale_output(out, c_scale)
    return jax.jit(run)(q_latent, q_rope, cache, batch)


def decode_batch(rows: int, context: int, S: int, rng):
    """A decode batch of `rows` sequences of `context` tokens on random pages: (batch,
    pages the cache needs)."""
    layout = make_batch([(1, context)] * rows, block_size=S, num_tokens=rows, num_rows=rows,
                        rng=rng)
    return jax_batch(layout), layout.num_pages


def time_mla_decode(kernel, rows: int, heads: int, *, dims, repeats: int, copy_bw, rng):
    """One MLA decode row: ms, GB/s of mla_work's bytes, % of the copy bandwidth (when
    known), TFLOP/s; the latent cache made for it and freed."""
    S, C, R, context = dims["block_size"], dims["latent"], dims["rope"], dims["context"]
    dtype = jnp.dtype(dims["dtype"])
    batch, pages = decode_batch(rows, context, S, rng)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    args = (jax.random.normal(keys[0], (rows, heads, C), dtype),
            jax.random.normal(keys[1], (rows, heads, R), dtype),
            fill_cache(keys[2], (pages, S, C + R), dtype), batch)
    nbytes, flops = mla_work([(1, context)] * rows, heads, C, R, dtype.itemsize)
    row = dict(kernel="mla", kind="mla-timing", rows=rows, context=context, N=heads,
               latent=C, rope=R, kv_gib=args[2].nbytes / 2**30)
    seconds = time_call(jax.jit(functools.partial(kernel, scale=1.0 / math.sqrt(C + R))),
                        args, repeats)
    row.update(ms=seconds * 1e3, gbs=nbytes / seconds / 1e9, tflops=flops / seconds / 1e12)
    if copy_bw:
        row["pct_copy"] = 100 * nbytes / seconds / copy_bw
    return row


def time_mha_equivalent(kernel, rows: int, heads: int, *, dims, repeats: int, rng) -> dict:
    """The MHA kernel (fn(q, k_cache, v_cache, batch, *, scale)) on the same decode batch
    with a key and a value per head (K = N heads of mha_head_dim): its ms, GB/s and the
    cache it reads."""
    S, H, context = dims["block_size"], dims["mha_head_dim"], dims["context"]
    dtype = jnp.dtype(dims["dtype"])
    batch, pages = decode_batch(rows, context, S, rng)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    shape = (pages, S, heads, H)
    args = (jax.random.normal(keys[0], (rows, heads, H), dtype),
            fill_cache(keys[1], shape, dtype), fill_cache(keys[2], shape, dtype), batch)
    nbytes, _ = attention_work([(1, context)] * rows, heads, heads, H, dtype.itemsize)
    seconds = time_call(jax.jit(functools.partial(kernel, scale=1.0 / math.sqrt(H))), args,
                        repeats)
    return dict(mha_ms=seconds * 1e3, mha_gbs=nbytes / seconds / 1e9,
                mha_kv_gib=2 * args[1].nbytes / 2**30)


def print_mla_row(row: dict) -> None:
    if "error" in row:
        print(f"FAIL {row['error']}", flush=True)
        return
    line = (f"{row['ms']:9.3f} ms {row['gbs']:7.0f} GB/s "
            + (f"{row['pct_copy']:5.1f}% copy " if "pct_copy" in row else "")
            + f"{row['tflops']:6.1f} TFLOP/s, latent cache {row['kv_gib']:.2f} GiB")
    if "mha_ms" in row:
        line += (f"; MHA-equivalent {row['mha_ms']:.3f} ms {row['mha_gbs']:.0f} GB/s over "
                 f"{row['mha_kv_gib']:.2f} GiB ({row['mha_ms'] / row['ms']:.2f}x the MLA time)")
    elif "mha_error" in row:
        line += f"; MHA-equivalent FAILED {row['mha_error']}"
    print(line, flush=True)


def run_mla_timing(kernel, mha_kernel, *, repeats: int, copy_bw, deadline: float, rng,
                   dims=MLA_TIMING) -> list:
    """MLA decode timing rows (dims: kernel_checks.MLA_TIMING's fields); mha_kernel (or
    None) timed on the MHA-equivalent shape beside the rows of the fewest heads. A case that
    fails is a row with "error"; past the deadline the rest are skipped."""
    print(f"\nMLA decode, S={dims['block_size']} C={dims['latent']} R={dims['rope']} "
          f"{dims['dtype']}, context {dims['context']}; GB/s = (latent read + q/out) / time")
    rows = []
    for heads in dims["heads"]:
        for count in dims["rows"]:
            name = f"mla decode {count} x ctx {dims['context']} N={heads}"
            if time.monotonic() > deadline:
                print(f"{name:40} skipped: time budget")
                continue
            print(f"{name:40}", end=" ", flush=True)
            try:
                row = time_mla_decode(kernel, count, heads, dims=dims, repeats=repeats,
                                      copy_bw=copy_bw, rng=rng)
            except Exception as exc:  # noqa: BLE001
                row = dict(kernel="mla", kind="mla-timing", rows=count, N=heads,
                           error=f"{type(exc).__name__}: {exc}"[:300])
            if mha_kernel is not None and heads == min(dims["heads"]) and "error" not in row:
                try:
                    row.update(time_mha_equivalent(mha_kernel, count, heads, dims=dims,
                                                   repeats=repeats, rng=rng))
                except Exception as exc:  # noqa: BLE001 (informational)
                    row["mha_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print_mla_row(row)
            rows.append(row)
    return rows

