"""What the Pallas attention kernels share outside the kernel body: the query layout, block sizes.

Both kernels (ragged_paged_attention.py for TPU, gpu_ragged_paged_attention.py for GPU) work
on query tiles that hold TQ consecutive tokens of the ragged batch for one kv head, all G
query heads of that kv head stacked as rows: M = TQ * Gp rows of H. So q [T, N, H] is
regrouped once, outside the kernel, to [K, T * Gp, H] (row = token * Gp + head in group), with
G padded up to a power of two Gp (the row's token is then a shift, and Triton's tile
dimensions stay powers of two); the output comes back the same way. The regrouping reads
and writes T * N * H elements, small next to the K/V pages a step reads.

Shape letters as in docs/architecture.md: T tokens, R rows, B blocks per row, S block size, K kv heads,
G = N / K query heads per kv head (Gp padded), H head dim, TQ query tokens per tile,
C pages per kv chunk (L = C * S keys).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK_VALUE = -1e30  # masked scores: finite, so no -inf - -inf; masked probabilities are zeroed


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of one kernel call.

    q_tokens: TQ, query tokens per program (a tile may span several sequences; rows of other
    sequences are masked, so decode-heavy steps want a small TQ). pages_per_chunk: C, pages
    copied and attended per inner step. kv_splits: programs that share one query tile's
    context (flash-decoding; GPU only: their partial softmaxes are merged outside)."""

    q_tokens: int
    pages_per_chunk: int
    kv_splits: int = 1

    def __post_init__(self) -> None:
        for name in ("q_tokens", "pages_per_chunk", "kv_splits"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 1, got {value}.")


@dataclasses.dataclass(frozen=True)
class TileRule:
    """A TPU generation's inputs to the tile table (jaxserve/config/accelerators.py holds them
    per generation, as KernelTiles): L = keys_per_chunk keys per inner step, query tiles of
    min_rows..max_tile_rows rows, and the scoped VMEM Mosaic gives the kernel (None: its
    default). The defaults are the kernel's tiles on a device the table does not know."""

    keys_per_chunk: int = 128
    min_rows: int = 8
    max_tile_rows: int = 256
    vmem_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("keys_per_chunk", "min_rows", "max_tile_rows"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TileRule.{name} must be a power of two >= 1, got {value}.")
        if self.vmem_limit_bytes is not None and self.vmem_limit_bytes <= 0:
            raise ValueError(f"TileRule.vmem_limit_bytes must be > 0, got "
                             f"{self.vmem_limit_bytes}.")


def div(a, b):
    """a // b for integers a >= 0: truncating division, which Mosaic and Triton lower without
    the sign fix-up of floor division (Mosaic's sign op needs a real TPU to lower)."""
    return jax.lax.div(a, jnp.asarray(b, jnp.int32) if isinstance(b, int) else b)


def padded_group(num_heads: int, num_kv_heads: int) -> int:
    """Gp: query heads per kv head, rounded up to a power of two."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}).")
    group = num_heads // num_kv_heads
    return 1 << (group - 1).bit_length()


def group_queries(q, num_kv_heads: int, group_p: int, num_tokens_p: int):
    """q [T, N, H] -> [K, Tp * Gp, H]: tokens padded to Tp, heads to Gp per kv head."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, num_tokens_p - num_tokens), (0, 0), (0, group_p - group), (0, 0)))
    return qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_tokens_p * group_p, head_dim)


def sink_rows(sinks, num_kv_heads: int, group_p: int, q_tokens: int):
    """f32[N] sinks -> f32[K, Q * Gp]: each row's sink in a tile of Q tokens laid out as
    group_queries does (row r: token r // Gp, head r % Gp); padding heads get MASK_VALUE,
    which weighs nothing once a key is seen."""
    group = sinks.shape[0] // num_kv_heads
    rows = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    rows = jnp.pad(rows, ((0, 0), (0, group_p - group)), constant_values=MASK_VALUE)
    return jnp.tile(rows, (1, q_tokens))


def ungroup_output(out, num_tokens: int, num_heads: int, group_p: int):
    """The inverse of group_queries: [K, Tp * Gp, H] -> [T, N, H]."""
    num_kv_heads, _, head_dim = out.shape
    group = num_heads // num_kv_heads
    out = out.reshape(num_kv_heads, -1, group_p, head_dim)[:, :num_tokens, :group]
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)


