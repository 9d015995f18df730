"""The torch backend's attention: the Triton kernels (interpret mode) and the PyTorch reference
against the float64 oracle, plus the Triton kernels compiled for a CUDA GPU without one.

The matrix is test_pallas_kernels.py's: decode, prefill and mixed batches x block size 16/32 x
GQA ratios 1/2/4/8 x head_dim 64/128 x float32/bfloat16, in padded buckets (padding rows and
tokens, loud padding queries, junk block-table entries, NaN in every unused page). Then
sliding window and soft cap, explicit tile sizes (split-KV, tiles wider or narrower than a
page, multi-token query blocks), a long decode with the default split-KV, the KV-cache write,
interpret mode whatever TRITON_INTERPRET says, and the compiled kernels built for sm_90 from
meta tensors, which also shows the launch reads nothing from the device.
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import triton.language as tl
from support.attention_cases import (
    MATRIX,
    SINK_CASES,
    assert_close,
    kernel_sink_cases,
    make_case,
    numpy_attention,
    padded_case,
    random_sinks,
)
from support.triton_helpers import (
    compile_for_cuda,
    interpreted_then_compiled,
    meta_case,
    recording,
    to_torch,
    torch_batch,
)

from jaxserve.kernels_triton import attention, kv_write, ref
from jaxserve.kernels_triton.attention import BlockSizes, default_block_sizes

IMPLS = {
    "triton": lambda *args, **kw: attention.ragged_paged_attention(*args, interpret=True, **kw),
    "ref": ref.ragged_paged_attention,
}
WRITERS = {
    "triton": lambda *args: kv_write.write_kv(*args, interpret=True),
    "ref": ref.write_kv,
}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return request.param


# ----------------------------------------------------------------------------- helpers


def poison_unused_pages(cache, batch) -> np.ndarray:
    """NaN in every page no real sequence owns (the null page and junk table entries
    included): an implementation that reads or weighs one of them shows NaN."""
    tables, kv_lens = np.asarray(batch.block_tables), np.asarray(batch.kv_lens)
    cache = np.array(cache)
    used = np.zeros(cache.shape[0], bool)
    for row in range(int(np.asarray(batch.num_seqs)[0])):
        used[tables[row, :-(-int(kv_lens[row]) // cache.shape[1])]] = True
    cache[~used] = np.nan
    return cache


def check(impl, case, dtype, **kw):
    """impl on the case with NaN in unused pages against the oracle on the clean case."""
    q, k_cache, v_cache, batch = case
    kw.setdefault("scale", 1.0 / math.sqrt(q.shape[-1]))
    want = numpy_attention(q, k_cache, v_cache, batch, **{k: v for k, v in kw.items()
                                                           if k != "block_sizes"})
    tq = to_torch(q)
    k_poisoned, v_poisoned = (to_torch(poison_unused_pages(c, batch)) for c in (k_cache, v_cache))
    if kw.get("sinks") is not None:
        kw["sinks"] = to_torch(kw["sinks"])
    got = IMPLS[impl](tq, k_poisoned, v_poisoned, torch_batch(batch), **kw)
    assert got.shape == tq.shape and got.dtype == tq.dtype
    assert_close(got.float().numpy(), want, batch, dtype)


# ----------------------------------------------------------------------------- attention

@pytest.mark.parametrize("kind,block_size,ratio,head_dim,dtype", MATRIX)
def test_matrix(kind, block_size, ratio, head_dim, dtype, impl):
    rng = np.random.default_rng(MATRIX.index((kind, block_size, ratio, head_dim, dtype)))
    check(impl, padded_case(rng, kind, block_size, ratio, head_dim, dtype), dtype)


WINDOW_CAP = [{"sliding_window": 9}, {"soft_cap": 2.0}, {"sliding_window": 20, "soft_cap": 5.0}]


@pytest.mark.parametrize("options", WINDOW_CAP, ids=lambda o: "-".join(o))
def test_window_and_soft_cap(options, impl):
    """A window shorter than a page and than a tile; a cap small enough to change scores."""
    rng = np.random.default_rng(WINDOW_CAP.index(options))
    q, k_cache, v_cache, batch = padded_case(rng, "mixed", 16, 2, 64, "float32")
    check(impl, (q * 4, k_cache, v_cache, batch), "float32", **options)


@pytest.mark.parametrize("kind,window,dtype", kernel_sink_cases())
def test_attention_sinks(kind, window, dtype, impl):
    """GPT-OSS's sinks on decode, prefill, mixed and windowed padded buckets (GQA 3, so
    padding heads' rows carry no sink)."""
    rng = np.random.default_rng(SINK_CASES.index((kind, window, dtype)))
    case = padded_case(rng, kind, 16, 3, 64, dtype)
    check(impl, case, dtype, sinks=random_sinks(rng, case[0].shape[1]), sliding_window=window)


