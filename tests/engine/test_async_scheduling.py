"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's tokens reach
the host, its decode inputs taken from N's sampled tokens on the device. What a user
notices is only that it is faster: every request gets exactly the tokens, text, logprobs and
finish reasons it gets with synchronous scheduling, on the JAX and torch backends, through
stop strings, length limits, aborts, preemption, prefix caching, structured outputs,
penalties, bad words, min_tokens and n > 1.
"""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.engine.outputs import Snapshot

# Few KV blocks: the mixed batch below preempts requests (and recomputes them).
SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, precompile=False,
             dtype="float32", num_gpu_blocks_override=24, block_size=8)
SHARED = "def fibonacci(n):\n    if n < 2:\n        return n\n"


STOP_CASE = ("class A:\n", SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                                           ignore_eos=True))


def _workload(stop: str):
    """Prompts and sampling params that exercise every path a step's inputs depend on;
    `stop` is a stop string the STOP_CASE request meets."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    cases = [
        ("import os\n", greedy),
        (SHARED + "# a", greedy),  # shares its prefix with the next two (prefix caching)
        (SHARED + "# b", SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=24,
                                        ignore_eos=True)),
        (SHARED + "# c", SamplingParams(temperature=0.8, seed=11, max_tokens=30, n=3,
                                        ignore_eos=True)),
        (STOP_CASE[0], STOP_CASE[1].clone(stop=[stop, "@@@"])),
        ("x = [", SamplingParams(temperature=0.7, seed=9, max_tokens=25, logprobs=3,
                                 prompt_logprobs=2, ignore_eos=True)),
        ("for i in", SamplingParams(temperature=1.0, seed=2, max_tokens=24,
                                    presence_penalty=0.5, frequency_penalty=0.3,
                                    repetition_penalty=1.2, ignore_eos=True)),
        ("while True:", SamplingParams(temperature=1.0, seed=4, max_tokens=16, min_tokens=10)),
        ("return", SamplingParams(temperature=1.0, seed=6, max_tokens=20, ignore_eos=True,
                                  bad_words=["self", " None"])),
        ("value = ", SamplingParams(temperature=1.0, seed=8, max_tokens=30,
                                    structured_outputs=StructuredOutputsParams(
                                        regex=r"[0-9]{2,4}-[a-z]{3}"))),
        ("if x:", SamplingParams(temperature=1.0, seed=10, max_tokens=1, ignore_eos=True)),
    ]
    return [p for p, _ in cases], [s for _, s in cases]


