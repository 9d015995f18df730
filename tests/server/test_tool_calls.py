"""Tool calling and structured outputs through the OpenAI client, against the server app
in-process (the tiny random-weight model, temperature 1.0): tool_choice "required" and a
named function always give arguments that fit the function's schema, streamed or not, and
the streamed deltas join up to the non-streamed answer; the client's parse() helpers work
unchanged. On both backends (JAX and torch)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from starlette.testclient import TestClient
from support.server_helpers import SMALL_ENGINE_ARGS

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import ServerConfig, create_app
from jaxserve.server.async_engine import AsyncLLMEngine
from jaxserve.server.openai.options import ChatSettings

WEATHER = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["c", "f"]}}}
ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["jax", "torch"])
def client(tiny_checkpoints, request):
    config = EngineConfig.create(str(tiny_checkpoints["llama"]), dtype="float32", seed=0,
                                 precompile=False, backend=request.param, **SMALL_ENGINE_ARGS)
    async_engine = AsyncLLMEngine(LLMEngine(config))
    async_engine.start()
    app = create_app(async_engine, ServerConfig(served_model_name="tiny",
                                                chat=ChatSettings(tool_call_parser="hermes")))
    try:
        with TestClient(app) as http:
            yield openai.OpenAI(base_url="http://testserver/v1", api_key="x",
                                http_client=http, max_retries=0)
    finally:
        async_engine.stop()


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_always_fit_the_schema(client, choice):
    tool_choice = ({"type": "function", "function": {"name": "get_weather"}}
                   if choice == "named" else "required")
    for seed in range(20):
        resp = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=False, temperature=1.0, max_tokens=80, seed=seed)
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == ("stop" if choice == "named" else "tool_calls")
        assert message.content is None
        for name, arguments in _calls(message):
            assert choice == "required" or name == "get_weather"
            jsonschema.validate(arguments, SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_tool_calls_join_up_to_the_non_streamed_answer(client, choice):
    tool_choice = ({"type": "function", "function": {"name": "add"}}
                   if choice == "named" else "required")
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                temperature=1.0, max_tokens=200, seed=11)
    whole = client.chat.completions.create(**args).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice_delta in chunk.choices:
            finish = choice_delta.finish_reason or finish
            for delta in choice_delta.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None,
                                                      "arguments": ""})
                if delta.id:
                    assert call["id"] is None, "the id comes once"
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    assert call["name"] is None, "the name comes once"
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert streamed and streamed == _calls(whole.message) and finish == whole.finish_reason
    for name, arguments in streamed:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(c["id"] for c in calls.values())


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


class Add(BaseModel):
    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


def test_the_openai_clients_parse_helpers_work_unchanged(client):
    for seed in range(5):
        parsed = client.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=Person, temperature=1.0,
            max_tokens=60, seed=seed).choices[0].message.parsed
        assert isinstance(parsed, Person)
    resp = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(Add)],
        tool_choice="required", parallel_tool_calls=False, temperature=1.0, max_tokens=60)
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "Add" and isinstance(call.function.parsed_arguments, Add)


def test_auto_tool_choice_reads_calls_with_the_servers_parser(client):
    """The random model writes no <tool_call>: the text comes back as content; a template
    that shows the tools gets them."""
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                          max_tokens=8)
    assert resp.choices[0].message.tool_calls in (None, [])
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_a_reasoning_parser_moves_the_thinking_out_of_the_answer(client):
    """deepseek_r1: the template opens <think>, so what the model writes before </think>
    is reasoning (the random model never closes it: all of it), streamed the same."""
    engine = client._client._transport.app.state.jaxserve.engine  # the module's engine
    app = create_app(engine, ServerConfig(served_model_name="tiny",
                                          chat=ChatSettings(reasoning_parser="deepseek_r1")))
    with TestClient(app) as http:
        reasoning = openai.OpenAI(base_url="http://testserver/v1", api_key="x",
                                  http_client=http, max_retries=0)
        args = dict(model="tiny", messages=MESSAGES, max_tokens=12, seed=3, temperature=1.0,
                    extra_body={"ignore_eos": True})
        message = reasoning.chat.completions.create(**args).choices[0].message
        text = message.model_extra["reasoning_content"]
        assert message.content is None and text and message.model_extra["reasoning"] == text
        pieces = [c.choices[0].delta.model_extra.get("reasoning_content") or ""
                  for c in reasoning.chat.completions.create(stream=True, **args) if c.choices]
        assert "".join(pieces) == text
        hidden = reasoning.chat.completions.create(
            **{**args, "extra_body": {"ignore_eos": True, "include_reasoning": False}})
        assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})
