"""Prompt scores against HF transformers: every position's logprob, not only where greedy
tokens differ (test_gemma.py, test_yarn.py, test_phi3.py)."""

from __future__ import annotations

import numpy as np

from jaxserve import LLM, SamplingParams


def assert_prompt_logprobs_match_hf(folder, prompts, atol: float = 2e-4, **engine_args):
    """Each prompt token's logprob from jaxserve (float32, prompt_logprobs=0; prefilled in
    64-token chunks over 16-token blocks unless engine_args say otherwise) equals HF's
    log_softmax of a full forward within atol. Returns the HF model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
            want.append(logits[torch.arange(len(prompt) - 1), prompt[1:]].numpy())
    llm = LLM(str(folder), **{"dtype": "float32", "max_model_len": 256, "block_size": 16,
                              "max_num_seqs": 4, "max_num_batched_tokens": 64,
                              "precompile": False, **engine_args})
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    for out, prompt, expected in zip(outs, prompts, want):
        got = np.array([entry[token].logprob
                        for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])])
        np.testing.assert_allclose(got, expected, atol=atol)
    return model
