"""/v1/completions, /v1/chat/completions, /tokenize, /detokenize: requests in, JSON or SSE out.

Each request is prepared in two halves. The first (prepare_*) runs in a worker thread: it
parses and validates the body, renders the chat template and tokenizes, so a large request
never stalls the event loop. The second (respond) runs on the event loop: it queues the
engine requests and turns their outputs into responses.

A completion request with several prompts becomes one engine request per prompt, admitted
all or none; choice index = prompt index * n + sample index, as in the OpenAI API. The
response objects and stream chunks come from response_view.ResponseView. A request the
engine fails gets a 500 envelope, or an error event in its stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jaxserve.reasoning_parsers import END as REASONING_END
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    OverloadedError,
    RequestFailedError,
)
from jaxserve.server.errors import APIError, from_value_error, short
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestLimits,
    TokenizeRequest,
)
from jaxserve.server.request_body import parse_body
from jaxserve.server.response_view import ResponseView
from jaxserve.tokenizer import apply_chat_template, with_special_tokens

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
REQUEST_ID_KEY = "jaxserve_request_id"  # in the ASGI scope's state, set by the app's guard


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    """Server-wide chat-template settings (vLLM's flags)."""

    template: str | None = None  # --chat-template: instead of the tokenizer's own
    default_kwargs: dict = dataclasses.field(default_factory=dict)  # --default-chat-template-kwargs
    trust_request_template: bool = False  # --trust-request-chat-template
    # --enable-auto-tool-choice --tool-call-parser NAME: tool_choice "auto" reads calls out
    # of the model's text with this parser (jaxserve/tool_parsers.py).
    tool_call_parser: str | None = None
    # --reasoning-parser NAME: the thinking goes to reasoning_content (and reasoning), and
    # a structured output applies after it (jaxserve/reasoning_parsers.py).
    reasoning_parser: str | None = None


@dataclasses.dataclass
class Prepared:
    """A parsed, validated, tokenized request, ready to queue."""

    kind: str  # "text_completion" | "chat.completion"
    body: CompletionRequest | ChatCompletionRequest
    params: SamplingParams
    prompts: list[tuple[str | None, list[int]]]  # (text if given as text, token ids)
    prompt_param: str  # the field a prompt problem is reported on
    model: str  # the name the response carries


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_names: str | tuple[str, ...],
                 limits: RequestLimits, chat: ChatSettings | None = None) -> None:
        self.engine = engine
        self.served_names = (served_names,) if isinstance(served_names, str) else \
            tuple(served_names)
        self.model_name = self.served_names[0]
        self.limits = limits
        self.chat = chat or ChatSettings()
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.config.model.max_model_len
        self.vocab_size = engine.engine.config.model.vocab_size
        self.sampling_defaults = engine.engine.config.model.sampling_defaults

    def check_model(self, name: str | None) -> str:
        """The served name a request's `model` picks (any alias; none or "": the first)."""
        if not name:
            return self.model_name
        if name not in self.served_names:
            raise APIError(404, f"The model {name[:64]!r} does not exist; this server serves "
                           f"{', '.join(map(repr, self.served_names))}.", param="model",
                           code="model_not_found")
        return name

    # ---- worker thread: parse, validate, tokenize -------------------------------------
    def prepare_completion(self, raw: bytes) -> Prepared:
        body = parse_body(raw, CompletionRequest)
        model = self.check_model(body.model)
        params = _params(body, self.limits, "prompt", self.sampling_defaults)
        self._compile_grammar(body, params)
        prompts = self._completion_prompts(body.prompt, body.add_special_tokens)
        prompts = [(text, self._truncated(ids, params)) for text, ids in prompts]
        self._check_context(prompts, params, "prompt")
        return Prepared("text_completion", body, params, prompts, "prompt", model)

    def prepare_chat(self, raw: bytes) -> Prepared:
        body = parse_body(raw, ChatCompletionRequest)
        model = self.check_model(body.model)
        params = _params(body, self.limits, "messages", self.sampling_defaults)
        if body.tool_mode == "auto" and self.chat.tool_call_parser is None:
            raise APIError(400, 'tool_choice "auto" needs the server started with '
                           "--enable-auto-tool-choice and --tool-call-parser; or use "
                           '"required" or a named function.', param="tool_choice",
                           code="invalid_value")
        if body.tool_mode == "auto" and self.chat.tool_call_parser == "mistral":
            params = params.clone(skip_special_tokens=False)  # [TOOL_CALLS] is special
        if body.include_reasoning is False and self.chat.reasoning_parser is None:
            raise APIError(400, "include_reasoning=false needs the server started with "
                           "--reasoning-parser.", param="include_reasoning",
                           code="invalid_value")
        if self.chat.reasoning_parser is not None and params.structured_outputs is not None \
                and self.end_of_thinking_is_one_token():
            params = params.clone(structured_outputs=dataclasses.replace(
                params.structured_outputs, starts_after=REASONING_END))
        self._compile_grammar(body, params)
        if body.chat_template is not None and not self.chat.trust_request_template:
            raise APIError(400, "chat_template: a chat template sent with the request is "
                           "refused unless the server runs with --trust-request-chat-template.",
                           param="chat_template", code="invalid_value")
        try:
            kwargs = body.template_kwargs(self.chat.default_kwargs)
            messages = body.template_messages()
        except ValueError as err:
            raise from_value_error(err, "messages") from None
        ids = self._render_chat(messages, body.adds_generation_prompt,
                                body.chat_template or self.chat.template, kwargs)
        if body.add_special_tokens:
            ids = with_special_tokens(self.tokenizer, ids)
        ids = self._truncated(ids, params)
        self._check_context([(None, ids)], params, "messages")
        return Prepared("chat.completion", body, params, [(None, ids)], "messages", model)

    def end_of_thinking_is_one_token(self) -> bool:
        """Whether the grammar can wait for the end of the reasoning: its marker is one
        token (Qwen3, DeepSeek-R1); otherwise it applies from the start."""
        return len(self.tokenizer.encode(REASONING_END, add_special_tokens=False)) == 1

    def _compile_grammar(self, body, params: SamplingParams) -> None:
        """Compile (and check) a structured-output grammar here, in the worker thread: the
        engine thread later only copies it. A bad schema, regex or grammar is a 400 naming
        the field that asked for it."""
        if params.structured_outputs is None:
            return
        try:
            self.engine.engine.compile_grammar(params)
        except ValueError as err:
            field = body.structured_field or "tools"
            raise APIError(400, short(str(err)), param=field, code="invalid_value") from None

    def _truncated(self, ids: list[int], params: SamplingParams) -> list[int]:
        try:
            return self.engine.engine.truncate_prompt(ids, params)
        except ValueError as err:
            raise from_value_error(err) from None

    def _check_context(self, prompts, params, param: str) -> None:
        """OpenAI's (and vLLM's) context-length error, which clients and gateways recognise:
        for a prompt that leaves no room for output, and for a max_tokens that does not fit
        next to its prompt (400, code context_length_exceeded)."""
        limit = self.max_model_len
        for _, ids in prompts:
            if len(ids) >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                               f"However, your request has {len(ids)} input tokens. Please "
                               f"reduce the length of the input {param}.", param=param,
                               code="context_length_exceeded")
            if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                               f"However, you requested {len(ids) + params.max_tokens} tokens "
                               f"({len(ids)} in the {param}, {params.max_tokens} in the "
                               f"completion). Please reduce the length of the {param} or "
                               "completion.", param=param, code="context_length_exceeded")

    def tokenize(self, raw: bytes) -> dict:
        body = parse_body(raw, TokenizeRequest)
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of prompt or messages.", param="prompt")
        if body.messages is not None:
            ids = self._render_chat([m.as_template_message() for m in body.messages],
                                    body.add_generation_prompt, self.chat.template,
                                    dict(self.chat.default_kwargs))
        else:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def detokenize(self, raw: bytes) -> dict:
        body = parse_body(raw, DetokenizeRequest)
        self.check_model(body.model)
        if any(not 0 <= t < self.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {self.vocab_size}).", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool,
                     template: str | None, kwargs: dict) -> list[int]:
        try:
            return apply_chat_template(self.tokenizer, messages,
                                       add_generation_prompt=add_generation_prompt,
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
        if len(prompt) > self.limits.max_prompts:
            raise APIError(400, f"A request may carry at most {self.limits.max_prompts} "
                           f"prompts; this one has {len(prompt)}.", param="prompt",
                           code="invalid_value")
        out = []
        for item in prompt:
            if isinstance(item, str):
                if not item:
                    raise APIError(400, "prompt must not be empty.", param="prompt")
                out.append((item, self.tokenizer.encode(
                    item, add_special_tokens=add_special_tokens)))
            else:
                out.append((None, list(item)))
        return out

    # ---- event loop: queue and respond ----------------------------------------------------
    async def respond(self, prepared: Prepared, raw: Request):
        prefix = "chatcmpl" if prepared.kind == "chat.completion" else "cmpl"
        # As vLLM: the X-Request-Id header, else the body's request_id, else a fresh id.
        header = raw.headers.get("x-request-id")
        own_id = (header[:256] if header else None) or prepared.body.request_id
        http_id = own_id or raw.scope.get("state", {}).get(REQUEST_ID_KEY) or uuid.uuid4().hex
        request_id = f"{prefix}-{http_id}"
        body = prepared.body
        if body.user:  # OpenAI's end-user id: for the operator's abuse monitoring
            logger.info("request %s: user %r", request_id, body.user[:128])
        try:
            streams = self.engine.submit_many(
                [(f"{request_id}-{i}", text, ids) for i, (text, ids) in
                 enumerate(prepared.prompts)], prepared.params, priority=body.priority,
                cache_salt=body.cache_salt)
        except (OverloadedError, EngineDeadError, ValueError) as err:
            raise _api_error(err, prepared.prompt_param) from None
        view = ResponseView(prepared.kind, request_id, prepared.model, body, prepared.prompts, self)
        if prepared.body.stream:
            return _sse(self._stream(view, streams))
        return await self._respond(view, streams, raw)

    async def _respond(self, view, streams, raw: Request) -> JSONResponse:
        """Wait for every prompt's last output; the first failure ends the request (and
        aborts its other prompts), as does the client leaving."""
        async def last(stream):
            final = None
            async for output in stream:
                if output.error is not None:
                    raise RequestFailedError(output.error)
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
            raise _api_error(err) from None
        finally:
            for task in tasks:
                task.cancel()  # those still waiting: their requests are aborted
        return JSONResponse(view.full_response(finals))

    async def _stream(self, view, streams) -> AsyncIterator[str]:
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index, stream):
            try:
                async for output in stream:
                    await merged.put((index, output))
            except BaseException as err:  # noqa: BLE001 - forwarded to the response
                await merged.put((index, err))
            finally:
                await merged.put((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        open_streams = len(tasks)
        try:
            for chunk in view.opening_chunks():
                yield _event(chunk)
            while open_streams:
                index, item = await merged.get()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, BaseException):
                    raise item
                elif item.error is not None:
                    raise RequestFailedError(item.error)
                else:
                    for chunk in view.chunks(index, item):
                        yield _event(chunk)
            usage = view.usage_chunk()
            if usage is not None:
                yield _event(usage)
        except Exception as err:  # noqa: BLE001 - the stream has started: report in-band
            if _api_error(err).status == 500 and not isinstance(err, RequestFailedError):
                logger.error("Stream %s failed: %s", view.id, err, exc_info=err)
            yield _event(_api_error(err).body())
        finally:
            for task in tasks:
                task.cancel()
        yield "data: [DONE]\n\n"


def _retrieve(future: asyncio.Future) -> None:
    """Read a finished task's exception, so that asyncio does not log one that lost the race
    to report first as "never retrieved"."""
    if not future.cancelled():
        future.exception()


def _params(body, limits: RequestLimits, prompt_param: str, defaults: dict):
    try:
        return body.sampling_params(limits, defaults)
    except ValueError as err:
        raise from_value_error(err, prompt_param) from None


def _api_error(err: BaseException, prompt_param: str = "prompt") -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, OverloadedError):
        return APIError(429, str(err), code="overloaded")
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), code="engine_dead")
    if isinstance(err, RequestFailedError):
        return APIError(500, f"{str(err)[:1].upper()}{str(err)[1:]}; other requests are not "
                        "affected.", code="internal_error")
    if isinstance(err, ValueError):
        return from_value_error(err, prompt_param)
    return APIError(500, "internal error while generating", code="internal_error")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
