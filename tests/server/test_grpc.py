"""`jaxserve serve --grpc-port`: vLLM's VllmEngine service, driven by a grpcio client built
from smg-grpc-proto's stubs (what the SMG gateway uses), against a real server process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import hashlib
import io
import json
import signal
import threading
import time
import zipfile

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from support.server_helpers import SMALL_ENGINE_ARGS, running_server
from support.tls import certificate

from jaxserve import LLM, SamplingParams
from jaxserve.server.app import ServerConfig, create_app
from jaxserve.server.async_engine import AsyncLLMEngine
from jaxserve.server.dev_routes import DEV_MODE_ENV
from jaxserve.server.grpc.servicer import VllmEngineServicer

PROMPT = "def fibonacci(n):"
SERVICE = "vllm.grpc.engine.VllmEngine"


# ---- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(api_server):
    """The shared `jaxserve serve` (conftest.api_server), which also serves gRPC."""
    return api_server


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield pb_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), **SMALL_ENGINE_ARGS)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return llm.get_tokenizer().encode(PROMPT)


def generate(stub, ids, *, stream=True, request_id="r", timeout=60, metadata=None, **params):
    request = pb.GenerateRequest(request_id=request_id,
                                 tokenized=pb.TokenizedInput(input_ids=ids),
                                 sampling_params=pb.SamplingParams(**params), stream=stream)
    return list(stub.Generate(request, timeout=timeout, metadata=metadata))


def by_choice(responses):
    """index -> (tokens of its chunks, its GenerateComplete)."""
    chunks, completes = {}, {}
    for response in responses:
        if response.HasField("chunk"):
            chunks.setdefault(response.chunk.index, []).extend(response.chunk.token_ids)
        else:
            assert response.complete.index not in completes
            completes[response.complete.index] = response.complete
    return chunks, completes


def loads(stub) -> pb.SchedulerLoad:
    return stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]


def wait_idle(stub, within: float) -> pb.SchedulerLoad:
    """The load once nothing runs and no KV block is held (fails after `within` s)."""
    deadline = time.monotonic() + within
    while True:
        load = loads(stub)
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and \
                load.token_usage == 0:
            return load
        assert time.monotonic() < deadline, load
        time.sleep(0.05)


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# ---- Generate -----------------------------------------------------------------------------
def test_streamed_greedy_output_equals_llm_generate(stub, llm, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, prompt_logprobs=1)
    ref = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    want = ref.outputs[0]
    responses = generate(stub, prompt_ids, temperature=0, max_tokens=24, logprobs=2,
                         prompt_logprobs=1, skip_special_tokens=True)
    chunks, completes = by_choice(responses)
    assert chunks == {0: want.token_ids}
    complete = completes[0]
    assert list(complete.output_ids) == want.token_ids
    assert complete.finish_reason == want.finish_reason
    assert complete.prompt_tokens == len(prompt_ids)
    assert complete.completion_tokens == len(want.token_ids)
    assert responses[-1].HasField("complete")
    streamed = [r.chunk for r in responses if r.HasField("chunk")]
    assert all(c.prompt_tokens == len(prompt_ids) for c in streamed)
    assert sum(c.completion_tokens for c in streamed) == len(want.token_ids)
    # logprobs: the chosen token's, and the top 2 most likely first (greedy: rank 1 chosen)
    lp = complete.output_logprobs
    assert list(lp.token_ids) == want.token_ids
    for token, value, top, entry in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs,
                                        want.logprobs):
        assert value == pytest.approx(entry[token].logprob, abs=1e-4)
        assert len(top.values) == 2 and top.token_ids[0] == token
        assert list(top.values) == sorted(top.values, reverse=True)
    streamed_lp = [t for c in streamed for t in c.output_logprobs.token_ids]
    assert streamed_lp == want.token_ids  # each chunk carries its own tokens' logprobs
    # prompt logprobs: in the first chunk and the complete; the first token has none
    first = streamed[0].input_logprobs
    assert list(first.token_ids) == prompt_ids
    assert not first.token_logprobs[0].HasField("value")
    for token, value, entry in zip(prompt_ids[1:], first.token_logprobs[1:],
                                   ref.prompt_logprobs[1:]):
        assert value.value == pytest.approx(entry[token].logprob, abs=1e-4)
    assert all(not c.HasField("input_logprobs") for c in streamed[1:])
    assert not complete.HasField("input_logprobs")  # once per request: the first chunk's

    # the same request unstreamed: one GenerateComplete, the same tokens
    plain = generate(stub, prompt_ids, stream=False, temperature=0, max_tokens=24)
    assert len(plain) == 1 and plain[0].HasField("complete")
    assert list(plain[0].complete.output_ids) == want.token_ids
    # as text: tokenized by the server the way the offline engine tokenizes a prompt
    text = list(stub.Generate(pb.GenerateRequest(
        request_id="t", text=PROMPT, stream=False,
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=24)), timeout=60))
    assert list(text[0].complete.output_ids) == want.token_ids


def test_stops_are_reported_as_vllm_does(stub, llm, prompt_ids):
    want = llm.generate([{"prompt_token_ids": prompt_ids}],
                        SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    tokens = want.outputs[0].token_ids
    _, completes = by_choice(generate(stub, prompt_ids, temperature=0, max_tokens=24,
                                      stop_token_ids=[tokens[5]]))
    done = completes[0]
    assert done.finish_reason == "stop" and done.matched_token_id == tokens[5]
    assert list(done.output_ids) == tokens[:tokens.index(tokens[5]) + 1]
    text = llm.get_tokenizer().decode(tokens[:8])
    stop = text[-3:]
    _, completes = by_choice(generate(stub, prompt_ids, temperature=0, max_tokens=24,
                                      stop=[stop], skip_special_tokens=True))
    assert completes[0].finish_reason == "stop" and completes[0].matched_stop_str == stop
    _, completes = by_choice(generate(stub, prompt_ids, temperature=0, max_tokens=3))
    assert completes[0].finish_reason == "length"
    assert completes[0].WhichOneof("matched_stop") is None


def test_n_with_a_seed_is_reproducible(stub, prompt_ids):
    def run():
        chunks, completes = by_choice(generate(stub, prompt_ids, temperature=1.0, n=2,
                                               seed=1234, max_tokens=16, ignore_eos=True))
        assert sorted(completes) == [0, 1]
        assert all(list(completes[i].output_ids) == chunks[i] for i in (0, 1))
        return [chunks[0], chunks[1]]

    first = run()
    assert first == run()
    assert first[0] != first[1]  # two samples, not one twice


def test_prompt_logprobs_are_sent_once_per_request(stub, prompt_ids):
    """With n choices the prompt logprobs (the same for each) go out once: streamed in the
    first chunk, unstreamed in choice 0's complete (not n copies: 16 of a 1,000-token prompt
    were 2.2 MiB)."""
    params = dict(temperature=1.0, seed=7, n=3, max_tokens=4, ignore_eos=True,
                  prompt_logprobs=1)

    def carriers(responses):
        return [(kind, r.chunk.index if kind == "chunk" else r.complete.index,
                 getattr(r, kind).input_logprobs) for r in responses
                for kind in (r.WhichOneof("response"),)
                if getattr(r, kind).HasField("input_logprobs")]

    streamed = generate(stub, prompt_ids, **params)
    assert sorted(by_choice(streamed)[1]) == [0, 1, 2]
    sent = carriers(streamed)
    assert [(kind, index) for kind, index, _ in sent] == [("chunk", 0)]
    assert streamed[0].chunk.HasField("input_logprobs")
    first = sent[0][2]
    assert list(first.token_ids) == prompt_ids and len(first.top_logprobs) == len(prompt_ids)
    plain = generate(stub, prompt_ids, stream=False, **params)
    assert sorted(by_choice(plain)[1]) == [0, 1, 2]
    sent = carriers(plain)
    assert [(kind, index) for kind, index, _ in sent] == [("complete", 0)]
    assert list(sent[0][2].token_ids) == prompt_ids
    assert [v.value for v in sent[0][2].token_logprobs[1:]] == pytest.approx(
        [v.value for v in first.token_logprobs[1:]], abs=1e-4)


BAD_INPUTS = {
    "empty input_ids": (dict(tokenized=pb.TokenizedInput(input_ids=[])), {}, "input_ids"),
    "no input": (dict(), {}, "input"),
    "token beyond the vocabulary": (dict(tokenized=pb.TokenizedInput(input_ids=[10**6])), {},
                                    "prompt_token_ids"),
    "negative temperature": (None, dict(temperature=-1.0), "temperature"),
    "top_p above 1": (None, dict(top_p=1.5), "top_p"),
    "logprobs of the vocabulary": (None, dict(logprobs=-1), "logprobs"),
    "too many logprobs": (None, dict(logprobs=21), "logprobs"),
    "max_tokens past the context": (None, dict(max_tokens=100_000), "max_tokens"),
    "stop token beyond the vocabulary": (None, dict(stop_token_ids=[10**6]), "stop_token_ids"),
    "bad json schema": (None, dict(json_schema="{not json"), "structured_outputs"),
    "structural tag": (None, dict(structural_tag="{}"), "structural_tag"),
    "multimodal": (dict(mm_inputs=pb.MultimodalInputs(im_token_id=3)), {}, "mm_inputs"),
    "kv transfer": (dict(kv_transfer_params_json="{}"), {}, "kv_transfer_params"),
    "data parallel rank": (dict(data_parallel_rank=1), {}, "data_parallel_rank"),
    "truncation beyond the context": (None, dict(truncate_prompt_tokens=10**6),
                                      "truncate_prompt_tokens"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_invalid_argument_naming_the_field(stub, prompt_ids, name):
    fields, params, named = BAD_INPUTS[name]
    if fields is None:
        fields = dict(tokenized=pb.TokenizedInput(input_ids=prompt_ids))
    request = pb.GenerateRequest(request_id=f"bad-{name}", stream=True,
                                 sampling_params=pb.SamplingParams(**{"max_tokens": 4, **params}),
                                 **fields)
    code, details = status_of(lambda: list(stub.Generate(request, timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert named in details
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy


def test_a_cancelled_stream_frees_its_blocks(stub, prompt_ids):
    call = stub.Generate(pb.GenerateRequest(
        request_id="cancel-me", tokenized=pb.TokenizedInput(input_ids=prompt_ids), stream=True,
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)),
        timeout=120)
    got = [next(call), next(call)]
    assert all(r.HasField("chunk") for r in got)
    assert loads(stub).num_running_reqs == 1
    call.cancel()
    wait_idle(stub, within=2.0)


def test_cancelled_streams_leave_no_error_in_the_log(server, stub, prompt_ids):
    """Calls cancelled while their responses are being written: each write is let go
    quietly (no "Task exception was never retrieved" in the log) and its request aborted."""
    for i in range(20):
        call = stub.Generate(pb.GenerateRequest(
            request_id=f"cancel-{i}", tokenized=pb.TokenizedInput(input_ids=prompt_ids),
            stream=True, sampling_params=pb.SamplingParams(temperature=0, max_tokens=400,
                                                           ignore_eos=True)), timeout=120)
        next(call)
        call.cancel()
    wait_idle(stub, within=5.0)
    time.sleep(0.5)  # a write left behind fails once its call is gone
    errors = [line for line in server.log().splitlines()
              if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    assert not errors, "\n".join(errors[:10])


def test_past_its_deadline_a_call_is_aborted(stub, prompt_ids):
    started = time.monotonic()
    code, details = status_of(lambda: generate(
        stub, prompt_ids, request_id="late", timeout=0.4, temperature=0, ignore_eos=True))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
    assert time.monotonic() - started < 5
    wait_idle(stub, within=2.0)


def test_abort_ends_the_stream_with_abort(stub, prompt_ids):
    call = stub.Generate(pb.GenerateRequest(
        request_id="abort-me", tokenized=pb.TokenizedInput(input_ids=prompt_ids), stream=True,
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True,
                                          n=2, seed=3)), timeout=120)
    next(call)
    stub.Abort(pb.AbortRequest(request_ids=["abort-me", "no-such-request"]), timeout=10)
    _, completes = by_choice(list(call))
    assert sorted(completes) == [0, 1]
    assert {c.finish_reason for c in completes.values()} == {"abort"}
    assert all(c.completion_tokens < 400 for c in completes.values())
    wait_idle(stub, within=2.0)


# ---- the other calls ----------------------------------------------------------------------
def test_model_server_info_and_loads(stub, llm, tiny_checkpoints):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    config = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    assert info.is_generation and info.served_model_name == "tiny"
    assert info.max_context_length == SMALL_ENGINE_ARGS["max_model_len"]
    assert info.vocab_size == config["vocab_size"]
    assert info.model_type == "llama" and list(info.architectures) == ["LlamaForCausalLM"]
    assert set(info.eos_token_ids) == set(llm.engine.eos_token_ids)
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert server.server_type == "vllm-grpc" and server.data_parallel_size == 1
    assert server.max_num_seqs == SMALL_ENGINE_ARGS["max_num_seqs"]
    assert server.block_size > 0 and server.uptime_seconds > 0 and not server.is_paused
    assert server.kv_cache_dtype == llm.engine.config.cache.kv_cache_dtype == "auto"
    response = stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=10)
    assert response.dp_rank_count == 1 and len(response.loads) == 1
    datetime.datetime.fromisoformat(response.timestamp)
    load = response.loads[0]
    assert load.max_total_num_tokens > 0 and 0 <= load.token_usage < 1
    assert load.max_running_requests == SMALL_ENGINE_ARGS["max_num_seqs"]
    code, details = status_of(lambda: stub.GetLoads(pb.GetLoadsRequest(dp_rank=3), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in details


def test_tokenizer_bundle_rebuilds_the_tokenizer(stub, llm, tiny_checkpoints):
    from tokenizers import Tokenizer

    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        names = set(bundle.namelist())
        assert {"tokenizer.json", "config.json"} <= names
        tokenizer = Tokenizer.from_str(bundle.read("tokenizer.json").decode())
    assert tokenizer.encode(PROMPT, add_special_tokens=False).ids == \
        llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)


def test_flush_cache_needs_dev_mode(stub):
    """The shared server runs without VLLM_SERVER_DEV_MODE: FlushCache is not served, as
    HTTP's development routes are not (whatever the request holds)."""
    for request in (common_pb2.FlushCacheRequest(), common_pb2.FlushCacheRequest(timeout_s=-1)):
        code, details = status_of(lambda r=request: stub.FlushCache(r, timeout=10))
        assert code == grpc.StatusCode.UNIMPLEMENTED, details
        assert DEV_MODE_ENV in details