def _check_same(got, want):
    """Tokens, text and finish reasons equal; logprobs equal up to float rounding (the two
    modes may batch a request with different neighbours)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == \
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            assert (gc.logprobs is None) == (wc.logprobs is None)
            if gc.logprobs is not None:
                assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, rel=1e-4)
                for ge, we in zip(gc.logprobs, wc.logprobs):
                    assert ge.keys() == we.keys()
                    assert [e.logprob for e in ge.values()] == pytest.approx(
                        [e.logprob for e in we.values()], rel=1e-4, abs=1e-5)
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
        if g.prompt_logprobs is not None:
            assert [e and sorted(e) for e in g.prompt_logprobs] == \
                [e and sorted(e) for e in w.prompt_logprobs]


@pytest.fixture(scope="module", params=["jax", pytest.param("torch", marks=pytest.mark.slow)])
def pair(tiny_checkpoints, request):
    folder = str(tiny_checkpoints["llama"])
    return {mode: LLM(folder, backend=request.param, async_scheduling=mode == "async",
                      **SMALL) for mode in ("async", "sync")}


def test_async_scheduling_is_on_by_default_and_off_with_speculation(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), max_model_len=128, precompile=False)
    assert llm.engine.config.scheduler.async_scheduling
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    llm = LLM(str(tiny_checkpoint), max_model_len=128, precompile=False, speculative_config=spec)
    assert not llm.engine.config.scheduler.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(tiny_checkpoint), max_model_len=128, speculative_config=spec,
            async_scheduling=True)


def test_every_request_gets_the_same_tokens_as_with_synchronous_scheduling(pair):
    # A stop string from the middle of that request's text without one.
    text = pair["sync"].generate([STOP_CASE[0]], STOP_CASE[1], use_tqdm=False)[0].outputs[0].text
    stop = next(text[i: i + 3] for i in range(len(text) // 2, len(text) - 3)
                if "\ufffd" not in text[i: i + 3])
    prompts, params = _workload(stop)
    # Requests whose inputs read their tokens (a grammar, bad words) make steps synchronous
    # while they run: the others also run as a batch of their own, all steps asynchronous.
    plain = [i for i, p in enumerate(params) if p.structured_outputs is None and not p.bad_words]
    alone = {mode: llm.generate([prompts[i] for i in plain], [params[i] for i in plain],
                                use_tqdm=False) for mode, llm in pair.items()}
    _check_same(alone["async"], alone["sync"])
    got = {mode: llm.generate(prompts, params, use_tqdm=False) for mode, llm in pair.items()}
    _check_same(got["async"], got["sync"])
    _check_same([got["async"][i] for i in plain], alone["async"])
    for mode, llm in pair.items():
        stats = llm.engine.stats()
        assert stats.preemptions > 0, f"{mode}: the workload was meant to preempt"
        assert stats.prefix_cache_hits > 0
        assert llm.engine.kv_manager.usage == 0, f"{mode}: blocks leaked"
    reasons = {c.finish_reason for o in got["async"] for c in o.outputs}
    assert reasons == {"stop", "length"}
    stopped = got["async"][4].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert len(got["async"][-1].outputs[0].token_ids) == 1


def test_bfloat16_gives_the_same_tokens_as_synchronous_scheduling(tiny_checkpoint):
    """Real checkpoints are bfloat16: the placeholders fed on the device are the same tokens
    there, through the same mixed workload (preemption included)."""
    llm = LLM(str(tiny_checkpoint), **{**SMALL, "dtype": "bfloat16"})  # one compile of each
    prompts, params = _workload("\n\n")
    got = {}
    for mode in ("sync", "async"):
        llm.engine.async_scheduling = mode == "async"
        llm.engine.reset_prefix_cache()  # both runs compute the same prefixes
        got[mode] = llm.generate(prompts, params, use_tqdm=False)
    _check_same(got["async"], got["sync"])
    assert llm.engine.stats().preemptions > 0, "the workload was meant to preempt"


def test_the_next_step_is_launched_before_the_previous_one_is_fetched(pair):
    engine = pair["async"].engine
    calls = []
    runner = engine.runner
    dispatch, fetch = runner.dispatch, runner.fetch

    def recording_dispatch(out, *args, **kwargs):
        calls.append("dispatch")
        return dispatch(out, *args, **kwargs)

    def recording_fetch(handle):
        calls.append("fetch")
        return fetch(handle)

    runner.dispatch, runner.fetch = recording_dispatch, recording_fetch
    try:
        engine.add_request("r", None, [5, 6, 7, 8], SamplingParams(max_tokens=6,
                                                                  ignore_eos=True))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
    finally:
        del runner.dispatch, runner.fetch
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 6
    # One step per token, and each fetch comes after the next step's dispatch (the device
    # never waits for the host), except the last: its token is the request's last.
    assert calls.count("dispatch") == 6, calls
    fetches = [i for i, c in enumerate(calls) if c == "fetch"]
    assert calls[:4] == ["dispatch", "dispatch", "fetch", "dispatch"], calls
    assert all(calls[i - 1] == "dispatch" for i in fetches[:-1]), calls


def test_an_abort_while_two_steps_are_in_flight_loses_nothing_and_emits_nothing_after(pair):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True)
    prompts = [[5 + i, 40, 41, 42] for i in range(4)]
    finals = {}
    for mode, llm in pair.items():
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{mode}{i}", None, prompt, params)
        seen = {}
        steps = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                seen[output.request_id] = output
            steps += 1
            if steps == 6:
                aborted = engine.abort_request(f"{mode}1")
                assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
                count = len(aborted.outputs[0].token_ids)
        assert len(seen[f"{mode}1"].outputs[0].token_ids) <= count
        assert engine.kv_manager.usage == 0
        finals[mode] = [seen[f"{mode}{i}"].outputs[0].token_ids for i in (0, 2, 3)]
    assert finals["async"] == finals["sync"]


def test_running_outputs_cost_the_same_at_any_length(tiny_checkpoint):
    """Work per step follows the new tokens, not the sequence length: a running request's
    output shares its token array (a Snapshot) instead of copying it, and detokenizing a
    step decodes a bounded window."""
    llm = LLM(str(tiny_checkpoint), max_model_len=512, max_num_seqs=4, precompile=False)
    engine = llm.engine
    decoded = []
    for params in [SamplingParams(max_tokens=400, ignore_eos=True),
                   SamplingParams(max_tokens=400, ignore_eos=True, stop=["@@@"])]:
        engine.add_request(f"long{params.stop}", None, [5, 6, 7], params)
    for tracked in engine._tracked.values():
        for detok in tracked.detokenizers:  # count the tokens each decode call reads
            decode = detok._decode_ids
            detok._decode_ids = lambda ids, decode=decode: decoded.append(len(ids)) or \
                decode(ids)
    lengths = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            choice = output.outputs[0]
            if not output.finished:
                assert isinstance(choice.token_ids, Snapshot)
                lengths.append(len(choice.token_ids))
            else:
                assert isinstance(choice.token_ids, list) and len(choice.token_ids) == 400
    assert max(lengths) > 350
    assert max(decoded) <= 16, "a step decoded more than a short window of tokens"


def test_outputs_nobody_wants_yet_are_skipped_and_the_next_one_carries_everything(pair):
    """The server asks only for the outputs of streams whose reader took the last one
    (step(wanted=...)); a skipped request's next output is cumulative, and its final one
    always comes."""
    engine = pair["async"].engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("slow", None, [5, 6, 7], params)
    engine.add_request("fast", None, [8, 9, 10], params)
    seen = {"slow": [], "fast": []}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for output in engine.step(wanted=lambda rid, n=steps: rid == "fast" or n % 5 == 0):
            seen[output.request_id].append((len(output.outputs[0].token_ids),
                                            output.finished, output.outputs[0].text))
    assert len(seen["slow"]) < len(seen["fast"])
    assert seen["slow"][-1][:2] == (12, True) and seen["fast"][-1][:2] == (12, True)
    lengths = [n for n, _, _ in seen["slow"]]
    assert lengths == sorted(lengths) and all(later - earlier > 1 for earlier, later in
                                               zip(lengths, lengths[1:]))
    greedy = pair["sync"].generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert seen["slow"][-1][2] == greedy.text
