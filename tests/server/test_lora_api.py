"""LoRA adapters through `jaxserve serve`: --lora-modules, a request's model naming an
adapter or the base model (greedy tokens equal transformers + PEFT's), /v1/models, loading
and unloading at run time (--allow-runtime-lora-updating, --allowed-lora-paths), the refusals
(each names the problem and loads nothing), gRPC's lora-name metadata,
vllm:lora_requests_info, and fuzzed load / unload bodies and adapter names."""

from __future__ import annotations

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from support.fuzz_requests import LORA_BODIES, LORA_NAMES, encode
from support.lora_helpers import greedy, make_adapter, peft_models, poison_adapter
from support.server_helpers import running_server

from jaxserve.benchmarks.checkpoint_checks import check_prompts

NEW_TOKENS = 8
PROMPTS = check_prompts()[:2]


@pytest.fixture(scope="module")
def folders(tiny_checkpoints, mesh_checkpoints, tmp_path_factory) -> dict:
    """Adapters: two served from the start, one loaded at run time (inside the allowed
    folder), and the bad ones (inside it too, so only their own fault refuses them)."""
    base = tiny_checkpoints["llama"]
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    folders = {
        "a0": make_adapter(base, outside / "a0", seed=1, rank=8),
        "a1": make_adapter(base, outside / "a1", seed=2, rank=4,
                           target_modules=("q_proj", "v_proj", "down_proj")),
        "late": make_adapter(base, allowed / "late", seed=3, rank=16, use_rslora=True),
        "outside": make_adapter(base, outside / "late", seed=3, rank=16),
        "rank": make_adapter(base, allowed / "rank32", seed=4, rank=32),
        "lm_head": make_adapter(base, allowed / "lm_head", seed=5,
                                target_modules=("q_proj", "lm_head")),
        "shapes": make_adapter(mesh_checkpoints["llama"], allowed / "other", seed=6),
        "allowed": allowed,
        "outside_folder": outside,
    }
    folders["nan"] = poison_adapter(folders["late"], allowed / "nan", float("nan"))[0]
    return folders


@pytest.fixture(scope="module")
def references(tiny_checkpoints, folders) -> dict:
    """name (None: the base model) -> the greedy tokens of each prompt."""
    names = [None, "a0", "a1", "late"]
    models = peft_models(tiny_checkpoints["llama"], [folders[n] for n in names[1:]])
    return {name: [greedy(model, p, NEW_TOKENS)[0] for p in PROMPTS]
            for name, model in zip(names, models)}


@pytest.fixture(scope="module")
def server(tiny_checkpoints, folders, tmp_path_factory):
    with running_server(tiny_checkpoints["llama"], "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "16", "--lora-modules",
                        f"a0={folders['a0']}",
                        f'{{"name": "a1", "path": "{folders["a1"]}", '
                        f'"base_model_name": "tiny-base"}}',
                        "--allow-runtime-lora-updating", "--allowed-lora-paths",
                        str(folders["allowed"]), wait_for="/health", grpc=True,
                        log_dir=tmp_path_factory.mktemp("lora-server")) as server:
        yield server


def complete(server, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}, timeout=120)


def tokens(server, model: str, prompt: list[int]) -> list[int]:
    response = complete(server, model, prompt)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def model_ids(server) -> dict:
    return {card["id"]: card for card in httpx.get(f"{server.url}/v1/models").json()["data"]}


def test_requests_name_each_adapter_and_the_base(server, references, folders):
    for model, name in (("tiny", None), ("a0", "a0"), ("a1", "a1")):
        for i, prompt in enumerate(PROMPTS):
            assert tokens(server, model, prompt) == references[name][i], (model, i)
    cards = model_ids(server)
    assert set(cards) == {"tiny", "a0", "a1"}
    assert cards["a0"]["parent"] == "tiny" and cards["a1"]["parent"] == "tiny-base"
    # An adapter's card names it, never its folder (clients do not learn server paths).
    assert cards["a0"]["root"] == "a0"
    assert not any(str(folders["outside_folder"]) in str(card) for card in cards.values())
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=120)
    assert chat.status_code == 200 and chat.json()["model"] == "a1"
    missing = complete(server, "nope", PROMPTS[0])
    assert missing.status_code == 404 and "a0" in missing.json()["error"]["message"]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2"' in metrics