class _Aborted(Exception):
    pass


class _Context:
    """grpc.aio's ServicerContext as far as FlushCache uses it."""

    async def abort(self, code, details):
        raise _Aborted(code, details)


def test_flush_cache_in_dev_mode_forgets_cached_prefixes(llm, prompt_ids, monkeypatch):
    """The servicer around the module's engine: dev mode is read when the servicer is made
    (at start-up), not at each call."""
    long = prompt_ids * 8
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached() -> int:
        return llm.generate([{"prompt_token_ids": long}], params,
                            use_tqdm=False)[0].num_cached_tokens

    cached()
    assert cached() > 0
    async_engine = AsyncLLMEngine(llm.engine)
    async_engine.start()
    try:
        state = create_app(async_engine, ServerConfig(served_model_name="tiny")).state.jaxserve
        monkeypatch.delenv(DEV_MODE_ENV, raising=False)
        off = VllmEngineServicer(state)
        monkeypatch.setenv(DEV_MODE_ENV, "1")
        on = VllmEngineServicer(state)

        def flush(servicer, **fields):
            return asyncio.run(servicer.FlushCache(common_pb2.FlushCacheRequest(**fields),
                                                   _Context()))

        with pytest.raises(_Aborted) as refused:
            flush(off)
        assert refused.value.args[0] == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(_Aborted) as bad:
            flush(on, timeout_s=-1)
        assert bad.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
        monkeypatch.delenv(DEV_MODE_ENV)
        reply = flush(on)
        assert reply.success, reply.message
    finally:
        async_engine.stop()
    assert cached() == 0


