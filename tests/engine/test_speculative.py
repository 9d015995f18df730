"""N-gram speculative decoding end to end on the tiny llama: outputs equal plain decoding's
(greedy, and seeded sampling token for token), the sampled distribution is plain sampling's,
stops behave as without speculation, nothing recompiles after warm-up, and the
configuration is vLLM's (`speculative_config` / `--speculative-config`).

Greedy parity with HF transformers under scheduler pressure, for every architecture, is in
test_parity.py; the scheduler's accounting of proposals in test_scheduler.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from support.spec_helpers import KnownContinuations

from jaxserve import LLM, SamplingParams

# The offline tests' shared shape (server_helpers.SMALL_ENGINE_ARGS): the plain engine's
# compiles come from the executable cache.
ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128,
              precompile=False)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llms(tiny_checkpoints):
    folder = str(tiny_checkpoints["llama"])
    return LLM(folder, **ENGINE), LLM(folder, speculative_config=SPEC, **ENGINE)


def repetitive_prompts(count: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(count):
        motif = rng.integers(5, 1000, 4 + i).tolist()
        prompts.append(rng.integers(5, 1000, 3).tolist() + motif * (2 + i % 3))
    return prompts


def tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def stats_delta(llm, before):
    after = llm.engine.stats()
    return (after.spec_draft_tokens - before.spec_draft_tokens,
            after.spec_accepted_tokens - before.spec_accepted_tokens)


def test_greedy_with_ngram_proposals_equals_plain_greedy(llms):
    plain, spec = llms
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = tokens(plain.generate(prompts, params, use_tqdm=False))
    before = spec.engine.stats()
    got = tokens(spec.generate(prompts, params, use_tqdm=False))
    drafted, accepted = stats_delta(spec, before)
    assert drafted > 30, "the repeated motifs should give the n-gram lookup proposals"
    assert got == want


@pytest.mark.parametrize("temperature, top_p, top_k", [
    pytest.param(1.0, 1.0, 0, marks=pytest.mark.slow), (0.8, 0.9, 40)])
def test_seeded_sampling_equals_plain_sampling_token_for_token(llms, monkeypatch, temperature,
                                                               top_p, top_k):
    """Each position is drawn as plain sampling draws it (the request's seed and the
    position), and proposals are kept while they equal the draws: the same tokens, and the
    same logprobs, with and without speculation."""
    plain, spec = llms
    prompts = repetitive_prompts(4)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=7, n=2,
                            max_tokens=40, ignore_eos=True, logprobs=2)
    want = plain.generate(prompts, params, use_tqdm=False)
    # Propose the plain run's own continuation, 30% corrupted: most proposals are kept.
    proposer = KnownContinuations([o.prompt_token_ids + c.token_ids for o in want
                                   for c in o.outputs])
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", proposer)
    before = spec.engine.stats()
    got = spec.generate(prompts, params, use_tqdm=False)
    drafted, accepted = stats_delta(spec, before)
    assert accepted > 100 and drafted - accepted > 30
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs):
            assert gc.text == wc.text
            assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-3)
            for gl, wl in zip(gc.logprobs, wc.logprobs):
                assert gl.keys() == wl.keys()
                assert all(gl[t].logprob == pytest.approx(wl[t].logprob, abs=1e-4) for t in gl)


def test_sampled_distribution_matches_plain_sampling(llms, monkeypatch):
    """Many seeded samples of one prompt (top_k=4 keeps the vocabulary small): the first
    four tokens' frequencies with speculation (seeds 0..799) match plain sampling's (other
    seeds, 1000..1799). The proposals are plain greedy's continuation, kept only when a
    draw matches it. Tolerance: a chi-square test of the two histograms per position
    (tokens seen fewer than 10 times pooled) must not reject equality at p = 0.001."""
    plain, spec = llms
    prompt = repetitive_prompts(1)[0]
    greedy = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True), use_tqdm=False)
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram",
                        KnownContinuations([prompt + greedy[0].outputs[0].token_ids],
                                           corrupt=0.0))
    samples = 800

    def draws(llm, first_seed):
        params = [SamplingParams(temperature=1.0, top_k=4, seed=first_seed + i, max_tokens=4,
                                 ignore_eos=True) for i in range(samples)]
        return np.array(tokens(llm.generate([prompt] * samples, params, use_tqdm=False)))

    base = draws(plain, 1000)
    before = spec.engine.stats()
    fast = draws(spec, 0)
    drafted, accepted = stats_delta(spec, before)
    assert accepted > 150 and drafted - accepted > 80
    for position in range(4):
        assert chi_square_p(base[:, position], fast[:, position]) > 1e-3, f"position {position}"


def chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of a chi-square test that samples a and b come from one distribution."""
    from scipy.stats import chi2_contingency

    ids, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    common = ids[counts >= 10]
    table = [[np.sum(x == t) for t in common] + [np.sum(~np.isin(x, common))] for x in (a, b)]
    table = np.array(table)
    table = table[:, table.sum(axis=0) > 0]
    return float(chi2_contingency(table).pvalue)


def stop_string(text: str, at: float) -> str:
    """Three characters of text from fraction `at` on, without U+FFFD (a partial
    character)."""
    start = int(len(text) * at)
    while "\ufffd" in text[start: start + 3] or len(text[start: start + 3]) < 3:
        start = (start + 1) % max(len(text) - 2, 1)
    return text[start: start + 3]


