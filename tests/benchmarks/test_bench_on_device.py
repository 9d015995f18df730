"""scripts/bench_on_device.py: the GPU end-to-end benchmark, run here in its tiny CPU form.

The numbers themselves are not checked (timing belongs to the script); what is checked is
that every section runs and reports what it claims: throughput, ordered TTFT / ITL
percentiles, decode step times against the weight-bandwidth floor, the HF baseline (or
why it was skipped) and the torch backend beside the JAX one. The fast tests check the GPU
plan without a GPU: the Llama-3-8B folder the script writes is one jaxserve accepts with the
engine arguments it will run with; the torch backend's section runs on the tiny model
(against made-up JAX numbers), a torch engine that cannot start is reported without losing
the JAX numbers, and the KV-block sizing beside JAX's memory pool is checked on numbers; the
quantized section's published formats (FP8 blocks, W4A16, AWQ) are configs jaxserve reads,
sized to the model's shape.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import subprocess
import sys
import types

import pytest

from jaxserve.benchmarks import device_plan, engine_measures, torch_section
from jaxserve.benchmarks.workloads import make_workload

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_on_device.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_on_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_ordered(stats: dict) -> None:
    assert stats["count"] > 0
    assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"]


@pytest.mark.slow  # ~100 s on 2 cores, nearly all of it compiling the engine's buckets
def test_cpu_run_reports_every_section(tmp_path):
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", str(report),
                          "--max-seconds", "900"], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.splitlines()[0].split("] ", 1)[1].startswith("device: cpu")
    assert "== summary" in out.stdout
    data = json.loads(report.read_text())
    assert data["tiny"] and data["backend"] == "cpu"
    assert data["errors"] == {} and data["skipped"] == {}

    assert data["bandwidth"]["bytes_per_s"] > 0
    assert data["weights"]["bytes"] > 0 and data["weights"]["floor_s"] > 0

    workload = data["workload"]
    assert workload["requests"] == 12
    assert workload["token_ids"][1] <= min(4096, data["model_config"]["vocab_size"])
    run = data["throughput"]
    assert not run["truncated"] and run["finished"] == workload["requests"]
    assert run["output_tokens"] == workload["output_tokens"]
    assert run["prompt_tokens"] == workload["prompt_tokens"]
    assert run["output_tok_s"] > 0 and run["total_tok_s"] > run["output_tok_s"]
    assert_ordered(run["ttft_s"])
    assert_ordered(run["itl_s"])
    assert run["ttft_s"]["count"] == workload["requests"]
    # Every token after each request's first is one inter-token gap.
    assert run["itl_s"]["count"] == workload["output_tokens"] - workload["requests"]

    batches = data["decode"]["batches"]
    assert [b["batch"] for b in batches] == [1, 4, 8]
    for b in batches:
        assert b["tokens_per_step"] == b["batch"]  # every request decoded in every step
        assert b["step_s"] > 0 and b["floor_s"] == data["weights"]["floor_s"]
        assert b["ratio"] > 0 and b["ratio_with_kv"] > 0
        assert b["floor_with_kv_s"] > b["floor_s"]
    # The largest batch also ran with asynchronous scheduling off.
    assert batches[-1]["sync_step_s"] > 0 and batches[-1]["async_speedup"] > 0
    assert "with async scheduling off" in out.stdout

    hf = data["hf"]
    if "skipped" in hf:
        assert isinstance(hf["skipped"], str) and hf["skipped"]
    else:
        assert hf["transformers"]["output_tok_s"] > 0 and hf["ratio"] > 0
        assert hf["transformers"]["output_tokens"] == hf["jaxserve"]["output_tokens"]
        assert hf["transformers"]["generated_tokens"] >= hf["transformers"]["output_tokens"]
        assert hf["jaxserve"]["requests"] == hf["requests"] == 4

    torch = data["torch"]  # the torch backend, same model, workload and decode batches
    assert torch["engine_args"]["backend"] == "torch"
    assert torch["engine_args"]["num_gpu_blocks_override"] == torch["jax_kv_blocks"]
    assert torch["weights"]["params"] == data["weights"]["params"]
    assert torch["throughput"]["output_tokens"] == workload["output_tokens"]
    assert [b["batch"] for b in torch["decode"]["batches"]] == [1, 4, 8]
    assert all(b["tokens_per_step"] == b["batch"] for b in torch["decode"]["batches"])
    assert torch["vs_jax"]["output_tok_s"] > 0 and set(torch["vs_jax"]["decode_step"]) == \
        {"1", "4", "8"}
    assert "torch / JAX speed" in out.stdout

    # int8, FP8-block and W4A16 weights and an fp8 KV cache, each its own engine
    quantized = data["quantized"]
    assert set(quantized) == {"int8 weights", "fp8 weights", "w4a16 weights", "fp8 kv"}
    bf16_bytes = data["weights"]["bytes"]
    assert quantized["int8 weights"]["weights"]["bytes"] < bf16_bytes
    fp8 = quantized["fp8 kv"]
    assert fp8["weights"]["bytes"] == bf16_bytes
    assert 2 * fp8["bytes_per_block"] == data["kv_cache"]["bytes_per_block"]
    assert fp8["kv_blocks"] >= data["kv_cache"]["blocks"]
    # The published formats: the quantization_config in their folder, groups sized to the
    # tiny model's 64-wide layers; fewer bytes than bf16's (the tiny model's bf16 embeddings
    # and lm_head are most of them), 4-bit codes fewer than 8-bit ones.
    fp8w, w4 = quantized["fp8 weights"], quantized["w4a16 weights"]
    assert fp8w["quantization_config"]["weight_block_size"] == [32, 32]
    assert w4["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert w4["weights"]["bytes"] < fp8w["weights"]["bytes"] < bf16_bytes
    for q in (fp8w, w4):
        assert q["weights"]["bytes_vs_bf16"] == pytest.approx(q["weights"]["bytes"] / bf16_bytes)
        for b in q["decode"]["batches"]:
            assert b["bytes_per_token_vs_bf16"] == pytest.approx(
                q["weights"]["bytes_vs_bf16"])  # every request decoded in every step
    for q in quantized.values():
        assert [b["batch"] for b in q["decode"]["batches"]] == [4, 8]
        assert all(b["tokens_per_step"] == b["batch"] and b["vs_bf16"] > 0
                   and b["weight_bytes_per_token"] == q["weights"]["bytes"] / b["batch"]
                   for b in q["decode"]["batches"])
    assert "fp8 kv decode batch" in out.stdout and "w4a16 weights decode batch" in out.stdout


def test_gpu_plan_is_llama3_8b_with_accelerator_engine_defaults(tmp_path):
    from jaxserve.config.engine_config import EngineConfig

    args = argparse.Namespace(requests=None, hf_requests=None, hf_batch_size=None,
                              max_seconds=None)
    plan = device_plan.Plan(tiny=False, quick=False, args=args)
    assert plan.requests == 256 and plan.decode_batches == (1, 32, 256)
    assert plan.budget_s == 600 and plan.copy_bytes == 2 << 30
    quick = device_plan.Plan(tiny=False, quick=True, args=args)
    assert quick.budget_s == 240 and quick.requests < plan.requests

    folder = device_plan.write_model_folder(tmp_path, plan.model_config)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file()
    config = EngineConfig.create(str(folder), load_format="dummy", dtype="bfloat16",
                                 on_accelerator=True, **plan.engine_args)
    defaults = EngineConfig.create(str(folder), on_accelerator=True)
    assert config.scheduler.max_num_seqs == defaults.scheduler.max_num_seqs == 256
    assert config.scheduler.max_num_batched_tokens == \
        defaults.scheduler.max_num_batched_tokens == 2048
    assert config.model.max_model_len == 2048 and config.model.dtype == "bfloat16"
    assert max(plan.decode_batches) <= config.scheduler.max_num_seqs
    hf = config.model.hf_config
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
            hf["num_key_value_heads"], hf["intermediate_size"], hf["vocab_size"]) == \
        (4096, 32, 32, 8, 14336, 128256)
    # Llama-3-8B holds 128 KiB of bf16 K and V per token.
    assert engine_measures.kv_bytes_per_token(plan.model_config) == 128 * 1024
    # The torch backend's and the quantized engines' sections keep their time within the
    # same budgets.
    for p in (quick, plan):
        assert p.need["torch"] + p.need["hf"] + p.need["quantized"] < p.budget_s
    assert plan.quantized_batches == (32, 256)


@pytest.mark.parametrize("tiny", [False, True])
def test_quantized_formats_fit_the_model_shape(tiny, tmp_path):
    """The published formats' quantization_configs jaxserve reads, with groups / blocks that
    divide every projection of the model: 128 on Llama-3-8B, 32 on the tiny model; a folder
    holding one is a model the engine accepts."""
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.models.quant_config import checkpoint_quant

    config = device_plan.TINY if tiny else device_plan.LLAMA3_8B
    group = 32 if tiny else 128
    assert device_plan.quant_group(config) == group
    labels = {}
    for fmt in device_plan.QUANT_FORMATS:
        quant = checkpoint_quant({**config, "quantization_config":
                                  device_plan.quantization_config(fmt, config)})
        assert quant.group_size == group and {"attention", "mlp"} <= set(quant.kinds)
        labels[fmt] = (quant.codes, quant.activations)
    assert labels == {"fp8": ("float8_e4m3fn", "dynamic-group"), "w4a16": ("uint4", "none"),
                      "awq": ("uint4", "none")}
    with pytest.raises(ValueError, match="unknown quantized format"):
        device_plan.quantization_config("nf4", config)
    folder = device_plan.write_model_folder(tmp_path, {
        **config, "quantization_config": device_plan.quantization_config("w4a16", config)})
    engine = EngineConfig.create(str(folder), load_format="dummy", dtype="bfloat16")
    assert engine.model.weights_scheme.format == "ct-pack"


def test_percentiles():
    stats = engine_measures.percentiles([0.3, 0.1, 0.2, 0.4])
    assert stats["count"] == 4 and stats["p50"] == pytest.approx(0.25)
    assert stats["p50"] <= stats["p90"] <= stats["p99"] <= 0.4
    assert engine_measures.percentiles([]) == {"count": 0}


# ----------------------------------------------------------------------------- torch backend


def tiny_report(tmp_path, **engine_overrides):
    """(report, folder, workload, jax runner) as run_engine_sections has them when the torch
    section starts: the tiny plan, made-up JAX numbers, the script's own engine arguments."""
    args = argparse.Namespace(requests=4, hf_requests=None, hf_batch_size=None,
                              max_seconds=600)
    plan = device_plan.Plan(tiny=True, quick=False, args=args)
    plan.decode_batches, plan.decode_steps = (1, 2), 2
    clock = device_plan.Clock(plan.budget_s)
    report = device_plan.Report(plan, clock, backend="cpu", model=plan.model_name)
    engine_args = dict(load_format="dummy", dtype="bfloat16", seed=0, precompile=True,
                       **plan.engine_args, **engine_overrides)
    report.data.update(
        engine_args=engine_args, bandwidth={"bytes_per_s": 1e10},
        weights={"bytes": 1 << 20},
        throughput={"output_tok_s": 100.0, "total_tok_s": 300.0, "truncated": False},
        decode={"batches": [{"batch": 1, "step_s": 0.01}, {"batch": 2, "step_s": 0.02}]})
    folder = device_plan.write_model_folder(tmp_path, plan.model_config)
    workload = make_workload(argparse.Namespace(workload="sharegpt-like", seed=0,
                                                num_prompts=plan.requests), 1000, None)
    # 8 sequences of max_model_len 1024 in blocks of 16, plus the null block
    runner = types.SimpleNamespace(num_blocks=8 * 64 + 1, bytes_per_block=4096)
    return report, folder, workload, runner