def test_health_reflection_and_what_is_not_served(stub, server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        services = {s.name for s in reply.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= services
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    # Embed needs a pooling model (tests/server/test_pooling_api.py serves one): this one generates
    code, details = status_of(lambda: stub.Embed(pb.EmbedRequest(
        request_id="e", tokenized=pb.TokenizedInput(input_ids=[5, 6])), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "generates text" in details
    for call in (lambda: stub.StartProfile(common_pb2.StartProfileRequest(), timeout=10),
                 lambda: list(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(),
                                                     timeout=10))):
        code, details = status_of(call)
        assert code == grpc.StatusCode.UNIMPLEMENTED and details


def test_grpc_requests_count_in_the_metrics(stub, server, prompt_ids):
    def finished() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{"))

    before = finished()
    generate(stub, prompt_ids, request_id="counted", temperature=0, max_tokens=3)
    deadline = time.monotonic() + 5
    while finished() < before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "request counted: prompt" in server.log()  # the request log


@pytest.mark.parametrize("seconds", [10.0, pytest.param(180.0, marks=pytest.mark.slow)])
def test_concurrent_streaming_clients(stub, server, prompt_ids, seconds):
    """16 clients streaming for 10 s (3 minutes with -m slow): no error, every stream
    complete, and the engine idle afterwards, its gauges back to 0."""
    stop_at = time.monotonic() + seconds
    errors, counts = [], [0] * 16

    def client(i: int) -> None:
        k = 0
        while time.monotonic() < stop_at and not errors:
            try:
                chunks, completes = by_choice(generate(
                    stub, prompt_ids[: 2 + (i + k) % len(prompt_ids)],
                    request_id=f"load-{i}-{k}", temperature=0.8, seed=i * 1000 + k,
                    max_tokens=4 + (i * 7 + k) % 24))
                assert list(completes[0].output_ids) == chunks[0]
                counts[i] += 1
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)
            k += 1

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(client, range(16)))
    assert not errors, errors[:3]
    assert min(counts) > 0
    wait_idle(stub, within=2.0)
    deadline = time.monotonic() + 2
    while True:  # the gauges follow the engine's snapshots
        gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                  for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
                  if line.startswith(("vllm:num_requests_running{",
                                      "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{"))}
        if len(gauges) == 3 and not any(gauges.values()):
            break
        assert time.monotonic() < deadline, gauges
        time.sleep(0.05)


# ---- TLS, API keys and draining: a server of its own ----------------------------------------


def test_tls_api_key_and_draining(tiny_checkpoints, tmp_path, prompt_ids):
    cert, key, pem = certificate(tmp_path)
    with running_server(tiny_checkpoints["llama"], "--api-key", "secret",
                        "--grpc-ssl-certfile", str(cert), "--grpc-ssl-keyfile", str(key),
                        "--shutdown-timeout", "20", grpc=True, log_dir=tmp_path,
                        wait_for="/health") as server:
        credentials = grpc.ssl_channel_credentials(root_certificates=pem)
        with grpc.secure_channel(f"localhost:{server.grpc_port}", credentials) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            good = [("authorization", "Bearer secret")]
            for metadata in (None, [("authorization", "Bearer wrong")],
                             [("authorization", "secret")]):
                code, details = status_of(lambda m=metadata: generate(
                    stub, prompt_ids, max_tokens=2, metadata=m))
                assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization" in details
                code, _ = status_of(lambda m=metadata: stub.GetModelInfo(
                    pb.GetModelInfoRequest(), timeout=10, metadata=m))
                assert code == grpc.StatusCode.UNAUTHENTICATED
            _, completes = by_choice(generate(stub, prompt_ids, temperature=0, max_tokens=4,
                                              metadata=good))
            assert len(completes[0].output_ids) == 4
            serving = health_pb2.HealthCheckResponse.SERVING
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving

            # SIGTERM: the stream in flight finishes, health turns NOT_SERVING, new calls
            # are refused as UNAVAILABLE, and the process exits 0.
            responses, failures = [], []

            def long_stream():
                try:
                    responses.extend(generate(stub, prompt_ids, request_id="in-flight",
                                              temperature=0, max_tokens=120, ignore_eos=True,
                                              metadata=good, timeout=120))
                except grpc.RpcError as err:
                    failures.append(err)

            worker = threading.Thread(target=long_stream)
            worker.start()
            deadline = time.monotonic() + 30
            while stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10,
                                     metadata=good).active_requests == 0:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while health.Check(health_pb2.HealthCheckRequest(service=SERVICE),
                               timeout=10).status == serving:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert not stub.HealthCheck(pb.HealthCheckRequest(), timeout=10,
                                        metadata=good).healthy
            code, _ = status_of(lambda: generate(stub, prompt_ids, max_tokens=2,
                                                 request_id="late", metadata=good))
            assert code == grpc.StatusCode.UNAVAILABLE
            worker.join(60)
            assert not failures, failures
            _, completes = by_choice(responses)
            assert completes[0].finish_reason == "length"
            assert len(completes[0].output_ids) == 120
        assert server.process.wait(60) == 0


