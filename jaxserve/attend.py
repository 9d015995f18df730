"""A layer's attention on the mesh: write the step's K/V into the paged cache, then attend.

Both halves run per `model` shard inside one shard_map: each device holds the query heads
[T, N / model, H] and the kv-head slice of the caches [P, S, K' / model, H] that go together
(mesh.py replicates kv heads up to one per device when there are fewer), so the scatter and
the attention kernel never see another device's heads and need no collective. Everything in
the batch is replicated. On a one-device mesh the shard_map is skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxserve.kernels_pallas.ref import write_kv
from jaxserve.mesh import KV_CACHE_SPEC, MODEL

_HEADS = PartitionSpec(None, MODEL, None)  # [T, N | K', H]
_CACHE = PartitionSpec(*KV_CACHE_SPEC)  # [P, S, K', H]


def make_attend(attention_fn: Callable, mesh: Mesh) -> Callable:
    """attend(q, k, v, kv_cache, batch, *, scale, sliding_window) -> (out, kv_cache) for the
    models; attention_fn is a ragged paged attention with ref.py's signature."""

    def local(q, k, v, k_cache, v_cache, batch, *, scale, sliding_window):
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        out = attention_fn(q, k_cache, v_cache, batch, scale=scale,
                           sliding_window=sliding_window)
        return out, k_cache, v_cache

    def attend(q, k, v, kv_cache, batch, *, scale, sliding_window=None):
        fn = functools.partial(local, scale=scale, sliding_window=sliding_window)
        if mesh.shape[MODEL] > 1:
            fn = jax.shard_map(fn, mesh=mesh,
                               in_specs=(_HEADS, _HEADS, _HEADS, _CACHE, _CACHE, PartitionSpec()),
                               out_specs=(_HEADS, _CACHE, _CACHE), check_vma=False)
        out, k_cache, v_cache = fn(q, k, v, *kv_cache, batch)
        return out, (k_cache, v_cache)

    return attend
