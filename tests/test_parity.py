"""Greedy token parity with HF transformers on every supported architecture.

Eight prompts of 3..200 tokens run together in one generate() call; the tokens must equal
HF `generate(do_sample=False)` in float32, also when prefill is chunked, blocks are small and
the KV pool is small enough to force preemption.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
PROMPT_LENS = (3, 9, 16, 31, 50, 97, 150, 200)
NEW_TOKENS = 32


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 1024, size=n).tolist() for n in PROMPT_LENS]


def hf_greedy(folder, prompts, new_tokens=NEW_TOKENS) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # No EOS at all: like ignore_eos (min_new_tokens would instead mask EOS out of the argmax).
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt in prompts:  # one at a time: no padding in the reference
            ids = model.generate(torch.tensor([prompt]), do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=0)
            outs.append(ids[0, len(prompt):].tolist())
            assert len(outs[-1]) == new_tokens
    return outs


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoints):
    prompts = make_prompts()
    return prompts, {arch: hf_greedy(tiny_checkpoints[arch], prompts) for arch in ARCHS}


def run_jaxserve(folder, prompts, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(folder), dtype="float32", max_model_len=256, precompile=False, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tiny_checkpoints, hf_reference):
    prompts, expected = hf_reference
    got, _ = run_jaxserve(tiny_checkpoints[arch], prompts, block_size=32,
                          max_num_seqs=8, max_num_batched_tokens=1024)
    assert got == expected[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_with_chunked_prefill_small_blocks_and_preemption(
        arch, tiny_checkpoints, hf_reference):
    prompts, expected = hf_reference
    # 64-token budget: the longer prompts are prefilled in chunks. 40 blocks of 16 tokens
    # cannot hold all eight sequences (they need 8 * ~8 blocks at the end), so the newest
    # running sequence is preempted and recomputed.
    got, llm = run_jaxserve(tiny_checkpoints[arch], prompts, block_size=16, num_kv_blocks=40,
                            max_num_seqs=8, max_num_batched_tokens=64)
    assert llm.engine.num_preemptions > 0
    assert got == expected[arch]
