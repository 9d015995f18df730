"""POST /v1/responses (OpenAI's Responses API) as its clients see it: the official `openai`
client (create, stream, parse, retrieve, delete) and the OpenAI Agents SDK against the
server shared by the HTTP test modules (tiny random-weight llama, served as "tiny").

Greedy text equals /v1/chat/completions' for the same conversation (previous_response_id
included); streamed events are numbered and in OpenAI's order and join up to the
non-streamed answer; forced tool calls and text.format JSON fit their schemas; refusals name
the field. The reasoning and tool-call parsers' items are checked on the event builder
directly (no server started with those flags).
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.parsers.reasoning import reasoning_parser
from jaxserve.parsers.tools import tool_parser
from jaxserve.server.openai.tool_calls import ChoiceTools
from jaxserve.server.responses.output import ResponseBuilder
from jaxserve.server.responses.store import ResponseStore, StoredResponse

R = "/v1/responses"
ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers.",
          "parameters": ADD, "strict": True}]
USER = "Write a function."
GREEDY = dict(model="tiny", temperature=0, max_output_tokens=10)
ENVELOPE_KEYS = {"message", "type", "param", "code"}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(api_server):
    return api_server  # conftest: one server for the HTTP test modules


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.api, api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def chat_text(client, messages, max_tokens=10) -> tuple[str, object]:
    resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                          max_tokens=max_tokens)
    return resp.choices[0].message.content, resp.usage


def strict(value: dict) -> dict:
    """value with the one field the openai package requires that the server leaves out, as
    vLLM does: usage.input_tokens_details.cache_write_tokens (no explicit cache writes)."""
    value = copy.deepcopy(value)
    response = value.get("response", value)
    if isinstance(response, dict) and response.get("usage"):
        response["usage"]["input_tokens_details"].setdefault("cache_write_tokens", 0)
    return value


def sse_events(resp: httpx.Response) -> list[dict]:
    """The data of each SSE event, checked against its `event:` line."""
    events, kind = [], None
    for line in resp.text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
            assert events[-1]["type"] == kind
    return events


def assert_refused(resp: httpx.Response, status: int, param: str) -> None:
    assert resp.status_code == status, resp.text[:400]
    error = resp.json()["error"]
    assert ENVELOPE_KEYS <= set(error) and error["param"] == param, error


# ---- plain and streamed ---------------------------------------------------------------------
def test_greedy_text_equals_chat_completions(client):
    resp = client.responses.create(input=USER, **GREEDY)
    text, usage = chat_text(client, [{"role": "user", "content": USER}])
    assert resp.output_text == text
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    assert resp.status in ("completed", "incomplete")
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert resp.usage.input_tokens == usage.prompt_tokens
    assert resp.usage.output_tokens == usage.completion_tokens
    assert resp.usage.total_tokens == usage.total_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    assert resp.temperature == 0 and resp.max_output_tokens == 10 and resp.tools == []
    # Items with instructions: the same conversation as chat's system + user messages.
    items = [{"role": "user", "content": [{"type": "input_text", "text": USER}]}]
    resp = client.responses.create(input=items, instructions="Be brief.", **GREEDY)
    text, _ = chat_text(client, [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": USER}])
    assert resp.output_text == text and resp.instructions == "Be brief."


def test_max_output_tokens_makes_it_incomplete(client):
    resp = client.responses.create(input=USER, extra_body={"ignore_eos": True},
                                   metadata={"k": "v"}, user="u1", **GREEDY)
    assert resp.status == "incomplete" and resp.usage.output_tokens == 10
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete"
    assert resp.metadata == {"k": "v"} and resp.user == "u1"


def test_streamed_events_are_ordered_and_join_up(client):
    whole = client.responses.create(input=USER, extra_body={"ignore_eos": True}, **GREEDY)
    events = list(client.responses.create(input=USER, stream=True,
                                          extra_body={"ignore_eos": True}, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 10
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_logprobs_are_included_on_request(client):
    resp = client.responses.create(input=USER, include=["message.output_text.logprobs"],
                                   top_logprobs=2, **GREEDY)
    part = resp.output[0].content[0]
    assert len(part.logprobs) == resp.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob == lp.top_logprobs[0].logprob
               for lp in part.logprobs)  # greedy: the chosen token is the likeliest


def test_truncation_and_continued_messages_run_as_chat(client):
    # (test_responses_truncation.py: which items truncation "auto" keeps)
    long = " ".join(f"word{i}" for i in range(400))
    resp = client.responses.create(input=long, truncation="auto", **GREEDY)
    assert 512 - 10 - 32 <= resp.usage.input_tokens <= 512 - 10
    assert resp.truncation == "auto"
    # An assistant message still in progress is continued, not answered.
    items = [{"role": "user", "content": USER},
             {"type": "message", "role": "assistant", "status": "incomplete",
              "content": [{"type": "output_text", "text": "def f(", "annotations": []}]}]
    resp = client.responses.create(input=items, **GREEDY)
    chat = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=10, messages=[
            {"role": "user", "content": USER}, {"role": "assistant", "content": "def f("}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert resp.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("body", [
    {"include": ["message.output_text.logprobs"], "top_logprobs": 2},
    {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
     "temperature": 1.0, "max_output_tokens": 80},
])
def test_objects_and_events_validate_against_the_openai_types(http, body):
    request = {"model": "tiny", "input": USER, "max_output_tokens": 6, **body}
    Response.model_validate(strict(http.post(R, json=request).json()))
    with http.stream("POST", R, json={**request, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        resp.read()
    for event in sse_events(resp):
        STREAM_EVENT.validate_python(strict(event))


# ---- tools and structured output ------------------------------------------------------------
def test_required_and_named_tools_give_calls_that_fit_the_schema(client):
    for choice in ("required", {"type": "function", "name": "add"}):
        resp = client.responses.create(model="tiny", input="Add 2 and 3.", tools=TOOLS,
                                       tool_choice=choice, parallel_tool_calls=False,
                                       temperature=1.0, max_output_tokens=80)
        (call,) = resp.output
        assert call.type == "function_call" and call.name == "add", resp.output
        assert call.status == "completed" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), ADD)
        assert resp.tools[0].name == "add" and resp.status == "completed"
    # The call and its output go back as input items; tool_choice "none" answers in text.
    follow = client.responses.create(
        model="tiny", tools=TOOLS, tool_choice="none", max_output_tokens=4, input=[
            {"role": "user", "content": "Add 2 and 3."}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert follow.output[0].type == "message"


def test_streamed_named_call_joins_up(client):
    events = list(client.responses.create(
        model="tiny", input="Add.", tools=TOOLS, tool_choice={"type": "function", "name": "add"},
        temperature=1.0, max_output_tokens=80, stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    pieces = "".join(e.delta for e in events if e.type ==
                     "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == events[-1].response.output[0].arguments
    jsonschema.validate(json.loads(pieces), ADD)


def test_text_format_json_schema_and_parse(client):
    resp = client.responses.create(
        model="tiny", input="Numbers?", temperature=1.0, max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "add", "schema": ADD, "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), ADD)
    assert resp.text.format.type == "json_schema"
    parsed = client.responses.parse(model="tiny", input="Who?", text_format=Person,
                                    temperature=1.0, max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Person)


# ---- the store ------------------------------------------------------------------------------
def test_store_previous_response_retrieve_delete(client, http):
    first = client.responses.create(input=USER, **GREEDY)
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    second = client.responses.create(input="And now?", previous_response_id=first.id, **GREEDY)
    text, usage = chat_text(client, [{"role": "user", "content": USER},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": "And now?"}])
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix
    assert_refused(http.post(f"{R}/{first.id}/cancel"), 400, "response_id")
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert_refused(http.post(R, json={"model": "tiny", "input": "x",
                                      "previous_response_id": first.id}),
                   404, "previous_response_id")
    unstored = client.responses.create(input=USER, store=False, **GREEDY)
    assert_refused(http.get(f"{R}/{unstored.id}"), 404, "response_id")


def test_the_store_evicts_the_least_recently_used():
    store = ResponseStore(2)
    for name in "abc"[:2]:
        store.put(name, StoredResponse({"id": name}, ()))
    assert store.get("a") is not None  # a is now more recent than b
    store.put("c", StoredResponse({"id": "c"}, ()))
    assert store.get("b") is None and store.get("a") and store.get("c") and store.evicted == 1
    with pytest.raises(ValueError, match="max_stored_responses"):
        ResponseStore(0)


def test_the_store_size_is_a_server_flag(tiny_checkpoints):
    from jaxserve.cli import build_parser
    from jaxserve.cli.serve import server_config
    from jaxserve.server.app import ServerConfig

    args = build_parser().parse_args(["serve", "--model", str(tiny_checkpoints["llama"]),
                                      "--max-stored-responses", "5",
                                      "--max-stored-response-bytes", "64M"])
    assert server_config(args).max_stored_responses == 5
    assert server_config(args).max_stored_response_bytes == 64 * 2**20
    assert ServerConfig().max_stored_responses == 1024
    assert ServerConfig().max_stored_response_bytes == 256 * 2**20
    for name in ("max_stored_responses", "max_stored_response_bytes"):
        with pytest.raises(ValueError, match=name):
            ServerConfig(**{name: 0})


# vLLM's ResponsesRequest (vllm/entrypoints/openai/responses/protocol.py), in its order.
VLLM_RESPONSES_FIELDS = [
    "background", "include", "input", "instructions", "max_output_tokens", "max_tool_calls",
    "metadata", "model", "logit_bias", "parallel_tool_calls", "previous_response_id", "prompt",
    "reasoning", "service_tier", "store", "stream", "temperature", "text", "tool_choice",
    "tools", "top_logprobs", "top_p", "top_k", "truncation", "user", "skip_special_tokens",
    "include_stop_str_in_output", "prompt_cache_key", "request_id", "mm_processor_kwargs",
    "priority", "cache_salt", "enable_response_messages", "previous_input_messages",
    "previous_response", "structured_outputs", "repetition_penalty", "seed", "stop",
    "ignore_eos", "vllm_xargs"]


def test_every_field_of_vllms_schema_is_declared():
    from jaxserve.server.responses.protocol import ResponsesRequest

    assert list(ResponsesRequest.model_fields)[:len(VLLM_RESPONSES_FIELDS)] == \
        VLLM_RESPONSES_FIELDS


# ---- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" needs --tool-call-parser (as chat)
    ({"tool_choice": {"type": "allowed_tools", "tools": []}, "tools": TOOLS}, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 600}, "input"),  # OpenAI's context-length error
    ({"temperature": "hot"}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "string", "pattern": "(a{1000}){1000}"}}}}, "text.format"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input"),
    ({"input": [{"role": "user", "content": "x"}] * 2049}, "input"),  # max_input_items
    ({"tools": [dict(TOOLS[0], name=f"f{i}") for i in range(129)]}, "tools"),  # max_tools
])
def test_bad_fields_get_400_naming_them(http, body, param):
    assert_refused(http.post(R, json={"model": "tiny", "input": "x", **body}), 400, param)


def test_unknown_ids_get_404(client, http):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"
    for method, path in (("GET", f"{R}/resp_nope"), ("DELETE", f"{R}/resp_nope"),
                         ("POST", f"{R}/resp_nope/cancel")):
        assert_refused(http.request(method, path), 404, "response_id")
    assert_refused(http.get(f"{R}/resp_nope", params={"stream": "true"}), 400, "stream")


# ---- the OpenAI Agents SDK ------------------------------------------------------------------
def test_the_agents_sdk_runs_a_turn_with_a_function_tool(server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        function_tool,
    )

    calls = []

    @function_tool
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    async def run():
        client = openai.AsyncOpenAI(base_url=server.api, api_key="x", max_retries=0)
        try:
            agent = Agent(name="adder", instructions="Add the numbers.", tools=[add],
                          model=OpenAIResponsesModel("tiny", openai_client=client),
                          model_settings=ModelSettings(tool_choice="required", temperature=1.0,
                                                       max_tokens=80,
                                                       parallel_tool_calls=False),
                          tool_use_behavior="stop_on_first_tool")
            return await Runner.run(agent, "What is 2 + 3?", max_turns=2,
                                    run_config=RunConfig(tracing_disabled=True))
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1 and all(0 <= x <= 99 for x in calls[0])
    assert result.final_output == str(sum(calls[0]))


# ---- bfloat16, a reasoning parser and auto tool calls, in-process -----------------------------
@pytest.mark.slow
def test_a_bfloat16_server_with_parsers_answers_and_streams(tiny_checkpoints):
    """deepseek_r1: the template opens <think>, so the random model's answer is all
    reasoning (a reasoning item); hermes reads calls under tool_choice "auto"."""
    from starlette.testclient import TestClient
    from support.server_helpers import SMALL_ENGINE_ARGS

    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server.app import ServerConfig, create_app
    from jaxserve.server.async_engine import AsyncLLMEngine
    from jaxserve.server.openai.options import ChatSettings

    config = EngineConfig.create(str(tiny_checkpoints["llama"]), dtype="bfloat16", seed=0,
                                 precompile=False, **SMALL_ENGINE_ARGS)
    engine = AsyncLLMEngine(LLMEngine(config))
    engine.start()
    chat = ChatSettings(reasoning_parser="deepseek_r1", tool_call_parser="hermes")
    try:
        with TestClient(create_app(engine, ServerConfig(served_model_name="tiny",
                                                        chat=chat))) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="x",
                                   http_client=http, max_retries=0)
            args = dict(input=USER, tools=TOOLS, extra_body={"ignore_eos": True}, **GREEDY)
            whole = client.responses.create(**args)
            (item,) = whole.output
            assert item.type == "reasoning" and item.content[0].text
            assert whole.usage.output_tokens_details.reasoning_tokens > 0
            events = list(client.responses.create(stream=True, **args))
            text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
            assert text == item.content[0].text == events[-1].response.output[0].content[0].text
    finally:
        engine.stop()


# ---- the event builder: reasoning and auto tool calls, without a server ---------------------
class _Chars:
    """A tokenizer stand-in: one token per character."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _outputs(text: str, finish: str = "stop"):
    """The cumulative outputs of a text written one character per step."""
    for n in range(1, len(text) + 1):
        done = n == len(text)
        c = CompletionOutput(0, text[:n], list(range(n)), None, None, finish if done else None)
        yield RequestOutput("r", None, [1, 2, 3], None, [c], done)


