"""Structured outputs on the tiny random-weight model at temperature 1.0 (the hardest case:
the model has no idea of JSON): every output that finished with "stop" satisfies its
schema, regex, choice or grammar, and nearly all finish within their max_tokens; seeded
unconstrained requests do not notice constrained neighbours; nothing recompiles. On the JAX
backend, and on the torch backend with -m slow."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from support.server_helpers import SMALL_ENGINE_ARGS

from jaxserve import LLM, SamplingParams
from jaxserve.core.sampling_params import StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
                                                                          "maxLength": 3},
                                               "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}},
     "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0,
                                                           "maximum": 9},
                                                          {"type": "boolean"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "boolean"},
                                      "b": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["a"], "additionalProperties": False},  # b optional
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {
        "type": "object", "properties": {"ok": {"type": "boolean"},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["ok", "n"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
     "maxItems": 4},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}},
     "required": ["points"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "fixed"},
                                      "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["kind", "ratio"], "additionalProperties": False},
]
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,2}/
"""
MAX_TOKENS = 64


@pytest.fixture(scope="module",
                params=["jax", pytest.param("torch", marks=pytest.mark.slow)])
def llm(tiny_checkpoints, request):
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", seed=0, precompile=True,
               backend=request.param, **SMALL_ENGINE_ARGS)


def _json_requests(count: int):
    prompts, params = [], []
    for i in range(count):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(f"# request {i}\n")
        params.append(SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i,
                                     structured_outputs=StructuredOutputsParams(json=schema)))
    return prompts, params


def _check_json(llm, count: int) -> None:
    prompts, params = _json_requests(count)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stopped = 0
    for i, out in enumerate(outputs):
        choice = out.outputs[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.text), SCHEMAS[i % len(SCHEMAS)])
            stopped += 1
    assert stopped >= 0.9 * count, f"{stopped} of {count} finished within {MAX_TOKENS} tokens"


def test_200_json_requests_over_11_schemas_at_temperature_one(llm):
    _check_json(llm, 200)


def test_regex_choice_and_grammar_outputs_match(llm):
    kinds = [("regex", r"[a-f]{2}-[0-9]{3}"), ("choice", ["alpha", "beta", "gamma delta"]),
             ("grammar", LARK)]
    for kind, value in kinds:
        params = SamplingParams(temperature=1.0, max_tokens=40, seed=7, n=6,
                                structured_outputs=StructuredOutputsParams(**{kind: value}))
        for choice in llm.generate(["x = "], params, use_tqdm=False)[0].outputs:
            assert choice.finish_reason == "stop", (kind, choice.text)
            if kind == "regex":
                assert re.fullmatch(value, choice.text)
            elif kind == "choice":
                assert choice.text in value
            else:
                assert _parses_as_expr(choice.text), choice.text


def _parses_as_expr(text: str) -> bool:
    """The LARK grammar above, checked by hand: terms of 1-2 digits or parenthesised
    expressions, joined by + and -."""
    pattern = re.compile(r"[0-9]{1,2}")
    prev = None
    while prev != text:  # reduce innermost parentheses until none remain
        prev = text
        text = re.sub(r"\(([0-9+\-]*)\)", lambda m: "0" if _flat(m.group(1)) else "!", text)
    return _flat(text) and bool(pattern.search(text))


def _flat(text: str) -> bool:
    return re.fullmatch(r"[0-9]{1,2}([+\-][0-9]{1,2})*", text) is not None


def test_constrained_neighbours_change_nothing_and_nothing_recompiles(llm):
    before = llm.engine.num_compilations
    free = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234,
                          ignore_eos=True)
    alone = llm.generate(["def f(x):"], free, use_tqdm=False)[0].outputs[0].token_ids
    prompts, params = ["def f(x):"], [free]
    json_prompts, json_params = _json_requests(7)
    for p, q in zip(json_prompts, json_params):
        prompts += [p, "import os\n"]
        params += [q, free.clone(seed=None)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone
    assert llm.engine.num_compilations == before


def test_a_bad_constraint_is_refused_naming_the_field(llm):
    for bad in ({"regex": "(unclosed"}, {"json": {"type": "nonsense"}},
                {"grammar": "start: missing_rule"}):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["x"], SamplingParams(structured_outputs=bad), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_a_constraint_can_start_after_a_token(llm):
    """What a reasoning model writes before its end-of-thinking token is free; the
    constraint applies after it (structured_outputs.starts_after)."""
    tokenizer = llm.get_tokenizer()
    marker = next(t for t in ("def", "import", "class")
                  if len(tokenizer.encode(t, add_special_tokens=False)) == 1)
    token = tokenizer.encode(marker, add_special_tokens=False)[0]
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=2, logit_bias={token: 100.0},
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}",
                                                                       starts_after=marker))
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == token and out.finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}", tokenizer.decode(out.token_ids[1:]))
    # already in the prompt after the last opening: the constraint applies at once
    prompt = tokenizer.encode("x = 1\n", add_special_tokens=False) + [token]
    out = llm.generate([prompt], params.clone(logit_bias=None), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", out.text)


def test_a_grammar_over_its_per_step_budget_fails_alone(llm, monkeypatch):
    """Past the structural caps (lifted here), [ab]{30}(c{1000}){1000} compiles within its
    time and survives the sandbox's first tokens, but llguidance's lexer runs out of its
    budget once the output reaches the repetition: that request fails alone, as the
    request's fault (finish_reason "error", error_param structured_outputs); its neighbour's
    tokens are those it gets alone."""
    from jaxserve.config.request_limits import RequestLimits

    monkeypatch.setattr(llm.engine.processor, "limits", RequestLimits(
        max_regex_repetition=10**9, grammar_compile_timeout=60))
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["def f(x):"], free, use_tqdm=False)[0].outputs[0].token_ids
    bomb = SamplingParams(temperature=1.0, max_tokens=200, seed=3,
                          structured_outputs=StructuredOutputsParams(
                              regex="[ab]{30}(c{1000}){1000}"))
    failed, fine = llm.generate(["x = ", "def f(x):"], [bomb, free], use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error", failed.outputs[0]
    assert failed.error_param == "structured_outputs" and "budget" in failed.error
    assert fine.outputs[0].token_ids == alone
