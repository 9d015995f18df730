"""Ragged paged attention and the KV-cache write in plain PyTorch: the CPU path of the torch
backend and the reference the Triton kernels are tested against.

Same contract as kernels_pallas/ref.py (the semantic definition). A step is a ragged batch of
T query tokens from R sequence rows; `batch` is any object with int32 tensors `cu_q_lens`
[R+1], `kv_lens` [R] (context length after the step), `block_tables` [R, B] and `num_seqs`
[1]. Rows from num_seqs on are padding, and so are the tokens from cu_q_lens[num_seqs] on;
their outputs are zeros. A query token at absolute position p = kv_len - q_len + j sees the
keys 0..p of its own sequence (only those > p - sliding_window when a window is given).
Attention sinks (f32[N], GPT-OSS) join each softmax as one more logit with no value.

Shape letters: T tokens, R rows, B blocks per row, P pages, S block size (slots per page),
K kv heads, N query heads, G = N / K query heads per kv head, H head dim, L keys, C queries.

The loop runs in Python over the real sequences only (their lengths are read on the host):
each gathers the keys its queries can see into dense [L, K, H] keys and values (its own
pages up to kv_len: pages it does not own, and slots past kv_len, are never read, so
whatever they hold, NaN included, cannot reach the output) and attends C query tokens at a
time with one matmul per kv head in float32, the G query heads of the kv head stacked as
rows, so GQA never repeats K/V; C keeps the scores under MAX_SCORES elements. One sequence's
keys stay in the CPU's caches through gather, matmul and softmax: on the 2-core development
machine, attending a decode step's sequences together instead (gathering them into padded
[D, L, K, H] arrays for batched matmuls) was 2-3x slower, bound by the extra DRAM passes.
"""

from __future__ import annotations

import torch

MAX_SCORES = 1 << 22  # float32 scores per matmul chunk (16 MiB): bounds a long prefill's memory


def ragged_paged_attention(q, k_cache, v_cache, batch, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, N, H]; k_cache, v_cache: [P, S, K, H] (q's dtype, or a quantized cache's
    float8_e4m3fn / int8 values, read as float32); sinks: f32[N] or None; returns
    [T, N, H] in q.dtype.

    Softmax in float32; rows of padding tokens are exactly zero."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}).")
    out = torch.zeros_like(q)
    num_seqs = int(batch.num_seqs.tolist()[0])
    cu = batch.cu_q_lens.tolist()
    kv_lens = batch.kv_lens.tolist()
    options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    for seq in range(num_seqs):
        start, end, kv_len = cu[seq], cu[seq + 1], kv_lens[seq]
        origin = kv_len - (end - start)  # position of the sequence's first query token
        chunk = max(1, MAX_SCORES // (num_heads * max(1, kv_len)))
        for lo_q in range(start, end, chunk):
            hi_q = min(end, lo_q + chunk)
            first, last = origin + lo_q - start, origin + hi_q - start - 1  # query positions
            lo_key = 0 if sliding_window is None else max(0, first - sliding_window + 1)
            keys = gather_pages(k_cache, batch.block_tables[seq], lo_key, last + 1)
            vals = gather_pages(v_cache, batch.block_tables[seq], lo_key, last + 1)
            out[lo_q:hi_q] = attend(q[lo_q:hi_q], keys, vals, first, lo_key, **options)
    return out


def gather_pages(cache, table_row, lo: int, hi: int) -> torch.Tensor:
    """Keys (or values) at positions [lo, hi) of one sequence: [P, S, K, H] -> [hi - lo, K, H]."""
    block_size = cache.shape[1]
    first_page = lo // block_size
    pages = table_row[first_page:-(-hi // block_size)].long()
    dense = cache[pages].flatten(0, 1)  # [pages * S, K, H]
    offset = first_page * block_size
    return dense[lo - offset:hi - offset]


def attend(q, keys, vals, first: int, lo_key: int, *, scale: float,
           sliding_window: int | None, soft_cap: float | None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """C query tokens at positions first.. against L keys at positions lo_key..

    q: [C, N, H]; keys, vals: [L, K, H]; returns [C, N, H] in q.dtype."""
    num_q, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    # [C, K, G, H] -> [K, C * G, H]: one matmul per kv head, its G query heads as extra rows.
    qg = q.float().reshape(num_q, num_kv_heads, group, head_dim).transpose(0, 1)
    qg = qg.reshape(num_kv_heads, num_q * group, head_dim)
    scores = torch.matmul(qg, keys.float().permute(1, 2, 0)) * scale  # [K, C * G, L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(first, first + num_q, device=q.device)[:, None]
    k_pos = torch.arange(lo_key, lo_key + num_keys, device=q.device)[None, :]
    visible = k_pos <= q_pos  # [C, L]; every query sees at least its own key
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.view(num_kv_heads, num_q, group, num_keys)
    scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    if sinks is not None:  # one more logit per head, dropped after the softmax
        sink = sinks.float().to(q.device).view(num_kv_heads, 1, group, 1)
        scores = torch.cat([scores, sink.expand(-1, num_q, -1, -1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :num_keys]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.reshape(num_kv_heads, num_q * group, num_keys)
    out = torch.matmul(probs, vals.float().transpose(0, 1))  # [K, C * G, H]
    out = out.view(num_kv_heads, num_q, group, head_dim).transpose(0, 1)
    return out.reshape(num_q, num_heads, head_dim).to(q.dtype)


def write_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Scatter the step's new keys and values (k, v: [T, K, H]) into the caches in place, at
    slot_mapping (int[T], slot = page * S + offset), converted to the caches' dtype. Padding
    tokens point at slot 0 of the null page 0, which no sequence reads; a token with a
    negative slot is skipped."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots, k, v = slots[keep], k[keep], v[keep]
    page, offset = slots // block_size, slots % block_size
    k_cache[page, offset] = k.to(k_cache.dtype)
    v_cache[page, offset] = v.to(v_cache.dtype)
