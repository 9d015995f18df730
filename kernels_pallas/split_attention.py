"""Ragged paged attention organised for XLA on the CPU: same semantics as ref.py, less traffic.

On the CPU the cost of paged attention is the gather of cached pages (a copy at memory
speed), not arithmetic. The reference gathers, for every token, pages up to the longest
context in the step, and attends its own chunk through the cache too. This version splits
each token's keys in two and merges the halves with the usual log-sum-exp rule:

* the step's own tokens (positions kv_len - q_len .. its own position): one dense, masked
  [T, T] attention over the new keys and values, read back from the cache at slot_mapping
  (a fresh prompt never touches a page);
* the cached context (positions 0 .. kv_len - q_len - 1): tokens sorted by context length
  and walked in groups of TOKENS_PER_GROUP, each group looping over its own longest
  context only, KV_TOKENS_PER_STEP keys at a time. Scores for a group come from one matmul
  over the whole group (block-diagonal, the off-diagonal part masked): on XLA:CPU that beats
  a batched dot of many tiny matrices.

The dense part is O(T^2), fine for the CPU's token buckets (<= 512 by default), and the
reason this path is for XLA:CPU only: accelerators use the Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels_pallas.ref import token_layout

TOKENS_PER_GROUP = 16
KV_TOKENS_PER_STEP = 64


def _cap(s, soft_cap):
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _step_tokens_part(q, k_new, v_new, seq, pos, valid, sliding_window, soft_cap):
    """Attention of each token to the step's tokens of its own sequence up to itself.

    q: f32[T, K, G, H] (scaled); k_new, v_new: f32[T, K, H]. Returns (m, l, acc) with m, l
    f32[T, K, G] and acc f32[T, K, G, H] (unnormalised)."""
    s = _cap(jnp.einsum("tkgh,ukh->tkgu", q, k_new), soft_cap)  # [T, K, G, U]
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    mask &= valid[:, None] & valid[None, :]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = s.max(-1)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - safe[..., None])
    return m, p.sum(-1), jnp.einsum("tkgu,ukh->tkgh", p, v_new)


def _cached_part(q, k_cache, v_cache, tables, context, pos, sliding_window, soft_cap):
    """Attention of each token to its sequence's cached context (keys 0 .. context - 1).

    q: f32[T, K, G, H] (scaled); tables: i32[T, B] (block table row of each token);
    context, pos: i32[T]. Returns (m, l, acc) as _step_tokens_part."""
    num_tokens, num_kv, group, head_dim = q.shape
    _, block_size, _, _ = k_cache.shape
    pages_per_step = max(1, KV_TOKENS_PER_STEP // block_size)
    step_len = pages_per_step * block_size
    tg = TOKENS_PER_GROUP if num_tokens % TOKENS_PER_GROUP == 0 else num_tokens
    width = tables.shape[1]
    padded = -(-width // pages_per_step) * pages_per_step
    tables = jnp.pad(tables, ((0, 0), (0, padded - width)))

    order = jnp.argsort(-context, stable=True)  # longest context first
    groups = (q[order].reshape(-1, tg, num_kv, group, head_dim),
              tables[order].reshape(-1, tg, padded), context[order].reshape(-1, tg),
              pos[order].reshape(-1, tg))
    diag = jnp.eye(tg, dtype=bool)[:, None, :, None]  # [tg, 1, tg, 1] token t <-> keys of t

    def one_group(args):
        qg, tab, ctx, p_abs = args
        qk = qg.transpose(1, 0, 2, 3).reshape(num_kv, tg * group, head_dim)  # [K, tg*G, H]

        def body(i, carry):
            m, denom, acc = carry  # [tg, K, G], [tg, K, G], [tg, K, G, H]
            pages = jax.lax.dynamic_slice_in_dim(tab, i * pages_per_step, pages_per_step, 1)
            k = k_cache[pages].reshape(tg * step_len, num_kv, head_dim)
            v = v_cache[pages].reshape(tg * step_len, num_kv, head_dim)
            s = jnp.einsum("kxh,ykh->kxy", qk, k.astype(jnp.float32))  # [K, tg*G, tg*L]
            s = s.reshape(num_kv, tg, group, tg, step_len).transpose(1, 0, 2, 3, 4)
            kv_pos = i * step_len + jnp.arange(step_len)
            ok = kv_pos[None, :] < ctx[:, None]  # [tg, L]
            if sliding_window is not None:
                ok &= kv_pos[None, :] > p_abs[:, None] - sliding_window
            mask = diag & ok[None, None, :, :]  # [tg, 1, tg, L] -> with G: [tg, K, G, tg, L]
            s = jnp.where(mask[:, :, None], _cap(s, soft_cap), -jnp.inf)
            m_new = jnp.maximum(m, s.max((-2, -1)))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - safe[..., None, None])  # zero off the diagonal
            alpha = jnp.exp(m - safe)
            pv = jnp.einsum("kxy,ykh->kxh", p.transpose(1, 0, 2, 3, 4).reshape(
                num_kv, tg * group, tg * step_len), v.astype(jnp.float32))
            pv = pv.reshape(num_kv, tg, group, head_dim).transpose(1, 0, 2, 3)
            return m_new, alpha * denom + p.sum((-2, -1)), alpha[..., None] * acc + pv

        init = (jnp.full((tg, num_kv, group), -jnp.inf, jnp.float32),
                jnp.zeros((tg, num_kv, group), jnp.float32),
                jnp.zeros((tg, num_kv, group, head_dim), jnp.float32))
        num_steps = (ctx[0] + step_len - 1) // step_len  # ctx[0]: the group's longest
        return jax.lax.fori_loop(0, num_steps, body, init)

    m, denom, acc = jax.lax.map(one_group, groups)
    inverse = jnp.argsort(order)
    unsort = lambda x: x.reshape(num_tokens, *x.shape[2:])[inverse]
    return unsort(m), unsort(denom), unsort(acc)


def ragged_paged_attention(q, k_cache, v_cache, batch, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None):
    """q: [T, N, H]; k_cache, v_cache: [P, S, K, H] holding this step's keys and values
    already (written at slot_mapping); returns [T, N, H], zeros for padding tokens."""
    num_tokens, num_heads, head_dim = q.shape
    pages, block_size, num_kv, _ = k_cache.shape
    group = num_heads // num_kv
    seq, pos, valid = token_layout(batch, num_tokens)
    q_len = (batch.cu_q_lens[1:] - batch.cu_q_lens[:-1])[seq]
    context = jnp.where(valid, batch.kv_lens[seq] - q_len, 0)  # cached keys of each token

    qg = q.reshape(num_tokens, num_kv, group, head_dim).astype(jnp.float32) * scale
    flat = (pages * block_size, num_kv, head_dim)
    k_new = k_cache.reshape(flat)[batch.slot_mapping].astype(jnp.float32)
    v_new = v_cache.reshape(flat)[batch.slot_mapping].astype(jnp.float32)
    m1, l1, acc1 = _step_tokens_part(qg, k_new, v_new, seq, pos, valid, sliding_window,
                                     soft_cap)
    m2, l2, acc2 = _cached_part(qg, k_cache, v_cache, batch.block_tables[seq], context, pos,
                                sliding_window, soft_cap)
    m = jnp.maximum(m1, m2)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    a1, a2 = jnp.exp(m1 - safe), jnp.exp(m2 - safe)
    denom = a1 * l1 + a2 * l2
    acc = a1[..., None] * acc1 + a2[..., None] * acc2
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