def _builder(reasoning: str | None, tools: bool) -> ResponseBuilder:
    return ResponseBuilder(
        {"id": "resp_x"}, tools=ChoiceTools("auto", tool_parser("hermes"), None, True)
        if tools else None, reasoning=reasoning_parser(reasoning) if reasoning else None,
        top_logprobs=None, tokenizer=_Chars())


def _shape(items):
    return [(i["type"], i.get("name"), i.get("arguments"), i["status"],
             [p["text"] for p in i.get("content", ())]) for i in items]


@pytest.mark.parametrize("reasoning, text, kinds", [
    ("qwen3", "<think>plan</think>Hi <tool_call>{\"name\": \"add\", \"arguments\": "
     "{\"a\": 1, \"b\": 2}}</tool_call>", ["reasoning", "message", "function_call"]),
    ("deepseek_r1", "thinking that never ends", ["reasoning"]),
    (None, "plain text", ["message"]),
])
def test_streamed_items_join_up_to_the_whole_answer(reasoning, text, kinds):
    streamed = _builder(reasoning, tools=True)
    events = [e for output in _outputs(text) for e in streamed.feed(output)]
    final = streamed.final()
    whole = _builder(reasoning, tools=True).full_response([list(_outputs(text))[-1]])
    assert _shape(final["output"]) == _shape(whole["output"])
    assert [i["type"] for i in final["output"]] == kinds
    for number, event in enumerate(events):
        STREAM_EVENT.validate_python({**event, "sequence_number": number})
    adds = [e for e in events if e["type"] == "response.output_item.added"]
    dones = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["id"] for e in adds] == [e["item"]["id"] for e in dones] == \
        [i["id"] for i in final["output"]]
    for index, item in enumerate(final["output"]):
        deltas = "".join(e["delta"] for e in events if e.get("output_index") == index and
                         e["type"].endswith(".delta"))
        assert deltas == (item.get("arguments") or item["content"][0]["text"])
    if reasoning:
        assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == \
            len(final["output"][0]["content"][0]["text"])


