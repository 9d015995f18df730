"""SamplingParams: how one request is sampled, validated when it is made (vLLM's names)."""

from __future__ import annotations

import dataclasses
import math

MAX_LOGPROBS = 20  # top-k logprobs the device step computes; logprobs/prompt_logprobs cap


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling settings, named and defaulted as in vLLM.

    Any combination of these values runs in the same compiled step: they travel to the
    device as per-sequence arrays, never as compile-time constants.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, allowed: str, value: object) -> ValueError:
            return ValueError(f"SamplingParams.{field} must be {allowed}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise bad("temperature", "a finite number >= 0 (0 means greedy)", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "-1 or 0 (disabled) or an integer >= 1", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, "in [-2, 2]", value)
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0 (1 means no penalty)", self.repetition_penalty)
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "an integer >= 1 (or None for up to max_model_len)",
                      self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}] or None", value)
        if any(not isinstance(s, str) or not s or "\ufffd" in s for s in self.stop):
            raise bad("stop", "a list of non-empty strings (without U+FFFD)", self.stop)
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)
