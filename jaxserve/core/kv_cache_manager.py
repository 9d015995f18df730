"""KV-cache block accounting and automatic prefix caching (host side).

A pool of fixed-size blocks with reference counts. Block 0 is the null block: padding tokens
write into it, so it is never handed out (nor cached).

Prefix caching, as in vLLM v1: a full block is named by a hash chain, H(parent hash, its
block_size token ids, extra keys), so equal hashes mean equal prefixes up to and including
that block, and therefore equal KV (a causal model's KV at a position depends only on the
tokens up to it). Full blocks are registered under their hash once their tokens are
scheduled. A freed block keeps its hash and stays reusable until the pool hands it out again:
the free queue is kept in LRU order (least recently freed first), and a request frees its
blocks tail first, so the tail of a prefix is evicted before its head. A new request starts
with the longest run of cached blocks matching its leading blocks.

Groups (config/kv_groups.py): with sliding-window layers, a request holds one block list
per group (request.block_ids[g], all of one length, block i holding positions i*S..),
drawn from the one pool. A window group's list keeps only the blocks its next queries can
see: when the request is given room, blocks wholly before the window of its next query are
released (their entries become the null block 0) and never allocated. A block is named per
group (a group's blocks hold other layers' KV than another's); a prefix hit is the longest
run of leading blocks whose full groups' blocks are all cached and whose window groups'
blocks are cached within the window of the first position left to compute.

Two kinds of request never read the cache (they still register their blocks for others):
- prompt_logprobs: every prompt position must be computed to be scored;
- any penalty (presence, frequency, repetition): the device-side penalty state is built from
  the tokens fed to the model each step, so tokens served from the cache would never count.
- mean or first-token pooling (core/pooling.py): every prompt position's hidden state is
  pooled (last-token pooling reads the cache: its last token is always computed).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from jaxserve.core.request import Request

# The parent of a request's first block. Fixed, so hashes are comparable across requests.
ROOT_HASH = hashlib.blake2b(b"jaxserve prefix cache root", digest_size=32).digest()


def hash_block(parent: bytes, token_ids: np.ndarray, extra_keys: tuple = ()) -> bytes:
    """The hash of one full block: collision-safe (BLAKE2b-256) over the parent's digest,
    the block's token ids as int32 bytes, and the extra keys (LoRA id, ... ; empty now).
    Parent and tokens have fixed lengths, so the concatenation is unambiguous."""
    h = hashlib.blake2b(parent, digest_size=32)
    h.update(np.ascontiguousarray(token_ids, np.int32).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    queries: int  # tokens looked up, at each admission of a request that may read the cache
    hits: int  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Blocks, reference counts, the free queue (LRU order) and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, np.int32)
        self.ref_counts[0] = 1  # the null block is never freed
        # Free blocks, least recently freed first. An OrderedDict so that a cache hit on a
        # free block takes it out in O(1) (the pool can hold ~100k blocks).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # hash (or (group, hash): KVCacheManager._key) -> block, for full blocks with known KV
        self.cached: dict = {}
        self.block_hash: dict[int, bytes] = {}  # the reverse map

    @property
    def num_free(self) -> int:
        """Blocks with no holder, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def free_order(self) -> list[int]:
        """The free queue, next to be handed out first (for tests and debugging)."""
        return list(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """count blocks, least recently freed first (evicting their hashes); None if there
        are not enough (nothing changes then)."""
        if count > len(self._free):
            return None
        free, block_hash, ref_counts = self._free, self.block_hash, self.ref_counts
        blocks = []
        for _ in range(count):  # (one at a time: mostly one, as a decoding request grows)
            block = free.popitem(last=False)[0]
            digest = block_hash.pop(block, None)
            if digest is not None:
                del self.cached[digest]
            ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks (a hit): free ones leave the free queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def register(self, block: int, digest) -> None:
        """Name a full block by its hash, unless another block already holds that hash (the
        same prefix computed twice): the duplicate stays unnamed and is reused first."""
        if digest not in self.cached and block not in self.block_hash:
            self.cached[digest] = block
            self.block_hash[block] = digest

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, in the given order: blocks that become free
        join the end of the free queue (evicted last), keeping their hash."""
        for block in block_ids:
            if block == 0 or self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} released more often than it was allocated")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None


class KVCacheManager:
    """Gives each request the blocks its computed tokens need, finds its cached prefix, and
    takes the blocks back. enable_caching=False: no hashing, lookups or registration.
    windows: per KV group, None (full attention) or its sliding window (KVGroups.windows)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 windows: tuple = (None,)) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.pool = BlockPool(num_blocks)
        self.queries = 0
        self.hits = 0

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (0 when idle; free cached blocks count as free)."""
        usable = self.pool.num_blocks - 1
        return (usable - self.pool.num_free) / usable

    @property
    def usable_blocks(self) -> int:
        return self.pool.num_blocks - 1  # block 0 is the null block

    @property
    def capacity_tokens(self) -> int:
        """Tokens the usable blocks hold in one group's layers."""
        return self.usable_blocks * self.block_size

    @property
    def hit_rate(self) -> float:
        return self.stats.hit_rate

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries, self.hits)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_kept(self, group: int, position: int) -> int:
        """The first block group g needs for queries from `position` on (0 for a full
        group; the block of the earliest key a window still sees)."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    # ---- prefix cache -------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> list[bytes]:
        """Extend request.block_hashes to cover every full block of its tokens (prompt and
        outputs alike, so a preempted request finds its own blocks again)."""
        hashes, size = request.block_hashes, self.block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), request.num_tokens // size):
            parent = hash_block(parent, request.token_ids[i * size: (i + 1) * size],
                                request.extra_keys)
            hashes.append(parent)
        return hashes

    @staticmethod
    def _key(group: int, digest: bytes):
        """A block's name in the pool: its hash (group 0), or (group, hash)."""
        return digest if group == 0 else (group, digest)

    def get_computed_blocks(self, request: Request) -> list:
        """The longest run of cached blocks matching the leading full blocks of a request
        that holds none yet, one entry per block: its id (one group), or a tuple of its id
        in each group (0 where a window group no longer needs it). At least the last token
        is left to compute (its logits are needed), so at most (num_tokens - 1) //
        block_size blocks. Takes no reference: pass the result to allocate_slots."""
        if (not self.enable_caching or request.num_computed_tokens or request.block_ids
                or not request.reads_prefix_cache):
            return []
        limit = (request.num_tokens - 1) // self.block_size
        hashes = self.update_block_hashes(request)[:limit]
        cached = self.pool.cached
        if len(self.windows) == 1 and self.windows[0] is None:
            blocks = []
            for digest in hashes:
                block = cached.get(digest)
                if block is None:
                    break
                blocks.append(block)
            return blocks
        n = len(hashes)
        for g, window in enumerate(self.windows):  # full groups: a run from the start
            if window is None:
                run = 0
                while run < n and self._key(g, hashes[run]) in cached:
                    run += 1
                n = run
        changed = True
        while changed:  # window groups: every block in the window before n; n only shrinks
            changed = False
            for g, window in enumerate(self.windows):
                while window is not None and n > 0:
                    lo = self._first_kept(g, n * self.block_size)
                    missing = [i for i in range(n - 1, lo - 1, -1)
                               if self._key(g, hashes[i]) not in cached]
                    if not missing:
                        break
                    n, changed = missing[0], True
        return [tuple(cached[self._key(g, hashes[i])]
                      if i >= self._first_kept(g, n * self.block_size) else 0
                      for g in range(len(self.windows))) for i in range(n)]

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted lookup (queries: the tokens looked up; hits: those served)."""
        if self.enable_caching and request.reads_prefix_cache:
            self.queries += request.num_tokens
            self.hits += num_hit_tokens

    # ---- allocation ---------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence = ()) -> bool:
        """Make room for num_new_tokens more computed tokens, after computed_blocks (cache
        hits from get_computed_blocks, for a request that holds no blocks yet). False, with
        nothing changed but blocks behind a window released, if the pool cannot.

        On success the request's newly full blocks are registered under their hashes: their
        tokens are known and their KV is written in this step, before any later step reads
        it. A request admitted later in the same step may hit them too: each layer writes
        the step's KV before its attention reads the cache.
        """
        size = self.block_size
        if not computed_blocks and request.block_ids:  # the common case: room, nothing to name
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(request.block_ids[0]) * size and (not self.enable_caching or min(
                    total, request.num_tokens) // size <= request.num_registered_blocks):
                return True
        if not self._allocate(request, num_new_tokens, computed_blocks):
            return False
        self._set_room(request)
        return True

    def _allocate(self, request: Request, num_new_tokens: int,
                  computed_blocks: Sequence) -> bool:
        size, groups = self.block_size, len(self.windows)
        lists = request.block_ids or [[] for _ in range(groups)]  # set once it succeeds
        if computed_blocks and isinstance(computed_blocks[0], tuple):  # one id per group
            hits = [list(column) for column in zip(*computed_blocks)]
        else:
            hits = [list(computed_blocks)] if groups == 1 else [[] for _ in range(groups)]
        start = request.num_computed_tokens + len(computed_blocks) * size  # first new query
        total = start + num_new_tokens
        need = self.blocks_needed(total)
        if request.block_ids:
            self._drop_behind_windows(request, start)
        held = len(lists[0]) + len(computed_blocks)
        first = [max(held, self._first_kept(g, start)) for g in range(groups)]
        missing = sum(max(0, need - f) for f in first)
        if computed_blocks:
            # Free hits leave the free queue when touched: count them out first, so that a
            # failure leaves everything (the LRU order included) as it was.
            touched = [b for column in hits for b in column if b]
            evictable = sum(1 for b in touched if self.pool.ref_counts[b] == 0)
            if missing > self.pool.num_free - evictable:
                return False
            self.pool.touch(touched)
            request.block_ids, request.dropped_blocks = lists, [0] * groups
            for blocks, column in zip(lists, hits):
                blocks.extend(column)
            request.num_registered_blocks = len(computed_blocks)
        if missing > 0:
            new = self.pool.allocate(missing)
            if new is None:
                return False
            if not request.block_ids:
                request.block_ids, request.dropped_blocks = lists, [0] * groups
            for g, blocks in enumerate(lists):
                count = max(0, need - first[g])
                blocks.extend([0] * (need - count - len(blocks)))  # behind the window
                blocks.extend(new[:count])
                new = new[count:]
        # Only blocks of known tokens are named: not those holding proposals (speculative
        # decoding writes their KV too, but they may be rejected).
        num_full = min(total, request.num_tokens) // self.block_size
        if self.enable_caching and num_full > request.num_registered_blocks:
            self._register(request, num_full)
        return True

    def _drop_behind_windows(self, request: Request, start: int) -> None:
        """Release each window group's blocks wholly before the window of the query at
        `start` (oldest first: they are evicted first); their entries become 0."""
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            blocks, first = request.block_ids[g], request.dropped_blocks[g]
            end = min(self._first_kept(g, start), len(blocks))
            if end > first:
                self.pool.release([b for b in blocks[first:end] if b])
                blocks[first:end] = [0] * (end - first)
                request.dropped_blocks[g] = end

    def _register(self, request: Request, num_full: int) -> None:
        hashes = self.update_block_hashes(request)
        for g, blocks in enumerate(request.block_ids):
            for i in range(request.num_registered_blocks, num_full):
                if blocks[i]:
                    self.pool.register(blocks[i], self._key(g, hashes[i]))
        request.num_registered_blocks = num_full

    def _set_room(self, request: Request) -> None:
        # request.kv_room: the computed-token count up to which allocate_slots has nothing to
        # do for it (its blocks hold them and no block fills): the scheduler's check before
        # it calls. Kept with every change to its blocks and registered count.
        room = len(request.block_ids[0]) * self.block_size if request.block_ids else 0
        if self.enable_caching:
            room = min(room, (request.num_registered_blocks + 1) * self.block_size - 1)
        request.kv_room = room

    def free(self, request: Request) -> None:
        # Tail first: the blocks at the end of a prefix are the least likely to be shared,
        # so they should be evicted first. (Without caching the order does not matter; it
        # stays as it always was.)
        for blocks in request.block_ids:
            blocks = [b for b in blocks if b]
            self.pool.release(blocks[::-1] if self.enable_caching else blocks)
        request.block_ids = []
        request.dropped_blocks = []
        request.num_registered_blocks = 0
        request.kv_room = 0

    def reset_prefix_cache(self) -> None:
        """Forget every hash (blocks and reference counts stay): for when a step that may
        have registered blocks did not run, so their KV may never have been written, and to
        flush the cache on request (running requests keep their blocks)."""
        self.pool.cached.clear()
        self.pool.block_hash.clear()