def test_torch_section_runs_beside_the_jax_numbers(tmp_path, capsys):
    """~15 s: the torch backend's engine on the tiny model (the PyTorch reference attention
    on the CPU): the same engine arguments and KV blocks, the whole workload, every decode
    batch, and the torch / JAX ratios against the JAX numbers already in the report."""
    import torch

    report, folder, workload, runner = tiny_report(tmp_path)
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    torch_section.run_torch_section(report, folder, workload, jax_runner=runner,
                                    id_limit=1000, seed=0)
    data = report.data
    assert data["errors"] == {} and data["skipped"] == {}, data["errors"]
    section = data["torch"]
    assert section["engine_args"] == dict(data["engine_args"], backend="torch",
                                          num_gpu_blocks_override=runner.num_blocks)
    assert section["device"] == "cpu" and not section["cuda_graphs"]
    assert section["warm_up_s"] > 0 and section["weights"]["bytes"] > 0
    run = section["throughput"]
    assert not run["truncated"] and run["finished"] == len(workload.prompts) == 4
    assert run["output_tokens"] == workload.output_tokens and run["recompilations"] == 0
    batches = section["decode"]["batches"]
    assert [b["batch"] for b in batches] == [1, 2]
    for b in batches:
        assert b["tokens_per_step"] == b["batch"] and b["ratio"] > 0
        assert b["floor_s"] == section["weights"]["floor_s"]
    ratios = section["vs_jax"]
    assert ratios["output_tok_s"] == pytest.approx(run["output_tok_s"] / 100.0)
    assert ratios["total_tok_s"] == pytest.approx(run["total_tok_s"] / 300.0)
    assert ratios["decode_step"] == {
        "1": pytest.approx(0.01 / batches[0]["step_s"]),
        "2": pytest.approx(0.02 / batches[1]["step_s"])}
    assert torch.get_num_threads() == threads and torch.is_grad_enabled() == grad
    json.dumps(data)
    del data["throughput"], data["decode"]  # made up: no TTFT, ITL or floors to print
    data["total_s"], data["device"] = 1.0, "cpu"
    capsys.readouterr()
    load_script().print_summary(data)
    summary = capsys.readouterr().out
    assert "torch backend throughput: 4/4 requests" in summary
    assert "torch decode batch   2:" in summary and "torch / JAX speed: " in summary


