"""/v1/completions, /v1/chat/completions, /tokenize, /detokenize: requests in, JSON or SSE out.

Each request goes through the engine's admission path (jaxserve/engine/admission.py) in three
parts, none of them on the event loop. prepare_* runs in a worker thread: it parses and
validates the body, checks the request limits, renders the chat template and tokenizes.
with_grammar compiles a structured output's grammar on the grammar threads (never the
parsing threads: a slow grammar holds up only its own request). respond, on the event loop,
queues the engine requests and turns their outputs into responses; large responses (non-
streamed ones, streams with logprobs or echo) are encoded to JSON on the encoding threads.

A completion request with several prompts becomes one engine request per prompt, admitted
all or none; choice index = prompt index * n + sample index, as in the OpenAI API. The
response objects and stream chunks come from server/openai/output.py's ResponseView. A request the
engine fails gets a 500 envelope, or an error event in its stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.admission import ContextLengthError, EngineRequest
from jaxserve.parsers.reasoning import END as REASONING_END
from jaxserve.parsers.tools import PARSERS
from jaxserve.server.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    OverloadedError,
    RequestFailedError,
)
from jaxserve.server.errors import APIError, from_value_error, short
from jaxserve.server.openai.options import ChatSettings, ResponseOptions
from jaxserve.server.openai.output import ResponseView
from jaxserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from jaxserve.server.openai.tool_calls import check_tool_count
from jaxserve.server.request_body import parse_body
from jaxserve.server.request_log import log_received

if TYPE_CHECKING:
    from jaxserve.models.lora import LoRARequest
    from jaxserve.server.lora_models import LoraModels

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
REQUEST_ID_KEY = "jaxserve_request_id"  # in the ASGI scope's state, set by the app's guard


@dataclasses.dataclass
class Prepared:
    """A parsed, validated, tokenized request, ready to queue (its grammar compiled once
    with_grammar has run)."""

    kind: str  # "text_completion" | "chat.completion"
    body: CompletionRequest | ChatCompletionRequest
    params: SamplingParams
    requests: list[EngineRequest]  # one per prompt
    prompt_param: str  # the field a prompt problem is reported on
    model: str  # the name the response carries
    request_id: str

    @property
    def prompts(self) -> list[tuple[str | None, list[int]]]:
        """(text if given as text, token ids) per prompt."""
        return [(r.prompt, r.prompt_token_ids) for r in self.requests]

    @property
    def grammar_field(self) -> str:
        """The field a grammar problem is reported on."""
        return self.body.structured_field or "tools"

    @property
    def heavy(self) -> bool:
        """Whether its stream chunks are large enough to encode off the event loop."""
        return self.params.logprobs is not None or bool(self.body.echo)


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_names: str | tuple[str, ...],
                 chat: ChatSettings | None = None, *, grammar_pool: Executor,
                 encoders: Executor, options: ResponseOptions | None = None) -> None:
        """grammar_pool: the threads that compile grammars; encoders: the threads that
        encode large responses to JSON."""
        self.options = options or ResponseOptions()
        self.engine = engine
        self.served_names = (served_names,) if isinstance(served_names, str) else \
            tuple(served_names)
        self.model_name = self.served_names[0]
        self.chat = chat or ChatSettings()
        self.processor, self.tokenizer = engine.processor, engine.tokenizer
        self.max_model_len, self.vocab_size = engine.max_model_len, engine.vocab_size
        self.sampling_defaults = engine.sampling_defaults
        self.grammar_pool, self.encoders = grammar_pool, encoders
        self.loras: LoraModels | None = None  # the LoRA adapters by name (the server sets)

    def check_model(self, name: str | None) -> str:
        """The served name a request's `model` picks (any alias, or a LoRA adapter's name:
        lora_models.py; none or "": the first)."""
        if not name:
            return self.model_name
        if name not in self.served_names and (self.loras is None
                                              or self.loras.lookup(name) is None):
            adapters = self.loras.names() if self.loras is not None else []
            known = ", ".join(map(repr, [*self.served_names, *adapters][:16]))
            raise APIError(404, f"The model {name[:64]!r} does not exist; this server serves "
                           f"{known}.", param="model", code="model_not_found")
        return name

    def lora_of(self, model: str) -> LoRARequest | None:
        """The adapter a checked `model` names (None: the base model)."""
        return None if self.loras is None else self.loras.lookup(model)

    # ---- worker thread: parse, check, render, tokenize --------------------------------------
    def prepare_completion(self, raw: bytes, ids: tuple[str | None, str]) -> Prepared:
        """ids: (the X-Request-Id header or None, the id to use when the request has none)."""
        body = parse_body(raw, CompletionRequest)
        model = self.check_model(body.model)
        request_id = self._request_id("cmpl", body, ids)
        params = self._params(body, "prompt")
        prompts = self._completion_prompts(body.prompt, body.add_special_tokens)
        return self._admit("text_completion", body, params, prompts, "prompt", model,
                           request_id)

    def prepare_chat(self, raw: bytes, ids: tuple[str | None, str]) -> Prepared:
        return self.prepare_chat_body(parse_body(raw, ChatCompletionRequest), ids)

    def prepare_chat_body(self, body: ChatCompletionRequest, ids: tuple[str | None, str],
                          prefix: str = "chatcmpl",
                          prompt: list[int] | None = None) -> Prepared:
        """A validated chat request through the admission path (also /v1/responses', which
        translates its requests into chat requests: server/responses/protocol.py). prompt: its
        messages as render_chat_body renders them, when the caller has them already."""
        model = self.check_model(body.model)
        request_id = self._request_id(prefix, body, ids)
        params = self._params(body, "messages")
        if body.tool_mode == "auto" and self.chat.tool_call_parser is None:
            raise APIError(400, 'tool_choice "auto" needs the server started with '
                           "--enable-auto-tool-choice and --tool-call-parser; or use "
                           '"required" or a named function.', param="tool_choice",
                           code="invalid_value")
        if body.tool_mode == "auto" and PARSERS[self.chat.tool_call_parser].keeps_special_tokens:
            params = params.clone(skip_special_tokens=False)  # e.g. mistral's [TOOL_CALLS]
        if body.include_reasoning is False and self.chat.reasoning_parser is None:
            raise APIError(400, "include_reasoning=false needs the server started with "
                           "--reasoning-parser.", param="include_reasoning",
                           code="invalid_value")
        if self.chat.reasoning_parser is not None and params.structured_outputs is not None \
                and self.end_of_thinking_is_one_token():
            params = params.clone(structured_outputs=dataclasses.replace(
                params.structured_outputs, starts_after=REASONING_END))
        if body.chat_template is not None and not self.chat.trust_request_template:
            raise APIError(400, "chat_template: a chat template sent with the request is "
                           "refused unless the server runs with --trust-request-chat-template.",
                           param="chat_template", code="invalid_value")
        if prompt is None:
            prompt = self.render_chat_body(body)
        return self._admit("chat.completion", body, params, [(None, prompt)], "messages",
                           model, request_id)

    def render_chat_body(self, body: ChatCompletionRequest) -> list[int]:
        """A chat request's messages (and tools) through the chat template: its prompt."""
        try:
            kwargs = body.template_kwargs(self.chat.default_kwargs,
                                          not self.chat.exclude_tools_when_none)
            messages = body.template_messages()
        except ValueError as err:
            raise from_value_error(err, "messages") from None
        return self._render_chat(messages, body.adds_generation_prompt,
                                 body.chat_template or self.chat.template, kwargs,
                                 body.add_special_tokens)

    def _request_id(self, prefix: str, body, ids: tuple[str | None, str]) -> str:
        """As vLLM: the X-Request-Id header, else the body's request_id, else a fresh id;
        a given one within the request_id length limit."""
        header, fresh = ids
        own = header or body.request_id
        if own:
            try:
                self.processor.check_request_id(own, "X-Request-Id" if header else
                                                "request_id")
            except ValueError as err:
                raise from_value_error(err) from None
        return f"{prefix}-{own or fresh}"

    def _params(self, body, prompt_param: str) -> SamplingParams:
        """The body's SamplingParams through the request limits (admission.py)."""
        # tools counted before their schemas become a grammar (a completion body declares
        # none: a "tools" there is an unknown field, logged and ignored as vLLM does)
        tools = body.tools if "tools" in type(body).model_fields else None
        try:
            self.processor.check_identifier(body.user, "user")
            check_tool_count(len(tools or ()), self.processor.limits)
            return self.processor.check_params(body.sampling_params(self.sampling_defaults))
        except ValueError as err:
            if getattr(err, "param", None) == "structured_outputs":
                raise _grammar_error(err, body.structured_field or "tools") from None
            raise from_value_error(err, prompt_param) from None

    def _admit(self, kind: str, body, params: SamplingParams, prompts, param: str, model: str,
               request_id: str) -> Prepared:
        """The prompts through the admission path (process_prompts: truncation, the context
        length, the worst-case response size, the model's checks); a max_tokens that does
        not fit beside a prompt is refused, as OpenAI and vLLM refuse it."""
        try:
            requests = self.processor.process_prompts(
                [f"{request_id}-{i}" for i in range(len(prompts))], prompts, params,
                body.priority, body.cache_salt, compile_grammar=False,
                lora=self.lora_of(model), strict_context=True)
        except ContextLengthError as err:
            raise context_length_error(err, param) from None
        except ValueError as err:
            raise from_value_error(err, param) from None
        return Prepared(kind, body, params, requests, param, model, request_id)

    def end_of_thinking_is_one_token(self) -> bool:
        """Whether the grammar can wait for the end of the reasoning: its marker is one
        token (Qwen3, DeepSeek-R1); otherwise it applies from the start."""
        return len(self.tokenizer.encode(REASONING_END, add_special_tokens=False)) == 1

    def tokenize(self, raw: bytes) -> dict:
        body = parse_body(raw, TokenizeRequest)
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of prompt or messages.", param="prompt")
        if body.messages is not None:
            try:
                messages = [m.as_template_message() for m in body.messages]
            except ValueError as err:
                raise from_value_error(err, "messages") from None
            ids = self._render_chat(messages, body.add_generation_prompt, self.chat.template,
                                    dict(self.chat.default_kwargs))
        else:
            ids = self.processor.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def detokenize(self, raw: bytes) -> dict:
        body = parse_body(raw, DetokenizeRequest)
        self.check_model(body.model)
        if any(not 0 <= t < self.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {self.vocab_size}).", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool,
                     template: str | None, kwargs: dict,
                     add_special_tokens: bool = False) -> list[int]:
        try:
            return self.processor.render_chat(messages,
                                              add_generation_prompt=add_generation_prompt,
                                              add_special_tokens=add_special_tokens,
                                              chat_template=template, **kwargs)
        except ValueError as err:
            raise from_value_error(err, "messages") from None

    def _completion_prompts(self, prompt, add_special_tokens: bool = True
                            ) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        try:
            self.processor.check_prompt_count(len(prompt))
        except ValueError as err:
            raise from_value_error(err) from None
        out = []
        for item in prompt:
            if isinstance(item, str):
                if not item:
                    raise APIError(400, "prompt must not be empty.", param="prompt")
                out.append((item, self.processor.encode(item, add_special_tokens)))
            else:
                out.append((None, list(item)))
        return out

    # ---- grammar threads ------------------------------------------------------------------
    async def with_grammar(self, prepared: Prepared) -> Prepared:
        """Compile the request's structured output (if any) on the grammar threads: the
        sandbox first, then here, cached by its text. A 400 naming the field that asked for
        it when it cannot be used."""
        if prepared.params.structured_outputs is None:
            return prepared
        loop = asyncio.get_running_loop()
        try:
            grammar = await loop.run_in_executor(self.grammar_pool,
                                                 self.processor.compile_grammar, prepared.params)
        except ValueError as err:
            raise _grammar_error(err, prepared.grammar_field) from None
        prepared.requests = [r.with_grammar(grammar) for r in prepared.requests]
        return prepared

    # ---- event loop: queue and respond ----------------------------------------------------
    async def respond(self, prepared: Prepared, raw: Request):
        body = prepared.body
        if self.options.log_requests:
            log_received(prepared.request_id, prepared.prompts, prepared.params,
                         self.options.max_log_len)
        if body.user:  # OpenAI's end-user id: for the operator's abuse monitoring
            logger.info("request %s: user %r", prepared.request_id[:300], body.user[:128])
        try:
            streams = self.engine.submit_many(prepared.requests)
        except (OverloadedError, EngineDeadError, ValueError) as err:
            raise api_error(err, prepared.prompt_param) from None
        view = ResponseView(prepared.kind, prepared.request_id, prepared.model, body,
                            prepared.prompts, self)
        if prepared.body.stream:
            return _sse(self._stream(view, streams, prepared.heavy))
        return await self.respond_whole(view, streams, raw)

    async def respond_whole(self, view, streams, raw: Request) -> Response:
        """Wait for every prompt's last output; the first failure ends the request (and
        aborts its other prompts), as does the client leaving. The response is encoded on
        the encoding threads (it can be megabytes of logprobs). view: anything with
        full_response(finals) (ResponseView; server/responses/output.py's ResponseBuilder)."""
        async def last(stream):
            final = None
            async for output in stream:
                if output.error is not None:
                    raise RequestFailedError(output.error, output.error_param)
                final = output
            return final

        tasks = [asyncio.ensure_future(last(s)) for s in streams]
        for task in tasks:
            task.add_done_callback(_retrieve)
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=_DISCONNECT_POLL_S,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()  # raises the first failure
                if pending and await raw.is_disconnected():
                    return JSONResponse({}, status_code=499)
            finals = [task.result() for task in tasks]
        except (OverloadedError, EngineDeadError, RequestFailedError, ValueError) as err:
            raise api_error(err) from None
        finally:
            for task in tasks:
                task.cancel()  # those still waiting: their requests are aborted
        content = await asyncio.get_running_loop().run_in_executor(
            self.encoders, _json_bytes, view.full_response, finals)
        return Response(content, media_type="application/json")

    async def _stream(self, view, streams, heavy: bool) -> AsyncIterator[str]:
        """SSE events of the request's prompts as they come. Each prompt's stream holds at
        most its latest output while this generator waits for the client to read (the
        client's pace bounds nothing but what is sent). heavy: chunks carry logprobs or an
        echoed prompt, and are encoded on the encoding threads."""
        loop = asyncio.get_running_loop()
        outputs = [stream.__aiter__() for stream in streams]
        waiting: dict[asyncio.Future, int] = {}
        merged = _merged(outputs, waiting)
        try:
            for chunk in view.opening_chunks():
                yield _event(chunk)
            async for index, output in merged:
                if output.error is not None:
                    raise RequestFailedError(output.error, output.error_param)
                if heavy:
                    events = await loop.run_in_executor(self.encoders, _events, view.chunks,
                                                        index, output)
                else:
                    events = _events(view.chunks, index, output)
                if events:
                    yield events
            usage = view.usage_chunk()
            if usage is not None:
                yield _event(usage)
        except Exception as err:  # noqa: BLE001 - the stream has started: report in-band
            if api_error(err).status == 500 and not isinstance(err, RequestFailedError):
                logger.error("Stream %s failed: %s", view.id, err, exc_info=err)
            yield _event(api_error(err).body())
        finally:
            await merged.aclose()
            for task in waiting:
                task.cancel()
            if waiting:
                await asyncio.wait(waiting)
            for it in outputs:
                await it.aclose()  # a request still running is aborted, its blocks freed
        yield "data: [DONE]\n\n"


