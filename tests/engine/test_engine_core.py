"""The engine core process (engine/core_process.py) behind EngineCoreClient: the same
outputs as the engine in this process, aborts, structured outputs, start-up failures, a
core that dies, and shutdown. (Every server test also runs through it: conftest's shared
api_server passes --engine-process.)"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from jaxserve import SamplingParams
from jaxserve.config.engine_args import EngineArgs
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.core_client import EngineCoreClient
from jaxserve.engine.data_parallel import create_engine, engine_from_args
from jaxserve.engine.failures import EngineDeadError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.async_engine import AsyncLLMEngine


def _config(model, dtype: str = "float32") -> EngineConfig:
    return EngineConfig.create(str(model), max_model_len=128, max_num_seqs=4,
                               max_num_batched_tokens=64, dtype=dtype, precompile=False)


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    """(the engine in a core process, the same engine here)."""
    config = _config(tiny_checkpoints["llama"])
    client = EngineCoreClient(create_engine, (config,))
    yield client, LLMEngine(config)
    client.close()


def _finals(engine, requests, timeout: float = 120.0) -> dict:
    """Add (request id, prompt ids, params) requests and step until they finish: the final
    outputs by id (and every output seen, in "all")."""
    for request_id, ids, params in requests:
        engine.add_request(request_id, None, ids, params)
    finals, seen = {}, []
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the requests did not finish"
        for output in engine.step():
            seen.append(output)
            if output.finished:
                finals[output.request_id] = output
    finals["all"] = seen
    return finals


def _choices(output) -> list:
    return [(c.text, list(c.token_ids), c.finish_reason, c.stop_reason)
            for c in output.outputs]


def _assert_logprobs_match(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if g is None or w is None:
            assert g is w
            continue
        assert g.keys() == w.keys()
        for token in g:
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)
            assert g[token].decoded_token == w[token].decoded_token


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, stop=["e"]),
    SamplingParams(temperature=0.0, max_tokens=24, stop=[" t", "\n"],
                   include_stop_str_in_output=True),
    SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=16, logprobs=2, stop=["o"]),
    SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2, min_tokens=4,
                   stop_token_ids=[13]),
], ids=["stop", "stop-included", "seeded-n3-logprobs", "prompt-logprobs"])
def test_a_request_gets_the_same_output_as_in_one_process(engines, params):
    client, local = engines
    prompt = client.processor.encode("The quick brown fox")
    got = _finals(client, [("a", prompt, params)])
    want = _finals(local, [("a", prompt, params)])
    assert _choices(got["a"]) == _choices(want["a"])
    for g, w in zip(got["a"].outputs, want["a"].outputs):
        if w.logprobs is not None:
            _assert_logprobs_match(g.logprobs, w.logprobs)
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    if want["a"].prompt_logprobs is not None:
        _assert_logprobs_match(got["a"].prompt_logprobs, want["a"].prompt_logprobs)
    assert got["a"].metrics.first_scheduled_time >= got["a"].metrics.arrival_time
    # The streamed texts are deltas that never retract, as in one process.
    texts = [o.outputs[0].text for o in got["all"]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_concurrent_requests_and_a_structured_output(engines):
    client, local = engines
    requests = [(f"r{i}", client.processor.encode(text),
                 SamplingParams(temperature=0.0, max_tokens=12 + i))
                for i, text in enumerate(["Hello", "One two three", "import os"])]
    structured = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={
        "json": {"type": "object", "properties": {"a": {"type": "integer"}},
                 "required": ["a"], "additionalProperties": False}})
    requests.append(("json", client.processor.encode("{"), structured))
    for engine in (client, local):  # the admission path compiles the grammar first
        processor = engine.processor
        for request_id, ids, params in requests:
            engine.add_processed(processor.process(request_id, None, ids,
                                                   processor.check_params(params)))
    got, want = _finals(client, []), _finals(local, [])
    for request_id, _, _ in requests:
        assert _choices(got[request_id]) == _choices(want[request_id]), request_id
    assert isinstance(json.loads(got["json"].outputs[0].text)["a"], int)


def test_abort_ends_a_request_at_once_and_frees_its_id(engines):
    client, _ = engines
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    client.add_request("long", None, [5, 6, 7], params)
    while not any(o.outputs[0].token_ids for o in client.step()):
        pass
    output = client.abort_request("long")
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert not client.has_unfinished_requests()
    assert client.abort_request("long") is None
    # The core stops it too: its sequence leaves the running set.
    deadline = time.monotonic() + 30
    while client.stats().running:
        assert time.monotonic() < deadline
        client.step()
    final = _finals(client, [("long", [5, 6, 7], params.clone(max_tokens=3))])
    assert len(final["long"].outputs[0].token_ids) == 3


def test_waiting_counts_requests_on_their_way_to_the_core(engines):
    client, _ = engines
    # Long enough that the core cannot have finished them by the time stats() is read
    # (a two-token request could finish there before this front end folds its outputs).
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    client.add_request("w", None, [5, 6], params.clone(n=2))
    stats = client.stats()  # one snapshot: waiting and running from the same moment
    assert stats.waiting + stats.running >= 2
    assert stats.unfinished_requests == 1
    _finals(client, [])
    assert client.stats().waiting == 0


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bfloat16_through_the_core(tiny_checkpoints, dtype):
    config = _config(tiny_checkpoints["llama"], dtype)
    params = SamplingParams(temperature=0.0, max_tokens=10, stop=["\n"])
    client = EngineCoreClient(create_engine, (config,))
    try:
        got = _finals(client, [("b", [5, 6, 7, 8], params)])
    finally:
        client.close()
    want = _finals(LLMEngine(config), [("b", [5, 6, 7, 8], params)])
    assert _choices(got["b"]) == _choices(want["b"])


def test_a_bad_setting_raises_in_the_front_end(tiny_checkpoints):
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineCoreClient(engine_from_args, (EngineArgs(max_logprobs=50),
                                            str(tiny_checkpoints["llama"]), False))


def test_a_core_that_dies_fails_its_requests_and_close_stops_the_process(tiny_checkpoints):
    config = _config(tiny_checkpoints["llama"])
    client = EngineCoreClient(create_engine, (config,))
    client.add_request("x", None, [5, 6, 7], SamplingParams(max_tokens=100,
                                                              ignore_eos=True))
    os.kill(client.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="exited"):
        for _ in range(200):
            client.step()
    with pytest.raises(EngineDeadError):
        client.add_request("y", None, [5], SamplingParams(max_tokens=1))
    client.close()

    # Idle, with nothing to step: the server's loop finds out all the same (/health: 503).
    client = EngineCoreClient(create_engine, (config,))
    async_engine = AsyncLLMEngine(client)
    async_engine.start()
    os.kill(client.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while async_engine.is_running:
        assert time.monotonic() < deadline, "the server's loop did not see the core die"
        time.sleep(0.05)
    assert "exited" in async_engine.dead_reason
    async_engine.stop()
    client.close()

    client = EngineCoreClient(create_engine, (config,))
    pid = client.pid
    _finals(client, [("z", [5, 6], SamplingParams(max_tokens=2))])
    client.close()
    assert client.exitcode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_speculative_steps_through_the_core(tiny_checkpoints):
    """n-gram speculation: several tokens per step and stop strings within them reach the
    front end as in one process."""
    config = EngineConfig.create(
        str(tiny_checkpoints["llama"]), max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=64, dtype="float32", precompile=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    motif = [11, 57, 203, 88, 9]
    prompt = [5, 6] + motif * 4
    requests = [("plain", prompt, SamplingParams(temperature=0.0, max_tokens=30)),
                ("stop", prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=["a"]))]
    client = EngineCoreClient(create_engine, (config,))
    try:
        got = {}
        for request in requests:  # one at a time: the same batches as below
            got.update(_finals(client, [request]))
        assert client.stats().spec_drafts > 0
    finally:
        client.close()
    local = LLMEngine(config)
    for request in requests:
        want = _finals(local, [request])
        assert _choices(got[request[0]]) == _choices(want[request[0]])


def test_an_output_the_front_end_cannot_build_fails_that_request_alone(engines, monkeypatch):
    client, _ = engines
    make_output = client.outputs.make_output

    def broken(tracked):
        if tracked.request_id == "bad":
            raise RuntimeError("the detokenizer broke")
        return make_output(tracked)

    monkeypatch.setattr(client.outputs, "make_output", broken)
    got = _finals(client, [
        ("bad", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)),
        ("good", [5, 6, 8], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))])
    assert got["bad"].outputs[0].finish_reason == "error"
    assert "while building its output" in got["bad"].error
    assert got["good"].outputs[0].finish_reason == "length"
    assert len(got["good"].outputs[0].token_ids) == 5
    deadline = time.monotonic() + 30  # the core was told to stop it
    while client.stats().running:
        assert time.monotonic() < deadline
        client.step()
