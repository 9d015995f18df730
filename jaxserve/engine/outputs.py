"""Result objects shaped like vLLM's (RequestOutput, CompletionOutput, Logprob; for pooling
models PoolingRequestOutput and its embedding, classification and scoring forms)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


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
    # The LoRA adapter it ran with (a LoRARequest; None: the base model), as vLLM's.
    lora_request: object | None = None


# ---- pooling (embeddings, classification, scores), as vLLM's ------------------------------
@dataclasses.dataclass
class PoolingOutput:
    """A pooling request's result: an embedding f32[D'] or classification f32[L] (vLLM holds
    a torch tensor here; jaxserve a numpy array)."""

    data: np.ndarray

    def __eq__(self, other) -> bool:
        return isinstance(other, PoolingOutput) and np.array_equal(self.data, other.data)


@dataclasses.dataclass
class PoolingRequestOutput:
    """The output of one pooling request (one input of LLM.embed / classify / encode):
    `outputs.data`, set once it has finished (None while it runs, and for a request the
    engine failed: then `error` says why)."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # as RequestOutput's
    error_param: str | None = None

    @property
    def finish_reason(self) -> str | None:
        """How it ended, in RequestOutput's words: "stop" (pooled), "error", "abort"; None
        while it runs."""
        if self.error is not None:
            return "error"
        if self.outputs is not None:
            return "stop"
        return "abort" if self.finished else None


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        if output.data.ndim != 1:
            raise ValueError("an embedding is one vector; this output holds "
                             f"{output.data.shape}")
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]  # per label, in id2label's order (logits when use_activation=False)

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ClassificationOutput:
        return cls(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ScoringOutput:
    score: float  # cosine similarity (embedding models) or the cross-encoder's probability

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ScoringOutput:
        if output.data.size != 1:
            raise ValueError(f"a score is one number; this output holds {output.data.size}")
        return cls(float(output.data.reshape(-1)[0]))


def _typed(kind):
    """A PoolingRequestOutput subclass whose outputs are `kind` (vLLM's
    EmbeddingRequestOutput and the others), with from_base."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput):
        return cls(output.request_id, kind.from_base(output.outputs), output.prompt_token_ids,
                   output.finished, output.num_cached_tokens, output.prompt, output.metrics)

    return from_base


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`outputs.embedding`: list[float]."""

    from_base = _typed(EmbeddingOutput)


class ClassificationRequestOutput(PoolingRequestOutput):
    """`outputs.probs`: list[float], one per label."""

    from_base = _typed(ClassificationOutput)


class ScoringRequestOutput(PoolingRequestOutput):
    """`outputs.score`: float."""

    from_base = _typed(ScoringOutput)
