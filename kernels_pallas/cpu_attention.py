"""Ragged paged attention tuned for XLA:CPU: same semantics as ref.py, a fraction of the work.

On the CPU, XLA runs a dot with many tiny batch elements slowly (a loop of small matmuls),
fuses a gather into its consumer badly (an index computation per element), and every pass
over a big score array costs memory bandwidth. So each token's keys are split in three
disjoint sets, each attended the way that suits it, and the three partial softmaxes
(m, l, acc) merged with the usual log-sum-exp rule (attention sinks, ref.py, join the
merge as a fourth part: m = sink, l = 1, no value):

* the step's own tokens (`_step_part`): flash-style tiles over the T tokens in the batch's
  order. A query tile of Q tokens loops over the key tiles from the one holding its
  earliest row start up to itself (a dynamic trip count), so a fresh prompt costs O(rows x
  len^2), not O(T^2). Keys and values are the step's own, read back at slot_mapping; scores
  are one dot per kv head, [Q*G, H] x [H, Q]: big enough for a real matmul.
* the cached context of single-token rows, i.e. decodes (`_decode_context_part`): every
  token has its own pages. Tokens are sorted by context length and walked in groups, each
  group looping over its own longest context only, a few pages at a time so the gathered
  keys stay in cache. The gather is materialised (an optimization barrier keeps XLA from
  fusing it into the consumer), and the arithmetic is multiply + reduce rather than a dot:
  one query token has only G rows per kv head, far too small for a matmul.
* the cached context of multi-token rows, i.e. chunk continuations and prefix-cache hits
  (`_chunk_context_part`): a dynamic loop over work items (row, tile of up to C queries);
  each item gathers its row's pages ONCE and attends all its queries with a dot per kv
  head, [C*G, H] x [H, L], instead of gathering the same pages once per query token.

Measured on the 2-core development machine (scripts/bench_attention.py, 125M model shapes,
ms per layer, ref -> this): decode 128 x ctx 160 27 -> 10; decode 128 x ctx 20..655
51 -> 23; prefill 4 x 128 fresh 62 -> 4.7; mixed 128 decodes + 4 x 96 fresh 125 -> 19;
suffix 32 after 1024 cached x 8 138 -> 18. Decodes stay memory bound (every token reads
its own pages: a gather near copy speed plus multiply + reduce at ~10-15 GFLOP/s); the
tile constants below were picked on those cases.

Everything is pure JAX with static shapes per (T, R) bucket; batch contents only change
trip counts. Shape letters: T tokens, R rows, B blocks per row, S block size, K kv heads,
G = N / K query heads per kv head, H head dim, L keys per loop step, Q / C query tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels_pallas.ref import sink_state, token_layout, values

STEP_TILE = 32  # Q: query (and key) tile of the in-step part
DECODE_GROUP = 32  # tokens per group in the decode context part
DECODE_KV_STEP = 32  # L: keys per loop step in the decode context part
CHUNK_TILE = 32  # C: queries per work item in the chunk context part
CHUNK_KV_STEP = 256  # L: keys per loop step in the chunk context part

_NEG = -jnp.inf


def _cap(s, soft_cap):
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _online_update(carry, s, v_part, axis):
    """One flash step: fold scores s (masked with -inf) into (m, l, acc).

    s has the key axis at `axis`; v_part(p) returns p's weighted values, shaped like acc."""
    m, denom, acc = carry
    m_new = jnp.maximum(m, s.max(axis))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - jnp.expand_dims(safe, axis))
    alpha = jnp.exp(m - safe)
    return m_new, alpha * denom + p.sum(axis), alpha[..., None] * acc + v_part(p)


def _pad_to(x, multiple, value=0):
    """Pad axis 0 of x up to a multiple of `multiple`."""
    extra = -x.shape[0] % multiple
    return jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def _init(shape):
    """Empty (m, l, acc) for queries of `shape` (..., H)."""
    return (jnp.full(shape[:-1], _NEG, jnp.float32), jnp.zeros(shape[:-1], jnp.float32),
            jnp.zeros(shape, jnp.float32))


def _merge(parts):
    """Combine partial softmaxes [(m, l, acc)] over disjoint key sets; normalise."""
    m = parts[0][0]
    for part in parts[1:]:
        m = jnp.maximum(m, part[0])
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    denom, acc = 0.0, 0.0
    for m_i, l_i, acc_i in parts:
        a = jnp.exp(m_i - safe)
        denom, acc = denom + a * l_i, acc + a[..., None] * acc_i
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]