def test_loading_and_unloading_at_run_time(server, references, folders):
    load = lambda body: httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)
    unload = lambda body: httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body,
                                     timeout=60)
    response = load({"lora_name": "late", "lora_path": str(folders["late"])})
    assert response.status_code == 200 and "late" in response.text, response.text
    assert model_ids(server)["late"]["parent"] == "tiny"
    for i, prompt in enumerate(PROMPTS):  # three adapters over two slots: swaps
        assert tokens(server, "late", prompt) == references["late"][i]
        assert tokens(server, "a0", prompt) == references["a0"][i]
    again = load({"lora_name": "late", "lora_path": str(folders["late"])})
    assert again.status_code == 400 and "already been loaded" in again.text
    base = load({"lora_name": "tiny", "lora_path": str(folders["late"])})
    assert base.status_code == 400 and "name of the base model" in base.text
    assert unload({"lora_name": "late"}).status_code == 200
    assert complete(server, "late", PROMPTS[0]).status_code == 404
    gone = unload({"lora_name": "late"})
    assert gone.status_code == 404 and "cannot be found" in gone.text
    # The name can be loaded again (a new adapter id: no stale cached prefix).
    assert load({"lora_name": "late", "lora_path": str(folders["late"])}).status_code == 200
    assert tokens(server, "late", PROMPTS[1]) == references["late"][1]
    assert unload({"lora_name": "late"}).status_code == 200


@pytest.mark.parametrize("case,message", [
    ("outside", "outside the folders"),
    ("rank", "max_lora_rank"),
    ("lm_head", "lm_head"),
    ("shapes", "shape"),
    ("missing", "adapter_config.json"),
    ("nan", "non-finite"),
])
def test_bad_adapters_are_refused_and_load_nothing(server, folders, case, message):
    path = folders["allowed"] / "missing" if case == "missing" else folders[case]
    before = model_ids(server)
    response = httpx.post(f"{server.url}/v1/load_lora_adapter",
                          json={"lora_name": f"bad-{case}", "lora_path": str(path)}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "lora_path", error
    assert model_ids(server) == before
    assert complete(server, f"bad-{case}", PROMPTS[0]).status_code == 404


def test_a_link_repointed_after_loading_is_not_followed(server, references, folders):
    """The adapter is read from the folder checked at load time: a symbolic link in the
    allowed folder re-pointed outside it afterwards (before the adapter's first use) is
    not followed."""
    link = folders["allowed"] / "link"
    link.symlink_to(folders["late"], target_is_directory=True)
    try:
        response = httpx.post(f"{server.url}/v1/load_lora_adapter",
                              json={"lora_name": "linked", "lora_path": str(link)}, timeout=60)
        assert response.status_code == 200, response.text
        link.unlink()
        link.symlink_to(folders["a0"], target_is_directory=True)  # (outside, other weights)
        for i, prompt in enumerate(PROMPTS):
            assert tokens(server, "linked", prompt) == references["late"][i]
    finally:
        link.unlink()
        httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "linked"},
                   timeout=60)


def test_grpc_selects_an_adapter_by_metadata(server, references):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.VllmEngineStub(channel)

        def run(metadata):
            request = pb.GenerateRequest(
                request_id="lora", tokenized=pb.TokenizedInput(input_ids=PROMPTS[0]),
                sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                  ignore_eos=True), stream=False)
            return list(stub.Generate(request, timeout=120, metadata=metadata))

        done = run((("lora-name", "a0"),))[-1].complete
        assert list(done.output_ids) == references["a0"][0]
        assert list(run(())[-1].complete.output_ids) == references[None][0]
        with pytest.raises(grpc.RpcError) as err:
            run((("lora-name", "nope"),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "nope" in err.value.details()


def test_runtime_updates_are_off_unless_asked(api_server):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert httpx.post(f"{api_server.url}{path}", json={}).status_code == 404


def _fuzz_lora(server, path, body, name) -> None:
    response = httpx.post(f"{server.url}{path}", content=encode(body),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code < 500, (path, body, response.text)
    response = httpx.post(f"{server.url}/v1/completions", content=encode(
        {"model": name, "prompt": "def", "max_tokens": 1}),
        headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code < 500, (name, response.text)
    assert httpx.get(f"{server.url}/health").status_code == 200


LORA_CASES = dict(path=LORA_BODIES.map(lambda case: case[0]),
                  body=LORA_BODIES.map(lambda case: case[1]), name=LORA_NAMES)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(**LORA_CASES)
def test_fuzzed_lora_bodies_and_names_never_fail_the_server(server, path, body, name):
    _fuzz_lora(server, path, body, name)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(**LORA_CASES)
def test_many_fuzzed_lora_bodies_and_names_never_fail_the_server(server, path, body, name):
    _fuzz_lora(server, path, body, name)
