"""Ragged paged attention as a Pallas TPU kernel: ref.py's function, K/V read page by page by DMA.

The grid is (K kv heads, query tiles). A program owns TQ consecutive tokens of the ragged
batch for one kv head (M = TQ * Gp rows, see kernel_layout.py). It walks every sequence that
has tokens in its tile, and for each one the chunks of C pages that those tokens can see
(up to the tile's last causal position, from the sliding window's start): a flat cursor
(sequence, chunk), whose next chunk's pages are copied HBM -> VMEM by async DMA into the
other half of a double buffer while the current chunk is computed. A page copy brings G kv
heads (_heads_per_copy: 2 of a bf16 cache, 4 of a one-byte cache, whose HBM tiles pack that
many kv-head rows per sublane, and a DMA may only start on a tile boundary; Mosaic refuses
a single head's slice there), of which the program takes its own in VMEM. Block tables, query
starts, context lengths and num_seqs are scalar-prefetch arguments in SMEM.

Per chunk: scores [M, L] = q . k^T on the MXU with float32 accumulation, soft cap, a mask
(the row's token belongs to this sequence, key position <= query position, inside the
window, and a page that exists), then the online softmax update of (m, l, acc) in VMEM
scratch. Rows of other sequences see only masked keys, so their probabilities are zero and
their state is unchanged. Pages past the sequence's last one are not copied; their stale
buffer slots are masked, and their values zeroed so stale NaN bits cannot leak through 0 *
NaN. After the last chunk, out = acc / l; rows that saw no key (padding) come out 0.
Attention sinks (ref.py) come as one more VMEM input, each row's sink across its lanes,
from which (m, l) start instead of (MASK_VALUE, 0).

On the CPU the same code runs in Pallas's TPU interpret mode (interpret=True), which
simulates the DMAs and semaphores; the tests compare it with ref.py there.
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
    sink_rows,
    ungroup_output,
    zero_dead_keys,
)
from jaxserve.kernels_pallas.ref import values


def ragged_paged_attention(q, k_cache, v_cache, batch, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks=None, kv_dtype=None, interpret: bool = False,
                           block_sizes: BlockSizes | None = None,
                           tiling: TileRule | None = None):
    """q: [T, N, H]; k_cache, v_cache: [P, S, K, H] of kv_dtype values (default q's dtype)
    or their bits; sinks: f32[N] or None; returns [T, N, H] (ref.py's contract).
    tiling: the TPU generation's tile rule and VMEM budget (default TileRule()); block_sizes
    overrides its tiles for this call."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_rows, width = batch.block_tables.shape
    group_p = padded_group(num_heads, num_kv_heads)
    rule = tiling or TileRule()
    sizes = block_sizes or default_block_sizes(
        num_tokens, num_rows, block_size, min_rows=rule.min_rows,
        max_tile_rows=rule.max_tile_rows, group_p=group_p, keys_per_chunk=rule.keys_per_chunk)
    tq = sizes.q_tokens
    num_tiles = -(-num_tokens // tq)
    qg = group_queries(q, num_kv_heads, group_p, num_tiles * tq)  # [K, Tp*Gp, H]
    rows = tq * group_p
    kernel = functools.partial(
        _kernel, q_tokens=tq, group_p=group_p, pages_per_chunk=sizes.pages_per_chunk,
        width=width, num_rows=num_rows, scale=scale, sliding_window=sliding_window,
        soft_cap=soft_cap, has_sinks=sinks is not None, kv_dtype=jnp.dtype(kv_dtype or q.dtype))
    tile = pl.BlockSpec((None, rows, head_dim), lambda kh, qi, *_: (kh, qi, 0))
    in_specs = [tile, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    inputs = [qg, k_cache, v_cache]
    if sinks is not None:  # [K, M, 128]: the same block for every query tile of a kv head
        in_specs.append(pl.BlockSpec((None, rows, 128), lambda kh, qi, *_: (kh, 0, 0)))
        inputs.append(jnp.broadcast_to(sink_rows(sinks, num_kv_heads, group_p, tq)[..., None],
                                       (num_kv_heads, rows, 128)))
    heads = _heads_per_copy(num_kv_heads, k_cache.dtype)
    buffer = pltpu.VMEM((2, sizes.pages_per_chunk, block_size, heads, head_dim), k_cache.dtype)
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_kv_heads, num_tiles),
            in_specs=in_specs,
            out_specs=tile,
            scratch_shapes=[buffer, buffer, pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((rows, 128), jnp.float32),
                            pltpu.VMEM((rows, 128), jnp.float32),
                            pltpu.VMEM((rows, head_dim), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=rule.vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention",
    )
    out = call(batch.cu_q_lens, batch.kv_lens, batch.block_tables.reshape(-1),
               batch.num_seqs, *inputs)
    return ungroup_output(out, num_tokens, num_heads, group_p)


def _kernel(cu_ref, kv_lens_ref, tables_ref, num_seqs_ref,  # SMEM: i32[R+1], [R], [R*B], [1]
            q_ref,  # [M, H]
            k_hbm, v_hbm,  # [P, S, K, H] in HBM
            *refs,  # (sink_ref f32[M, 128] if has_sinks), then the output and scratch:
            # o_ref [M, H]; k_buf, v_buf VMEM [2, C, S, G, H]; sems: DMA semaphores [2 (k, v),
            # 2 (slot)]; m_ref, l_ref VMEM f32[M, 128], every lane equal; acc_ref f32[M, H]
            q_tokens, group_p, pages_per_chunk, width, num_rows, scale, sliding_window,
            soft_cap, has_sinks, kv_dtype):
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
    kv_head = pl.program_id(0)
    block_size, heads = k_buf.shape[2], k_buf.shape[3]
    # The first of the G kv heads each page copy brings (0 when G = K: all of them).
    first_head = 0 if heads == k_hbm.shape[2] else div(kv_head, heads) * heads
    chunk_len = pages_per_chunk * block_size
    walk = TileWalk(cu_ref, kv_lens_ref, num_seqs_ref[0], num_rows, pl.program_id(1) * q_tokens,
                    q_tokens, chunk_len, sliding_window)

    def copies(s, c, slot):
        """(page exists, its K and V DMAs) for each page of chunk c of sequence s."""
        num_pages = div(kv_lens_ref[s] + block_size - 1, block_size)
        for j in range(pages_per_chunk):
            index = c * pages_per_chunk + j
            page = tables_ref[s * width + jnp.minimum(index, width - 1)]
            yield index < num_pages, (
                pltpu.make_async_copy(k_hbm.at[page, :, pl.ds(first_head, heads), :],
                                      k_buf.at[slot, j], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[page, :, pl.ds(first_head, heads), :],
                                      v_buf.at[slot, j], sems.at[1, slot]))

    def start(s, c, slot):
        for exists, pair in copies(s, c, slot):
            _when(exists, pair, "start")

    def wait(s, c, slot):
        for exists, pair in copies(s, c, slot):
            _when(exists, pair, "wait")

    def compute(s, c, slot):
        # Bits on the CPU; a quantized cache's one-byte values become q's dtype here.
        k = _own_head(k_buf, slot, kv_head - first_head, kv_dtype, q_ref.dtype, chunk_len)
        v = _own_head(v_buf, slot, kv_head - first_head, kv_dtype, q_ref.dtype, chunk_len)
        v = zero_dead_keys(v, c, chunk_len, kv_lens_ref[s])
        mask = walk.mask(s, c, q_ref.shape[0], group_p)
        state = (m_ref[...][:, :1], l_ref[...][:, :1], acc_ref[...])
        m, denom, acc = online_update(q_ref[...], k, v, mask, state, scale=scale,
                                      soft_cap=soft_cap)
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(denom, l_ref.shape)
        acc_ref[...] = acc

    if has_sinks:  # the sinks' term first: m = sink, l = 1
        m_ref[...] = sink_ref[...]
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    else:
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    walk.run_double_buffered(start, wait, compute)
    denom = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)


def _when(condition, dmas, method: str):
    """Start (or wait for) the DMAs if condition holds."""
    @pl.when(condition)
    def _():
        for dma in dmas:
            getattr(dma, method)()


def _heads_per_copy(num_kv_heads: int, dtype) -> int:
    """G: the kv heads one page copy brings. The cache's tiled HBM layout packs
    4 / itemsize rows of its second-minor dimension (K) per sublane, and a DMA may only
    start a slice of it on such a boundary: a bf16 cache is copied two heads at a time, a
    one-byte cache four (all K heads when K is not a multiple of that)."""
    pack = max(1, 4 // jnp.dtype(dtype).itemsize)
    return pack if num_kv_heads % pack == 0 else num_kv_heads


def _own_head(buf, slot, index, kv_dtype, dtype, chunk_len: int):
    """The program's kv head (index of G in the copied pages), [L, H] of dtype, from
    buf [2, C, S, G, H]: each head sliced statically, then the program's selected."""
    heads = buf.shape[3]
    pages = buf[slot]  # [C, S, G, H]
    chosen = None
    for i in range(heads):
        one = values(pages[:, :, i, :], kv_dtype).astype(jnp.float32)
        chosen = one if chosen is None else jnp.where(index == i, one, chosen)
    return chosen.astype(dtype).reshape(chunk_len, -1)
