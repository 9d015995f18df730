"""Property-based fuzz of every input surface of a real `jaxserve serve`: the JSON endpoints
(bodies and X-Request-Id; the pooling routes too, which this generating model refuses: a
pooling model's fuzz pass is in test_pooling_api.py) and gRPC Generate, Abort and Embed,
with the grammar-bearing fields (schemas, regexes, grammars, choices, tools) drawn from a
corpus of known bombs (tests/support/fuzz_requests.py). Every answer is a 2xx or a 4xx with the
error envelope (gRPC: OK or a status that blames the request, never INTERNAL or UNKNOWN),
the server process is the same one afterwards and still gives the same greedy tokens, and
its log holds no ERROR line."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from support.fuzz_requests import ABORTS, embed_requests, encode, grpc_requests, http_requests
from support.response_checks import check_response

NORMAL = {"model": "tiny", "prompt": [1, 5, 6, 7], "max_tokens": 4, "temperature": 0,
          "ignore_eos": True, "logprobs": 0}
# What a gRPC call may end with: the request's fault, or the server's load (and Embed, on a
# model that does not embed: FAILED_PRECONDITION).
GRPC_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.UNAVAILABLE}


@pytest.fixture(scope="module")
def server(api_server):
    return api_server  # conftest: one server for the HTTP test modules


@pytest.fixture(scope="module")
def expected_tokens(server):
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
        return normal_tokens(client)


def normal_tokens(client) -> list[str]:
    resp = client.post("/v1/completions", json=NORMAL)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


def assert_same_server(server, pid: int, expected_tokens) -> None:
    assert server.process.poll() is None and server.process.pid == pid
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as fresh:
        assert fresh.get("/health").status_code == 200
        assert normal_tokens(fresh) == expected_tokens


def fuzz_http(server, expected_tokens, seconds: float, examples: int) -> None:
    """Up to `examples` generated requests, stopping early after `seconds`."""
    deadline = time.monotonic() + seconds
    pid, sent = server.process.pid, []
    client = httpx.Client(base_url=server.url, timeout=60, trust_env=False)

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=http_requests())
    # Found by the fuzzer once (a 500): a field that only chat declares, sent to completions.
    @example(request=("/v1/completions", {"model": "tiny", "prompt": "def f(x):",
                                          "max_tokens": 3, "tools": True}, {}))
    def one(request):
        path, body, headers = request
        if time.monotonic() > deadline:
            return  # the time is up: the remaining examples pass untried
        resp = client.post(path, content=encode(body),
                           headers={"content-type": "application/json", **headers})
        sent.append(resp.status_code)
        check_response(resp, path)

    try:
        one()
    finally:
        client.close()
    assert len(sent) >= min(examples, 50), len(sent)
    assert any(code == 200 for code in sent), "the fuzz never reached the engine"
    assert_same_server(server, pid, expected_tokens)


def fuzz_grpc(server, expected_tokens, seconds: float, examples: int) -> None:
    deadline = time.monotonic() + seconds
    pid, outcomes = server.process.pid, []
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.VllmEngineStub(channel)

        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(request=grpc_requests() | ABORTS | embed_requests())
        # A valid request always among them: the drawn ones can all be refusals (seen once
        # in ~20 runs), and the fuzz must show the engine serving amid them.
        @example(request=pb.GenerateRequest(
            request_id="fuzz-valid", text="def f(x):",
            sampling_params=pb.SamplingParams(max_tokens=2, temperature=0.0)))
        def one(request):
            if time.monotonic() > deadline:
                return
            try:
                if isinstance(request, pb.AbortRequest):
                    stub.Abort(request, timeout=60)
                    return
                if isinstance(request, pb.EmbedRequest):
                    reply = stub.Embed(request, timeout=60)
                    assert reply.embedding_dim == len(reply.embedding) > 0, reply
                    outcomes.append(grpc.StatusCode.OK)
                    return
                responses = list(stub.Generate(request, timeout=60))
            except grpc.RpcError as err:
                allowed = GRPC_REFUSALS | ({grpc.StatusCode.FAILED_PRECONDITION}
                                           if isinstance(request, pb.EmbedRequest) else set())
                assert err.code() in allowed, (err.code(), err.details(), request)
                assert "Error" not in err.details()[:40], err.details()  # no class names
                outcomes.append(err.code())
                return
            assert responses and responses[-1].HasField("complete"), responses[-3:]
            outcomes.append(grpc.StatusCode.OK)

        one()
    assert len(outcomes) >= min(examples, 30), len(outcomes)
    assert grpc.StatusCode.OK in outcomes, "the fuzz never reached the engine"
    assert_same_server(server, pid, expected_tokens)


def test_fuzzed_bodies_get_2xx_or_4xx_and_the_engine_keeps_serving(server, expected_tokens):
    # 400 bodies by default (the suite's time budget); 20,000 in the slow variant below.
    fuzz_http(server, expected_tokens, seconds=60.0, examples=400)


def test_fuzzed_grpc_requests_are_served_or_refused(server, expected_tokens):
    fuzz_grpc(server, expected_tokens, seconds=30.0, examples=200)


@pytest.mark.slow
def test_fuzzed_bodies_for_ten_minutes(server, expected_tokens):
    fuzz_http(server, expected_tokens, seconds=600.0, examples=20_000)


@pytest.mark.slow
def test_fuzzed_grpc_requests_for_five_minutes(server, expected_tokens):
    fuzz_grpc(server, expected_tokens, seconds=300.0, examples=10_000)


# Keep last: the whole module's log.
def test_the_server_log_has_no_error_lines(server):
    errors = [line for line in server.log().splitlines()
              if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    assert not errors, "\n".join(errors[:20])
