"""Timing of the torch backend's Triton attention kernel on a GPU, for
scripts/check_triton_kernels.py: CUDA events around eager calls and CUDA-graph replays (as
the torch backend runs it) on kernel_checks.bench_cases' grid, the achieved bandwidth
against the device's copy bandwidth, and torch's scaled_dot_product_attention on the dense
equivalent of the uniform batches (timed, and its output compared with the kernel's).
HostTimer runs the same path on CPU tensors (the tests).
"""

from __future__ import annotations

import functools
import math
import time

import numpy as np
import torch

from jaxserve.benchmarks.kernel_checks import (
    BENCH,
    attention_work,
    bench_cases,
    next_pow2,
    relative_error,
)
from jaxserve.benchmarks.triton_checks import generator, torch_batch

SDPA_TOL = 2e-2  # bf16 kernel vs bf16 SDPA on the same inputs
MEMORY_MARGIN = 1 << 30  # bytes kept free beyond what a timing case needs


class CudaTimer:
    """Median seconds per call of fn() on the GPU: CUDA events around rounds of calls."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats

    def eager(self, fn) -> float:
        fn()  # warm-up: compiles, autotunes, allocates
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        once = start.elapsed_time(end) / 1e3
        inner = max(1, min(50, int(0.01 / max(once, 1e-6))))  # ~10 ms rounds
        times = []
        for _ in range(self.repeats):
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        return float(np.median(times))

    def graphed(self, fn) -> float:
        """fn captured once in a CUDA graph (after warm-up on a side stream), replays timed."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        try:
            return self.eager(graph.replay)
        finally:
            del graph


class HostTimer:
    """The timing path on the CPU (tests): wall-clock medians, no CUDA graphs."""

    def __init__(self, repeats: int = 1) -> None:
        self.repeats = repeats

    def eager(self, fn) -> float:
        fn()
        times = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    def graphed(self, fn):
        return None


def time_both(timer, fn) -> dict:
    """{eager_ms, graph_ms or graph_error, ms}: ms is the graph time when the capture works."""
    row = {"eager_ms": timer.eager(fn) * 1e3}
    try:
        seconds = timer.graphed(fn)
        if seconds is not None:
            row["graph_ms"] = seconds * 1e3
    except Exception as exc:  # a capture that fails leaves the eager number
        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
    row["ms"] = row.get("graph_ms", row["eager_ms"])
    return row


def copy_bandwidth(nbytes: int, timer, device) -> float:
    """Bytes/s of y = x + 1 on bf16 arrays of nbytes: every byte read once and written once."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / timer.eager(lambda: torch.add(x, 1, out=y))


def dense_shape(specs):
    """(R, Lq, L, causal) when every row has the same (q_len, kv_len) and SDPA on dense
    tensors computes the same thing: decode (q_len 1, not causal) or fresh prefill
    (q_len == kv_len, causal); else None."""
    if len(set(specs)) != 1:
        return None
    q_len, kv_len = specs[0]
    if q_len == 1:
        return len(specs), 1, kv_len, False
    if q_len == kv_len:
        return len(specs), q_len, kv_len, True
    return None


def row_values(gen, specs, K, H, dtype, device):
    """Each row's keys (then values) [kv_len, K, H], drawn in one fixed order: the dense and
    the paged layouts of a case get the same numbers from the same seed."""
    for _ in range(2):
        for _, kv_len in specs:
            yield torch.randn((kv_len, K, H), generator=gen, device=device, dtype=dtype)


def dense_kv(seed, specs, K, H, dtype, device):
    """K and V [R, K, L, H], contiguous."""
    R, L = len(specs), specs[0][1]
    dense = [torch.empty((R, K, L, H), dtype=dtype, device=device) for _ in range(2)]
    values = row_values(generator(device, seed), specs, K, H, dtype, device)
    for which in range(2):
        for row in range(R):
            dense[which][row] = next(values).transpose(0, 1)
    return dense


def paged_kv(seed, batch, pages, S, K, H, dtype, device):
    """K and V caches [P, S, K, H] holding each row's keys and values on its pages (the null
    page zero)."""
    caches = [torch.zeros((pages, S, K, H), dtype=dtype, device=device) for _ in range(2)]
    values = row_values(generator(device, seed), batch.specs, K, H, dtype, device)
    tables = batch.block_tables.long()
    for which in range(2):
        for row, (_, kv_len) in enumerate(batch.specs):
            count = -(-kv_len // S)
            rows = next(values)
            padded = torch.zeros((count * S, K, H), dtype=dtype, device=device)
            padded[:kv_len] = rows
            caches[which][tables[row, :count]] = padded.view(count, S, K, H)
    return caches


def sdpa(q, k, v, *, scale, causal, fused_only=None):
    """fn() -> torch's fused attention on dense [R, N, Lq, H] / [R, K, L, H]. fused_only
    (default: on a GPU): never the math backend, which would repeat K/V for GQA and
    materialise the scores (an error instead of running out of memory)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    call = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v,
                             is_causal=causal, scale=scale, enable_gqa=True)
    if not (q.device.type == "cuda" if fused_only is None else fused_only):
        return call
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION]

    def run():
        with sdpa_kernel(fused):
            return call()

    return run


