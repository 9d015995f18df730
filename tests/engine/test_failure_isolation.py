"""One request that makes a step fail must fail alone: the engine finds it, ends it with
finish_reason "error", frees its blocks and keeps serving everyone else, with their correct
tokens. Failures are injected by a runner wrapper around the real ModelRunner, for steps that
carry the request named "poison": when the step is prepared (dispatch), when it runs on the
device (fetch), or everywhere at once (a lost device, which alone kills the engine).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from starlette.testclient import TestClient

from jaxserve import SamplingParams
from jaxserve.backends.jax.runner import ModelRunner
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import EngineDeadError, LLMEngine
from jaxserve.server.app import ServerConfig, create_app
from jaxserve.server.async_engine import AsyncLLMEngine

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
POISON = [1, 40, 41, 42, 43]


class InjectedError(RuntimeError):
    pass


class FaultyRunner:
    """The real runner, except that steps carrying a poisoned request fail (mode "dispatch"
    or "fetch"), or every step fails (mode "lost")."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.mode: str | None = None
        self.failed_steps: list[int] = []  # the request count of each step that failed
        self.steps = 0  # dispatched (or attempted)
        # (request, the first position its row computes) -> whether the step fails
        self.is_poison = lambda request, first: request.request_id.startswith("poison")

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _poisoned(self, out) -> bool:
        return self.mode == "lost" or any(
            self.is_poison(r, first) for r, first in zip(out.requests, out.num_computed_tokens))

    def dispatch(self, out, score_targets=None, grammar_masks=None):
        self.steps += 1
        if self.mode in ("dispatch", "lost") and self._poisoned(out):
            self.failed_steps.append(len(out.requests))
            raise InjectedError("injected while preparing the step")
        return (self.runner.dispatch(out, score_targets, grammar_masks), len(out.requests),
                self.mode == "fetch" and self._poisoned(out))

    def fetch(self, handle):
        step, size, poisoned = handle
        if poisoned or self.mode == "lost":
            self.failed_steps.append(size)
            raise InjectedError("injected while the step ran")
        return self.runner.fetch(step)


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    # bfloat16, as real checkpoints: the reference tokens come from this same engine.
    config = EngineConfig.create(str(tiny_checkpoints["llama"]), max_model_len=256,
                                 max_num_seqs=8, max_num_batched_tokens=128, precompile=False,
                                 dtype="bfloat16")
    return LLMEngine(config, runner=FaultyRunner(ModelRunner(config)))


@pytest.fixture(scope="module")
def good_prompts(checkpoint_script):
    return checkpoint_script.check_prompts()[:7]


@pytest.fixture(scope="module")
def reference(engine, good_prompts):
    """The seven good prompts' greedy tokens, run with no fault."""
    return run(engine, {f"good{i}": p for i, p in enumerate(good_prompts)})


def run(engine, prompts: dict[str, list[int]], params=PARAMS) -> dict:
    for request_id, ids in prompts.items():
        engine.add_request(request_id, None, ids, params)
    finals = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished_requests()
    return finals


def check_poisoned_batch(engine, good_prompts, reference, mode: str,
                         poison: list[int] = POISON) -> None:
    engine.runner.mode, engine.runner.failed_steps = mode, []
    try:
        finals = run(engine, {"poison": poison, **{f"good{i}": p
                                                   for i, p in enumerate(good_prompts)}})
    finally:
        engine.runner.mode = None
    # One shared step failed (with asynchronous scheduling, also the one launched behind it
    # before its failure was known), then the poison alone: it was found at once, and no
    # other request's step ever failed with it again.
    failed = engine.runner.failed_steps
    shared = 2 if engine.config.scheduler.async_scheduling and mode == "fetch" else 1
    assert len(failed) == shared + 1 and min(failed[:shared]) > 1 and failed[-1] == 1, failed
    poisoned = finals.pop("poison")
    assert [c.finish_reason for c in poisoned.outputs] == ["error"]
    assert poisoned.error and "InjectedError" in poisoned.error
    for request_id, output in finals.items():
        assert output.error is None
        assert output.outputs[0].finish_reason == "length"
        assert output.outputs[0].token_ids == reference[request_id].outputs[0].token_ids, \
            request_id
    # Everything was freed, and the engine goes on serving.
    assert engine.kv_manager.usage == 0 and not engine.scheduler.running
    again = run(engine, {"after": good_prompts[0]})["after"]
    assert again.outputs[0].token_ids == reference["good0"].outputs[0].token_ids


