"""Weight loading from Hugging Face folders: sharded checkpoints, dtypes, refusals."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SMALL = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
PROMPTS = [[5, 6, 7, 8], list(range(10, 50))]


def copy_tokenizer(src, dst):
    """Tokenizer files only: config.json and weights come from save_pretrained."""
    for path in src.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(path, dst / path.name)


def param_dtypes(llm) -> set:
    return {leaf.dtype for leaf in jax.tree_util.tree_leaves(llm.engine.runner.params)}


def test_sharded_checkpoint_loads_and_matches(tmp_path, tiny_checkpoints):
    import torch
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoints["qwen2"]
    dst = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(dst, max_shard_size="100KB")
    copy_tokenizer(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    whole = LLM(str(src), **SMALL).generate(PROMPTS, GREEDY, use_tqdm=False)
    sharded = LLM(str(dst), **SMALL).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in whole]


def test_bfloat16_checkpoint_loads_as_saved_and_casts(tmp_path, tiny_checkpoints):
    import torch
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoints["llama"]
    dst = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst)
    copy_tokenizer(src, dst)
    saved = LLM(str(dst), dtype="bfloat16", **SMALL)
    assert param_dtypes(saved) == {jnp.dtype(jnp.bfloat16)}
    out = saved.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    # auto on the CPU: float32 (XLA:CPU has no bf16 matmul; docs/usage.md "dtype"), as asked
    auto = LLM(str(dst), dtype="auto", **SMALL)
    assert param_dtypes(auto) == {jnp.dtype(jnp.float32)}


def test_auto_dtype_is_the_checkpoints_on_accelerators_and_f32_on_the_cpu(tmp_path,
                                                                         tiny_checkpoints,
                                                                         monkeypatch):
    from jaxserve.config import engine_config as config

    hf = {"torch_dtype": "bfloat16"}
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    assert config._resolve_dtype("auto", hf, str(folder), on_accelerator=True) == "bfloat16"
    assert config._resolve_dtype("auto", hf, str(folder), on_accelerator=False) == "float32"
    assert config._resolve_dtype("auto", {}, str(folder), on_accelerator=False) == "float32"
    assert config._resolve_dtype("float16", hf, str(folder), on_accelerator=False) == "float16"
    # f32 weights over a quarter of the host's memory: the checkpoint's own dtype
    monkeypatch.setattr(config, "_host_memory_bytes", lambda: 4 * 1999)
    assert config._resolve_dtype("auto", hf, str(folder), on_accelerator=False) == "bfloat16"


def test_bad_dtype_and_missing_folder_are_refused(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_checkpoints["llama"]), dtype="int8", **SMALL)
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "nowhere"), **SMALL)
    import shutil

    remote = tmp_path / "remote-code"
    shutil.copytree(tiny_checkpoints["llama"], remote)
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps(
        {**config, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    with pytest.raises(ValueError, match="trust_remote_code=True.*auto_map"):
        LLM(str(remote), trust_remote_code=True, **SMALL)


def test_checkpoint_missing_a_tensor_is_refused(tmp_path, tiny_checkpoints):
    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoints["llama"]
    dst = tmp_path / "broken"
    dst.mkdir()
    copy_tokenizer(src, dst)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 weights"):
        LLM(str(dst), **SMALL)
