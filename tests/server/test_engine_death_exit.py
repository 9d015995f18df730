"""Once the engine dies, `jaxserve serve` fails the requests in flight and exits non-zero (for
its supervisor to restart it) instead of answering 503 forever; a server stopped by SIGTERM
still exits 0. In process (server/launch.serve, a lost device injected into the engine's
step), and as a real `jaxserve serve` whose engine core process is killed (about 5 s)."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import signal
import threading
import time

import httpx
import pytest
from support.server_helpers import free_port, running_server
from support.streams import aclient, request, run_async, stream

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.failures import EngineDeadError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import ServerConfig
from jaxserve.server.launch import ENGINE_DEAD_EXIT_CODE, serve

BODY = {"model": "t", "prompt": [5, 6, 7], "max_tokens": 4}


def serve_in_process(engine, client, give_up: float = 20.0) -> tuple[int, float]:
    """launch.serve(engine) on a free port (this thread: uvicorn's signal handlers) while
    client(url) runs on another thread; (serve's exit status, seconds it served). A server
    still up give_up seconds after the client is done gets SIGTERM (then exits 0)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    served = threading.Event()

    def run_client():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        client(url)
        if not served.wait(give_up) and callable(signal.getsignal(signal.SIGTERM)):
            os.kill(os.getpid(), signal.SIGTERM)  # (only while uvicorn's handler is there)

    thread = threading.Thread(target=run_client, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        status = serve(engine, ServerConfig(served_model_name="t", port=port,
                                            shutdown_timeout=1.0, log_stats=False))
    finally:
        served.set()
        gc.unfreeze()  # (serve froze this test process's heap)
    thread.join(10)
    return status, time.monotonic() - started


@pytest.fixture
def engine(tiny_checkpoints):
    config = EngineConfig.create(str(tiny_checkpoints["llama"]), max_model_len=128,
                                 max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
    return LLMEngine(config)


def test_a_dead_engine_fails_its_requests_and_the_server_exits_non_zero(engine, monkeypatch):
    def lost_device(*args, **kwargs):
        raise EngineDeadError("the device fails even an empty step: injected")

    monkeypatch.setattr(engine, "step", lost_device)
    answers = []

    def client(url):
        answers.append(httpx.post(f"{url}/v1/completions", json=BODY, timeout=30,
                                  trust_env=False))

    status, seconds = serve_in_process(engine, client)
    assert status == ENGINE_DEAD_EXIT_CODE != 0
    assert seconds < 30, seconds
    (answer,) = answers
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "engine_dead" and "injected" in error["message"], error


def test_a_server_stopped_by_sigterm_exits_zero(engine):
    answers = []

    def client(url):
        answers.append(httpx.get(f"{url}/health", timeout=10, trust_env=False).status_code)
        os.kill(os.getpid(), signal.SIGTERM)  # (uvicorn's handler, on the serving thread)

    status, _ = serve_in_process(engine, client)
    assert answers == [200]
    assert status == 0


# Slow (a server process of its own; the suite's budget): the watcher itself is tested above.
@pytest.mark.slow
def test_serve_exits_non_zero_when_its_engine_core_process_dies(tiny_checkpoints, tmp_path):
    with running_server(tiny_checkpoints["llama"], "--engine-process", "--precompile", "lazy",
                        wait_for="/health", log_dir=tmp_path) as srv:
        core = int(re.search(r"The engine core runs in process (\d+)", srv.log()).group(1))

        async def main():
            first = asyncio.Event()
            async with aclient() as own:
                task = asyncio.create_task(stream(own, srv.api, *request(
                    False, "def f(x):", 400, ignore_eos=True), first_chunk=first))
                await asyncio.wait_for(first.wait(), 120)
                os.kill(core, signal.SIGKILL)
                return await task

        result = run_async(main(), 180)
        returncode = srv.process.wait(30)
        log = srv.log()
    assert result.status == 200 and result.done, result
    assert result.error is not None and result.error["error"]["code"] == "engine_dead", result
    assert returncode == ENGINE_DEAD_EXIT_CODE, log[-3000:]
    assert "The engine is dead" in log, log[-3000:]
