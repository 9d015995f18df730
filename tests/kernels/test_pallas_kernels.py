"""The Pallas kernels (TPU-style and GPU-style) in interpret mode against the float64 oracle,
on the issue's matrix, plus their lowering for real TPUs and CUDA GPUs.

test_ref_attention.py already runs both kernels through every shared case (long contexts,
sliding window, soft cap, padding, one trace per bucket, write-then-attend). This file adds
what only kernels have: GQA ratios 1/2/4/8 x head_dim 64/128 x block size 16/32 x float32/
bfloat16 on decode, prefill and mixed batches, explicit tile sizes, caches whose unused
pages hold NaN, and the Mosaic (TPU) and Triton (CUDA) lowering, which runs on the CPU and
rejects what the hardware compilers would not take (shapes, ops, memory spaces).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from support.abstract_cases import abstract_case
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

from jaxserve.config.accelerators import ACCELERATORS
from jaxserve.kernels_pallas import gpu_ragged_paged_attention, ragged_paged_attention
from jaxserve.kernels_pallas.kernel_layout import BlockSizes, TileRule, default_block_sizes

KERNELS = {"tpu": ragged_paged_attention.ragged_paged_attention,
           "gpu": gpu_ragged_paged_attention.ragged_paged_attention}
JITTED = {name: jax.jit(functools.partial(fn, interpret=True),
                        static_argnames=("scale", "sliding_window", "soft_cap", "block_sizes"))
          for name, fn in KERNELS.items()}


@pytest.fixture(params=sorted(KERNELS))
def kernel(request):
    return request.param


def poison_unused_pages(k_cache, v_cache, batch):
    """NaN in every page no real sequence owns (the null page and junk table entries
    included): a kernel that reads or weighs one of them shows NaN."""
    tables = np.asarray(batch.block_tables)
    kv_lens = np.asarray(batch.kv_lens)
    used = np.zeros(k_cache.shape[0], bool)
    for row in range(int(np.asarray(batch.num_seqs)[0])):
        used[tables[row, :-(-int(kv_lens[row]) // k_cache.shape[1])]] = True
    mask = jnp.asarray(~used)[:, None, None, None]
    return jnp.where(mask, jnp.nan, k_cache), jnp.where(mask, jnp.nan, v_cache)


def check(kernel, case, dtype, block_sizes=None, **kw):
    q, k_cache, v_cache, batch = case
    kw.setdefault("scale", 1.0 / math.sqrt(q.shape[-1]))
    want = numpy_attention(q, k_cache, v_cache, batch, **kw)
    k_cache, v_cache = poison_unused_pages(k_cache, v_cache, batch)
    got = JITTED[kernel](q, k_cache, v_cache, batch, block_sizes=block_sizes, **kw)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, want, batch, dtype)


@pytest.mark.parametrize("kind,block_size,ratio,head_dim,dtype", MATRIX)
def test_matrix(kind, block_size, ratio, head_dim, dtype, kernel):
    """A padded (T, R) bucket: num_seqs < R, padding tokens with loud queries, junk block
    table entries and NaN in every unused page; lengths start and end mid-block."""
    rng = np.random.default_rng(MATRIX.index((kind, block_size, ratio, head_dim, dtype)))
    check(kernel, padded_case(rng, kind, block_size, ratio, head_dim, dtype), dtype)


@pytest.mark.parametrize("kind,window,dtype", kernel_sink_cases())
def test_attention_sinks(kind, window, dtype, kernel):
    """GPT-OSS's sinks on decode, prefill, mixed and windowed padded buckets, NaN in every
    unused page; GQA 4 (padding heads' rows carry no sink)."""
    rng = np.random.default_rng(SINK_CASES.index((kind, window, dtype)))
    case = padded_case(rng, kind, 16, 3, 64, dtype)
    check(kernel, case, dtype, sinks=random_sinks(rng, case[0].shape[1]),
          sliding_window=window)


@pytest.mark.parametrize("kernel,sizes", [
    pytest.param("tpu", BlockSizes(64, 16), marks=pytest.mark.slow),
    ("gpu", BlockSizes(1, 8, kv_splits=2)),
    pytest.param("gpu", BlockSizes(32, 4, kv_splits=4), marks=pytest.mark.slow)],
                         ids=lambda x: str(x))
def test_attention_sinks_across_tiles_and_splits(kernel, sizes):
    """A sink counted once when a query's keys are split over programs (flash-decoding) and
    when a tile holds several sequences."""
    rng = np.random.default_rng(sizes.kv_splits)
    specs = [(1, 389), (150, 357), (1, 2), (1, 17), (60, 137), (1, 64)]
    case = make_case(rng, specs, block_size=16, num_kv_heads=2, num_heads=6, head_dim=64,
                     max_model_len=400, num_rows=8, num_tokens=256, junk_tables=True)
    check(kernel, case, "float32", block_sizes=sizes, sliding_window=128,
          sinks=random_sinks(rng, 6))


# TPU tiles hold >= 8 rows (sublanes); the GPU's one-token decode tiles are its own.
# The smallest TPU tiles run the most interpreted grid steps: -m slow (the suite's budget).
TILES = [pytest.param("tpu", BlockSizes(8, 2), marks=pytest.mark.slow),
         ("tpu", BlockSizes(64, 16)),
         ("gpu", BlockSizes(1, 8, kv_splits=2)), ("gpu", BlockSizes(16, 1)),
         ("gpu", BlockSizes(32, 4, kv_splits=4))]

@pytest.mark.parametrize("kernel,sizes", TILES, ids=lambda x: str(x))
def test_tile_sizes(kernel, sizes):
    """Tiles spanning several sequences, one page per chunk or more pages than a context,
    context split over programs (GPU): all the same function."""
    rng = np.random.default_rng(sizes.q_tokens * sizes.pages_per_chunk)
    specs = [(1, 389), (150, 357), (1, 2), (1, 17), (60, 137), (1, 64)]
    case = make_case(rng, specs, block_size=16, num_kv_heads=2, num_heads=6, head_dim=64,
                     max_model_len=400, num_rows=8, num_tokens=256, junk_tables=True)
    check(kernel, case, "float32", block_sizes=sizes, sliding_window=100, soft_cap=30.0)


def test_block_size_table():
    """Decode buckets get the smallest tile that fills the rows; prefill buckets big tiles;
    the GPU splits small batches' contexts, never a full one's."""
    decode = default_block_sizes(256, 256, 16, group_p=8)
    assert decode.q_tokens == 1 and decode.kv_splits == 1
    assert default_block_sizes(1024, 8, 16, group_p=4).q_tokens == 64
    single = default_block_sizes(16, 1, 16, min_rows=16, group_p=8, num_kv_heads=8,
                                 target_programs=264)
    assert single.kv_splits == 16
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(q_tokens=3, pages_per_chunk=8)


def test_gpu_kernel_refuses_a_head_dim_triton_cannot_tile():
    rng = np.random.default_rng(0)
    case = make_case(rng, [(1, 20)], block_size=16, num_kv_heads=1, num_heads=1, head_dim=80)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        KERNELS["gpu"](*case, scale=0.125, interpret=True)


# ----------------------------------------------------------------------------- lowering


# (T, R, N, K, H, S, P, B, dtype, options): decode, mixed and prefill buckets, GQA 8:1 and
# 3:1 (padded to 4), bf16 and f32, window and soft cap, attention sinks, fp8 and int8 caches
# (kv_dtype: the cache's dtype; kv_cache_dtype, kv_quant.py).
LOWERING = [
    (256, 256, 32, 4, 128, 16, 4096, 128, "bfloat16", {}),
    (256, 256, 32, 4, 128, 16, 4096, 128, "bfloat16", {"kv_dtype": jnp.float8_e4m3fn}),
    (512, 64, 32, 8, 128, 32, 1024, 64, "bfloat16", {"kv_dtype": jnp.int8}),
    (16, 1, 32, 4, 128, 16, 4096, 2048, "bfloat16", {}),
    (512, 64, 32, 8, 128, 32, 1024, 64, "bfloat16", {"sliding_window": 256, "soft_cap": 30.0}),
    (1024, 8, 12, 4, 64, 16, 1024, 128, "float32", {}),
    # GPT-OSS's attention: 64 heads of 64 over 8 kv heads, a 128-token window, sinks
    (512, 64, 64, 8, 64, 16, 1024, 64, "bfloat16", {"sliding_window": 128, "sinks": True}),
]


@pytest.mark.parametrize("platform,kernel_name", [("tpu", "tpu"), ("cuda", "gpu")])
@pytest.mark.parametrize("shape", LOWERING, ids=lambda s: f"T{s[0]}-R{s[1]}-{s[8]}" + (
    f"-{jnp.dtype(s[9]['kv_dtype']).name}" if "kv_dtype" in s[9] else ""))
def test_lowers_for_the_hardware(platform, kernel_name, shape):
    """Mosaic (TPU) or Triton (CUDA) lowering of the real kernel, run here without a device."""
    *dims, dtype, options = shape
    args = abstract_case(*dims, jnp.dtype(dtype))
    if "kv_dtype" in options:  # a quantized cache: one-byte values
        cache = jax.ShapeDtypeStruct(args[1].shape, options["kv_dtype"])
        args = (args[0], cache, cache, args[3])
    head_dim = dims[4]
    if options.get("sinks"):  # f32[N]
        options = {**options, "sinks": jnp.zeros((dims[2],), jnp.float32)}
    fn = jax.jit(functools.partial(KERNELS[kernel_name], scale=1 / math.sqrt(head_dim),
                                   **options))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = export.export(fn, platforms=[platform], disabled_checks=checks)(*args)
    module = exported.mlir_module()
    target = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
    assert target in module
    assert exported.out_avals[0].shape == args[0].shape


# ------------------------------------------------------------ lowering per TPU generation
# What JAX checks without the chip: jax.export takes a platform ("tpu"), never a generation.
# Pallas's Python lowering reads the generation only from an AbstractMesh's AbstractDevice
# (jax.sharding.use_abstract_mesh), and only for a few ops this kernel does not use: its
# exported module is byte-identical under every generation's device (checked by hand with
# JAX 0.10.2). Only the tiles and VMEM budget of config/accelerators.py differ, so the test
# below lowers each generation's tiles under its device. The generation's own compiler
# (Mosaic in libtpu: MXU dtypes, tiled layouts, DMA sizes, the VMEM budget) runs on the CPU
# only through libtpu's compile-only TPU targets (jax.experimental.topologies), which the
# -m slow test after it uses when libtpu is installed (the [tpu] extra's libtpu==0.0.42.*;
# `PYTHONPATH=<a folder holding libtpu> pytest -m slow -k libtpu` without installing it
# into the environment, where it would make every jax start-up probe for a TPU).

GENERATIONS = [row for row in ACCELERATORS if row.platform == "tpu"]
KERNEL_GENERATIONS = [row for row in GENERATIONS if row.kernel]


def _one_per_tiling(rows):
    """Each row as a param; rows whose tiles an earlier row already has run with -m slow."""
    seen = set()
    for row in rows:
        marks = [pytest.mark.slow] if row.tiles in seen else []
        seen.add(row.tiles)
        yield pytest.param(row, marks=marks, id=row.name.replace(" ", "-"))


def _tiling(row) -> TileRule:
    return TileRule(**dataclasses.asdict(row.tiles))


@pytest.mark.parametrize("row", list(_one_per_tiling(KERNEL_GENERATIONS)))
def test_lowers_with_each_generation_tiles(row):
    device = jax.sharding.AbstractDevice(device_kind=row.device_kinds[0], num_cores=1,
                                         platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    args = abstract_case(256, 256, 32, 4, 128, 16, 4096, 128, jnp.bfloat16)
    fn = jax.jit(functools.partial(KERNELS["tpu"], scale=1 / math.sqrt(128),
                                   tiling=_tiling(row)))
    with jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(fn, platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()


# generation -> a compile-only topology of libtpu (its first device is compiled for)
TOPOLOGIES = {"TPU v2": "v2:2x2", "TPU v3": "v3:2x2", "TPU v4": "v4:2x2x1",
              "TPU v5e": "v5e:2x2", "TPU v5p": "v5p:2x2x1", "TPU v6e": "v6e:2x2",
              "TPU v7x": "tpu7x:2x2x1"}


def _compile_with_libtpu(row, args, **options):
    """Mosaic's real compile of the TPU kernel for the generation of `row`, on the CPU."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    topology = topologies.get_topology_desc(platform="tpu",
                                            topology_name=TOPOLOGIES[row.name])
    device = topology.devices[0]
    assert device.device_kind in row.device_kinds
    placed = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), args)
    fn = jax.jit(functools.partial(KERNELS["tpu"], scale=1 / math.sqrt(args[0].shape[-1]),
                                   tiling=_tiling(row) if row.tiles else None, **options))
    return fn.lower(*args).compile()


# 4 kv heads: a bf16 cache's page copies bring two heads (its HBM tiles pack two rows of
# the kv-head dimension per sublane, and a copy may only start on such a boundary).
@pytest.mark.slow
@pytest.mark.parametrize("row, dtype", [
    pytest.param(row, dtype, id=f"{row.name.replace(' ', '-')}-{dtype}")
    for row in GENERATIONS for dtype in ("float32", "bfloat16")])
def test_compiles_for_each_generation_with_libtpu(row, dtype):
    """The kernel compiles where the table says it runs (with the generation's tiles) and
    is refused on v2 and v3."""
    args = abstract_case(256, 256, 32, 4, 128, 16, 4096, 128, jnp.dtype(dtype))
    if row.kernel:
        _compile_with_libtpu(row, args)
    else:
        with pytest.raises(Exception, match="Mosaic failed to compile"):
            _compile_with_libtpu(row, args)


@pytest.mark.slow
@pytest.mark.parametrize("shape", LOWERING, ids=lambda s: f"T{s[0]}-K{s[3]}-H{s[4]}-{s[8]}" + (
    f"-{jnp.dtype(s[9]['kv_dtype']).name}" if "kv_dtype" in s[9] else ""))
def test_lowering_cases_compile_with_libtpu(shape):
    """Every case of the lowering test through Mosaic's compiler (TPU v6e): one, two and
    four kv heads per page copy (f32, bf16, one-byte caches), head_dim 64, windows, sinks."""
    *dims, dtype, options = shape
    args = abstract_case(*dims, jnp.dtype(dtype))
    if "kv_dtype" in options:
        cache = jax.ShapeDtypeStruct(args[1].shape, options["kv_dtype"])
        args = (args[0], cache, cache, args[3])
    if options.get("sinks"):
        options = {**options, "sinks": jnp.zeros((dims[2],), jnp.float32)}
    _compile_with_libtpu(next(r for r in GENERATIONS if r.name == "TPU v6e"), args, **options)
