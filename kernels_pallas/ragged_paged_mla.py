"""Ragged paged multi-head latent attention (MLA, DeepSeek V2/V3) as a Pallas TPU kernel, in the
absorbed form: mla_ref.py's function, the latent cache read page by page by DMA.

Shape letters: T query tokens, N query heads (Np: N padded to a power of two), C latent
width (kv_lora_rank: 512 for DeepSeek-V3), R rope dims (qk_rope_head_dim: 64), W = C + R the
width of one cache entry, P pages, S page size (tokens per page), B block-table width (pages
per row), TQ query tokens per tile, M = TQ * Np rows per tile, CP pages per chunk (L = CP * S
keys per inner step).

MLA caches one entry per token, [W] = [latent c | rope key k_r], shared by every head: a
single kv "head". So a program owns a query tile of TQ consecutive tokens of the ragged
batch with all N of their heads stacked as rows (row = token * Np + head, the queries
[q_latent | q_rope] concatenated and regrouped once outside the kernel, as kernel_layout.py's
group_queries does with one kv head), and every page it copies serves all M rows: a decode
token's N heads read its latent pages once, which is what the absorbed form buys on a TPU
(the MHA kernel reads K and V per kv head). The grid is the query tiles alone.

A program walks every sequence that has tokens in its tile and, for each, the chunks of CP
pages those tokens can see (up to the tile's last causal position), with kernel_layout.py's
TileWalk: a flat cursor (sequence, chunk), whose next chunk's pages are copied HBM -> VMEM
by async DMA (one whole [S, W] page each) into the other half of a double buffer while the
current chunk is computed. Block tables, query starts, context lengths and num_seqs are
scalar-prefetch arguments in SMEM.

Per chunk: scores [M, L] = scale * [q_latent | q_rope] . [c | k_r]^T, one MXU dot over the
whole entry width W with float32 accumulation (the two dot products of the score at once);
a mask (the row's token belongs to this sequence, key position <= query position, a page
that exists); then the online softmax update of (m, l, acc) in VMEM scratch, with the
values the entries' first C columns (acc f32[M, C]: the output stays in the latent space).
Rows of other sequences see only masked keys, so their probabilities are zero and their
state is unchanged. Pages past the sequence's last one are not copied; their stale buffer
slots (and stale slots past kv_len in its last page) are masked, and their values zeroed so
stale NaN bits cannot leak through 0 * NaN. After the last chunk out = acc / l; rows that
saw no key (padding tokens) come out 0, and the padding heads' rows are sliced away.

VMEM for V3 (bf16, S = 16, CP = 8, M = 256 at most): the page double buffer 2 * 8 * 16 * 576
* 2 B = 288 KiB, the query tile 288 KiB and output tile 256 KiB (each double-buffered by the
pipeline), acc 512 KiB and m, l 128 KiB each, plus the chunk's scores and probabilities
([M, L] f32, 128 KiB): a few MiB, inside every generation's default scoped VMEM.

A cache may hold kv_dtype's values or, on the CPU, their bits as unsigned integers of the
same width (ref.kv_storage_dtype): pages are copied as stored and read as kv_dtype in VMEM
(ref.values), then as q's dtype, exactly as ragged_paged_attention.py does. On the CPU the
same code runs in Pallas's TPU interpret mode (interpret=True), which simulates the DMAs
and semaphores and fills uninitialized VMEM with NaN; the tests compare it with a float64
oracle there and lower it for real TPUs (Mosaic) without a device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.kernels_pallas.kernel_layout import (
    MASK_VALUE,
    BlockSizes,
    TileRule,
    TileWalk,
    default_block_sizes,
    div,
    group_queries,
    online_update,
    padded_group,
    ungroup_output,
    zero_dead_keys,
)
from jaxserve.kernels_pallas.ref import values


def ragged_paged_mla(q_latent, q_rope, cache, batch, *, scale: float, kv_dtype=None,
                     interpret=False, block_sizes: BlockSizes | None = None,
                     tiling: TileRule | None = None):
    """q_latent: [T, N, C]; q_rope: [T, N, R]; cache: [P, S, C + R] of kv_dtype values
    (default q_latent's dtype) or their bits (ref.kv_storage_dtype); returns [T, N, C] in
    q_latent's dtype (mla_ref.py's contract: rows of padding tokens are zeros, never NaN).

    interpret: True (or a pltpu.InterpretParams) runs Pallas's TPU interpret mode, on the
    CPU. block_sizes: the tile (TQ tokens of all N heads) and CP pages per chunk; default
    kernel_layout.default_block_sizes for the (T, R) bucket under tiling (the TPU
    generation's TileRule, default TileRule())."""
    num_tokens, num_heads, latent = q_latent.shape
    rope = q_rope.shape[-1]
    _, block_size, entry = cache.shape
    if q_rope.shape[:2] != (num_tokens, num_heads) or entry != latent + rope:
        raise ValueError(f"q_latent {q_latent.shape}, q_rope {q_rope.shape} and cache "
                         f"{cache.shape} disagree: the cache's entries are [C + R].")
    num_rows, width = batch.block_tables.shape
    heads_p = padded_group(num_heads, 1)
    rule = tiling or TileRule()
    sizes = block_sizes or default_block_sizes(
        num_tokens, num_rows, block_size, min_rows=rule.min_rows,
        max_tile_rows=rule.max_tile_rows, group_p=heads_p, keys_per_chunk=rule.keys_per_chunk)
    tq = sizes.q_tokens
    num_tiles = -(-num_tokens // tq)
    rows = tq * heads_p
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)  # [T, N, W]
    q = group_queries(q, 1, heads_p, num_tiles * tq)[0]  # [Tp * Np, W]
    kernel = functools.partial(
        _kernel, q_tokens=tq, heads_p=heads_p, pages_per_chunk=sizes.pages_per_chunk,
        width=width, num_rows=num_rows, latent=latent, scale=scale,
        kv_dtype=jnp.dtype(kv_dtype or q_latent.dtype))
    if interpret is True:
        interpret = pltpu.InterpretParams()
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_tiles,),
            in_specs=[pl.BlockSpec((rows, entry), lambda qi, *_: (qi, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((rows, latent), lambda qi, *_: (qi, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, sizes.pages_per_chunk, block_size, entry), cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, latent), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((num_tiles * rows, latent), q_latent.dtype),
        # Tiles share nothing (each program copies its own pages): megacore may split them.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=rule.vmem_limit_bytes),
        interpret=interpret or False,
        name="ragged_paged_mla",
    )
    out = call(batch.cu_q_lens, batch.kv_lens, batch.block_tables.reshape(-1),
               batch.num_seqs, q, cache)
    return ungroup_output(out[None], num_tokens, num_heads, heads_p)


def _kernel(cu_ref, kv_lens_ref, tables_ref, num_seqs_ref,  # SMEM: i32[R+1], [R], [R*B], [1]
            q_ref,  # [M, W]: the tile's [q_latent | q_rope] rows
            cache_hbm,  # [P, S, W] in HBM
            o_ref,  # [M, C]
            buf,  # VMEM [2 (slot), CP, S, W] of the cache's dtype
            sems,  # DMA semaphores [2 (slot)]
            m_ref, l_ref,  # VMEM f32[M, 128], every lane equal
            acc_ref,  # VMEM f32[M, C]
            *, q_tokens, heads_p, pages_per_chunk, width, num_rows, latent, scale, kv_dtype):
    """One query tile: walk its sequences' chunks (double-buffered page DMAs), fold each into
    the online softmax, write out = acc / l."""
    block_size = buf.shape[2]
    chunk_len = pages_per_chunk * block_size
    walk = TileWalk(cu_ref, kv_lens_ref, num_seqs_ref[0], num_rows,
                    pl.program_id(0) * q_tokens, q_tokens, chunk_len, None)

    def copies(s, c, slot):
        """(page exists, its DMA) for each page of chunk c of sequence s."""
        num_pages = div(kv_lens_ref[s] + block_size - 1, block_size)
        for j in range(pages_per_chunk):
            index = c * pages_per_chunk + j
            page = tables_ref[s * width + jnp.minimum(index, width - 1)]
            yield index < num_pages, pltpu.make_async_copy(cache_hbm.at[page], buf.at[slot, j],
                                                           sems.at[slot])

    def start(s, c, slot):
        """Start the copies of chunk c of sequence s into buffer slot."""
        for exists, dma in copies(s, c, slot):
            _when(exists, dma, "start")

    def wait(s, c, slot):
        """Wait for the copies start(s, c, slot) began."""
        for exists, dma in copies(s, c, slot):
            _when(exists, dma, "wait")

    def compute(s, c, slot):
        """Fold chunk c of sequence s (in buffer slot) into (m, l, acc)."""
        entries = _entries(buf, slot, kv_dtype, q_ref.dtype, chunk_len)  # [L, W]
        latents = zero_dead_keys(entries[:, :latent], c, chunk_len, kv_lens_ref[s])  # [L, C]
        mask = walk.mask(s, c, q_ref.shape[0], heads_p)
        state = (m_ref[...][:, :1], l_ref[...][:, :1], acc_ref[...])
        m, denom, acc = online_update(q_ref[...], entries, latents, mask, state, scale=scale,
                                      soft_cap=None)
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(denom, l_ref.shape)
        acc_ref[...] = acc

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    walk.run_double_buffered(start, wait, compute)
    denom = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)


def _when(condition, dma, method: str):
    """Start (or wait for) the DMA if condition holds."""
    @pl.when(condition)
    def _():
        getattr(dma, method)()


def _entries(buf, slot, kv_dtype, dtype, chunk_len: int):
    """The chunk's entries [L, W] as dtype from buf [2, CP, S, W]: bits read as kv_dtype
    (ref.values), a narrower cache's values widened through float32."""
    pages = values(buf[slot], kv_dtype)  # [CP, S, W]
    if pages.dtype != dtype:
        pages = pages.astype(jnp.float32).astype(dtype)
    return pages.reshape(chunk_len, pages.shape[-1])
