"""A layer's attention on the mesh: write the step's K/V into the paged cache, then attend.

Both halves run per `model` shard inside one shard_map: each device holds the query heads
[T, N / model, H] and the kv-head slice of the caches [P, S, K' / model, H] that go together
(mesh.py replicates kv heads up to one per device when there are fewer), so the scatter and
the attention kernel never see another device's heads and need no collective. Everything in
the batch is replicated. On a one-device mesh the shard_map is skipped. attention_for picks
the ragged paged attention implementation for an attention_backend setting, platform and
device kind (config/accelerators.py: TPU v2/v3 cannot run the TPU kernel; v4 and newer get
it with their generation's tiles and VMEM budget).

A quantized cache (kv_cache_dtype fp8 / int8) comes per layer as (k_cache, v_cache, k_scale,
v_scale), the scales f32[K'] split over `model` like the cache's kv heads: the step's keys
and values are quantized before the write, and the scales folded into the queries and the
output (kv_quant.attend_quantized), so every attention implementation reads plain one-byte
values.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxserve.backends.jax.kv_quant import attend_quantized, finite_kv
from jaxserve.config.accelerators import Accelerator, accelerator_for
from jaxserve.config.engine_config import JAX_ATTENTION_BACKENDS
from jaxserve.config.mesh import KV_CACHE_SPEC, MODEL
from jaxserve.kernels_pallas import cpu_attention, ref
from jaxserve.kernels_pallas.ref import write_kv

logger = logging.getLogger(__name__)

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_HEADS = PartitionSpec(None, MODEL, None)  # [T, N | K', H]
_CACHE = PartitionSpec(*KV_CACHE_SPEC)  # [P, S, K', H]
KV_SCALE_SPEC = (MODEL,)  # a quantized cache's scales, f32[K']: split like its kv heads
_SCALE = PartitionSpec(*KV_SCALE_SPEC)
_SINKS = PartitionSpec(MODEL)  # attention sinks, f32[N]: split like the query heads


def make_attend(attention_fn: Callable, mesh: Mesh, kv_dtype=None) -> Callable:
    """attend(q, k, v, kv_cache, batch, *, scale, sliding_window, soft_cap, sinks) -> (out,
    kv_cache) for the models; attention_fn is a ragged paged attention with ref.py's
    signature; sinks f32[N] (or None) split over `model` like the query heads. kv_dtype: the one-byte format of a quantized cache (kv_quant.value_dtype),
    whose layers come with their scales; None: the model's dtype."""

    def local(q, k, v, k_cache, v_cache, batch, sinks, *scales, scale, sliding_window,
              soft_cap):
        k, v = finite_kv(k), finite_kv(v)  # (0 x NaN: one request's NaN would reach others)
        options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if sinks is not None:  # only then: implementations without sinks never see the word
            options["sinks"] = sinks
        if scales:
            return attend_quantized(attention_fn, write_kv, q, k, v, k_cache, v_cache,
                                    *scales, batch, kv_dtype=kv_dtype, **options)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        return attention_fn(q, k_cache, v_cache, batch, **options), k_cache, v_cache

    def attend(q, k, v, kv_cache, batch, *, scale, sliding_window=None, soft_cap=None,
               sinks=None):
        fn = functools.partial(local, scale=scale, sliding_window=sliding_window,
                               soft_cap=soft_cap)
        caches, scales = kv_cache[:2], tuple(kv_cache[2:])
        if mesh.shape[MODEL] > 1:
            sink_spec = None if sinks is None else _SINKS
            fn = jax.shard_map(fn, mesh=mesh,
                               in_specs=(_HEADS, _HEADS, _HEADS, _CACHE, _CACHE,
                                         PartitionSpec(), sink_spec) + (_SCALE,) * len(scales),
                               out_specs=(_HEADS, _CACHE, _CACHE), check_vma=False)
        out, k_cache, v_cache = fn(q, k, v, *caches, batch, sinks, *scales)
        return out, (k_cache, v_cache) + scales

    return attend