async def _merged(outputs: list, waiting: dict) -> AsyncIterator[tuple[int, object]]:
    """(prompt index, output) from several prompts' output iterators as they come; one
    prompt's is read directly (the common case: no task per output). waiting: the reads
    under way, for the caller to cancel."""
    if len(outputs) == 1:
        async for output in outputs[0]:
            yield 0, output
        return
    for i, it in enumerate(outputs):
        waiting[asyncio.ensure_future(it.__anext__())] = i
    while waiting:
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            index = waiting.pop(task)
            try:
                output = task.result()
            except StopAsyncIteration:
                continue
            yield index, output
            if not output.finished:
                waiting[asyncio.ensure_future(outputs[index].__anext__())] = index


def _retrieve(future: asyncio.Future) -> None:
    """Read a finished task's exception, so that asyncio does not log one that lost the race
    to report first as "never retrieved"."""
    if not future.cancelled():
        future.exception()


def context_length_error(err: ContextLengthError, param: str) -> APIError:
    """The admission path's ContextLengthError in OpenAI's (and vLLM's) words, which clients
    and gateways recognise (400, code context_length_exceeded): a prompt that leaves no room
    for output, or a max_tokens that does not fit next to its prompt. param: the field the
    prompt came in (prompt, messages)."""
    limit, prompt = err.max_model_len, err.prompt_tokens
    if err.max_tokens is None:
        message = (f"This model's maximum context length is {limit} tokens. However, your "
                   f"request has {prompt} input tokens. Please reduce the length of the "
                   f"input {param}.")
    else:
        message = (f"This model's maximum context length is {limit} tokens. However, you "
                   f"requested {err.requested} tokens ({prompt} in the {param}, "
                   f"{err.max_tokens} in the completion). Please reduce the length of the "
                   f"{param} or completion.")
    return APIError(400, message, param=param, code="context_length_exceeded")


