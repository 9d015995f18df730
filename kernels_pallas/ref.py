"""Reference ragged paged attention in pure JAX: the semantic definition kernels must match.

One call attends a ragged batch that mixes prefill chunks and decodes: T query tokens from R
sequences, each sequence's keys and values read through its row of the block table from a
paged cache. A query token at absolute position p sees the keys at positions 0..p of its own
sequence (causal inside a chunk), optionally only the last `sliding_window` of them.
Attention sinks (GPT-OSS), when given, are one learned logit per query head that joins
every softmax's denominator and adds no value: out = sum_j e^(s_j) v_j / (e^sink +
sum_j e^(s_j)). The online softmax starts from that term (m = sink, l = 1, acc = 0).

The loop walks the block tables a group of pages at a time with an online (flash-style)
softmax in float32, and stops after the longest sequence's last page, so short contexts do
not pay for max_model_len.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KV_TOKENS_PER_STEP = 128  # keys gathered per loop iteration (pages_per_step * block_size)

_BITS = {1: jnp.uint8, 2: jnp.uint16}


def kv_storage_dtype(dtype, platform: str):
    """The dtype the paged KV cache is stored in, for model dtype `dtype` on a JAX platform.

    XLA:CPU has no bfloat16 / float16 gather, scatter or dynamic-update-slice: it widens
    them to float32 by converting the whole operand, so a bf16 cache would be converted
    (and written back) in full at every step, making the step's cost grow with the cache's
    size rather than with its work. On the CPU a narrow float cache therefore holds the same
    bits as unsigned integers of the same width, which every one of those ops moves as they
    are; the attention reads its pages back as `dtype` with `values` (a free bitcast of the
    pages it gathered). TPU and GPU handle narrow floats natively and store them as they are.
    """
    dtype = jnp.dtype(dtype)
    if platform == "cpu" and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in _BITS:
        return jnp.dtype(_BITS[dtype.itemsize])
    return dtype


def values(x, dtype):
    """Cache contents x as `dtype`: the bits reinterpreted when the cache stores integers
    (kv_storage_dtype), else x itself."""
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger) and jnp.issubdtype(dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, dtype)
    return x


def token_layout(batch, num_tokens: int):
    """For each of the T tokens: its sequence row, absolute position, and whether it is real.

    Returns (seq i32[T], pos i32[T], valid bool[T]). Positions are derived from cu_q_lens and
    kv_lens (not batch.positions), as a kernel would.
    """
    cu = batch.cu_q_lens  # i32[R+1]
    num_rows = batch.kv_lens.shape[0]
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], tok, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_rows - 1)
    valid = tok < cu[batch.num_seqs[0]]
    q_len = cu[seq + 1] - cu[seq]
    pos = batch.kv_lens[seq] - q_len + (tok - cu[seq])
    return seq, pos, valid


def ragged_paged_attention(q, k_cache, v_cache, batch, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks=None, kv_dtype=None):
    """q: [T, N, H]; k_cache, v_cache: [P, S, K, H] (P pages of S slots) of kv_dtype values
    (default q's dtype; a quantized cache's one-byte format, kv_quant.py), or their bits
    (kv_storage_dtype); sinks: f32[N] or None; returns [T, N, H].

    Rows of padding tokens (beyond cu_q_lens[num_seqs]) come out as zeros, never NaN.
    """
    kv_dtype = kv_dtype or q.dtype
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    pages_per_step = max(1, KV_TOKENS_PER_STEP // block_size)
    step_len = pages_per_step * block_size

    seq, pos, valid = token_layout(batch, num_tokens)
    tables = batch.block_tables[seq]  # i32[T, B]
    width = tables.shape[1]
    padded = -(-width // pages_per_step) * pages_per_step
    tables = jnp.pad(tables, ((0, 0), (0, padded - width)))
    live = jnp.arange(batch.kv_lens.shape[0]) < batch.num_seqs[0]
    longest = jnp.max(jnp.where(live, batch.kv_lens, 0))
    num_steps = (longest + step_len - 1) // step_len

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * scale

    def body(i, carry):
        m, denom, acc = carry  # f32[T, K, G], f32[T, K, G], f32[T, K, G, H]
        pages = jax.lax.dynamic_slice_in_dim(tables, i * pages_per_step, pages_per_step, 1)
        k = values(k_cache[pages], kv_dtype).reshape(num_tokens, step_len, num_kv_heads, head_dim)
        v = values(v_cache[pages], kv_dtype).reshape(num_tokens, step_len, num_kv_heads, head_dim)
        s = jnp.einsum("tkgh,tlkh->tkgl", qg, k.astype(jnp.float32))
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = i * step_len + jnp.arange(step_len)
        mask = (kv_pos[None, :] <= pos[:, None]) & valid[:, None]  # [T, L]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - safe[..., None])
        alpha = jnp.exp(m - safe)
        denom = alpha * denom + p.sum(-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgl,tlkh->tkgh", p, v.astype(jnp.float32))
        return m_new, denom, acc

    init = (*sink_state(sinks, (num_tokens, num_kv_heads, group)),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, num_steps, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def sink_state(sinks, shape):
    """The online softmax's starting (m, l), f32[*shape] for shape (..., K, G): the sinks'
    term (m = sink, l = 1), or nothing seen yet (m = -inf, l = 0)."""
    if sinks is None:
        return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32)
    m = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(shape[-2:]), shape)
    return m, jnp.ones(shape, jnp.float32)


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Scatter the step's new keys/values ([T, K, H]) into the paged caches at slot_mapping
    (i32[T], flat slot = page * S + offset). Padding tokens point at the null page 0. A cache
    of unsigned integers (kv_storage_dtype) takes the bits of k and v (of a quantized cache:
    k and v already quantized, kv_quant.quantize)."""
    pages, offsets = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]

    def write(cache, new):
        if not _stores_bits(cache):
            new = new.astype(cache.dtype)
        elif new.dtype.itemsize == cache.dtype.itemsize:  # the model dtype's bits
            new = jax.lax.bitcast_convert_type(new, cache.dtype)
        else:
            raise ValueError(f"A {cache.dtype} cache stores the bits of a float of the same "
                             f"width (kv_storage_dtype); got {new.dtype} keys/values.")
        # Indexed by (page, offset), not through a [P * S, K, H] view, which XLA:TPU may lay
        # out otherwise for the scatter: a copy of the whole cache in and out of each layer.
        return cache.at[pages, offsets].set(new)

    return write(k_cache, k), write(v_cache, v)


def _stores_bits(cache) -> bool:
    return jnp.issubdtype(cache.dtype, jnp.unsignedinteger)