def test_a_step_that_cannot_be_prepared_fails_only_its_culprit(engine, good_prompts,
                                                                reference):
    check_poisoned_batch(engine, good_prompts, reference, "dispatch")


def test_a_step_that_fails_on_the_device_fails_only_its_culprit(engine, good_prompts,
                                                                 reference):
    check_poisoned_batch(engine, good_prompts, reference, "fetch")


def test_a_culprit_that_fails_only_in_a_later_prompt_chunk_is_found(engine, good_prompts,
                                                                      reference):
    # 200 tokens with a budget of 128 per step: the prompt runs in two chunks, and only steps
    # with the second one fail. Suspects run alone until they pass the step that failed, so
    # the culprit's first chunk succeeding alone does not clear it.
    runner = engine.runner
    runner.is_poison = lambda r, first: r.request_id.startswith("poison") and first > 0
    try:
        check_poisoned_batch(engine, good_prompts, reference, "fetch",
                             poison=[1] + list(range(40, 239)))
    finally:
        runner.is_poison = FaultyRunner(None).is_poison


def test_a_failure_reading_one_requests_results_fails_it_alone(engine, good_prompts,
                                                                reference, monkeypatch):
    for i, prompt in enumerate(good_prompts):
        engine.add_request(f"good{i}", None, prompt, PARAMS)
    engine.add_request("poison", None, POISON, PARAMS)
    detok = engine._tracked["poison"].detokenizers[0]  # a detokenizer that breaks

    def broken(*args, **kwargs):
        raise InjectedError("injected while detokenizing")

    monkeypatch.setattr(detok, "update", broken)
    monkeypatch.setattr(detok, "extend", broken)  # what the engine feeds sampled tokens to
    finals = run(engine, {})
    assert finals["poison"].outputs[0].finish_reason == "error"
    for i in range(len(good_prompts)):
        assert finals[f"good{i}"].outputs[0].token_ids == \
            reference[f"good{i}"].outputs[0].token_ids
    assert engine.kv_manager.usage == 0


def test_failed_request_is_a_500_or_an_error_event_and_the_server_stays_healthy(engine):
    runner = engine.runner
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()
    # The server makes its own request ids: poison by prompt instead.
    runner.mode, runner.is_poison = "dispatch", lambda r, _: r.prompt_token_ids == POISON
    try:
        client = TestClient(create_app(async_engine, ServerConfig(served_model_name="t")))
        body = {"prompt": POISON, "max_tokens": 4}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert error["code"] == "internal_error" and "InjectedError" in error["message"]
        resp = client.post("/v1/completions", json={**body, "stream": True})
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "internal_error"
        # A poisoned prompt among several fails the request at once and aborts the others
        # (one would need 200 steps to finish).
        steps = runner.steps
        resp = client.post("/v1/completions", json={"prompt": [[1, 5, 6], POISON],
                                                    "max_tokens": 200, "ignore_eos": True})
        assert resp.status_code == 500, resp.text
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            time.sleep(0.02)
        assert not engine.has_unfinished_requests() and engine.kv_manager.usage == 0
        assert runner.steps - steps < 100, runner.steps - steps
        assert client.get("/health").status_code == 200
        resp = client.post("/v1/completions", json={"prompt": [1, 5, 6, 7], "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"]
    finally:
        runner.mode, runner.is_poison = None, FaultyRunner(None).is_poison
        async_engine.stop()


def test_a_lost_device_kills_the_engine_and_health_says_why(tiny_checkpoints, engine):
    engine.runner.mode = "lost"
    try:
        engine.add_request("a", None, [1, 5, 6], PARAMS)
        engine.add_request("b", None, [1, 7, 8], PARAMS)
        with pytest.raises(EngineDeadError, match="empty step.*InjectedError"):
            for _ in range(10):
                engine.step()
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()

        async def late():
            processor = engine.processor
            stream = async_engine.submit(processor.process("late", None, [1, 5],
                                                           processor.check_params(PARAMS)))
            return [o async for o in stream]

        with pytest.raises(EngineDeadError):
            asyncio.run(late())
        client = TestClient(create_app(async_engine, ServerConfig(served_model_name="t")))
        health = client.get("/health")
        assert health.status_code == 503
        assert "InjectedError" in health.json()["error"]["message"]
        async_engine.stop()
    finally:
        engine.runner.mode = None
        for request_id in ("a", "b", "late"):
            engine.abort_request(request_id)
