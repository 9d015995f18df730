"""Sleep mode and weight updates (engine/sleep_mode.py, backends/jax/sleep.py): what sleep
frees and wake_up brings back, that greedy tokens and the compiled steps survive both, that
update_weights gives exactly what a fresh engine on the new weights gives (dict or folder,
whole or partial, awake or asleep) and refuses before changing anything; and the
development-mode HTTP routes (server/dev_routes.py), in-process and through a real `jaxserve
serve` with VLLM_SERVER_DEV_MODE=1."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pathlib
import tempfile
import threading
import types

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient
from support.fuzz_requests import dev_requests

from jaxserve import LLM, SamplingParams
from jaxserve.backends.checkpoint import read_safetensors
from jaxserve.backends.compile_stats import compilation_count
from jaxserve.backends.jax.sleep import RunnerSleep
from jaxserve.benchmarks.checkpoints import make_checkpoint
from jaxserve.config.engine_args import EngineArgs
from jaxserve.engine.admission import EngineRequest
from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine.failures import EngineDeadError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.remote_replica import RemoteReplica
from jaxserve.engine.sleep_mode import EngineSleepingError, RequestsUnfinishedError
from jaxserve.server.app import ServerConfig, create_app
from jaxserve.server.async_engine import AsyncLLMEngine
from jaxserve.server.dev_routes import DEV_MODE_ENV, install_dev_routes

PROMPTS = ["def f(x):", "import os"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(max_model_len=128, num_gpu_blocks_override=32, max_num_seqs=4,
              max_num_batched_tokens=64, seed=0)


def tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def device_bytes(runner) -> tuple[int, int]:
    """(weights, KV cache) bytes of a runner."""
    return (sum(a.nbytes for a in jax.tree.leaves(runner.params)),
            sum(k.nbytes + v.nbytes for k, v, *_ in runner.kv_caches))


def flat(params) -> dict[tuple, np.ndarray]:
    return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def tensors(folder) -> dict[str, np.ndarray]:
    return {name: np.array(a) for name, a in
            read_safetensors(pathlib.Path(folder) / "model.safetensors")}


@pytest.fixture(scope="module")
def first(tiny_checkpoints) -> pathlib.Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def second(first) -> pathlib.Path:
    """The tiny llama with other weights (seed 1), built once beside the tiny checkpoints."""
    final = first.parent / "llama-seed1"
    if not final.is_dir():
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=first.parent))
        make_checkpoint("llama", tmp, seed=1)
        try:
            os.rename(tmp, final)
        except OSError:  # another test process built it first
            pass
    return final


@pytest.fixture(scope="module")
def llm(first):
    with LLM(str(first), dtype="float32", enable_sleep_mode=True, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    return tokens(llm)


@pytest.fixture(scope="module")
def expected_second(second):
    """A fresh engine on the second checkpoint (sleep mode off): its tokens, and the
    refusal of sleep without enable_sleep_mode."""
    with LLM(str(second), dtype="float32", **ENGINE) as other:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            other.sleep()
        return tokens(other)


def test_sleep_level_1_frees_the_device_and_wakes_with_the_same_tokens(llm, expected):
    runner = llm.engine.runner
    weights, kv = device_bytes(runner)
    before, compiles = live_bytes(), compilation_count()
    llm.sleep(1)
    asleep = live_bytes()
    assert llm.is_sleeping() and before - asleep >= weights + kv
    llm.sleep(1)  # the same level again: nothing
    with pytest.raises(EngineSleepingError, match=r"sleeping \(LLM.sleep\): call wake_up"):
        llm.generate("def g():", PARAMS, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.wake_up()
    assert not llm.is_sleeping() and live_bytes() - asleep >= weights + kv
    assert device_bytes(runner) == (weights, kv)
    llm.wake_up()  # awake: nothing
    assert tokens(llm) == expected
    assert compilation_count() == compiles


def test_wake_up_and_updates_reset_the_prefix_cache(llm, first):
    # Two prompts (two rows, as PROMPTS) of a full block each, sharing nothing.
    prompts = [{"prompt_token_ids": list(range(start, start + 20))} for start in (5, 105)]
    short = SamplingParams(temperature=0.0, max_tokens=2)

    def hits_of_a_run() -> int:
        hits = llm.engine.prefix_cache_stats.hits
        llm.generate(prompts, short, use_tqdm=False)
        return llm.engine.prefix_cache_stats.hits - hits

    hits_of_a_run()
    assert hits_of_a_run() >= 32  # cached
    llm.sleep(1)
    llm.wake_up()
    assert hits_of_a_run() == 0  # nothing cached survived
    llm.update_weights(str(first))  # the same weights, but the cache is reset all the same
    assert hits_of_a_run() == 0


def test_sleep_level_2_reloads_from_the_folder_and_tags_wake_parts(llm, expected):
    runner, compiles = llm.engine.runner, compilation_count()
    llm.sleep(1)
    llm.sleep(2)  # deeper: the host copy goes too
    assert runner.sleep_mode.host is None and runner.params is None
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and runner.params is not None  # the KV cache still sleeps
    with pytest.raises(EngineSleepingError):
        llm.generate("def g():", PARAMS, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert tokens(llm) == expected
    assert compilation_count() == compiles
    with pytest.raises(ValueError, match="tags: unknown tag 'weight'"):
        llm.wake_up(["weight"])
    with pytest.raises(ValueError, match="level must be 1 .* or 2"):
        llm.sleep(3)


def test_update_weights_gives_the_other_checkpoints_tokens(llm, expected, expected_second,
                                                           first, second):
    new = tensors(second)
    names = sorted(new)
    # numpy, torch and jax values alike
    given = {name: (torch.from_numpy(new[name]) if i % 3 == 1 else
                    jnp.asarray(new[name]) if i % 3 == 2 else new[name])
             for i, name in enumerate(names)}
    compiles = compilation_count()
    assert llm.update_weights(given) == len(names)
    assert tokens(llm) == expected_second
    assert llm.update_weights(str(first)) == len(names)  # back, from a folder
    assert tokens(llm) == expected
    assert compilation_count() == compiles


def test_partial_update_changes_only_its_parameters(llm, expected, first, second):
    runner = llm.engine.runner
    old, norm = flat(runner.params), tensors(second)["model.norm.weight"]
    assert llm.update_weights({"model.norm.weight": norm}) == 1
    now = flat(runner.params)
    assert np.array_equal(now[("norm", "weight")], norm)
    assert all(np.array_equal(now[p], old[p]) for p in old if p != ("norm", "weight"))
    llm.update_weights({"model.norm.weight": tensors(first)["model.norm.weight"]})
    assert tokens(llm) == expected


def test_refusals_change_nothing(llm, expected, second):
    runner = llm.engine.runner
    old = flat(runner.params)
    good = tensors(second)["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="unexpected tensor 'model.nope.weight'"):
        llm.update_weights({"model.layers.0.mlp.up_proj.weight": good,
                            "model.nope.weight": good})
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' has shape \(3,\)"):
        llm.update_weights({"model.layers.0.mlp.up_proj.weight": good,
                            "model.norm.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="not a numeric array"):
        llm.update_weights({"model.norm.weight": [1.0] * 64})
    with pytest.raises(ValueError, match="is not a directory"):
        llm.update_weights("/nonexistent/folder")
    with pytest.raises(ValueError, match="weights is empty"):
        llm.update_weights({})
    now = flat(runner.params)
    assert all(np.array_equal(now[p], old[p]) for p in old)
    # Sleeping with a request unfinished: refused (it must finish or be aborted).
    llm.engine.add_request("running", None, [1, 5, 6, 7], PARAMS)
    with pytest.raises(RequestsUnfinishedError, match="1 request is unfinished"):
        llm.sleep()
    assert not llm.is_sleeping()
    llm.engine.abort_request("running")
    assert tokens(llm) == expected


@pytest.mark.parametrize("level", [1, 2])
def test_update_while_asleep(llm, expected, expected_second, first, second, level):
    """Level 1: the update replaces the host copy; level 2: it gives the weights wake_up
    places (all of them: the folder is not read; some: the folder's, with those over it)."""
    compiles = compilation_count()
    llm.sleep(level)
    llm.update_weights(str(second))
    llm.wake_up()
    assert tokens(llm) == expected_second
    llm.sleep(level)
    llm.update_weights({"model.norm.weight": tensors(first)["model.norm.weight"]})
    llm.update_weights({"model.embed_tokens.weight": tensors(first)["model.embed_tokens.weight"]})
    llm.wake_up()
    if level == 2:  # the rest came from the model's folder
        assert tokens(llm) == expected
    else:
        llm.update_weights(str(first))
        assert tokens(llm) == expected
    assert compilation_count() == compiles


def test_bfloat16_sleeps_wakes_and_updates_with_the_same_tokens(first):
    with LLM(str(first), dtype="bfloat16", enable_sleep_mode=True, **ENGINE) as llm:
        expected, compiles = tokens(llm), compilation_count()
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            assert tokens(llm) == expected
        # torch bfloat16 tensors, rounded as the loader rounds float32: the same weights
        bf16 = {name: torch.from_numpy(value).to(torch.bfloat16)
                for name, value in tensors(first).items()}
        llm.update_weights(bf16)
        assert tokens(llm) == expected
        assert compilation_count() == compiles
        llm.sleep(1)  # and closed asleep


def test_int8_updates_are_quantized_as_loading_quantizes(first, second):
    with LLM(str(first), dtype="float32", quantization="int8", **ENGINE) as llm:
        expected = tokens(llm)
        compiles = compilation_count()
        llm.update_weights(str(second))
        llm.update_weights(tensors(first))
        assert tokens(llm) == expected
        assert compilation_count() == compiles


def test_runner_refusals():
    """A checkpoint published quantized takes no updates; a replica over several hosts
    neither sleeps nor updates."""
    model = types.SimpleNamespace(weights_scheme=object(), weights_label="fp8 (block 128)")
    runner = types.SimpleNamespace(config=types.SimpleNamespace(model=model), channel=None)
    with pytest.raises(ValueError, match=r"published quantized \(fp8 \(block 128\)\)"):
        RunnerSleep(runner).update_weights({})
    runner.channel, model.weights_scheme = object(), None
    for call in (lambda s: s.sleep(1), lambda s: s.update_weights({})):
        with pytest.raises(ValueError, match="spans several hosts"):
            call(RunnerSleep(runner))


# ---- the other engine fronts --------------------------------------------------------------
class StandInReplica:
    """Records the sleep-mode calls a data-parallel front end makes."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.sleeping = False
        self.tokenizer, self.processor, self.runner, self.eos_token_ids = (None,) * 4

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.sleeping = True

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))
        self.sleeping = False

    def is_sleeping(self):
        return self.sleeping

    def update_weights(self, weights):
        self.calls.append(("update_weights", sorted(weights)))
        return len(weights)


def test_data_parallel_engine_fans_out_to_every_replica():
    config = types.SimpleNamespace(parallel=types.SimpleNamespace(data_parallel_size=2),
                                   enable_sleep_mode=True)
    replicas = [StandInReplica(), StandInReplica()]
    engine = DataParallelEngine(config, replicas=replicas)
    engine.sleep(2)
    assert engine.is_sleeping()
    assert engine.update_weights({"b": np.ones(2), "a": torch.ones(2)}) == 2
    engine.wake_up(["weights"])
    for replica in replicas:
        assert replica.calls == [("sleep", 2), ("update_weights", ["a", "b"]),
                                 ("wake_up", ("weights",))]
    engine._owner["r"] = 0  # a request unfinished: checked before any replica sleeps
    with pytest.raises(RequestsUnfinishedError, match="1 request is unfinished"):
        engine.sleep()
    del engine._owner["r"]
    config.enable_sleep_mode = False
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        engine.sleep()
    assert all(len(replica.calls) == 3 for replica in replicas)


def test_engine_core_utility_calls_return_or_raise_in_the_caller(first):
    """The engine core client's side of the protocol (core_process.py), against a stand-in
    core at the other end of a pipe: results come back, the core's errors are raised here,
    a sleeping core's client refuses requests itself, and a core that dies fails the call."""
    config = EngineArgs(model=str(first), dtype="float32").engine_config(
        str(first), on_accelerator=False, default_precompile=False)
    here, there = multiprocessing.Pipe()
    there.send(("ready", config))
    client = RemoteReplica(here, "replica 1 (host 1)")
    answers = {"sleep": (True, None), "wake_up": (True, None), "is_sleeping": (True, False),
               "update_weights": (False, ValueError("tensor 'x' has shape (3,)"))}
    seen = []

    def core():
        while True:
            kind, call_id, method, args = there.recv()
            seen.append((kind, method, args))
            if method == "update_weights" and "die" in args[0]:
                there.close()  # the core dies before it answers
                return
            there.send(("reply", call_id, *answers[method]))

    thread = threading.Thread(target=core, daemon=True)
    thread.start()
    client.sleep(2)
    assert client.is_sleeping()
    with pytest.raises(EngineSleepingError):
        client.add_processed(EngineRequest("r", None, [1, 2], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match=r"tensor 'x' has shape \(3,\)"):
        client.update_weights({"x": np.ones(3, np.float32)})
    client.wake_up(["kv_cache"])
    assert not client.is_sleeping()
    assert [(m, a if m != "update_weights" else sorted(a[0])) for _, m, a in seen] == [
        ("sleep", (2,)), ("update_weights", ["x"]), ("wake_up", (("kv_cache",),)),
        ("is_sleeping", ())]
    with pytest.raises(EngineDeadError):
        client.update_weights({"die": np.ones(1, np.float32)})
    thread.join(5)
    client.close()


def test_torch_backend_refuses_update_weights():
    engine = types.SimpleNamespace(config=types.SimpleNamespace(backend="torch"),
                                   runner=object())
    with pytest.raises(ValueError, match="update_weights runs on the JAX backend; this engine "
                       "runs backend='torch'"):
        LLMEngine.update_weights(engine, {"model.norm.weight": np.ones(4, np.float32)})
    assert not LLMEngine.is_sleeping(engine)


# ---- the development-mode routes, in-process --------------------------------------------
@pytest.fixture
def dev_client(llm, monkeypatch):
    """The app around the module's engine (its loop on a thread of its own meanwhile), with
    the development routes."""
    async_engine = AsyncLLMEngine(llm.engine)
    async_engine.start()
    app = create_app(async_engine, ServerConfig(served_model_name="tiny"))
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    assert install_dev_routes(app, app.state.jaxserve)
    try:
        with TestClient(app) as client:
            yield client
    finally:
        async_engine.stop()


def completion(client) -> list[int] | httpx.Response:
    resp = client.post("/v1/completions", json={
        "model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    return resp.json()["choices"][0]["token_ids"] if resp.status_code == 200 else resp


def test_dev_routes_in_process(dev_client, second, first):
    client = dev_client
    before = completion(client)
    assert client.post("/sleep?level=1").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = completion(client)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "engine_sleeping"
    assert "call wake_up() first" in refused.json()["error"]["message"]
    assert client.post("/wake_up?tags=weights").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert client.post("/wake_up?tags=kv_cache").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert completion(client) == before
    resp = client.post("/update_weights", json={"path": str(second)})
    assert resp.status_code == 200 and resp.json() == {"updated": 21}
    assert client.post("/update_weights", json={"path": str(first)}).status_code == 200
    assert completion(client) == before
    for method, url, body, param in [
            ("POST", "/sleep?level=3", None, "level"),
            ("POST", "/sleep?level=1&level=2", None, "level"),
            ("POST", "/sleep?lvl=1", None, "lvl"),
            ("POST", "/sleep", b'{"level": 2}', None),
            ("POST", "/wake_up?tags=all", None, "tags"),
            ("GET", "/is_sleeping?x=1", None, "x"),
            ("POST", "/update_weights", b"{", None),
            ("POST", "/update_weights", b"{}", "path"),
            ("POST", "/update_weights", b'{"path": 5}', "path"),
            ("POST", "/update_weights", b'{"path": "/", "force": true}', "force"),
            ("POST", "/update_weights", b'{"path": "/nonexistent"}', "path"),
            ("POST", "/update_weights", b'{"path": "/"}', "path")]:
        resp = client.request(method, url, content=body)
        assert resp.status_code == 400, (url, body, resp.text)
        assert resp.json()["error"]["param"] == param, (url, body, resp.text)


def test_a_request_that_reaches_a_sleeping_engine_gets_503(llm):
    """A request queued behind a sleep (here: a server made around a sleeping engine) is
    refused on the engine thread, with the same 503."""
    llm.sleep(1)
    async_engine = AsyncLLMEngine(llm.engine)
    async_engine.start()
    try:
        app = create_app(async_engine, ServerConfig(served_model_name="tiny"))
        with TestClient(app) as client:
            resp = completion(client)
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "engine_sleeping"
            resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "def",
                                                        "max_tokens": 2, "stream": True})
            assert "engine_sleeping" in resp.text  # (a stream reports it in-band)
        assert async_engine.is_running
    finally:
        async_engine.stop()
        llm.wake_up()


def test_dev_routes_fuzz(dev_client, first):
    """Wild query parameters and bodies: a 2xx or a 4xx with the error envelope, never a
    500; the engine still gives the same tokens afterwards."""
    client = dev_client
    before = completion(client)

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=dev_requests(folders=(str(first),)))
    def one(request):
        method, path, query, body = request
        resp = client.request(method, path, params=query, content=body)
        assert resp.status_code < 500, (method, path, query, body, resp.text[:300])
        if resp.status_code >= 400:
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

    one()
    assert client.post("/wake_up").status_code == 200
    assert completion(client) == before


def test_dev_routes_need_dev_mode(llm, monkeypatch):
    monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    async_engine = AsyncLLMEngine(llm.engine)
    app = create_app(async_engine, ServerConfig(served_model_name="tiny"))
    assert not install_dev_routes(app, app.state.jaxserve)
    client = TestClient(app)
    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/update_weights")]:
        assert client.request(method, path).status_code == 404


# ---- the development-mode routes through `jaxserve serve` ---------------------------------
@pytest.fixture(scope="module")
def dev_server(first, tmp_path_factory):
    """`jaxserve serve` of the tiny llama started with VLLM_SERVER_DEV_MODE=1 and
    --enable-sleep-mode, its engine in the engine core process (the calls cross its pipes)."""
    from support.server_helpers import running_server

    with pytest.MonkeyPatch.context() as patch:  # (only the server's environment has it)
        patch.setenv(DEV_MODE_ENV, "1")
        context = running_server(first, "--engine-process", "--enable-sleep-mode",
                                 wait_for="/health", log_dir=tmp_path_factory.mktemp("dev"))
        server = context.__enter__()
    try:
        yield server
    finally:
        context.__exit__(None, None, None)


def test_dev_routes_through_serve(dev_server, first, second):
    with httpx.Client(base_url=dev_server.url, timeout=120, trust_env=False) as client:
        before = completion(client)
        resp = client.post("/sleep", params={"level": 2})
        assert resp.status_code != 404, "server/app.py's create_app must call " \
            "dev_routes.install_dev_routes(app, state)"
        assert resp.status_code == 200, resp.text
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        refused = completion(client)
        assert refused.status_code == 503 and "wake_up" in refused.json()["error"]["message"]
        assert client.post("/sleep", params={"level": 1}).status_code == 200  # (a no-op)
        assert client.post("/wake_up").status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert completion(client) == before
        resp = client.post("/update_weights", json={"path": str(second)})
        assert resp.status_code == 200 and resp.json() == {"updated": 21}, resp.text
        assert completion(client) != before
        resp = client.post("/update_weights", json={"path": str(first / "nope")})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "path"
        assert client.post("/update_weights", json={"path": str(first)}).status_code == 200
        assert completion(client) == before
    assert " ERROR " not in dev_server.log(), dev_server.log()[-3000:]


def test_dev_routes_are_absent_without_dev_mode(api_server):
    with httpx.Client(base_url=api_server.url, timeout=30, trust_env=False) as client:
        for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/update_weights")]:
            assert client.request(method, path).status_code == 404, path
