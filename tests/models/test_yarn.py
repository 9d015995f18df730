"""YaRN RoPE scaling (long-context Qwen2/Qwen2.5/Qwen3, `rope_scaling.type: yarn`): the
frequencies and attention factor transformers computes, and the models' scores past the
original context on both backends."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.models import model_family
from jaxserve.models.llama_arch import rope_attention_factor, rope_inv_freq

YARN_CASES = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
     "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.707, "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5},
    {"rope_type": "yarn", "factor": 4.0},  # the original length: max_position_embeddings
]


@pytest.mark.parametrize("rope", YARN_CASES)
def test_frequencies_and_attention_factor_match_transformers(rope):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = dict(architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=256,
              intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=131072,
              rope_theta=1000000.0, rope_scaling=dict(rope))
    config = transformers.Qwen2Config(**{k: v for k, v in hf.items() if k != "architectures"})
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    arch = model_family(hf).arch_from_hf(hf)
    np.testing.assert_allclose(rope_inv_freq(arch), want.numpy(), rtol=1e-6)
    assert rope_attention_factor(arch) == pytest.approx(want_factor, rel=1e-12)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 1000000.0}


@pytest.fixture(scope="module")
def yarn_qwen2(tmp_path_factory):
    from jaxserve.benchmarks.checkpoints import make_checkpoint

    return make_checkpoint("qwen2", tmp_path_factory.mktemp("yarn") / "qwen2",
                           overrides={"rope_parameters": YARN})


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_prompt_logprobs_match_transformers_past_the_original_context(backend, yarn_qwen2,
                                                                      checkpoint_script):
    """Every position's logprob equals HF's (float32) on prompts of 97..200 tokens, past
    the original 64-token context, prefilled in 64-token chunks."""
    from support.score_helpers import assert_prompt_logprobs_match_hf

    prompts = checkpoint_script.check_prompts()[-3:]
    model = assert_prompt_logprobs_match_hf(yarn_qwen2, prompts, backend=backend)
    assert model.model.rotary_emb.rope_type == "yarn"


@pytest.mark.slow
def test_greedy_tokens_do_not_depend_on_the_mesh(yarn_qwen2):
    """Tensor parallelism with YaRN's frequencies and attention factor: 1x2 splits the 2 kv
    heads, 1x4 replicates them (8 fake CPU devices, in a subprocess)."""
    from support.mesh import mesh_runs

    runs = mesh_runs(yarn_qwen2, ["1x1", "1x2", "1x4"])
    assert runs["1x2"]["tokens"] == runs["1x1"]["tokens"] == runs["1x4"]["tokens"]
