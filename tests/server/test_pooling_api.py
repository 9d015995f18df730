"""The pooling routes (/v1/embeddings, /pooling, /classify, /score, /rerank) and gRPC Embed of
a real `jaxserve serve` of a tiny embedding model, against LLM.embed / LLM.score on the same
checkpoint and Hugging Face transformers; their refusals on it and on the shared generating
server; a fuzz pass over them.

The server runs the pooling tests' engine shape (pooling_refs.POOL_ENGINE: one 16-token step
bucket of up to 2 sequences), so the executable cache serves both modules' compiles."""

from __future__ import annotations

import base64
import re
import time

import grpc
import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from support.fuzz_requests import (
    POOLING_PATHS,
    POOLING_VALID,
    embed_requests,
    encode,
    http_requests,
)
from support.pooling_refs import (
    COSINE_F32,
    POOL_ENGINE,
    cosine_distance,
    hf_hidden,
    hf_probs,
    random_prompts,
)
from support.response_checks import check_response
from support.server_helpers import running_server

from jaxserve import LLM, PoolingParams

POOL_FLAGS = [arg for name, value in POOL_ENGINE.items()
              for arg in ("--" + name.replace("_", "-"), str(value))]
LIMIT = 8  # the server's max_embedding_inputs
TEXTS = ["def main():\n    return 0", "import os", "x"]


@pytest.fixture(scope="module")
def folder(pooling_checkpoints):
    return pooling_checkpoints["qwen3-embed"]  # LAST pooling, normalized, Matryoshka


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    with running_server(folder, *POOL_FLAGS, "--request-limits",
                        f'{{"max_embedding_inputs": {LIMIT}}}', "--enable-log-requests",
                        wait_for="/health", grpc=True,
                        log_dir=tmp_path_factory.mktemp("pooling-server")) as server:
        yield server


@pytest.fixture(scope="module")
def llm(folder):
    llm = LLM(str(folder), **POOL_ENGINE)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.api, api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield pb_grpc.VllmEngineStub(channel)


def vectors(outputs) -> list[np.ndarray]:
    return [np.asarray(o.outputs.embedding, np.float32) for o in outputs]


def post(http, path: str, body: dict) -> dict:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


# ---- embeddings -----------------------------------------------------------------------------
def test_openai_client_embeddings_equal_llm_embed_and_transformers(client, llm, folder):
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model="tiny", input=TEXTS)  # base64, the default
    want = vectors(llm.embed(TEXTS, use_tqdm=False))
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    assert packed.model == "tiny" and packed.object == "list"
    assert packed.usage.prompt_tokens == packed.usage.total_tokens == sum(map(len, ids))
    for i, (f, b, w) in enumerate(zip(floats.data, packed.data, want)):
        assert f.index == b.index == i and f.object == "embedding"
        np.testing.assert_array_equal(np.float32(f.embedding), np.float32(b.embedding))
        np.testing.assert_allclose(f.embedding, w, atol=1e-6)
        assert cosine_distance(b.embedding, hf_hidden(folder, ids[i])[-1]) < COSINE_F32
    prompts = random_prompts([20, 5], seed=30)  # token-id lists, and one list of ids
    got = client.embeddings.create(model="tiny", input=prompts)
    for g, w in zip(got.data, vectors(llm.embed(prompts, use_tqdm=False))):
        np.testing.assert_allclose(g.embedding, w, atol=1e-6)
    one = client.embeddings.create(model="tiny", input=prompts[1])
    np.testing.assert_allclose(one.data[0].embedding, got.data[1].embedding, atol=1e-6)


def test_dimensions_normalize_and_truncation_are_llms(client, llm):
    params = [PoolingParams(dimensions=16), PoolingParams(normalize=False),
              PoolingParams(truncate_prompt_tokens=3)]
    want = vectors(llm.embed([TEXTS[0]] * 3, params, use_tqdm=False))
    short = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16)
    raw = client.embeddings.create(model="tiny", input=TEXTS[0],
                                   extra_body={"use_activation": False})
    raw_old_name = client.embeddings.create(model="tiny", input=TEXTS[0],
                                            extra_body={"normalize": False})
    cut = client.embeddings.create(model="tiny", input=TEXTS[0],
                                   extra_body={"truncate_prompt_tokens": 3})
    assert len(short.data[0].embedding) == 16 and cut.usage.prompt_tokens == 3
    for got, expected in zip([short, raw, cut], want):
        np.testing.assert_allclose(got.data[0].embedding, expected, atol=1e-6)
    assert raw_old_name.data[0].embedding == raw.data[0].embedding
    assert abs(np.linalg.norm(raw.data[0].embedding) - 1) > 1e-3  # (not normalized)


