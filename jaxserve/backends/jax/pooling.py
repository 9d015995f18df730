"""The pooling function of a pooling engine's steps (device side): what each row of a step
contributes to its request's embedding or classification, in one f32 array.

It runs after the step, compiled per (T, R) bucket like the step (bucket_compiler.py's
("pool", T, R)), on the step's final hidden states, which never leave the device:

    pool(params, hidden, rows) -> f32[R, X]
    hidden: [T, D] (the step's `hidden`); rows: i32[T + R], core/pooling.py's pool_inputs
    X: D, or L with a classification head

MEAN sums each row's tokens (tokens named R, padding, are dropped); LAST and CLS pick one
token per row. The classification head (linear, no bias) applies to either, so the host can
add a long prompt's chunk sums of logits as it adds sums of hidden states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pool_rows(model, hidden, rows, pooling_type: str, head: bool):
    """hidden [T, D], rows i32[T + R] -> f32[R, X] (see the module docstring); model: the
    merged Flax model (its `classify` when head)."""
    num_tokens = hidden.shape[0]
    num_rows = rows.shape[0] - num_tokens
    if pooling_type == "MEAN":
        pooled = jax.ops.segment_sum(hidden.astype(jnp.float32), rows[:num_tokens],
                                     num_segments=num_rows)  # ids == R are dropped
    else:
        pooled = hidden[rows[num_tokens:]].astype(jnp.float32)  # [R, D]
    return model.classify(pooled) if head else pooled