def test_stops_end_the_output_where_plain_decoding_ends_it(llms, monkeypatch):
    """A stop string, a stop token or EOS inside a step's accepted proposals ends the output
    there: text, tokens, finish and stop reasons are plain decoding's."""
    plain, spec = llms
    prompts = repetitive_prompts(4)
    free = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                  ignore_eos=True), use_tqdm=False)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in free]
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram",
                        KnownContinuations(sequences, corrupt=0.0))
    cases = []
    for o in free:
        out = o.outputs[0]
        cases.append(SamplingParams(temperature=0.0, max_tokens=40,
                                    stop=[stop_string(out.text, 0.5)]))
        cases.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                    stop_token_ids=[out.token_ids[17]]))
        cases.append(SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True,
                                    include_stop_str_in_output=True,
                                    stop=[stop_string(out.text, 0.4)]))
    prompts = [p for p in prompts for _ in range(3)]
    want = plain.generate(prompts, cases, use_tqdm=False)
    got = spec.generate(prompts, cases, use_tqdm=False)
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (w.token_ids, w.text, w.finish_reason, w.stop_reason)
    assert sum(o.outputs[0].finish_reason == "stop" for o in want) >= 8


def test_requests_with_penalties_or_grammars_run_unspeculated_beside_others(llms):
    """Penalties need counts of the tokens before each position, so such a request gets no
    proposals; it shares steps with speculating ones and its output is plain decoding's."""
    plain, spec = llms
    prompts = repetitive_prompts(4)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                             repetition_penalty=1.3 if i % 2 else 1.0) for i in range(4)]
    assert tokens(spec.generate(prompts, params, use_tqdm=False)) == \
        tokens(plain.generate(prompts, params, use_tqdm=False))


def test_no_compilation_after_warm_up(tiny_checkpoints):
    """Proposals fill the same (T, R) buckets as any step: after the warm-up (a small shape,
    so that it compiles little) a speculating workload compiles nothing."""
    llm = LLM(str(tiny_checkpoints["llama"]), speculative_config=SPEC,
              **{**ENGINE, "precompile": True, "max_num_seqs": 2, "max_num_batched_tokens": 16})
    compiled = llm.engine.num_compilations
    before = llm.engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm.generate(repetitive_prompts(6), params, use_tqdm=False)
    assert stats_delta(llm, before)[0] > 0
    assert llm.engine.num_compilations == compiled


def test_speculative_config_forms_and_errors(tiny_checkpoints):
    folder = str(tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(folder, speculative_config={"method": "eagle", "num_speculative_tokens": 2},
            **ENGINE)
    with pytest.raises(TypeError, match="model"):
        LLM(folder, speculative_config={"model": "x", "num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(ValueError, match="speculative_config: .*JAX backend"):
        LLM(folder, speculative_config=SPEC, backend="torch", **ENGINE)


CLI = [sys.executable, "-m", "jaxserve.cli"]
CLI_ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128"]


@pytest.mark.slow  # a generation in a subprocess, ~25 s cold (the suite's time budget)
def test_cli_flag_takes_vllms_json(tiny_checkpoints):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    out = subprocess.run([*CLI, "generate", str(tiny_checkpoints["llama"]), *CLI_ENGINE,
                          "--speculative-config", spec, "--max-tokens", "6", "--ignore-eos",
                          "--json", "def f(x): return f(x)"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["outputs"][0]["token_ids"]) == 6


def test_cli_flag_refuses_a_bad_config(tiny_checkpoints):
    bad = subprocess.run([*CLI, "generate", str(tiny_checkpoints["llama"]), *CLI_ENGINE,
                          "--speculative-config", '{"num_speculative_tokens": 0}', "hi"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "num_speculative_tokens" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_metrics_export_vllms_spec_decode_counters():
    from jaxserve.server.metrics import EngineMetrics

    metrics = EngineMetrics("m", num_speculative_tokens=2)
    for totals in ((0, 0, 0, (0, 0)), (3, 6, 4, (3, 1)), (5, 10, 5, (4, 1))):
        metrics.update_spec_decode(*totals)
    text = metrics.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 10.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} '
            '4.0') in text
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} '
            '1.0') in text
    assert "spec_decode" not in EngineMetrics("n").render().decode()


@pytest.mark.slow  # two more engines to compile (the suite's time budget)
def test_bfloat16_speculation_keeps_plain_decodings_tokens(tiny_checkpoints, monkeypatch,
                                                           checkpoint_script):
    """Real checkpoints are bfloat16. Verifying K+1 positions in one query rounds differently
    from decoding them one by one, so a near-tie may flip (as in any speculative decoder);
    on the check prompts (clear greedy margins) the outputs stay plain decoding's."""
    folder = str(tiny_checkpoints["llama"])
    engine = {**ENGINE, "dtype": "bfloat16"}
    prompts = checkpoint_script.check_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = tokens(LLM(folder, **engine).generate(prompts, params, use_tqdm=False))
    proposer = KnownContinuations([p + w for p, w in zip(prompts, want)])
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", proposer)
    spec = LLM(folder, speculative_config=SPEC, **engine)
    got = tokens(spec.generate(prompts, params, use_tqdm=False))
    assert spec.engine.stats().spec_accepted_tokens > 50
    agree = np.mean([g == w for gs, ws in zip(got, want) for g, w in zip(gs, ws)])
    assert agree >= 0.95, agree