@pytest.mark.parametrize("sizes", [BlockSizes(1, 16, 4), pytest.param(
    BlockSizes(8, 128, 2), marks=pytest.mark.slow)], ids=str)
def test_attention_sinks_with_split_kv(sizes):
    """Each sink counted once when a query block's keys are split over programs."""
    rng = np.random.default_rng(sizes.kv_splits)
    specs = [(1, 150), (12, 120), (1, 2), (1, 17), (7, 57), (1, 64)]
    case = make_case(rng, specs, block_size=32, num_kv_heads=1, num_heads=4, head_dim=32,
                     max_model_len=160, num_rows=8, num_tokens=26, junk_tables=True)
    check("triton", case, "float32", block_sizes=sizes, sliding_window=128,
          sinks=random_sinks(rng, 4))


# Query blocks of one or several tokens; tiles narrower than a page, of one page and of more
# pages than some contexts; a query block's keys split over 1..16 programs.
TILES = [BlockSizes(1, 16, 4),
         pytest.param(BlockSizes(1, 64, 16), marks=pytest.mark.slow),  # 16 splits: slow here
         BlockSizes(2, 32, 1),
         BlockSizes(8, 128, 2), BlockSizes(32, 16, 1)]


@pytest.mark.parametrize("sizes", TILES, ids=str)
def test_tile_sizes(sizes):
    """All tile sizes compute the same function, with window and cap."""
    rng = np.random.default_rng(sizes.q_tokens * sizes.tile_keys * sizes.kv_splits)
    specs = [(1, 150), (12, 120), (1, 2), (1, 17), (7, 57), (1, 64)]
    case = make_case(rng, specs, block_size=32, num_kv_heads=1, num_heads=4, head_dim=32,
                     max_model_len=160, num_rows=8, num_tokens=26, junk_tables=True)
    check("triton", case, "float32", block_sizes=sizes, sliding_window=70, soft_cap=30.0)


def test_long_decode_uses_split_kv(impl):
    """A small decode bucket with contexts of hundreds of keys: the default sizes split each
    context over many programs, and the merge gets every split's share right."""
    specs = [(1, 517), (1, 1), (1, 300), (1, 449)]
    sizes = default_block_sizes(len(specs), len(specs), num_kv_heads=1, group=4, head_dim=64)
    assert sizes.q_tokens == 1 and sizes.kv_splits >= 8
    rng = np.random.default_rng(7)
    case = make_case(rng, specs, block_size=16, num_kv_heads=1, num_heads=4, head_dim=64,
                     dtype="bfloat16", max_model_len=544, junk_tables=True)
    check(impl, case, "bfloat16")


def test_block_size_policy():
    """Decode buckets: one-token blocks, split contexts when the grid is small and only
    then; prefill buckets: big blocks, no split; sizes are powers of two."""
    small = default_block_sizes(8, 8, num_kv_heads=8, group=4, head_dim=128)
    assert small.q_tokens == 1 and small.kv_splits > 1
    full = default_block_sizes(256, 256, num_kv_heads=8, group=4, head_dim=128)
    assert full.q_tokens == 1 and full.kv_splits == 1
    prefill = default_block_sizes(2048, 4, num_kv_heads=8, group=4, head_dim=128)
    assert prefill.q_tokens > 1 and prefill.kv_splits == 1
    assert prefill.q_tokens * 4 * 128 <= attention.MAX_TILE_ELEMENTS
    assert default_block_sizes(1024, 8, group=1, head_dim=64).q_tokens == 64
    wide = default_block_sizes(1024, 8, group=2, head_dim=256)
    assert wide.q_tokens * 2 * 256 <= attention.MAX_TILE_ELEMENTS and wide.tile_keys == 16
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(3, 16)
    with pytest.raises(ValueError, match="power of two >= 16"):
        BlockSizes(1, 8)


