"""The admission path without a server or a device: the request limits table, the grammar
caps, the sandbox that compiles grammars in another process, JSON inside strings, the
worst-case response size. Every front end calls this path (tests/server/test_server_admission.py
drives the same cases through HTTP and gRPC)."""

from __future__ import annotations

import time
import types

import pytest
from support.fuzz_requests import any_of_text, lark_chain, ref_chain

from jaxserve import SamplingParams
from jaxserve.config.request_limits import DESCRIPTIONS, RequestLimits
from jaxserve.core.sampling_params import StructuredOutputsParams as Structured
from jaxserve.core.structured_output import GrammarCompiler
from jaxserve.engine.admission import InputProcessor
from jaxserve.inputs.tokenizer import load_tokenizer

MAX_LEN = 512


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    return load_tokenizer(str(tiny_checkpoints["llama"]))


def make_processor(tokenizer, **limits) -> InputProcessor:
    model = types.SimpleNamespace(max_model_len=MAX_LEN, vocab_size=len(tokenizer))
    grammars = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return InputProcessor(model, "fcfs", tokenizer, [tokenizer.eos_token_id], grammars,
                          RequestLimits(**limits))


@pytest.fixture(scope="module")
def processor(tokenizer):
    processor = make_processor(tokenizer)
    yield processor
    processor.grammars.close()


def refused(processor, field: str, limit: str | None = None, **params) -> str:
    """check_params refuses SamplingParams(**params) naming field (and the limit)."""
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        processor.check_params(SamplingParams(**params))
    assert time.perf_counter() - start < 1.0, "refused before any expensive work"
    message = str(info.value)
    assert message.startswith(f"{field}:"), message
    assert getattr(info.value, "param", field) == field, info.value.param
    if limit is not None:
        assert f"request limit {limit}" in message, message
    return message


@pytest.mark.parametrize("field, limit, params", [
    ("n", "max_n", dict(n=17, temperature=1.0)),
    ("stop", "max_stop_strings", dict(stop=[f"s{i}" for i in range(17)])),
    ("stop", "max_stop_length", dict(stop=["s" * 257])),
    ("stop_token_ids", "max_stop_token_ids", dict(stop_token_ids=list(range(257)))),
    ("logit_bias", "max_logit_bias", dict(logit_bias={i: 1.0 for i in range(1025)})),
    ("bad_words", "max_bad_words", dict(bad_words=[f"word{i}" for i in range(8000)])),
    ("bad_words", "max_bad_word_length", dict(bad_words=["w" * 257])),
])
def test_each_limit_is_refused_naming_its_field_and_limit(processor, field, limit, params):
    refused(processor, field, limit, **params)


def test_the_limits_table_is_documented_and_refuses_unknown_or_bad_values():
    assert set(DESCRIPTIONS) == {f for f in RequestLimits.__dataclass_fields__}
    assert RequestLimits.parse('{"max_n": 32}').max_n == 32
    assert RequestLimits.parse(None) == RequestLimits()
    with pytest.raises(ValueError, match="unknown names.*max_m"):
        RequestLimits.parse({"max_m": 3})
    with pytest.raises(ValueError, match="max_n must be a positive integer"):
        RequestLimits(max_n=0)
    with pytest.raises(ValueError, match="at most 20"):
        RequestLimits(max_logprobs=21)


def test_raised_limits_let_the_request_through(tokenizer):
    generous = make_processor(tokenizer, max_n=32, max_stop_strings=64)
    generous.check_params(SamplingParams(n=32, temperature=1.0, stop=[f"s{i}" for i in
                                                                        range(64)]))


@pytest.mark.parametrize("name, structured, limit", [
    ("3,000-long $ref chain", Structured(json=ref_chain(3000)), "max_schema_refs"),
    ("900-long $ref chain", Structured(json=ref_chain(900)), "max_schema_depth"),
    ("1,000-deep anyOf as text", Structured(json=any_of_text(1000)), None),
    ("40-deep anyOf", Structured(json=any_of_text(40)), "max_schema_combinator_depth"),
    ("3,000-rule Lark chain", Structured(grammar=lark_chain(3000)), "max_grammar_rules"),
    ("300-rule Lark chain", Structured(grammar=lark_chain(300)), "max_grammar_depth"),
    ("regex repetition bomb", Structured(regex="(c{1000}){1000}"), "max_regex_repetition"),
    ("the bomb in a schema pattern", Structured(json={"type": "string",
                                                      "pattern": "(a{1000}){1000}"}),
     "max_regex_repetition"),
    ("the bomb in a Lark regex", Structured(grammar='start: /(a{1000}){1000}/'),
     "max_regex_repetition"),
    ("the bomb in a Lark %json", Structured(grammar='start: %json ' + str(
        ref_chain(1500)).replace("'", '"')), "max_schema_refs"),
    ("100,000 choices", Structured(choice=[f"option {i}" for i in range(100_000)]),
     "max_choices"),
    ("JSON schema text 5,000 deep", Structured(json="[" * 5000 + "]" * 5000), None),
])
def test_grammar_bombs_are_refused_before_compiling(processor, name, structured, limit):
    message = refused(processor, "structured_outputs", limit, structured_outputs=structured)
    if limit is None:
        assert "deeper than 128" in message


