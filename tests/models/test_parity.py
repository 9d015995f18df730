"""Greedy token parity with HF transformers on every supported architecture.

Eight prompts of 3..200 tokens run together in one generate() call; the tokens must equal
HF `generate(do_sample=False)` in float32, also when prefill is chunked, blocks are small and
the KV pool is small enough to force preemption. The prompts are the checkpoint script's
check_prompts(), on which the tiny models' greedy paths have clear top-1/top-2 margins
(> 1.7e-3 relative over 40 tokens), so a parity failure is a real difference, not a near-tie.
Both backends: JAX, and the torch backend (LLM(backend="torch")), once with its Triton kernels
in interpret mode.
"""

from __future__ import annotations

import pytest
from support.parity import hf_greedy, run_jaxserve

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
         "gemma3", "gpt_oss", "deepseek_v3", "deepseek_v2")
JAX_ONLY = ("gpt_oss", "deepseek_v3", "deepseek_v2")  # the torch backend refuses them


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoints, checkpoint_script):
    prompts = checkpoint_script.check_prompts()
    assert sorted(map(len, prompts)) == [3, 7, 16, 33, 60, 97, 150, 200]
    return prompts, {arch: hf_greedy(tiny_checkpoints[arch], prompts) for arch in ARCHS}


# By default llama, mixtral, qwen2 and qwen3; mistral is checked by default under scheduler
# pressure below (a stricter check of the same tokens), the MoE families but mixtral with
# -m slow. Gemma 3 here, Gemma 2 under pressure (soft caps and windows across chunks, pages
# and recomputation).
# DeepSeek's default checks are test_deepseek.py's (tokens and logprobs under pressure).
PLAIN_DEFAULT = ("llama", "mixtral", "qwen2", "qwen3", "gemma3", "gpt_oss")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=[] if a in PLAIN_DEFAULT
                                                else [pytest.mark.slow]) for a in ARCHS])
def test_greedy_matches_transformers(arch, tiny_checkpoints, hf_reference):
    prompts, expected = hf_reference
    got, _ = run_jaxserve(tiny_checkpoints[arch], prompts, block_size=32,
                          max_num_seqs=8, max_num_batched_tokens=1024)
    assert got == expected[arch]


# 64-token budget: the longer prompts are prefilled in chunks. 36 blocks of 16 tokens cannot
# hold the sequences that fit at admission once they grow (7 of them need 39 by the end), so
# the newest running sequence is preempted and later recomputed.
VARIANTS = {
    "chunked-prefill": dict(block_size=32, max_num_batched_tokens=64),
    "block-size-16": dict(block_size=16, max_num_batched_tokens=1024),
    "preemption": dict(block_size=16, num_kv_blocks=36, max_num_batched_tokens=1024),
    "all-three": dict(block_size=16, num_kv_blocks=36, max_num_batched_tokens=64),
}


def variant(name: str, arch: str, backend: str = "jax") -> dict:
    """VARIANTS[name], its KV pool sized for arch: a model whose sliding-window layers hold
    only their window (config/kv_groups.py) needs fewer blocks for the same sequences, so
    the pool that makes the others preempt would not make it; and a hybrid model's blocks
    each hold one group's layers, so it needs more of them to hold one sequence at all."""
    engine = dict(VARIANTS[name])
    if "num_kv_blocks" in engine:
        hybrid = backend == "jax" and arch in HYBRID_BLOCKS
        engine["num_kv_blocks"] = HYBRID_BLOCKS[arch] if hybrid else WINDOW_BLOCKS.get(arch, 36)
    return engine


# Pools that hold one sequence of max_model_len yet make the eight sequences preempt.
WINDOW_BLOCKS = {"mistral": 30}  # a 96-token window on every layer, on either backend
HYBRID_BLOCKS = {"gemma2": 60, "gemma3": 130, "gpt_oss": 60}  # 2, 6 and 2 KV groups


# By default "all-three" (chunked prefill, preemption and block size 16 at once) runs on
# llama (llama3 RoPE) and mistral (sliding window across chunks and pages); qwen2 and qwen3
# differ from llama in their layers, not in how a step is scheduled (plain parity above, and
# under all three pressures on the torch backend below). The other families, and the single
# variants, which tell which one broke, run with -m slow (the suite's time budget on cold
# compilation caches; the MoE defaults are in test_moe.py and test_mesh.py).
DEFAULT_PRESSURE = {arch: ("all-three",) for arch in ("llama", "mistral", "gemma2", "gpt_oss")}
PRESSURE_CASES = [
    pytest.param(arch, variant, marks=[] if variant in DEFAULT_PRESSURE.get(arch, ())
                 else [pytest.mark.slow])
    for arch in ARCHS for variant in VARIANTS
]