@pytest.mark.parametrize("sizes", [None, BlockSizes(4, 16, 1)], ids=str)
def test_all_padding(sizes, impl):
    """A bucket with no real sequence (num_seqs 0): zeros, never NaN, split or not."""
    q = torch.randn(6, 4, 32)
    cache = torch.full((3, 16, 2, 32), float("nan"))
    batch = types.SimpleNamespace(cu_q_lens=torch.zeros(4, dtype=torch.int32),
                                  kv_lens=torch.zeros(3, dtype=torch.int32),
                                  block_tables=torch.zeros((3, 2), dtype=torch.int32),
                                  num_seqs=torch.zeros(1, dtype=torch.int32))
    kw = {"block_sizes": sizes} if impl == "triton" else {}
    got = IMPLS[impl](q, cache, cache, batch, scale=0.2, **kw)
    assert torch.equal(got, torch.zeros_like(q))


@pytest.mark.parametrize("head_dim", [80, 8])
def test_refuses_a_head_dim_triton_cannot_tile(head_dim):
    rng = np.random.default_rng(0)
    q, k_cache, v_cache, batch = make_case(rng, [(1, 20)], block_size=16, num_kv_heads=1,
                                           num_heads=1, head_dim=head_dim)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        attention.ragged_paged_attention(to_torch(q), to_torch(k_cache), to_torch(v_cache),
                                         torch_batch(batch), scale=0.1, interpret=True)


