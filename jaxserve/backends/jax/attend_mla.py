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

A quantized latent cache (kv_cache_dtype fp8 / int8) comes per layer as (cache, c_scale,
r_scale), f32[1] each, replicated: the latent c and the rope key k_r of an entry are
quantized with their own scale (kv_quant.calibrated_scales with latent=True), and as for a
multi-head cache the scales never enter the kernels:

    q_latent . (c_q * s_c) + q_rope . (k_r,q * s_r) = (q_latent * s_c) . c_q + (q_rope * s_r) . k_r,q
    sum_j p_j (c_q,j * s_c) = s_c * sum_j p_j c_q,j

so the queries are scaled before the kernel, which reads one-byte values (kv_dtype), and its
output after.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxserve.backends.jax.kv_quant import finite_kv, quantize, scale_output, scale_queries
from jaxserve.config.engine_config import JAX_ATTENTION_BACKENDS
from jaxserve.config.mesh import MODEL
from jaxserve.kernels_pallas import mla_ref

logger = logging.getLogger(__name__)

LATENT_CACHE_SPEC = ()  # [P, S, C + R]: replicated over every axis
_HEADS = PartitionSpec(None, MODEL, None)  # [T, N, C | R]
_KERNELS = {"tpu": "jaxserve.kernels_pallas.ragged_paged_mla",
            "gpu": "jaxserve.kernels_pallas.gpu_ragged_paged_mla"}


def make_attend_latent(mla_fn: Callable, mesh: Mesh, kv_dtype=None) -> Callable:
    """attend_latent(q_latent, q_rope, entry, kv_cache, batch, *, scale) -> (out [T, N, C],
    kv_cache) for models/jax/deepseek.py; kv_cache = (latent cache [P, S, C + R],), or with
    its (c_scale, r_scale) when quantized; entry the step's [T, C + R]; mla_fn a ragged
    paged MLA with mla_ref's signature. kv_dtype: a quantized cache's one-byte format
    (kv_quant.value_dtype); None: the model's dtype."""

    def local(q_latent, q_rope, entry, cache, batch, *scales, scale):
        entry = finite_kv(entry)  # (0 x NaN: one request's NaN would reach others)
        if not scales:
            cache = mla_ref.write_latent(cache, entry, batch.slot_mapping)
            return mla_fn(q_latent, q_rope, cache, batch, scale=scale), cache
        c_scale, r_scale = scales
        latent = q_latent.shape[-1]
        quantized = jnp.concatenate(  # [T, C + R], each part by its own scale
            [quantize(entry[:, None, :latent], c_scale, kv_dtype),
             quantize(entry[:, None, latent:], r_scale, kv_dtype)], axis=-1)[:, 0]
        cache = mla_ref.write_latent(cache, quantized, batch.slot_mapping)
        out = mla_fn(scale_queries(q_latent, c_scale), scale_queries(q_rope, r_scale), cache,
                     batch, scale=scale, kv_dtype=kv_dtype)
        return scale_output(out, c_scale), cache

    def attend_latent(q_latent, q_rope, entry, kv_cache, batch, *, scale):
        fn = functools.partial(local, scale=scale)
        scales = tuple(kv_cache[1:])
        if mesh.shape[MODEL] > 1:
            rep = PartitionSpec()
            fn = jax.shard_map(fn, mesh=mesh,
                               in_specs=(_HEADS, _HEADS, rep, rep, rep) + (rep,) * len(scales),
                               out_specs=(_HEADS, rep), check_vma=False)
        out, cache = fn(q_latent, q_rope, entry, kv_cache[0], batch, *scales)
        return out, (cache,) + scales

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
