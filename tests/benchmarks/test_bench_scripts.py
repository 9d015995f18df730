"""The benchmark scripts run end to end (on the tiny checkpoint, so in seconds).

Their numbers are not checked (timing belongs to the scripts, not to tests); what is
checked is that they finish, count what they claim to count, and that prefix caching on and
off give the same tokens; bench_quantized.py's ratios are checked on made-up times.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.scripts import SCRIPTS, load_script
from support.server_helpers import SMALL_ENGINE

# The HTTP tests' engine shape: the executable cache serves the compiles to both.
ENGINE = SMALL_ENGINE


# The pooling tests' engine shape (pooling_refs.POOL_ENGINE): the executable cache serves its compiles here too.
POOL_ENGINE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128",
               "--num-kv-blocks", "10", "--attention-backend", "reference"]


def run_script(name: str, *args, timeout=600) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


# Slow: two engines compile every bucket (the suite's time budget); prefix caching itself is
# tested by default in test_prefix_caching.py.
@pytest.mark.slow
def test_bench_offline_shared_prefix_compares_caching(tiny_checkpoints, tmp_path):
    report = tmp_path / "report.json"
    out = run_script("bench_offline.py", "--model", str(tiny_checkpoints["llama"]),
                     "--workload", "shared-prefix", "--num-prompts", "6", "--prefix-len", "64",
                     "--suffix-len", "8", "--output-len", "4", "--compare-prefix-caching",
                     "--json", str(report), *ENGINE)
    assert "token-identical" in out.stdout
    data = json.loads(report.read_text())
    on, off = data["jaxserve prefix caching on"], data["jaxserve prefix caching off"]
    assert data["outputs_identical"] and on["outputs"] == off["outputs"]
    assert on["prefix_cache_hit_rate"] > 0.5 and off["prefix_cache_hit_rate"] == 0
    for run in (on, off):
        assert run["recompilations_after_warm_up"] == 0
        assert [len(o) for o in run["outputs"]] == [4] * 6
        assert 0 < run["kv_utilisation_peak"] <= 1


@pytest.mark.slow
def test_bench_offline_with_hf_baseline(tiny_checkpoints, tmp_path):
    report = tmp_path / "report.json"
    out = run_script("bench_offline.py", "--model", str(tiny_checkpoints["llama"]),
                     "--workload", "sharegpt-like", "--num-prompts", "6", "--baseline", "hf",
                     "--hf-batch-sizes", "2", "4", "--hf-sweep-requests", "4", "--json",
                     str(report), *ENGINE)
    assert "jaxserve / HF output tok/s" in out.stdout
    data = json.loads(report.read_text())
    assert data["hf"]["best_batch_size"] in (2, 4)
    assert data["hf"]["output_tokens"] == data["output_tokens"]
    assert data["hf"]["generated_tokens"] >= data["output_tokens"]
    assert sum(len(o) for o in data["jaxserve"]["outputs"]) == data["output_tokens"]


# Slow (the suite's time budget): pooling against transformers is in test_pooling.py.
@pytest.mark.slow
def test_bench_embeddings_matches_transformers_and_counts_tokens(pooling_checkpoints,
                                                                 tmp_path):
    report = tmp_path / "report.json"
    out = run_script("bench_embeddings.py", "--model", str(pooling_checkpoints["qwen3-embed"]),
                     "--num-inputs", "12", "--median-len", "24", "--max-len", "100",
                     "--hf-batch-size", "4", "--json", str(report), *POOL_ENGINE)
    assert "jaxserve / HF tok/s" in out.stdout
    data = json.loads(report.read_text())
    ours, hf = data["jaxserve"], data["hf"]
    assert data["inputs"] == 12 and ours["tokens"] == hf["tokens"] == data["tokens"]
    assert hf["padded_tokens"] >= data["tokens"] and ours["recompilations_after_warm_up"] == 0
    assert ours["tok_s"] > 0 and data["ratio"] == pytest.approx(ours["tok_s"] / hf["tok_s"])
    assert data["max_cosine_distance"] < 1e-5  # the same embeddings, LAST-pooled, normalized


def test_bench_structured_compares_constrained_and_free_batches(tiny_checkpoints, tmp_path):
    report = tmp_path / "report.json"
    out = run_script("bench_structured.py", "--model", str(tiny_checkpoints["llama"]),
                     "--num-requests", "8", "--output-len", "12", "--json", str(report),
                     *ENGINE)
    assert "throughput ratio" in out.stdout
    data = json.loads(report.read_text())
    free, half = data["unconstrained"], data["half_constrained"]
    assert free["output_tokens"] == half["output_tokens"] == 8 * 12
    assert half["mask_ms_per_step"] > 0 and free["mask_ms_per_step"] == 0
    assert data["recompilations_after_warm_up"] == 0


@pytest.mark.slow
def test_bench_spec_decode_compares_plain_and_ngram(tiny_checkpoints, tmp_path):
    """Two engines compile every bucket: slow. Greedy outputs must be identical (the script
    exits non-zero otherwise) and the n-gram run must have verified proposals."""
    report = tmp_path / "report.json"
    out = run_script("bench_spec_decode.py", "--model", str(tiny_checkpoints["llama"]),
                     "--num-prompts", "6", "--output-len", "24", "--repeats", "1",
                     "--max-model-len", "1024", "--json", str(report),
                     "--max-num-seqs", "4", "--max-num-batched-tokens", "64")
    assert out.stdout.count("token-identical") == 2
    data = json.loads(report.read_text())
    for name in ("code-edits", "sharegpt-like"):
        assert data[name]["outputs_identical"]
        assert data[name]["ngram"]["proposed"] > 0
        assert data[name]["ngram"]["recompilations"] == 0


@pytest.mark.slow  # two engines, each running its workload twice
def test_bench_hybrid_kv_counts_both_layouts(tmp_path):
    """The Gemma 3-shaped model with window layers holding their window and holding
    everything: both finish every request, and the windowed one holds more sequences of
    max_model_len in the same KV budget."""
    report = tmp_path / "report.json"
    out = run_script("bench_hybrid_kv.py", "--layers", "6", "--hidden", "64", "--window", "32",
                     "--max-model-len", "256", "--kv-mib", "1", "--requests", "6", "--prompt",
                     "96", "--output", "8", "--json", str(report))
    assert "ratios" in out.stdout
    data = json.loads(report.read_text())
    plain, hybrid = data["runs"]
    assert not plain["hybrid"] and hybrid["hybrid"] and hybrid["groups"] == ["None"] + ["32"] * 5
    assert data["ratios"]["capacity"] > 2
    assert plain["output_tok_s"] > 0 and hybrid["output_tok_s"] > 0


@pytest.mark.slow  # five engines (bf16, three formats, the rest), each compiling its bucket
def test_bench_quantized_compares_weight_formats(tmp_path):
    """The tiny Llama in bf16, FP8 blocks, W4A16 and AWQ (groups of 32), the engines taking
    turns: every variant decodes its batch, its layers hold the format's bytes, and the
    ratios against bf16 and the per-layer times (against the rest engine) are reported."""
    report = tmp_path / "report.json"
    out = run_script("bench_quantized.py", "--tiny", "--batches", "2", "--rounds", "2",
                     "--variants", "fp8", "w4a16", "awq", "--json", str(report))
    assert "layer speed x" in out.stdout
    data = json.loads(report.read_text())
    assert data["errors"] == {} and data["interleaved"]
    rows = data["variants"]
    assert list(rows) == ["bf16", "fp8", "w4a16", "awq", "rest"]
    assert rows["fp8"]["quantization_config"]["weight_block_size"] == [32, 32]
    assert rows["w4a16"]["label"] == "compressed-tensors INT4 per group of 32"
    # Per weight: 1 (fp8) or 1/2 (int4) byte, a 4-byte scale per 32 rows, AWQ a 1-byte zero
    # too, against bf16's 2 (the layers' bf16 norms move it by under 1%).
    for name, per_weight in {"fp8": 1 + 4 / 32, "w4a16": 0.5 + 4 / 32,
                             "awq": 0.5 + 5 / 32}.items():
        weights = rows[name]["weights"]
        assert weights["layer_bytes_vs_bf16"] == pytest.approx(per_weight / 2, rel=0.01)
        assert weights["bytes"] < rows["bf16"]["weights"]["bytes"]
    for name, row in rows.items():
        [r] = row["decode"]
        assert r["batch"] == 2 and r["tokens_per_step"] == 2 and r["steps"] == 2
        assert r["step_s"] > 0 and len(r["rounds_s"]) == 2
        if name != "rest":
            assert r["speed_vs_bf16"] > 0 and "per_layer_s" in r


def test_bench_quantized_ratios_pair_the_rounds():
    """Each ratio is the median of the rounds' own ratios: a round the machine ran twice as
    slow for every engine leaves it unchanged; per layer: (step - rest step) / layers."""
    bench = load_script("bench_quantized.py")
    row = lambda total, layers, rounds: {"weights": {"bytes": total, "layer_bytes": layers},
                                         "decode": [{"batch": 1, "rounds_s": rounds}]}
    rows = {"bf16": row(1000, 800, [1.0, 2.0, 1.0]), "fp8": row(600, 400, [1.2, 2.4, 1.2]),
            "rest": row(200, 0, [0.2, 0.4, 0.2])}
    bench.add_ratios(rows, layers=2)
    fp8 = rows["fp8"]
    assert fp8["weights"]["bytes_per_layer"] == 200
    assert fp8["weights"]["bytes_vs_bf16"] == 0.6 and fp8["weights"]["layer_bytes_vs_bf16"] == 0.5
    [r] = fp8["decode"]
    assert r["speed_vs_bf16"] == pytest.approx(1 / 1.2)
    assert r["per_layer_rounds_s"] == pytest.approx([0.5, 1.0, 0.5])
    assert r["per_layer_s"] == pytest.approx(0.5)
    assert r["per_layer_speed_vs_bf16"] == pytest.approx(0.4 / 0.5)
    assert rows["bf16"]["decode"][0]["per_layer_speed_vs_bf16"] == pytest.approx(1)
    assert "speed_vs_bf16" not in rows["rest"]["decode"][0]
    # The whole 8B model: bf16 embeddings and lm_head (Llama-3's vocabulary) and 32 layers.
    whole = bench.projection(rows)
    head = 2 * (2 * 128256 * 4096 + 4096)
    assert whole["fp8"]["bytes"] == head + 32 * 200
    assert whole["fp8"]["vs_bf16"] == pytest.approx((head + 6400) / (head + 32 * 400))


# Slow: two engines (one with LoRA slots) compile every bucket; LoRA's correctness is tested
# in test_lora_format.py and the LoRA tests.
@pytest.mark.slow
def test_bench_lora_runs_base_adapters_and_lora_path(tiny_checkpoints, tmp_path):
    """Every configuration generates the whole batch, no compile after the warm-up, the LoRA
    engine with no adapter gives the base model's tokens and the adapters change them."""
    report = tmp_path / "report.json"
    out = run_script("bench_lora.py", "--model", str(tiny_checkpoints["llama"]),
                     "--num-prompts", "6", "--median-len", "12", "--max-len", "40",
                     "--output-len", "6", "--repeats", "2", "--adapter-dir",
                     str(tmp_path / "adapters"), "--json", str(report), "--max-num-seqs", "2",
                     "--max-num-batched-tokens", "16", "--max-model-len", "64",
                     "--num-kv-blocks", "10", "--attention-backend", "reference")
    assert "lora / base" in out.stdout
    data = json.loads(report.read_text())
    assert data["prompts"] == 6 and data["output_tokens"] == 36 and data["dtype"] == "float32"
    assert len(data["adapters"]) == 4 and data["rank"] == 16
    for name in ("base", "lora", "lora-off"):
        row = data["configs"][name]
        assert len(row["output_tok_s_all"]) == 2 and row["output_tok_s"] > 0
    assert data["recompilations_after_warm_up"] == 0
    assert data["lora_off_tokens_identical_to_base"]
    assert data["prompts_changed_by_adapters"] > 0
    assert data["ratio_lora_vs_base"] > 0 and data["ratio_lora_off_vs_base"] > 0