def test_chat_form_renders_the_template_as_vllm(http, llm):
    messages = [{"role": "system", "content": "You embed."},
                {"role": "user", "content": "def f(x): return x"}]
    processor = llm.engine.processor
    for extra, generation_prompt in (({}, False), ({"add_generation_prompt": True}, True)):
        body = post(http, "/v1/embeddings", {"messages": messages, **extra})
        ids = processor.render_chat(messages, add_generation_prompt=generation_prompt)
        want, = vectors(llm.embed({"prompt_token_ids": ids}, use_tqdm=False))
        assert body["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(body["data"][0]["embedding"], want, atol=1e-6)


@pytest.mark.parametrize("dtype, endianness, atol", [
    ("float32", "little", 0.0), ("float32", "big", 0.0), ("float16", "native", 1e-3),
    ("bfloat16", "big", 4e-3)])
def test_base64_embed_dtypes_and_byte_orders(http, dtype, endianness, atol):
    floats = post(http, "/v1/embeddings", {"input": TEXTS[:2]})["data"]
    packed = post(http, "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64",
                                          "embed_dtype": dtype, "endianness": endianness})
    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    for f, b in zip(floats, packed["data"]):
        raw = base64.b64decode(b["embedding"])
        if dtype == "bfloat16":
            bits = np.frombuffer(raw, np.dtype(np.uint16).newbyteorder(order))
            got = (bits.astype(np.uint32) << 16).view(np.float32)
        else:
            got = np.frombuffer(raw, np.dtype(dtype).newbyteorder(order)).astype(np.float32)
        np.testing.assert_allclose(got, f["embedding"], atol=atol, rtol=atol)


def test_pooling_route_and_model_card(http, llm):
    ids = [5, 6, 7, 8]
    body = post(http, "/pooling", {"input": ids, "dimensions": 8})
    want = llm.encode([ids], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.data
    assert body["id"].startswith("pool-") and body["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(body["data"][0]["data"], want, atol=1e-6)
    card, = http.get("/v1/models").json()["data"]
    assert card["id"] == "tiny" and card["tasks"] == ["embed", "score", "encode"]


# ---- scores ---------------------------------------------------------------------------------
def test_score_forms_equal_llm_score(http, llm):
    query, docs = "def main", ["import os", "return None", "import os"]
    want = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    pairs = [o.outputs.score for o in llm.score(["class A", "x = 1"], ["class B", "y = 2"],
                                                  use_tqdm=False)]
    one_to_many = post(http, "/score", {"model": "tiny", "text_1": query, "text_2": docs})
    assert one_to_many["object"] == "list" and one_to_many["id"].startswith("score-")
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], want, atol=1e-6)
    for path, names in (("/v1/score", ("queries", "documents")), ("/score", ("queries", "items")),
                        ("/score", ("data_1", "data_2")), ("/v1/score", ("text_1", "text_2"))):
        body = post(http, path, {names[0]: ["class A", "x = 1"],
                                 names[1]: ["class B", {"text": "y = 2"}]})
        np.testing.assert_allclose([d["score"] for d in body["data"]], pairs, atol=1e-6)
        assert body["usage"]["prompt_tokens"] > 0


