"""A pooling engine's pooled rows on the torch backend: backends/jax/pooling.py's pooling
function in torch, run eagerly after the forward pass (core/pooling.py's pool_inputs give
each token's row)."""

from __future__ import annotations

import torch


def pool_rows(model, hidden: torch.Tensor, rows: torch.Tensor, pooling_type: str,
              head: bool) -> torch.Tensor:
    """The JAX runner's pooling function (backends/jax/pooling.py) in torch: hidden [T, D],
    rows i64[T + R] (core/pooling.py's pool_inputs) -> f32[R, X]."""
    num_tokens = hidden.shape[0]
    num_rows = rows.shape[0] - num_tokens
    if pooling_type == "MEAN":  # each row's tokens summed; tokens of row R (padding) dropped
        sums = torch.zeros(num_rows + 1, hidden.shape[1], dtype=torch.float32,
                           device=hidden.device)
        pooled = sums.index_add_(0, rows[:num_tokens], hidden.float())[:num_rows]
    else:
        pooled = hidden[rows[num_tokens:]].float()
    return model.classify(pooled) if head else pooled
