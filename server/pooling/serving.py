"""The pooling routes: /v1/embeddings, /pooling, /classify, /score (/v1/score) and /rerank
(/v1/rerank, /v2/rerank), as vLLM serves them, on a pooling engine (runner="pooling").

Each request takes the completion routes' path (server/openai/serving.py): on a prepare thread the
body is parsed and checked (server/pooling/protocol.py), its pooling settings are resolved against
the served model (PoolingParams.resolve: a generating model, or a model of the other pooling
task, is a 400 that says so), the inputs are counted against max_embedding_inputs before
anything is tokenized, then tokenized (the chat form through the chat template) and admitted
one by one (InputProcessor.process_pooling). On the event loop the engine requests are
queued all or none (AsyncLLMEngine.encode_many); a client that leaves aborts them. Scores
and reranking pair their inputs and turn pooled outputs into scores in
jaxserve/engine/scoring.py (bi-encoder cosine or cross-encoder head, as LLM.score); the
response objects come from server/pooling/output.py, encoded on the encoding threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.core.pooling_params import PoolingParams
from jaxserve.engine.admission import EngineRequest
from jaxserve.engine.scoring import ScoreJob, plan_scores
from jaxserve.server.async_engine import (
    EngineDeadError,
    OverloadedError,
    RequestFailedError,
)
from jaxserve.server.errors import APIError, from_value_error
from jaxserve.server.openai.serving import OpenAIServing, api_error
from jaxserve.server.pooling import output as view
from jaxserve.server.pooling.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from jaxserve.server.request_body import parse_body
from jaxserve.server.request_log import log_received

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
# The PoolingParams fields a refusal may name (any other refusal is about the served model).
_SETTINGS = ("dimensions", "normalize", "use_activation", "truncate_prompt_tokens")


@dataclasses.dataclass
class PreparedPooling:
    """A parsed, checked, tokenized pooling request, ready to queue."""

    request_id: str
    body: object
    params: PoolingParams
    requests: list[EngineRequest]  # one per input (or per pooled prompt of a score)
    build: Callable[[list], dict]  # the outputs (in request order) -> the response object

    @property
    def prompts(self) -> list[tuple[str | None, list[int]]]:
        return [(r.prompt, r.prompt_token_ids) for r in self.requests]


class PoolingServing:
    def __init__(self, serving: OpenAIServing) -> None:
        """serving: the completion routes' (served names, chat settings, engine, threads)."""
        self.serving = serving
        self.engine = serving.engine
        self.processor = serving.processor
        self.pooler = self.processor.pooler

    @property
    def tasks(self) -> list[str]:
        return view.supported_tasks(self.pooler)

    # ---- worker thread: parse, check, tokenize, admit -----------------------------------
    def prepare_embeddings(self, raw: bytes, ids: tuple[str | None, str]) -> PreparedPooling:
        body = parse_body(raw, EmbeddingRequest)
        model, request_id = self._start(body, "embd", ids)
        params = self._params(task="embed", dimensions=body.dimensions,
                              normalize=self._checked(lambda: body.normalized),
                              truncate_prompt_tokens=body.truncate_prompt_tokens)
        return self._admit(body, request_id, params, lambda outputs: view.vectors_response(
            request_id, model, outputs, body))

    def prepare_pooling(self, raw: bytes, ids: tuple[str | None, str]) -> PreparedPooling:
        body = parse_body(raw, PoolingRequest)
        model, request_id = self._start(body, "pool", ids)
        task = None if body.task in (None, "encode") else body.task
        if self.pooler is not None and self.pooler.task == "classify":
            settings = dict(use_activation=body.use_activation, normalize=body.normalize)
        else:  # (use_activation is vLLM's newer name of normalize for embeddings)
            settings = dict(normalize=self._checked(lambda: body.normalized))
        params = self._params("task" if body.task else "model", task=task,
                              dimensions=body.dimensions,
                              truncate_prompt_tokens=body.truncate_prompt_tokens, **settings)
        return self._admit(body, request_id, params, lambda outputs: view.vectors_response(
            request_id, model, outputs, body, "pooling"))

    def prepare_classify(self, raw: bytes, ids: tuple[str | None, str]) -> PreparedPooling:
        body = parse_body(raw, ClassificationRequest)
        model, request_id = self._start(body, "classify", ids)
        params = self._params(task="classify", use_activation=body.use_activation,
                              truncate_prompt_tokens=body.truncate_prompt_tokens)
        labels = self.pooler.labels
        return self._admit(body, request_id, params, lambda outputs:
                           view.classification_response(request_id, model, outputs, labels))

    def prepare_score(self, raw: bytes, ids: tuple[str | None, str]) -> PreparedPooling:
        body = parse_body(raw, ScoreRequest)
        model, request_id = self._start(body, "score", ids)
        params = self._score_params(body)
        (first, data_1), (second, data_2) = self._checked(body.sides)
        job = self._plan(data_1, data_2, params, (first, second))
        return self._admit_job(body, request_id, params, job, second, lambda outputs:
                               view.score_response(request_id, model, job.scores(outputs)))

    def prepare_rerank(self, raw: bytes, ids: tuple[str | None, str]) -> PreparedPooling:
        body = parse_body(raw, RerankRequest)
        model, request_id = self._start(body, "rerank", ids)
        params = self._score_params(body)
        documents = body.document_list
        job = self._plan([body.query], documents, params, ("query", "documents"))
        return self._admit_job(body, request_id, params, job, "documents", lambda outputs:
                               view.rerank_response(request_id, model, job.scores(outputs),
                                                    documents, body.top_n,
                                                    body.return_documents))

    # ---- the steps they share ---------------------------------------------------------------
    def _start(self, body, prefix: str, ids: tuple[str | None, str]) -> tuple[str, str]:
        """(the served name the request picks, its request id), once its fields are checked."""
        model = self.serving.check_model(body.model)
        self._checked(body.check)
        self._checked(lambda: self.processor.check_identifier(getattr(body, "user", None),
                                                              "user"))
        header, fresh = ids
        own = header or body.request_id
        if own:
            self._checked(lambda: self.processor.check_request_id(
                own, "X-Request-Id" if header else "request_id"))
        return model, f"{prefix}-{own or fresh}"

    @staticmethod
    def _checked(fn, prompt_param: str = "input"):
        """fn(), its ValueError as a 400 naming the field."""
        try:
            return fn()
        except ValueError as err:
            raise from_value_error(err, prompt_param) from None

    def _params(self, field: str = "model", **settings) -> PoolingParams:
        """The request's PoolingParams, checked against the served model (process_pooling
        resolves them again: resolving is not idempotent): a bad value or a setting the
        model cannot honour is a 400 naming the setting; a model that cannot serve the route
        (it generates, or pools for the other task), a 400 on `field`."""
        try:
            params = PoolingParams(**settings)
            params.resolve(self.pooler)
            return params
        except ValueError as err:
            error = from_value_error(err)
            if error.param not in _SETTINGS:  # (the model, not a setting, is what is wrong)
                error.param = field
            raise error from None

    def _score_params(self, body) -> PoolingParams:
        return self._params(task="score", use_activation=body.use_activation,
                            truncate_prompt_tokens=body.truncate_prompt_tokens)

    def _plan(self, data_1: list, data_2: list, params: PoolingParams,
              fields: tuple[str, str]) -> ScoreJob:
        """The score's pooling prompts (pairs checked and counted before tokenization)."""
        items_1 = [(text, None) for text in data_1]
        items_2 = [(text, None) for text in data_2]
        return self._checked(lambda: plan_scores(self.processor, items_1, items_2, params,
                                                 fields), fields[1])

    def _inputs(self, body) -> list[tuple[str | None, list[int]]]:
        """The body's inputs as (text or None, token ids): the chat form rendered, the
        completion form counted (max_embedding_inputs), then tokenized."""
        if body.messages is not None:
            return [(None, self._render_chat(body))]
        items = body.input
        if isinstance(items, str) or (items and isinstance(items[0], int)):
            items = [items]
        if not items:
            raise APIError(400, "input must not be empty.", param="input",
                           code="invalid_value")
        self._checked(lambda: self.processor.check_pooling_count(len(items), "input"))
        add = body.adds_special_tokens
        return [(item, self.processor.encode(item, add)) if isinstance(item, str)
                else (None, list(item)) for item in items]

    def _render_chat(self, body) -> list[int]:
        chat = self.serving.chat
        if body.chat_template is not None and not chat.trust_request_template:
            raise APIError(400, "chat_template: a chat template sent with the request is "
                           "refused unless the server runs with --trust-request-chat-template.",
                           param="chat_template", code="invalid_value")
        return self._checked(lambda: self.processor.render_chat(
            [m.as_template_message() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            add_special_tokens=body.adds_special_tokens,
            chat_template=body.chat_template or chat.template,
            **body.template_kwargs(chat.default_kwargs)), "messages")

    def _admit(self, body, request_id: str, params: PoolingParams, build) -> PreparedPooling:
        prompts = self._inputs(body)
        param = "messages" if body.messages is not None else "input"
        return self._requests(body, request_id, params, prompts, build, param)

    def _admit_job(self, body, request_id: str, params: PoolingParams, job: ScoreJob,
                   param: str, build) -> PreparedPooling:
        """A score's prompts (param: the field a prompt's refusal names)."""
        return self._requests(body, request_id, params, job.prompts, build, param)

    def _requests(self, body, request_id: str, params: PoolingParams, prompts, build,
                  param: str) -> PreparedPooling:
        """Each prompt through process_pooling: truncation, the model's checks."""
        requests = self._checked(lambda: [
            self.processor.process_pooling(f"{request_id}-{i}", text, ids, params,
                                           body.priority, body.cache_salt)
            for i, (text, ids) in enumerate(prompts)], param)
        return PreparedPooling(request_id, body, params, requests, build)

    # ---- event loop: queue and respond ----------------------------------------------------
    async def respond(self, prepared: PreparedPooling, raw: Request) -> Response:
        """Queue the request's inputs (all or none), wait for every output (the first
        failure, or the client leaving, aborts the others) and answer with the response
        object, encoded on the encoding threads."""
        options = self.serving.options
        if options.log_requests:
            log_received(prepared.request_id, prepared.prompts, prepared.params,
                         options.max_log_len)
        user = getattr(prepared.body, "user", None)
        if user:  # OpenAI's end-user id: for the operator's abuse monitoring
            logger.info("request %s: user %r", prepared.request_id[:300], user[:128])
        task = asyncio.ensure_future(self.engine.encode_many(prepared.requests))
        task.add_done_callback(_retrieve)
        try:
            while not task.done():
                await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
                if not task.done() and await raw.is_disconnected():
                    return JSONResponse({}, status_code=499)
            outputs = task.result()
        except (OverloadedError, EngineDeadError, RequestFailedError, ValueError) as err:
            raise api_error(err, "input") from None
        finally:
            task.cancel()  # (a no-op once done) the requests still running are aborted
        content = await asyncio.get_running_loop().run_in_executor(
            self.serving.encoders, _encoded, prepared.build, outputs)
        return Response(content, media_type="application/json")


def _encoded(build, outputs) -> bytes:
    return view.json_bytes(build(outputs))


def _retrieve(future: asyncio.Future) -> None:
    """Read a finished task's exception, so that asyncio logs nothing about it."""
    if not future.cancelled():
        future.exception()
