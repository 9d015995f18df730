"""SamplingParams: how one request is sampled, validated when it is made (vLLM's names).

Validation is also the contract with the device: every number must survive its trip there.
Counts, top_k and token ids travel as int32; temperatures, probabilities and penalties as
float32, where a value beyond float32's range becomes infinite and a nonzero value below its
smallest normal number becomes 0 (or a denormal that XLA flushes to 0). Such values are
refused here, naming the field, so that the HTTP server, the offline LLM and any other front
end share one check and nothing unrepresentable ever reaches a step.
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.core.structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20  # top-k logprobs the device step computes; logprobs/prompt_logprobs cap
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
# Scales logits (divides positive, multiplies negative ones): beyond this range the effect no
# longer changes (every seen token is pinned near 0 or pushed to -inf), and near float32's
# limits a penalised logit overflows.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
LOGIT_BIAS_MAX = 100.0  # as OpenAI: each bias in [-100, 100]


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
    # Added to the logits of these token ids (before penalties and temperature).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Never generated: a one-token word is banned outright, a longer one has its last token
    # banned whenever the output ends with the rest (vLLM's semantics).
    bad_words: list[str] | None = None
    # Keep only k prompt tokens (-1: max_model_len - 1, leaving room for one output token);
    # truncation_side "left" drops the oldest tokens, "right" the newest.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    # Constrained decoding: a JSON schema, JSON object, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and \
                not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _bad("structured_outputs", "a StructuredOutputsParams (or its dict) or None",
                       self.structured_outputs)
        self.stop = ([self.stop] if isinstance(self.stop, str) else
                     _as_list("stop", self.stop, "a string or a list of strings"))
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids,
                                       "a list of token ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids,
                                              "a list of token ids")
        if self.bad_words is not None:
            self.bad_words = ([self.bad_words] if isinstance(self.bad_words, str) else
                              _as_list("bad_words", self.bad_words, "a list of strings"))
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise _bad("logit_bias", "a dict of {token id: bias}", self.logit_bias)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, 1, INT32_MAX)
        _check_float("temperature", self.temperature, 0.0, FLOAT32_MAX,
                     "a number in [0, 3.4e38] (0 means greedy)")
        _check_float("top_p", self.top_p, FLOAT32_TINY, 1.0, "in (0, 1]")
        _check_int("top_k", self.top_k, 0, INT32_MAX, "-1 or 0 (disabled) or an integer in "
                   f"[1, {INT32_MAX}] (any k >= the vocabulary keeps every token)")
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0, "in [-2, 2]")
        low, high = REPETITION_PENALTY_RANGE
        _check_float("repetition_penalty", self.repetition_penalty, low, high,
                     f"in [{low:g}, {high:g}] (1 means no penalty)")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, INT32_MAX,
                       f"an integer in [1, {INT32_MAX}] (or None for up to max_model_len)")
        _check_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS,
                           f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX,
                       "a 64-bit signed integer or None")
        if any(not isinstance(s, str) or not s or "\ufffd" in s for s in self.stop):
            raise _bad("stop", "a list of non-empty strings (without U+FFFD)", self.stop)
        if any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise _bad("stop_token_ids", f"a list of token ids in [0, {INT32_MAX}]",
                       self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "true or false", getattr(self, name))
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or not 0 <= token <= INT32_MAX:
                    raise _bad("logit_bias", f"keyed by token ids in [0, {INT32_MAX}]", token)
                _check_float("logit_bias", bias, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX,
                             f"values in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not _is_int(t) or not 0 <= t <= INT32_MAX
                       for t in self.allowed_token_ids)):
            raise _bad("allowed_token_ids", f"a non-empty list of token ids in [0, {INT32_MAX}]",
                       self.allowed_token_ids)
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip()
                                              for w in self.bad_words):
            raise _bad("bad_words", "a list of non-blank strings", self.bad_words)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, INT64_MAX,
                       "-1 (max_model_len - 1) or a positive integer or None")
        if self.truncation_side not in ("left", "right"):
            raise _bad("truncation_side", "'left' or 'right'", self.truncation_side)

    @property
    def has_logit_bias(self) -> bool:
        """Whether the request changes logits by a fixed per-token amount (logit_bias,
        allowed_token_ids, or a one-token bad word): the engine gives it a bias row."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or \
            bool(self.bad_words)

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _bad(field: str, allowed: str, value: object) -> ValueError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ValueError(f"SamplingParams.{field} must be {allowed}, got {shown}.")


def _as_list(field: str, value: object, allowed: str) -> list:
    """None as [], a list or tuple as a list; anything else is refused."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise _bad(field, allowed, value)
    return list(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(field: str, value: object, low: int, high: int,
               allowed: str | None = None) -> None:
    if not _is_int(value) or not low <= value <= high:
        raise _bad(field, allowed or f"an integer in [{low}, {high}]", value)


def _check_float(field: str, value: object, low: float, high: float, allowed: str) -> None:
    """A finite number in [low, high] that float32 holds: 0, or at least FLOAT32_TINY in
    magnitude (a smaller one would be 0 on the device)."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and low <= value <= high
          and (value == 0 or abs(value) >= FLOAT32_TINY))
    if not ok:
        if low <= 0 <= high:
            allowed += " (float32: 0, or at least 1.2e-38 in magnitude)"
        raise _bad(field, allowed, value)
