"""Grammar-constrained decoding with llguidance (host side): JSON schemas, JSON objects,
regular expressions, choices and Lark grammars, as vLLM's StructuredOutputsParams.

A constrained request holds an llguidance matcher per sequence. After each step the engine
feeds the sampled token to its matcher; before the next step, the matcher's next-token
bitmask (one bit per vocabulary entry, packed in int32 words) goes to the device, which
masks the logits of that row before sampling. EOS is allowed only where the grammar may end,
and a grammar that has reached its end finishes the request with "stop".

A new grammar is first compiled, and its first mask computed (which builds its lexer), in
the sandbox process (grammar_sandbox.py) under a wall-clock limit, after the structural caps
of grammar_checks.py; only then is it compiled in the caller's thread (the server's grammar
threads) and cached by its text (so are refusals). Engine threads only copy compiled
matchers. llguidance's fuel limits bound each later mask: a matcher that runs out of its
per-step fuel is in error, and the engine fails that request alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from jaxserve.inputs import bounded_json

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

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *,
                 sandbox_workers: int = 2) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = (vocab_size + 31) // 32  # W: int32 words of one bitmask row
        self._lock = threading.Lock()
        self._tokenizer = None
        self._executor = None
        self._sandbox = None
        self._sandbox_workers = sandbox_workers
        self._grammars: OrderedDict[str, Any] = OrderedDict()  # text -> compiled matcher
        self._refused: OrderedDict[str, str] = OrderedDict()  # text -> why it cannot be used

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
                schema = bounded_json.loads(schema, "the JSON schema")
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

    def compile(self, params: StructuredOutputsParams, timeout: float = 10.0):
        """The compiled matcher of params (copy it per sequence: new_matcher); ValueError
        saying what is wrong with the grammar. The first call for a grammar tries it in the
        sandbox (up to `timeout` seconds), then compiles it here and builds its lexer; later
        calls, and those for a grammar already refused, answer from the cache."""
        text = self.grammar(params)
        with self._lock:
            template = self._grammars.get(text)
            why = self._refused.get(text)
            if template is not None:
                self._grammars.move_to_end(text)
        if template is not None:
            return template
        if why is None:
            why = self.sandbox.check(text, timeout)
        if why is None:
            template, why = self._compile_here(text)
        with self._lock:
            if why is not None:
                self._refused[text] = why
                _trim(self._refused)
            else:
                self._grammars[text] = template
                _trim(self._grammars)
        if why is not None:
            raise ValueError(f"the {params.kind} constraint cannot be used: {_short(why)}")
        return template

    def compile_checked(self, params: StructuredOutputsParams):
        """compile() for a constraint that another process's compile() has accepted (the
        engine core process, core_process.py, takes grammars the server's admission path
        compiled in its sandbox): compiled here at once, without the sandbox; cached."""
        text = self.grammar(params)
        with self._lock:
            template = self._grammars.get(text)
        if template is not None:
            return template
        template, why = self._compile_here(text)
        if why is not None:
            raise ValueError(f"the {params.kind} constraint cannot be used: {_short(why)}")
        with self._lock:
            self._grammars[text] = template
            _trim(self._grammars)
        return template

    def _compile_here(self, text: str):
        """(matcher, None), or (None, why): compiled in this process, its first mask filled
        so that the lexer is built here rather than at the request's first step."""
        import llguidance
        import llguidance.numpy as llnp

        template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0, limits=_limits())
        if not template.is_error():
            llnp.fill_next_token_bitmask(template, np.zeros((1, self.words), np.int32), 0)
        if template.is_error():
            return None, template.get_error()
        return template, None

    @staticmethod
    def new_matcher(template):
        """A fresh matcher for one sequence, from a compiled one."""
        return template.deep_copy()

    @property
    def sandbox(self):
        with self._lock:
            if self._sandbox is None:
                from jaxserve.core.grammar_sandbox import GrammarSandbox

                self._sandbox = GrammarSandbox(self._hf, self.vocab_size, self.eos_token_ids,
                                               workers=self._sandbox_workers)
            return self._sandbox

    def close(self) -> None:
        """Stop the sandbox's worker processes."""
        with self._lock:
            sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            sandbox.close()

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


def describe_error(error: str) -> str:
    """llguidance's error, first line only (its later lines show parser state)."""
    first = error.strip().splitlines()[0] if error.strip() else "no reason given"
    return first if len(first) <= 200 else first[:197] + "..."


def _limits():
    """Fuel limits, the sandbox's: a pathological schema or grammar fails to compile (or a
    step's mask gives up, failing its request) instead of stalling its thread."""
    import llguidance

    from jaxserve.core.grammar_sandbox import PARSER_LIMITS

    return llguidance.LLParserLimits(**PARSER_LIMITS)


def _trim(cache: OrderedDict) -> None:
    while len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


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
