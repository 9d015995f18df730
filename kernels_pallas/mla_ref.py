"""Reference ragged paged multi-head latent attention (MLA, DeepSeek V2/V3) in pure JAX: the
semantic definition the MLA kernels must match.

An MLA layer caches one entry per token, [L] = [C + R]: the compressed latent c (C =
kv_lora_rank, already RMS-normalised) followed by the RoPE key k_r (R = qk_rope_head_dim,
already rotated), shared by every head. In the absorbed form the queries arrive projected
into the latent space: q_latent[n] = W_uk[n]^T q_nope[n] ([C]) and q_rope[n] ([R]), so that

    score(t, n, j) = scale * (q_latent[t, n] . c_j + q_rope[t, n] . k_r_j)
    out[t, n]      = sum_j softmax_j(score) c_j        ([C]: still in the latent space)

and the caller maps out through the value up-projection W_uv. The ragged batch is
ref.py's (T query tokens of R sequences mixing prefill chunks and decodes, block tables,
causal within a chunk); the loop walks the block tables a group of pages at a time with an
online softmax in float32 and stops after the longest sequence's last page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels_pallas.ref import KV_TOKENS_PER_STEP, token_layout, values


def ragged_paged_mla(q_latent, q_rope, cache, batch, *, scale: float, kv_dtype=None):
    """q_latent: [T, N, C]; q_rope: [T, N, R]; cache: [P, S, C + R] of kv_dtype values
    (default q_latent's dtype) or their bits (ref.kv_storage_dtype); returns [T, N, C] in
    q_latent's dtype. Rows of padding tokens (beyond cu_q_lens[num_seqs]) come out as
    zeros, never NaN."""
    kv_dtype = kv_dtype or q_latent.dtype
    num_tokens, num_heads, latent = q_latent.shape
    _, block_size, width = cache.shape
    pages_per_step = max(1, KV_TOKENS_PER_STEP // block_size)
    step_len = pages_per_step * block_size

    seq, pos, valid = token_layout(batch, num_tokens)
    tables = batch.block_tables[seq]  # i32[T, B]
    columns = tables.shape[1]
    padded = -(-columns // pages_per_step) * pages_per_step
    tables = jnp.pad(tables, ((0, 0), (0, padded - columns)))
    live = jnp.arange(batch.kv_lens.shape[0]) < batch.num_seqs[0]
    longest = jnp.max(jnp.where(live, batch.kv_lens, 0))
    num_steps = (longest + step_len - 1) // step_len
    # One query of width C + R against the cache's whole entry: the two dot products at once.
    q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32) * scale  # [T, N, L]

    def body(i, carry):
        m, denom, acc = carry  # f32[T, N], f32[T, N], f32[T, N, C]
        pages = jax.lax.dynamic_slice_in_dim(tables, i * pages_per_step, pages_per_step, 1)
        entries = values(cache[pages], kv_dtype).reshape(num_tokens, step_len, width)
        entries = entries.astype(jnp.float32)
        s = jnp.einsum("tnl,tjl->tnj", q, entries)
        kv_pos = i * step_len + jnp.arange(step_len)
        mask = (kv_pos[None, :] <= pos[:, None]) & valid[:, None]  # [T, J]
        s = jnp.where(mask[:, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - safe[..., None])
        alpha = jnp.exp(m - safe)
        denom = alpha * denom + p.sum(-1)
        acc = alpha[..., None] * acc + jnp.einsum("tnj,tjc->tnc", p, entries[..., :latent])
        return m_new, denom, acc

    init = (jnp.full((num_tokens, num_heads), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, num_heads), jnp.float32),
            jnp.zeros((num_tokens, num_heads, latent), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, num_steps, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(q_latent.dtype)


def write_latent(cache, new, slot_mapping):
    """Scatter the step's new entries ([T, C + R]) into the paged latent cache [P, S, C + R]
    at slot_mapping (i32[T], flat slot = page * S + offset; padding tokens point at the
    null page 0). A cache of unsigned integers (ref.kv_storage_dtype) takes new's bits."""
    shape = cache.shape
    if jnp.issubdtype(cache.dtype, jnp.unsignedinteger):
        if new.dtype.itemsize != cache.dtype.itemsize:
            raise ValueError(f"A {cache.dtype} cache stores the bits of a float of the same "
                             f"width (kv_storage_dtype); got {new.dtype} entries.")
        new = jax.lax.bitcast_convert_type(new, cache.dtype)
    else:
        new = new.astype(cache.dtype)
    # Indexed by (page, offset), not through a [P * S, C + R] view: XLA:TPU lays such a view
    # out transposed for the scatter, a copy of the whole cache in and out of each layer.
    return cache.at[slot_mapping // shape[1], slot_mapping % shape[1]].set(new)
