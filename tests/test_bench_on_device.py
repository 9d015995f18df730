"""scripts/bench_on_device.py: the GPU end-to-end benchmark, run here in its tiny CPU form.

The numbers themselves are not checked (timing belongs to the script); what is checked is
that every section runs and reports what it claims: throughput, ordered TTFT / ITL
percentiles, decode step times against the weight-bandwidth floor, and the HF baseline (or
why it was skipped). The fast tests check the GPU plan without a GPU: the Llama-3-8B folder
the script writes is one jaxserve accepts with the engine arguments it will run with.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_on_device.py"


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

    hf = data["hf"]
    if "skipped" in hf:
        assert isinstance(hf["skipped"], str) and hf["skipped"]
    else:
        assert hf["transformers"]["output_tok_s"] > 0 and hf["ratio"] > 0
        assert hf["transformers"]["output_tokens"] == hf["jaxserve"]["output_tokens"]
        assert hf["transformers"]["generated_tokens"] >= hf["transformers"]["output_tokens"]
        assert hf["jaxserve"]["requests"] == hf["requests"] == 4


def test_gpu_plan_is_llama3_8b_with_accelerator_engine_defaults(tmp_path):
    from jaxserve.config import EngineConfig

    script = load_script()
    args = script.argparse.Namespace(requests=None, hf_requests=None, hf_batch_size=None,
                                     max_seconds=None)
    plan = script.Plan(tiny=False, quick=False, args=args)
    assert plan.requests == 256 and plan.decode_batches == (1, 32, 256)
    assert plan.budget_s == 480 and plan.copy_bytes == 2 << 30
    quick = script.Plan(tiny=False, quick=True, args=args)
    assert quick.budget_s == 120 and quick.requests < plan.requests

    folder = script.write_model_folder(tmp_path, plan.model_config)
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
    assert script.kv_bytes_per_token(plan.model_config) == 128 * 1024


def test_percentiles():
    script = load_script()
    stats = script.percentiles([0.3, 0.1, 0.2, 0.4])
    assert stats["count"] == 4 and stats["p50"] == pytest.approx(0.25)
    assert stats["p50"] <= stats["p90"] <= stats["p99"] <= 0.4
    assert script.percentiles([]) == {"count": 0}