# ----------------------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_write_kv(writer, dtype, cache_dtype):
    """In place, into the caches given (same objects), converted to their dtype; padding
    tokens write the null page's slot 0 (or nothing, with a negative slot); every other slot
    keeps its value."""
    gen = torch.Generator().manual_seed(3)
    num_pages, block_size, num_kv_heads, head_dim = 6, 16, 3, 24
    k_cache = torch.randn(num_pages, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(k_cache.shape, generator=gen)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    slots = torch.tensor([17, 18, 19, 95, 40, 0, -1, 0], dtype=torch.int32)  # 3 padding
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    want_k, want_v = k_cache.float().numpy().copy(), v_cache.float().numpy().copy()
    flat = (num_pages * block_size, num_kv_heads, head_dim)
    for cache, new in ((want_k, k), (want_v, v)):
        cache.reshape(flat)[slots[:5].numpy()] = new[:5].to(cache_dtype).float().numpy()
    k_id, v_id, ptr = id(k_cache), id(v_cache), k_cache.data_ptr()

    WRITERS[writer](k_cache, v_cache, k, v, slots)
    assert (id(k_cache), id(v_cache), k_cache.data_ptr()) == (k_id, v_id, ptr)
    assert k_cache.dtype == v_cache.dtype == cache_dtype
    # Triton's interpreter converts float32 to bfloat16 by truncation where a GPU rounds to
    # nearest: one unit in the last place apart.
    rtol = 2.0**-7 if writer == "triton" and dtype != cache_dtype else 0.0
    for got, want in ((k_cache, want_k), (v_cache, want_v)):
        got = got.float().numpy()
        np.testing.assert_allclose(got[1:], want[1:], rtol=rtol, atol=0)
        np.testing.assert_allclose(got[0, 1:], want[0, 1:], rtol=rtol, atol=0)


def test_written_keys_are_attended():
    """write_kv then attention: the step's own keys come back through the block table."""
    rng = np.random.default_rng(11)
    q, k_cache, v_cache, batch = make_case(rng, [(5, 20), (1, 9)], block_size=16,
                                           num_kv_heads=2, num_heads=4, head_dim=32,
                                           num_rows=3, num_tokens=8)
    new_k = rng.standard_normal((8, 2, 32)).astype(np.float32)
    new_v = rng.standard_normal((8, 2, 32)).astype(np.float32)
    tk, tv = to_torch(k_cache), to_torch(v_cache)
    kv_write.write_kv(tk, tv, torch.from_numpy(new_k), torch.from_numpy(new_v),
                      to_torch(batch.slot_mapping), interpret=True)
    got = attention.ragged_paged_attention(to_torch(q), tk, tv, torch_batch(batch),
                                           scale=0.2, interpret=True)
    ref_k, ref_v = to_torch(k_cache), to_torch(v_cache)
    ref.write_kv(ref_k, ref_v, torch.from_numpy(new_k), torch.from_numpy(new_v),
                 to_torch(batch.slot_mapping))
    want = numpy_attention(q, ref_k.numpy(), ref_v.numpy(), batch, scale=0.2)
    assert_close(got.numpy(), want, batch, "float32")


# ----------------------------------------------------------------------------- builds


# Both ways in the default suite would cost 15 s of the budget: "1" with -m slow.
@pytest.mark.parametrize("env", ["unset", pytest.param("1", marks=pytest.mark.slow)])
def test_interpret_whatever_triton_interpret_says(env):
    """interpret=True interprets and interpret=False compiles, in one process, whether
    triton.jit there compiles (TRITON_INTERPRET unset) or interprets (1)."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env != "unset":
        environ["TRITON_INTERPRET"] = env
    code = ("from support.triton_helpers import interpreted_then_compiled; "
            "interpreted_then_compiled(); print('both ok')")
    run = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                         text=True, timeout=300, cwd=pathlib.Path(__file__).parents[1])
    assert run.returncode == 0 and "both ok" in run.stdout, run.stderr[-3000:]


def test_interpreted_runs_leave_triton_language_alone():
    """Nothing an interpreted launch patches in triton.language outlives it: a leftover
    patch breaks every later compile in the process."""
    before = dict(vars(tl.core))
    interpreted_then_compiled()
    assert [name for name, value in vars(tl.core).items() if before.get(name) is not value] == []


# (T, R, N, K, H, S, P, B, dtype, options): a decode bucket small enough to split its
# contexts, a full decode bucket, a mixed bucket with window and cap, a prefill bucket, and
# GPT-OSS's split decode with window and sinks.
LAUNCHES = [
    (16, 16, 32, 8, 128, 16, 4096, 128, torch.bfloat16, {}),
    (256, 256, 32, 4, 128, 16, 4096, 128, torch.float16, {}),
    (512, 64, 32, 8, 128, 32, 1024, 64, torch.bfloat16, {"sliding_window": 256,
                                                         "soft_cap": 30.0}),
    (1024, 8, 12, 4, 64, 16, 1024, 128, torch.float32, {}),
    (16, 16, 64, 8, 64, 16, 1024, 64, torch.bfloat16, {"sliding_window": 128, "sinks": True}),
]


@pytest.mark.parametrize("shape", LAUNCHES, ids=lambda s: f"T{s[0]}-R{s[1]}-{str(s[8])[6:]}")
def test_compiles_for_cuda(shape):
    """The compiled builds of a real call compile for an H100/H200 here, without a GPU, and
    their shared memory fits one SM (227 KiB); the call reads no value from its tensors."""
    *dims, dtype, options = shape
    q, k_cache, v_cache, batch = meta_case(*dims, dtype)
    if options.get("sinks"):  # GPT-OSS: f32[N]
        options = {**options, "sinks": torch.empty(dims[2], dtype=torch.float32, device="meta")}
    with recording(attention._ATTENTION) as attend, recording(attention._MERGE) as merge:
        out = attention.ragged_paged_attention(q, k_cache, v_cache, batch,
                                               scale=1 / math.sqrt(q.shape[-1]), **options)
    assert out.shape == q.shape and out.dtype == dtype
    launches = [(r.kernel, launch) for r in (attend, merge) for launch in r.launches]
    splits = default_block_sizes(dims[0], dims[1], num_kv_heads=dims[3],
                                 group=dims[2] // dims[3], head_dim=dims[4]).kv_splits
    assert len(launches) == (2 if splits > 1 else 1)
    for kernel, (grid, args, kwargs) in launches:
        assert all(isinstance(n, int) for n in grid)
        compiled = compile_for_cuda(kernel, args, kwargs)
        assert compiled.asm["cubin"] and compiled.metadata.shared <= 227 * 1024


def test_kv_write_compiles_for_cuda():
    cache = torch.empty((4096, 16, 8, 128), dtype=torch.bfloat16, device="meta")
    new = torch.empty((256, 8, 128), dtype=torch.bfloat16, device="meta")
    slots = torch.empty(256, dtype=torch.int32, device="meta")
    with recording(kv_write._WRITE) as recorder:
        kv_write.write_kv(cache, cache, new, new, slots)
    ((grid, args, kwargs),) = recorder.launches
    assert compile_for_cuda(recorder.kernel, args, kwargs).asm["cubin"]
