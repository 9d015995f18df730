"""The MLA (latent attention) Pallas TPU kernel in interpret mode against the float64 oracle,
plus its lowering for real TPUs.

The matrix runs decode, prefill and mixed batches in padded (T, R) buckets (padding rows and
tokens, loud padding queries, junk block-table entries on some cases) over page sizes 8, 16
and 32, default and explicit tiles (one token per tile up to 16, one page per chunk up to
8), head counts that are and are not powers of two, float32, bfloat16 and a bfloat16 cache
stored as its uint16 bits (ref.kv_storage_dtype), each with NaN in every cache slot no
sequence may read. The small latent shape (C = 64, R = 16) runs by default; DeepSeek-V3's
(C = 512, R = 64) in interpret mode with -m slow, and in the lowering (Mosaic, platform "tpu"
on the CPU) for decode, prefill and mixed buckets of 16 heads per device.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from support.abstract_cases import abstract_mla_case
from support.attention_cases import SPECS, assert_close
from support.mla_cases import SHAPES, make_mla_case, numpy_mla

from jaxserve.kernels_pallas import mla_ref
from jaxserve.kernels_pallas.kernel_layout import BlockSizes
from jaxserve.kernels_pallas.ragged_paged_mla import ragged_paged_mla
from jaxserve.kernels_pallas.ref import kv_storage_dtype

JITTED = jax.jit(functools.partial(ragged_paged_mla, interpret=True),
                 static_argnames=("scale", "kv_dtype", "block_sizes"))


def mla_scale(latent: int, rope: int) -> float:
    """DeepSeek's softmax scale: 1 / sqrt(qk_head_dim), qk_head_dim = nope + rope dims
    (here the latent width stands in for the nope dims)."""
    return 1.0 / math.sqrt(latent + rope)


def padded_mla_case(rng, kind, block_size, num_heads, shape, dtype, junk_tables):
    """A padded (T, R) bucket of `kind`: num_seqs < R, 5 padding tokens with loud queries,
    lengths that start and end mid-page."""
    specs = SPECS[kind](rng, block_size)
    real = sum(q for q, _ in specs)
    latent, rope = SHAPES[shape]
    q_latent, q_rope, cache, batch = make_mla_case(
        rng, specs, block_size=block_size, num_heads=num_heads, latent=latent, rope=rope,
        dtype=dtype, num_rows=len(specs) + 3, num_tokens=real + 5, junk_tables=junk_tables)
    return q_latent.at[real:].mul(1e3), q_rope.at[real:].mul(1e3), cache, batch


def unread_slots(cache, batch):
    """bool[P, S]: the slots no real sequence may read: every page outside the real rows'
    first ceil(kv_len / S) block-table entries (the null page 0 and junk entries' pages
    included) and the slots past kv_len in each row's last page."""
    tables = np.asarray(batch.block_tables)
    kv_lens = np.asarray(batch.kv_lens)
    S = cache.shape[1]
    unread = np.ones(cache.shape[:2], bool)
    for row in range(int(np.asarray(batch.num_seqs)[0])):
        kv_len = int(kv_lens[row])
        pages = tables[row, :-(-kv_len // S)]
        unread[pages[:-1]] = False
        unread[pages[-1], :kv_len - (len(pages) - 1) * S] = False
    return unread


def poison(cache, batch):
    """NaN in every slot of unread_slots: a kernel that weighs one shows NaN."""
    return jnp.where(jnp.asarray(unread_slots(cache, batch))[:, :, None], jnp.nan, cache)


def check(case, dtype, *, block_sizes=None, bits=False):
    """The kernel on a poisoned copy of the case's cache against the float64 oracle on the
    clean one. bits: the cache as its unsigned-integer bits, read as dtype (kv_dtype)."""
    q_latent, q_rope, cache, batch = case
    scale = mla_scale(q_latent.shape[-1], q_rope.shape[-1])
    want = numpy_mla(q_latent, q_rope, cache, batch, scale=scale)
    cache = poison(cache, batch)
    kv_dtype = None
    if bits:
        kv_dtype = jnp.dtype(dtype)
        cache = jax.lax.bitcast_convert_type(cache, kv_storage_dtype(kv_dtype, "cpu"))
    got = JITTED(q_latent, q_rope, cache, batch, scale=scale, kv_dtype=kv_dtype,
                 block_sizes=block_sizes)
    assert got.shape == q_latent.shape and got.dtype == q_latent.dtype
    assert_close(got, want, batch, dtype)


# (kind, page size S, heads N, dtype, tiles, junk tables); "bits": a bf16 cache stored as
# uint16. None: the default tiles (one token per tile for decode buckets, 16 for prefill).
# Each case compiles its own interpreter (~3 s): three run with -m slow (the suite's budget).
MATRIX = [
    ("decode", 16, 16, "float32", None, True),
    ("decode", 8, 8, "bfloat16", BlockSizes(1, 4), False),
    ("decode", 32, 3, "bits", BlockSizes(4, 1), True),
    ("prefill", 16, 4, "bfloat16", None, False),
    ("prefill", 32, 8, "float32", BlockSizes(16, 2), True),
    pytest.param("prefill", 8, 2, "float32", BlockSizes(8, 8), False, marks=pytest.mark.slow),
    ("mixed", 16, 4, "bfloat16", BlockSizes(8, 2), True),
    pytest.param("mixed", 32, 16, "float32", None, False, marks=pytest.mark.slow),
    pytest.param("mixed", 8, 5, "bits", BlockSizes(2, 4), True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,block_size,num_heads,dtype,sizes,junk", MATRIX,
                         ids=lambda x: str(x) if not isinstance(x, BlockSizes)
                         else f"tq{x.q_tokens}-cp{x.pages_per_chunk}")
def test_matrix(kind, block_size, num_heads, dtype, sizes, junk):
    """Small latent (C = 64, R = 16) in padded buckets, NaN in every unread slot."""
    rng = np.random.default_rng(block_size * num_heads + len(kind))
    real_dtype = "bfloat16" if dtype == "bits" else dtype
    case = padded_mla_case(rng, kind, block_size, num_heads, "small", real_dtype, junk)
    check(case, real_dtype, block_sizes=sizes, bits=dtype == "bits")


@pytest.mark.slow
@pytest.mark.parametrize("kind,block_size,dtype,sizes", [
    ("decode", 16, "bfloat16", None),
    ("prefill", 16, "float32", BlockSizes(8, 2)),
    ("mixed", 32, "bfloat16", None),
], ids=str)
def test_v3_shape(kind, block_size, dtype, sizes):
    """DeepSeek-V3's latent (C = 512, R = 64), 16 heads (one device's share of 128 at TP 8)."""
    rng = np.random.default_rng(len(kind) * block_size)
    case = padded_mla_case(rng, kind, block_size, 16, "v3", dtype, True)
    check(case, dtype, block_sizes=sizes)


def test_nan_in_unreadable_slots_stays_out():
    """NaN in the null page 0, in pages the padding rows' tables and junk entries point at,
    and in the stale slots past kv_len in each sequence's last page; tiles that span
    several sequences and chunks that run past a sequence's last page (their buffer slots
    are never copied, and interpret mode fills uninitialized VMEM with NaN)."""
    rng = np.random.default_rng(7)
    specs = [(1, 37), (20, 45), (1, 3), (9, 9), (1, 70)]
    case = make_mla_case(rng, specs, block_size=16, num_heads=4, latent=64, rope=16,
                         num_rows=8, num_tokens=40, max_model_len=128)
    unread = unread_slots(case[2], case[3])
    assert unread[0].all()  # the null page, where the padding rows' tables point
    assert not unread[np.asarray(case[3].block_tables)[0, 2], :5].any()  # 37 = 2 * 16 + 5
    assert unread[np.asarray(case[3].block_tables)[0, 2], 5:].all()
    check(case, "float32", block_sizes=BlockSizes(8, 4))


@pytest.mark.slow
def test_reference_agrees_with_the_oracle():
    """mla_ref.py (the definition) against the float64 oracle on the same padded bucket the
    kernel sees, so a disagreement between kernel and oracle points at the kernel."""
    rng = np.random.default_rng(11)
    q_latent, q_rope, cache, batch = padded_mla_case(rng, "mixed", 16, 4, "small", "float32",
                                                     True)
    scale = mla_scale(64, 16)
    want = numpy_mla(q_latent, q_rope, cache, batch, scale=scale)
    assert_close(mla_ref.ragged_paged_mla(q_latent, q_rope, cache, batch, scale=scale), want,
                 batch, "float32")


def test_refuses_mismatched_entry_width():
    rng = np.random.default_rng(0)
    q_latent, q_rope, cache, batch = make_mla_case(rng, [(1, 5)], block_size=8, num_heads=2,
                                                   latent=64, rope=16)
    with pytest.raises(ValueError, match=r"\[C \+ R\]"):
        ragged_paged_mla(q_latent, q_rope[..., :8], cache, batch, scale=0.1, interpret=True)


# ----------------------------------------------------------------------------- lowering


# (T, R, N, S, P, B, dtype): V3 buckets of 16 heads per device: decode (one token per row),
# prefill (a few long chunks), mixed; pages of 16 and 64 tokens.
LOWERING = {
    "decode": (256, 256, 16, 16, 4096, 128, "bfloat16"),
    "prefill": (1024, 8, 16, 64, 1024, 64, "bfloat16"),
    "mixed": (512, 64, 16, 16, 4096, 128, "bfloat16"),
}


def _export_for_tpu(dims, **options):
    """jax.export of the kernel for platform "tpu": Pallas's Mosaic lowering, on the CPU."""
    *dims, dtype = dims
    args = abstract_mla_case(*dims, jnp.dtype(dtype))
    fn = jax.jit(functools.partial(ragged_paged_mla, scale=mla_scale(512, 64), **options))
    return args, export.export(fn, platforms=["tpu"])(*args)


@pytest.mark.parametrize("bucket", sorted(LOWERING))
def test_lowers_for_the_tpu(bucket):
    """Mosaic lowering of the real kernel for V3's latent (C = 512, R = 64), without a device."""
    args, exported = _export_for_tpu(LOWERING[bucket])
    assert "tpu_custom_call" in exported.mlir_module()
    assert exported.out_avals[0].shape == args[0].shape
    assert exported.out_avals[0].dtype == args[0].dtype


# libtpu's compile-only TPU targets run Mosaic's real compiler (layouts, DMA shapes, VMEM)
# on the CPU; see test_pallas_kernels.py (`PYTHONPATH=<a folder holding libtpu> pytest -m
# slow -k libtpu`).
@pytest.mark.slow
@pytest.mark.parametrize("bucket", sorted(LOWERING))
def test_compiles_with_libtpu(bucket):
    """Every lowering bucket through Mosaic's compiler for TPU v6e."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    device = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x2").devices[0]
    placed = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    *dims, dtype = LOWERING[bucket]
    args = abstract_mla_case(*dims, jnp.dtype(dtype))
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), args)
    fn = jax.jit(functools.partial(ragged_paged_mla, scale=mla_scale(512, 64)))
    fn.lower(*args).compile()
