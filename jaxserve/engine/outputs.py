"""Result objects shaped like vLLM's (RequestOutput, CompletionOutput, Logprob)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token_id: Logprob}, holding the chosen token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


class Snapshot(Sequence):
    """The first `length` items of a growing sequence (a request's token array, its logprob
    entries), read-only: what a running request's output holds instead of a copy, so that
    building an output per step costs the same at any length. The items it covers never
    change (a request only appends). Reads like a list: len, indexing, iteration, and a
    slice or `list()` gives a list; compares equal to a list or tuple of the same items.
    A finished request's output holds plain lists."""

    __slots__ = ("_items", "_length")

    def __init__(self, items, length: int) -> None:
        self._items, self._length = items, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            part = self._items[: self._length][index]
            return part.tolist() if hasattr(part, "tolist") else list(part)
        if not -self._length <= index < self._length:
            raise IndexError("index out of range")
        item = self._items[index % self._length]
        return item.item() if hasattr(item, "item") else item

    def __iter__(self):
        return iter(self[:])

    def __eq__(self, other) -> bool:
        if isinstance(other, (Snapshot, list, tuple)):
            return len(self) == len(other) and self[:] == list(other)
        return NotImplemented

    def __add__(self, other) -> list:
        return self[:] + list(other)

    def __radd__(self, other) -> list:
        return list(other) + self[:]

    def __repr__(self) -> str:
        return repr(self[:])


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int] | Snapshot  # a Snapshot while the request runs
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
