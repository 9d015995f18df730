"""The OpenAI-compatible API as its clients see it: the official `openai` client and raw httpx
against a real `jaxserve serve` process (tiny llama checkpoint, served as "tiny"), on both
backends: JAX (the server shared by the HTTP test modules) and `--backend torch` (with
-m slow).

Greedy output equals the offline LLM's; streaming, n/seed, logprobs, echo, stop strings that
span token boundaries, usage, tokenize; every bad request gets a 4xx with the full error
envelope and leaves the server healthy (the server shared by the HTTP test modules); API-key
auth on a second server.
"""

from __future__ import annotations

import json
import pathlib
import random
import re
import time

import httpx
import openai
import pytest
from support.server_helpers import SHARED_READ_TIMEOUT, SMALL_ENGINE_ARGS, running_server

import jaxserve
from jaxserve import LLM, SamplingParams
from jaxserve.inputs.tokenizer import apply_chat_template

C, CH = "/v1/completions", "/v1/chat/completions"
PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Write a function."}]
IGNORE_EOS = {"ignore_eos": True}
NORMAL = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
NORMAL_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENVELOPE_KEYS = {"message", "type", "param", "code"}
LEAK = re.compile(r"Traceback|File \"|\.py\b|site-packages|/(?:root|home|tmp|work|usr)/")
ANY = object()


# ---- fixtures -----------------------------------------------------------------------------
# The torch backend's run of this module is slow-marked (the default suite's budget);
# test_tool_calls.py round-trips the OpenAI client through it by default.
@pytest.fixture(scope="module", params=["jax", pytest.param("torch", marks=pytest.mark.slow)])
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def server(backend, request, tiny_checkpoints, tmp_path_factory):
    if backend == "jax":
        yield request.getfixturevalue("api_server")  # conftest: shared by the HTTP modules
        return
    with running_server(tiny_checkpoints["llama"], "--backend", "torch",
                        "--request-read-timeout", str(SHARED_READ_TIMEOUT), wait_for="/health",
                        log_dir=tmp_path_factory.mktemp("server-api-torch")) as srv:
        yield srv


@pytest.fixture(scope="module")
def auth_server(tiny_checkpoints, tmp_path_factory):
    with running_server(tiny_checkpoints["llama"], "--api-key", "secret", "--api-key", "other",
                        "--served-model-name", "tiny", "tiny-alias",
                        log_dir=tmp_path_factory.mktemp("server-api-auth")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.api, api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(tiny_checkpoints, backend):
    return LLM(str(tiny_checkpoints["llama"]), backend=backend, **SMALL_ENGINE_ARGS)


# ---- helpers ------------------------------------------------------------------------------
def offline(llm, prompt=None, messages=None, max_tokens=24, **kw):
    """The offline engine's greedy output for a prompt (or a chat) as a CompletionOutput."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    if messages is not None:
        return llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    return llm.generate([prompt], params, use_tqdm=False)[0]


def chosen_logprobs(out):
    return [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]


def create(client, chat: bool, **kw):
    if chat:
        return client.chat.completions.create(model="tiny", messages=CHAT, **kw)
    return client.completions.create(model="tiny", prompt=PROMPT, **kw)


def text_of(choice, chat: bool) -> str:
    return choice.message.content if chat else choice.text


def delta_of(choice, chat: bool) -> str:
    return (choice.delta.content or "") if chat else choice.text


def stream_texts(chunks, chat: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + delta_of(choice, chat)
    return texts


def assert_envelope(resp, status, param=ANY):
    assert resp.status_code == status, resp.text[:500]
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert ENVELOPE_KEYS <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    if param is not ANY:
        assert error["param"] == param, error
    assert not LEAK.search(resp.text), resp.text[:500]
    assert len(resp.content) < 1000  # a short excerpt of the input at most
    return error


def assert_healthy(http):
    resp = http.post(C, json=NORMAL)
    assert resp.status_code == 200, resp.text[:500]
    assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")


def spanning_stop(tokenizer, token_ids, text):
    """(stop, cut): a substring of `text` that starts inside one token's text and ends inside
    a later token's text, and the text before its first occurrence."""
    prefixes = [tokenizer.decode(token_ids[:k], skip_special_tokens=True)
                for k in range(len(token_ids) + 1)]
    spans = []  # (start, end) of each token's text, where both ends are whole characters
    for before, after in zip(prefixes, prefixes[1:]):
        if not after.endswith("\ufffd") and text.startswith(after) and after.startswith(before):
            spans.append((len(before), len(after)))
    wide = [(s, e) for s, e in spans if e - s >= 2]
    for (s1, _), (s2, _) in zip(wide, wide[1:]):
        if s1 == 0 or s2 - s1 > 12:
            continue
        stop = text[s1 + 1: s2 + 1]
        if stop.strip() and "\ufffd" not in stop and text.find(stop) == s1 + 1:
            return stop, text[: s1 + 1]
    raise AssertionError(f"no token-spanning stop string found in {text!r}")


# ---- temperature 0: the server equals LLM.generate / LLM.chat ---------------------------
def test_completion_greedy_equals_offline_with_logprobs(client, llm):
    ref = offline(llm, PROMPT, max_tokens=32, logprobs=3).outputs[0]
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32,
                                     temperature=0, logprobs=3)
    choice = resp.choices[0]
    assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    lp = choice.logprobs
    n = len(ref.token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.tokens == [entry[t].decoded_token for t, entry in zip(ref.token_ids, ref.logprobs)]
    assert lp.token_logprobs == pytest.approx(chosen_logprobs(ref), abs=1e-4)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4  # the top 3, plus the chosen token if it is not among them
        assert max(top.values()) == pytest.approx(logprob, abs=1e-6)  # greedy: rank 1
        if "\ufffd" not in token:  # distinct partial-byte tokens share the key "\ufffd"
            assert top[token] == pytest.approx(logprob, abs=1e-6)

    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32,
                                         temperature=0, stream=True)
    assert stream_texts(streamed, chat=False) == {0: ref.text}