def test_ordinary_constraints_pass_the_caps(processor):
    recursive = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,20}$"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    for structured in (Structured(json=recursive), Structured(regex=r"(\w+\s){0,5000}"),
                       Structured(regex="[a-z]{20000}"), Structured(regex="(ab{10}){100}"),
                       Structured(choice=["yes", "no"]),
                       Structured(grammar='start: expr\nexpr: NUMBER ("+" NUMBER)*\n'
                                          'NUMBER: /[0-9]+/')):
        params = processor.check_params(SamplingParams(structured_outputs=structured))
        assert processor.compile_grammar(params) is not None


def test_a_grammar_that_crashes_the_compiler_is_refused_and_this_process_lives(tokenizer):
    """With the caps lifted, the $ref bomb reaches llguidance: it overflows the stack of the
    sandbox process, which dies instead of this one; the request is refused naming the field
    and later requests compile as usual (the worker is restarted)."""
    lifted = make_processor(tokenizer, max_schema_refs=10**6, max_schema_depth=10**6)
    try:
        params = lifted.check_params(SamplingParams(structured_outputs=Structured(
            json=ref_chain(3000))))
        start = time.perf_counter()
        with pytest.raises(ValueError, match="structured_outputs:.*crashed") as info:
            lifted.compile_grammar(params)
        assert time.perf_counter() - start < 30, "refused within seconds"
        assert "signal" in str(info.value)
        with pytest.raises(ValueError, match="crashed"):  # refused again, from the cache
            lifted.compile_grammar(params)
        fine = lifted.check_params(SamplingParams(structured_outputs=Structured(regex="[0-9]+")))
        assert lifted.compile_grammar(fine) is not None
    finally:
        lifted.grammars.close()


def test_a_grammar_that_compiles_too_long_is_refused_at_the_time_limit(tokenizer):
    lifted = make_processor(tokenizer, max_regex_repetition=10**9, grammar_compile_timeout=0.5)
    try:
        params = lifted.check_params(SamplingParams(structured_outputs=Structured(
            regex="(c{1000}){1000}")))
        start = time.perf_counter()
        with pytest.raises(ValueError, match="longer than 0.5 s.*grammar_compile_timeout"):
            lifted.compile_grammar(params)
        assert time.perf_counter() - start < 10
        fine = lifted.check_params(SamplingParams(structured_outputs=Structured(regex="[ab]+")))
        assert lifted.compile_grammar(fine) is not None
    finally:
        lifted.grammars.close()


def test_the_worst_case_response_size_is_capped(tokenizer):
    small = make_processor(tokenizer, max_response_bytes=2**20)
    ok = small.check_params(SamplingParams(max_tokens=8, logprobs=5))
    small.process("a", None, [5, 6, 7], ok)
    big = small.check_params(SamplingParams(max_tokens=400, n=16, logprobs=20,
                                            temperature=1.0))
    with pytest.raises(ValueError, match="max_response_bytes") as info:
        small.process("b", None, [5, 6, 7], big)
    assert info.value.param == "logprobs"
    with pytest.raises(ValueError, match="max_response_bytes"):  # every prompt counts
        small.check_response_size(ok.clone(max_tokens=100), [10] * 200)


def test_request_ids_and_prompt_counts_are_capped(processor):
    processor.check_request_id("r" * 256)
    with pytest.raises(ValueError, match="request_id:.*max_request_id_length"):
        processor.check_request_id("r" * 257)
    with pytest.raises(ValueError, match="X-Request-Id:"):
        processor.check_request_id("r" * 300, "X-Request-Id")
    with pytest.raises(ValueError, match="prompt:.*max_prompts"):
        processor.check_prompt_count(257)


def test_prompts_and_token_ids_are_checked_against_the_model(processor):
    params = processor.check_params(SamplingParams(max_tokens=4))
    request = processor.process("ok", "text", [5, 6, 7], params)
    assert request.prompt_token_ids == [5, 6, 7] and request.grammar is None
    for ids, match in (([], "must not be empty"), ([5] * MAX_LEN, "shorter than"),
                       ([5, -1], r"\[0, "), ([5, 10**6], r"\[0, "), ([5, "x"], r"\[0, ")):
        with pytest.raises(ValueError, match=match):
            processor.process("bad", None, ids, params)
    with pytest.raises(ValueError, match="stop_token_ids"):
        processor.process("bad", None, [5], params.clone(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        processor.process("bad", None, [5], params, priority=1)


def test_bad_words_are_tokenized_in_linear_time(processor):
    many = processor.check_params(SamplingParams(bad_words=[f"w{i}" for i in range(128)]))
    start = time.perf_counter()
    request = processor.process("words", None, [5, 6], many.clone(
        bad_words=[f"x{i % 9}" for i in range(128)]))  # repeats: each spelling once
    assert time.perf_counter() - start < 1.0
    assert len(request.constraints.bad_sequences) == len(set(request.constraints.bad_sequences))
