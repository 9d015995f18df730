"""RequestLimits: the one table of what a single request may ask for.

Every front end (the HTTP server, gRPC, the offline LLM) checks a request against this table
through the admission path (admission.py), before any expensive work (tokenizing, template
rendering, grammar compiling). A refusal names the field and the limit: a 400 over HTTP,
INVALID_ARGUMENT over gRPC, a ValueError offline. The server's flags (--max-n,
--max-prompts-per-request, --request-limits JSON) and `LLM(request_limits={...})` change the
values; docs/architecture.md and docs/serving.md list them.

JSON nests at most 128 arrays/objects deep wherever a request carries it (the body, and
JSON inside string fields: schemas, tool-call arguments), a fixed bound (bounded_json.py).
The grammar caps are structural: they bound what a constraint may make the grammar compiler
do (reference chains it resolves recursively, nesting, rule counts, regex repetition
products), so a small request cannot crash or stall it. Whatever passes them still compiles
in a sandbox process with a wall-clock limit (grammar_sandbox.py).
"""

from __future__ import annotations

import dataclasses
import json

# One row per limit: (name, what it bounds). The order is the documentation's.
DESCRIPTIONS = {
    "max_n": "n (and best_of): sequences per prompt",
    "max_prompts": "prompts in one request (a batched completion)",
    "max_embedding_inputs": "inputs in one embedding, classification or scoring request (texts, "
                            "token lists or pairs)",
    "max_stop_strings": "stop strings",
    "max_stop_length": "characters of one stop string",
    "max_stop_token_ids": "stop_token_ids entries",
    "max_allowed_token_ids": "allowed_token_ids entries",
    "max_logit_bias": "logit_bias entries",
    "max_bad_words": "bad_words entries",
    "max_bad_word_length": "characters of one bad word",
    "max_logprobs": "logprobs / top_logprobs per token",
    "max_prompt_logprobs": "prompt_logprobs per token",
    "max_request_id_length": "characters of request_id (X-Request-Id, gRPC request_id)",
    "max_user_length": "characters of an end-user or cache-routing id (user, "
                       "prompt_cache_key)",
    "max_safety_identifier_length": "characters of /v1/responses' safety_identifier (as "
                                    "OpenAI's)",
    "max_response_bytes": "worst-case size of a response: choices x tokens x logprob entries",
    "max_abort_ids": "request ids in one gRPC Abort",
    "max_input_items": "input items of one /v1/responses request (messages, function calls "
                       "and their outputs, reasoning)",
    "max_tools": "tools of one chat or /v1/responses request",
    "max_lora_name_length": "characters of a LoRA adapter's name (lora_name; a request's "
                            "model naming one)",
    "max_lora_path_length": "characters of a LoRA adapter's folder (lora_path)",
    "max_lora_adapters": "LoRA adapters a server knows at once (--lora-modules and those "
                         "loaded at run time)",
    "max_schema_depth": "JSON schema nesting with its $refs followed",
    "max_schema_refs": "$ref entries in one JSON schema",
    "max_schema_nodes": "objects and arrays in one JSON schema",
    "max_schema_combinator_depth": "anyOf / oneOf / allOf nested in one another",
    "max_grammar_rules": "rules of one Lark / GBNF / EBNF grammar",
    "max_grammar_depth": "chain of rules referring to one another",
    "max_choices": "entries of a choice constraint",
    "max_choice_bytes": "UTF-8 bytes of all choice entries together",
    "max_regex_repetition": "product of nested counted repetitions in a regex, e.g. (a{10}){20}",
    "grammar_compile_timeout": "seconds one grammar may take to compile (and build its lexer)",
}


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Caps on one request. Every front end checks them (admission.InputProcessor)."""

    max_n: int = 16
    max_prompts: int = 256
    max_embedding_inputs: int = 2048  # as OpenAI's embeddings API
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_stop_token_ids: int = 256
    max_allowed_token_ids: int = 262_144  # the largest vocabularies (Gemma: 262,144)
    max_logit_bias: int = 1024
    max_bad_words: int = 128
    max_bad_word_length: int = 256
    max_logprobs: int = 20  # the top-k the device step computes
    max_prompt_logprobs: int = 20
    max_request_id_length: int = 256
    max_user_length: int = 256
    max_safety_identifier_length: int = 64  # OpenAI's cap
    max_response_bytes: int = 256 * 2**20
    max_abort_ids: int = 1024
    max_input_items: int = 2048
    max_tools: int = 128  # OpenAI's own cap on functions per request
    max_lora_name_length: int = 256
    max_lora_path_length: int = 4096  # PATH_MAX
    max_lora_adapters: int = 1024
    max_schema_depth: int = 256
    max_schema_refs: int = 1000
    max_schema_nodes: int = 100_000
    max_schema_combinator_depth: int = 32
    max_grammar_rules: int = 2000
    max_grammar_depth: int = 256
    max_choices: int = 4096
    max_choice_bytes: int = 1 << 20
    max_regex_repetition: int = 10_000
    grammar_compile_timeout: float = 10.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kind = float if field.type == "float" else int
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (kind is int and not isinstance(value, int)) or not value > 0:
                raise ValueError(f"request_limits.{field.name} must be a positive "
                                 f"{'number' if kind is float else 'integer'}, got {value!r}.")
        if self.max_logprobs > 20 or self.max_prompt_logprobs > 20:
            raise ValueError("request_limits.max_logprobs and max_prompt_logprobs can be at "
                             "most 20: the device step computes the top 20.")

    @classmethod
    def parse(cls, value: RequestLimits | dict | str | None) -> RequestLimits:
        """From a RequestLimits, a dict or its JSON text (the --request-limits flag); None
        gives the defaults. Unknown names are refused, naming the known ones."""
        if value is None:
            return cls()
        if isinstance(value, RequestLimits):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise ValueError(f"request_limits is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("request_limits must be a JSON object of limit names to values, "
                             f"got {type(value).__name__}.")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"request_limits: unknown names {unknown}; known: "
                             f"{', '.join(known)}.")
        return cls(**value)

    def replace(self, **changes) -> RequestLimits:
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def limit_error(field: str, what: str, limit_name: str, limit: int | float,
                got: int | float | None = None) -> ValueError:
    """The refusal for a request over one limit: names the field, the limit and its name
    (what a server operator raises with --request-limits)."""
    shown = f" (got {got})" if got is not None else ""
    err = ValueError(f"{field}: {what} is limited to {limit}{shown} "
                     f"(request limit {limit_name}).")
    err.param = field
    return err
