"""Correctness of the torch backend's Triton kernels (kernels_triton/) against
kernels_triton/ref.py, for scripts/check_triton_kernels.py and the Triton part of
scripts/check_kernels_on_device.py: the attention kernel on random ragged batches (the
same kinds and tolerances as the Pallas checks, kernel_checks.py), rows of padding tokens
exactly 0 and NaN in every page no sequence owns; and kv_write.write_kv in place, against
ref.write_kv, every other slot untouched. Never imports JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np
import torch

from jaxserve.benchmarks.kernel_checks import (
    check_label,
    check_specs,
    check_verdict,
    next_pow2,
    random_sinks,
    relative_error,
)
from jaxserve.benchmarks.ragged_batch import make_batch
from jaxserve.kernels_triton import ref

WRITE_TOL = 2.0**-7  # float32 -> bf16 in the cache: one unit in the last place
# (kind, dtype, S block size, K kv heads, N query heads, H head dim, sliding_window, soft_cap,
# attention sinks)
CPU_CHECKS = [("decode", "float32", 16, 1, 4, 32, None, None, False),
              ("prefill", "bfloat16", 16, 2, 4, 32, None, None, False),
              ("mixed", "float32", 16, 1, 4, 32, None, None, False),
              ("mixed", "bfloat16", 16, 2, 4, 32, 24, 5.0, True),
              ("far-decode", "bfloat16", 16, 1, 4, 32, None, None, False)]
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


def torch_batch(specs, *, block_size: int, num_tokens: int, num_rows: int, rng, device,
                first_page: int = 1):
    """ragged_batch.make_batch's layout on pages first_page.. (page 0 is the null page) as a
    Batch on the device. Returns (batch, P = pages the cache needs, null page included)."""
    layout = make_batch(specs, block_size=block_size, num_tokens=num_tokens,
                        num_rows=num_rows, rng=rng, first_page=first_page)
    put = lambda a: torch.from_numpy(a).to(device)
    batch = Batch(cu_q_lens=put(layout.cu_q_lens), kv_lens=put(layout.kv_lens),
                  block_tables=put(layout.block_tables),
                  num_seqs=put(np.array([layout.num_seqs], np.int32)),
                  slot_mapping=put(layout.slot_mapping), real_tokens=layout.real_tokens,
                  specs=layout.specs)
    return batch, layout.num_pages


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
    batch, pages = torch_batch(specs, block_size=S, rng=rng, device=device,
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


def run_checks(kernel, cases, *, long: bool, far_bytes: int, device, tol: dict, rng,
               log=print, name: str = "triton"):
    """kernel(q, k_cache, v_cache, batch, **opts) on every case against ref; result dicts."""
    results = []
    for kind, dtype, S, K, N, H, window, cap, sinks in cases:
        result = dict(kernel=name, kind=kind, dtype=dtype, S=S, K=K, N=N, H=H,
                      sliding_window=window, soft_cap=cap, sinks=sinks, tol=tol[dtype])
        start = time.perf_counter()
        labelled = False
        try:
            q, k_cache, v_cache, batch = random_case(
                kind, getattr(torch, dtype), S, K, N, H, rng=rng, long=long,
                far_bytes=far_bytes, device=device)
            result.update(T=q.shape[0], R=batch.kv_lens.shape[0], real_tokens=batch.real_tokens,
                          cache_gib=2 * k_cache.numel() * k_cache.element_size() / 2**30)
            opts = dict(scale=1.0 / math.sqrt(H), sliding_window=window, soft_cap=cap)
            if sinks:
                opts["sinks"] = torch.from_numpy(random_sinks(rng, N)).to(device)
            with no_tf32():
                want = ref.ragged_paged_attention(
                    q.float(), *compact_for_reference(k_cache, v_cache, batch), **opts)
            # the line's start before the kernel runs: a crash shows what ran
            log(check_label(result, "torch-check", 8), end=" ", flush=True)
            labelled = True
            got = kernel(q, k_cache, v_cache, batch, **opts)
            if got.shape != q.shape or got.dtype != q.dtype:
                raise ValueError(f"output {tuple(got.shape)} {got.dtype}, want "
                                 f"{tuple(q.shape)} {q.dtype}")
            result["error"] = relative_error(got.double(), want.double(), batch.real_tokens)
            result["padding_nonzero"] = int(torch.count_nonzero(got[batch.real_tokens:]))
            result["ok"] = result["error"] <= tol[dtype] and result["padding_nonzero"] == 0
            del q, k_cache, v_cache, got, want
        except Exception as exc:  # a failing kernel is a result, not the end of the run
            if not labelled:
                log(check_label(result, "torch-check", 8), end=" ", flush=True)
            result.update(ok=False, exception=f"{type(exc).__name__}: {exc}"[:400])
        result["seconds"] = time.perf_counter() - start
        log(check_verdict(result), flush=True)
        results.append(result)
    return results


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


