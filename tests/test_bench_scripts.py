"""The benchmark scripts run end to end (on the tiny checkpoint, so in seconds).

Their numbers are not checked (timing belongs to the scripts, not to tests); what is
checked is that they finish, count what they claim to count, and that prefix caching on and
off give the same tokens.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from server_helpers import SMALL_ENGINE

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"
# The HTTP tests' engine shape: the executable cache serves the compiles to both.
ENGINE = SMALL_ENGINE


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
