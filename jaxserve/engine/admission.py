"""The admission path: every request, from every front end, becomes a trusted EngineRequest
here (vLLM's InputProcessor).

The HTTP server, the gRPC service and the offline LLM all call one InputProcessor, in this
order, so that the cheap checks come before any expensive work:
1. check_params: the request limits table (request_limits.py: n, stops, token-id lists,
   bad words, logit bias, logprobs, structured-output caps) and, for a structured output,
   its schema parsed with a depth bound and its structure checked (grammar_checks.py);
   check_request_id, check_identifier, check_prompt_count, check_priority likewise (a pooling request:
   check_pooling_count, and its PoolingParams resolved against the engine's pooler);
2. render_chat / encode: chat templates and tokenization (request text stays text);
3. process / process_prompts: truncation (once per prompt), the model's checks (the
   context length: ContextLengthError; the vocabulary), the output budget (computed here
   once: EngineRequest.max_output_tokens), bad words tokenized, the worst-case response
   size, the structured output's start token: an EngineRequest (process_pooling for
   embeddings, classifications and scores);
4. compile_grammar: the constraint compiled, first in the sandbox process
   (grammar_sandbox.py), then here; the server runs it on threads of its own, so grammar
   compiles never occupy the threads that parse ordinary requests.
Every refusal is a ValueError naming the field (a 400 / INVALID_ARGUMENT in the servers);
a prompt that does not fit the context is a ContextLengthError carrying the numbers, which
each front end words in its own terms (the OpenAI server as OpenAI's
context_length_exceeded, gRPC as INVALID_ARGUMENT, the offline LLM as this message).
The engine takes EngineRequests as they are: its own checks only assert this contract.
The server calls 1-3 (and 4) off the event loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxserve.config.generation_config import eos_token_ids
from jaxserve.config.request_limits import RequestLimits, limit_error
from jaxserve.core import grammar_checks
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_fields import MAX_BANNED_IDS
from jaxserve.core.structured_output import GrammarCompiler
from jaxserve.core.token_constraints import TokenConstraints
from jaxserve.inputs.tokenizer import (
    apply_chat_template,
    encode_pair,
    encode_prompt,
    load_tokenizer,
    with_special_tokens,
)
from jaxserve.models.lora import LoRARequest, inspect_adapter

# What one token of a response can cost in bytes, for the worst-case size: its text and id,
# and each logprob entry ({"token", "logprob", "bytes", ...} in JSON).
_TOKEN_BYTES = 16
_LOGPROB_ENTRY_BYTES = 96


def output_budget(max_tokens: int | None, prompt_tokens: int, max_model_len: int) -> int:
    """The most tokens each sequence of a prompt_tokens-token prompt may generate: max_tokens
    capped by what the context leaves (max_model_len - prompt_tokens); all of that when
    max_tokens is not set."""
    room = max_model_len - prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


class ContextLengthError(ValueError):
    """A prompt (truncated) that leaves no room for output (a pooling prompt, which gets
    none: one longer than max_model_len), or a max_tokens that does not fit beside it where
    the front end refuses that rather than cut it (strict). The message is the engine's
    wording; the servers word it from the numbers in their protocol's terms."""

    def __init__(self, prompt_tokens: int, max_model_len: int, max_tokens: int | None = None,
                 *, pooling: bool = False) -> None:
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len
        self.max_tokens = max_tokens  # the output asked for; None: the prompt alone is too long
        self.pooling = pooling
        if max_tokens is not None:
            message = (f"max_tokens={max_tokens} does not fit beside the {prompt_tokens}-token "
                       f"prompt: this model's maximum context length is {max_model_len} "
                       f"tokens; lower max_tokens or shorten the prompt.")
        elif pooling:
            message = (f"prompt is {prompt_tokens} tokens long, but may be at most "
                       f"max_model_len={max_model_len} tokens (truncate_prompt_tokens keeps "
                       "the last ones).")
        else:
            message = (f"prompt is {prompt_tokens} tokens long, but must be shorter than "
                       f"max_model_len={max_model_len} to leave room for output.")
        super().__init__(message)

    @property
    def requested(self) -> int:
        """The tokens the request asked the context to hold (prompt and output)."""
        return self.prompt_tokens + (self.max_tokens or 0)


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """A request the admission path has checked: the engine runs it as it is."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # truncated, checked against the model
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    constraints: TokenConstraints | None = None  # logit_bias, allowed ids, bad words
    grammar: Any = None  # the compiled constraint (llguidance matcher), copied per sequence
    grammar_start: int | None = None  # the token after which the grammar applies
    # A pooling request's settings, resolved (PoolingParams.resolve); params is then the
    # engine's internal one-token SamplingParams (pooling_sampling_params). None: generation.
    pooling: PoolingParams | None = None
    lora: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    # The most tokens each of its sequences may generate (output_budget, computed once, at
    # admission); None only in a request built by hand, which gets what the context leaves.
    max_output_tokens: int | None = None

    def with_grammar(self, grammar) -> EngineRequest:
        return dataclasses.replace(self, grammar=grammar)

    def cache_keys(self) -> tuple:
        """What its sequences' prefix-cache blocks are keyed by beside their tokens: its
        adapter (KV computed through one is not the base model's) and its cache salt."""
        keys = ()
        if self.lora is not None:
            keys += ("lora", self.lora.lora_name, self.lora.lora_int_id, self.lora.lora_path)
        if self.cache_salt is not None:
            keys += ("cache_salt", str(self.cache_salt))
        return keys

    def budget(self, max_model_len: int) -> int:
        """The most tokens each of its sequences may generate: max_output_tokens, as
        admission computed it."""
        if self.max_output_tokens is not None:
            return self.max_output_tokens
        return output_budget(self.params.max_tokens, len(self.prompt_token_ids), max_model_len)


def pooling_sampling_params() -> SamplingParams:
    """What a pooling request's sequence is scheduled with: one greedy token, which the
    engine discards (its prompt's end finishes it: core/pooling.py)."""
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class InputProcessor:
    """Checks, renders, tokenizes and compiles requests for one engine. Thread-safe: the
    server calls it from several worker threads at once."""

    def __init__(self, model_config, scheduling_policy: str, tokenizer, eos_token_ids,
                 grammars: GrammarCompiler, limits: RequestLimits, pooler=None,
                 lora=None) -> None:
        """pooler: the engine's config.pooler.PoolerConfig (None: it generates); lora: its
        config.lora.LoraConfig (None: LoRA off)."""
        self.pooler = pooler
        self.lora, self.hf_config = lora, getattr(model_config, "hf_config", None)
        self._adapters: dict = {}  # adapters checked (check_lora), oldest first
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.vocab_size
        self.scheduling_policy = scheduling_policy
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammars = grammars
        self.limits = limits

    @classmethod
    def for_config(cls, config) -> InputProcessor:
        """The admission path of an engine's config (config.engine_config.EngineConfig): its
        tokenizer, EOS ids and grammar compiler made here."""
        tokenizer = load_tokenizer(config.model.tokenizer)
        eos = frozenset(eos_token_ids(config.model.model, config.model.hf_config,
                                      tokenizer.eos_token_id))
        grammars = GrammarCompiler(tokenizer, config.model.vocab_size, eos)
        return cls(config.model, config.scheduler.policy, tokenizer, eos, grammars,
                   config.limits, config.pooler, config.lora)

    # ---- 1. the limits table: cheap, before anything else -----------------------------------
    def check_params(self, params: SamplingParams) -> SamplingParams:
        """params against the limits table; returns it with a structured output's schema
        parsed (bounded) and checked. ValueError naming the field and the limit."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(params).__name__}.")
        limits = self.limits
        counts = (
            ("n", params.n, "the number of sequences per prompt", "max_n"),
            ("stop", len(params.stop), "the number of stop strings", "max_stop_strings"),
            ("stop_token_ids", len(params.stop_token_ids), "the number of stop_token_ids",
             "max_stop_token_ids"),
            ("allowed_token_ids", len(params.allowed_token_ids or ()),
             "the number of allowed_token_ids", "max_allowed_token_ids"),
            ("logit_bias", len(params.logit_bias or ()), "the number of logit_bias entries",
             "max_logit_bias"),
            ("bad_words", len(params.bad_words or ()), "the number of bad_words",
             "max_bad_words"),
            ("logprobs", params.logprobs or 0, "the number of logprobs per token",
             "max_logprobs"),
            ("prompt_logprobs", params.prompt_logprobs or 0,
             "the number of logprobs per prompt token", "max_prompt_logprobs"),
        )
        for field, value, what, name in counts:
            if value > getattr(limits, name):
                raise limit_error(field, what, name, getattr(limits, name), value)
        longest = max(map(len, params.stop), default=0)
        if longest > limits.max_stop_length:
            raise limit_error("stop", "the length of a stop string", "max_stop_length",
                              limits.max_stop_length, longest)
        longest = max(map(len, params.bad_words or ()), default=0)
        if longest > limits.max_bad_word_length:
            raise limit_error("bad_words", "the length of a bad word", "max_bad_word_length",
                              limits.max_bad_word_length, longest)
        structured = params.structured_outputs
        if structured is not None:
            try:
                checked = grammar_checks.check_constraint(structured, limits,
                                                          "structured_outputs")
            except ValueError as err:
                err.param = "structured_outputs"  # the front end names its own field
                raise
            if checked is not structured:
                params = params.clone(structured_outputs=checked)
        return params

    def check_lora(self, lora, field: str = "lora_request") -> None:
        """A request's adapter: LoRA on, a LoRARequest, its folder a PEFT adapter that fits
        the model within max_lora_rank, every weight finite (models/lora.py's checks on its
        config, tensor header and values; each adapter checked once)."""
        if lora is None:
            return
        if self.lora is None:
            raise ValueError(f"{field}: LoRA adapters are off on this engine; start it with "
                             "enable_lora=True (--enable-lora).")
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"{field} must be a LoRARequest, got {type(lora).__name__}.")
        limits = self.limits
        if len(lora.lora_name) > limits.max_lora_name_length:
            raise limit_error(f"{field}.lora_name", "an adapter's name",
                              "max_lora_name_length", limits.max_lora_name_length,
                              len(lora.lora_name))
        if len(lora.lora_path) > limits.max_lora_path_length:
            raise limit_error(f"{field}.lora_path", "an adapter's folder",
                              "max_lora_path_length", limits.max_lora_path_length,
                              len(lora.lora_path))
        if lora in self._adapters:
            return
        try:
            inspect_adapter(lora.lora_path, self.hf_config, self.lora.max_lora_rank,
                            values=True)
        except ValueError as err:
            raise ValueError(f"{field}: LoRA adapter {lora.lora_name!r}: {err}") from None
        if len(self._adapters) >= 1024:
            self._adapters.pop(next(iter(self._adapters)), None)
        self._adapters[lora] = True

    def check_request_id(self, request_id: str, field: str = "request_id") -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"{field} must be a non-empty string.")
        if len(request_id) > self.limits.max_request_id_length:
            raise limit_error(field, "the length of a request id", "max_request_id_length",
                              self.limits.max_request_id_length, len(request_id))

    def check_identifier(self, value: str | None, field: str) -> None:
        """An end-user or routing id a request carries (user, prompt_cache_key,
        safety_identifier): echoed and stored, so bounded (max_user_length;
        safety_identifier: max_safety_identifier_length)."""
        name = "max_safety_identifier_length" if field == "safety_identifier" \
            else "max_user_length"
        limit = getattr(self.limits, name)
        if value is not None and len(value) > limit:
            raise limit_error(field, "the length of an end-user id", name, limit, len(value))

    def check_prompt_count(self, count: int, field: str = "prompt") -> None:
        if count > self.limits.max_prompts:
            raise limit_error(field, "the number of prompts in one request", "max_prompts",
                              self.limits.max_prompts, count)

    def check_pooling_count(self, count: int, field: str = "input") -> None:
        """The inputs of one embedding, classification or scoring request (a pair counts
        once) against max_embedding_inputs."""
        if count > self.limits.max_embedding_inputs:
            raise limit_error(field, "the number of inputs in one pooling request",
                              "max_embedding_inputs", self.limits.max_embedding_inputs, count)

    def check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r:.40}.")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs priority scheduling: start the engine "
                             "with scheduling_policy='priority' (--scheduling-policy "
                             "priority).")

    # ---- 2. templates and tokenization ----------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (the tokenizer releases the GIL while it works)."""
        return encode_prompt(self.tokenizer, text, add_special_tokens)

    def encode_pair(self, text: str, text_pair: str) -> list[int]:
        """A text pair's token ids as the tokenizer encodes pairs (a cross-encoder's input:
        tokenizer(text, text_pair))."""
        return encode_pair(self.tokenizer, text, text_pair)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, chat_template: str | None = None,
                    **kwargs) -> list[int]:
        """A conversation through the chat template, tokenized so that no text the request
        supplied becomes a special token (tokenizer.apply_chat_template)."""
        ids = apply_chat_template(self.tokenizer, messages,
                                  add_generation_prompt=add_generation_prompt,
                                  chat_template=chat_template, **kwargs)
        return with_special_tokens(self.tokenizer, ids) if add_special_tokens else ids

    # ---- 3. the model's checks -------------------------------------------------------------
    def truncate(self, prompt_token_ids: list[int],
                 params: SamplingParams | PoolingParams) -> list[int]:
        """The prompt as params.truncate_prompt_tokens keeps it, as vLLM: k tokens (-1: all
        the context holds with room for output, max_model_len - 1; a pooling request's,
        which gets no output, max_model_len), the last k unless truncation_side is
        "right"."""
        k, pooling = params.truncate_prompt_tokens, isinstance(params, PoolingParams)
        if k is None:
            return prompt_token_ids
        if k == -1:
            k = self.max_model_len - (0 if pooling else 1)
        if k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens={k} cannot be greater than "
                             f"max_model_len={self.max_model_len}; request a smaller "
                             "truncation size.")
        if getattr(params, "truncation_side", "left") == "right":
            return list(prompt_token_ids[:k])
        return list(prompt_token_ids[-k:])

    def process(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                params: SamplingParams, priority: int = 0, cache_salt: str | None = None,
                *, compile_grammar: bool = True, lora: LoRARequest | None = None,
                strict_context: bool = False) -> EngineRequest:
        """One prompt of a request, ready for the engine (process_prompts for one)."""
        return self.process_prompts([request_id], [(prompt, prompt_token_ids)], params,
                                    priority, cache_salt, compile_grammar=compile_grammar,
                                    lora=lora, strict_context=strict_context)[0]

    def process_prompts(self, request_ids: list[str],
                        prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                        priority: int = 0, cache_salt: str | None = None, *,
                        compile_grammar: bool = True, lora: LoRARequest | None = None,
                        strict_context: bool = False) -> list[EngineRequest]:
        """The prompts of one request ((text or None, token ids) each, with one SamplingParams
        already through check_params), ready for the engine, all or none: each truncated
        once and checked against the context (ContextLengthError) and the vocabulary, its
        output budget computed (max_output_tokens), the worst-case response size of them
        all checked. strict_context: a max_tokens that does not fit beside a prompt is
        refused (the servers, as OpenAI's and vLLM's) rather than cut to what the context
        leaves (the offline LLM, as vLLM's). compile_grammar=False leaves the grammar to
        compile_grammar (the server runs that on its grammar threads) and with_grammar.
        lora: the adapter they run with (check_lora)."""
        if self.pooler is not None:
            raise ValueError(f"This model is served for pooling ({self.pooler.task}: "
                             "runner='pooling'): it generates no text. Send embedding, "
                             "classification or scoring requests, or start the engine with "
                             "runner='generate' on a generative model.")
        for request_id in request_ids:
            self.check_request_id(request_id)
        self.check_priority(priority)
        checked, budgets = [], []
        for _, ids in prompts:
            ids = self.check_prompt(self.truncate(ids, params))
            checked.append(ids)
            budgets.append(self.check_context(len(ids), params.max_tokens,
                                              strict=strict_context))
        self._check_response_size(params, [len(ids) for ids in checked], budgets)
        self.check_lora(lora)
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got "
                             f"{params.stop_token_ids[:8]}.")
        constraints = self._constraints(params)
        starts = [self._grammar_start(params, ids) for ids in checked]
        grammar = None
        if params.structured_outputs is not None and compile_grammar:
            grammar = self.compile_grammar(params)
        return [EngineRequest(request_id, text, ids, params, priority, cache_salt,
                              constraints, grammar, start, lora=lora, max_output_tokens=budget)
                for request_id, (text, _), ids, start, budget
                in zip(request_ids, prompts, checked, starts, budgets)]

    def process_pooling(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                        params: PoolingParams, priority: int = 0,
                        cache_salt: str | None = None) -> EngineRequest:
        """One input of an embedding, classification or scoring request, ready for the
        engine: params resolved against the engine's pooler (ValueError naming the field it
        cannot honour, or saying that this engine generates), the prompt truncated
        (truncate_prompt_tokens: the last k tokens, -1: max_model_len) and checked; a
        pooling prompt may fill max_model_len."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got "
                             f"{type(params).__name__}.")
        params = params.resolve(self.pooler)
        self.check_request_id(request_id)
        self.check_priority(priority)
        ids = self.check_prompt(self.truncate(prompt_token_ids, params), pooling=True)
        sampling = pooling_sampling_params()
        return EngineRequest(request_id, prompt, ids, sampling, priority, cache_salt,
                             pooling=params, max_output_tokens=self.check_context(
                                 len(ids), sampling.max_tokens, pooling=True))

    def check_prompt(self, prompt_token_ids, pooling: bool = False) -> list[int]:
        """The prompt as a list of ints in the vocabulary that fits the context
        (check_context)."""
        vocab = self.vocab_size
        count = len(prompt_token_ids)
        if count == 0:
            raise ValueError("prompt must not be empty (it has 0 tokens).")
        self.check_context(count, pooling=pooling)
        try:
            ids = np.asarray(prompt_token_ids)
        except (ValueError, TypeError):
            ids = np.asarray([], np.int64)  # ragged or odd: reported below
        if ids.ndim != 1 or ids.size != count or ids.dtype.kind not in "iu" or \
                ids.min() < 0 or ids.max() >= vocab:
            bad = [t for t in prompt_token_ids if isinstance(t, bool) or not (
                isinstance(t, (int, np.integer)) and 0 <= t < vocab)][:3]
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}) (the model's "
                             f"vocabulary); got {bad!r:.80}.")
        return ids.tolist()

    def check_context(self, prompt_tokens: int, max_tokens: int | None = None, *,
                      pooling: bool = False, strict: bool = False) -> int:
        """The context-length check, the one place it is made: ContextLengthError for a
        prompt shorter than max_model_len leaves no room for output (a pooling prompt, which
        gets none, may fill it), and, strict, for a max_tokens that does not fit beside it.
        Returns the output budget (output_budget: max_tokens cut to what the context
        leaves)."""
        limit = self.max_model_len
        if prompt_tokens > limit - (0 if pooling else 1):
            raise ContextLengthError(prompt_tokens, limit, pooling=pooling)
        budget = output_budget(max_tokens, prompt_tokens, limit)
        if strict and max_tokens is not None and budget < max_tokens:
            raise ContextLengthError(prompt_tokens, limit, max_tokens)
        return budget

    def check_response_size(self, params: SamplingParams, prompt_lengths: list[int]) -> None:
        """The worst case of what the request's responses could hold (every choice running
        to its output budget, each token with its logprob entries) against
        max_response_bytes."""
        self._check_response_size(params, prompt_lengths, [
            output_budget(params.max_tokens, n, self.max_model_len) for n in prompt_lengths])

    def _check_response_size(self, params: SamplingParams, prompt_lengths: list[int],
                             budgets: list[int]) -> None:
        per_token = _TOKEN_BYTES + _LOGPROB_ENTRY_BYTES * (
            params.logprobs + 1 if params.logprobs is not None else 0)
        per_prompt_token = _LOGPROB_ENTRY_BYTES * (
            params.prompt_logprobs + 1 if params.prompt_logprobs is not None else 0)
        total = sum(params.n * (new * per_token + length * per_prompt_token)
                    for length, new in zip(prompt_lengths, budgets))
        limit = self.limits.max_response_bytes
        if total > limit:
            fields = "max_tokens, n" + (", logprobs" if params.logprobs is not None else "") \
                + (", prompt_logprobs" if params.prompt_logprobs is not None else "")
            err = ValueError(f"The response to this request could reach {total / 2**20:.0f} "
                             f"MiB, over the limit of {limit / 2**20:.0f} MiB (request limit "
                             f"max_response_bytes): lower {fields}.")
            err.param = "max_tokens" if params.logprobs is None else "logprobs"
            raise err

    def _constraints(self, params: SamplingParams) -> TokenConstraints | None:
        constraints = TokenConstraints.from_params(params, self.tokenizer)
        if constraints is None:
            return None
        vocab = self.vocab_size
        bad = [t for t in constraints.token_ids() if not 0 <= t < vocab][:3]
        if bad:
            field = ("logit_bias" if any(t in (params.logit_bias or {}) for t in bad) else
                     "allowed_token_ids")
            raise ValueError(f"{field} must name token ids in [0, {vocab}) (the model's "
                             f"vocabulary); got {bad}.")
        stops = len(self.eos_token_ids | set(params.stop_token_ids)) if params.min_tokens \
            else 0
        if stops > MAX_BANNED_IDS:
            raise ValueError(f"min_tokens works with at most {MAX_BANNED_IDS} stop_token_ids "
                             "(EOS included).")
        if stops + len(constraints.bad_sequences) > MAX_BANNED_IDS:
            raise ValueError(f"bad_words: at most {MAX_BANNED_IDS - stops} words of several "
                             f"tokens (each spelling counts), got "
                             f"{len(constraints.bad_sequences)}.")
        return constraints

    # ---- 4. grammars -----------------------------------------------------------------------
    def compile_grammar(self, params: SamplingParams):
        """The compiled constraint of params.structured_outputs (sandboxed the first time,
        then cached by its text); ValueError naming structured_outputs when it cannot be
        used. Blocks for up to the grammar_compile_timeout limit: call it off the event
        loop, on threads other than those that parse requests."""
        try:
            return self.grammars.compile(params.structured_outputs,
                                         self.limits.grammar_compile_timeout)
        except ValueError as err:
            raise ValueError(f"structured_outputs: {err}") from None

    def _grammar_start(self, params: SamplingParams, prompt: list[int]) -> int | None:
        """The token a constraint waits for (structured_outputs.starts_after), or None when
        it applies at once: no constraint or none is set, or the prompt already holds it
        after the last opening "<think>" (a template that turned thinking off)."""
        if params.structured_outputs is None:
            return None
        after = params.structured_outputs.starts_after
        if after is None:
            return None
        end = self._single_token(after, "structured_outputs.starts_after")
        start = self._single_token(after.replace("/", "", 1), None) if "/" in after else None
        last_end = max((i for i, t in enumerate(prompt) if t == end), default=-1)
        last_start = max((i for i, t in enumerate(prompt) if t == start), default=-1)
        return None if last_end > last_start else end

    def _single_token(self, text: str, field: str | None) -> int | None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            if field is None:
                return None
            raise ValueError(f"{field} must be one token of the vocabulary; {text!r} is "
                             f"{len(ids)} tokens.")
        return ids[0]
