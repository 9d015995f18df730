"""SchedulerOutput: the step the scheduler hands the engine and a backend.

What a step runs is the scheduled requests themselves (`core/request.py`'s Request, shared
with the scheduler, not copied): a backend reads, for each one in batch order,

- `token_ids[num_computed_tokens : num_computed_tokens + count]`: the tokens to feed,
  where count is its entry of `num_scheduled_tokens` (its known tokens first, then
  `num_proposed` speculative proposals written after them);
- `block_ids`: its KV blocks, enough for num_computed_tokens + count slots;
- `state_slot`: its row of the device-side penalty, bias and grammar state;
- `seed`, `sampling_floats`, `sampling_top_k`, `params`: how to sample its next token;
- `num_prompt_tokens`: whether this step still reads the prompt (prompt logprobs, and
  whether it samples at all: `input_builder.samples_this_step`).

The scheduler moves num_computed_tokens forward only in `update_from_output`, after the
step, so during a step these fields describe the step's start.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.request import Request


@dataclasses.dataclass
class SchedulerOutput:
    # The requests this step runs, in batch order (row r of the step is requests[r]).
    requests: list[Request]
    # Tokens each request runs this step, same order: a prefill chunk, one decode token, or
    # one token plus its proposals. Each is >= 1.
    num_scheduled_tokens: list[int]
    # Requests preempted while this step was formed (their blocks are freed; they wait to be
    # recomputed). Not part of the batch; the engine reports them in its stats.
    preempted: list[Request]

    @property
    def total_num_scheduled_tokens(self) -> int:
        """T before padding: the tokens of every request together."""
        return sum(self.num_scheduled_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests

    @classmethod
    def concat(cls, parts: list[SchedulerOutput]) -> SchedulerOutput:
        """Several partial steps seen as one (a step the engine split to isolate a failing
        request runs as parts)."""
        return cls([r for p in parts for r in p.requests],
                   [n for p in parts for n in p.num_scheduled_tokens],
                   [r for p in parts for r in p.preempted])
