"""Prompt scores against HF transformers: every position's logprob, not only where greedy
tokens differ (test_gemma.py, test_yarn.py, test_phi3.py, test_gpt_oss.py); and a model in
bfloat16 against itself in float32."""

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


def assert_bfloat16_close_to_float32(folder, prompts, **engine_args):
    """Real checkpoints are bfloat16: the bf16 model scores the prompts close to the float32
    one (mean |logprob difference| < 0.2) and picks the same first 4 greedy tokens at 75% of
    the positions or more."""
    engine = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 512,
              "precompile": False, **engine_args}
    scores, tokens = {}, {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(folder), dtype=dtype, **engine)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4,
                                                    ignore_eos=True, prompt_logprobs=0),
                            use_tqdm=False)
        scores[dtype] = np.concatenate([[entry[token].logprob for entry, token in zip(
            o.prompt_logprobs[1:], prompt[1:])] for o, prompt in zip(outs, prompts)])
        tokens[dtype] = np.array([o.outputs[0].token_ids for o in outs])
    assert np.isfinite(scores["bfloat16"]).all()
    assert np.abs(scores["bfloat16"] - scores["float32"]).mean() < 0.2
    assert (tokens["bfloat16"] == tokens["float32"]).mean() >= 0.75
