"""`jaxserve plan`: per-device weight and KV bytes, blocks, concurrency and buckets, checked
against numbers computed here by formula from the model's sizes (config.json only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.cli import main
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.plan import make_plan, plan_dict
from jaxserve.config.plan_text import format_plan, parse_bytes

GiB = 2**30
# Llama-3-8B's sizes: V, D, F, layers, N, K, H
V, D, F, L, N, K, H = 128256, 4096, 14336, 32, 32, 8, 128


def llama_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": D,
        "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": N,
        "num_key_value_heads": K, "head_dim": H, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    return {**config, **overrides}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """name -> a model folder holding nothing but config.json."""
    def make(name: str, **overrides):
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps(llama_config(**overrides)))
        return str(path)
    return {"8b": make("llama8b"), "4kv": make("kv4", num_key_value_heads=4)}


def split_params(kv_heads: int) -> int:
    """Parameters split over the model axis: embeddings, attention, MLP (not the norms)."""
    return 2 * V * D + L * (2 * D * N * H + 2 * D * kv_heads * H + 3 * D * F)


NORM_PARAMS = 2 * L * D + D  # two RMSNorms per layer and the final one: replicated


def plan_for(model: str, mesh: str, memory: int = 16 * GiB, **kwargs):
    config = EngineConfig.create(model, on_accelerator=True, mesh=mesh, **kwargs)
    return make_plan(config, memory)


def test_llama_8b_on_1x8_with_16_gib(folder):
    plan = plan_for(folder["8b"], "1x8")
    assert split_params(K) + NORM_PARAMS == plan.num_params == 8_030_261_248
    weights = split_params(K) * 2 // 8 + NORM_PARAMS * 2  # bfloat16
    assert plan.weight_bytes_per_device == weights == 2_008_031_232
    groups = {g.name: g for g in plan.weights}
    assert groups["embeddings"].bytes_per_device == 2 * V * D * 2 // 8
    assert groups["attention"].params == L * (2 * D * N * H + 2 * D * K * H)
    assert groups["mlp"].params == L * 3 * D * F
    assert (groups["norms"].params, groups["norms"].split) == (NORM_PARAMS, "replicated")
    assert plan.bytes_per_block == 2 * 32 * 16 * 1 * 128 * 2 == 262_144
    assert plan.bytes_per_token == 16_384
    # the sampler state (penalty counts, prompt mask, logit-bias rows, grammar bitmasks) of
    # 256 sequences + 1
    assert plan.sampler_state_bytes == 257 * (V * (4 + 1 + 4) + V // 32 * 4) == 300_776_352
    budget = int(16 * GiB * 0.9 - weights - plan.sampler_state_bytes)
    assert plan.kv_budget_bytes == budget
    assert plan.num_blocks == budget // 262_144 == 50_174
    assert plan.kv_tokens == 50_173 * 16
    assert plan.blocks_per_seq == 8192 // 16
    assert plan.max_concurrency == 50_173 // 512 == 97
    assert plan.concurrency == pytest.approx(97.994, abs=1e-3)
    # the engine's accelerator defaults: max_model_len 8192, 256 seqs, 2048 tokens per step
    assert plan.token_buckets == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert plan.step_buckets[:5] == ((16, 1), (16, 2), (16, 4), (16, 8), (16, 16))
    assert plan.step_buckets[-1] == (2048, 256) and len(plan.step_buckets) == 12
    assert (plan.sharding.kv_heads, plan.sharding.embed_axis) == (8, "hidden")
    text = format_plan(plan)
    for needle in ("1x8", "2,008,031,232", "262,144", "50,174", "97.99", "802,768",
                   "300,776,352",
                   "2048x256", "kv heads 8 (not replicated) -> 1 per device"):
        assert needle in text, needle
    assert json.loads(json.dumps(plan_dict(plan)))["max_concurrency"] == 97


def test_2x4_splits_each_replica_over_4(folder):
    plan = plan_for(folder["8b"], "2x4", max_model_len=4096)
    assert plan.sharding.kv_heads_per_device == 2  # 8 kv heads over 4 devices
    assert (plan.mesh.data, plan.mesh.num_devices) == (2, 8)
    weights = split_params(K) * 2 // 4 + NORM_PARAMS * 2
    assert plan.weight_bytes_per_device == weights
    assert plan.bytes_per_block == 2 * 32 * 16 * 2 * 128 * 2
    blocks = int(16 * GiB * 0.9 - weights - plan.sampler_state_bytes) // plan.bytes_per_block
    assert plan.num_blocks == blocks and plan.max_concurrency == (blocks - 1) // 256


def test_too_few_kv_heads_are_replicated(folder):
    plan = plan_for(folder["4kv"], "1x8")
    s = plan.sharding
    assert (plan.num_kv_heads, s.kv_heads, s.kv_replicas, s.kv_heads_per_device) == (4, 8, 2, 1)
    # wk / wv hold K' = 8 heads, each device one of them
    assert plan.weight_bytes_per_device == split_params(8) * 2 // 8 + NORM_PARAMS * 2
    assert plan.bytes_per_block == 2 * 32 * 16 * 1 * 128 * 2
    assert "kv heads 4 -> K'=8 (each replicated 2x)" in format_plan(plan)


def test_explicit_num_kv_blocks_is_kept(folder):
    plan = plan_for(folder["8b"], "1x8", num_kv_blocks=1000)
    assert (plan.num_blocks, plan.kv_budget_source) == (1000, "num_kv_blocks")


def test_mesh_that_cannot_split(folder):
    with pytest.raises(ValueError, match=r"cannot be split over model=3.*sizes that work: "
                                         r"1, 2, 4, 8, 16, 32"):
        plan_for(folder["8b"], "1x3")


def test_weights_too_big_say_what_helps(folder):
    with pytest.raises(ValueError, match="weights alone do not fit") as err:
        plan_for(folder["8b"], "1x1", dtype="float32")
    assert "--mesh 1x4" in str(err.value) and "--dtype bfloat16" in str(err.value)


@pytest.mark.parametrize("text, value", [
    ("16GiB", 16 * GiB), ("16G", 16 * GiB), ("16Gi", 16 * GiB), ("80GB", 80 * 10**9),
    ("16e9", 16 * 10**9), ("1.5 GiB", 3 * GiB // 2), ("512MiB", 512 * 2**20), ("1024", 1024)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["16XB", "GiB", "-1G", "0", "16 Gigs", "16iB"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="device memory"):
        parse_bytes(text)


def test_cli_plan_prints_the_table_and_json(folder, capsys):
    args = ["plan", "--model", folder["8b"], "--mesh", "1x8", "--device-memory", "16GiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2,008,031,232" in out and "50,174" in out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 50_174
    assert main([*args[:-1], "4GiB", "--dtype", "float32"]) == 2
    assert "do not fit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args[:-1], "lots"])


def test_cli_plan_never_touches_an_accelerator(folder):
    """Even with an accelerator platform asked for (absent here, so initialising it would
    fail), the plan succeeds: it is arithmetic on config.json and never imports jax."""
    code = ("import sys; from jaxserve.cli import main; "
            f"rc = main(['plan', '--model', {folder['8b']!r}, '--mesh', '1x8', "
            "'--device-memory', '16GiB']); "
            "print('JAX LOADED', 'jax' in sys.modules); "
            "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cuda"})
    assert proc.returncode == 0, proc.stderr
    assert "JAX LOADED False" in proc.stdout and "50,174" in proc.stdout


PARAM_TABLE_CONFIGS = [
    {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
     "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2},
    {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 96, "hidden_size": 32,
     "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "tie_word_embeddings": True},
    {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 96, "hidden_size": 32,
     "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
     "num_key_value_heads": 1, "head_dim": 16},
    {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 96, "hidden_size": 32,
     "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
     "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
     "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
     "mlp_only_layers": [1]},
    {"architectures": ["MixtralForCausalLM"], "vocab_size": 96, "hidden_size": 32,
     "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 96, "hidden_size": 32,
     "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8},
    {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 96, "hidden_size": 32,
     "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False},
    {"architectures": ["GptOssForCausalLM"], "vocab_size": 96, "hidden_size": 32,
     "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
     "num_experts_per_tok": 2, "sliding_window": 8},
]


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("hf", PARAM_TABLE_CONFIGS, ids=lambda hf: hf["architectures"][0])
def test_the_parameter_table_plan_counts_is_the_flax_models(hf, quantization):
    """plan counts weights from the family's numpy table (no jax); the Flax model must
    declare exactly those parameters, shapes and stored dtypes."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.models import model_family

    family = model_family(hf)
    arch = family.arch_from_hf(hf)
    options = {"quantization": quantization} if quantization else {}
    _, state = nnx.split(nnx.eval_shape(
        lambda: family.model_cls(arch, jnp.bfloat16, **options)))
    declared = {tuple(path): (tuple(var.get_value().shape), str(var.get_value().dtype))
                for path, var in nnx.to_flat_state(state)}
    table = {path: (shape, dtype or "bfloat16")
             for path, (shape, dtype) in family.param_shapes(arch, quantization).items()}
    assert table == declared
