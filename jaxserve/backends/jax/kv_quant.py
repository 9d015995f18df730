"""The quantized KV cache (kv_cache_dtype fp8 / int8) in JAX: quantize, attend, calibrate.

A quantized cache holds one byte per element: fp8 (e4m3, largest value 448) or int8
(-127..127), x ~= stored * scale, with a float32 scale per layer and kv head for keys and
another for values (the formats and the scale rule: kv_formats.py). The scales never enter
the attention kernels: for kv head k,

    q . (k_q * s_k) = (q * s_k) . k_q          sum_l p_l (v_q,l * s_v) = s_v * sum_l p_l v_q,l

so `attend` (attend.py) quantizes the step's new keys and values before writing them,
multiplies the queries of kv head k by s_k, and the attention's output by s_v. A kernel
only reads one-byte values and converts them to its compute dtype (the `kv_dtype` keyword
of every ragged_paged_attention).

`calibrate` runs the model once over kv_formats.CALIBRATION_TEXT with `calibration_attend`,
which records each layer's largest |k| and |v| per kv head. Shape letters as in
docs/architecture.md: T tokens, N query heads, K kv heads, G = N / K, H head dim.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends.jax.batch import Batch
from jaxserve.backends.jax.weights import place
from jaxserve.backends.kv_formats import cache_element, calibration_token_ids, is_quantized, largest
from jaxserve.backends.kv_formats import scales_from_amax as host_scales

logger = logging.getLogger(__name__)

FORMATS = {"fp8_e4m3": jnp.float8_e4m3fn, "int8": jnp.int8}

__all__ = ["attend_quantized", "calibrate", "calibrated_scales", "calibration_attend_latent",
           "calibration_token_ids", "is_quantized", "quantize", "scale_output", "scale_queries",
           "scales_from_amax", "value_dtype"]


def value_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The dtype of the cache's values: the model's for auto, else the one-byte format's."""
    if not is_quantized(kv_cache_dtype):
        return jnp.dtype(model_dtype)
    return jnp.dtype(FORMATS[cache_element("", kv_cache_dtype)])


def scales_from_amax(amax, kv_cache_dtype: str) -> jax.Array:
    """kv_formats.scales_from_amax on a device array (f32[K] -> f32[K])."""
    return jnp.asarray(host_scales(np.asarray(amax), kv_cache_dtype))


def finite_kv(x):
    """x with NaN as 0 and +-inf as the dtype's largest values: what the step writes into the
    KV cache. Every attention implementation weighs the keys and values it must not see by
    0 (other sequences' tokens in a tile, stale slots of a reused block), and 0 x NaN is NaN:
    one request whose values overflowed (a bad LoRA adapter, a float16 overflow) would reach
    every request attending beside it, or later to its blocks. Finite values pass unchanged."""
    return jnp.nan_to_num(x, nan=0.0)


def quantize(x, scale, dtype):
    """x [T, K, H] / scale f32[K] in the one-byte dtype: int8 rounds to nearest; both
    saturate at the format's largest value (a plain fp8 cast would give NaN past it)."""
    dtype = jnp.dtype(dtype)
    top = largest(dtype.name)
    y = x.astype(jnp.float32) / scale[None, :, None]
    if dtype == jnp.int8:
        y = jnp.round(y)
    return jnp.clip(y, -top, top).astype(dtype)


def _per_query_head(scale, num_heads: int):
    """f32[K] -> f32[1, N, 1]: each query head takes its kv head's scale."""
    return jnp.repeat(scale, num_heads // scale.shape[0])[None, :, None]


def scale_queries(q, k_scale):
    """q [T, N, H] times its kv head's key scale, in q's dtype."""
    return (q.astype(jnp.float32) * _per_query_head(k_scale, q.shape[1])).astype(q.dtype)


def scale_output(out, v_scale):
    """An attention output [T, N, H] over quantized values times its kv head's value scale."""
    return (out.astype(jnp.float32) * _per_query_head(v_scale, out.shape[1])).astype(out.dtype)


def attend_quantized(attention_fn, write_fn, q, k, v, k_cache, v_cache, k_scale, v_scale,
                     batch, **options):
    """What attend does for a quantized cache of one device: quantize and write the step's
    k, v [T, K, H] (write_fn(k_cache, v_cache, k_q, v_q, slot_mapping)), then attend with
    the scales folded into the queries and the output; options: the attention's keywords,
    kv_dtype (value_dtype's) among them. Returns (out, k_cache, v_cache)."""
    dtype = options["kv_dtype"]  # the cache may hold its bits (ref.kv_storage_dtype)
    k_cache, v_cache = write_fn(k_cache, v_cache, quantize(k, k_scale, dtype),
                                quantize(v, v_scale, dtype), batch.slot_mapping)
    out = attention_fn(scale_queries(q, k_scale), k_cache, v_cache, batch, **options)
    return scale_output(out, v_scale), k_cache, v_cache


# ----------------------------------------------------------------------------- calibration


def calibration_attend(q, k, v, amax, batch, *, scale, sliding_window=None, soft_cap=None,
                       sinks=None):
    """An `attend` for one sequence of T fresh tokens without a cache: dense causal
    attention, and amax = (f32[K], f32[K]) raised to the largest |k| and |v| per kv head."""
    del batch
    k_max, v_max = amax
    k_max = jnp.maximum(k_max, jnp.abs(k.astype(jnp.float32)).max((0, 2)))
    v_max = jnp.maximum(v_max, jnp.abs(v.astype(jnp.float32)).max((0, 2)))
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv, num_heads // num_kv, head_dim)
    s = jnp.einsum("tkgh,ukh->kgtu", qg, k.astype(jnp.float32)) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    pos = jnp.arange(num_tokens)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    s = jnp.where(mask, s, -jnp.inf)
    if sinks is not None:  # one more logit per head, dropped after the softmax
        sink = sinks.astype(jnp.float32).reshape(num_kv, -1, 1, 1)
        s = jnp.concatenate([s, jnp.broadcast_to(sink, s.shape[:-1] + (1,))], axis=-1)
    p = jax.nn.softmax(s, axis=-1)[..., :num_tokens]
    out = jnp.einsum("kgtu,ukh->tkgh", p, v.astype(jnp.float32))
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype), (k_max, v_max)


