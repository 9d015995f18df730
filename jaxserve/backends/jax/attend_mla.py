"""A multi-head latent attention layer (DeepSeek V2/V3) on the mesh: write the step's latent
entries into the paged latent cache, then attend in the absorbed form.

The latent cache of a layer, [P, S, C + R], is one entry per token shared by every head, so
each device of the `model` axis holds the whole cache (replicated, like a single kv head),
and its query heads [T, N / model, C] attend over it inside one shard_map: every device
writes the same entries into its own copy, and no collective is needed. mla_attention_for
picks the implementation for an attention_backend setting and platform, as
attend.attention_for does for multi-head attention: the Pallas TPU and GPU kernels
(kernels_pallas/ragged_paged_mla.py, gpu_ragged_paged_mla.py) on their hardware, the
reference (kernels_pallas/mla_ref.py) on the CPU.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxserve.config.engine_config import JAX_ATTENTION_BACKENDS
from jaxserve.config.mesh import MODEL
from jaxserve.kernels_pallas import mla_ref

logger = logging.getLogger(__name__)

LATENT_CACHE_SPEC = ()  # [P, S, C + R]: replicated over every axis
_HEADS = PartitionSpec(None, MODEL, None)  # [T, N, C | R]
_KERNELS = {"tpu": "jaxserve.kernels_pallas.ragged_paged_mla",
            "gpu": "jaxserve.kernels_pallas.gpu_ragged_paged_mla"}


def make_attend_latent(mla_fn: Callable, mesh: Mesh) -> Callable:
    """attend_latent(q_latent, q_rope, entry, kv_cache, batch, *, scale) -> (out [T, N, C],
    kv_cache) for models/jax/deepseek.py; kv_cache = (latent cache [P, S, C + R],), entry
    the step's [T, C + R]; mla_fn a ragged paged MLA with mla_ref's signature."""

    def local(q_latent, q_rope, entry, cache, batch, *, scale):
        cache = mla_ref.write_latent(cache, entry, batch.slot_mapping)
        return mla_fn(q_latent, q_rope, cache, batch, scale=scale), cache

    def attend_latent(q_latent, q_rope, entry, kv_cache, batch, *, scale):
        fn = functools.partial(local, scale=scale)
        if mesh.shape[MODEL] > 1:
            rep = PartitionSpec()
            fn = jax.shard_map(fn, mesh=mesh, in_specs=(_HEADS, _HEADS, rep, rep, rep),
                               out_specs=(_HEADS, rep), check_vma=False)
        out, cache = fn(q_latent, q_rope, entry, kv_cache[0], batch)
        return out, (cache,)

    return attend_latent


def mla_attention_for(backend: str, platform: str) -> Callable:
    """The ragged paged MLA for an attention_backend setting on a JAX platform: auto takes
    the platform's Pallas kernel on TPU and GPU and the reference elsewhere; interpret and
    interpret-gpu run the TPU and GPU kernels in Pallas interpret mode (slow); reference
    the pure-JAX reference. ValueError for pallas on a platform without a kernel."""
    if backend not in JAX_ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(JAX_ATTENTION_BACKENDS)}, "
                         f"got {backend!r}.")
    kernel = "tpu" if platform == "tpu" else "gpu" if platform in ("gpu", "cuda",
                                                                   "rocm") else None
    if backend == "pallas" and kernel is None:
        raise ValueError(
            f"attention_backend='pallas' needs a TPU or GPU, but the engine runs on {platform}. "
            "Use 'interpret' (the TPU MLA kernel in Pallas interpret mode; 'interpret-gpu' "
            "for the GPU one; both slow), 'reference' or 'auto'.")
    if backend in ("interpret", "interpret-gpu"):
        kernel, interpret = ("gpu" if backend == "interpret-gpu" else "tpu"), True
    elif backend == "reference" or kernel is None:
        logger.info("Latent attention (MLA): the pure-JAX reference (kernels_pallas/mla_ref.py)"
                    " (attention_backend=%s on %s).", backend, platform)
        return mla_ref.ragged_paged_mla
    else:
        interpret = False
    module = importlib.import_module(_KERNELS[kernel])
    logger.info("Latent attention (MLA): the %s Pallas kernel (%s), %s (attention_backend=%s "
                "on %s).", kernel.upper(), module.__name__,
                "in Pallas interpret mode (slow)" if interpret else "compiled", backend,
                platform)
    return functools.partial(module.ragged_paged_mla, interpret=interpret)
