"""Ragged paged attention as a Pallas GPU kernel (Triton lowering): ref.py's function.

The grid is (query tiles, K kv heads, kv splits). A program owns TQ consecutive tokens of the
ragged batch for one kv head (M = TQ * Gp rows, see kernel_layout.py) and walks the same
(sequence, chunk) cursor as the TPU kernel: each sequence with tokens in the tile, each
chunk of C pages those tokens can see. A chunk's pages are gathered straight from the
paged cache through the block table (one vector load of C page ids, then a [C, S, H]
gather), scores [M, L] come from one tensor-core dot, and the online softmax state stays in
registers.

Decode-heavy buckets use one-token tiles (G query heads padded with zero heads to the 16
rows a tensor-core dot needs) and split each tile's context over `kv_splits`
programs (flash-decoding): every split writes its own normalised partial output and
(m, l), and a few XLA ops outside merge them with the log-sum-exp rule, so a batch of one
long sequence still fills the GPU. Prefill-heavy buckets use big tiles and one split, and
write the output directly. Tile sizes come from kernel_layout.default_block_sizes.
Attention sinks (ref.py) start split 0's (m, l) at (sink, 1), so the merge counts each
sink once.

On the CPU the same code runs in Pallas interpret mode (interpret=True); tests compare it
with ref.py there and lower it for CUDA to catch what Triton would reject.
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
    online_update,
    padded_group,
    sink_rows,
    ungroup_output,
    zero_dead_keys,
)
from jaxserve.kernels_pallas.ref import values

TARGET_PROGRAMS = 264  # two waves on an H100/H200 (132 SMs): enough to hide a split's tail
MIN_DOT_ROWS = 16  # Triton's tl.dot needs every dimension >= 16


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head_dim (Triton tiles are powers of two >= 16)."""
    return head_dim >= MIN_DOT_ROWS and not head_dim & (head_dim - 1)


