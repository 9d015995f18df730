"""Gemma 2 and Gemma 3 (text): configs as published and as transformers 5 writes them, and
the models in bfloat16. Greedy parity with HF transformers is in test_parity.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models import model_family

# Published config.json files (abridged to what the architecture reads), written before
# transformers had layer_types and per-layer-type rope_parameters.
GEMMA2_9B = dict(architectures=["Gemma2ForCausalLM"], vocab_size=256000, hidden_size=3584,
                 intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                 query_pre_attn_scalar=256, sliding_window=4096,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 hidden_activation="gelu_pytorch_tanh", attention_bias=False)
GEMMA3_27B_TEXT = dict(architectures=["Gemma3ForCausalLM"], vocab_size=262208,
                       hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                       rope_scaling={"factor": 8.0, "rope_type": "linear"},
                       query_pre_attn_scalar=168, sliding_window=1024,
                       sliding_window_pattern=6, final_logit_softcapping=None,
                       attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh")


def test_published_gemma2_config():
    arch = model_family(GEMMA2_9B).arch_from_hf(GEMMA2_9B)
    # Layer 0 slides, layer 1 attends to everything, and so on.
    assert arch.sliding_windows[:4] == (4096, None, 4096, None)
    assert arch.sliding_windows.count(None) == 21
    assert arch.query_pre_attn_scalar == 256 and arch.head_dim == 256
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (50.0, 30.0)
    assert arch.tie_word_embeddings and not arch.qk_norm and arch.local_rope is None


def test_published_gemma3_config():
    arch = model_family(GEMMA3_27B_TEXT).arch_from_hf(GEMMA3_27B_TEXT)
    windows = arch.sliding_windows
    assert windows[:6] == (1024,) * 5 + (None,) and windows.count(None) == 62 // 6
    assert arch.qk_norm and arch.attn_logit_softcapping is None
    full, local = arch.layer_rope(5), arch.layer_rope(0)
    assert full.rope_theta == 1e6 and dict(full.rope_scaling) == {"factor": 8.0,
                                                                  "rope_type": "linear"}
    assert local.rope_theta == 1e4 and dict(local.rope_scaling) == {"rope_type": "default"}


def test_transformers_5_gemma3_config_matches_the_published_form(tiny_checkpoints):
    import json

    hf = json.loads((tiny_checkpoints["gemma3"] / "config.json").read_text())
    assert "full_attention" in hf["rope_parameters"]  # the per-layer-type form
    arch = model_family(hf).arch_from_hf(hf)
    assert arch.sliding_windows == (48,) * 5 + (None,)
    assert arch.layer_rope(0).rope_theta == 1e4 and arch.layer_rope(5).rope_theta == 1e6
    assert dict(arch.layer_rope(5).rope_scaling)["rope_type"] == "linear"


def test_unsupported_activation_is_refused_by_name():
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        model_family(GEMMA2_9B).arch_from_hf({**GEMMA2_9B, "hidden_activation": "relu"})


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_bfloat16_stays_close_to_float32(arch, tiny_checkpoints, checkpoint_script):
    """Real checkpoints are bfloat16: the bf16 model scores the prompts close to the float32
    one and mostly picks the same first greedy tokens."""
    folder = str(tiny_checkpoints[arch])
    prompts = checkpoint_script.check_prompts()[:6]
    engine = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512,
                  precompile=False)
    scores, tokens = {}, {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(folder, dtype=dtype, **engine)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4,
                                                    ignore_eos=True, prompt_logprobs=0),
                            use_tqdm=False)
        scores[dtype] = np.concatenate([[entry[token].logprob for entry, token in zip(
            o.prompt_logprobs[1:], prompt[1:])] for o, prompt in zip(outs, prompts)])
        tokens[dtype] = np.array([o.outputs[0].token_ids for o in outs])
    assert np.isfinite(scores["bfloat16"]).all()
    assert np.abs(scores["bfloat16"] - scores["float32"]).mean() < 0.2
    assert (tokens["bfloat16"] == tokens["float32"]).mean() >= 0.75


@pytest.mark.parametrize("arch", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_greedy_tokens_do_not_depend_on_the_mesh(arch, tiny_checkpoints):
    """Tensor parallelism: 1x2 splits the 2 kv heads, 1x4 replicates them (8 fake CPU
    devices, in a subprocess); the soft cap and windows go through the sharded attention."""
    from test_mesh import mesh_runs

    runs = mesh_runs(tiny_checkpoints[arch], ["1x1", "1x2", "1x4"])
    assert runs["1x2"]["tokens"] == runs["1x1"]["tokens"] == runs["1x4"]["tokens"]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_prompt_logprobs_match_transformers_past_the_window(arch, tiny_checkpoints,
                                                            checkpoint_script):
    """Every prompt position's logprob equals HF's (float32) on prompts up to 4x the 48-token
    window, prefilled in 64-token chunks over 16-token blocks: the soft caps, the windows
    and the per-layer RoPE bases at every position, not only where greedy tokens differ."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoints[arch]
    prompts = checkpoint_script.check_prompts()[-3:]  # 97, 150 and 200 tokens
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
            want.append(logits[torch.arange(len(prompt) - 1), prompt[1:]].numpy())
    llm = LLM(str(folder), dtype="float32", max_model_len=256, block_size=16,
              max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    for out, prompt, expected in zip(outs, prompts, want):
        got = np.array([entry[token].logprob
                        for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])])
        np.testing.assert_allclose(got, expected, atol=2e-4)
