"""SchedulerOutput: the step the scheduler hands the engine and a backend.

What a step runs is the scheduled requests themselves (`core/request.py`'s Request, shared
with the scheduler, not copied), with what the scheduler recorded for each row when it
formed the step. A backend reads, for each one in batch order (row r):

- `num_computed_tokens[r]` = first, `num_scheduled_tokens[r]` = count: the step feeds the
  request's positions first .. first + count - 1, `token_ids[first : first + count]` (its
  known tokens first, then `num_proposed` speculative proposals written after them). A
  position at or past the request's `num_tokens` is a placeholder: the token a step still
  in flight is sampling for it (asynchronous scheduling), which the backend takes from that
  step's output on the device, by the request's `state_slot`;
- `block_ids`: its KV blocks, enough for first + count slots;
- `state_slot`: its row of the device-side penalty, bias, grammar and last-token state, and
  whether the row was just handed out and starts from nothing (`new_rows`);
- `sampling_row` (core/step_fields.py's SamplingRow), `params`: how to sample its next
  token;
- `samples[r]`: whether the row samples a token (a prompt chunk short of the prompt's end
  does not), and `num_prompt_tokens`: whether it still reads its prompt (prompt logprobs).

The scheduler advances each request's num_computed_tokens as it schedules it, so the
request itself already describes the state after the step; the fields above describe the
step.
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
    # Each row's first position: its request's num_computed_tokens when it was scheduled
    # (None: read from the requests now, for a step formed by hand from their state).
    num_computed_tokens: list[int] | None = None
    # Whether each row samples a token at its end (None: from the requests' state now).
    samples: list[bool] | None = None
    # The rows whose request was given its state slot by this step (needs_state_reset: its
    # device-side state starts from nothing), ascending (None: from the requests' state).
    new_rows: list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_computed_tokens is None:
            self.num_computed_tokens = [r.num_computed_tokens for r in self.requests]
        if self.samples is None:
            self.samples = [first + count >= r.num_tokens for r, first, count in zip(
                self.requests, self.num_computed_tokens, self.num_scheduled_tokens)]
        if self.new_rows is None:
            self.new_rows = [i for i, r in enumerate(self.requests) if r.needs_state_reset]

    @property
    def total_num_scheduled_tokens(self) -> int:
        """T before padding: the tokens of every request together."""
        return sum(self.num_scheduled_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests

    def rows(self, indices) -> SchedulerOutput:
        """The step's rows at `indices` as a step of their own (the engine splits a step to
        isolate a failing request)."""
        new = set(self.new_rows)
        return SchedulerOutput([self.requests[i] for i in indices],
                               [self.num_scheduled_tokens[i] for i in indices], [],
                               [self.num_computed_tokens[i] for i in indices],
                               [self.samples[i] for i in indices],
                               [row for row, i in enumerate(indices) if i in new])

    @classmethod
    def concat(cls, parts: list[SchedulerOutput]) -> SchedulerOutput:
        """Several partial steps seen as one (a step the engine split to isolate a failing
        request runs as parts)."""
        return cls([r for p in parts for r in p.requests],
                   [n for p in parts for n in p.num_scheduled_tokens],
                   [r for p in parts for r in p.preempted],
                   [n for p in parts for n in p.num_computed_tokens],
                   [s for p in parts for s in p.samples],
                   [row + sum(len(q.requests) for q in parts[:i])
                    for i, p in enumerate(parts) for row in p.new_rows])
