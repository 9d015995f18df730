"""Shapes-only inputs (jax.ShapeDtypeStruct) of the attention kernels for a padded (T, R)
bucket, for lowering them (jax.export) without building arrays: abstract_case for the
ragged paged attention kernels, abstract_mla_case for the MLA (latent attention) kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.backends.jax.batch import Batch


def abstract_case(num_tokens, num_rows, num_heads, num_kv_heads, head_dim, block_size,
                  num_pages, width, dtype):
    def sds(shape, dt=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dt)

    T, R = num_tokens, num_rows
    batch = Batch(sds((T,)), sds((T,)), sds((T,)), sds((R + 1,)), sds((R,)), sds((R, width)),
                  sds((1,)), sds((R,)))
    cache = sds((num_pages, block_size, num_kv_heads, head_dim), dtype)
    return sds((T, num_heads, head_dim), dtype), cache, cache, batch


def abstract_mla_case(num_tokens, num_rows, num_heads, block_size, num_pages, width, dtype,
                      latent=512, rope=64):
    """ShapeDtypeStructs of (q_latent, q_rope, cache, batch) for a (T, R) bucket."""
    def sds(shape, dt=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dt)

    T, R = num_tokens, num_rows
    batch = Batch(sds((T,)), sds((T,)), sds((T,)), sds((R + 1,)), sds((R,)), sds((R, width)),
                  sds((1,)), sds((R,)))
    return (sds((T, num_heads, latent), dtype), sds((T, num_heads, rope), dtype),
            sds((num_pages, block_size, latent + rope), dtype), batch)
