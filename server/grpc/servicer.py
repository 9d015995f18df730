"""The VllmEngine gRPC service (vllm.grpc.engine, from smg-grpc-proto) on the shared engine.

The same AsyncLLMEngine as the HTTP API serves it, on the same event loop, so gRPC and HTTP
requests share every step, the admission cap, the Prometheus metrics and the request log.
Requests go through the engine's admission path (jaxserve/engine/admission.py: the request limits,
tokenization, the grammar) on the HTTP side's prepare and grammar threads, never on the event
loop. Status codes: a bad request is INVALID_ARGUMENT naming the field, the admission cap
RESOURCE_EXHAUSTED, a draining server, a dead engine or a full prepare queue UNAVAILABLE, a
request whose grammar ran past its per-step budget INVALID_ARGUMENT, a request the engine
failed INTERNAL; a call past its deadline is aborted (its blocks freed) and answered
DEADLINE_EXCEEDED, and a cancelled call aborts its request. Embed serves an embedding model
(requests.py's embed_request); on any other model it is FAILED_PRECONDITION. FlushCache is
a development-mode call, as vLLM's /reset_prefix_cache: without VLLM_SERVER_DEV_MODE=1 (read
once, when the servicer is made, by the same dev_routes.dev_mode as the HTTP routes) it is
UNIMPLEMENTED, as gRPC answers a call the service does not enable.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import io
import json
import logging
import math
import pathlib
import time
import uuid
import zipfile

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from jaxserve.config.version import VERSION
from jaxserve.parsers.reasoning import END as REASONING_END
from jaxserve.server.async_engine import EngineDeadError, OverloadedError, RequestFailedError
from jaxserve.server.dev_routes import DEV_MODE_ENV, dev_mode
from jaxserve.server.errors import APIError
from jaxserve.server.grpc.requests import (
    BadRequest,
    ChoiceStream,
    NotPooling,
    check_unsupported,
    embed_request,
    prompt_of,
    sampling_params,
)
from jaxserve.server.loads import scheduler_load

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_CHUNK_BYTES = 64 * 1024
LORA_METADATA = "lora-name"  # a Generate call's metadata naming a LoRA adapter
# The tokenizer bundle GetTokenizer zips (as vLLM's servicer): these names, and any file
# with these suffixes, from the tokenizer's folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json",
                   "generation_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json",
                   "preprocessor_config.json")
TOKENIZER_SUFFIXES = (".tiktoken", ".jinja", ".model")
DEFAULT_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_DEADLINE_MARGIN_S = 0.05  # answer DEADLINE_EXCEEDED just before the client gives up


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, state) -> None:
        """state: the HTTP app's ServerState (engine, config, draining flag, workers)."""
        self.state = state
        self.engine = state.engine  # the AsyncLLMEngine (its reads: server/engine_view.py)
        self.last_receive = 0.0  # wall time of the last Generate
        # Decided once, at start-up, as the HTTP side installs its development routes.
        self.dev_mode = dev_mode()

    # ---- Generate --------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context) -> None:
        """Responses are written one at a time; a client that takes none for
        --stream-write-timeout seconds has its request aborted (its blocks freed; the call
        itself ends once the client takes that message or goes away)."""
        self.last_receive = time.time()
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "The server is shutting down.")
        engine_request = await self._admit(request, context)
        try:
            stream = self.engine.submit(engine_request)
        except OverloadedError as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except EngineDeadError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        request_id, params = engine_request.request_id, engine_request.params
        timer, expired = self._deadline_timer(context, request_id)
        choices = ChoiceStream(engine_request.prompt_token_ids, params)
        heavy = params.logprobs is not None or params.prompt_logprobs is not None
        loop = asyncio.get_running_loop()
        outputs = stream.__aiter__()
        try:
            async for output in outputs:
                if output.error is not None and output.error_param is not None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, output.error)
                if output.error is not None:
                    await context.abort(grpc.StatusCode.INTERNAL,
                                        f"The engine failed this request: {output.error}")
                if expired.is_set():
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        "The call's deadline passed; the request was aborted.")
                responses = (await loop.run_in_executor(self.state.encoders, choices.responses,
                                                        output, request.stream)
                             if heavy else choices.responses(output, request.stream))
                for response in responses:
                    stalled = await self._write(context, response, request_id)
                    if stalled is not None:
                        await outputs.aclose()  # aborted now: its blocks are freed
                        # The call ends once the client takes the message or goes away (or
                        # its deadline passes); until then it holds this one message.
                        with contextlib.suppress(Exception):
                            await stalled
                        return
        except EngineDeadError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except grpc.aio.AbortError:
            raise  # the call was ended on purpose, above
        except Exception as err:  # noqa: BLE001 - logged once, answered INTERNAL
            logger.error("gRPC Generate %s failed while sending its outputs", request_id[:64],
                         exc_info=err)
            await context.abort(grpc.StatusCode.INTERNAL,
                                "internal error while sending the request's outputs")
        finally:
            if timer is not None:
                timer.cancel()
            await outputs.aclose()  # an unfinished request is aborted, its blocks freed

    async def _write(self, context, response, request_id: str):
        """Send one response; None once sent, or the write still under way when the client
        has not taken it within the write timeout (the caller aborts the request and waits
        for it: grpc cannot end a call while one of its messages is being sent)."""
        timeout = self.state.config.stream_write_timeout
        write = asyncio.ensure_future(context.write(response))
        # Its failure is read even when nobody awaits it any more (a cancelled call).
        write.add_done_callback(_retrieve)
        try:
            done, _ = await asyncio.wait([write], timeout=timeout)
        except asyncio.CancelledError:  # the client cancelled the call: its write goes too
            write.cancel()
            raise
        if done:
            write.result()
            return None
        logger.info("gRPC request %s: the client has not read its responses for %g s "
                    "(--stream-write-timeout); aborting it", request_id[:64], timeout)
        return write

    async def _admit(self, request: pb.GenerateRequest, context):
        """The request through the admission path: checked and tokenized on a prepare
        thread, its grammar compiled on a grammar thread. Every refusal ends the call with
        INVALID_ARGUMENT naming the field; the server's own failure with INTERNAL."""
        loop = asyncio.get_running_loop()
        try:
            async with self.state.preparing():
                lora_name = dict(context.invocation_metadata() or ()).get(LORA_METADATA)
                engine_request = await self.state.off_loop(self._prepare, request, lora_name)
                params = engine_request.params
                if params.structured_outputs is not None:
                    grammar = await loop.run_in_executor(
                        self.state.grammar_workers, self.engine.processor.compile_grammar,
                        params)
                    engine_request = engine_request.with_grammar(grammar)
            return engine_request
        except APIError as err:  # the prepare queue is full
            await context.abort(grpc.StatusCode.UNAVAILABLE, err.message)
        except (ValueError, RecursionError) as err:
            message = str(err) if isinstance(err, ValueError) else \
                "the request nests too deeply to be read"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message[:1000])
        except Exception as err:  # noqa: BLE001 - logged once, answered INTERNAL
            logger.error("gRPC Generate failed while preparing its request", exc_info=err)
            await context.abort(grpc.StatusCode.INTERNAL,
                                "internal error while preparing the request")

    def _prepare(self, request: pb.GenerateRequest, lora_name: str | None = None):
        """Prepare thread: the request as an admission.EngineRequest (grammar not compiled
        yet), checked as the engine will run it (ValueError naming the field otherwise).
        lora_name: the call's `lora-name` metadata, a LoRA adapter the server serves (vLLM's
        GenerateRequest has no field for one)."""
        check_unsupported(request)
        processor = self.engine.processor
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        processor.check_request_id(request_id)
        serving = self.state.serving
        starts_after = None
        if serving.chat.reasoning_parser is not None and serving.end_of_thinking_is_one_token():
            starts_after = REASONING_END
        try:
            params = sampling_params(request.sampling_params, starts_after=starts_after)
        except BadRequest:
            raise
        except ValueError as err:
            raise BadRequest(f"sampling_params: {err}") from None
        params = processor.check_params(params)
        prompt = prompt_of(request, processor.encode)
        # (a max_tokens that does not fit beside the prompt is refused, not cut: a
        # ContextLengthError, answered INVALID_ARGUMENT in the engine's words, which name
        # max_tokens or the prompt and the numbers)
        return processor.process(request_id, prompt.text, prompt.token_ids, params,
                                 compile_grammar=False, lora=self._lora(lora_name),
                                 strict_context=True)

    def _lora(self, name: str | None):
        """The adapter the `lora-name` metadata names (None: the base model)."""
        if name is None:
            return None
        limit = self.engine.processor.limits.max_lora_name_length
        if len(name) > limit:
            raise BadRequest(f"{LORA_METADATA} metadata: an adapter's name is limited to "
                             f"{limit} characters (request limit max_lora_name_length).")
        loras = self.state.serving.loras
        lora = loras.lookup(name) if loras is not None else None
        if lora is None:
            known = ", ".join(map(repr, loras.names()[:16])) if loras is not None else ""
            raise BadRequest(f"{LORA_METADATA} metadata: no LoRA adapter {name[:64]!r} is "
                             f"served{' (serving ' + known + ')' if known else ''}.")
        return lora

    def _deadline_timer(self, context, request_id: str):
        """Abort the request just before the call's deadline (None: no deadline)."""
        expired = asyncio.Event()
        remaining = context.time_remaining()
        if remaining is None or not math.isfinite(remaining):
            return None, expired

        def expire() -> None:
            expired.set()
            self.engine.stop_request(request_id)

        loop = asyncio.get_running_loop()
        return loop.call_later(max(0.0, remaining - _DEADLINE_MARGIN_S), expire), expired

    # ---- requests and the engine's state ---------------------------------------------------
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        limit = self.engine.processor.limits.max_abort_ids
        if len(request.request_ids) > limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_ids: at most {limit} ids in one Abort (request limit "
                                f"max_abort_ids), got {len(request.request_ids)}.")
        self.engine.stop_requests(request.request_ids)
        return pb.AbortResponse()

    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        if self.state.draining:
            return pb.HealthCheckResponse(healthy=False, message="The server is shutting down.")
        if not self.engine.is_running:
            return pb.HealthCheckResponse(healthy=False, message=self.engine.dead_reason)
        return pb.HealthCheckResponse(healthy=True, message="Health")

    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context):
        if not self.dev_mode:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "FlushCache is a development-mode call (as vLLM's "
                                "/reset_prefix_cache): start the server with "
                                f"{DEV_MODE_ENV}=1 to serve it.")
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"timeout_s must be a finite number >= 0, got "
                                f"{request.timeout_s}.")
        # Forgetting the cached blocks' hashes never waits for running requests (they keep
        # their blocks), so it succeeds at once.
        try:
            await self.engine.reset_prefix_cache()
        except EngineDeadError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return common_pb2.FlushCacheResponse(success=True,
                                             message="Local KV prefix cache flushed "
                                                     "successfully")

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        model = self.engine.config.model
        hf = model.hf_config
        defaults = {k: v for k, v in model.sampling_defaults.items()
                    if k in DEFAULT_SAMPLING_FIELDS}
        return pb.GetModelInfoResponse(
            model_path=model.model, is_generation=self.engine.config.pooler is None,
            max_context_length=model.max_model_len,
            vocab_size=model.vocab_size, supports_vision=False,
            served_model_name=self.state.config.served_names[0], tokenizer_path=model.tokenizer,
            model_type=hf.get("model_type", ""), architectures=hf.get("architectures") or [],
            eos_token_ids=sorted(self.engine.eos_token_ids),
            pad_token_id=_int_or_zero(hf.get("pad_token_id")),
            bos_token_id=_int_or_zero(hf.get("bos_token_id")),
            max_req_input_len=model.max_model_len - 1,
            default_sampling_params_json=json.dumps(defaults, separators=(",", ":"))
            if defaults else "")

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        config = self.engine.config
        reasoning = self.state.serving.chat.reasoning_parser
        return pb.GetServerInfoResponse(
            active_requests=self.engine.num_in_flight, is_paused=self.state.draining,
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.state.started, server_type="vllm-grpc",
            data_parallel_size=1, kv_cache_dtype=config.cache.kv_cache_dtype,
            block_size=config.cache.block_size,
            attention_backend="" if config.attention.backend == "auto"
            else config.attention.backend,
            model_dtype=config.model.dtype, max_num_seqs=config.scheduler.max_num_seqs,
            engine_reasoning_parser=reasoning or "",
            constrained_decoding_start="after_reasoning" if reasoning else "first_token")

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank={request.dp_rank}: this engine reports one data-"
                                "parallel rank, 0.")
        engine = self.engine
        stats = engine.stats
        load = scheduler_load(stats, max_num_seqs=engine.config.scheduler.max_num_seqs,
                              gen_throughput=engine.generation_rate.rate(),
                              waiting_prompt_tokens=engine.waiting_prompt_tokens(stats.waiting))
        return pb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            version=VERSION, dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context):
        try:
            bundle = await self.state.off_loop(_tokenizer_zip,
                                               self.engine.config.model.tokenizer)
        except FileNotFoundError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        digest = hashlib.sha256(bundle).hexdigest()
        for start in range(0, len(bundle), TOKENIZER_CHUNK_BYTES):
            last = start + TOKENIZER_CHUNK_BYTES >= len(bundle)
            yield common_pb2.GetTokenizerChunk(
                data=bundle[start:start + TOKENIZER_CHUNK_BYTES], sha256=digest if last else "")

    # ---- Embed -----------------------------------------------------------------------------
    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        """One tokenized input's embedding, on a pooling model that embeds (otherwise
        FAILED_PRECONDITION); admitted as /v1/embeddings' inputs are."""
        self.last_receive = time.time()
        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "The server is shutting down.")
        request_id = request.request_id or f"grpc-embed-{uuid.uuid4().hex}"
        try:
            async with self.state.preparing():
                engine_request = await self.state.off_loop(
                    embed_request, request, self.engine.processor, request_id)
        except APIError as err:  # the prepare queue is full
            await context.abort(grpc.StatusCode.UNAVAILABLE, err.message)
        except NotPooling as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err)[:1000])
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err)[:1000])
        timer, expired = self._deadline_timer(context, request_id)
        try:
            output = await self.engine.encode(engine_request)
        except OverloadedError as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except EngineDeadError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except RequestFailedError as err:
            code = grpc.StatusCode.INVALID_ARGUMENT if err.param is not None else \
                grpc.StatusCode.INTERNAL
            await context.abort(code, f"The engine failed this request: {err}"[:1000])
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err)[:1000])
        finally:
            if timer is not None:
                timer.cancel()
        if output.outputs is None:  # stopped before its end: the deadline, or an Abort
            if expired.is_set():
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "The call's deadline passed; the request was aborted.")
            await context.abort(grpc.StatusCode.ABORTED, "The request was aborted.")
        vector = output.outputs.data
        return pb.EmbedResponse(embedding=vector.tolist(),
                                prompt_tokens=len(output.prompt_token_ids),
                                embedding_dim=int(vector.size))

    # ---- not served ------------------------------------------------------------------------

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "StartProfile: profiling over gRPC is not supported; use "
                            "JAX's profiler (jax.profiler) in the engine process.")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "StopProfile: profiling over gRPC is not supported.")

    async def SubscribeKvEvents(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "SubscribeKvEvents: jaxserve publishes no KV cache events; poll "
                            "GetLoads for the engine's load.")
        yield  # an async generator, as the streaming method must be


def _retrieve(future: asyncio.Future) -> None:
    """Read a finished write's exception, so that asyncio logs nothing about it."""
    if not future.cancelled():
        future.exception()


def _int_or_zero(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _tokenizer_zip(folder: str) -> bytes:
    """The tokenizer files of a local folder, zipped with flat names."""
    root = pathlib.Path(folder)
    files = sorted(p for p in root.iterdir() if p.is_file() and (
        p.name in TOKENIZER_FILES or p.name.endswith(TOKENIZER_SUFFIXES))) \
        if root.is_dir() else []
    if not files:
        raise FileNotFoundError(f"No tokenizer files in {folder!r} to send.")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for path in files:
            bundle.write(path, path.name)
    return buffer.getvalue()
