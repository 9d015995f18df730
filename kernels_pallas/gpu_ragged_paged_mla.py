"""Ragged paged multi-head latent attention (MLA, DeepSeek V2/V3) in its absorbed form, as a
Pallas GPU kernel (Triton lowering): mla_ref.py's function.

Shape letters here: T tokens, N query heads (Np: padded to a power of two), C latent width
(kv_lora_rank), R rope width (qk_rope_head_dim), P pages, S page size, B block-table width,
TQ query tokens per tile, Hb query heads per program (a head block), M = TQ * Hb rows of a
program, L = pages_per_chunk * S keys per inner step, X kv splits. (kernel_layout.py's C
and R, pages per chunk and batch rows, are spelled out below to avoid the clash.)

The cache holds one entry per token, [C + R], shared by every head: MLA is attention with a
single kv head that all N query heads read (GQA with G = N), and keys and values are the
same latent c. So the layout is the GPU MHA kernel's (gpu_ragged_paged_attention.py) with
the kv-head axis replaced by head blocks: the grid is (query tiles, head blocks, kv
splits), and a program's M rows are its TQ tokens x Hb heads (row = token * Hb + head, as
kernel_layout.group_queries lays them out with Np / Hb "kv heads" of Hb). Every page a
program gathers serves all its rows: a decode tile is one token whose Hb heads fill the
rows of each tensor-core dot (heads padded with zero queries to the 16 rows a dot needs),
so one sequence's pages are read once per head block, not once per head.

A program walks the same (sequence, chunk) cursor as the MHA kernels (kernel_layout's
TileWalk): each sequence with tokens in the tile, each chunk of pages those tokens can see.
A chunk's pages are gathered through the block table straight from the paged cache, as two
power-of-two loads of the same pages (Triton tensors must be): the latent [L, C] and the
rope keys [L, R] (static slices of the entry's last axis, C + R itself is not a power of
two). Scores [M, L] = q_latent [M, C] . c^T + q_rope [M, R] . k_r^T are two tensor-core
dots; the online softmax (float32) folds p [M, L] . c [L, C] into an [M, C] accumulator.
Latent rows at or past the sequence's kv_len are zeroed before both dots (stale slots of a
last page or pages past it may hold anything, NaN included, and 0 * NaN is NaN); masked
scores are replaced, not added to.

Decode-heavy buckets use one-token tiles and split each tile's context over X programs
(flash-decoding): each split writes its normalised partial output and (m, l), merged
outside the kernel with the log-sum-exp rule. Prefill-heavy buckets use several tokens per
tile and one split. The accumulator [M, C] and a chunk [L, C] live in registers, so the
tile table (default_mla_block_sizes) keeps M * C and L * C near MAX_TILE_ELEMENTS: for
V3's C = 512, 32 rows (Hb = 16 or 32 heads) and 32 keys per step, as Triton MLA decode
kernels use; for a small C, larger tiles.

Triton's tl.dot needs every dimension >= 16 and Pallas-Triton power-of-two tensors: C and
R must be powers of two >= 16 (supports(); V3's 512 / 64 and the tests' 64 / 16 both
are), and L = pages_per_chunk * S >= 16 on a GPU. N is padded to Np and to Hb as needed.

On the CPU the same code runs in Pallas interpret mode (interpret=True); a bfloat16 cache
may then be stored as its uint16 bits (ref.kv_storage_dtype), read back with ref.values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.kernels_pallas.kernel_layout import (
    MASK_VALUE,
    BlockSizes,
    TileWalk,
    default_block_sizes,
    group_queries,
    ungroup_output,
    zero_dead_keys,
)
from jaxserve.kernels_pallas.ref import values

TARGET_PROGRAMS = 264  # two waves on an H100/H200 (132 SMs), as the MHA kernel
MIN_DOT_ROWS = 16  # Triton's tl.dot needs every dimension >= 16
MAX_TILE_ELEMENTS = 16384  # M * C (the f32 accumulator) and L * C (a chunk) per program
MAX_KEYS_PER_CHUNK = 128


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def supports(latent: int, rope: int) -> bool:
    """Whether the kernel takes this latent width C and rope width R: Triton tiles are powers
    of two >= 16 (V3's 512 and 64 are). Any number of heads is taken (padded)."""
    return all(d >= MIN_DOT_ROWS and not d & (d - 1) for d in (latent, rope))


def default_mla_block_sizes(num_tokens: int, num_rows: int, block_size: int, num_heads: int,
                            latent: int) -> tuple[BlockSizes, int]:
    """(BlockSizes, Hb) for a static (T, rows) bucket: kernel_layout's tile table with the
    head blocks as its kv heads, rows capped so that M * C <= MAX_TILE_ELEMENTS (at least 16
    rows) and L * C near it (16..128 keys per chunk). Heads fill the rows before tokens do
    (a token's heads share every key and the causal mask); decode buckets get one-token
    tiles, Hb padded up to 16 rows, and kv splits while the grid is small."""
    max_rows = max(MIN_DOT_ROWS, MAX_TILE_ELEMENTS // latent)
    keys = min(MAX_KEYS_PER_CHUNK, max(MIN_DOT_ROWS, MAX_TILE_ELEMENTS // latent))
    heads_p = _pow2(num_heads)
    head_block = min(heads_p, max_rows)
    sizes = default_block_sizes(num_tokens, num_rows, block_size, min_rows=1,
                                max_tile_rows=max_rows, group_p=head_block,
                                num_kv_heads=heads_p // head_block,
                                target_programs=TARGET_PROGRAMS, keys_per_chunk=keys)
    return sizes, max(head_block, MIN_DOT_ROWS // sizes.q_tokens)


def ragged_paged_mla(q_latent, q_rope, cache, batch, *, scale: float, kv_dtype=None,
                     interpret: bool = False, block_sizes: BlockSizes | None = None,
                     head_block: int | None = None):
    """q_latent: [T, N, C]; q_rope: [T, N, R]; cache: [P, S, C + R] of kv_dtype values
    (default q_latent's dtype) or their bits (ref.kv_storage_dtype); returns [T, N, C] in
    q_latent's dtype (mla_ref.py's contract: padding tokens' rows are zeros).

    block_sizes / head_block (Hb, a power of two) override default_mla_block_sizes; Hb is
    raised so that a program has at least 16 rows."""
    num_tokens, num_heads, latent = q_latent.shape
    rope = q_rope.shape[-1]
    num_pages, block_size, entry = cache.shape
    num_rows, width = batch.block_tables.shape
    if entry != latent + rope:
        raise ValueError(f"Cache entries of {entry} values, expected C + R = {latent + rope}.")
    if not supports(latent, rope):
        raise ValueError(f"The GPU MLA kernel needs power-of-two latent and rope widths >= 16, "
                         f"got C={latent}, R={rope}; use the reference for this model.")
    sizes, default_head_block = default_mla_block_sizes(num_tokens, num_rows, block_size,
                                                        num_heads, latent)
    sizes = block_sizes or sizes
    tq, splits = sizes.q_tokens, sizes.kv_splits
    head_block = head_block or default_head_block
    if head_block & (head_block - 1):
        raise ValueError(f"head_block must be a power of two, got {head_block}.")
    head_block = max(head_block, MIN_DOT_ROWS // tq)
    chunk_len = sizes.pages_per_chunk * block_size
    if not interpret and chunk_len < MIN_DOT_ROWS:
        raise ValueError(f"A chunk of {chunk_len} keys is below the 16 a Triton dot needs; "
                         "raise pages_per_chunk.")
    heads_p = max(_pow2(num_heads), head_block)
    num_blocks = heads_p // head_block
    rows = tq * head_block
    num_tiles = -(-num_tokens // tq)

    def regroup(q):
        """[T, N, D] -> [Np / Hb, Tp * Hb, D]: heads padded to Np, tokens to Tp."""
        q = jnp.pad(q, ((0, 0), (0, heads_p - num_heads), (0, 0)))
        return group_queries(q, num_blocks, head_block, num_tiles * tq)

    ql, qr = regroup(q_latent), regroup(q_rope)
    kernel = functools.partial(
        _kernel, q_tokens=tq, head_block=head_block, pages_per_chunk=sizes.pages_per_chunk,
        width=width, num_rows=num_rows, splits=splits, scale=scale,
        kv_dtype=jnp.dtype(kv_dtype or q_latent.dtype))
    whole = pl.BlockSpec()  # the whole array: scalars and pages read by index
    part_spec = pl.BlockSpec((None, None, rows, latent), lambda qi, hb, sp: (sp, hb, qi, 0))
    stat_spec = pl.BlockSpec((None, None, rows), lambda qi, hb, sp: (sp, hb, qi))
    out_dtype = q_latent.dtype if splits == 1 else jnp.float32
    part, m, denom = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_blocks, splits),
        in_specs=[whole, whole, whole, whole,
                  pl.BlockSpec((None, rows, latent), lambda qi, hb, sp: (hb, qi, 0)),
                  pl.BlockSpec((None, rows, rope), lambda qi, hb, sp: (hb, qi, 0)),
                  whole],
        out_specs=[part_spec, stat_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct((splits,) + ql.shape, out_dtype),
                   jax.ShapeDtypeStruct((splits,) + ql.shape[:2], jnp.float32),
                   jax.ShapeDtypeStruct((splits,) + ql.shape[:2], jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4 if rows * latent <= 4096 else 8,
                                             num_stages=2),
        interpret=interpret,
        name="gpu_ragged_paged_mla",
    )(batch.cu_q_lens, batch.kv_lens, batch.block_tables.reshape(-1), batch.num_seqs,
      ql, qr, cache)
    out = part[0] if splits == 1 else _merge_splits(part, m, denom).astype(q_latent.dtype)
    return ungroup_output(out, num_tokens, heads_p, head_block)[:, :num_heads]


def _merge_splits(part, m, denom):
    """Combine the splits' normalised outputs part [X, Np / Hb, M', C] with their (m, l)
    [X, Np / Hb, M']: each weighs l * exp(m - max m); splits that saw no key weigh 0."""
    weight = denom * jnp.exp(m - m.max(axis=0))
    total = weight.sum(axis=0)
    merged = (weight[..., None] * part).sum(axis=0)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]


def _online_update(q_latent, q_rope, latent, rope_keys, mask, state, *, scale: float):
    """One flash step over a chunk: q_latent [M, C], q_rope [M, R], latent [L, C] (dead keys
    zeroed), rope_keys [L, R], mask bool[M, L]; state = (m f32[M, 1], l f32[M, 1],
    acc f32[M, C]). Masked keys get probability 0, so rows that see none keep their state."""
    m_prev, l_prev, acc = state
    precision = jax.lax.Precision.HIGHEST if q_latent.dtype == jnp.float32 else None
    contract = (((1,), (1,)), ((), ()))
    s = jax.lax.dot_general(q_latent, latent, contract, precision=precision,
                            preferred_element_type=jnp.float32)
    s += jax.lax.dot_general(q_rope, rope_keys, contract, precision=precision,
                             preferred_element_type=jnp.float32)
    s = jnp.where(mask, s * scale, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    pv = jax.lax.dot_general(p.astype(latent.dtype), latent, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
    return m_next, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def _kernel(cu_ref, kv_lens_ref, tables_ref, num_seqs_ref,  # i32[rows+1], [rows], [rows*B], [1]
            ql_ref, qr_ref,  # [M, C], [M, R]: this tile's rows of one head block
            cache_ref,  # [P, S, C + R]: the whole paged latent cache
            o_ref, m_ref, l_ref,  # [M, C] output (normalised by this split's l); f32[M] (m, l)
            *, q_tokens, head_block, pages_per_chunk, width, num_rows, splits, scale,
            kv_dtype):
    """One (query tile, head block, kv split) program: walk the tile's sequences and this
    split's share of each one's chunks, folding each chunk into the online softmax."""
    split = pl.program_id(2)
    block_size = cache_ref.shape[1]
    latent, rope = ql_ref.shape[1], qr_ref.shape[1]
    chunk_len = pages_per_chunk * block_size
    rows = ql_ref.shape[0]
    walk = TileWalk(cu_ref, kv_lens_ref, num_seqs_ref[0], num_rows,
                    pl.program_id(0) * q_tokens, q_tokens, chunk_len, None)
    q_latent, q_rope = ql_ref[...], qr_ref[...]

    def attend_chunk(s, c, state):
        """Gather chunk c of sequence s (two loads of the same pages) and fold it in."""
        index = jnp.minimum(c * pages_per_chunk + jnp.arange(pages_per_chunk), width - 1)
        pages = tables_ref[s * width + index]  # i32[pages_per_chunk]
        # Bits on the CPU become kv_dtype, then q's dtype for the dots.
        lat = values(cache_ref[pages, :, pl.ds(0, latent)], kv_dtype).astype(q_latent.dtype)
        key = values(cache_ref[pages, :, pl.ds(latent, rope)], kv_dtype).astype(q_rope.dtype)
        lat = zero_dead_keys(lat.reshape(chunk_len, latent), c, chunk_len, kv_lens_ref[s])
        return _online_update(q_latent, q_rope, lat, key.reshape(chunk_len, rope),
                              walk.mask(s, c, rows, head_block), state, scale=scale)

    state = (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
             jnp.zeros((rows, latent), jnp.float32))
    m, denom, acc = walk.run_split(split, splits, attend_chunk, state)
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)
    m_ref[...] = m[:, 0]
    l_ref[...] = denom[:, 0]