def _grammar_error(err: ValueError, field: str) -> APIError:
    """A structured-output refusal as a 400 naming the request's own field for it."""
    message = str(err)
    if message.startswith("structured_outputs"):
        message = field + message[len("structured_outputs"):]
    return APIError(400, short(message), param=field, code="invalid_value")


def api_error(err: BaseException, prompt_param: str = "prompt") -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, OverloadedError):
        return APIError(429, str(err), code="overloaded")
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), code="engine_dead")
    if isinstance(err, RequestFailedError) and err.param is not None:
        return APIError(400, short(str(err)), param=err.param, code="invalid_value")
    if isinstance(err, RequestFailedError):
        return APIError(500, f"{str(err)[:1].upper()}{str(err)[1:]}; other requests are not "
                        "affected.", code="internal_error")
    if isinstance(err, ValueError):
        return from_value_error(err, prompt_param)
    return APIError(500, "internal error while generating", code="internal_error")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _events(chunks, index: int, output) -> str:
    """The SSE events of one output (chunks: ResponseView.chunks)."""
    return "".join(_event(chunk) for chunk in chunks(index, output))


def _json_bytes(full_response, finals) -> bytes:
    """The response body, as JSONResponse renders it."""
    return _dumps_in_pieces(full_response(finals)).encode("utf-8")


def _dumps_in_pieces(value, depth: int = 4) -> str:
    """json.dumps(value) (compact, as JSONResponse), made of one call per part down to
    `depth` levels: one json.dumps call holds the GIL from start to end, so a single call
    over a response of tens of megabytes (echoed prompts with their logprobs) would stall
    the event loop even from another thread."""
    if depth and isinstance(value, dict):
        return "{" + ",".join(json.dumps(str(k), ensure_ascii=False) + ":"
                              + _dumps_in_pieces(v, depth - 1) for k, v in value.items()) + "}"
    if depth and isinstance(value, list) and len(value) > 1:
        return "[" + ",".join(_dumps_in_pieces(v, depth - 1) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
