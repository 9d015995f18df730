"""Greedy tokens of HF transformers and of jaxserve on the same prompts, in float32: the
reference and the engine run of models/test_parity.py, shared by the tests that compare
other engine setups (meshes, attention backends, Orbax checkpoints) with transformers."""

from __future__ import annotations

from jaxserve import LLM, SamplingParams

NEW_TOKENS = 32


def hf_greedy(folder, prompts, new_tokens=NEW_TOKENS) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds wake-up latency
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # No EOS at all: like ignore_eos (min_new_tokens would instead mask EOS out of the argmax).
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt in prompts:  # one at a time: no padding in the reference
            ids = torch.tensor([prompt])
            ids = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens,
                                 pad_token_id=model.config.pad_token_id)
            outs.append(ids[0, len(prompt):].tolist())
            assert len(outs[-1]) == new_tokens
    return outs


def run_jaxserve(folder, prompts, new_tokens=NEW_TOKENS,
                 **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(folder), **{"dtype": "float32", "max_model_len": 256, "precompile": False,
                              **engine_args})
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], llm
