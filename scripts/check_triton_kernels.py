"""Check the Triton attention kernels against the PyTorch reference, then time them on the GPU.

    python scripts/check_triton_kernels.py [--quick] [--max-seconds 150] [--json OUT]

scripts/check_kernels_on_device.py runs this after its JAX checks (run() below, in the same
process) and folds its report and failures into its own. Nothing here imports JAX.

* correctness: kernels_triton/attention.py (compiled on a GPU; Triton's interpreter and small
  shapes on the CPU) against kernels_triton/ref.py on random ragged batches (decode-only,
  prefill-only, mixed, sliding window + soft cap, and pages beyond 4 GiB into the caches) in
  float32 and bfloat16. Error = max |kernel - ref| / max |ref| over the real tokens, with ref
  run on the float32 upcast of the same inputs and TF32 off (torch's matmul and cuDNN flags).
  The kernel's float32 dots use input_precision="ieee" (attention.py), hence the float32
  tolerance of 1e-5; its 16-bit dots use TF32, exact for bf16 operands. Rows of padding tokens
  must be exactly 0, and every page no real sequence owns holds NaN. kv_write.write_kv against
  ref.write_kv: in place, the written slots equal (a float32 -> bf16 conversion within one
  unit in the last place: the interpreter truncates where a GPU rounds), every other slot
  untouched.
* timing (GPU only; "skipped: no GPU" elsewhere): CUDA events, a warm-up, the median of
  --repeats rounds, each call timed both eagerly (Python launches included) and replayed from
  a CUDA graph (as the torch backend runs it; `ms` is the graph time when the capture works).
  Decode batches 1..256 x context 512..32k and mixed prefill + decode batches (bf16, head dim
  128, 64 query / 8 kv heads, block size 16), with the achieved bandwidth (K/V read + q + out
  bytes / time) against the device's copy bandwidth (torch.add over a --copy-gib array), and
  torch's scaled_dot_product_attention (flash / cuDNN / efficient only, enable_gqa=True) on
  the dense equivalent of the uniform batches: the same keys and values in contiguous
  [R, K, L, H] tensors (made first and freed before the paged cache, so a case needs its K/V
  bytes once). Its output is compared with the kernel's (sdpa_err). Cases that would not fit
  the GPU's free memory (JAX may hold most of it when run after the JAX checks) or the
  --max-seconds budget are skipped with a note. Small cases sit in L2 and are launch-bound.

run() returns (report, failures): a JSON-able dict and a list of failure lines.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.metadata
import inspect
import json
import math
import platform
import sys
import time

import numpy as np
import torch

from jaxserve.kernels_triton import ref

TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max abs error / max abs reference output
TF32_F32_TOL = 1e-3  # if attention.py ever runs float32 dots in TF32 on a GPU
WRITE_TOL = 2.0**-7  # float32 -> bf16 in the cache: one unit in the last place
# (kind, dtype, S block size, K kv heads, N query heads, H head dim, sliding_window, soft_cap)
CPU_CHECKS = [("decode", "float32", 16, 1, 4, 32, None, None),
              ("prefill", "bfloat16", 16, 2, 4, 32, None, None),
              ("mixed", "float32", 16, 1, 4, 32, None, None),
              ("mixed", "bfloat16", 16, 2, 4, 32, 24, 5.0),
              ("far-decode", "bfloat16", 16, 1, 4, 32, None, None)]
DEVICE_CHECKS = [(kind, dtype, 16, 8, 64, 128, None, None)
                 for kind in ("decode", "prefill", "mixed")
                 for dtype in ("float32", "bfloat16")]
DEVICE_CHECKS += [("mixed", dtype, 32, 2, 16, 64, 700, 30.0) for dtype in ("float32", "bfloat16")]
DEVICE_CHECKS += [("far-decode", "bfloat16", 16, 8, 64, 128, None, None)]
# far: pages past this many bytes into each cache, so 32-bit element offsets (2**31 elements)
# would go wrong; on the CPU only the plumbing
FAR_BYTES = {"cpu": 1 << 20, "cuda": (1 << 32) + (1 << 28)}
# (dtype of k/v, cache dtype, T tokens (the last 2 padding), pages, S, K, H, far)
WRITE_CHECKS = {
    "cpu": [("float32", "float32", 7, 6, 16, 2, 32, False),
            ("bfloat16", "bfloat16", 7, 6, 16, 2, 32, False),
            ("float32", "bfloat16", 7, 6, 16, 2, 32, False),
            ("bfloat16", "bfloat16", 7, 6, 16, 2, 32, True)],
    "cuda": [("float32", "float32", 256, 4096, 16, 8, 128, False),
             ("bfloat16", "bfloat16", 256, 4096, 16, 8, 128, False),
             ("float32", "bfloat16", 256, 4096, 16, 8, 128, False),
             ("bfloat16", "bfloat16", 256, 64, 16, 8, 128, True)],
}
WRITE_FILL = 0.5  # what every slot of the write checks' caches holds before the write
BENCH = dict(block_size=16, kv_heads=8, q_heads=64, head_dim=128, dtype="bfloat16")
MAX_SECONDS = {"quick": 60.0, "full": 150.0}
SDPA_TOL = 2e-2  # bf16 kernel vs bf16 SDPA on the same inputs
MEMORY_MARGIN = 1 << 30  # bytes kept free beyond what a timing case needs


# ----------------------------------------------------------------------------- setup


def versions(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": device.type}
    for dist in ("triton", "pytorch-triton"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["capability"] = "%d.%d" % torch.cuda.get_device_capability(device)
    return info


def f32_dot_precision() -> str:
    """The input_precision attention.py gives float32 tl.dot calls: "ieee" when its launch says
    so (read from its source), else "tf32" (Triton's default on a GPU)."""
    from jaxserve.kernels_triton import attention

    try:
        source = inspect.getsource(attention)
    except (OSError, TypeError):
        return "unknown"
    return "ieee" if '"ieee"' in source or "'ieee'" in source else "tf32"


def tolerances(device: torch.device) -> dict:
    tol = dict(TOL)
    if device.type == "cuda" and f32_dot_precision() != "ieee":
        tol["float32"] = TF32_F32_TOL
    return tol


@contextlib.contextmanager
def no_tf32():
    """torch's float32 matmuls (the reference's) in full precision on a GPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_kernels(device: torch.device):
    """(attention, write_kv) of kernels_triton: compiled on a GPU, interpreted on the CPU."""
    from jaxserve.kernels_triton import attention, kv_write

    interpret = device.type != "cuda"
    return (functools.partial(attention.ragged_paged_attention, interpret=interpret),
            functools.partial(kv_write.write_kv, interpret=interpret))


# ----------------------------------------------------------------------------- batches


@dataclasses.dataclass
class Batch:
    """The kernels' batch fields (int32 tensors on the device) plus the host's view."""

    cu_q_lens: torch.Tensor  # i32[R+1]
    kv_lens: torch.Tensor  # i32[R]
    block_tables: torch.Tensor  # i32[R, B]
    num_seqs: torch.Tensor  # i32[1]
    slot_mapping: torch.Tensor  # i32[T]
    real_tokens: int
    specs: list


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def make_batch(specs, *, block_size: int, num_tokens: int, num_rows: int, rng, device,
               first_page: int = 1):
    """A ragged Batch from specs [(q_len, kv_len)] of the real rows, on shuffled pages
    first_page.. (page 0 is the null page).

    Rows beyond len(specs) and tokens beyond the real ones are padding (kv_len 0; slot 0 of
    the null page). Returns (batch, P = pages the cache needs, null page included)."""
    S = block_size
    counts = [-(-kv // S) for _, kv in specs]
    assert num_rows >= len(specs) and num_tokens >= sum(q for q, _ in specs)
    cu = np.zeros(num_rows + 1, np.int32)
    cu[1:len(specs) + 1] = np.cumsum([q for q, _ in specs])
    cu[len(specs) + 1:] = cu[len(specs)]
    kv_lens = np.zeros(num_rows, np.int32)
    kv_lens[:len(specs)] = [kv for _, kv in specs]
    tables = np.zeros((num_rows, max(counts)), np.int32)
    slots = np.zeros(num_tokens, np.int32)
    pages = rng.permutation(np.arange(first_page, first_page + sum(counts), dtype=np.int64))
    used = 0
    for row, ((q_len, kv_len), count) in enumerate(zip(specs, counts)):
        tables[row, :count] = pages[used:used + count]
        used += count
        pos = np.arange(kv_len - q_len, kv_len)
        slots[cu[row]:cu[row + 1]] = tables[row, pos // S] * S + pos % S
    put = lambda a: torch.from_numpy(a).to(device)
    batch = Batch(cu_q_lens=put(cu), kv_lens=put(kv_lens), block_tables=put(tables),
                  num_seqs=put(np.array([len(specs)], np.int32)), slot_mapping=put(slots),
                  real_tokens=int(cu[len(specs)]), specs=list(specs))
    return batch, first_page + used


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


def generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def random_case(kind, dtype, S, K, N, H, *, rng, long, far_bytes, device):
    """(q [T, N, H], k_cache, v_cache [P, S, K, H], batch). Pages no real sequence owns (the
    null page, 3 spare ones, and for far-decode every page below far_bytes) hold NaN; mixed
    batches come padded to power-of-two buckets."""
    far = kind == "far-decode"
    specs = check_specs("decode" if far else kind, rng, S, long)
    real = sum(q for q, _ in specs)
    pad = kind == "mixed"
    itemsize = torch.empty((), dtype=dtype).element_size()
    first_page = -(-far_bytes // (S * K * H * itemsize)) if far else 1
    batch, pages = make_batch(specs, block_size=S, rng=rng, device=device,
                              first_page=first_page,
                              num_tokens=next_pow2(real + 1) if pad else real,
                              num_rows=next_pow2(len(specs) + 1) if pad else len(specs))
    gen = generator(device, rng.integers(1 << 30))
    q = torch.randn((batch.slot_mapping.shape[0], N, H), generator=gen, device=device,
                    dtype=dtype)
    owned = torch.arange(first_page, pages, device=device)
    caches = []
    for _ in range(2):
        cache = torch.full((pages + 3, S, K, H), math.nan, dtype=dtype, device=device)
        cache[owned] = torch.randn((len(owned), S, K, H), generator=gen, device=device,
                                   dtype=dtype)
        caches.append(cache)
    return q, caches[0], caches[1], batch


def compact_for_reference(k_cache, v_cache, batch):
    """The pages the block tables name, upcast to float32, with the tables renumbered: the
    reference's float32 inputs without upcasting a whole (possibly > 4 GiB) cache."""
    pages = torch.unique(batch.block_tables.long())  # sorted
    tables = torch.searchsorted(pages, batch.block_tables.long()).to(torch.int32)
    return (k_cache[pages].float(), v_cache[pages].float(),
            dataclasses.replace(batch, block_tables=tables))


# ----------------------------------------------------------------------------- correctness


def relative_error(got, want, real: int) -> float:
    """max |got - want| / max |want| over the first `real` tokens; inf if any output row is
    not finite."""
    if not bool(torch.isfinite(got).all()):
        return math.inf
    got, want = got[:real].double(), want[:real].double()
    return float((got - want).abs().max() / want.abs().max())


def run_checks(kernel, cases, *, long: bool, far_bytes: int, device, tol: dict, rng,
               log=print, name: str = "triton"):
    """kernel(q, k_cache, v_cache, batch, **opts) on every case against ref; result dicts."""
    results = []
    for kind, dtype, S, K, N, H, window, cap in cases:
        result = dict(kernel=name, kind=kind, dtype=dtype, S=S, K=K, N=N, H=H,
                      sliding_window=window, soft_cap=cap, tol=tol[dtype])
        start = time.perf_counter()
        labelled = False
        try:
            q, k_cache, v_cache, batch = random_case(
                kind, getattr(torch, dtype), S, K, N, H, rng=rng, long=long,
                far_bytes=far_bytes, device=device)
            result.update(T=q.shape[0], R=batch.kv_lens.shape[0], real_tokens=batch.real_tokens,
                          cache_gib=2 * k_cache.numel() * k_cache.element_size() / 2**30)
            opts = dict(scale=1.0 / math.sqrt(H), sliding_window=window, soft_cap=cap)
            with no_tf32():
                want = ref.ragged_paged_attention(
                    q.float(), *compact_for_reference(k_cache, v_cache, batch), **opts)
            log(check_label(result), end=" ", flush=True)  # a crash shows what ran
            labelled = True
            got = kernel(q, k_cache, v_cache, batch, **opts)
            if got.shape != q.shape or got.dtype != q.dtype:
                raise ValueError(f"output {tuple(got.shape)} {got.dtype}, want "
                                 f"{tuple(q.shape)} {q.dtype}")
            result["error"] = relative_error(got, want, batch.real_tokens)
            result["padding_nonzero"] = int(torch.count_nonzero(got[batch.real_tokens:]))
            result["ok"] = result["error"] <= tol[dtype] and result["padding_nonzero"] == 0
            del q, k_cache, v_cache, got, want
        except Exception as exc:  # a failing kernel is a result, not the end of the run
            if not labelled:
                log(check_label(result), end=" ", flush=True)
            result.update(ok=False, exception=f"{type(exc).__name__}: {exc}"[:400])
        result["seconds"] = time.perf_counter() - start
        log(check_verdict(result), flush=True)
        results.append(result)
    return results


def check_label(r: dict) -> str:
    extra = ""
    if r["sliding_window"] is not None or r["soft_cap"] is not None:
        extra = f" window={r['sliding_window']} cap={r['soft_cap']}"
    shape = f"S={r['S']} K={r['K']} N={r['N']} H={r['H']} T={r.get('T')} R={r.get('R')}{extra}"
    return f"torch-check {r['kernel']:8} {r['kind']:10} {r['dtype']:8} {shape:44}"


def check_verdict(r: dict) -> str:
    if "exception" in r:
        verdict = f"FAIL {r['exception']}"
    else:
        verdict = f"err {r['error']:.2e} (tol {r['tol']:.0e}) "
        if r["padding_nonzero"]:
            verdict += f"{r['padding_nonzero']} nonzero padding values "
        verdict += "ok" if r["ok"] else "FAIL"
    return f"{verdict} [{r['seconds']:.1f}s]"


def check_write_kv(writer, cases, *, far_bytes: int, device, rng, log=print,
                   name: str = "triton"):
    """writer(k_cache, v_cache, k, v, slot_mapping) against ref.write_kv: result dicts.

    The caches start as WRITE_FILL everywhere; T - 2 tokens go to distinct random slots of
    pages first_page.., the last 2 (padding) to slot 0 of the null page, which is not
    compared (two writers may race there). ref.write_kv writes the same tokens into a copy of
    just the touched pages; every other slot must still hold WRITE_FILL."""
    results = []
    for dtype, cache_dtype, T, pages, S, K, H, far in cases:
        result = dict(kernel=f"{name}-write-kv", dtype=dtype, cache_dtype=cache_dtype, T=T,
                      S=S, K=K, H=H, far=far,
                      tol=WRITE_TOL if dtype != cache_dtype else 0.0)
        log(f"torch-check {result['kernel']:14} {dtype:>8} -> {cache_dtype:8} T={T} "
            f"pages={pages}{' far' if far else ''}", end=" ", flush=True)
        start = time.perf_counter()
        try:
            cdt, kdt = getattr(torch, cache_dtype), getattr(torch, dtype)
            itemsize = torch.empty((), dtype=cdt).element_size()
            first = -(-far_bytes // (S * K * H * itemsize)) if far else 1
            total = first + pages
            result["pages"] = total
            gen = generator(device, rng.integers(1 << 30))
            chosen = rng.choice(pages * S, T - 2, replace=False) + first * S
            slots = torch.from_numpy(np.concatenate([chosen, [0, 0]]).astype(np.int32))
            slots = slots.to(device)
            k, v = (torch.randn((T, K, H), generator=gen, device=device, dtype=kdt)
                    for _ in range(2))
            got = [torch.full((total, S, K, H), WRITE_FILL, dtype=cdt, device=device)
                   for _ in range(2)]
            pointers = [c.data_ptr() for c in got]
            writer(*got, k, v, slots)
            in_place = [c.data_ptr() for c in got] == pointers
            touched = torch.unique(slots.long() // S)  # page 0 included (padding)
            local = torch.searchsorted(touched, slots.long() // S) * S + slots.long() % S
            want = [torch.full((len(touched), S, K, H), WRITE_FILL, dtype=cdt, device=device)
                    for _ in range(2)]
            ref.write_kv(*want, k, v, local)
            error, others = 0.0, True
            for cache, expect in zip(got, want):
                mine = cache[touched]
                mine[0, 0] = expect[0, 0] = 0  # the padding tokens' slot
                scale = float(expect.double().abs().max())
                error = max(error, float((mine.double() - expect.double()).abs().max()) / scale)
                cache[touched] = WRITE_FILL  # then nothing else may differ from the fill
                others = others and not bool((cache != WRITE_FILL).any())
            result.update(error=error, in_place=in_place, others_untouched=others,
                          ok=in_place and others and error <= result["tol"])
            del got, want, k, v
        except Exception as exc:
            result.update(ok=False, exception=f"{type(exc).__name__}: {exc}"[:400])
        result["seconds"] = time.perf_counter() - start
        if "exception" in result:
            verdict = f"FAIL {result['exception']}"
        else:
            verdict = (f"err {result['error']:.1e} (tol {result['tol']:.0e}) in place "
                       f"{'yes' if result['in_place'] else 'NO'}, other slots "
                       f"{'untouched' if result['others_untouched'] else 'CHANGED'} "
                       + ("ok" if result["ok"] else "FAIL"))
        log(f"{verdict} [{result['seconds']:.1f}s]", flush=True)
        results.append(result)
    return results


# ----------------------------------------------------------------------------- timing


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


def attention_work(specs, N, K, H, itemsize):
    """(bytes, flops) one step must move and compute: each row's K/V read once, q and out
    once; 4 N H flops per (query token, visible key)."""
    kv_tokens = sum(kv for _, kv in specs)
    q_tokens = sum(q for q, _ in specs)
    nbytes = (2 * kv_tokens * K * H + 2 * q_tokens * N * H) * itemsize
    visible = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in specs)
    return nbytes, 4 * N * H * visible


def bench_cases(quick: bool, max_kv_gib: float, dims=None):
    """{name: specs}: the decode grid (within max_kv_gib of K+V) and mixed batches."""
    S, K, H, dtype = dims or (BENCH["block_size"], BENCH["kv_heads"], BENCH["head_dim"],
                              BENCH["dtype"])
    per_token = 2 * K * H * torch.empty((), dtype=getattr(torch, dtype)).element_size()
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
    batch, pages = make_batch(specs, block_size=S, rng=rng, device=device,
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
            row["sdpa_err"] = relative_error(fn(), sdpa_out.float(), real)
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


# ----------------------------------------------------------------------------- run


def failures_of(report: dict) -> list[str]:
    """One line per failed check, write check and timing case (an SDPA that cannot run is
    informational; one that disagrees with the kernel means the comparison is wrong)."""
    failed = []
    for c in report.get("checks", []):
        if not c["ok"]:
            why = c.get("exception") or (f"err {c['error']:.2e} > tol {c['tol']:.0e}"
                                         if c["error"] > c["tol"] else
                                         f"{c['padding_nonzero']} nonzero padding values")
            failed.append(f"triton check {c['kind']} {c['dtype']} S={c['S']} K={c['K']} "
                          f"N={c['N']} H={c['H']} window={c['sliding_window']} "
                          f"cap={c['soft_cap']}: {why}")
    for w in report.get("write_kv", []):
        if not w["ok"]:
            why = w.get("exception") or (f"err {w['error']:.1e}, in place {w['in_place']}, "
                                         f"others untouched {w['others_untouched']}")
            failed.append(f"triton write_kv {w['dtype']} -> {w['cache_dtype']} T={w['T']}"
                          f"{' far' if w['far'] else ''}: {why}")
    timing = report.get("timing", {})
    if "error" in timing:
        failed.append(f"triton timing: {timing['error']}")
    for r in timing.get("rows", []):
        if "error" in r:
            failed.append(f"triton timing {r['case']}: {r['error']}")
        elif r.get("sdpa_ok") is False:
            failed.append(f"triton timing {r['case']}: the kernel and SDPA disagree "
                          f"(err {r['sdpa_err']:.1e} > {SDPA_TOL:.0e})")
    return failed


def run(*, quick: bool = False, max_seconds: float | None = None, repeats: int = 5,
        max_kv_gib: float = 40.0, copy_gib: float = 2.0, device=None, kernel=None,
        writer=None, seed: int = 0, log=print):
    """Check (and on a GPU time) the Triton kernels. Returns (report, failures).

    kernel, writer: the attention and KV-write functions under test (default: the Triton
    kernels, interpreted on the CPU)."""
    start = time.monotonic()
    device = torch.device(device) if device is not None else default_device()
    on_gpu = device.type == "cuda"
    max_seconds = max_seconds or MAX_SECONDS["quick" if quick else "full"]
    deadline = start + max_seconds
    if kernel is None or writer is None:
        kernel_default, writer_default = load_kernels(device)
        kernel, writer = kernel or kernel_default, writer or writer_default
    tol = tolerances(device)
    report = dict(versions=versions(device), mode="compiled" if on_gpu else "interpret",
                  precision={"reference": "float32, TF32 off",
                             "kernel_float32_dots": f32_dot_precision(),
                             "kernel_16bit_dots": "tf32 (exact for bf16/fp16 operands)"},
                  tol=tol, max_seconds=max_seconds)
    mode = f"compiled on {device}" if on_gpu else "interpret mode"
    log(f"\ntriton kernels vs kernels_triton/ref.py ({mode}): "
        + " ".join(f"{k}={v}" for k, v in report["versions"].items()), flush=True)
    rng = np.random.default_rng(seed)
    far_bytes = FAR_BYTES["cuda" if on_gpu else "cpu"]
    report["checks"] = run_checks(kernel, DEVICE_CHECKS if on_gpu else CPU_CHECKS,
                                  long=on_gpu, far_bytes=far_bytes, device=device, tol=tol,
                                  rng=rng, log=log)
    report["write_kv"] = check_write_kv(writer, WRITE_CHECKS["cuda" if on_gpu else "cpu"],
                                        far_bytes=far_bytes, device=device, rng=rng, log=log)
    if on_gpu:
        try:
            report["timing"] = run_timing(kernel, quick=quick, timer=CudaTimer(repeats),
                                          device=device, max_kv_gib=max_kv_gib,
                                          copy_gib=copy_gib, deadline=deadline, rng=rng,
                                          log=log)
        except Exception as exc:
            report["timing"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            log(f"triton timing FAILED: {report['timing']['error']}")
    else:
        report["timing"] = {"skipped": "no GPU (torch.cuda.is_available() is False)"}
        log(f"triton timing skipped: {report['timing']['skipped']}")
    failures = failures_of(report)
    report["failures"] = failures
    report["seconds"] = time.monotonic() - start
    log(f"triton kernels: {'FAILED: ' + str(len(failures)) if failures else 'all checks passed'}"
        f" ({report['seconds']:.0f}s)", flush=True)
    for line in failures:
        log(f"  {line}", flush=True)
    return report, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing shapes")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--max-seconds", type=float,
                        help="skip the remaining timing cases after this many seconds "
                             f"(default {MAX_SECONDS['full']:g}, --quick "
                             f"{MAX_SECONDS['quick']:g})")
    parser.add_argument("--max-kv-gib", type=float, default=40, help="skip bigger decode KV")
    parser.add_argument("--copy-gib", type=float, default=2, help="copy-bandwidth array size")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="default: cuda when torch sees a GPU")
    parser.add_argument("--json", metavar="OUT", help="write every result here")
    args = parser.parse_args()
    print(f"python={platform.python_version()} torch={torch.__version__}", flush=True)
    try:
        report, failures = run(quick=args.quick, max_seconds=args.max_seconds,
                               repeats=args.repeats, max_kv_gib=args.max_kv_gib,
                               copy_gib=args.copy_gib, device=args.device)
    except Exception as exc:  # still write what happened
        report = {"error": f"{type(exc).__name__}: {exc}"}
        failures = [report["error"]]
        print(f"FAILED: {report['error']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
