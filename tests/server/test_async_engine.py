"""The engine loop behind the server, driven in-process (no HTTP)."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from starlette.testclient import TestClient

from jaxserve import SamplingParams
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import ServerConfig, create_app
from jaxserve.server.async_engine import AsyncLLMEngine, EngineDeadError, OverloadedError
from jaxserve.server.metrics import EngineMetrics

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    config = EngineConfig.create(str(tiny_checkpoints["llama"]), max_model_len=128,
                                 max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
    return LLMEngine(config)


@pytest.fixture
def running(engine):
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=3, metrics=EngineMetrics("t"))
    async_engine.start()
    yield async_engine
    async_engine.stop()
    assert not engine.has_unfinished_requests()


async def collect(stream):
    return [output async for output in stream]


def admitted(engine, request_id: str, ids: list[int], params: SamplingParams = PARAMS):
    """The engine request the admission path makes (the server's prepare threads)."""
    processor = engine.processor
    return processor.process(request_id, None, ids, processor.check_params(params))


def test_concurrent_requests_share_steps_and_match_offline(engine):
    # The offline reference first: the engine must not be stepped from two threads.
    engine.add_request("offline", None, [5, 6, 7], PARAMS)
    while engine.has_unfinished_requests():
        final = [o for o in engine.step() if o.finished]
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def main():
        streams = [async_engine.submit(admitted(engine, f"r{i}", [5 + i, 6, 7]))
                   for i in range(3)]
        return await asyncio.gather(*(collect(s) for s in streams))

    try:
        results = asyncio.run(main())
    finally:
        async_engine.stop()
    for outputs in results:
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 6
    assert final[0].outputs[0].token_ids == results[0][-1].outputs[0].token_ids


def test_leaving_early_aborts_and_frees_blocks(running, engine):
    async def main():
        stream = running.submit(admitted(engine, "early", [5, 6, 7],
                                         SamplingParams(max_tokens=100, ignore_eos=True)))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if running.num_in_flight == 0 and not engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.02)
        return False

    assert asyncio.run(main())
    assert engine.kv_manager.usage == 0


def test_admission_cap_raises_overloaded(engine):
    idle = AsyncLLMEngine(engine, max_waiting_requests=2)  # not started: nothing drains

    async def main():
        idle._thread = type("Alive", (), {"is_alive": lambda self: True})()
        for i in range(2):
            idle.submit(admitted(engine, f"w{i}", [5, 6], PARAMS))
        with pytest.raises(OverloadedError):
            idle.submit(admitted(engine, "w2", [5, 6], PARAMS))

    asyncio.run(main())


def test_a_request_too_big_for_the_queue_is_refused_whole_and_alone(engine):
    idle = AsyncLLMEngine(engine, max_waiting_requests=4)  # not started: nothing drains

    async def main():
        idle._thread = type("Alive", (), {"is_alive": lambda self: True})()
        idle.submit(admitted(engine, "w0", [5, 6], PARAMS))
        many = [admitted(engine, f"big-{i}", [5, 6]) for i in range(4)]
        with pytest.raises(OverloadedError):  # 1 + 4 > 4: none of the four is queued
            idle.submit_many(many)
        assert idle.num_in_flight == 1
        n2 = PARAMS.clone(n=2, temperature=1.0)
        with pytest.raises(OverloadedError):  # n counts: 2 prompts x n=2 do not fit in 3
            idle.submit_many([admitted(engine, f"big-{i}", [5, 6], n2) for i in range(2)])
        with pytest.raises(ValueError):  # an id in use: nothing queued
            idle.submit_many([admitted(engine, "w9", [5]), admitted(engine, "w0", [5])])
        assert idle.num_in_flight == 1
        idle.submit_many(many[:3])  # still room for a request that fits
        assert idle.num_in_flight == 4

    asyncio.run(main())


def test_dead_loop_fails_requests_and_health(engine, monkeypatch):
    async_engine = AsyncLLMEngine(engine)

    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken_step)
    async_engine.start()

    async def main():
        with pytest.raises(EngineDeadError):
            await collect(async_engine.submit(admitted(engine, "doomed", [5, 6, 7], PARAMS)))

    asyncio.run(main())
    assert not async_engine.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(async_engine.submit(admitted(engine, "late", [5], PARAMS))))
    client = TestClient(create_app(async_engine, ServerConfig(served_model_name="t")))
    assert client.get("/health").status_code == 503
    assert client.get("/ready").status_code == 503
    body = client.post("/v1/completions", json={"prompt": "hi"}).json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    engine.abort_request("doomed")


def test_an_unhandled_error_is_a_500_logged_once_with_the_request_id(engine, caplog):
    async_engine = AsyncLLMEngine(engine)
    app = create_app(async_engine, ServerConfig(served_model_name="t"))

    def broken(raw, ids):
        raise RuntimeError("a bug")

    app.state.jaxserve.serving.prepare_completion = broken
    with caplog.at_level(logging.INFO):
        resp = TestClient(app).post("/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 500
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert "a bug" not in resp.text  # no internals in the answer
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert re.search(r"POST /v1/completions \(request [0-9a-f]{32}\)", errors[0].getMessage())
    assert errors[0].exc_info is not None


def test_a_consumer_whose_event_loop_closed_is_aborted_and_the_loop_goes_on(running, engine):
    """Outputs for a stream whose event loop has closed (a short-lived client loop, as
    starlette's TestClient runs) cannot be delivered: the request is aborted and the engine
    thread keeps serving."""
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    gone = asyncio.new_event_loop()

    async def submit_only():
        return running.submit(admitted(engine, "orphan", [5, 6, 7], long))

    gone.run_until_complete(submit_only())
    gone.close()  # nobody will ever read "orphan"'s outputs
    for _ in range(500):
        if not engine.has_unfinished_requests() and running.num_in_flight == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert running.is_running, running.dead_reason
    assert not engine.has_unfinished_requests() and running.num_in_flight == 0

    async def one():
        return await collect(running.submit(admitted(engine, "after", [5, 6, 7], PARAMS)))

    assert asyncio.run(one())[-1].finished


def test_a_template_that_refuses_is_the_same_400_on_tokenize_and_chat(running, engine):
    tokenizer = engine.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('system messages are not supported') }}"
    try:
        client = TestClient(create_app(running, ServerConfig(served_model_name="t")))
        messages = [{"role": "system", "content": "be brief"}]
        chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        tokenize = client.post("/tokenize", json={"messages": messages})
    finally:
        tokenizer.chat_template = saved
    for resp in (chat, tokenize):
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "messages" and "system messages are not supported" in \
            error["message"]
    assert chat.json()["error"] == tokenize.json()["error"]
