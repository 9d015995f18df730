"""The compiled step's function (runner.py compiles it per (T, R) bucket):

    step(params, kv_caches, penalty_state, packed_inputs, loras)
        -> (kv_caches, penalty_state, hidden, packed_sample_result)

The packed inputs unpack into the Batch and SamplingInputs (packing.py); a placeholder
position takes the token the previous step sampled for its request (feed_slots); with LoRA
adapters, each token's slot (lora_slots) selects its adapter in every projection
(models/jax/lora.py). The model runs, the penalty state is updated where a row uses
penalties, and the sampler draws each row's token (with speculative decoding: at each
proposal and the last token, keeping the proposals that match: rejection_sampler.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxserve.backends.jax.batch import Batch, SamplingInputs
from jaxserve.backends.jax.packing import Layout, pack_device, unpack
from jaxserve.backends.jax.rejection_sampler import accept_drafts
from jaxserve.backends.jax.sampler import sample, update_penalty_state, uses_penalties
from jaxserve.core.step_fields import BATCH_FIELDS, SAMPLING_FIELDS
from jaxserve.kernels_pallas.ref import token_layout
from jaxserve.models.jax.lora import attach as attach_lora

_BATCH_FIELDS = tuple(f.name for f in BATCH_FIELDS)
_SAMPLING_FIELDS = tuple(f.name for f in SAMPLING_FIELDS)


@dataclasses.dataclass(frozen=True, eq=False)
class StepSettings:
    """What the step function closes over: the model's graph, the attention, the
    replicated sharding, the KV groups (None: one) and K, the proposals verified at most."""

    graphdef: object
    attend: object
    replicated: NamedSharding
    groups: object
    num_speculative: int


def step_fn(settings: StepSettings, params, kv_caches, penalty_state, packed, loras,
            layout: Layout):
    """One step (the module docstring); loras: the LoRA slots' arrays (lora_weights.py; {}
    without LoRA)."""
    arrays = unpack(packed, layout)
    feed, token_slots = arrays["feed_slots"], arrays.get("lora_slots")
    batch = Batch(**{f: arrays[f] for f in _BATCH_FIELDS})
    # Placeholder inputs: the token the previous step sampled for the row's request.
    batch = dataclasses.replace(batch, token_ids=jnp.where(
        feed > 0, penalty_state.last_tokens[feed], batch.token_ids))
    sampling = SamplingInputs(**{f: arrays[f] for f in _SAMPLING_FIELDS})
    model = nnx.merge(settings.graphdef, params)
    if loras:
        attach_lora(model, loras, token_slots)
    groups = settings.groups
    kv_caches, hidden = model(kv_caches, batch, settings.attend, groups)
    hidden = jax.lax.with_sharding_constraint(hidden, settings.replicated)  # [T, D]
    seq, _, valid = token_layout(batch, batch.token_ids.shape[0])
    # The penalty rows are only read by requests with penalties, which are in the
    # steps that update them: other steps skip the scatter.
    penalty_state = jax.lax.cond(
        uses_penalties(sampling), update_penalty_state, lambda state, *_: state,
        penalty_state, batch, sampling, seq, valid)

    def sample_at(indices, s):  # the sampler sees the whole vocabulary on every device
        logits = jax.lax.with_sharding_constraint(model.logits(hidden[indices]),
                                                  settings.replicated)  # f32[rows, V]
        return sample(logits, penalty_state, s)

    k = settings.num_speculative
    if not k:
        result = sample_at(batch.logits_indices, sampling)
        # Each row's token for a later step's placeholder (padding rows write row 0;
        # speculative steps are never followed by placeholders).
        penalty_state = dataclasses.replace(penalty_state, last_tokens=(
            penalty_state.last_tokens.at[sampling.state_slots].set(result.token_ids)))
        return kv_caches, penalty_state, hidden, pack_device(result)
    rows = batch.logits_indices.shape[0]
    slots = min(batch.token_ids.shape[0], rows * (k + 1))  # L

    def one_token():  # row r's entry at r
        result = sample_at(batch.logits_indices, sampling)
        widen = lambda x: jnp.zeros((slots,) + x.shape[1:], x.dtype).at[:rows].set(x)
        return jax.tree.map(widen, result), jnp.ones((rows,), jnp.int32)

    def verify():
        proposed = sampling.num_proposed
        # Slot layout: row r's proposals and last token (padding rows: none).
        counts = jnp.where(jnp.arange(rows) < batch.num_seqs[0], proposed + 1, 0)
        ends = jnp.cumsum(counts)
        starts = ends - counts
        slot = jnp.arange(slots)
        row = jnp.minimum(jnp.searchsorted(ends, slot, side="right"), rows - 1)
        j = slot - starts[row]  # position among the row's sampled tokens
        used = slot < ends[-1]
        back = proposed[row] - j  # tokens after this one in the row's query
        index = jnp.where(used, batch.logits_indices[row] - back, 0)
        each = jax.tree.map(lambda x: x[row], sampling)
        each = dataclasses.replace(
            each, sample_positions=jnp.where(used, each.sample_positions - back, 0))
        result = sample_at(index, each)
        # The proposal after this token, when there is one: kept if the draw equals it.
        follows = batch.token_ids[jnp.minimum(index + 1, batch.token_ids.shape[0] - 1)]
        return result, accept_drafts(result.token_ids, follows, used & (back > 0), row,
                                     starts)

    result = jax.lax.cond(jnp.any(sampling.num_proposed > 0), verify, one_token)
    return kv_caches, penalty_state, hidden, pack_device(result)

