"""/v1/completions, /v1/chat/completions, /tokenize, /detokenize: requests in, JSON or SSE out.

Each request is prepared in two halves. The first (prepare_*) runs in a worker thread: it
parses and validates the body, renders the chat template and tokenizes, so a large request
never stalls the event loop. The second (respond) runs on the event loop: it queues the
engine requests and turns their outputs into responses.

A completion request with several prompts becomes one engine request per prompt, admitted
all or none; choice index = prompt index * n + sample index, as in the OpenAI API. Streams
send only text the detokenizer has released (never part of a stop string), exactly one chunk
per choice with a finish_reason, and, with stream_options.include_usage, a last chunk with
the usage. A request the engine fails gets a 500 envelope, or an error event in its stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.reasoning_parsers import END as REASONING_END
from jaxserve.reasoning_parsers import reasoning_parser
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
from jaxserve.server.tool_calls import ChoiceTools
from jaxserve.tokenizer import apply_chat_template, with_special_tokens
from jaxserve.tool_parsers import tool_parser

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
                and self._end_of_thinking_is_one_token():
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

    def _end_of_thinking_is_one_token(self) -> bool:
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
        view = _View(prepared.kind, request_id, prepared.model, body, prepared.prompts, self)
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


class _View:
    """Turns engine outputs into OpenAI response objects (with vLLM's additions) for one HTTP
    request."""

    def __init__(self, kind: str, request_id: str, model: str, body, prompts, serving) -> None:
        self.chat = kind == "chat.completion"
        self.kind, self.id, self.model, self.body = kind, request_id, model, body
        self.created = int(time.time())
        self.n = body.n
        self.prompts = prompts
        self.serving = serving
        self.echo = bool(body.echo) and not self.chat
        self.chat_echo = body.echo_text if self.chat else ""
        self.prompt_only = bool(getattr(body, "scores_prompt_only", False))
        self.token_ids = bool(body.return_token_ids)
        self.as_ids = bool(body.return_tokens_as_token_ids)
        self.interval = body.stream_interval or 1
        total = len(prompts) * self.n
        self.reasoning = None
        if self.chat and serving.chat.reasoning_parser is not None:
            self.reasoning = reasoning_parser(serving.chat.reasoning_parser)
        self.include_reasoning = bool(getattr(body, "include_reasoning", True))
        self.sent_reasoning = [0] * total
        self.sent_answer = [0] * total
        mode = body.tool_mode if self.chat else None
        self.tools = None
        if mode is not None:
            parser = (tool_parser(serving.chat.tool_call_parser)
                      if mode == "auto" else None)
            self.tools = [ChoiceTools(mode, parser, body.named_tool,
                                      body.parallel_tool_calls is not False)
                          for _ in range(total)]
        self.sent_text = [0] * total
        self.sent_tokens = [0] * total
        self.finished = [False] * total
        self.completion_tokens = [0] * total
        self.text_offsets = [0] * total
        self.cached_tokens = [0] * len(prompts)

    # ---- non-streamed -------------------------------------------------------------------
    def full_response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for p, output in enumerate(finals):
            self.cached_tokens[p] = output.num_cached_tokens
            for c in output.outputs:
                index = p * self.n + c.index
                generated = [] if self.prompt_only else c.token_ids
                self.completion_tokens[index] = len(generated)
                if self.chat:
                    text, reasoning = c.text, None
                    if self.reasoning is not None:
                        reasoning, text = self.reasoning.split(c.text, final=True)
                    message = {"role": "assistant", "content": (
                        self.chat_echo + text if text is not None or self.chat_echo else None)}
                    finish = c.finish_reason
                    if self.tools is not None:
                        message, finish = self.tools[index].message(text or "",
                                                                    c.finish_reason)
                    if self.reasoning is not None and self.include_reasoning:
                        message["reasoning_content"] = message["reasoning"] = reasoning
                    choice = {"index": index, "message": message,
                              "logprobs": self._chat_logprobs(c, 0),
                              "finish_reason": finish, "stop_reason": c.stop_reason}
                else:
                    text = "" if self.prompt_only else c.text
                    if self.echo:
                        text = self._prompt_text(p) + text
                    choice = {"index": index, "text": text,
                              "logprobs": self._completion_logprobs(output, c, 0, True, index),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                              "prompt_logprobs": self._prompt_logprobs(output)}
                    if self.token_ids:
                        choice["prompt_token_ids"] = output.prompt_token_ids
                if self.token_ids:
                    choice["token_ids"] = list(generated)
                choices.append(choice)
        response = {"id": self.id, "object": self.kind, "created": self.created,
                    "model": self.model, "choices": choices, "usage": self._usage()}
        if self.chat:
            response["prompt_logprobs"] = self._prompt_logprobs(finals[0])
            if self.token_ids:
                response["prompt_token_ids"] = finals[0].prompt_token_ids
            if self.body.return_prompt_text:
                response["prompt_text"] = self._prompt_text(0)
        return response

    # ---- streamed -----------------------------------------------------------------------
    def opening_chunks(self) -> list[dict]:
        if not self.chat:
            return []
        chunks = [self._chunk(i, {"role": "assistant", "content": ""}, None, None)
                  for i in range(self.n)]
        if self.token_ids:
            chunks[0]["prompt_token_ids"] = self.prompts[0][1]
        if self.body.return_prompt_text:
            chunks[0]["prompt_text"] = self._prompt_text(0)
        if self.chat_echo:
            chunks += [self._chunk(i, {"content": self.chat_echo}, None, None)
                       for i in range(self.n)]
        if self.body.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = self._usage()
        return chunks

    def chunks(self, p: int, output: RequestOutput) -> list[dict]:
        out = []
        self.cached_tokens[p] = output.num_cached_tokens
        for c in output.outputs:
            index = p * self.n + c.index
            if self.finished[index]:
                continue
            done = c.finish_reason is not None
            start = self.sent_tokens[index]
            if not done and len(c.token_ids) - start < self.interval:
                continue  # stream_interval: wait for more tokens
            first = start == 0 and self.sent_text[index] == 0
            if self.tools is not None or self.reasoning is not None:
                out += self._parsed_chunks(index, c, start)
                continue
            delta = "" if self.prompt_only else c.text[self.sent_text[index]:]
            if self.echo and first:
                delta = self._prompt_text(p) + delta
            if not delta and not done and (c.logprobs is None or len(c.token_ids) == start):
                continue  # nothing to show yet (text held back, or no new tokens)
            logprobs = (self._chat_logprobs(c, start) if self.chat else
                        self._completion_logprobs(output, c, start, first, index))
            self.sent_text[index] = len(c.text)
            self.sent_tokens[index] = len(c.token_ids)
            self.completion_tokens[index] = 0 if self.prompt_only else len(c.token_ids)
            self.finished[index] = done
            payload = {"content": delta} if self.chat else delta
            chunk = self._chunk(index, payload, logprobs, c.finish_reason, c.stop_reason)
            choice = chunk["choices"][0]
            if self.token_ids:
                choice["token_ids"] = [] if self.prompt_only else c.token_ids[start:]
                if first and not self.chat:
                    choice["prompt_token_ids"] = output.prompt_token_ids
            if self.body.continuous_usage:
                chunk["usage"] = self._usage()
            out.append(chunk)
        return out

    def _parsed_chunks(self, index: int, c: CompletionOutput, start: int) -> list[dict]:
        """A chat choice read by a reasoning parser and/or in a tool mode: reasoning,
        content and tool-call deltas."""
        done = c.finish_reason is not None
        text, deltas, finish = c.text, [], c.finish_reason
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(c.text, final=done)
            reasoning, text = reasoning or "", text or ""
            if len(reasoning) > self.sent_reasoning[index]:
                piece = reasoning[self.sent_reasoning[index]:]
                self.sent_reasoning[index] = len(reasoning)
                if self.include_reasoning:
                    deltas.append({"reasoning_content": piece, "reasoning": piece})
        if self.tools is not None:
            more, finish = self.tools[index].deltas(text, c.finish_reason)
            deltas += more
        elif len(text) > self.sent_answer[index]:
            deltas.append({"content": text[self.sent_answer[index]:]})
            self.sent_answer[index] = len(text)
        logprobs = self._chat_logprobs(c, start)
        self.sent_text[index] = len(c.text)
        self.sent_tokens[index] = len(c.token_ids)
        self.completion_tokens[index] = len(c.token_ids)
        done = c.finish_reason is not None
        self.finished[index] = done
        if done and not deltas:
            deltas = [{}]
        chunks = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            chunk = self._chunk(index, delta, logprobs if i == 0 else None,
                                finish if last and done else None,
                                c.stop_reason if last and done else None)
            if self.body.continuous_usage:
                chunk["usage"] = self._usage()
            chunks.append(chunk)
        return chunks

    def usage_chunk(self) -> dict | None:
        if not self.body.include_usage:
            return None
        return {"id": self.id, "object": self._chunk_kind(), "created": self.created,
                "model": self.model, "choices": [], "usage": self._usage()}

    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index, payload, logprobs, finish_reason, stop_reason=None) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = payload
        else:
            choice["text"] = payload
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {"id": self.id, "object": self._chunk_kind(), "created": self.created,
                "model": self.model, "choices": [choice]}

    # ---- pieces -------------------------------------------------------------------------
    def _usage(self) -> dict:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    def _prompt_text(self, p: int) -> str:
        text, ids = self.prompts[p]
        if text is not None:
            return text
        return self.serving.tokenizer.decode(ids, skip_special_tokens=not self.chat)

    def _token_text(self, token: int, lp) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        return lp.decoded_token or ""

    def _prompt_logprobs(self, output: RequestOutput) -> list | None:
        """vLLM's prompt_logprobs: per prompt token, null for the first, else {token id:
        {logprob, rank, decoded_token}} (the prompt's token and the top ones)."""
        if output.prompt_logprobs is None:
            return None
        return [None if entry is None else
                {str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank,
                          "decoded_token": self._token_text(t, lp)}
                 for t, lp in entry.items()}
                for entry in output.prompt_logprobs]

    def _chat_logprobs(self, c: CompletionOutput, start: int) -> dict | None:
        if c.logprobs is None:
            return None
        k = self.body.top_logprobs or 0
        content = []
        for token, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            top = sorted(((t, lp) for t, lp in entry.items()
                          if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)
            content.append({**self._token_entry(token, entry[token]),
                            "top_logprobs": [self._token_entry(t, lp) for t, lp in top[:k]]})
        return {"content": content}

    def _token_entry(self, token: int, lp) -> dict:
        text = self._token_text(token, lp)
        return {"token": text, "logprob": max(lp.logprob, -9999.0),
                "bytes": list(text.encode("utf-8"))}

    def _completion_logprobs(self, output: RequestOutput, c: CompletionOutput, start: int,
                             with_prompt: bool, index: int) -> dict | None:
        if c.logprobs is None:
            return None
        rows = []  # (token text, logprob, {token text: logprob}) per position
        if self.echo and with_prompt and output.prompt_logprobs is not None:
            for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
                rows.append(self._completion_row(token, entry) if entry is not None else
                            (self._token_text(token, _Plain(token, self.serving)), None, None))
        if not self.prompt_only:
            rows += [self._completion_row(t, e)
                     for t, e in zip(c.token_ids[start:], c.logprobs[start:])]
        offsets, position = [], self.text_offsets[index]  # continues across stream chunks
        for token, _, _ in rows:
            offsets.append(position)
            position += len(token)
        self.text_offsets[index] = position
        return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [r[2] for r in rows], "text_offset": offsets}

    def _completion_row(self, token: int, entry: dict) -> tuple:
        return (self._token_text(token, entry[token]), entry[token].logprob,
                {self._token_text(t, lp): lp.logprob for t, lp in entry.items()})


class _Plain:
    """The decoded text of a prompt token that has no logprob entry (the first)."""

    def __init__(self, token: int, serving) -> None:
        self.decoded_token = serving.tokenizer.decode([token])