def free_bytes(device) -> int | None:
    """Bytes a new allocation can get on the GPU (torch's cached blocks included); None on
    the host."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def block_sizes_label(T, R, K, N, H) -> str | None:
    try:
        from jaxserve.kernels_triton import attention

        sizes = attention.default_block_sizes(T, R, num_kv_heads=K, group=N // K, head_dim=H)
        return f"Q{sizes.q_tokens} L{sizes.tile_keys} X{sizes.kv_splits}"
    except Exception:  # informational only
        return None


def time_case(name, specs, kernel, *, timer, device, dims, copy_bw, rng, with_sdpa=True):
    """Time one batch; dims (S, K, N, H, dtype). With SDPA: the dense K/V first (timed, then
    freed), then the paged cache of the same numbers, so the case holds its K/V once."""
    S, K, N, H, dtype_name = dims
    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    real = sum(q for q, _ in specs)
    pad = len(specs) != real  # mixed batches come padded to buckets
    batch, pages = torch_batch(specs, block_size=S, rng=rng, device=device,
                               num_tokens=next_pow2(real) if pad else real,
                               num_rows=next_pow2(len(specs)) if pad else len(specs))
    T, R = batch.slot_mapping.shape[0], batch.kv_lens.shape[0]
    kv_bytes = 2 * pages * S * K * H * itemsize
    row = dict(case=name, T=T, R=R, kv_gib=kv_bytes / 2**30,
               blocks=block_sizes_label(T, R, K, N, H))
    free = free_bytes(device)
    need = kv_bytes + 8 * T * N * H * 4 + MEMORY_MARGIN  # + q, out, f32 split partials
    if free is not None and need > free:
        row["skipped"] = (f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on the "
                          "GPU (run scripts/check_triton_kernels.py alone for the full grid)")
        return row
    seed = int(rng.integers(1 << 30))
    gen = generator(device, rng.integers(1 << 30))
    q = torch.randn((T, N, H), generator=gen, device=device, dtype=dtype)
    scale = 1.0 / math.sqrt(H)
    nbytes, flops = attention_work(specs, N, K, H, itemsize)
    dense = dense_shape(specs) if with_sdpa else None
    sdpa_out = fn = None
    if dense is not None:
        rows, q_len, _, causal = dense
        q_dense = q[:real].view(rows, q_len, N, H).transpose(1, 2).contiguous()  # [R,N,Lq,H]
        k_dense, v_dense = dense_kv(seed, specs, K, H, dtype, device)
        try:
            fn = sdpa(q_dense, k_dense, v_dense, scale=scale, causal=causal)
            timed = time_both(timer, fn)
            row.update({f"sdpa_{key}": value for key, value in timed.items()})
            sdpa_out = fn().transpose(1, 2).reshape(real, N, H)
        except Exception as exc:  # the baseline is informational
            row["sdpa_error"] = f"{type(exc).__name__}: {exc}"[:300]
        del k_dense, v_dense, q_dense, fn  # fn holds the dense K/V too: free them first
    k_cache, v_cache = paged_kv(seed, batch, pages, S, K, H, dtype, device)
    try:
        fn = functools.partial(kernel, q, k_cache, v_cache, batch, scale=scale)
        row.update(time_both(timer, fn))
        seconds = row["ms"] / 1e3
        row.update(gbs=nbytes / seconds / 1e9, tflops=flops / seconds / 1e12)
        if copy_bw:
            row["pct_copy"] = 100 * nbytes / seconds / copy_bw
        if sdpa_out is not None:
            row["sdpa_err"] = relative_error(fn().double(), sdpa_out.double(), real)
            row["sdpa_ok"] = row["sdpa_err"] <= SDPA_TOL
            row["sdpa_over_triton"] = row["sdpa_ms"] / row["ms"]  # > 1: the kernel is faster
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    del k_cache, v_cache, q, sdpa_out
    return row


def print_row(row: dict, log=print) -> None:
    if "skipped" in row:
        log(f"skipped: {row['skipped']}", flush=True)
        return
    if "error" in row:
        timing = f"FAIL {row['error']}"
    else:
        timing = (f"{row['ms']:9.3f} {row['eager_ms']:9.3f} {row['gbs']:8.0f} "
                  f"{row.get('pct_copy', math.nan):6.1f}% {row['tflops']:7.1f}")
    sdpa_part = row.get("sdpa_error", "")
    if "sdpa_ms" in row:
        sdpa_part = f"{row['sdpa_ms']:9.3f}"
        if "sdpa_over_triton" in row:
            sdpa_part += (f" ({row['sdpa_over_triton']:.2f}x, err {row['sdpa_err']:.1e}"
                          + ("" if row["sdpa_ok"] else " MISMATCH") + ")")
    log(f"{row['T']:6} {row['R']:4} {row['kv_gib']:6.2f} {row['blocks'] or '':12} {timing} "
        f"{sdpa_part}", flush=True)


def run_timing(kernel, *, quick, timer, device, max_kv_gib, copy_gib, deadline, rng,
               dims=None, cases=None, log=print):
    """The timing grid on the device: a dict with the copy bandwidth and one row per case."""
    dims = dims or tuple(BENCH[k] for k in ("block_size", "kv_heads", "q_heads", "head_dim",
                                            "dtype"))
    S, K, N, H, dtype = dims
    copy_bw = copy_bandwidth(int(copy_gib * 2**30), timer, device)
    log(f"\ntorch copy bandwidth (y = x + 1, {copy_gib:g} GiB bf16, read + write): "
        f"{copy_bw / 1e9:.0f} GB/s")
    log(f"triton attention, S={S} K={K} N={N} H={H} {dtype}; GB/s = (K/V read + q/out) / "
        "time; ms: CUDA-graph replay (eager: Python launches); SDPA: dense, same K/V")
    log(f"{'case':46} {'T':>6} {'R':>4} {'KV GiB':>6} {'blocks':12} {'ms':>9} {'eager ms':>9} "
        f"{'GB/s':>8} {'%copy':>7} {'TFLOP/s':>7} SDPA ms (SDPA/triton)")
    rows = []
    cases = cases if cases is not None else bench_cases(quick, max_kv_gib, (S, K, H, dtype))
    for name, specs in cases.items():
        if time.monotonic() > deadline and rows:  # the first case runs whatever the budget
            rows.append(dict(case=name, skipped="--max-seconds reached"))
            log(f"{name:46} skipped: --max-seconds reached")
            continue
        log(f"{name:46}", end=" ", flush=True)  # a crash shows what ran
        rows.append(time_case(name, specs, kernel, timer=timer, device=device, dims=dims,
                              copy_bw=copy_bw, rng=rng))
        print_row(rows[-1], log)
    return {"copy_bandwidth_gbs": copy_bw / 1e9, "dims": dict(zip(
        ("block_size", "kv_heads", "q_heads", "head_dim", "dtype"), dims)), "rows": rows}


