"""A roofline prediction of the engine's steps on an accelerator (host-side arithmetic).

A step of bucket (T, R) takes at least the longer of its compute time (FLOPs over the
device's peak bf16 FLOP/s, accelerators.py) and its memory time (bytes over the HBM
bandwidth), per device; every device of a replica runs its share at once. The FLOPs and
bytes are the compiled step's own (XLA's cost_analysis of `jaxserve compile`: the weights
read, the activations, the KV writes, the sampler) plus the attention over the context,
which the compiler cannot count (the kernel's work depends on the context lengths it
reads at run time): each sequence's K and V of `context` tokens read once per step (the
plan's KV bytes per token on a device), and 4 FLOPs per query token, query head of the
device and key, per head dimension (q . k and p . v; a latent cache's C + R).

Decode (the buckets of the smallest T, and those with T = R): R sequences each sampling
one token at `context` tokens of context; output tokens/s over all replicas = R x replicas
/ step. Prefill (T > R): a bucket's T tokens as R fresh prompts of T / R tokens (each
token attends to half its prompt on average); tokens/s = T x replicas / step. Both ignore what is not in the step (host scheduling, transfers, the
gaps between steps): a lower bound on time, an upper bound on throughput.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One step bucket's roofline on one device of a replica."""

    key: tuple  # ("step", T, R)
    mode: str  # "decode" or "prefill"
    flops: float  # per device: compiled + attention
    bytes: float
    compute_seconds: float
    memory_seconds: float
    tokens_per_second: float  # over every replica: output tokens (decode) or prompt tokens

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"


def attention_costs(plan, query_tokens: int, keys_per_query: float,
                    sequences_keys: float) -> tuple[float, float]:
    """(FLOPs, bytes) of the attention on one device: query_tokens each attending to
    keys_per_query keys; sequences_keys: the K and V tokens read in all (each sequence's
    context once)."""
    heads = plan.num_heads // plan.mesh.model
    width = plan.latent.dim if plan.latent is not None else plan.head_dim
    flops = 4.0 * query_tokens * keys_per_query * heads * width
    return flops, sequences_keys * plan.bytes_per_token


def predict(plan, key: tuple, flops: float, bytes_accessed: float, accelerator,
            context: int) -> Prediction:
    """The roofline of step bucket key = ("step", T, R) compiled with `flops` and
    `bytes_accessed` per device (cost_analysis), on `accelerator` (its bf16_flops and
    hbm_bandwidth); decode at `context` tokens when T is the smallest bucket's or R, else
    prefill. ValueError when the table has no peak FLOP/s for it."""
    if not accelerator.bf16_flops:
        raise ValueError(f"{accelerator.name}: the accelerator table has no peak FLOP/s.")
    _, tokens, rows = key
    replicas = plan.mesh.data
    if tokens == plan.token_buckets[0] or tokens == rows:  # decode: a token per sequence
        mode, queries, keys, read = "decode", rows, context, rows * context
        produced = rows
    else:  # prefill: R prompts of T / R tokens
        mode, queries = "prefill", tokens
        keys, read, produced = tokens / rows / 2, tokens, tokens
    attn_flops, attn_bytes = attention_costs(plan, queries, keys, read)
    total_flops, total_bytes = flops + attn_flops, bytes_accessed + attn_bytes
    compute = total_flops / accelerator.bf16_flops
    memory = total_bytes / accelerator.hbm_bandwidth
    return Prediction(key, mode, total_flops, total_bytes, compute, memory,
                      produced * replicas / max(compute, memory))
