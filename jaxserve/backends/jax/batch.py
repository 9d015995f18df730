"""The ragged batch one device step consumes (docs/architecture.md's layout), as a JAX pytree.

T tokens from R sequences, padded to a (T, R) bucket. Padding tokens write their K/V into the
null block 0 and their rows are ignored; padding sequences have kv_len 0.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]   flat KV slot = block_id * block_size + offset
    cu_q_lens: jax.Array  # i32[R+1]  query start of each sequence in the T tokens
    kv_lens: jax.Array  # i32[R]      context length of each sequence after this step
    block_tables: jax.Array  # i32[R, B]
    num_seqs: jax.Array  # i32[1]
    logits_indices: jax.Array  # i32[R]  the token whose logits are sampled


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    """Per-sequence sampling settings as arrays, so any mix runs in one compiled step."""

    temperature: jax.Array  # f32[R]   0 = greedy
    top_k: jax.Array  # i32[R]         0 = disabled
    top_p: jax.Array  # f32[R]
    min_p: jax.Array  # f32[R]
    presence_penalty: jax.Array  # f32[R]
    frequency_penalty: jax.Array  # f32[R]
    repetition_penalty: jax.Array  # f32[R]
    seeds: jax.Array  # u32[R]
    sample_positions: jax.Array  # i32[R]  position of the token being sampled (RNG fold-in)
    state_slots: jax.Array  # i32[R]  row of the penalty state; 0 = scratch row for padding
    reset_state: jax.Array  # bool[R]  the sequence starts from scratch this step
    prompt_lens: jax.Array  # i32[R]
    wants_logprobs: jax.Array  # bool[R]  the request asked for logprobs of sampled tokens
    banned_ids: jax.Array  # i32[R, X]  tokens masked this step (stop ids before min_tokens,
    #                                   bad words' last tokens); -1 pad
    has_bias: jax.Array  # bool[R]  add the row's logit bias (PenaltyState.logit_bias)
    has_grammar: jax.Array  # bool[R]  mask by the row's grammar (PenaltyState.grammar_mask)
    num_proposed: jax.Array  # i32[R]  speculative proposals among the row's last tokens: the
    #                                  step samples at each of them and at the last token
