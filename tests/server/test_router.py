"""jaxserve behind a real router: the SMG gateway (`smg launch`, from the `smg` wheel of the
dev extra) in gRPC mode in front of two `jaxserve serve --grpc-port` workers, as docs/parallelism.md's
"Scaling out" runs it. OpenAI requests through the router reach both workers (round robin)
and give the greedy text jaxserve's own HTTP API gives; each worker's GetLoads shows the
tokens it generated."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from support.server_helpers import free_port, running_server

SMG = pathlib.Path(sys.executable).parent / "smg"
ROUTER_READY_S = 60.0
PROMPTS = ["def fibonacci(n):", "import os\n"]
CHATS = [[{"role": "user", "content": "Write a loop."}],
         [{"role": "user", "content": "Sort a list."}]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def workers(api_server, tiny_checkpoints, tmp_path_factory):
    """Two gRPC workers serving the tiny llama as "tiny" with the same engine flags: the
    shared server (conftest.api_server) and one more."""
    with running_server(tiny_checkpoints["llama"], grpc=True, wait_for="/health",
                        log_dir=tmp_path_factory.mktemp("router-worker")) as second:
        yield [api_server, second]


@pytest.fixture(scope="module")
def router(workers, tiny_checkpoints, tmp_path_factory):
    """`smg launch` in front of both workers (round robin); its URL once it routes to both."""
    assert SMG.exists(), f"{SMG} is missing: install the dev extra (pip install -e '.[dev]')"
    port = free_port()
    log_path = tmp_path_factory.mktemp("router") / "smg.log"
    cmd = [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *(f"grpc://127.0.0.1:{w.grpc_port}" for w in workers),
           "--model-path", str(tiny_checkpoints["llama"]), "--policy", "round_robin",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--load-monitor-interval", "1",  # GetLoads every second (default 10)
           "--shutdown-grace-period-secs", "1"]  # (its default waits 5 s at SIGTERM)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, "NO_COLOR": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_READY_S
        while len(_ready_workers(url)) < len(workers):
            assert process.poll() is None, f"smg exited:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, \
                f"smg not routing to both workers:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.2)
        yield url
    finally:
        _stop(process)


def _ready_workers(url: str) -> list[dict]:
    try:
        listed = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return [w for w in listed if w.get("is_healthy") and w.get("status") == "ready"]


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def finished(worker) -> float:
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)


def texts(base_url: str) -> list[str]:
    """The greedy texts of PROMPTS (completions), CHATS (chat; the second streamed).
    Completion prompts go without the tokenizer's BOS (add_special_tokens false), as the
    router tokenizes them."""
    out = []
    with client(base_url) as client_:
        for prompt in PROMPTS:
            response = client_.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"add_special_tokens": False})
            out.append(response.choices[0].text)
        out.append(client_.chat.completions.create(
            model="tiny", messages=CHATS[0], max_tokens=MAX_TOKENS,
            temperature=0).choices[0].message.content)
        stream = client_.chat.completions.create(model="tiny", messages=CHATS[1],
                                                max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True)
        out.append("".join(chunk.choices[0].delta.content or "" for chunk in stream
                           if chunk.choices))
    return out


def test_router_spreads_requests_with_jaxserves_greedy_text(router, workers):
    before = [finished(w) for w in workers]
    own = texts(workers[1].url)  # jaxserve's own HTTP API, straight
    with client(workers[1].url) as direct:  # (HTTP's default prompt starts with BOS)
        assert direct.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0,
                                         max_tokens=MAX_TOKENS).choices[0].text != own[0]
    routed = texts(router)
    # Equal, but where an output cut by max_tokens ends inside a multi-byte character: the
    # router drops its incomplete bytes (as vLLM's detokenizer), jaxserve emits U+FFFD.
    assert routed == [text.removesuffix("\ufffd") for text in own] and all(routed)
    # Both workers served some of the 4 routed requests (the second also the 5 direct ones).
    deadline = time.monotonic() + 10
    while True:
        served = [finished(w) - b for w, b in zip(workers, before)]
        served[1] -= len(own) + 1
        if sum(served) >= len(routed) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sum(served) == len(routed) and min(served) >= 1, served
    # What the router balances on: each worker's GetLoads (its tokens of the last seconds).
    for worker in workers:
        with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
            load = pb_grpc.VllmEngineStub(channel).GetLoads(pb.GetLoadsRequest(),
                                                            timeout=10).loads[0]
        assert load.gen_throughput > 0 and load.max_running_requests == 8
        assert load.utilization == load.token_usage
    # ... and the router has them: its next poll sees the tokens of the last seconds.
    deadline = time.monotonic() + 10
    while True:
        rates = {w["url"]: (w.get("engine_load") or {}).get("loads", [{}])[0].get(
            "gen_throughput", 0.0) for w in _ready_workers(router)}
        if len(rates) == 2 and min(rates.values()) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(rates) == 2 and min(rates.values()) > 0, rates
    errors = [line for line in workers[1].log().splitlines()
              if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    assert not errors, "\n".join(errors[:10])


def aborted(worker) -> float:
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{")
               and 'finished_reason="abort"' in line)


def test_a_client_that_leaves_the_router_aborts_the_request_on_its_worker(router, workers):
    """The router sends gRPC Abort when its client goes: the worker stops the request at
    once (finish reason abort) instead of generating its 400 tokens."""
    before = [aborted(w) for w in workers]
    with client(router) as client_:
        stream = client_.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=400,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        next(iter(stream))  # the first token came: the request runs on a worker
        stream.close()
    deadline = time.monotonic() + 20
    while sum(aborted(w) for w in workers) - sum(before) < 1:
        assert time.monotonic() < deadline, "no worker saw the abort"
        time.sleep(0.1)
    for worker in workers:  # and nothing runs any more, once the engine's stats snapshot
        while True:         # (published after the step that aborted it) has caught up
            with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
                load = pb_grpc.VllmEngineStub(channel).GetLoads(pb.GetLoadsRequest(),
                                                                timeout=10).loads[0]
            if load.num_running_reqs == 0 and load.num_waiting_reqs == 0:
                break
            assert time.monotonic() < deadline, f"still running after the abort: {load}"
            time.sleep(0.1)