def test_rerank_sorts_by_llm_score(http, llm):
    query = "def main"
    docs = ["import os", {"text": "def main(): pass"}, "x = 1",
            {"content": [{"type": "text", "text": "return None"}]}]
    texts = ["import os", "def main(): pass", "x = 1", "return None"]
    want = [o.outputs.score for o in llm.score(query, texts, use_tqdm=False)]
    order = sorted(range(4), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(http, path, {"model": "tiny", "query": query, "documents": docs,
                                 "top_n": 2})
        assert body["id"].startswith("rerank-") and body["model"] == "tiny"
        assert [r["index"] for r in body["results"]] == order[:2]
        for result in body["results"]:
            assert result["document"] == {"text": texts[result["index"]]}
            assert abs(result["relevance_score"] - want[result["index"]]) < 1e-6
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    every = post(http, "/rerank", {"query": query, "documents": texts,
                                   "return_documents": False})["results"]
    assert [r["index"] for r in every] == order and "document" not in every[0]


# ---- refusals -------------------------------------------------------------------------------
# vLLM's pooling request fields (its PoolingBasicRequestMixin, CompletionRequestMixin,
# ChatRequestMixin, EncodingRequestMixin, EmbedRequestMixin, ScoringRequestMixin and the
# routes' own): each is declared, so it is honoured or refused by name, never ignored.
_BASIC = {"model", "user", "truncate_prompt_tokens", "padding", "truncation_side",
          "request_id", "priority", "mm_processor_kwargs", "cache_salt"}
_INPUTS = {"input", "add_special_tokens", "messages", "add_generation_prompt",
           "continue_final_message", "chat_template", "chat_template_kwargs",
           "media_io_kwargs"}
_ENCODED = {"encoding_format", "embed_dtype", "endianness", "dimensions", "use_activation"}
_SCORING = _BASIC | {"use_activation", "max_tokens_per_query", "max_tokens_per_doc",
                     "instruction", "chat_template_kwargs"}
VLLM_FIELDS = {"EmbeddingRequest": _BASIC | _INPUTS | _ENCODED,
               "PoolingRequest": _BASIC | _INPUTS | _ENCODED | {"task"},
               "ClassificationRequest": _BASIC | _INPUTS | {"use_activation"},
               "ScoreRequest": _SCORING | {"text_1", "text_2", "queries", "documents", "items",
                                           "data_1", "data_2"},
               "RerankRequest": _SCORING | {"query", "documents", "top_n"}}


@pytest.mark.parametrize("name", sorted(VLLM_FIELDS))
def test_every_field_of_vllms_pooling_schemas_is_declared(name):
    from jaxserve.server.pooling import protocol as pooling_protocol
    declared = set(getattr(pooling_protocol, name).model_fields)
    assert VLLM_FIELDS[name] <= declared, VLLM_FIELDS[name] - declared


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}, 400, None, "served for pooling"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, None,
     "generates no text"),
    ("/v1/responses", {"input": "hi"}, 400, None, "generates no text"),
    ("/classify", {"input": "x"}, 400, "model", "needs a classification model"),
    ("/pooling", {"input": "x", "task": "classify"}, 400, "task", "classification model"),
    ("/pooling", {"input": "x", "task": "token_embed"}, 400, "task", "per-token pooling"),
    ("/v1/embeddings", {"input": ["a"] * 9}, 400, "input", "limited to 8"),
    ("/score", {"text_1": "a", "text_2": ["b"] * 9}, 400, "text_2", "limited to 8"),
    ("/rerank", {"query": "a", "documents": ["b"] * 9}, 400, "documents", "limited to 8"),
    ("/v1/embeddings", {"input": "x", "dimensions": 65}, 400, "dimensions", "hidden size 64"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, 400, "dimensions", ">= 1"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "bytes"}, 400, "encoding_format",
     "'float' or 'base64'"),
    ("/v1/embeddings", {"input": "x", "embed_dtype": "fp8_e4m3"}, 400, "embed_dtype",
     "not supported"),
    ("/v1/embeddings", {"input": "x", "endianness": "middle"}, 400, "endianness", "native"),
    ("/v1/embeddings", {"input": "x", "use_activation": False, "normalize": True}, 400,
     "normalize", "disagree"),
    ("/v1/embeddings", {"input": []}, 400, "input", "must not be empty"),
    ("/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
     "input", "exactly one of input"),
    ("/v1/embeddings", {"input": [[5, 2000]]}, 400, "input", "vocabulary"),
    ("/v1/embeddings", {"input": [5] * 129}, 400, "input", "max_model_len=128"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 200}, 400,
     "truncate_prompt_tokens", "max_model_len"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens", ">= 1 or -1"),  # (once a 500: found by the fuzz)
    ("/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens", ">= 1 or -1"),
    ("/v1/embeddings", {"input": "x", "truncation_side": "right"}, 400, "truncation_side",
     "keeps the last"),
    ("/v1/embeddings", {"input": "x", "padding": "max_length"}, 400, "padding", "as they are"),
    ("/v1/embeddings", {"input": "x", "add_generation_prompt": True}, 400,
     "add_generation_prompt", "chat form"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "x"}],
                        "chat_template": "{{ 1 }}"}, 400, "chat_template", "trust"),
    ("/v1/embeddings", {"input": "x", "priority": 3}, 400, "priority", "priority scheduling"),
    ("/v1/embeddings", {"input": "x", "mm_processor_kwargs": {}}, 400, "mm_processor_kwargs",
     "text only"),
    ("/v1/embeddings", {"model": "gpt-4", "input": "x"}, 404, "model", "does not exist"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_1", "2 inputs"),
    ("/score", {"text_1": "a"}, 400, "text_1", "one pair of inputs"),
    ("/score", {"text_1": "a", "text_2": "b", "use_activation": True}, 400, "use_activation",
     "does not apply"),
    ("/score", {"text_1": "a", "text_2": "b", "max_tokens_per_doc": 4}, 400,
     "max_tokens_per_doc", "not supported"),
    ("/score", {"text_1": "a", "text_2": []}, 400, "text_2", "must not be empty"),
    ("/rerank", {"query": "a", "documents": [{"content": [{"type": "image_url",
                                                           "image_url": {"url": "x"}}]}]},
     400, "documents", "only text parts"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400, "top_n", "0"),
])
def test_refusals_name_the_field(http, path, body, status, param, message):
    resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error


