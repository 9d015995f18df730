"""Ragged paged-attention batches on random pages, for the attention benchmark, the kernel
checks (JAX and Triton) and the kernel tests (tests/support/attention_cases.py).

One builder of the layout (which pages each sequence's keys sit on, where each new token's
key goes), as numpy arrays: the JAX callers wrap it with `jax_batch`, the Triton checks move
it into torch tensors. Padding rows have kv_len 0; padding tokens write into slot 0 of the
null page 0, which no sequence owns.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    specs: list  # [(q_len, kv_len)] of the real rows, in order
    cu_q_lens: np.ndarray  # i32[R+1]
    kv_lens: np.ndarray  # i32[R]
    block_tables: np.ndarray  # i32[R, B]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]
    logits_indices: np.ndarray  # i32[R]: each real row's last token; 0 for padding rows
    num_pages: int  # pages the cache needs, the null page included

    @property
    def num_seqs(self) -> int:
        return len(self.specs)

    @property
    def real_tokens(self) -> int:
        return int(self.cu_q_lens[self.num_seqs])


def make_batch(specs, *, block_size: int, rng, num_tokens: int | None = None,
               num_rows: int | None = None, width: int | None = None, first_page: int = 1,
               pool: int | None = None, junk_tables: bool = False) -> RaggedBatch:
    """The layout of specs [(q_len, kv_len)] padded to num_tokens (T, default the real
    tokens) and num_rows (R, default the real rows).

    Each row gets distinct pages, in a random order, drawn from the `pool` pages first_page..
    (default: just the pages the rows need); the cache then holds first_page + pool pages.
    width: block-table columns B (default the longest row's pages). junk_tables: unused
    block-table entries point at random pages instead of the null page."""
    S = block_size
    R = len(specs) if num_rows is None else num_rows
    T = sum(q for q, _ in specs) if num_tokens is None else num_tokens
    counts = [-(-kv // S) for _, kv in specs]
    pool = sum(counts) if pool is None else pool
    assert R >= len(specs) and T >= sum(q for q, _ in specs) and pool >= sum(counts)
    pages = rng.permutation(np.arange(first_page, first_page + pool))
    num_pages = first_page + pool
    tables = np.zeros((R, max(counts) if width is None else width), np.int32)
    if junk_tables:
        tables[:] = rng.integers(0, num_pages, size=tables.shape)
    cu = np.zeros(R + 1, np.int32)
    cu[1:len(specs) + 1] = np.cumsum([q for q, _ in specs])
    cu[len(specs) + 1:] = cu[len(specs)]
    kv_lens = np.zeros(R, np.int32)
    kv_lens[:len(specs)] = [kv for _, kv in specs]
    positions = np.zeros(T, np.int32)
    slots = np.zeros(T, np.int32)
    logits_indices = np.zeros(R, np.int32)
    used = 0
    for row, ((q_len, kv_len), count) in enumerate(zip(specs, counts)):
        tables[row, :count] = pages[used:used + count]
        used += count
        pos = np.arange(kv_len - q_len, kv_len)
        positions[cu[row]:cu[row + 1]] = pos
        slots[cu[row]:cu[row + 1]] = tables[row, pos // S] * S + pos % S
        logits_indices[row] = cu[row + 1] - 1
    return RaggedBatch(specs=list(specs), cu_q_lens=cu, kv_lens=kv_lens, block_tables=tables,
                       positions=positions, slot_mapping=slots, logits_indices=logits_indices,
                       num_pages=num_pages)


def jax_batch(layout: RaggedBatch, token_ids=None):
    """The layout as the JAX kernels' Batch (token ids: zeros unless given)."""
    import jax.numpy as jnp

    from jaxserve.backends.jax.batch import Batch

    T = layout.slot_mapping.shape[0]
    return Batch(token_ids=jnp.zeros(T, jnp.int32) if token_ids is None else token_ids,
                 positions=jnp.asarray(layout.positions),
                 slot_mapping=jnp.asarray(layout.slot_mapping),
                 cu_q_lens=jnp.asarray(layout.cu_q_lens), kv_lens=jnp.asarray(layout.kv_lens),
                 block_tables=jnp.asarray(layout.block_tables),
                 num_seqs=jnp.array([layout.num_seqs], jnp.int32),
                 logits_indices=jnp.asarray(layout.logits_indices))
