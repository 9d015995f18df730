"""vLLM's `speculative_config` (`--speculative-config` JSON or `LLM(speculative_config=...)`):
the n-gram method's settings, checked once. The proposer is core/spec_decode.py."""

from __future__ import annotations

import dataclasses
import json

METHODS = ("ngram",)
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min / _max when neither is given


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config for the n-gram method (`--speculative-config` JSON or
    `LLM(speculative_config={...})`)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    # No proposals in a step while more sequences than this are running (None: always).
    # Where a step is bound by arithmetic (many sequences), verifying costs what decoding
    # does, and speculation only adds the rejected tokens.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)} "
                             f"(prompt lookup), got {self.method!r}; draft models and EAGLE "
                             "are not supported.")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got "
                                 f"{value!r}.")
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                                 or size < 1):
            raise ValueError("speculative_config.disable_by_batch_size must be an integer >= 1 "
                             f"(or null), got {size!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must not exceed prompt_lookup_max ({self.prompt_lookup_max}).")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From vLLM's forms: None, a dict, its JSON text, or a SpeculativeConfig. A missing
        lookup bound takes the other's value, both missing are 5 (vLLM's defaults)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}.") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}.')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"speculative_config got unexpected keys {unknown}; the n-gram "
                            f"method takes {sorted(known)}.")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (the tokens "
                             "proposed per step).")
        fields = dict(value)
        low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        fields["prompt_lookup_min"] = low if low is not None else (high or DEFAULT_LOOKUP)
        fields["prompt_lookup_max"] = high if high is not None else (low or DEFAULT_LOOKUP)
        if fields.get("method") is None:
            fields["method"] = "ngram"
        return cls(**fields)