# ----------------------------------------------------------------------------- step tokens


def _step_part(q, k_new, v_new, seq, pos, valid, start, sliding_window, soft_cap):
    """Attention of each token to the step's tokens of its own row, up to itself.

    q: f32[T, K, G, H] scaled; k_new, v_new: f32[T, K, H]; seq, pos: i32[T]; valid: bool[T];
    start: i32[T], index of the first token of each token's row. Returns (m, l, acc)."""
    num_real, num_kv, group, head_dim = q.shape
    tile = min(STEP_TILE, num_real)
    q, k_new, v_new, seq, pos, start = (_pad_to(x, tile) for x in (q, k_new, v_new, seq, pos,
                                                                   start))
    valid = _pad_to(valid, tile, False)
    num_tokens = q.shape[0]
    num_tiles = num_tokens // tile
    kt = k_new.reshape(num_tiles, tile, num_kv, head_dim).transpose(0, 2, 3, 1)  # [., K, H, Q]
    vt = v_new.reshape(num_tiles, tile, num_kv, head_dim).transpose(0, 2, 1, 3)  # [., K, Q, H]
    key_info = (seq.reshape(num_tiles, tile), pos.reshape(num_tiles, tile),
                valid.reshape(num_tiles, tile))
    first = jnp.where(valid, start, jnp.arange(num_tokens)).reshape(num_tiles, tile).min(1)

    def one_tile(args):
        i, q_tile, q_seq, q_pos, q_valid = args  # q_tile: [Q, K, G, H]
        qk = q_tile.transpose(1, 0, 2, 3).reshape(num_kv, tile * group, head_dim)

        def body(j, carry):
            k_seq, k_pos, k_valid = (x[j] for x in key_info)
            s = _cap(jnp.einsum("kxh,khu->kxu", qk, kt[j]), soft_cap)  # [K, Q*G, Q]
            mask = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            mask &= q_valid[:, None] & k_valid[None, :]
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
            mask = jnp.broadcast_to(mask[:, None, :], (tile, group, tile)).reshape(
                1, tile * group, tile)
            s = jnp.where(mask, s, _NEG)
            return _online_update(carry, s, lambda p: jnp.einsum("kxu,kuh->kxh", p, vt[j]), -1)

        init = _init((num_kv, tile * group, head_dim))
        out = jax.lax.fori_loop(first[i] // tile, i + 1, body, init)
        return jax.tree.map(lambda x: x.reshape(num_kv, tile, group, *x.shape[2:]).swapaxes(0, 1),
                            out)

    tiles = (jnp.arange(num_tiles), q.reshape(num_tiles, tile, num_kv, group, head_dim),
             *key_info)
    out = jax.lax.map(one_tile, tiles)
    return jax.tree.map(lambda x: x.reshape(num_tokens, *x.shape[2:])[:num_real], out)


# ----------------------------------------------------------------------------- decode context


def _decode_context_part(q, k_cache, v_cache, tables, context, pos, num_rows, sliding_window,
                         soft_cap, dtype):
    """Attention of each token to its own cached keys 0 .. context - 1 (0 for none).

    q: f32[T, K, G, H] scaled; tables: i32[T, B], each token's block-table row; context,
    pos: i32[T]; num_rows: R; dtype: the keys' dtype (ref.values). Returns (m, l, acc) as
    _step_part.

    A step has at most R decode tokens (one per row), and sorting puts them first, so
    groups of min(DECODE_GROUP, R) tokens hold no idle slots in small batches (every slot
    of a group gathers pages up to the group's longest context, padding or not). A smaller
    group walks more keys per loop step, keeping the gathered block about the same size."""
    num_real, num_kv, group, head_dim = q.shape
    num_pages, block_size = k_cache.shape[:2]
    tg = min(DECODE_GROUP, num_real, num_rows)
    keys_per_step = DECODE_KV_STEP * (DECODE_GROUP // tg)
    pages_per_step = max(1, keys_per_step // block_size)
    step_len = pages_per_step * block_size
    q, tables, context, pos = (_pad_to(x, tg) for x in (q, tables, context, pos))
    num_tokens = q.shape[0]
    width = tables.shape[1]
    padded = -(-width // pages_per_step) * pages_per_step
    tables = jnp.pad(tables, ((0, 0), (0, padded - width)))
    k_flat, v_flat = (c.reshape(num_pages, -1) for c in (k_cache, v_cache))  # [P, S*K*H]

    order = jnp.argsort(-context, stable=True)  # longest context first
    groups = (q[order].reshape(-1, tg, num_kv, group, head_dim),
              tables[order].reshape(-1, tg, padded), context[order].reshape(-1, tg),
              pos[order].reshape(-1, tg))

    def one_group(args):
        qg, tab, ctx, p_abs = args

        def body(i, carry):
            pages = jax.lax.dynamic_slice_in_dim(tab, i * pages_per_step, pages_per_step, 1)
            pages = pages.reshape(-1)
            k = values(k_flat[pages], dtype).reshape(tg, step_len, num_kv, head_dim)
            v = values(v_flat[pages], dtype).reshape(tg, step_len, num_kv, head_dim)
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
            k, v = jax.lax.optimization_barrier((k, v))  # a copy at memory speed, then hot
            s = _cap((qg[:, None] * k[:, :, :, None, :]).sum(-1), soft_cap)  # [tg, L, K, G]
            kv_pos = i * step_len + jnp.arange(step_len)
            ok = kv_pos[None, :] < ctx[:, None]  # [tg, L]
            if sliding_window is not None:
                ok &= kv_pos[None, :] > p_abs[:, None] - sliding_window
            s = jnp.where(ok[:, :, None, None], s, _NEG)
            return _online_update(carry, s, lambda p: (p[..., None] * v[:, :, :, None]).sum(1),
                                  1)

        num_steps = (ctx[0] + step_len - 1) // step_len  # ctx[0]: the group's longest
        return jax.lax.fori_loop(0, num_steps, body, _init((tg, num_kv, group, head_dim)))

    m, denom, acc = jax.lax.map(one_group, groups)
    inverse = jnp.argsort(order)
    unsort = lambda x: x.reshape(num_tokens, *x.shape[2:])[inverse[:num_real]]
    return unsort(m), unsort(denom), unsort(acc)


# ----------------------------------------------------------------------------- chunk context


def _chunk_items(batch, rows_q_len, rows_ctx, tile):
    """Work items of the chunk part: (row, first query token, query count) for item w.

    Rows with more than one query token and some cached context get ceil(q_len / C) items.
    Returns (count i32[], item_of(w) -> (row, t0, n))."""
    live = jnp.arange(rows_ctx.shape[0]) < batch.num_seqs[0]
    wanted = live & (rows_q_len > 1) & (rows_ctx > 0)
    per_row = jnp.where(wanted, (rows_q_len + tile - 1) // tile, 0)
    ends = jnp.cumsum(per_row)

    def item_of(w):
        row = jnp.searchsorted(ends, w, side="right").astype(jnp.int32)
        j = w - (ends[row] - per_row[row])
        t0 = batch.cu_q_lens[row] + j * tile
        return row, t0, jnp.minimum(tile, rows_q_len[row] - j * tile)

    return ends[-1], item_of


def _chunk_context_part(q, k_cache, v_cache, batch, pos, sliding_window, soft_cap, dtype):
    """Attention of the tokens of multi-token rows to their row's cached context.

    q: f32[T, K, G, H] scaled; pos: i32[T]; dtype: the keys' dtype (ref.values). Returns (m, l, acc) as _step_part (empty for
    tokens of single-token rows and rows without cached context)."""
    num_tokens, num_kv, group, head_dim = q.shape
    num_pages, block_size = k_cache.shape[:2]
    tile = min(CHUNK_TILE, num_tokens)
    pages_per_step = max(1, CHUNK_KV_STEP // block_size)
    step_len = pages_per_step * block_size
    tables = batch.block_tables
    padded = -(-tables.shape[1] // pages_per_step) * pages_per_step
    tables = jnp.pad(tables, ((0, 0), (0, padded - tables.shape[1])))
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    rows_ctx = batch.kv_lens - q_lens
    count, item_of = _chunk_items(batch, q_lens, rows_ctx, tile)
    q_pad = jnp.pad(q, ((0, tile), (0, 0), (0, 0), (0, 0)))  # slices never clamp
    pos_pad = jnp.pad(pos, (0, tile))

    def one_item(w, out):
        row, t0, n = item_of(w)
        qt = jax.lax.dynamic_slice_in_dim(q_pad, t0, tile, 0)  # [C, K, G, H]
        qk = qt.transpose(1, 0, 2, 3).reshape(num_kv, tile * group, head_dim)
        q_pos = jax.lax.dynamic_slice_in_dim(pos_pad, t0, tile, 0)
        tab, ctx = tables[row], rows_ctx[row]

        def body(i, carry):
            pages = jax.lax.dynamic_slice_in_dim(tab, i * pages_per_step, pages_per_step, 0)
            k = values(k_cache[pages], dtype).reshape(step_len, num_kv, head_dim)
            v = values(v_cache[pages], dtype).reshape(step_len, num_kv, head_dim)
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
            s = _cap(jnp.einsum("kxh,lkh->kxl", qk, k), soft_cap)  # [K, C*G, L]
            kv_pos = i * step_len + jnp.arange(step_len)
            ok = jnp.broadcast_to(kv_pos[None, :] < ctx, (tile, step_len))
            if sliding_window is not None:
                ok &= kv_pos[None, :] > q_pos[:, None] - sliding_window
            ok = jnp.broadcast_to(ok[:, None], (tile, group, step_len)).reshape(
                1, tile * group, step_len)
            s = jnp.where(ok, s, _NEG)
            return _online_update(carry, s, lambda p: jnp.einsum("kxl,lkh->kxh", p, v), -1)

        num_steps = (ctx + step_len - 1) // step_len
        res = jax.lax.fori_loop(0, num_steps, body, _init((num_kv, tile * group, head_dim)))
        res = jax.tree.map(lambda x: x.reshape(num_kv, tile, group, *x.shape[2:]).swapaxes(0, 1),
                           res)
        keep = jnp.arange(tile) < n  # the tile's tail may belong to the next row
        return jax.tree.map(lambda buf, r: jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(
            keep.reshape((tile,) + (1,) * (r.ndim - 1)), r,
            jax.lax.dynamic_slice_in_dim(buf, t0, tile, 0)), t0, 0), out, res)

    out = _init((num_tokens + tile, num_kv, group, head_dim))
    out = jax.lax.fori_loop(0, count, one_item, out)
    return jax.tree.map(lambda x: x[:num_tokens], out)


# ----------------------------------------------------------------------------- entry point


def ragged_paged_attention(q, k_cache, v_cache, batch, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks=None, kv_dtype=None):
    """q: [T, N, H]; k_cache, v_cache: [P, S, K, H] holding this step's keys and values
    already (written at slot_mapping), of kv_dtype values (default q's dtype) or their bits
    (ref.kv_storage_dtype); sinks: f32[N] or None (ref.py); returns [T, N, H], zeros for
    padding tokens."""
    kv_dtype = kv_dtype or q.dtype
    num_tokens, num_heads, head_dim = q.shape
    pages, block_size, num_kv, _ = k_cache.shape
    group = num_heads // num_kv
    seq, pos, valid = token_layout(batch, num_tokens)
    q_len = (batch.cu_q_lens[1:] - batch.cu_q_lens[:-1])[seq]
    single = valid & (q_len == 1)
    context = jnp.where(single, batch.kv_lens[seq] - 1, 0)  # cached keys of decode tokens

    qg = q.reshape(num_tokens, num_kv, group, head_dim).astype(jnp.float32) * scale
    flat = (pages * block_size, num_kv, head_dim)
    k_new = values(k_cache.reshape(flat)[batch.slot_mapping], kv_dtype).astype(jnp.float32)
    v_new = values(v_cache.reshape(flat)[batch.slot_mapping], kv_dtype).astype(jnp.float32)
    parts = [
        _step_part(qg, k_new, v_new, seq, pos, valid, batch.cu_q_lens[seq], sliding_window,
                   soft_cap),
        _decode_context_part(qg, k_cache, v_cache, batch.block_tables[seq], context, pos,
                             batch.kv_lens.shape[0], sliding_window, soft_cap, kv_dtype),
        _chunk_context_part(qg, k_cache, v_cache, batch, pos, sliding_window, soft_cap,
                            kv_dtype),
    ]
    if sinks is not None:  # a fourth part: the sinks' term, no value
        parts.append((*sink_state(sinks, qg.shape[:-1]), jnp.zeros(qg.shape, jnp.float32)))
    return _merge(parts).reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
