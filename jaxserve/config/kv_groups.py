"""KV-cache groups: which layers share a block table, and which cache tensor each layer uses
(vLLM's hybrid KV cache manager), plain Python on config values.

A model whose layers attend to everything keeps one group: one block table per sequence,
every layer its own cache tensor [P, S, K, H] at the same block ids, each block holding the
KV of all L layers. When some layers slide a window over the sequence (Gemma 2/3, GPT-OSS,
Mistral), the keys before a window layer's window are never read again, so those layers
form groups of their own whose blocks are freed as the sequence moves on:

* the layers are split by kind (full attention, or a window of W tokens) into groups of k
  layers, k the size of the smallest kind (Gemma 3's 5:1 pattern: one full group and five
  window groups of k layers each; a kind whose count k does not divide gets a last, partly
  empty group);
* there are k cache tensors ("slots"); layer r of each group reads and writes slot r, with
  its group's block table. A block id belongs to one group at a time, so every block is the
  KV of k layers, whichever group holds it, and all groups draw from one pool;
* a full group holds ceil(n / S) blocks of an n-token sequence; a window group holds only
  the blocks its next queries can see (core/kv_cache_manager.py frees the others).

hybrid=False keeps one group whatever the windows (every layer holds the whole sequence).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KVGroups:
    windows: tuple  # per group: None (full attention) or its sliding window in tokens
    layer_group: tuple  # per layer: its group
    layer_slot: tuple  # per layer: the cache tensor (slot) it reads and writes
    num_slots: int  # k: cache tensors, i.e. layers per block

    @classmethod
    def single(cls, num_layers: int) -> KVGroups:
        """One group of every layer, each with its own cache tensor."""
        return cls((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def for_windows(cls, sliding_windows: tuple, hybrid: bool = True) -> KVGroups:
        """The groups of a model whose layer i has window sliding_windows[i] (None: full)."""
        num_layers = len(sliding_windows)
        if not hybrid or all(w is None for w in sliding_windows):
            return cls.single(num_layers)
        kinds = sorted(set(sliding_windows), key=lambda w: (w is not None, w or 0))
        members = {w: [i for i, x in enumerate(sliding_windows) if x == w] for w in kinds}
        k = min(len(layers) for layers in members.values())
        windows, group, slot = [], [0] * num_layers, [0] * num_layers
        for w in kinds:
            for r, layer in enumerate(members[w]):
                group[layer], slot[layer] = len(windows) + r // k, r % k
            windows += [w] * -(-len(members[w]) // k)
        return cls(tuple(windows), tuple(group), tuple(slot), k)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether some group frees blocks behind its window."""
        return any(w is not None for w in self.windows)

    def tokens_held(self, num_blocks: int, block_size: int) -> int:
        """The tokens num_blocks blocks hold in every layer (a block holds num_slots)."""
        return num_blocks * block_size * self.num_slots // len(self.layer_slot)

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks (of k layers each) one sequence of num_tokens holds at most while it
        computes `chunk` tokens a step (1: decoding): ceil(n / S) per full group, and per
        window group the blocks its window and the chunk span."""
        full = -(-num_tokens // block_size)
        span = lambda w: (w + chunk - 2) // block_size + 2  # noqa: E731
        return sum(full if w is None else min(full, span(w)) for w in self.windows)


def describe_groups(groups: KVGroups) -> str:
    """The groups for the start-up log and `jaxserve plan`: '' for one full group."""
    if not groups.hybrid:
        return ""
    kinds = [(w, groups.windows.count(w)) for w in dict.fromkeys(groups.windows)]
    parts = [f"{n} {'full' if w is None else f'window-{w}'}" for w, n in kinds]
    return (f"; KV groups of {groups.num_slots} layers: {', '.join(parts)} (a block holds "
            "one group's layers; window layers hold only their window)")


def kv_groups_for(config) -> KVGroups:
    """The KV groups an engine of `config` (an EngineConfig) uses: its model's windows in
    groups, or one group of every layer when hybrid_kv_cache is off. Layers of several
    kinds share slots only on a backend with shared_kv_slots (backend_capabilities.py: the
    JAX one) and with an unquantized cache (a quantized cache's scales are per layer);
    elsewhere such a model keeps one group."""
    from jaxserve.config.backend_capabilities import supports
    from jaxserve.models import model_family

    hf = config.model.hf_config
    windows = model_family(hf).arch_from_hf(hf).sliding_windows
    groups = KVGroups.for_windows(windows, config.cache.hybrid_kv_cache)
    if groups.num_groups > 1 and (not supports(config.backend, "shared_kv_slots")
                                  or config.cache.kv_cache_dtype != "auto"):
        return KVGroups.single(len(windows))
    return groups