def calibration_attend_latent(q_latent, q_rope, entry, amax, batch, *, scale):
    """calibration_attend for a latent cache (multi-head latent attention, attend_mla.py):
    dense causal attention in the absorbed form over the step's entries [T, C + R], and
    amax = (f32[1], f32[1]) raised to the largest |latent| and |rope key|: the latent cache's
    two scales stand where a multi-head cache's key and value scales do, one "kv head"."""
    del batch
    latent = q_latent.shape[-1]
    entries = entry.astype(jnp.float32)
    c_max = jnp.maximum(amax[0], jnp.abs(entries[:, :latent]).max()[None])
    r_max = jnp.maximum(amax[1], jnp.abs(entries[:, latent:]).max()[None])
    q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32)
    s = jnp.einsum("tnl,ul->ntu", q, entries) * scale
    pos = jnp.arange(q.shape[0])
    p = jax.nn.softmax(jnp.where(pos[None, :] <= pos[:, None], s, -jnp.inf), axis=-1)
    out = jnp.einsum("ntu,uc->tnc", p, entries[:, :latent])
    return out.astype(q_latent.dtype), (c_max, r_max)


def _amax(graphdef, num_layers: int, num_kv_heads: int, attend, params, batch):
    from flax import nnx

    model = nnx.merge(graphdef, params)
    zeros = jnp.zeros((num_kv_heads,), jnp.float32)
    amax, _ = model([(zeros, zeros)] * num_layers, batch, attend)
    return jnp.stack([jnp.stack(pair) for pair in amax])  # f32[layers, 2, K]


def calibrate(graphdef, params, batch, num_layers: int, num_kv_heads: int,
              kv_cache_dtype: str, replicated=None, attend=calibration_attend) -> np.ndarray:
    """f32[layers, 2 (k, v), K] host scales for the model (graphdef, params) on the
    calibration batch (a batch.Batch of one sequence: token_ids and positions are read);
    replicated: the mesh's replicated sharding, so that every host reads the maxima;
    attend: calibration_attend_latent for a latent cache (K = 1: latent and rope key)."""
    amax = jax.jit(_amax, static_argnums=(0, 1, 2, 3), out_shardings=replicated)(
        graphdef, num_layers, num_kv_heads, attend, params, batch)
    if not amax.is_fully_addressable:  # several hosts: each holds a full copy
        amax = amax.addressable_data(0)
    amax = np.asarray(jax.device_get(amax))
    return host_scales(amax, kv_cache_dtype)


def calibrated_scales(config, graphdef, params, num_layers: int, num_kv_heads: int,
                      vocab_size: int, replicated, latent: bool = False) -> np.ndarray:
    """f32[layers, 2 (k, v), K] scales of config's kv_cache_dtype for the model (graphdef,
    params) on the calibration text, tokenized by config's tokenizer; logged. latent: a
    latent cache's f32[layers, 2 (latent, rope key), 1] (calibration_attend_latent)."""
    from jaxserve.inputs.tokenizer import load_tokenizer

    kv_cache_dtype = config.cache.kv_cache_dtype
    ids = calibration_token_ids(load_tokenizer(config.model.tokenizer), vocab_size,
                                config.model.max_model_len)
    num_tokens = len(ids)
    none = np.zeros(1, np.int32)
    batch = Batch(token_ids=ids, positions=np.arange(num_tokens, dtype=np.int32),
                  slot_mapping=np.zeros(num_tokens, np.int32), cu_q_lens=none, kv_lens=none,
                  block_tables=none[:, None], num_seqs=none, logits_indices=none)
    batch = jax.tree.map(lambda x: place(x, replicated), batch)  # every host: its devices
    scales = calibrate(graphdef, params, batch, num_layers, 1 if latent else num_kv_heads,
                       kv_cache_dtype, replicated,
                       calibration_attend_latent if latent else calibration_attend)
    logger.info("KV cache: %s (%s values), scales per layer and %s calibrated on %d tokens: "
                "%s %.3g..%.3g, %s %.3g..%.3g.", kv_cache_dtype,
                value_dtype(kv_cache_dtype, jnp.float32).name,
                "latent cache" if latent else "kv head", num_tokens,
                "latents" if latent else "keys", scales[:, 0].min(), scales[:, 0].max(),
                "rope keys" if latent else "values", scales[:, 1].min(), scales[:, 1].max())
    return scales
