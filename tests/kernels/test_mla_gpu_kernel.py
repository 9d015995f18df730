"""The GPU (Triton-lowered) Pallas kernel for ragged paged MLA (latent attention,
kernels_pallas/gpu_ragged_paged_mla.py) in interpret mode against the float64 oracle
(mla_cases.numpy_mla), plus its Triton lowering for CUDA, which runs here without a device.

Every interpret-mode case is a padded (T, rows) bucket (padding tokens with loud queries,
padding rows, junk block-table entries where asked) whose cache holds NaN wherever no real
sequence may read: pages no sequence owns (the null page 0 included) and the stale slots
past kv_len in each sequence's last page.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from support.attention_cases import SPECS, assert_close, f64
from support.mla_cases import SHAPES, make_mla_case, mla_scale, numpy_mla

from jaxserve.backends.jax.batch import Batch
from jaxserve.kernels_pallas import gpu_ragged_paged_mla as gpu_mla
from jaxserve.kernels_pallas.kernel_layout import BlockSizes
from jaxserve.kernels_pallas.ref import kv_storage_dtype

KERNEL = jax.jit(functools.partial(gpu_mla.ragged_paged_mla, interpret=True),
                 static_argnames=("scale", "kv_dtype", "block_sizes", "head_block"))


def poison(cache, batch):
    """NaN in every slot no real sequence may read: pages no real row owns (the null page 0
    and junk block-table entries included) and the slots past kv_len in each real row's
    last page. Returns (cache, bool[P, S] mask of the poisoned slots)."""
    tables = np.asarray(batch.block_tables)
    kv_lens = np.asarray(batch.kv_lens)
    num_pages, size = cache.shape[:2]
    readable = np.zeros((num_pages, size), bool)
    for row in range(int(np.asarray(batch.num_seqs)[0])):
        pos = np.arange(int(kv_lens[row]))
        readable[tables[row, pos // size], pos % size] = True
    dead = jnp.asarray(~readable)[:, :, None]
    return jnp.where(dead, jnp.nan, cache), ~readable


def padded_mla_case(rng, specs, *, block_size, num_heads, shape, dtype, junk_tables=True,
                    max_model_len=256):
    """A padded bucket of specs: three padding rows, five padding tokens whose queries are
    a thousand times louder than the real ones."""
    latent, rope = SHAPES[shape]
    real = sum(q for q, _ in specs)
    q_latent, q_rope, cache, batch = make_mla_case(
        rng, specs, block_size=block_size, num_heads=num_heads, latent=latent, rope=rope,
        dtype=dtype, num_rows=len(specs) + 3, num_tokens=real + 5, junk_tables=junk_tables,
        max_model_len=max_model_len)
    return q_latent.at[real:].mul(1e3), q_rope.at[real:].mul(1e3), cache, batch


def check(case, dtype, *, bits=False, **kw):
    """The kernel against the oracle, on the case's cache with every unreadable slot NaN.
    bits: store a bfloat16 cache as its uint16 bits, as the CPU backend does."""
    q_latent, q_rope, cache, batch = case
    scale = mla_scale(q_latent.shape[-1], q_rope.shape[-1])
    want = numpy_mla(q_latent, q_rope, cache, batch, scale=scale)
    cache, dead = poison(cache, batch)
    assert dead[0].all()  # the null page
    kv_dtype = None
    if bits:
        kv_dtype = cache.dtype
        cache = jax.lax.bitcast_convert_type(cache, kv_storage_dtype(cache.dtype, "cpu"))
        assert cache.dtype == jnp.uint16
    got = KERNEL(q_latent, q_rope, cache, batch, scale=scale, kv_dtype=kv_dtype, **kw)
    assert got.shape == q_latent.shape and got.dtype == q_latent.dtype
    assert_close(got, want, batch, dtype)
    return got


# (kind, block_size S, num_heads N, shape, dtype, bf16 cache stored as bits): every kind
# with both dtypes, S 8 / 16 / 32, N 1 to 16 (a decode token's heads padded to the 16 rows
# of a dot; several tokens' heads per tile in prefill), the small shape (C 64, R 16) by default and V3's
# (C 512, R 64) with -m slow (interpret mode's time on 2 cores).
MATRIX = [
    ("decode", 16, 4, "small", "float32", False),
    ("decode", 8, 16, "small", "bfloat16", False),
    ("prefill", 32, 1, "small", "float32", False),
    pytest.param("prefill", 8, 8, "small", "bfloat16", False, marks=pytest.mark.slow),
    ("mixed", 16, 2, "small", "bfloat16", True),
    ("mixed", 32, 16, "small", "float32", False),
    pytest.param("decode", 16, 16, "v3", "bfloat16", False, marks=pytest.mark.slow),
    pytest.param("mixed", 16, 8, "v3", "float32", False, marks=pytest.mark.slow),
]


def matrix_case(kind, block_size, num_heads, shape, dtype):
    """The matrix's padded bucket for these parameters (same seed, same case)."""
    rng = np.random.default_rng(block_size * 100 + num_heads)
    specs = SPECS[kind](rng, block_size)
    return padded_mla_case(rng, specs, block_size=block_size, num_heads=num_heads,
                           shape=shape, dtype=dtype)