@pytest.mark.parametrize("param, code, blamed", [
    ("structured_outputs", "invalid_value", "text.format"),  # the request's own fault
    (None, "internal_error", None),
])
def test_a_failure_mid_stream_is_an_error_event(param, code, blamed):
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from jaxserve.server.responses.serving import OpenAIResponses

    async def outputs():
        c = CompletionOutput(0, "ab", [1, 2], None, None, None)
        yield RequestOutput("r", None, [1], None, [c], False)
        c = CompletionOutput(0, "ab", [1, 2], None, None, "error")
        yield RequestOutput("r", None, [1], None, [c], True, error="it failed",
                            error_param=param)

    async def collect(api, prepared):
        return [chunk async for chunk in api._stream(_builder(None, False), outputs(),
                                                      prepared)]

    with ThreadPoolExecutor(1) as encoders:
        api = OpenAIResponses(SimpleNamespace(encoders=encoders), ResponseStore(1))
        prepared = SimpleNamespace(body=SimpleNamespace(grammar_field="text.format"),
                                   response_id="resp_x")
        chunks = asyncio.run(collect(api, prepared))
    events = [json.loads(line[6:]) for chunk in chunks for line in chunk.splitlines()
              if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "error"
    assert events[-1]["code"] == code and events[-1]["param"] == blamed


# Keep last: the whole module's log.
def test_the_server_log_has_no_error_lines(server):
    errors = [line for line in server.log().splitlines()
              if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    assert not errors, "\n".join(errors[:20])
