"""Every field of vLLM's two request schemas, sent to the server one at a time: each either
has its documented effect or gets a 400 naming it; none is accepted and silently ignored.

The field lists are vLLM 0.33.0's (vllm/entrypoints/openai/completion/protocol.py and
chat_completion/protocol.py, in declaration order). The server runs in-process (the app on
an engine with the priority scheduling policy, a request chat template trusted, two served
names), so that one test module covers every field quickly; on the JAX backend, and on
the torch backend with -m slow.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from starlette.testclient import TestClient
from support.server_helpers import SMALL_ENGINE_ARGS

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.request_limits import RequestLimits
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import ServerConfig, create_app
from jaxserve.server.async_engine import AsyncLLMEngine
from jaxserve.server.openai.options import ChatSettings
from jaxserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest

VLLM_VERSION = "0.33.0"
COMPLETION_FIELDS = [
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "prompt_logprobs",
    "logprob_token_ids", "bad_words", "prompt_embeds", "add_special_tokens", "response_format",
    "structured_outputs", "priority", "request_id", "session_id", "return_tokens_as_token_ids",
    "return_token_ids", "return_weight_versions", "routed_experts_prompt_start",
    "return_token_offsets", "mm_payload", "return_mm_kwargs", "cache_salt",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection",
    "thinking_token_budget", "stream_interval"]
CHAT_FIELDS = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "max_tokens", "max_completion_tokens", "n", "presence_penalty", "response_format", "seed",
    "stop", "stream", "stream_options", "temperature", "top_p", "tools", "tool_choice",
    "reasoning_effort", "thinking_token_budget", "include_reasoning", "parallel_tool_calls",
    "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "prompt_logprobs", "logprob_token_ids",
    "allowed_token_ids", "bad_words", "echo", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "priority", "request_id",
    "session_id", "return_tokens_as_token_ids", "return_token_ids", "return_weight_versions",
    "routed_experts_prompt_start", "return_token_offsets", "return_prompt_text", "mm_payload",
    "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "stream_interval"]
GUIDED = ["guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "guided_decoding_backend", "guided_whitespace_pattern"]
PROMPT = "def fibonacci(n):\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
MESSAGES = [{"role": "user", "content": "Write a function."}]
SHOW = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module",
                params=["jax", pytest.param("torch", marks=pytest.mark.slow)])
def client(tiny_checkpoints, request):
    config = EngineConfig.create(str(tiny_checkpoints["llama"]), dtype="float32", seed=0,
                                 precompile=False, backend=request.param,
                                 scheduling_policy="priority", **SMALL_ENGINE_ARGS)
    async_engine = AsyncLLMEngine(LLMEngine(config))
    async_engine.start()
    server = ServerConfig(served_model_name=("tiny", "alias"),
                          chat=ChatSettings(trust_request_template=True,
                                            default_kwargs={"flag": "server", "other": "x"},
                                            tool_call_parser="hermes"))
    try:
        with TestClient(create_app(async_engine, server)) as test_client:
            yield test_client
    finally:
        async_engine.stop()


class Call:
    """One endpoint: its path, a minimal greedy body, and how to read an answer's text."""

    def __init__(self, client, chat: bool) -> None:
        self.client, self.chat = client, chat
        self.path = "/v1/chat/completions" if chat else "/v1/completions"

    def body(self, **fields) -> dict:
        base = {"model": "tiny", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        base["messages" if self.chat else "prompt"] = MESSAGES if self.chat else PROMPT
        return {**base, **fields}

    def post(self, **fields):
        return self.client.post(self.path, json=self.body(**fields))

    def ok(self, **fields) -> dict:
        resp = self.post(**fields)
        assert resp.status_code == 200, resp.text[:400]
        return resp.json()

    def refused(self, field: str, value) -> None:
        resp = self.post(**{field: value})
        assert resp.status_code == 400, resp.text[:300]
        assert resp.json()["error"]["param"] == field, resp.json()
        assert field in resp.json()["error"]["message"]

    def invalid(self, field: str, value) -> None:
        """A value out of range: a 400 whose param names the field."""
        resp = self.post(**{field: value})
        assert resp.status_code == 400, resp.text[:300]
        assert (resp.json()["error"]["param"] or "").split(".")[0] == field, resp.json()

    def params(self, **fields):
        """The SamplingParams this body becomes (the same translation the server makes)."""
        model = ChatCompletionRequest if self.chat else CompletionRequest
        return model.model_validate(self.body(**fields)).sampling_params()

    def passes(self, field: str, value, attribute: str | None = None) -> None:
        """A sampling field: served, and it reaches SamplingParams (whose effect on the
        tokens is tested in test_llm_api and test_sampler)."""
        self.ok(**{field: value})
        got = getattr(self.params(**{field: value}), attribute or field)
        assert got == value or got == [value], (field, got)

    def text(self, answer: dict, index: int = 0) -> str:
        choice = answer["choices"][index]
        return choice["message"]["content"] if self.chat else choice["text"]

    def stream(self, **fields) -> list[dict]:
        resp = self.post(stream=True, **fields)
        assert resp.status_code == 200, resp.text[:300]
        events = [line[len("data: "):] for line in resp.text.splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]


def _model(c: Call):
    assert c.ok(model="alias")["model"] == "alias"  # a --served-model-name alias
    assert c.ok(model="")["model"] == "tiny"  # vLLM serves its model for an empty name
    resp = c.post(model="other")
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"


def _prompt(c: Call):
    assert c.ok()["usage"]["prompt_tokens"] > 10
    assert c.ok(prompt=[5, 6, 7])["usage"]["prompt_tokens"] == 3


def _messages(c: Call):
    one = c.ok(return_prompt_text=True, chat_template=SHOW)
    assert one["prompt_text"] == "[user]Write a function."


def _echo(c: Call):
    if c.chat:  # vLLM: the last message's content leads the answer when it has its role
        messages = MESSAGES + [{"role": "assistant", "content": "Sure:"}]
        answer = c.ok(messages=messages, echo=True, add_generation_prompt=False,
                      continue_final_message=True)
        assert c.text(answer).startswith("Sure:") and len(c.text(answer)) > len("Sure:")
        return
    assert c.text(c.ok(echo=True)).startswith(PROMPT)
    # echo with max_tokens 0 scores the prompt: its logprobs, no new token
    scored = c.ok(echo=True, max_tokens=0, logprobs=1)
    assert c.text(scored) == PROMPT and scored["usage"]["completion_tokens"] == 0
    logprobs = scored["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == scored["usage"]["prompt_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["token_logprobs"][1] < 0


def _logit_bias(c: Call):
    answer = c.ok(logit_bias={"321": 100}, return_token_ids=True)
    assert answer["choices"][0]["token_ids"] == [321] * 4
    c.invalid("logit_bias", {"x": 1})


def _logprobs(c: Call):
    if c.chat:
        content = c.ok(logprobs=True)["choices"][0]["logprobs"]["content"]
        assert len(content) == 4 and all(entry["logprob"] <= 0 for entry in content)
    else:
        logprobs = c.ok(logprobs=2)["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == 4 and all(len(t) >= 2 for t in
                                                    logprobs["top_logprobs"])


def _top_logprobs(c: Call):
    content = c.ok(logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 3 for entry in content)
    c.invalid("top_logprobs", 99)


def _max_tokens(c: Call):
    assert c.ok(max_tokens=3)["usage"]["completion_tokens"] == 3
    if not c.chat:  # completions default to 16, as OpenAI and vLLM
        body = c.body()
        del body["max_tokens"]
        resp = c.client.post(c.path, json=body)
        assert resp.json()["usage"]["completion_tokens"] == 16


def _max_completion_tokens(c: Call):
    assert c.ok(max_completion_tokens=2)["usage"]["completion_tokens"] == 2


def _n(c: Call):
    assert len(c.ok(n=2, temperature=1.0)["choices"]) == 2


def _seed(c: Call):
    first, again = (c.text(c.ok(seed=7, temperature=1.0)) for _ in range(2))
    assert first == again
    c.invalid("seed", 2**63)


def _stop(c: Call):
    text = c.text(c.ok(max_tokens=12))
    stop = text[2:4] if len(text) >= 4 else text
    answer = c.ok(max_tokens=12, stop=[stop])
    assert stop not in c.text(answer) and answer["choices"][0]["finish_reason"] == "stop"


def _stream(c: Call):
    chunks = c.stream()
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "length"


def _stream_options(c: Call):
    chunks = c.stream(stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    every = c.stream(stream_options={"continuous_usage_stats": True})
    assert all(chunk["usage"]["prompt_tokens"] > 0 for chunk in every if chunk["choices"])
    c.refused("stream_options", {"include_usage": True})  # without stream=true


def _user(c: Call):
    """OpenAI's end-user id, for the operator's abuse monitoring: logged with the request
    id (vLLM ignores it); it changes nothing else."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("jaxserve.server.openai.serving")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        answer = c.ok(user="user-42")
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    assert any("user-42" in r.getMessage() and answer["id"] in r.getMessage() for r in records)


def _refused(value):
    return lambda c, field: c.refused(field, value)


def _sampling(value, attribute=None):
    return lambda c, field: c.passes(field, value, attribute)


def _truncate_prompt_tokens(c: Call):
    answer = c.ok(truncate_prompt_tokens=5, return_token_ids=True)
    assert answer["usage"]["prompt_tokens"] == 5
    c.invalid("truncate_prompt_tokens", -2)


def _truncation_side(c: Call):
    full = c.ok(return_token_ids=True)
    right = c.ok(truncate_prompt_tokens=5, truncation_side="right", return_token_ids=True)
    left = c.ok(truncate_prompt_tokens=5, return_token_ids=True)
    ids = _prompt_ids(c, full)
    assert _prompt_ids(c, right) == ids[:5] and _prompt_ids(c, left) == ids[-5:]


def _prompt_ids(c: Call, answer: dict) -> list[int]:
    return answer["prompt_token_ids"] if c.chat else answer["choices"][0]["prompt_token_ids"]


def _allowed_token_ids(c: Call):
    answer = c.ok(allowed_token_ids=[11, 222], temperature=1.0, return_token_ids=True)
    assert set(answer["choices"][0]["token_ids"]) <= {11, 222}
    c.invalid("allowed_token_ids", [10**7])


def _prompt_logprobs(c: Call):
    answer = c.ok(prompt_logprobs=2)
    prompt_logprobs = answer["prompt_logprobs"] if c.chat else \
        answer["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == answer["usage"]["prompt_tokens"]
    assert prompt_logprobs[0] is None
    assert all(2 <= len(entry) <= 3 for entry in prompt_logprobs[1:])
    entry = next(iter(prompt_logprobs[1].values()))
    assert set(entry) == {"logprob", "rank", "decoded_token"}
    resp = c.post(prompt_logprobs=1, stream=True)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"


def _bad_words(c: Call):
    c.passes("bad_words", ["fibonacci"])


def _add_special_tokens(c: Call):
    tokenizer = c.client.app.state.jaxserve.serving.tokenizer
    with_special = c.ok(add_special_tokens=True)["usage"]["prompt_tokens"]
    without = c.ok(add_special_tokens=False)["usage"]["prompt_tokens"]
    if c.chat:
        extra = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))
        assert with_special == without + extra
    else:
        assert with_special == len(tokenizer.encode(PROMPT))
        assert without == len(tokenizer.encode(PROMPT, add_special_tokens=False))


SMALL_SCHEMA = {"type": "object", "required": ["a"], "additionalProperties": False,
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}}}


def _response_format(c: Call):
    c.ok(response_format={"type": "text"})
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL_SCHEMA,
                                                     "strict": True}}
    answer = c.ok(response_format=schema, temperature=1.0, max_tokens=30)
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(c.text(answer))["a"], int)
    free = c.text(c.ok(response_format={"type": "json_object"}, temperature=1.0))
    assert free.startswith("{")
    c.refused("response_format", {"type": "json_schema"})  # no schema
    c.refused("response_format", {"type": "structural_tag"})


def _structured_outputs(c: Call):
    answer = c.ok(structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}, temperature=1.0,
                  max_tokens=12)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", c.text(answer))
    c.refused("structured_outputs", {"regex": "(unclosed"})
    c.refused("structured_outputs", {"regex": "a", "choice": ["b"]})  # exactly one


def _priority(c: Call):
    c.ok(priority=-3)  # the order is the scheduler's (test_scheduler); fcfs refuses it:
    model = c.client.app.state.jaxserve.engine.engine
    assert model.config.scheduler.policy == "priority"
    c.invalid("priority", 2**63)


def _request_id(c: Call):
    answer = c.ok(request_id="my-request-1")
    assert answer["id"].endswith("-my-request-1")


def _return_tokens_as_token_ids(c: Call):
    if c.chat:
        content = c.ok(logprobs=True, return_tokens_as_token_ids=True)["choices"][0][
            "logprobs"]["content"]
        tokens = [entry["token"] for entry in content]
    else:
        tokens = c.ok(logprobs=1, return_tokens_as_token_ids=True)["choices"][0][
            "logprobs"]["tokens"]
    assert tokens and all(t.startswith("token_id:") for t in tokens)


def _return_token_ids(c: Call):
    answer = c.ok(return_token_ids=True)
    assert len(answer["choices"][0]["token_ids"]) == 4
    assert len(_prompt_ids(c, answer)) == answer["usage"]["prompt_tokens"]
    chunks = c.stream(return_token_ids=True)
    assert sum(len(ch["choices"][0].get("token_ids", [])) for ch in chunks
               if ch["choices"]) == 4


def _mm_payload(c: Call):
    c.ok(mm_payload="none")  # no multimodal data: either value holds
    c.invalid("mm_payload", "pixels")


def _return_mm_kwargs(c: Call):
    c.ok(return_mm_kwargs=False)


def _cache_salt(c: Call):
    long_prompt = PROMPT * 3
    field = "messages" if c.chat else "prompt"
    value = [{"role": "user", "content": long_prompt}] if c.chat else long_prompt
    c.ok(**{field: value, "cache_salt": "tenant-a"})
    same = c.ok(**{field: value, "cache_salt": "tenant-a"})
    other = c.ok(**{field: value, "cache_salt": "tenant-b"})
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    c.refused("cache_salt", "a/b")


def _thinking_token_budget(c: Call):
    c.ok(thinking_token_budget=-1)  # unlimited: the same as unset
    c.refused("thinking_token_budget", 100)


def _stream_interval(c: Call):
    chunks = c.stream(stream_interval=2, max_tokens=7, return_token_ids=True)
    counts = [len(ch["choices"][0]["token_ids"]) for ch in chunks
              if ch["choices"] and "token_ids" in ch["choices"][0]]
    assert sum(counts) == 7 and all(n >= 2 for n in counts[:-1])


TOOL = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "required": ["a", "b"],
                                  "additionalProperties": False,
                                  "properties": {"a": {"type": "integer", "minimum": 0,
                                                       "maximum": 99},
                                                 "b": {"type": "integer", "minimum": 0,
                                                       "maximum": 99}}}}}


def _tools(c: Call):
    answer = c.ok(tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                  temperature=1.0, max_tokens=60)
    call = answer["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "add" and answer["choices"][0]["finish_reason"] == \
        "tool_calls"
    assert set(json.loads(call["function"]["arguments"])) == {"a", "b"}
    c.refused("tools", [])


def _tool_choice(c: Call):
    assert "tool_calls" not in c.ok(tools=[TOOL], tool_choice="none")["choices"][0]["message"]
    named = {"type": "function", "function": {"name": "add"}}
    answer = c.ok(tools=[TOOL], tool_choice=named, temperature=1.0, max_tokens=60)
    call = answer["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "add"
    assert set(json.loads(call["function"]["arguments"])) == {"a", "b"}
    # auto (the server runs --tool-call-parser hermes): the random model writes no call
    auto = c.ok(tools=[TOOL], tool_choice="auto")["choices"][0]["message"]
    assert isinstance(auto["content"], str)
    c.refused("tool_choice", "required")  # without tools
    resp = c.post(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"


def _parallel_tool_calls(c: Call):
    one = c.ok(tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
               temperature=1.0, max_tokens=60, seed=1)
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1
    # Allowed to go on calling, the random model sometimes writes calls until max_tokens:
    # one of a few seeds ends its calls.
    for seed in range(1, 6):
        many = c.ok(tools=[TOOL], tool_choice="required", temperature=1.0, max_tokens=400,
                    seed=seed)
        if many["choices"][0]["finish_reason"] == "tool_calls":
            break
    assert many["choices"][0]["finish_reason"] == "tool_calls"
    assert len(many["choices"][0]["message"]["tool_calls"]) >= 1


def _reasoning_effort(c: Call):
    template = "{{ reasoning_effort }}/{{ enable_thinking }}|" + SHOW
    answer = c.ok(reasoning_effort="low", chat_template=template, return_prompt_text=True)
    assert answer["prompt_text"].startswith("low/True|")


def _include_reasoning(c: Call):
    c.ok(include_reasoning=True)
    c.refused("include_reasoning", False)




def _add_generation_prompt(c: Call):
    opened = c.ok(add_generation_prompt=True)["usage"]["prompt_tokens"]
    closed = c.ok(add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert opened > closed


def _continue_final_message(c: Call):
    messages = MESSAGES + [{"role": "assistant", "content": "Sure, here"}]
    answer = c.ok(messages=messages, continue_final_message=True, add_generation_prompt=False,
                  return_prompt_text=True)
    assert answer["prompt_text"].endswith("Sure, here")
    c.refused("continue_final_message", True)  # the last message is the user's


def _documents(c: Call):
    template = "{% for d in documents %}<{{ d.title }}>{% endfor %}" + SHOW
    answer = c.ok(documents=[{"title": "doc1", "text": "x"}], chat_template=template,
                  return_prompt_text=True)
    assert answer["prompt_text"].startswith("<doc1>")


def _chat_template(c: Call):
    answer = c.ok(chat_template="{{ messages | length }}!" + SHOW, return_prompt_text=True)
    assert answer["prompt_text"] == "1![user]Write a function."


def _chat_template_kwargs(c: Call):
    template = "{{ flag }}/{{ other }}|" + SHOW
    # --default-chat-template-kwargs, then the request's own (which win)
    assert c.ok(chat_template=template, return_prompt_text=True)["prompt_text"].startswith(
        "server/x|")
    answer = c.ok(chat_template=template, chat_template_kwargs={"flag": "on"},
                  return_prompt_text=True)
    assert answer["prompt_text"].startswith("on/x|")
    c.refused("chat_template_kwargs", {"tokenize": True})
    # the typed fields win over the same names in chat_template_kwargs
    assert c.ok(chat_template_kwargs={"add_generation_prompt": False})["usage"][
        "prompt_tokens"] == c.ok()["usage"]["prompt_tokens"]


def _return_prompt_text(c: Call):
    assert "Write a function." in c.ok(return_prompt_text=True)["prompt_text"]
    text = c.ok(return_prompt_text=True, chat_template=SHOW)["prompt_text"]
    assert text == "[user]Write a function."


CASES = {
    "model": _model, "prompt": _prompt, "messages": _messages, "echo": _echo,
    "frequency_penalty": _sampling(1.5), "presence_penalty": _sampling(-1.0),
    "temperature": _sampling(0.5), "top_p": _sampling(0.5), "top_k": _sampling(5),
    "min_p": _sampling(0.1), "repetition_penalty": _sampling(1.3),
    "stop_token_ids": _sampling([7]), "include_stop_str_in_output": _sampling(True),
    "ignore_eos": _sampling(False), "min_tokens": _sampling(2),
    "skip_special_tokens": _sampling(False),
    "spaces_between_special_tokens": _sampling(False),
    "logit_bias": _logit_bias, "logprobs": _logprobs, "top_logprobs": _top_logprobs,
    "max_tokens": _max_tokens, "max_completion_tokens": _max_completion_tokens, "n": _n,
    "seed": _seed, "stop": _stop, "stream": _stream, "stream_options": _stream_options,
    "user": _user, "truncate_prompt_tokens": _truncate_prompt_tokens,
    "truncation_side": _truncation_side, "allowed_token_ids": _allowed_token_ids,
    "prompt_logprobs": _prompt_logprobs, "bad_words": _bad_words,
    "add_special_tokens": _add_special_tokens, "response_format": _response_format,
    "priority": _priority, "request_id": _request_id,
    "return_tokens_as_token_ids": _return_tokens_as_token_ids,
    "return_token_ids": _return_token_ids, "mm_payload": _mm_payload,
    "return_mm_kwargs": _return_mm_kwargs, "cache_salt": _cache_salt,
    "thinking_token_budget": _thinking_token_budget, "stream_interval": _stream_interval,
    "tool_choice": _tool_choice, "reasoning_effort": _reasoning_effort,
    "include_reasoning": _include_reasoning, "parallel_tool_calls": _parallel_tool_calls,
    "add_generation_prompt": _add_generation_prompt,
    "continue_final_message": _continue_final_message, "documents": _documents,
    "chat_template": _chat_template, "chat_template_kwargs": _chat_template_kwargs,
    "return_prompt_text": _return_prompt_text,
    # Features jaxserve does not have (yet): a 400 naming the field.
    "suffix": _refused("x"), "use_beam_search": _refused(True), "watermarking": _refused(True),
    "length_penalty": _refused(2.0), "logprob_token_ids": _refused([1]),
    "prompt_embeds": _refused("AAAA"), "structured_outputs": _structured_outputs,
    "session_id": _refused("s1"), "return_weight_versions": _refused(True),
    "routed_experts_prompt_start": _refused(1), "return_token_offsets": _refused(True),
    "kv_transfer_params": _refused({}), "ec_transfer_params": _refused({}),
    "vllm_xargs": _refused({"k": 1}), "repetition_detection": _refused({"min_count": 2}),
    "tools": _tools,
    "media_io_kwargs": _refused({}), "mm_processor_kwargs": _refused({}),
}


def _run(client, chat: bool, field: str) -> None:
    case = CASES[field]
    call = Call(client, chat)
    if case.__code__.co_argcount == 2:
        case(call, field)
    else:
        case(call)


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_every_completions_field_works_or_is_refused(client, field):
    assert field in CompletionRequest.model_fields
    _run(client, False, field)


@pytest.mark.parametrize("field", CHAT_FIELDS)
def test_every_chat_field_works_or_is_refused(client, field):
    assert field in ChatCompletionRequest.model_fields
    _run(client, True, field)


GUIDED_VALUES = {"guided_json": SMALL_SCHEMA, "guided_regex": "[a-c]{4}",
                 "guided_choice": ["left", "right"],
                 "guided_grammar": 'start: "ab" | "cd" "e"'}


@pytest.mark.parametrize("field", GUIDED)
def test_vllms_older_guided_fields_still_constrain(client, field):
    """vLLM removed these in 0.12 and now ignores them; here they still work."""
    for chat in (False, True):
        c = Call(client, chat)
        if field == "guided_decoding_backend":
            c.ok(guided_decoding_backend="guidance", guided_regex="[a-c]{4}")
            c.refused(field, "xgrammar")
            continue
        if field == "guided_whitespace_pattern":
            text = c.text(c.ok(guided_json=SMALL_SCHEMA, guided_whitespace_pattern=" ?",
                               temperature=1.0, max_tokens=30))
            assert isinstance(json.loads(text)["a"], int)
            continue
        text = c.text(c.ok(**{field: GUIDED_VALUES[field]}, temperature=1.0, max_tokens=30))
        if field == "guided_json":
            assert isinstance(json.loads(text)["a"], int)
        elif field == "guided_regex":
            assert re.fullmatch("[a-c]{4}", text)
        elif field == "guided_choice":
            assert text in ("left", "right")
        else:
            assert text in ("ab", "cde")
        # two structured-output fields at once: a 400 naming one of them
        resp = c.post(**{field: GUIDED_VALUES[field]}, structured_outputs={"regex": "a"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field


def test_message_fields_reach_the_chat_template(client):
    template = ("{% for m in messages %}[{{ m.role }}|{{ m.name }}|{{ m.tool_call_id }}|"
                "{% for t in m.tool_calls or [] %}{{ t.function.name }}({{ t.function.arguments.x"
                " }}){% endfor %}|{{ m.reasoning_content }}]{% endfor %}")
    messages = [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "thinking",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "add", "arguments": "{\"x\": 3}"}}]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"}]
    answer = Call(client, True).ok(messages=messages, chat_template=template,
                                   return_prompt_text=True)
    assert answer["prompt_text"] == "[user|ann|||][assistant|||add(3)|thinking][tool||c1||]"
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]
    resp = Call(client, True).post(messages=bad)
    assert resp.status_code == 400 and "arguments" in resp.json()["error"]["message"]


def test_unknown_fields_are_served_and_logged_once_per_name(client, caplog, monkeypatch):
    from jaxserve.server import schema_base

    monkeypatch.setattr(schema_base, "_logged_unknown", set())  # per process: fresh per client
    with caplog.at_level(logging.WARNING, logger="jaxserve.server.schema_base"):
        for _ in range(2):
            Call(client, False).ok(not_a_vllm_field=1, store=True)
    names = [r.getMessage() for r in caplog.records if "not part of vLLM" in r.getMessage()]
    assert len(names) == 2 and any("not_a_vllm_field" in m for m in names)


def test_cached_tokens_count_a_repeated_prompts_cached_blocks(client):
    call = Call(client, False)
    prompt = "# a prompt no other test sends\n" + PROMPT * 4
    first = call.ok(prompt=prompt)["usage"]
    again = call.ok(prompt=prompt)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    full_blocks = (again["prompt_tokens"] - 1) // 16 * 16  # the last token is always computed
    assert again["prompt_tokens_details"]["cached_tokens"] == full_blocks > 0


def test_a_fcfs_engine_refuses_a_priority():
    from jaxserve.engine.admission import InputProcessor

    model = type("M", (), {"max_model_len": 64, "vocab_size": 100})()
    fcfs = InputProcessor(model, "fcfs", None, (), None, RequestLimits())
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        fcfs.check_priority(3)
    fcfs.check_priority(0)