def attention_for(backend: str, platform: str, head_dim: int | None = None,
                  device_kind: str | None = None) -> Callable:
    """The ragged paged attention for an attention_backend setting on a JAX device
    (its .platform and .device_kind).

    auto takes the platform's Pallas kernel on TPU and GPU, the XLA:CPU-tuned cpu_attention on
    the CPU, and the reference elsewhere: also on a TPU generation the kernel cannot run on
    (v2, v3: one log line says why) and on a GPU for a head_dim its kernel cannot tile. On a
    TPU generation the table knows, the kernel gets that generation's tiles and VMEM budget;
    on an unknown device_kind, its defaults. Every choice computes the reference's function
    (tests/kernels/test_ref_attention.py and the kernel tests check them against it). Raises
    ValueError for pallas on a platform, generation or head_dim without a kernel.
    """
    if backend not in JAX_ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(JAX_ATTENTION_BACKENDS)}, "
                         f"got {backend!r}.")
    kernel = "tpu" if platform == "tpu" else "gpu" if platform in _GPU_PLATFORMS else None
    if backend == "pallas" and kernel is None:
        raise ValueError(
            f"attention_backend='pallas' needs a TPU or GPU, but the engine runs on {platform}. "
            "Use 'interpret' (the TPU kernel in Pallas interpret mode; 'interpret-gpu' for the "
            "GPU kernel; both slow), 'reference' (the pure-JAX reference) or 'auto'.")
    device = accelerator_for(platform, device_kind) if kernel else None
    if device is not None and not device.kernel and backend in ("auto", "pallas"):
        if backend == "pallas":
            raise ValueError(
                f"attention_backend='pallas': {device.name} cannot run the {kernel.upper()} "
                f"Pallas kernel: {device.kernel_note}. Use 'auto' or 'reference' (the pure-JAX "
                "reference attention).")
        logger.info("Attention: %s: %s; using the reference attention (attention_backend=%s "
                    "on %s).", device.name, device.kernel_note, backend, platform)
        return ref.ragged_paged_attention
    if kernel == "gpu" and head_dim is not None and backend in ("auto", "pallas"):
        from jaxserve.kernels_pallas import gpu_ragged_paged_attention

        if not gpu_ragged_paged_attention.supports(head_dim):
            if backend == "pallas":
                raise ValueError(f"The GPU kernel needs a power-of-two head_dim >= 16; this model "
                                 f"has {head_dim}. Use attention_backend='reference' or 'auto'.")
            logger.info("Attention: the GPU kernel cannot tile head_dim %d.", head_dim)
            kernel = None
    if backend in ("auto", "pallas"):
        impl = kernel or ("cpu" if platform == "cpu" else "reference")
    elif backend == "reference":
        impl = "reference"
    else:
        impl = "gpu" if backend == "interpret-gpu" else "tpu"
    interpret = backend.startswith("interpret")
    tiled = device if impl == "tpu" and not interpret and device is not None else None
    fn, name = _implementation(impl, interpret=interpret, device=tiled)
    logger.info("Attention: %s (attention_backend=%s on %s).", name, backend, platform)
    return fn


def _implementation(impl: str, *, interpret: bool,
                    device: Accelerator | None = None) -> tuple[Callable, str]:
    """One implementation and its name for the log. The Pallas kernel modules are imported
    only when chosen, so that the other implementations never depend on them. device: the
    TPU generation whose tiles the TPU kernel takes (None: the kernel's defaults)."""
    if impl == "cpu":
        return cpu_attention.ragged_paged_attention, "cpu_attention, the XLA:CPU-tuned pure JAX"
    if impl == "reference":
        return ref.ragged_paged_attention, "the pure-JAX reference (kernels_pallas/ref.py)"
    if impl == "tpu":
        from jaxserve.kernels_pallas import ragged_paged_attention as kernel
    else:
        from jaxserve.kernels_pallas import gpu_ragged_paged_attention as kernel
    mode = "in Pallas interpret mode (slow)" if interpret else "compiled"
    options = {"interpret": interpret}
    if device is not None and device.tiles is not None:
        from jaxserve.kernels_pallas.kernel_layout import TileRule

        tiles = device.tiles
        options["tiling"] = TileRule(**dataclasses.asdict(tiles))
        budget = ("Mosaic's default VMEM" if tiles.vmem_limit_bytes is None
                  else f"{tiles.vmem_limit_bytes >> 20} MiB of VMEM")
        mode += (f", with {device.name}'s tiles ({tiles.keys_per_chunk} keys per chunk, "
                 f"{tiles.min_rows}-{tiles.max_tile_rows} query rows, {budget})")
    return (functools.partial(kernel.ragged_paged_attention, **options),
            f"the {impl.upper()} Pallas kernel ({kernel.__name__}), {mode}")