def test_torch_engine_that_cannot_start_is_reported(tmp_path, capsys):
    """An engine that fails to start (here: the compiled Triton kernels asked for on the
    CPU) is an error in the report, not an exception; the JAX numbers stand."""
    report, folder, workload, runner = tiny_report(tmp_path, attention_backend="triton")
    jax_numbers = dict(report.data["throughput"])
    torch_section.run_torch_section(report, folder, workload, jax_runner=runner,
                                    id_limit=1000, seed=0)
    data = report.data
    assert "needs a GPU" in data["errors"]["torch"] and data["torch"]["error"]
    assert data["throughput"] == jax_numbers and "throughput" not in data["torch"]
    assert data["torch"]["vs_jax"] == {}
    assert "FAILED torch" in capsys.readouterr().out


def test_torch_kv_blocks_and_ratios(monkeypatch):
    gib = 1 << 30
    # The host (or no memory figure): the JAX engine's count.
    assert torch_section.torch_kv_blocks(1000, 2 << 20, 16 * gib, None) == 1000
    # On a GPU beside JAX's pool: what fits in 90% of the free bytes after the weights and
    # the headroom, never more than JAX's count, never fewer than 2.
    fit = int((0.9 * 56 * gib - 16 * gib - torch_section.TORCH_HEADROOM) // (2 << 20))
    assert torch_section.torch_kv_blocks(30000, 2 << 20, 16 * gib, 56 * gib) == fit < 30000
    assert torch_section.torch_kv_blocks(4000, 2 << 20, 16 * gib, 56 * gib) == 4000
    assert torch_section.torch_kv_blocks(4000, 2 << 20, 16 * gib, 10 * gib) == 2
    assert torch_section.compare_backends({}, {}) == {}
    assert torch_section.ratios_line({"decode_step": {"1": 1.5}}) == "decode batch 1 1.50x"
    assert torch_section.torch_unavailable("cpu") is None
    monkeypatch.setitem(sys.modules, "triton", None)
    assert "not importable" in torch_section.torch_unavailable("cpu")