@pytest.mark.parametrize("kind,block_size,num_heads,shape,dtype,bits", MATRIX)
def test_matrix(kind, block_size, num_heads, shape, dtype, bits):
    """Padded decode, prefill and mixed buckets with the default tiles (decode: one-token
    tiles with kv splits), lengths starting and ending mid-page, junk block tables."""
    check(matrix_case(kind, block_size, num_heads, shape, dtype), dtype, bits=bits)


LONG = [(1, 389), (150, 357), (1, 2), (1, 17), (60, 137), (1, 64)]

# Explicit tiles: (BlockSizes, head_block). One-token tiles split 4 ways over a long
# context; one page per chunk with tiles spanning sequences; several head blocks per token
# (N 32 in blocks of 8, two tokens per tile); more pages per chunk than most contexts.
TILES = [(BlockSizes(1, 2, kv_splits=4), None),
         pytest.param(BlockSizes(16, 1), None, marks=pytest.mark.slow),
         (BlockSizes(2, 4, kv_splits=2), 8),
         pytest.param(BlockSizes(32, 16, kv_splits=4), None, marks=pytest.mark.slow)]


@pytest.mark.parametrize("sizes,head_block", TILES, ids=str)
def test_tile_sizes(sizes, head_block):
    """Long and short contexts, prefill chunks and decodes in one bucket, under explicit
    tile sizes: all the same function."""
    rng = np.random.default_rng(sizes.q_tokens * sizes.pages_per_chunk)
    case = make_mla_case(rng, LONG, block_size=16, num_heads=32 if head_block else 4,
                         latent=64, rope=16, max_model_len=400, num_rows=8, num_tokens=256,
                         junk_tables=True)
    check(case, "float32", block_sizes=sizes, head_block=head_block)


@pytest.mark.parametrize("shape,dtype", [("small", "float32"),
                                         pytest.param("v3", "bfloat16",
                                                      marks=pytest.mark.slow)])
def test_long_decode_with_kv_splits(shape, dtype):
    """A decode bucket of one long context (and two short ones): the default tiles split
    each context over 16 programs (flash-decoding), merged outside the kernel; a split
    whose share of a short context is empty weighs nothing."""
    latent, _ = SHAPES[shape]
    sizes, head_block = gpu_mla.default_mla_block_sizes(8, 8, 16, 16, latent)
    assert sizes.q_tokens == 1 and sizes.kv_splits == 16 and head_block == 16
    rng = np.random.default_rng(7)
    specs = [(1, 1000), (1, 3), (1, 250)]
    case = padded_mla_case(rng, specs, block_size=16, num_heads=16, shape=shape,
                           dtype=dtype, max_model_len=1024, junk_tables=False)
    check(case, dtype)


