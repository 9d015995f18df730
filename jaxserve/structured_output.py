"""Grammar-constrained decoding with llguidance (host side): JSON schemas, JSON objects,
regular expressions, choices and Lark grammars, as vLLM's StructuredOutputsParams.

A constrained request holds an llguidance matcher per sequence. After each step the engine
feeds the sampled token to its matcher; before the next step, the matcher's next-token
bitmask (one bit per vocabulary entry, packed in int32 words) goes to the device, which
masks the logits of that row before sampling. EOS is allowed only where the grammar may end,
and a grammar that has reached its end finishes the request with "stop".

Grammars are compiled and checked once (LRU cache) in the caller's thread (the server's
worker threads), with llguidance's fuel limits bounding the work a pathological schema can
cause; engine threads only copy the compiled matcher.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured-outputs request: exactly one of json (a JSON schema, as a dict or
    its text), regex, choice (a list of strings), grammar (Lark, or GBNF) or json_object
    (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # A token (its text, e.g. "</think>") after which the constraint starts: what comes
    # before it is free (a reasoning model's thinking). None: from the first token.
    starts_after: str | None = None

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar or json_object; got {kinds or 'none'}.")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple))
                                        or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string.")

    def kinds(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def key(self) -> str:
        """A cache key: the grammar part of the request, canonical JSON."""
        fields = dataclasses.asdict(self)
        fields.pop("starts_after")
        return json.dumps(fields, sort_keys=True, default=str)

    @classmethod
    def from_dict(cls, value: dict[str, Any], field: str = "structured_outputs"
                  ) -> StructuredOutputsParams:
        if not isinstance(value, dict):
            raise ValueError(f"{field} must be an object.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"{field}: unknown keys {unknown}; known: {sorted(names)}.")
        return cls(**value)


class GrammarCompiler:
    """Compiles StructuredOutputsParams into llguidance grammars for one tokenizer, and
    fills next-token bitmasks. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = (vocab_size + 31) // 32  # W: int32 words of one bitmask row
        self._lock = threading.Lock()
        self._tokenizer = None
        self._executor = None
        self._grammars: OrderedDict[str, Any] = OrderedDict()  # key -> compiled matcher

    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (built once, about a second)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None)
            return self._tokenizer

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar text of params (not yet checked)."""
        import llguidance

        matcher = llguidance.LLMatcher
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as err:
                    raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be a JSON object.")
            # Compact JSON (one space after ":" and ","), unless a whitespace_pattern says
            # otherwise: free whitespace lets a model pad forever instead of finishing.
            options: dict[str, Any] = {"whitespace_flexible": False}
            if params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            if params.disable_additional_properties:
                schema = _no_additional_properties(schema)
            try:
                return matcher.grammar_from_json_schema(schema, overrides=options)
            except ValueError as err:
                raise ValueError(f"the JSON schema cannot be used: {err}") from None
        if kind == "regex":
            return matcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        return llguidance.grammar_from("grammar", params.grammar)

    def compile(self, params: StructuredOutputsParams):
        """A fresh matcher for params; ValueError saying what is wrong with the grammar.
        The first call for a grammar compiles and checks it; later ones copy the result."""
        key = params.key()
        with self._lock:
            template = self._grammars.get(key)
            if template is not None:
                self._grammars.move_to_end(key)
        if template is None:
            import llguidance

            text = self.grammar(params)
            template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0,
                                            limits=_limits())
            if template.is_error():
                raise ValueError(f"the {params.kind} constraint cannot be used: "
                                 f"{_short(template.get_error())}")
            with self._lock:
                self._grammars[key] = template
                while len(self._grammars) > _CACHE_SIZE:
                    self._grammars.popitem(last=False)
        return template.deep_copy()

    def fill_masks(self, matchers: list) -> np.ndarray:
        """i32[len(matchers), W]: each matcher's next-token bitmask (bit t of word t // 32:
        token t allowed), computed in parallel."""
        import llguidance
        import llguidance.numpy as llnp

        masks = np.full((len(matchers), self.words), -1, np.int32)
        if not matchers:
            return masks
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            executor = self._executor
        llnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)],
                                         masks)
        return masks


def _limits():
    """Fuel limits: a pathological schema or grammar fails to compile (or a step's mask gives
    up) instead of stalling its thread (llguidance's defaults bound both to milliseconds)."""
    import llguidance

    return llguidance.LLParserLimits()


def _no_additional_properties(schema):
    """The schema with additionalProperties: false on every object that does not set it."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