def default_block_sizes(num_tokens: int, num_rows: int, block_size: int, *,
                        min_rows: int = 8, max_tile_rows: int = 256,
                        group_p: int = 1, num_kv_heads: int = 1,
                        target_programs: int = 0, keys_per_chunk: int = 128) -> BlockSizes:
    """The tile table, from the step's static (T, R) bucket.

    About one token per row (decode-heavy): the smallest tile whose M = TQ * Gp still fills
    `min_rows` matrix rows, since each extra token in a tile is another sequence whose pages
    the tile walks with its rows masked. Many tokens per row (prefill-heavy): big tiles, so
    one page read serves many queries. Keys per chunk: keys_per_chunk (128 by default: it
    keeps the VMEM/SRAM footprint small for every head_dim; a TPU generation with a 256-wide
    MXU takes 256, TileRule), at least one page.
    With target_programs > 0 (GPU), kv_splits spreads a small batch's contexts over enough
    programs to fill the device."""
    per_row = max(1, num_tokens // max(1, num_rows))
    q_tokens = 1 if per_row <= 2 else 16 if per_row <= 16 else 64
    q_tokens = min(q_tokens, 1 << (num_tokens - 1).bit_length(), max_tile_rows // group_p)
    q_tokens = max(q_tokens, -(-min_rows // group_p), 1)
    q_tokens = 1 << (q_tokens - 1).bit_length()
    pages = max(1, keys_per_chunk // block_size)
    splits = 1
    if target_programs:
        tiles = -(-num_tokens // q_tokens) * num_kv_heads
        while splits < 16 and tiles * splits * 2 <= target_programs:
            splits *= 2
    return BlockSizes(q_tokens=q_tokens, pages_per_chunk=pages, kv_splits=splits)


@dataclasses.dataclass(frozen=True)
class TileWalk:
    """Which sequences and kv chunks one query tile [t0, t0 + TQ) visits, read from refs.

    cu_ref i32[R+1], kv_lens_ref i32[R] (SMEM on TPU, global memory on GPU); num_seqs a
    scalar. Chunks are C pages (chunk_len = C * S keys) of a sequence's block-table row.
    Scalar code only, shared by both kernels."""

    cu_ref: object
    kv_lens_ref: object
    num_seqs: object
    num_rows: int
    t0: object
    q_tokens: int
    chunk_len: int
    sliding_window: int | None

    def origin(self, s):
        """Position of token index t of sequence s is origin(s) + t."""
        start, end = self.cu_ref[s], self.cu_ref[s + 1]
        return self.kv_lens_ref[s] - (end - start) - start

    def chunk_range(self, s):
        """Chunks [lo, hi) of sequence s that the tile's tokens can see; empty if none."""
        row = jnp.minimum(s, self.num_rows - 1)
        start, end = self.cu_ref[row], self.cu_ref[row + 1]
        first = jnp.maximum(start, self.t0)
        last = jnp.minimum(end, self.t0 + self.q_tokens) - 1
        origin = self.origin(row)
        has = (s < self.num_seqs) & (last >= first)
        hi = jnp.where(has, div(origin + last, self.chunk_len) + 1, 0)
        lo = jnp.int32(0)
        if self.sliding_window is not None:
            lo = div(jnp.maximum(origin + first - self.sliding_window + 1, 0), self.chunk_len)
        return jnp.minimum(lo, hi), hi

    def live(self, s):
        """Sequence s is real and starts before the tile ends."""
        row = jnp.minimum(s, self.num_rows)
        return (s < self.num_seqs) & (self.cu_ref[row] < self.t0 + self.q_tokens)

    def next_sequence(self, s):
        """The first sequence after s with chunks to visit, or the first one not live."""
        def empty(s):
            lo, hi = self.chunk_range(s)
            return self.live(s) & (lo >= hi)

        return jax.lax.while_loop(empty, lambda s: s + 1, s + 1)

    def first_sequence(self):
        """The first sequence with chunks to visit (not live if the tile is padding)."""
        first = self._first_ending_after(self.t0)
        lo, hi = self.chunk_range(first)
        return jax.lax.cond(lo < hi, lambda: first, lambda: self.next_sequence(first))

    def advance(self, s, c):
        """The cursor after (s, c): the next chunk of s, else the first of the next sequence."""
        return jax.lax.cond(c + 1 < self.chunk_range(s)[1], lambda: (s, c + 1),
                            lambda: self._first_chunk(self.next_sequence(s)))

    def _first_chunk(self, s):
        """The cursor (s, first chunk of s)."""
        return s, self.chunk_range(s)[0]

    def run_double_buffered(self, start, wait, compute) -> None:
        """Visit every (sequence, chunk) of the tile with a two-slot buffer (the TPU
        kernels): start(s, c, slot) begins chunk c's copies into a slot, wait(s, c, slot)
        waits for them, compute(s, c, slot) uses them; the next chunk's copies start into
        the other slot before this one is computed."""
        s0, c0 = self._first_chunk(self.first_sequence())

        @pl.when(self.live(s0))
        def _():
            start(s0, c0, 0)

        def body(state):
            s, c, slot = state
            s_next, c_next = self.advance(s, c)

            @pl.when(self.live(s_next))
            def _():
                start(s_next, c_next, 1 - slot)

            wait(s, c, slot)
            compute(s, c, slot)
            return s_next, c_next, 1 - slot

        jax.lax.while_loop(lambda state: self.live(state[0]), body, (s0, c0, jnp.int32(0)))

    def run_split(self, split, splits: int, attend_chunk, state):
        """The GPU kernels' walk: for every sequence of the tile, this split's share of its
        chunks (split of `splits`, flash-decoding), state = attend_chunk(s, c, state) for
        each; the final state."""

        def attend_sequence(carry):
            s, state = carry
            lo, hi = self.chunk_range(s)
            per_split = div(hi - lo + splits - 1, splits)
            first = lo + split * per_split
            last = jnp.minimum(hi, first + per_split)
            state = jax.lax.fori_loop(first, jnp.maximum(first, last),
                                      lambda c, st: attend_chunk(s, c, st), state)
            return self.next_sequence(s), state

        return jax.lax.while_loop(lambda carry: self.live(carry[0]), attend_sequence,
                                  (self.first_sequence(), state))[1]

    def _first_ending_after(self, token):
        """The smallest s < num_seqs with cu[s + 1] > token (num_seqs if none)."""
        def step(_, bounds):
            lo, hi = bounds
            mid = div(lo + hi, 2)
            right = self.cu_ref[jnp.minimum(mid + 1, self.num_rows)] <= token
            go = lo < hi
            return jnp.where(go & right, mid + 1, lo), jnp.where(go & ~right, mid, hi)

        bounds = (jnp.int32(0), jnp.asarray(self.num_seqs, jnp.int32))
        lo, _ = jax.lax.fori_loop(0, self.num_rows.bit_length() + 1, step, bounds)
        return lo

    def mask(self, s, c, rows: int, group_p: int):
        """bool[M, L]: row r (token t0 + r // Gp) may see key c * L + l of sequence s."""
        start, end = self.cu_ref[s], self.cu_ref[s + 1]
        origin = self.origin(s)
        shape = (rows, self.chunk_len)
        token = self.t0 + div(jax.lax.broadcasted_iota(jnp.int32, shape, 0), group_p)
        key = c * self.chunk_len + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        mask = (token >= start) & (token < end) & (key <= origin + token)
        mask &= key < self.kv_lens_ref[s]
        if self.sliding_window is not None:
            mask &= key > origin + token - self.sliding_window
        return mask


def online_update(q, k, v, mask, state, *, scale: float, soft_cap: float | None):
    """One flash step: fold a chunk (q [M, H], k/v [L, H], mask bool[M, L]) into
    state = (m f32[M, 1], l f32[M, 1], acc f32[M, H]). Masked keys get probability 0, so
    rows that see no key in the chunk keep their state exactly."""
    m_prev, l_prev, acc = state
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
    return m_next, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def zero_dead_keys(v, c, chunk_len: int, kv_len):
    """v [L, H] with keys at or past kv_len zeroed: their buffer rows may hold stale bits
    (even NaN), and 0 * NaN would leak through the masked probabilities."""
    key = c * chunk_len + jax.lax.broadcasted_iota(jnp.int32, (chunk_len, 1), 0)
    return jnp.where(key < kv_len, v, jnp.zeros_like(v))
