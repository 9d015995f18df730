"""Phi-3 / Phi-4 (Phi3ForCausalLM): fused qkv and gate_up projections, partial rotary, the
model's sliding window; scores equal HF's on both backends. LongRoPE is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models import model_family

# microsoft/phi-4's config.json, abridged to what the architecture reads.
PHI4 = dict(architectures=["Phi3ForCausalLM"], vocab_size=100352, hidden_size=5120,
            intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
            num_key_value_heads=10, max_position_embeddings=16384, rms_norm_eps=1e-5,
            rope_theta=250000.0, rope_scaling=None, sliding_window=None,
            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    """A random Phi-3 with 4 query and 2 kv heads of 16, half of each head rotary, and a
    window of 48 tokens."""
    import torch
    import transformers

    from jaxserve.benchmarks import checkpoints

    config = transformers.Phi3Config(
        vocab_size=checkpoints.VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, original_max_position_embeddings=2048,
        partial_rotary_factor=0.5, sliding_window=48, rope_theta=10000.0,
        tie_word_embeddings=False, dtype="float32", **checkpoints.SPECIAL_IDS)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):
                t.copy_(torch.rand(t.shape) + 0.5)
            elif t.dim() == 2:
                t.copy_(torch.randn(t.shape) * 1.5 / t.shape[-1] ** 0.5)
    folder = tmp_path_factory.mktemp("phi3") / "phi3"
    checkpoints._save_model(model, folder, eos_token_id=[checkpoints.EOS_ID])
    for name, data in checkpoints._tokenizer_files():
        (folder / name).write_bytes(data)
    return folder


def test_published_phi4_config():
    arch = model_family(PHI4).arch_from_hf(PHI4)
    assert (arch.head_dim, arch.rotary_dim, arch.num_kv_heads) == (128, 0, 10)
    assert arch.sliding_windows == (None,) * 40 and not arch.tie_word_embeddings
    shapes = model_family(PHI4).param_shapes(arch)
    assert sum(int(np.prod(shape)) for shape, _ in shapes.values()) == 14_659_507_200


def test_partial_rotary_and_longrope():
    arch = model_family(PHI4).arch_from_hf({**PHI4, "partial_rotary_factor": 0.75})
    assert arch.rotary_dim == 96
    longrope = {**PHI4, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                                         "long_factor": [2.0] * 48}}
    with pytest.raises(ValueError, match="RoPE type 'longrope' is not supported"):
        model_family(longrope).arch_from_hf(longrope)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_prompt_logprobs_match_transformers(backend, tiny_phi3, checkpoint_script):
    """Every position's logprob equals HF's (float32) on prompts of 97..200 tokens (past the
    window), prefilled in 64-token chunks over 16-token blocks."""
    from score_helpers import assert_prompt_logprobs_match_hf

    prompts = checkpoint_script.check_prompts()[-3:]
    assert_prompt_logprobs_match_hf(tiny_phi3, prompts, backend=backend)


def test_bfloat16_greedy_stays_close_to_float32(tiny_phi3, checkpoint_script):
    prompts = checkpoint_script.check_prompts()[:6]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(tiny_phi3), dtype=dtype, max_model_len=256, max_num_seqs=8,
                  precompile=False)
        tokens[dtype] = np.array([o.outputs[0].token_ids
                                  for o in llm.generate(prompts, params, use_tqdm=False)])
    assert (tokens["bfloat16"] == tokens["float32"]).mean() >= 0.75
