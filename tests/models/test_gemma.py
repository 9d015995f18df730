"""Gemma 2 and Gemma 3 (text): configs as published and as transformers 5 writes them, and
the models in bfloat16. Greedy parity with HF transformers is in test_parity.py."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.benchmarks.published_configs import GEMMA2_9B, GEMMA3_27B_TEXT
from jaxserve.models import model_family


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


@pytest.mark.parametrize("arch,backend", [("gemma2", "jax"), ("gemma3", "jax"),
                                          ("gemma2", "torch")])
def test_bfloat16_stays_close_to_float32(arch, backend, tiny_checkpoints, checkpoint_script):
    from support.score_helpers import assert_bfloat16_close_to_float32

    assert_bfloat16_close_to_float32(tiny_checkpoints[arch], checkpoint_script.check_prompts()[:6],
                                     backend=backend)


@pytest.mark.parametrize("arch", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_greedy_tokens_do_not_depend_on_the_mesh(arch, tiny_checkpoints):
    """Tensor parallelism: 1x2 splits the 2 kv heads, 1x4 replicates them (8 fake CPU
    devices, in a subprocess); the soft cap and windows go through the sharded attention."""
    from support.mesh import mesh_runs

    runs = mesh_runs(tiny_checkpoints[arch], ["1x1", "1x2", "1x4"])
    assert runs["1x2"]["tokens"] == runs["1x1"]["tokens"] == runs["1x4"]["tokens"]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_prompt_logprobs_match_transformers_past_the_window(arch, tiny_checkpoints,
                                                            checkpoint_script):
    """Every prompt position's logprob equals HF's (float32) on prompts up to 4x the 48-token
    window, prefilled in 64-token chunks over 16-token blocks: the soft caps, the windows
    and the per-layer RoPE bases at every position, not only where greedy tokens differ."""
    from support.score_helpers import assert_prompt_logprobs_match_hf

    prompts = checkpoint_script.check_prompts()[-3:]  # 97, 150 and 200 tokens
    assert_prompt_logprobs_match_hf(tiny_checkpoints[arch], prompts)


def test_image_parts_are_refused_by_name():
    """Gemma 3's published checkpoints are multimodal; jaxserve serves their text. A chat
    message with an image part gets a 400 that names the part, not a type error."""
    from pydantic import ValidationError

    from jaxserve.server.errors import from_validation_error
    from jaxserve.server.openai.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    error = from_validation_error(caught.value)
    assert error.status == 400 and error.param == "messages.0.content"
    assert "content part 1 has type 'image_url'" in error.message
    body["messages"][0]["content"].pop()
    assert ChatCompletionRequest.model_validate(body).messages[0].text == (
        "What is in this picture?")


def test_a_multimodal_gemma3_folder_serves_its_language_model(tiny_checkpoints, tmp_path,
                                                              checkpoint_script):
    """A Gemma3ForConditionalGeneration folder (the 4B..27B as published: a vision tower and
    projector beside the language model, whose tensors carry a `language_model.` prefix, and
    the text settings under text_config) gives the text model's greedy tokens; the vision
    tensors are skipped."""
    import json
    import shutil

    import torch
    import transformers

    text_folder = tiny_checkpoints["gemma3"]
    text = transformers.AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.config, vision_config=vision,
                                       mm_tokens_per_image=4, dtype="float32")
    both = transformers.Gemma3ForConditionalGeneration(config)
    missing, _ = both.model.language_model.load_state_dict(text.model.state_dict(), strict=False)
    assert not missing
    folder = tmp_path / "gemma3-mm"
    both.save_pretrained(folder)
    for name in text_folder.iterdir():
        if name.name.startswith("tokenizer") or name.name == "generation_config.json":
            shutil.copy(name, folder / name.name)
    hf = json.loads((folder / "config.json").read_text())
    assert hf["architectures"] == ["Gemma3ForConditionalGeneration"] and "text_config" in hf

    prompts = checkpoint_script.check_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=128, max_num_seqs=4, precompile=False)
    want = [o.outputs[0].token_ids
            for o in LLM(str(text_folder), **engine).generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids
           for o in LLM(str(folder), **engine).generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_published_multimodal_gemma3_config_takes_transformers_defaults():
    """google/gemma-3-4b-it's config.json gives only what differs from Gemma3TextConfig's
    defaults under text_config; every reader of the config sees the whole text model."""
    from jaxserve.models.gemma_arch import language_model_config

    published = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "eos_token_id": [1, 106], "torch_dtype": "bfloat16", "mm_tokens_per_image": 256,
                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                 "model_type": "gemma3_text", "num_hidden_layers": 34,
                                 "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024},
                 "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
    flat = language_model_config(published)
    assert flat["max_position_embeddings"] == 131072 and flat["vocab_size"] == 262208
    assert flat["eos_token_id"] == [1, 106] and flat["torch_dtype"] == "bfloat16"
    arch = model_family(flat).arch_from_hf(flat)
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads,
            arch.head_dim) == (34, 2560, 8, 4, 256)
    assert arch.sliding_windows[:6] == (1024,) * 5 + (None,) and arch.multimodal
    assert dict(arch.layer_rope(5).rope_scaling)["factor"] == 8.0
    assert arch.layer_rope(0).rope_theta == 1e4 and arch.tie_word_embeddings
    assert model_family(published).arch_from_hf(published) == arch  # unflattened too
