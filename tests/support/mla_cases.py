"""Random ragged MLA (latent attention) cases and a float64 numpy oracle, shared by the MLA
kernel tests.

The oracle walks each sequence's block-table row position by position into a dense [L, C + R]
array and runs an ordinary softmax per query token and head in float64, in the expanded
form's terms (score = q_latent . c + q_rope . k_r; out = sum p c), so it shares no code or
tricks (online softmax, page groups, masks, tiles) with the implementations it checks.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxserve.benchmarks.ragged_batch import jax_batch, make_batch
from support.attention_cases import f64, gather_dense

# V3's latent (C = kv_lora_rank 512, R = qk_rope_head_dim 64) and a small one for the matrix.
SHAPES = {"small": (64, 16), "v3": (512, 64)}


def make_mla_case(rng, specs, *, block_size, num_heads, latent, rope, dtype="float32",
                  num_rows=None, num_tokens=None, max_model_len=256, junk_tables=False):
    """(q_latent [T, N, C], q_rope [T, N, R], cache [P, S, C + R], batch) for specs
    [(q_len, kv_len)]: distinct random pages per sequence (never the null page 0) and random
    values in the whole cache, padding rows and tokens as attention_cases.make_case."""
    assert all(1 <= q <= kv <= max_model_len for q, kv in specs)
    needed = sum(-(-kv // block_size) for _, kv in specs)
    pages = needed + 8 + 1
    layout = make_batch(specs, block_size=block_size, rng=rng, num_tokens=num_tokens,
                        num_rows=num_rows, width=-(-max_model_len // block_size),
                        pool=pages - 1, junk_tables=junk_tables)
    jdt = jnp.dtype(dtype)
    T = layout.slot_mapping.shape[0]
    q_latent = jnp.asarray(rng.standard_normal((T, num_heads, latent)), jdt)
    q_rope = jnp.asarray(rng.standard_normal((T, num_heads, rope)), jdt)
    cache = jnp.asarray(rng.standard_normal((pages, block_size, latent + rope)), jdt)
    batch = jax_batch(layout, token_ids=jnp.asarray(rng.integers(0, 1000, T), jnp.int32))
    return q_latent, q_rope, cache, batch


def numpy_mla(q_latent, q_rope, cache, batch, *, scale):
    """float64 ragged paged latent attention, [T, N, C]; rows of padding tokens stay zero."""
    q_latent, q_rope, cache = f64(q_latent), f64(q_rope), f64(cache)
    cu = np.asarray(batch.cu_q_lens)
    kv_lens = np.asarray(batch.kv_lens)
    tables = np.asarray(batch.block_tables)
    num_seqs = int(np.asarray(batch.num_seqs)[0])
    T, N, C = q_latent.shape
    S = cache.shape[1]
    out = np.zeros((T, N, C))
    for i in range(num_seqs):
        L = int(kv_lens[i])
        q_len = int(cu[i + 1] - cu[i])
        entries = gather_dense(cache[:, :, None, :], tables[i], L, S)[:, 0]  # [L, C + R]
        latents, keys = entries[:, :C], entries[:, C:]
        for j in range(q_len):
            t = cu[i] + j
            pos = L - q_len + j
            s = (np.einsum("nc,lc->nl", q_latent[t], latents[:pos + 1])
                 + np.einsum("nr,lr->nl", q_rope[t], keys[:pos + 1])) * scale
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[t] = np.einsum("nl,lc->nc", w, latents[:pos + 1])
    return out


def mla_scale(latent, rope):
    """DeepSeek's softmax scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim); the latent
    width stands in for the nope dims here (scores stay ~N(0, 1))."""
    return 1.0 / math.sqrt(latent + rope)