def ragged_paged_attention(q, k_cache, v_cache, batch, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks=None, kv_dtype=None, interpret: bool = False,
                           block_sizes: BlockSizes | None = None):
    """q: [T, N, H]; k_cache, v_cache: [P, S, K, H] of kv_dtype values (default q's dtype)
    or their bits; sinks: f32[N] or None; returns [T, N, H] (ref.py's contract)."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, block_size, num_kv_heads, _ = k_cache.shape
    num_rows, width = batch.block_tables.shape
    if not supports(head_dim):
        raise ValueError(f"The GPU kernel needs a power-of-two head_dim >= 16, got {head_dim}; "
                         "use attention_backend='reference' for this model.")
    group_p = padded_group(num_heads, num_kv_heads)
    sizes = block_sizes or default_block_sizes(
        num_tokens, num_rows, block_size, min_rows=1, group_p=group_p,
        num_kv_heads=num_kv_heads, target_programs=TARGET_PROGRAMS)
    tq, splits = sizes.q_tokens, sizes.kv_splits
    # A tensor-core dot needs >= 16 rows: small tiles get zero query heads as filler rather
    # than more tokens, so a decode tile still walks one sequence's pages, not 16 // G.
    group_p = max(group_p, MIN_DOT_ROWS // tq)
    rows = tq * group_p
    num_tiles = -(-num_tokens // tq)
    qg = group_queries(q, num_kv_heads, group_p, num_tiles * tq)  # [K, Tp*Gp, H]
    kernel = functools.partial(
        _kernel, q_tokens=tq, group_p=group_p, pages_per_chunk=sizes.pages_per_chunk,
        width=width, num_rows=num_rows, splits=splits, scale=scale,
        sliding_window=sliding_window, soft_cap=soft_cap, has_sinks=sinks is not None,
        kv_dtype=jnp.dtype(kv_dtype or q.dtype))
    cache_spec = pl.BlockSpec((num_pages, block_size, None, head_dim),
                              lambda qi, kh, sp: (0, 0, kh, 0))
    q_spec = pl.BlockSpec((None, rows, head_dim), lambda qi, kh, sp: (kh, qi, 0))
    part_spec = pl.BlockSpec((None, None, rows, head_dim), lambda qi, kh, sp: (sp, kh, qi, 0))
    stat_spec = pl.BlockSpec((None, None, rows), lambda qi, kh, sp: (sp, kh, qi))
    whole = pl.BlockSpec()  # the whole array: scalars read by index
    in_specs = [whole, whole, whole, whole, q_spec, cache_spec, cache_spec]
    inputs = [qg, k_cache, v_cache]
    if sinks is not None:  # [K, M]: every query tile's rows of a kv head alike
        in_specs.append(pl.BlockSpec((None, rows), lambda qi, kh, sp: (kh, 0)))
        inputs.append(sink_rows(sinks, num_kv_heads, group_p, tq))
    out_dtype = q.dtype if splits == 1 else jnp.float32
    part, m, denom = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=[part_spec, stat_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct((splits,) + qg.shape, out_dtype),
                   jax.ShapeDtypeStruct((splits,) + qg.shape[:2], jnp.float32),
                   jax.ShapeDtypeStruct((splits,) + qg.shape[:2], jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4 if rows * head_dim <= 4096 else 8,
                                             num_stages=2),
        interpret=interpret,
        name="gpu_ragged_paged_attention",
    )(batch.cu_q_lens, batch.kv_lens, batch.block_tables.reshape(-1), batch.num_seqs, *inputs)
    out = part[0] if splits == 1 else _merge_splits(part, m, denom).astype(q.dtype)
    return ungroup_output(out, num_tokens, num_heads, group_p)


def _merge_splits(part, m, denom):
    """Combine the splits' normalised outputs part [X, K, M', H] with their (m, l) [X, K, M']:
    each weighs l * exp(m - max m); splits that saw no key weigh 0."""
    weight = denom * jnp.exp(m - m.max(axis=0))
    total = weight.sum(axis=0)
    merged = (weight[..., None] * part).sum(axis=0)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]


def _kernel(cu_ref, kv_lens_ref, tables_ref, num_seqs_ref,  # i32[R+1], [R], [R*B], [1]
            q_ref,  # [M, H]
            k_ref, v_ref,  # [P, S, H]: this kv head's slice of the caches
            *refs,  # (sink_ref f32[M] if has_sinks), o_ref [M, H]: output (normalised by
            # this split's l), m_ref, l_ref f32[M]: this split's running max and denominator
            q_tokens, group_p, pages_per_chunk, width, num_rows, splits, scale,
            sliding_window, soft_cap, has_sinks, kv_dtype):
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    o_ref, m_ref, l_ref = refs
    split = pl.program_id(2)
    block_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    chunk_len = pages_per_chunk * block_size
    rows = q_ref.shape[0]
    walk = TileWalk(cu_ref, kv_lens_ref, num_seqs_ref[0], num_rows,
                    pl.program_id(0) * q_tokens, q_tokens, chunk_len, sliding_window)
    q = q_ref[...]

    def attend_chunk(s, c, state):
        index = jnp.minimum(c * pages_per_chunk + jnp.arange(pages_per_chunk), width - 1)
        pages = tables_ref[s * width + index]  # i32[C]
        # Bits on the CPU; a quantized cache's one-byte values become q's dtype here.
        k = values(k_ref[pages], kv_dtype).astype(q.dtype).reshape(chunk_len, head_dim)
        v = values(v_ref[pages], kv_dtype).astype(q.dtype).reshape(chunk_len, head_dim)
        v = zero_dead_keys(v, c, chunk_len, kv_lens_ref[s])
        return online_update(q, k, v, walk.mask(s, c, rows, group_p), state, scale=scale,
                             soft_cap=soft_cap)

    state = (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
             jnp.zeros((rows, head_dim), jnp.float32))
    if has_sinks:  # split 0 starts from the sinks' term (m = sink, l = 1)
        first = split == 0
        state = (jnp.where(first, sink_ref[...][:, None], state[0]),
                 jnp.where(first, 1.0, state[1]), state[2])
    m, denom, acc = walk.run_split(split, splits, attend_chunk, state)
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)
    m_ref[...] = m[:, 0]
    l_ref[...] = denom[:, 0]
