"""scripts/bench_mla_decode.py: the DeepSeek-V3-shaped decode benchmark (multi-head latent
attention, dummy weights). Its presets parse as DeepSeek V3 with V3's attention per head
and routing; a tiny run in this process reports decode tok/s per batch size, no
compilation after the warm-up, and the latent cache's bytes per block (layers x S x
(C + R) x itemsize, the engine's own) against the MHA-equivalent's; the default run is
slow (minutes on 2 cores).
"""

from __future__ import annotations

import json

import pytest
from support.scripts import load_script as load_bench_script

from jaxserve.models.deepseek_arch import DeepseekArch

TINY = ["--preset", "tiny", "--batch-sizes", "1", "2", "--prompt-len", "8", "--output-len",
        "4", "--max-model-len", "64"]


def load_script():
    return load_bench_script("bench_mla_decode.py")


def test_presets_keep_v3_attention_and_routing():
    """Every preset is DeepSeek V3 to the architecture parser: V3's latent and head widths
    (C 512, R 64, P 128, V 128), its YaRN scale, sigmoid noaux_tc routing in groups, one
    shared expert and dense first layers; v3 is V3's own sizes; the overrides cut it."""
    bench = load_script()
    v3 = DeepseekArch.from_hf(bench.model_config(bench.parse_args(["--preset", "v3"])))
    for preset in bench.PRESETS:
        config = bench.model_config(bench.parse_args(["--preset", preset]))
        arch = DeepseekArch.from_hf(config)
        assert (arch.kv_lora_rank, arch.qk_rope_head_dim, arch.qk_nope_head_dim,
                arch.v_head_dim) == (512, 64, 128, 128)
        assert arch.softmax_scale == v3.softmax_scale and arch.rope_interleave
        assert (arch.scoring, arch.topk_method, arch.norm_topk_prob) == ("sigmoid", "noaux_tc",
                                                                         True)
        assert arch.num_groups > arch.topk_groups >= 2 and arch.num_experts % arch.num_groups == 0
        assert arch.shared_expert_size == arch.moe_intermediate_size
        assert not arch.sparse_layers[0] and all(arch.sparse_layers[-1:])
    assert (v3.hidden_size, v3.num_heads, v3.num_layers, v3.num_experts, v3.top_k,
            v3.moe_intermediate_size, v3.vocab_size, v3.q_lora_rank) == (
        7168, 128, 61, 256, 8, 2048, 129280, 1536)
    assert v3.sparse_layers[:4] == (False, False, False, True)
    small = DeepseekArch.from_hf(bench.model_config(bench.parse_args([])))
    assert (small.hidden_size, small.num_heads, small.num_experts, small.top_k,
            small.vocab_size, small.q_lora_rank) == (1024, 16, 16, 4, 32000, 1536)
    cut = bench.model_config(bench.parse_args(["--preset", "v3", "--layers", "4",
                                               "--experts", "12"]))
    arch = DeepseekArch.from_hf(cut)
    assert arch.num_layers == 4 and arch.sparse_layers == (False, False, False, True)
    assert arch.num_experts == 12 and arch.num_groups == 4 and arch.topk_groups == 4


def test_kv_capacity_of_v3():
    """V3's latent entry is 576 values per token and layer; its 128 heads' keys (192) and
    values (128) would be 40,960: 71x the blocks in one budget."""
    bench = load_script()
    config = bench.model_config(bench.parse_args(["--preset", "v3"]))
    kv = bench.kv_capacity(config, block_size=16, itemsize=2, budget=100 << 30)
    assert kv["latent_bytes_per_block"] == 61 * 16 * 576 * 2
    assert kv["mha_bytes_per_block"] == 61 * 16 * 128 * 320 * 2
    assert kv["ratio"] == pytest.approx(40960 / 576)
    assert kv["latent_blocks"] == (100 << 30) // kv["latent_bytes_per_block"]
    assert kv["latent_tokens"] == 16 * kv["latent_blocks"]
    assert kv["latent_blocks"] // kv["mha_blocks"] == 71


def check_report(report: dict, batch_sizes: list[int]) -> None:
    """What every run's report must say."""
    rows = report["rows"]
    assert [r["batch"] for r in rows] == batch_sizes
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["generate_tok_s"] > 0 and r["step_ms"] > 0
        assert 0 < r["tokens_per_step"] <= r["batch"]
        assert r["decode_tok_s"] == pytest.approx(r["tokens_per_step"] / r["step_ms"] * 1e3)
    assert report["recompilations_after_warm_up"] == 0
    config, kv = report["config"], report["kv"]
    layers, size = config["num_hidden_layers"], kv["block_size"]
    itemsize = 1 if report["kv_cache_dtype"] != "auto" else {"float32": 4,
                                                              "bfloat16": 2}[report["dtype"]]
    latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert kv["latent_bytes_per_block"] == layers * size * latent * itemsize
    assert report["engine_kv"]["bytes_per_block"] == kv["latent_bytes_per_block"]
    heads = config["num_attention_heads"]
    assert kv["mha_bytes_per_block"] == layers * size * heads * (128 + 64 + 128) * itemsize
    assert kv["budget_bytes"] == report["engine_kv"]["cache_bytes"]
    assert kv["latent_blocks"] == report["engine_kv"]["blocks"] + 1  # the null block too
    assert kv["mha_blocks"] < kv["latent_blocks"]


def test_tiny_run_reports_decode_and_kv(tmp_path, capsys):
    """~15-40 s (the dummy weights and two buckets compile; a warm executable cache loads
    them): two batch sizes, a few steps, in this process."""
    bench = load_script()
    out = tmp_path / "mla.json"
    assert bench.main(TINY + ["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    check_report(report, [1, 2])
    assert report["dtype"] == "float32" and report["platform"] == "cpu"
    assert report["mla_attention"] == "jaxserve.kernels_pallas.mla_ref.ragged_paged_mla"
    assert report["config"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert report["kv"]["ratio"] == pytest.approx(4 * 320 / 576)
    text = capsys.readouterr().out
    assert "decode tok/s" in text and "compilations after warm-up: 0" in text
    assert "MHA-equivalent 163,840 B/block" in text  # 2 layers x 16 x 4 x 320 x 4 B


@pytest.mark.slow  # the tiny run again (the suite's budget)
def test_tiny_run_with_an_fp8_latent_cache(tmp_path):
    """--kv-cache-dtype fp8: one byte per latent value in the engine and the report."""
    bench = load_script()
    out = tmp_path / "mla.json"
    assert bench.main(TINY + ["--kv-cache-dtype", "fp8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    check_report(report, [1, 2])
    assert report["kv_cache_dtype"] == "fp8" and report["kv"]["latent_bytes_per_block"] == (
        2 * 16 * (512 + 64))  # 2 layers x 16 tokens x (C + R) x 1 B


@pytest.mark.slow  # ~6 min on 2 busy cores: the default preset and batch sizes
def test_default_run(tmp_path):
    bench = load_script()
    out = tmp_path / "mla.json"
    assert bench.main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    check_report(report, [1, 8, 32, 64])
    rows = report["rows"]
    assert rows[-1]["decode_tok_s"] > rows[0]["decode_tok_s"]  # batching pays
