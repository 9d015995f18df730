"""POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A Responses request runs as a chat request (server/responses/protocol.py translates it): prepare, on
a prepare thread, parses and checks the body, checks the request limits (input items, tools),
builds the conversation (the instructions, a previous response's turns from the store, the
input items: server/responses/items.py) and sends the chat request through the chat path's
admission (OpenAIServing.prepare_chat_body); with_grammar compiles its grammar on the
grammar threads. respond queues it and answers with a Response object, or with SSE events
(`event: TYPE` and `data: JSON` lines, sequence numbers from 0, no [DONE] line, as OpenAI's
stream); server/responses/output.py's ResponseBuilder renders both. A response with store=true (the
default) is kept in the store (server/responses/store.py) once it has finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.config.request_limits import limit_error
from jaxserve.parsers.reasoning import reasoning_parser
from jaxserve.parsers.tools import tool_parser
from jaxserve.server.async_engine import EngineDeadError, OverloadedError, RequestFailedError
from jaxserve.server.errors import APIError, from_value_error, short
from jaxserve.server.openai.protocol import ChatCompletionRequest
from jaxserve.server.openai.serving import OpenAIServing, Prepared, api_error
from jaxserve.server.openai.tool_calls import ChoiceTools, check_tool_count
from jaxserve.server.request_body import parse_body
from jaxserve.server.request_log import log_received
from jaxserve.server.responses.items import to_messages
from jaxserve.server.responses.output import ResponseBuilder
from jaxserve.server.responses.protocol import ResponsesRequest, renamed
from jaxserve.server.responses.store import ResponseStore, StoredResponse
from jaxserve.server.responses.truncation import (
    MessageCounter,
    fit,
    longest_token_chars,
    message_texts,
)
from jaxserve.server.schema_base import ParamError

logger = logging.getLogger(__name__)

# The stream's last event, by the response's status.
_FIT_TRIES = 4  # renders truncation "auto" tries before the context-length error
_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
             "cancelled": "response.failed"}


@dataclasses.dataclass
class ResponsesPrepared:
    chat: Prepared  # the chat request it runs as, admitted
    body: ResponsesRequest
    response_id: str
    # The conversation without the instructions (a previous response's, then the input),
    # as chat messages, as truncation "auto" kept it: what a later previous_response_id
    # continues.
    messages: list[dict]


class OpenAIResponses:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving, self.store = serving, store
        self._token_chars: int | None = None  # the vocabulary's longest entry

    # ---- prepare thread -------------------------------------------------------------------
    def prepare(self, raw: bytes, ids: tuple[str | None, str]) -> ResponsesPrepared:
        """ids: (the X-Request-Id header or None, this HTTP request's own id)."""
        body = parse_body(raw, ResponsesRequest)
        serving = self.serving
        try:
            body.check()
            self._check_limits(body)
            messages = [*self._previous(body), *to_messages(body.input)]
            system = [{"role": "system", "content": body.instructions}] \
                if body.instructions else []
            if not system + messages:
                raise ParamError("input", "input must not be empty.")
            limit = body.prompt_limit(serving.max_model_len)
            if body.truncation == "auto":
                chat, prompt, messages = self._fit(body, system, messages, limit)
            else:
                self._check_size(system + messages, limit)
                chat, prompt = body.chat_request(system + messages), None
            prepared = serving.prepare_chat_body(chat, ids, prefix="resp", prompt=prompt)
        except ParamError as err:
            raise APIError(400, short(str(err)), param=err.param, code="invalid_value") \
                from None
        except APIError as err:
            raise renamed(err, body.grammar_field) from None
        return ResponsesPrepared(prepared, body, f"resp_{ids[1]}", messages)

    def _check_limits(self, body: ResponsesRequest) -> None:
        """The request limits max_input_items and max_tools, and the identifiers' lengths
        (max_user_length, max_safety_identifier_length), before any item is read."""
        limits = self.serving.processor.limits
        for name in ("user", "prompt_cache_key", "safety_identifier"):
            try:
                self.serving.processor.check_identifier(getattr(body, name), name)
            except ValueError as err:
                raise from_value_error(err) from None
        count = 1 if isinstance(body.input, str) else len(body.input)
        if count > limits.max_input_items:
            raise from_value_error(limit_error("input", "the number of input items",
                                               "max_input_items", limits.max_input_items,
                                               count))
        try:
            check_tool_count(len(body.tools), limits)
        except ValueError as err:
            raise from_value_error(err) from None

    def _counter(self) -> MessageCounter:
        if self._token_chars is None:  # (once: it reads the whole vocabulary)
            self._token_chars = longest_token_chars(self.serving.tokenizer)
        return MessageCounter(self.serving.tokenizer, self._token_chars)

    def _fit(self, body: ResponsesRequest, system: list[dict], messages: list[dict],
             limit: int) -> tuple[ChatCompletionRequest, list[int], list[dict]]:
        """truncation "auto": (the chat request, its prompt, the messages it keeps) with the
        oldest messages dropped until the prompt fits `limit` tokens, the instructions
        kept (server/responses/truncation.py). Each try renders the kept part through the chat
        template and, when the template's own tokens make it too long, fits again with a
        budget smaller by the excess; past _FIT_TRIES the admission path's context-length
        error answers."""
        counter = self._counter()
        own = counter.count(-1, system[0], limit, "instructions") if system else 0
        budget = limit - (limit if own is None else own)
        for attempt in range(_FIT_TRIES):
            fitted = fit(messages, budget, counter)
            if not fitted.messages:
                raise APIError(400, f"This model's maximum context length is "
                               f"{self.serving.max_model_len} tokens: the instructions and "
                               f"max_output_tokens leave no room for the input, even with "
                               "truncation 'auto' (which drops input items, oldest first, "
                               "but keeps the instructions). Shorten the instructions or "
                               "lower max_output_tokens.", param="input",
                               code="context_length_exceeded")
            chat = body.chat_request(system + fitted.messages)
            prompt = self.serving.render_chat_body(chat)
            over = len(prompt) - limit
            if over <= 0:
                break
            budget -= over + 16 * attempt
        if fitted.dropped or fitted.cut:
            logger.debug("truncation 'auto' dropped %d of %d messages%s", fitted.dropped,
                         len(messages), " and cut the start of the oldest kept" if fitted.cut
                         else "")
        return chat, prompt, fitted.messages

    def _check_size(self, messages: list[dict], limit: int) -> None:
        """truncation "disabled": a conversation whose text is longer than `limit` tokens
        could hold is refused before it is rendered or tokenized."""
        counter = self._counter()
        size = sum(len(text) for message in messages for text in message_texts(message))
        if size > counter.bound(limit):
            raise APIError(400, f"This model's maximum context length is "
                           f"{self.serving.max_model_len} tokens. However, your input holds "
                           f"{size} characters, more than {limit} tokens can hold. Please "
                           "reduce the length of the input, or set truncation 'auto' to drop "
                           "the oldest items.", param="input",
                           code="context_length_exceeded")

    def _previous(self, body: ResponsesRequest) -> list[dict]:
        """The conversation a previous response ended (404 when it is not stored)."""
        if body.previous_response_id is None:
            return []
        entry = self.store.get(body.previous_response_id)
        if entry is None:
            raise self._not_found(body.previous_response_id, "previous_response_id")
        return [dict(message) for message in entry.messages]

    def _not_found(self, response_id: str, param: str) -> APIError:
        return APIError(404, f"Response with id {response_id[:80]!r} not found. Responses are "
                        f"kept in memory, the latest {self.store.max_entries} "
                        "(--max-stored-responses), and only with store=true.",
                        param=param, code="response_not_found")

    # ---- grammar threads ------------------------------------------------------------------
    async def with_grammar(self, prepared: ResponsesPrepared) -> ResponsesPrepared:
        try:
            prepared.chat = await self.serving.with_grammar(prepared.chat)
        except APIError as err:
            raise renamed(err, prepared.body.grammar_field) from None
        return prepared

    # ---- event loop -------------------------------------------------------------------------
    async def respond(self, prepared: ResponsesPrepared, raw: Request):
        serving, chat, body = self.serving, prepared.chat, prepared.body
        if serving.options.log_requests:
            log_received(chat.request_id, chat.prompts, chat.params,
                         serving.options.max_log_len)
        for name in ("user", "safety_identifier"):  # end-user ids: for abuse monitoring
            if getattr(body, name):
                logger.info("request %s: %s %r", chat.request_id[:300], name,
                            getattr(body, name)[:128])
        try:
            streams = serving.engine.submit_many(chat.requests)
        except (OverloadedError, EngineDeadError, ValueError) as err:
            raise renamed(api_error(err, "messages"), body.grammar_field) from None
        builder = self._builder(prepared)
        if body.stream:
            return StreamingResponse(self._stream(builder, streams[0], prepared),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await serving.respond_whole(builder, streams, raw)
        except APIError as err:
            raise renamed(err, body.grammar_field) from None

    def _builder(self, prepared: ResponsesPrepared) -> ResponseBuilder:
        serving, chat = self.serving, prepared.chat.body
        params = prepared.chat.params
        mode, tools = chat.tool_mode, None
        if mode is not None:
            parser = tool_parser(serving.chat.tool_call_parser) if mode == "auto" else None
            tools = ChoiceTools(mode, parser, chat.named_tool,
                                chat.parallel_tool_calls is not False)
        reasoning = (reasoning_parser(serving.chat.reasoning_parser)
                     if serving.chat.reasoning_parser is not None else None)
        head = {"id": prepared.response_id, "object": "response",
                "created_at": int(time.time()), "status": None, "background": False,
                "error": None, "incomplete_details": None, "model": prepared.chat.model,
                "output": [], "temperature": params.temperature, "top_p": params.top_p,
                **prepared.body.echoed(), "usage": None, "completed_at": None}
        return ResponseBuilder(
            head, tools=tools, reasoning=reasoning, top_logprobs=params.logprobs,
            tokenizer=serving.tokenizer, as_ids=serving.options.return_tokens_as_token_ids,
            on_final=lambda response: self._keep(prepared, response))

    def _keep(self, prepared: ResponsesPrepared, response: dict) -> None:
        """Store a finished response (store=true): its output continues the conversation."""
        if not prepared.body.store or response["status"] not in ("completed", "incomplete"):
            return
        output = to_messages(response["output"], "output")
        self.store.put(response["id"], StoredResponse(response, (*prepared.messages,
                                                                 *output)))

    async def _stream(self, builder: ResponseBuilder, stream,
                      prepared: ResponsesPrepared) -> AsyncIterator[str]:
        """The response's SSE events as its outputs come; an error event when the engine
        fails it. A client that leaves aborts the request (the stream is closed)."""
        loop = asyncio.get_running_loop()
        encoders, events = self.serving.encoders, _Events()
        outputs = stream.__aiter__()
        heavy = builder.top is not None  # logprobs: encoded off the event loop
        try:
            opening = builder.created()
            yield events.sse({"type": "response.created", "response": opening})
            yield events.sse({"type": "response.in_progress", "response": opening})
            async for output in outputs:
                if output.error is not None:
                    raise RequestFailedError(output.error, output.error_param)
                text = (await loop.run_in_executor(encoders, events.feed, builder, output)
                        if heavy else events.feed(builder, output))
                if text:
                    yield text
            yield await loop.run_in_executor(encoders, events.final, builder)
        except Exception as err:  # noqa: BLE001 - the stream has started: report in-band
            error = renamed(api_error(err, "messages"), prepared.body.grammar_field)
            if error.status == 500 and not isinstance(err, RequestFailedError):
                logger.error("Stream %s failed: %s", prepared.response_id, err, exc_info=err)
            yield events.sse({"type": "error", "code": error.code, "message": error.message,
                              "param": error.param})
        finally:
            await outputs.aclose()  # a request still running is aborted, its blocks freed

    # ---- the stored responses ---------------------------------------------------------------
    async def retrieve(self, response_id: str, query) -> Response:
        """GET /v1/responses/{id}: the stored Response object as it was answered."""
        for name in ("stream", "starting_after"):
            if query.get(name, "false").lower() not in ("false", "0", ""):
                raise APIError(400, f"{name}: replaying a response's events is for background "
                               "responses, which this server does not run.", param=name,
                               code="invalid_value")
        if any(key.startswith("include") and key != "include_obfuscation" for key in query):
            raise APIError(400, "include: a stored response is returned as it was answered; "
                           "ask for logprobs when creating it.", param="include",
                           code="invalid_value")
        entry = self.store.get(response_id)
        if entry is None:
            raise self._not_found(response_id, "response_id")
        content = await asyncio.get_running_loop().run_in_executor(
            self.serving.encoders, _compact, entry.response)
        return Response(content, media_type="application/json")

    def delete(self, response_id: str) -> JSONResponse:
        if not self.store.delete(response_id):
            raise self._not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def cancel(self, response_id: str) -> JSONResponse:
        if self.store.get(response_id) is None:
            raise self._not_found(response_id, "response_id")
        raise APIError(400, "Cannot cancel a synchronous response: only background responses "
                       "can be cancelled, and this server runs none (background is refused).",
                       param="response_id", code="invalid_value")


class _Events:
    """SSE events of one stream, numbered from 0 (sequence_number)."""

    def __init__(self) -> None:
        self.number = 0

    def sse(self, event: dict) -> str:
        event["sequence_number"] = self.number
        self.number += 1
        return f"event: {event['type']}\ndata: {_compact(event).decode('utf-8')}\n\n"

    def feed(self, builder: ResponseBuilder, output) -> str:
        return "".join(self.sse(event) for event in builder.feed(output))

    def final(self, builder: ResponseBuilder) -> str:
        response = builder.final()
        return self.sse({"type": _TERMINAL[response["status"]], "response": response})


def _compact(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