@pytest.mark.parametrize("arch,variant_name", PRESSURE_CASES)
def test_greedy_matches_under_scheduler_pressure(arch, variant_name, tiny_checkpoints,
                                                 hf_reference):
    prompts, expected = hf_reference
    got, llm = run_jaxserve(tiny_checkpoints[arch], prompts, max_num_seqs=8,
                            **variant(variant_name, arch))
    if "num_kv_blocks" in VARIANTS[variant_name]:
        assert llm.engine.num_preemptions > 0
    assert got == expected[arch]


# ---- speculative decoding: proposals verified in the step, under all three pressures (and
# prefix caching, on by default). The proposer knows HF's continuation and corrupts 30% of
# its proposals, so every step keeps some and rejects others (test_speculative.py runs the
# real n-gram lookup). All with -m slow (the suite's time budget); by default
# test_speculative.py checks speculative greedy and sampled outputs against plain decoding.
SPEC_DEFAULT = ()


@pytest.mark.parametrize("arch", [pytest.param(a, marks=[] if a in SPEC_DEFAULT
                                                else [pytest.mark.slow]) for a in ARCHS])
def test_speculative_greedy_matches_transformers(arch, tiny_checkpoints, hf_reference,
                                                 monkeypatch):
    from support.spec_helpers import KnownContinuations

    prompts, expected = hf_reference
    proposer = KnownContinuations([p + e for p, e in zip(prompts, expected[arch])])
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", proposer)
    got, llm = run_jaxserve(tiny_checkpoints[arch], prompts, max_num_seqs=8,
                            speculative_config={"num_speculative_tokens": 4},
                            **variant("all-three", arch))
    stats = llm.engine.stats()
    assert llm.engine.num_preemptions > 0
    assert stats.spec_accepted_tokens > 20
    assert stats.spec_draft_tokens - stats.spec_accepted_tokens > 20
    assert got == expected[arch]


# ---- the torch backend (LLM(backend="torch"): torch models, the PyTorch reference attention
# on the CPU) against the same HF tokens. Default: the dense families plainly and under all
# three pressures at once; the MoE families with -m slow; GPT-OSS and DeepSeek run on JAX only.
TORCH_DEFAULT = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
TORCH_CASES = [pytest.param(arch, marks=[] if arch in TORCH_DEFAULT else [pytest.mark.slow])
               for arch in ARCHS if arch not in JAX_ONLY]


@pytest.mark.parametrize("arch", TORCH_CASES)
def test_torch_backend_greedy_matches_transformers(arch, tiny_checkpoints, hf_reference):
    prompts, expected = hf_reference
    got, _ = run_jaxserve(tiny_checkpoints[arch], prompts, backend="torch", block_size=32,
                          max_num_seqs=8, max_num_batched_tokens=1024)
    assert got == expected[arch]


@pytest.mark.parametrize("arch", TORCH_CASES)
def test_torch_backend_matches_under_scheduler_pressure(arch, tiny_checkpoints, hf_reference):
    prompts, expected = hf_reference
    got, llm = run_jaxserve(tiny_checkpoints[arch], prompts, backend="torch", max_num_seqs=8,
                            **variant("all-three", arch, "torch"))
    assert llm.engine.num_preemptions > 0
    assert got == expected[arch]


@pytest.mark.slow
def test_torch_backend_with_the_triton_kernels_end_to_end(tiny_checkpoints, hf_reference):
    """attention_backend="triton-interpret": the Triton attention and KV-write kernels (in
    interpret mode on the CPU) carry a whole generation, with chunked prefill, preemption and
    block size 16."""
    prompts, expected = hf_reference
    got, llm = run_jaxserve(tiny_checkpoints["llama"], prompts, backend="torch",
                            attention_backend="triton-interpret", max_num_seqs=8,
                            **VARIANTS["all-three"])
    assert llm.engine.num_preemptions > 0
    assert got == expected["llama"]


def test_torch_backend_with_the_triton_kernels_under_pressure(tiny_checkpoints, hf_reference):
    """The same in the default suite's budget: three of the prompts (33-97 tokens), 12 new
    tokens each (HF's greedy prefix), 32-token steps (chunked prefill), 16 blocks of 16
    tokens (preemption)."""
    prompts, expected = hf_reference
    chosen = [i for i, p in enumerate(prompts) if 30 <= len(p) <= 100]
    assert len(chosen) == 3
    got, llm = run_jaxserve(tiny_checkpoints["llama"], [prompts[i] for i in chosen],
                            new_tokens=12, backend="torch",
                            attention_backend="triton-interpret", max_num_seqs=8,
                            block_size=16, num_kv_blocks=10, max_num_batched_tokens=32,
                            max_model_len=128)
    assert llm.engine.num_preemptions > 0
    assert got == [expected["llama"][i][:12] for i in chosen]
