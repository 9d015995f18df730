"""`jaxserve convert` writes an Orbax checkpoint; LLM(model=DIR) restores it straight into the
mesh's shardings, with the tokens of the Hugging Face folder it came from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import mesh_runs as mesh_runs_module
from support.mesh import mesh_runs
from support.parity import hf_greedy

from jaxserve import LLM, SamplingParams
from jaxserve.backends.jax.orbax_checkpoint import convert, is_orbax_folder

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self"]
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, precompile=False)


def greedy(folder, dtype: str) -> list[list[int]]:
    llm = LLM(str(folder), dtype=dtype, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


# Slow (the suite's time budget): conversion and restore are tested by default below.
@pytest.mark.slow
def test_the_command_line_converts_to_bfloat16(tiny_checkpoints, tmp_path):
    """`jaxserve convert MODEL --out DIR --dtype bfloat16`; the restored bf16 model gives the
    tokens the HF folder gives in bf16."""
    out = tmp_path / "llama-orbax"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "convert",
                           str(tiny_checkpoints["llama"]), "--out", str(out), "--dtype",
                           "bfloat16"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Wrote {out}" in done.stdout and "Writing Orbax checkpoint" in done.stderr
    assert is_orbax_folder(out)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert greedy(out, "bfloat16") == greedy(tiny_checkpoints["llama"], "bfloat16")

    again = subprocess.run([sys.executable, "-m", "jaxserve.cli", "convert",
                            str(tiny_checkpoints["llama"]), "--out", str(out)],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.slow  # the suite's time budget: qwen3's steps compile for this test alone
def test_qwen3_restores_with_the_hf_tokens(tiny_checkpoints, tmp_path):
    out = convert(tiny_checkpoints["qwen3"], tmp_path / "qwen3-orbax")
    assert greedy(out, "float32") == greedy(tiny_checkpoints["qwen3"], "float32")


@pytest.mark.slow  # (the suite's budget: conversion and restore on one device stay default)
def test_restored_on_other_meshes(mesh_checkpoints, tmp_path):
    """Converted on one device, restored on 1x4 (kv heads replicated: read whole, repeated
    on the devices) and 2x2 (two replicas, kv heads split): HF's greedy tokens."""
    folder = mesh_checkpoints["llama"]
    out = convert(folder, tmp_path / "mesh-llama-orbax")
    runs = mesh_runs(out, ["1x4", "2x2"])
    want = hf_greedy(folder, mesh_runs_module.prompts(), new_tokens=mesh_runs_module.NEW_TOKENS)
    for mesh, run in runs.items():
        assert run["tokens"] == want, mesh


def test_a_folder_that_does_not_match_its_config_names_the_first_mismatch(tiny_checkpoints,
                                                                          tmp_path):
    out = convert(tiny_checkpoints["llama"], tmp_path / "orbax")
    config = json.loads((out / "config.json").read_text())
    config["intermediate_size"] += 8
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"parameter 'layers\.0\.mlp\.w_\w+' is saved with "
                                         r"shape .* but config\.json makes it"):
        LLM(str(out), dtype="float32", **ENGINE)
    config["intermediate_size"] -= 8
    config["num_hidden_layers"] -= 1
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has parameter 'layers\.\d+\..*', which this "
                                         r"model's config\.json does not use"):
        LLM(str(out), dtype="float32", **ENGINE)


def test_the_torch_backend_refuses_an_orbax_folder(tiny_checkpoints, tmp_path):
    out = convert(tiny_checkpoints["llama"], tmp_path / "orbax")
    with pytest.raises(ValueError, match="Orbax checkpoint .* backend='jax'"):
        LLM(str(out), backend="torch")