def test_generating_server_refuses_the_pooling_routes(api_server):
    with httpx.Client(base_url=api_server.url, timeout=60, trust_env=False) as http:
        for path, body in POOLING_VALID.items():
            resp = http.post(path, json=body)
            assert resp.status_code == 400, (path, resp.text)
            error = resp.json()["error"]
            assert error["param"] == "model" and "This model generates text" in \
                error["message"], (path, error)
        card, = http.get("/v1/models").json()["data"]
        assert card["tasks"] == ["generate"]


# ---- gRPC -----------------------------------------------------------------------------------
def grpc_status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_grpc_embed_round_trip(stub, llm):
    prompts = random_prompts([30, 4], seed=31)
    want = vectors(llm.embed(prompts, use_tqdm=False))
    for i, (ids, expected) in enumerate(zip(prompts, want)):
        reply = stub.Embed(pb.EmbedRequest(request_id=f"embed-{i}", tokenized=pb.TokenizedInput(
            original_text="", input_ids=ids)), timeout=60)
        assert reply.prompt_tokens == len(ids) and reply.embedding_dim == 64
        np.testing.assert_allclose(reply.embedding, expected, atol=1e-6)
    for request, code, words in (
            (pb.EmbedRequest(request_id="e"), grpc.StatusCode.INVALID_ARGUMENT,
             "tokenized.input_ids must not be empty"),
            (pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[5] * 129)),
             grpc.StatusCode.INVALID_ARGUMENT, "max_model_len=128"),
            (pb.EmbedRequest(request_id="r" * 300, tokenized=pb.TokenizedInput(input_ids=[5])),
             grpc.StatusCode.INVALID_ARGUMENT, "max_request_id_length")):
        got, details = grpc_status(lambda request=request: stub.Embed(request, timeout=60))
        assert got == code and words in details, details
    got, details = grpc_status(lambda: list(stub.Generate(pb.GenerateRequest(
        request_id="g", text="def", sampling_params=pb.SamplingParams(max_tokens=2)),
        timeout=60)))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "generates no text" in details


# ---- metrics, fuzz, log ----------------------------------------------------------------------
def counter(http, name: str) -> float:
    text = http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def test_pooling_requests_count_in_the_vllm_metrics(http):
    before = (counter(http, "vllm:request_success_total"),
              counter(http, "vllm:prompt_tokens_total"))
    body = post(http, "/v1/embeddings", {"input": [[5, 6], [7, 8, 9], [10]]})
    after = (counter(http, "vllm:request_success_total"),
             counter(http, "vllm:prompt_tokens_total"))
    assert after[0] - before[0] == 3
    assert after[1] - before[1] == body["usage"]["prompt_tokens"] == 6