def test_unreadable_nan_stays_out_and_readable_nan_shows():
    """The poison reaches the kernel: with NaN in the stale slots and foreign pages every
    output is finite (padding rows exactly zero), while NaN in one readable slot of one
    sequence turns that sequence's rows, and only them, to NaN. (The matrix's first decode
    bucket: same shapes, so the compiled kernel is reused.)"""
    case = matrix_case("decode", 16, 4, "small", "float32")
    got = check(case, "float32")
    q_latent, q_rope, cache, batch = case
    cache, dead = poison(cache, batch)
    tables = np.asarray(batch.block_tables)
    assert np.asarray(batch.kv_lens)[:2].tolist() == [1, 17]  # decode_specs' first two
    assert not dead[tables[0, 0], 0] and dead[tables[0, 0], 1:].all()  # stale slots
    assert not dead[tables[1, 1], 0] and dead[tables[1, 1], 1:].all()
    scale = mla_scale(*SHAPES["small"])
    bad = f64(KERNEL(q_latent, q_rope, cache.at[tables[1, 0], 3].set(jnp.nan), batch,
                     scale=scale))
    assert np.isnan(bad[1]).all()  # decode: token i is sequence i
    np.testing.assert_array_equal(np.delete(bad, 1, axis=0), np.delete(f64(got), 1, axis=0))


def test_supports_and_block_size_table():
    """Power-of-two widths >= 16 only; V3's tiles keep the accumulator at 32 x 512 and a
    chunk at 32 keys; decode buckets get one-token tiles, prefill ones several tokens."""
    assert gpu_mla.supports(512, 64) and gpu_mla.supports(64, 16)
    assert not gpu_mla.supports(576, 64) and not gpu_mla.supports(512, 8)
    decode, hb = gpu_mla.default_mla_block_sizes(256, 256, 16, 128, 512)
    assert (decode.q_tokens, decode.pages_per_chunk, decode.kv_splits, hb) == (1, 2, 1, 32)
    prefill, hb = gpu_mla.default_mla_block_sizes(1024, 8, 16, 16, 512)
    assert prefill.q_tokens * hb == 32 and prefill.q_tokens > 1
    small, hb = gpu_mla.default_mla_block_sizes(1024, 8, 16, 4, 64)
    assert small.q_tokens * hb == 256 and small.pages_per_chunk * 16 == 128
    rng = np.random.default_rng(0)
    case = make_mla_case(rng, [(1, 20)], block_size=16, num_heads=2, latent=48, rope=16)
    with pytest.raises(ValueError, match="power-of-two latent and rope"):
        gpu_mla.ragged_paged_mla(*case, scale=0.1, interpret=True)


# ----------------------------------------------------------------------------- lowering


def abstract_case(num_tokens, num_rows, num_heads, latent, rope, block_size, num_pages, width,
                  dtype):
    """Shape-only arguments of one bucket."""
    def sds(shape, dt=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dt)

    T, R = num_tokens, num_rows
    batch = Batch(sds((T,)), sds((T,)), sds((T,)), sds((R + 1,)), sds((R,)), sds((R, width)),
                  sds((1,)), sds((R,)))
    return (sds((T, num_heads, latent), dtype), sds((T, num_heads, rope), dtype),
            sds((num_pages, block_size, latent + rope), dtype), batch)


# (T, rows, N, C, R, S, P, B, dtype): V3's latent (C 512, R 64) with 16 heads (TP 8) and
# S 16 in a decode, a prefill and a mixed bucket, bf16; a one-sequence decode bucket (kv
# splits), 128 heads (head blocks), a page count that is no power of two, and float32.
LOWERING = [
    (256, 256, 16, 512, 64, 16, 4096, 128, "bfloat16"),
    (1024, 8, 16, 512, 64, 16, 4096, 128, "bfloat16"),
    (512, 64, 16, 512, 64, 16, 4096, 64, "bfloat16"),
    (16, 1, 128, 512, 64, 16, 3000, 2048, "bfloat16"),
    (256, 32, 16, 64, 16, 32, 1000, 64, "float32"),
]


@pytest.mark.parametrize("shape", LOWERING,
                         ids=lambda s: f"T{s[0]}-R{s[1]}-N{s[2]}-C{s[3]}-{s[8]}")
def test_lowers_for_cuda(shape):
    """Triton lowering of the real kernel (platform cuda), run here without a device."""
    *dims, dtype = shape
    args = abstract_case(*dims, jnp.dtype(dtype))
    fn = jax.jit(functools.partial(gpu_mla.ragged_paged_mla, scale=mla_scale(*dims[3:5])))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
    assert exported.out_avals[0].shape == args[0].shape
    assert exported.out_avals[0].dtype == args[0].dtype