def test_bench_lora_ratios_pair_the_rounds():
    """Each ratio is the median of the rounds' own ratios: a round the machine ran slow for
    every configuration leaves it unchanged."""
    bench = load_script("bench_lora.py")
    rows = lambda *tok_s: [{"output_tok_s": v} for v in tok_s]
    runs = {"base": rows(100.0, 50.0, 100.0), "lora": rows(80.0, 40.0, 90.0)}
    assert bench.median_ratio(runs, "lora", "base") == pytest.approx(0.8)


@pytest.mark.slow  # (a server of its own: the suite's budget)
def test_bench_responses_chain_continues_each_turn(tiny_checkpoints, tmp_path):
    out = run_script("bench_responses_chain.py", "--model", str(tiny_checkpoints["llama"]),
                     "--turns", "5", "--turn-mb", "0.05", "--json", str(tmp_path / "r.json"),
                     "--", *ENGINE)
    report = json.loads(out.stdout)
    assert report == json.loads((tmp_path / "r.json").read_text()) and report["ok"]
    assert len(report["seconds"]) == len(report["rss_mib"]) == 5
    # Each 50 kB turn is past the 512-token context: truncation "auto" fits every one.
    assert all(400 < n <= 512 - 8 for n in report["input_tokens"])
    assert report["rss_start_mib"] > 0 and report["latency_last5_over_first5"] > 0