def test_fuzzed_pooling_requests_get_2xx_or_4xx(server, http, stub):
    """The pooling routes' fuzz on a model that serves them (test_fuzz.py sends them to the
    generating model), then gRPC Embed's; the same server answers the same afterwards."""
    before = post(http, "/v1/embeddings", {"input": TEXTS})["data"]
    pid, sent, deadline = server.process.pid, [], time.monotonic() + 12

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=http_requests(paths=POOLING_PATHS))
    def one(request):
        path, body, headers = request
        if time.monotonic() > deadline:
            return
        resp = http.post(path, content=encode(body),
                         headers={"content-type": "application/json", **headers})
        sent.append(resp.status_code)
        check_response(resp, path)

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=embed_requests())
    def embed(request):
        try:
            reply = stub.Embed(request, timeout=60)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
            return
        assert reply.embedding_dim == len(reply.embedding) == 64

    one()
    embed()
    assert len(sent) >= 50 and 200 in sent, sent
    assert server.process.poll() is None and server.process.pid == pid
    assert post(http, "/v1/embeddings", {"input": TEXTS})["data"] == before


# Keep last: the whole module's log.
def test_the_server_log_has_no_error_lines(server):
    errors = [line for line in server.log().splitlines()
              if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    assert not errors, "\n".join(errors[:20])


# ---- slow: a cross-encoder, and bfloat16 ---------------------------------------------------
@pytest.mark.slow
def test_cross_encoder_server_scores_as_llm_and_transformers(pooling_checkpoints,
                                                             tmp_path):
    folder = pooling_checkpoints["llama-cls1"]
    query, docs = "what is os", ["import os", "def f(): pass", "x = 1"]
    engine = {**POOL_ENGINE, "max_num_seqs": 1}  # test_pooling's cross-encoder shape
    with LLM(str(folder), **engine) as llm:
        want = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        probs = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
        tokenizer = llm.get_tokenizer()
    flags = [arg for name, value in engine.items()
             for arg in ("--" + name.replace("_", "-"), str(value))]
    with running_server(folder, *flags, log_dir=tmp_path) as server, \
            httpx.Client(base_url=server.url, timeout=60, trust_env=False) as http:
        scores = post(http, "/score", {"text_1": query, "text_2": docs})["data"]
        ranked = post(http, "/rerank", {"query": query, "documents": docs})["results"]
        classes = post(http, "/classify", {"input": TEXTS})
        raw = post(http, "/score", {"text_1": query, "text_2": docs[0],
                                    "use_activation": False})["data"][0]["score"]
        refused = http.post("/v1/embeddings", json={"input": "x"}).json()["error"]
        card, = http.get("/v1/models").json()["data"]
    for got, expected, doc in zip(scores, want, docs):
        pair = dict(tokenizer(query, doc, return_tensors="pt"))
        assert abs(got["score"] - expected) < 1e-6
        assert abs(got["score"] - float(hf_probs(folder, pair)[0])) < 1e-5
    assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -want[i])
    first = dict(tokenizer(query, docs[0], return_tensors="pt"))
    assert abs(raw - float(hf_probs(folder, first, activation=False)[0])) < 1e-4
    for got, expected in zip(classes["data"], probs):
        assert got["num_classes"] == 1 and got["label"] == "LABEL_0"
        np.testing.assert_allclose(got["probs"], expected, atol=1e-6)
    assert refused["param"] == "model" and "needs an embedding model" in refused["message"]
    assert card["tasks"] == ["classify", "score", "encode"]
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_bfloat16_embedding_server_is_close_to_transformers(folder, tmp_path):
    """Real embedding checkpoints are bfloat16: served in bfloat16 with the default
    attention, within test_pooling's bfloat16 bound of transformers in float32."""
    with running_server(folder, "--dtype", "bfloat16", "--max-model-len", "128",
                        log_dir=tmp_path) as server, \
            openai.OpenAI(base_url=server.api, api_key="x", max_retries=0, timeout=60) as c:
        got = c.embeddings.create(model="tiny", input=TEXTS)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text, data in zip(TEXTS, got.data):
        ids = tokenizer(text)["input_ids"]
        assert cosine_distance(data.embedding, hf_hidden(folder, ids)[-1]) < 1e-3
