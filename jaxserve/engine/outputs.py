"""Result objects shaped like vLLM's (RequestOutput, CompletionOutput, Logprob)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token_id: Logprob}, holding the chosen token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None: running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> _Finished:
        """Whether this choice has ended: `if c.finished:` reads it as an attribute, and
        vLLM's `c.finished()` still works (the value is callable and returns itself)."""
        return _Finished(self.finish_reason is not None)


class _Finished(int):
    """A bool that may also be called (CompletionOutput.finished, for vLLM's method)."""

    def __new__(cls, value: bool) -> _Finished:
        return super().__new__(cls, bool(value))

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request was added
    first_scheduled_time: float | None  # when it first ran (None: still waiting)

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Why the engine failed this request (its choices end with finish_reason "error"): a
    # short description without traceback, None for a request that did not fail.
    error: str | None = None
    # The request field whose value made it fail (its structured output's grammar ran past
    # its per-step budget): the request's fault, not the engine's. None otherwise.
    error_param: str | None = None
