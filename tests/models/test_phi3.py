"""Phi-3 / Phi-4 (Phi3ForCausalLM): fused qkv and gate_up projections, partial rotary, the
model's sliding window, LongRoPE's short and long factors; scores equal HF's on both
backends."""

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


def _tiny_phi3(folder, **overrides):
    """A random Phi-3 with 4 query and 2 kv heads of 16, half of each head rotary, and a
    window of 48 tokens."""
    import torch
    import transformers

    from jaxserve.benchmarks import checkpoints

    config = transformers.Phi3Config(**{
        "vocab_size": checkpoints.VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "original_max_position_embeddings": 2048,
        "partial_rotary_factor": 0.5, "sliding_window": 48, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "dtype": "float32", **checkpoints.SPECIAL_IDS,
        **overrides})
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):
                t.copy_(torch.rand(t.shape) + 0.5)
            elif t.dim() == 2:
                t.copy_(torch.randn(t.shape) * 1.5 / t.shape[-1] ** 0.5)
    checkpoints._save_model(model, folder, eos_token_id=[checkpoints.EOS_ID])
    for name, data in checkpoints._tokenizer_files():
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    return _tiny_phi3(tmp_path_factory.mktemp("phi3") / "phi3")


# Phi-3.5-mini's shape of LongRoPE, scaled down: trained on 96 positions, extended to 256;
# one factor per rotary frequency (4 of the 8 rotary dims), the long ones larger.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6],
            "long_factor": [1.1, 2.5, 6.0, 11.0]}


@pytest.fixture(scope="module")
def tiny_longrope(tmp_path_factory):
    return _tiny_phi3(tmp_path_factory.mktemp("longrope") / "phi3",
                      max_position_embeddings=256, original_max_position_embeddings=96,
                      rope_scaling=dict(LONGROPE))


def test_published_phi4_config():
    arch = model_family(PHI4).arch_from_hf(PHI4)
    assert (arch.head_dim, arch.rotary_dim, arch.num_kv_heads) == (128, 0, 10)
    assert arch.sliding_windows == (None,) * 40 and not arch.tie_word_embeddings
    shapes = model_family(PHI4).param_shapes(arch)
    assert sum(int(np.prod(shape)) for shape, _ in shapes.values()) == 14_659_507_200


def test_partial_rotary_and_longrope():
    from jaxserve.models.llama_arch import (
        rope_attention_factor,
        rope_inv_freq,
        with_max_model_len,
    )

    arch = model_family(PHI4).arch_from_hf({**PHI4, "partial_rotary_factor": 0.75})
    assert arch.rotary_dim == 96
    # microsoft/Phi-4-mini-instruct's rope: 48 factors for its 96 rotary dims, 4096 -> 131072.
    mini = {**PHI4, "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                             "long_factor": [2.0] * 48}}
    arch = model_family(mini).arch_from_hf(mini)
    assert rope_attention_factor(arch) == pytest.approx((1 + np.log(32) / np.log(4096)) ** 0.5)
    short = rope_inv_freq(with_max_model_len(arch, 4096))
    long = rope_inv_freq(with_max_model_len(arch, 4097))
    np.testing.assert_allclose(long, short / 2, rtol=1e-6)
    np.testing.assert_array_equal(rope_inv_freq(arch), long)  # the config's own length
    for bad in ({"long_factor": [2.0] * 47}, {"short_factor": None}):
        config = {**mini, "rope_scaling": {**mini["rope_scaling"], **bad}}
        with pytest.raises(ValueError, match="must list 48 numbers"):
            model_family(config).arch_from_hf(config)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_longrope_scores_match_transformers_on_both_sides(backend, tiny_longrope,
                                                          checkpoint_script):
    """An engine whose max_model_len stays within original_max_position_embeddings (96)
    uses the short factors, and scores prompts of 16..60 tokens as HF does; one of
    max_model_len 256 uses the long factors, and scores prompts of 97..200 tokens (past 96,
    where HF switches to them) as HF does."""
    from support.score_helpers import assert_prompt_logprobs_match_hf

    prompts = checkpoint_script.check_prompts()
    assert_prompt_logprobs_match_hf(tiny_longrope, prompts[2:5], backend=backend,
                                    max_model_len=96)
    assert_prompt_logprobs_match_hf(tiny_longrope, prompts[-3:], backend=backend,
                                    max_model_len=256)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_prompt_logprobs_match_transformers(backend, tiny_phi3, checkpoint_script):
    """Every position's logprob equals HF's (float32) on prompts of 97..200 tokens (past the
    window), prefilled in 64-token chunks over 16-token blocks."""
    from support.score_helpers import assert_prompt_logprobs_match_hf

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


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["tiny_phi3", "tiny_longrope"])
def test_greedy_tokens_do_not_depend_on_the_mesh(folder, request):
    """The fused qkv and gate_up tensors split into sharded parameters, partial rotary and
    LongRoPE on meshes: 1x2 splits the 2 kv heads, 1x4 replicates them (8 fake CPU
    devices, in a subprocess)."""
    from support.mesh import mesh_runs

    runs = mesh_runs(request.getfixturevalue(folder), ["1x1", "1x2", "1x4"])
    assert runs["1x2"]["tokens"] == runs["1x1"]["tokens"] == runs["1x4"]["tokens"]
