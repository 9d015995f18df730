"""GPT-OSS (GptOssForCausalLM): the published configs' parameter counts and plan figures,
scores equal to HF's past the window and YaRN's original length, MXFP4 expert tensors,
bfloat16, meshes (tensor and expert parallel), and what is refused. Greedy parity with HF
transformers, under scheduler pressure too, is in test_parity.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.benchmarks.published_configs import gpt_oss as published
from jaxserve.models import model_family, mxfp4
from jaxserve.models.quant_config import checkpoint_quant


# The model cards' totals: 20.91B and 116.83B (transformers' own count of these configs).
@pytest.mark.parametrize("layers,experts,params", [(24, 32, 20_914_757_184),
                                                    (36, 128, 116_829_156_672)])
def test_published_configs_and_plan(layers, experts, params, tmp_path):
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.config.plan import make_plan

    hf = published(layers, experts)
    arch = model_family(hf).arch_from_hf(hf)
    assert arch.sliding_windows[:3] == (128, None, 128) and arch.attention_bias
    assert (arch.num_experts, arch.top_k, arch.swiglu_limit) == (experts, 4, 7.0)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = EngineConfig.create(str(tmp_path), on_accelerator=True, mesh="1x8",
                                 max_model_len=8192)
    assert config.model.dtype == "bfloat16"  # the tensors besides the MXFP4 experts
    plan = make_plan(config, 141 * 2**30)  # an H200
    assert plan.num_params == params
    # bf16 weights but the experts', which stay MXFP4 (4 bits + an 8-bit scale per 32);
    # every group split 8 ways but the norms, sinks and small biases, and the down
    # projections' scales, whole on every device (2880 / 8 rows are not whole groups of 32)
    experts = 3 * 2880 * 2880 * experts * layers
    expected = ((params - experts) * 2 + experts * (0.5 + 1 / 32)) / 8 + experts / 3 / 32 * 7 / 8
    assert abs(plan.weight_bytes_per_device - expected) < 0.01 * expected
    # KV per token and device: 2 (K, V) x layers x 1 of the 8 kv heads x 64 x 2 bytes
    assert plan.bytes_per_token == 2 * layers * 1 * 64 * 2


def test_other_quantizations_are_refused_by_name():
    hf = {**published(24, 32), "quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(ValueError, match="quantized with 'bitsandbytes' are not supported"):
        model_family(hf).arch_from_hf(hf)
    with pytest.raises(ValueError, match="bitsandbytes checkpoints are not supported"):
        checkpoint_quant(hf)


def test_the_torch_backend_refuses_gpt_oss(tiny_checkpoints):
    with pytest.raises(ValueError, match="GPT-OSS .* runs on the JAX backend only"):
        LLM(str(tiny_checkpoints["gpt_oss"]), backend="torch", precompile=False)


def test_mxfp4_matches_transformers_dequantization():
    """mxfp4.dequantize equals transformers' convert_moe_packed_tensors on random bytes
    (every nibble and a wide range of exponents), and quantize inverts it on the grid."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 2, 16), dtype=np.uint8)  # [E, out, in / 32, 16]
    scales = rng.integers(110, 140, (3, 40, 2), dtype=np.uint8)
    got = mxfp4.dequantize(blocks, scales)  # [E, in, out]
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).numpy()
    assert got.shape == want.shape == (3, 64, 40)
    np.testing.assert_array_equal(got, want)
    again = mxfp4.dequantize(*mxfp4.quantize(got))
    np.testing.assert_array_equal(again, got)
    with pytest.raises(ValueError, match="do not match scales"):
        mxfp4.dequantize(blocks, scales[..., :1])


def write_mxfp4_folders(source, tmp_path):
    """(an MXFP4 folder, the same weights dequantized): the source checkpoint's experts
    rounded to MXFP4, stored as *_blocks / *_scales with quantization_config in one folder,
    and as plain float32 tensors in the other."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    packed, plain = {}, {}
    for name, value in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(value)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            plain[name] = mxfp4.dequantize(blocks, scales).astype(np.float32)
        else:
            packed[name] = plain[name] = value
    folders = []
    for label, weights in (("mxfp4", packed), ("dequantized", plain)):
        folder = tmp_path / label
        shutil.copytree(source, folder)
        save_file(weights, str(folder / "model.safetensors"))
        folders.append(folder)
    config = json.loads((folders[0] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folders[0] / "config.json").write_text(json.dumps(config))
    return folders


def test_an_mxfp4_folder_gives_the_dequantized_folders_tokens(tiny_checkpoints, tmp_path,
                                                              checkpoint_script):
    packed, plain = write_mxfp4_folders(tiny_checkpoints["gpt_oss"], tmp_path)
    prompts = checkpoint_script.check_prompts()[3:6]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = []
    for folder in (packed, plain):
        llm = LLM(str(folder), dtype="float32", max_model_len=256, precompile=False)
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob,
                                                                abs=1e-5)


@pytest.mark.parametrize("fault,match", [
    ("missing", "only the blocks of tensor .*layers.1.mlp.experts.down_proj"),
    ("short", "model.safetensors: .*down_proj_scales.*MXFP4 blocks .* do not match scales"),
    ("signed", "MXFP4 blocks and scales must be uint8"),
])
def test_a_broken_mxfp4_piece_is_named(fault, match, tiny_checkpoints, tmp_path):
    """A piece missing, of the wrong shape or dtype: a ValueError naming the file, the
    tensor and the fault, before anything is served."""
    from safetensors.numpy import load_file, save_file

    packed, _ = write_mxfp4_folders(tiny_checkpoints["gpt_oss"], tmp_path)
    tensors = load_file(str(packed / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    if fault == "missing":
        del tensors[name]
    elif fault == "short":
        tensors[name] = np.ascontiguousarray(tensors[name][..., :1])
    else:
        tensors[name] = tensors[name].astype(np.int8)
    save_file(tensors, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        LLM(str(packed), dtype="float32", max_model_len=64, precompile=False)


def test_prompt_logprobs_match_transformers(tiny_checkpoints, checkpoint_script):
    """Every prompt position's logprob equals HF's (float32) on prompts of 97..200 tokens:
    past the 48-token window and YaRN's original 64 positions, with the sinks, biases and
    the clamped SwiGLU at every position; prefilled in 64-token chunks over 16-token blocks."""
    from support.score_helpers import assert_prompt_logprobs_match_hf

    prompts = checkpoint_script.check_prompts()[-3:]
    assert_prompt_logprobs_match_hf(tiny_checkpoints["gpt_oss"], prompts)


def test_bfloat16_stays_close_to_float32(tiny_checkpoints, checkpoint_script):
    from support.score_helpers import assert_bfloat16_close_to_float32

    assert_bfloat16_close_to_float32(tiny_checkpoints["gpt_oss"],
                                     checkpoint_script.check_prompts()[:6])


@pytest.mark.slow  # four meshes in a subprocess: the suite's time budget
def test_greedy_tokens_do_not_depend_on_the_mesh(tiny_checkpoints):
    """1x2 splits the 2 kv heads, the sinks with the query heads and every expert's width;
    1x4 replicates the kv heads; 1x4:ep puts 2 whole experts (and their biases) on each
    device (8 fake CPU devices, in a subprocess)."""
    from support.mesh import mesh_runs

    runs = mesh_runs(tiny_checkpoints["gpt_oss"], ["1x1", "1x2", "1x4", "1x4:ep"])
    single = runs["1x1"]["tokens"]
    assert all(run["tokens"] == single for run in runs.values())