def test_completion_token_ids_and_several_prompts_equal_offline(client, llm):
    prompts = ["import os\nimport sys\n", "class Foo:"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    refs = llm.generate(prompts, params, use_tqdm=False)
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=12,
                                     temperature=0, extra_body=IGNORE_EOS)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in refs]
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert resp.usage.completion_tokens == 24

    ids = refs[1].prompt_token_ids
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                       extra_body=IGNORE_EOS)
    assert by_ids.choices[0].text == refs[1].outputs[0].text


def test_chat_greedy_equals_offline_with_logprobs(client, llm):
    ref = offline(llm, messages=CHAT, max_tokens=32, logprobs=3)
    resp = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=32,
                                          temperature=0, logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text and choice.finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    content = choice.logprobs.content
    assert len(content) == len(ref.token_ids)
    assert [e.logprob for e in content] == pytest.approx(chosen_logprobs(ref), abs=1e-4)
    for entry in content:
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert tops[0] == pytest.approx(entry.logprob, abs=1e-6)  # greedy: rank 1

    streamed = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=32,
                                              temperature=0, stream=True)
    assert stream_texts(streamed, chat=True) == {0: ref.text}


def _raw_token_bytes(tokenizer, token_id: int) -> bytes:
    """A byte-level BPE token's bytes (GPT-2's byte <-> printable character table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable}
    byte_of.update({chr(256 + i): b for i, b in enumerate(others)})
    return bytes(byte_of[ch] for ch in tokenizer.convert_ids_to_tokens(token_id))


@pytest.mark.xfail(strict=True, reason="chat logprobs 'bytes' is the UTF-8 of the decoded "
                   "token text, so a partial-UTF-8 token reports EF BF BD (U+FFFD), not its bytes")
def test_chat_logprob_bytes_are_the_tokens_bytes(client, llm):
    ref = offline(llm, messages=CHAT, max_tokens=32, logprobs=0)
    assert any(t.decoded_token == "\ufffd" for t in
               (entry[tid] for tid, entry in zip(ref.token_ids, ref.logprobs)))
    resp = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=32,
                                          temperature=0, logprobs=True, top_logprobs=1)
    tokenizer = llm.get_tokenizer()
    got = [bytes(e.bytes) for e in resp.choices[0].logprobs.content]
    assert got == [_raw_token_bytes(tokenizer, t) for t in ref.token_ids]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_logprobs_without_top_logprobs(client, stream):
    resp = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, stream=stream)
    chunks = list(resp) if stream else [resp]
    entries = [e for c in chunks for ch in c.choices if ch.logprobs
               for e in ch.logprobs.content or []]
    assert len(entries) == 4 and all(e.top_logprobs == [] for e in entries)


# ---- n, seed, streaming shape --------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n2_with_seed_is_reproducible_and_streams_the_same(client, chat):
    kw = dict(n=2, seed=1234, temperature=1.0, max_tokens=12, extra_body=IGNORE_EOS)
    first, again = create(client, chat, **kw), create(client, chat, **kw)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [text_of(c, chat) for c in first.choices]
    assert texts == [text_of(c, chat) for c in again.choices]
    assert texts[0] != texts[1]  # seed + i per sample, not the same draw twice

    chunks = list(create(client, chat, stream=True, **kw))
    assert stream_texts(chunks, chat) == {0: texts[0], 1: texts[1]}
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert sum(c.finish_reason is not None for c in mine) == 1
        assert mine[-1].finish_reason == "length"
        if chat:
            assert mine[0].delta.role == "assistant"


@pytest.mark.parametrize("path", [C, CH], ids=["completions", "chat"])
def test_raw_sse_body_is_data_events_ending_with_done(http, path):
    body = dict(NORMAL_CHAT if path == CH else NORMAL, max_tokens=6, stream=True)
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(event.startswith("data: ") for event in events), events
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    payloads = [json.loads(event[len("data: "):]) for event in events[:-1]]
    assert payloads and all(isinstance(p, dict) and "error" not in p for p in payloads)
    assert all(len(p["choices"]) == 1 for p in payloads)
    assert sum(p["choices"][0]["finish_reason"] is not None for p in payloads) == 1
    kind = "chat.completion.chunk" if path == CH else "text_completion"
    assert {p["object"] for p in payloads} == {kind} and len({p["id"] for p in payloads}) == 1


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_include_usage_adds_one_final_usage_chunk(client, http, chat):
    n, max_tokens = (2, 7) if chat else (1, 9)
    logprobs = dict(logprobs=True, top_logprobs=1) if chat else dict(logprobs=1)
    chunks = list(create(client, chat, n=n, max_tokens=max_tokens, stream=True,
                         stream_options={"include_usage": True}, **logprobs))
    usage_chunks = [c for c in chunks if not c.choices]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    assert all(c.usage is None for c in chunks[:-1])
    usage = usage_chunks[0].usage
    assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    tokenize = {"messages": CHAT} if chat else {"prompt": PROMPT}
    assert usage.prompt_tokens == http.post("/tokenize", json=tokenize).json()["count"]
    generated = 0
    for chunk in chunks[:-1]:
        lp = chunk.choices[0].logprobs
        if lp is not None:
            generated += len(lp.content or []) if chat else len(lp.tokens)
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert len(finishes) == n
    assert usage.completion_tokens == generated
    if set(finishes) == {"length"}:
        assert generated == n * max_tokens


# ---- echo -----------------------------------------------------------------------------------
def test_echo_returns_prompt_first_with_prompt_logprobs(client, http, llm):
    ref = offline(llm, PROMPT, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                      echo=True, extra_body=IGNORE_EOS)
    assert plain.choices[0].text == PROMPT + ref.outputs[0].text
    assert plain.choices[0].logprobs is None

    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                     echo=True, logprobs=2, extra_body=IGNORE_EOS)
    choice = resp.choices[0]
    assert choice.text == PROMPT + ref.outputs[0].text
    num_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert num_prompt == len(ref.prompt_token_ids) == resp.usage.prompt_tokens
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    prompt_ref = [entry[t].logprob for t, entry in
                  zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    assert lp.token_logprobs[1:num_prompt] == pytest.approx(prompt_ref, abs=1e-4)
    assert lp.token_logprobs[num_prompt:] == pytest.approx(chosen_logprobs(ref.outputs[0]),
                                                           abs=1e-4)

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                            temperature=0, echo=True, stream=True,
                                            extra_body=IGNORE_EOS))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert stream_texts(chunks, chat=False) == {0: choice.text}


# ---- a stop string across a token boundary, never streamed ----------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_string_spanning_tokens_is_cut_and_never_streamed(client, llm, chat):
    ref = (offline(llm, messages=CHAT, max_tokens=40, ignore_eos=True) if chat else
           offline(llm, PROMPT, max_tokens=40, ignore_eos=True).outputs[0])
    stop, cut = spanning_stop(llm.get_tokenizer(), ref.token_ids, ref.text)

    resp = create(client, chat, max_tokens=40, temperature=0, stop=[stop], extra_body=IGNORE_EOS)
    assert text_of(resp.choices[0], chat) == cut
    assert resp.choices[0].finish_reason == "stop"

    chunks = list(create(client, chat, max_tokens=40, temperature=0, stop=[stop], stream=True,
                         extra_body=IGNORE_EOS))
    so_far = ""
    for chunk in chunks:
        delta = delta_of(chunk.choices[0], chat)
        assert stop not in delta
        so_far += delta
        assert cut.startswith(so_far), (so_far, cut)  # nothing past the cut, not even stop[0]
    assert so_far == cut
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["stop"]


# ---- tokenize, models, health, CORS -------------------------------------------------------
def test_tokenize_detokenize_round_trip(http, llm):
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"
    tokenizer = llm.get_tokenizer()
    resp = http.post("/tokenize", json={"model": "tiny", "prompt": text})
    assert resp.status_code == 200
    body = resp.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512
    back = http.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]}).json()
    assert back["prompt"].endswith(text)

    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert http.post("/detokenize", json={"tokens": bare["tokens"]}).json()["prompt"] == text

    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == apply_chat_template(tokenizer, CHAT, add_generation_prompt=True)


def test_models_health_ready_version(client, http):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    model = http.get("/v1/models").json()["data"][0]
    assert model["id"] == "tiny" and model["max_model_len"] == 512
    assert http.get("/health").status_code == 200
    wait_until_ready(http)
    version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"] == jaxserve.__version__


def test_no_cors_headers_without_allowed_origins(http):
    origin = {"Origin": "http://evil.example"}
    responses = [
        http.get("/v1/models", headers=origin),
        http.post(C, json=NORMAL, headers=origin),
        http.options(C, headers={**origin, "Access-Control-Request-Method": "POST"}),
    ]
    assert responses[0].status_code == 200 and responses[1].status_code == 200
    for resp in responses:
        assert not [h for h in resp.headers if h.lower().startswith("access-control-")]


# ---- bad input: a 4xx with the full envelope, and the server stays healthy ---------------
def _c(**kw):
    return {**NORMAL, **kw}


def _ch(**kw):
    return {**NORMAL_CHAT, **kw}


BAD = [  # (id, path, JSON body or raw bytes, status, param)
    ("malformed-json", C, b'{"prompt": "hi",', 400, None),
    ("malformed-json-chat", CH, b'{"messages": [', 400, None),
    ("empty-body", C, b"", 400, None),
    ("json-list", C, b'[{"prompt": "hi"}]', 400, None),
    ("json-number", C, b"42", 400, None),
    ("json-null", C, b"null", 400, None),
    ("json-null-chat", CH, b"null", 400, None),
    ("json-string", CH, b'"hi"', 400, None),
    ("missing-prompt", C, {"model": "tiny"}, 400, "prompt"),
    ("missing-messages", CH, {"model": "tiny"}, 400, "messages"),
    ("temperature-str", C, _c(temperature="hot"), 400, "temperature"),
    ("max-tokens-str", C, _c(max_tokens="abc"), 400, "max_tokens"),
    ("n-float", C, _c(n=1.5), 400, "n"),
    ("prompt-number", C, _c(prompt=5), 400, "prompt"),
    ("stop-number", C, _c(stop=5), 400, "stop"),
    ("messages-str", CH, _ch(messages="hi"), 400, "messages"),
    ("message-role", CH, _ch(messages=[{"role": "", "content": "x"}]), 400,
     "messages.0.role"),
    ("message-content-number", CH, _ch(messages=[{"role": "user", "content": 5}]), 400,
     "messages.0.content"),
    ("temperature-neg", C, _c(temperature=-1), 400, "temperature"),
    ("temperature-neg-chat", CH, _ch(temperature=-1), 400, "temperature"),
    ("top-p-0", C, _c(top_p=0), 400, "top_p"),
    ("top-p-1.5", C, _c(top_p=1.5), 400, "top_p"),
    ("n-0", C, _c(n=0), 400, "n"),
    ("n-17", C, _c(n=17), 400, "n"),
    ("n-17-chat", CH, _ch(n=17), 400, "n"),
    ("max-tokens-0", C, _c(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-0-chat", CH, _ch(max_tokens=0), 400, "max_tokens"),
    ("logprobs-21", C, _c(logprobs=21), 400, "logprobs"),
    ("logprobs-neg", C, _c(logprobs=-1), 400, "logprobs"),
    ("top-logprobs-21", CH, _ch(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("presence-penalty-3", C, _c(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty-neg3", C, _c(frequency_penalty=-3), 400, "frequency_penalty"),
    ("min-p-2", C, _c(min_p=2), 400, "min_p"),
    ("top-k-neg5", C, _c(top_k=-5), 400, "top_k"),
    ("repetition-penalty-0", C, _c(repetition_penalty=0), 400, "repetition_penalty"),
    ("min-tokens-over-max", C, _c(min_tokens=5), 400, "min_tokens"),
    ("stop-17-strings", C, _c(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("stop-257-chars", C, _c(stop=["x" * 257]), 400, "stop"),
    ("stop-257-chars-chat", CH, _ch(stop="x" * 257), 400, "stop"),
    ("stop-token-out-of-vocab", C, _c(stop_token_ids=[1024]), 400, "stop_token_ids"),
    ("unknown-model", C, _c(model="gpt-4"), 404, "model"),
    ("unknown-model-chat", CH, _ch(model="gpt-4"), 404, "model"),
    ("prompt-over-context", C, _c(prompt="hello " * 600), 400, "prompt"),
    ("prompt-ids-over-context", C, _c(prompt=[5] * 512), 400, "prompt"),
    ("chat-over-context", CH, _ch(messages=[{"role": "user", "content": "hello " * 600}]), 400,
     "messages"),
    ("empty-messages", CH, _ch(messages=[]), 400, "messages"),
    ("empty-prompt", C, _c(prompt=""), 400, "prompt"),
    ("empty-prompt-in-list", C, _c(prompt=["a", ""]), 400, "prompt"),
    ("empty-prompt-list", C, _c(prompt=[]), 400, "prompt"),
    ("empty-token-ids", C, _c(prompt=[[]]), 400, "prompt"),
    ("token-id-1024", C, _c(prompt=[5, 6, 1024]), 400, "prompt"),
    ("token-id-1024-nested", C, _c(prompt=[[5, 6], [7, 1024]]), 400, "prompt"),
    ("token-id-negative", C, _c(prompt=[-1]), 400, "prompt"),
    ("response-format-no-schema", CH, _ch(response_format={"type": "json_schema"}), 400,
     "response_format"),
    ("response-format-bad-schema", CH, _ch(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), 400, "response_format"),
    ("guided-regex-bad", C, _c(guided_regex="(unclosed"), 400, "guided_regex"),
    ("suffix", C, _c(suffix="return n"), 400, "suffix"),
    ("stream-options-without-stream", C, _c(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("tokenize-wrong-type", "/tokenize", {"prompt": 5}, 400, "prompt"),
    ("tokenize-unknown-model", "/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [5, 1024]}, 400, "tokens"),
    pytest.param("max-completion-tokens-0", CH, _ch(max_tokens=None, max_completion_tokens=0),
                 400, "max_completion_tokens"),
    pytest.param("temperature-nan", C, b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',
                 400, ANY),
    pytest.param("prompt-lone-surrogate", C, b'{"prompt": "hi \\ud800", "max_tokens": 2}',
                 400, ANY),
    pytest.param("chat-lone-surrogate", CH, b'{"messages": [{"role": "user", "content": '
                 b'"hi \\ud800"}], "max_tokens": 2}', 400, ANY),
]


@pytest.mark.parametrize("path, body, param, requested", [
    (C, _c(prompt=[5] * 512), "prompt", None),
    (C, _c(prompt=[5] * 10, max_tokens=600), "prompt", 610),
    (CH, _ch(messages=[{"role": "user", "content": "hello " * 600}]), "messages", None),
    (CH, _ch(max_tokens=600), "messages", None),
])
def test_context_overflow_uses_openais_message(http, path, body, param, requested):
    """Clients and gateways detect an overflow by OpenAI's wording and code; a max_tokens
    that does not fit beside the prompt is refused too, not shortened."""
    resp = http.post(path, json=body)
    assert_envelope(resp, 400, param)
    error = resp.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("This model's maximum context length is 512 tokens.")
    if requested is not None:
        assert f"you requested {requested} tokens" in error["message"]


@pytest.mark.parametrize("name, path, body, status, param", BAD, ids=[
    case.values[0] if hasattr(case, "values") else case[0] for case in BAD])
def test_bad_request_gets_envelope_and_server_stays_healthy(http, name, path, body, status,
                                                            param):
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert resp.status_code != 422
    assert_envelope(resp, status, param)
    assert_healthy(http)


def test_validation_errors_through_the_openai_client(client, http):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):  # rejected before the stream starts
        client.chat.completions.create(model="tiny", messages=CHAT, stream=True, top_p=0)
    assert_healthy(http)


def test_oversized_body_is_413(http):
    body = json.dumps({"model": "tiny", "prompt": "x" * (5 * 1024 * 1024)}).encode()
    resp = http.post(C, content=body, headers={"content-type": "application/json"})
    assert_envelope(resp, 413)
    assert_healthy(http)


def _peak_rss_kib(pid: int) -> int:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1))


def test_oversized_chunked_body_is_413_without_buffering_it(http, server):
    """No Content-Length: the cap must hold while reading, not after buffering it all."""
    if not pathlib.Path(f"/proc/{server.process.pid}/status").exists():
        pytest.skip("needs /proc")
    before = _peak_rss_kib(server.process.pid)

    def chunks():
        for _ in range(2048):  # 128 MiB
            yield b" " * 65536

    resp = http.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert_envelope(resp, 413)
    assert _peak_rss_kib(server.process.pid) - before < 32 * 1024
    assert_healthy(http)


def test_unknown_route_and_method_get_the_envelope(http):
    assert_envelope(http.get("/v1/nothing"), 404)
    assert_envelope(http.get(C), 405)
    assert_healthy(http)


# ---- auth (second server, --api-key secret) --------------------------------------------------
def test_api_key_required_except_on_open_routes(auth_server):
    url = auth_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic secret"},
                    {"Authorization": "secret"}, {"Authorization": "Bearer secret2"}):
        assert_envelope(httpx.post(url + C, json=NORMAL, headers=headers, timeout=30), 401)
        assert_envelope(httpx.get(url + "/v1/models", headers=headers, timeout=30), 401)
        assert_envelope(httpx.post(url + "/tokenize", json={"prompt": "x"}, headers=headers,
                                   timeout=30), 401)
    for path in ("/health", "/ready", "/version", "/metrics"):
        assert httpx.get(url + path, timeout=30).status_code == 200, path
    for key in ("secret", "other"):  # several --api-key values: each is accepted
        good = {"Authorization": f"Bearer {key}"}
        assert httpx.post(url + C, json=NORMAL, headers=good, timeout=30).status_code == 200


def test_openai_client_with_right_and_wrong_key(auth_server):
    with openai.OpenAI(base_url=auth_server.api, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert err.value.status_code == 401
        assert ENVELOPE_KEYS <= set(err.value.body)
    with openai.OpenAI(base_url=auth_server.api, api_key="secret", max_retries=0) as good:
        assert [m.id for m in good.models.list().data] == ["tiny", "tiny-alias"]
        alias = good.completions.create(model="tiny-alias", prompt="hi", max_tokens=2)
        assert alias.model == "tiny-alias"
        resp = good.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
        assert resp.choices[0].finish_reason in ("length", "stop")
        chunks = list(good.completions.create(model="tiny", prompt="hi", max_tokens=3,
                                              stream=True))
        assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


def test_top_k_up_to_int32_means_no_limit_and_beyond_is_refused(auth_server):
    url, good = auth_server.url, {"Authorization": "Bearer secret"}
    resp = httpx.post(url + C, json=_c(top_k=2**31 - 1), headers=good, timeout=30)
    assert resp.status_code == 200, resp.text  # as vLLM: any k >= vocab keeps every token
    for top_k in (2**31, 2**40, 2**63, 2**64):  # more than the device's int32 holds
        resp = httpx.post(url + C, json=_c(top_k=top_k), headers=good, timeout=30)
        assert_envelope(resp, 400, "top_k")
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.post(url + C, json=NORMAL, headers=good, timeout=30).status_code == 200


def test_streamed_text_offsets_continue_across_chunks(client):
    kwargs = dict(model="tiny", prompt="def main():", max_tokens=12, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].logprobs
    streamed = []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.text_offset
    assert streamed == whole.text_offset
    assert whole.text_offset == sorted(whole.text_offset) and whole.text_offset[0] == 0


def wait_until_ready(http, timeout: float = 300.0) -> None:
    """/ready is 503 warming_up while the background warm-up runs, then 200."""
    deadline = time.monotonic() + timeout
    while (resp := http.get("/ready")).status_code != 200:
        assert_envelope(resp, 503)
        assert resp.json()["error"]["code"] == "warming_up"
        assert time.monotonic() < deadline, "the warm-up did not finish"
        time.sleep(0.2)


def metric(http, name: str) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines()
             if line.startswith(name + " ") or line.startswith(name + "{")]
    assert lines, name
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_after_the_warm_up_mixed_requests_compile_nothing(http, backend):
    if backend == "torch":
        pytest.skip("XLA compilation: the torch backend compiles nothing on the CPU")
    wait_until_ready(http)
    assert metric(http, "jaxserve:warm_up_done") == 1
    assert metric(http, "jaxserve:compile_seconds_count") + metric(
        http, "jaxserve:executable_cache_loads_total") >= 11  # 7 step + 4 scoring functions
    before = metric(http, "jaxserve:xla_compilations_total")
    rng = random.Random(5)
    words = "def class return import self value list for while yield".split()
    for i in range(50):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 150)))
        common = dict(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.9]),
                      n=rng.choice([1, 2]), seed=i, stream=i % 4 == 0)
        if i % 2:
            body = dict(model="tiny", messages=[{"role": "user", "content": text}],
                        logprobs=i % 3 == 0, **common)
            resp = http.post(CH, json=body)
        else:
            body = dict(model="tiny", prompt=text, logprobs=2 if i % 3 == 0 else None,
                        echo=i % 10 == 0, top_k=rng.choice([0, 5]), **common)
            resp = http.post(C, json=body)
        assert resp.status_code == 200, resp.text[:300]
    assert metric(http, "jaxserve:xla_compilations_total") == before


# Keep last: the log of everything this module did.
@pytest.mark.parametrize("which", ["server", "auth_server"])
def test_the_server_logs_have_no_error_lines(which, backend, request):
    log = request.getfixturevalue(which).log()
    errors = [line for line in log.splitlines()
              if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    assert not errors, "\n".join(errors[:20])


def test_the_openai_clients_parse_helpers_against_the_server(client):
    """client.chat.completions.parse(response_format=PydanticModel) and a pydantic function
    tool, unchanged, against `jaxserve serve` (temperature 1.0: the grammar does the work)."""
    from pydantic import BaseModel, Field

    class Point(BaseModel):
        x: int = Field(ge=0, le=9)
        label: str = Field(max_length=5)

    parsed = client.chat.completions.parse(model="tiny", messages=CHAT, response_format=Point,
                                           temperature=1.0, max_tokens=40, seed=1)
    assert isinstance(parsed.choices[0].message.parsed, Point)
    tool = openai.pydantic_function_tool(Point, name="plot")
    resp = client.chat.completions.parse(model="tiny", messages=CHAT, tools=[tool],
                                         tool_choice="required", parallel_tool_calls=False,
                                         temperature=1.0, max_tokens=40, seed=2)
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "plot" and isinstance(call.function.parsed_arguments, Point)
    assert resp.choices[0].finish_reason == "tool_calls"