# ---- the request mapping, without a server -----------------------------------------------
def test_proto3_defaults_read_as_vllms_servicer_reads_them():
    from jaxserve.server.grpc.requests import sampling_params

    plain = sampling_params(pb.SamplingParams())
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p) == (1.0, 1.0, 0, 0.0)
    assert (plain.repetition_penalty, plain.n, plain.max_tokens, plain.seed) == (1.0, 1, None,
                                                                                  None)
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert plain.structured_outputs is None and not plain.skip_special_tokens
    set_ = sampling_params(pb.SamplingParams(
        temperature=0.0, top_p=0.5, top_k=7, max_tokens=9, n=3, seed=0, logprobs=0,
        logit_bias={5: -3.0}, json_object=True, stop=["x"], skip_special_tokens=True),
        starts_after="</think>")
    assert (set_.temperature, set_.top_p, set_.top_k, set_.max_tokens, set_.n) == \
        (0.0, 0.5, 7, 9, 3)
    assert set_.seed == 0 and set_.logprobs == 0 and set_.logit_bias == {5: -3.0}
    assert set_.structured_outputs.json_object and set_.stop == ["x"]
    assert set_.structured_outputs.starts_after == "</think>"
    first = sampling_params(pb.SamplingParams(regex="a+", grammar_from_first_token=True),
                            starts_after="</think>")
    assert first.structured_outputs.regex == "a+"
    assert first.structured_outputs.starts_after is None
    assert sampling_params(pb.SamplingParams(json_object=False)).structured_outputs is None
    choice = sampling_params(pb.SamplingParams(choice=pb.ChoiceConstraint(choices=["a", "b"])))
    assert choice.structured_outputs.choice == ["a", "b"]
