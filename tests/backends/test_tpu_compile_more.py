"""test_tpu_compile.py's check for the engines with more device functions: int8 weights,
an fp8 KV cache, LoRA slots (the step with adapters and the slot write) and pooling (the
step and the pooling function), on Llama's tiny model, float32 and bfloat16."""

from __future__ import annotations

import json

import pytest
from support.tpu_compile import compile_case, tpu_shaped

CASES = [
    ("int8-weights", {"quantization": "int8"}, ()),
    ("fp8-kv-cache", {"kv_cache_dtype": "fp8"}, ()),
    ("lora", {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}, (("lora",),)),
    ("pooling", {"runner": "pooling"}, "pool"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name, options, extra", CASES, ids=[c[0] for c in CASES])
def test_engine_compiles_for_tpu(tiny_checkpoints, tmp_path, name, options, extra, dtype):
    compile_case(tpu_shaped(tiny_checkpoints["llama"], tmp_path / "llama"), dtype, options,
                 extra)


def test_cli_reports_every_function_beside_the_plan(tiny_checkpoints, tmp_path, capsys):
    """`jaxserve compile --json` on a v5e-4: every function a warm-up builds, each
    compiled and stored in the executable cache for the slice's hosts, the step's
    arguments the plan's, and a roofline row per step bucket."""
    from jaxserve.cli import main

    folder = tpu_shaped(tiny_checkpoints["llama"], tmp_path / "llama")
    args = ["compile", str(folder), "--device", "v5e-4", "--mesh", "1x2", "--max-num-seqs",
            "2", "--max-num-batched-tokens", "16", "--max-model-len", "256",
            "--kv-cache-memory-bytes", str(2 << 30), "--compilation-cache-dir",
            str(tmp_path / "cache"), "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    names = [f["name"] for f in report["functions"]]
    assert names == ["step-16-2", "step-16-1", "score-16", "bias", "grammar"]
    assert report["compiled"] and report["fits"] and abs(report["difference"]) < 0.1
    stored = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").rglob("*.jxc"))
    assert stored == ["bias", "grammar", "score", "step", "step"]
    assert [r["name"] for r in report["roofline"]["steps"]] == ["step-16-2", "step-16-1"]
    assert all(r["mode"] == "decode" and r["tokens_per_second"] > 0
               for r in report["roofline"]["steps"])
    assert main(args[:-1] + ["--context", "0"]) == 2  # a bad value: the error, no compile
    assert "--context must be >= 1" in capsys.readouterr().err
