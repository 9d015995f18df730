"""The roofline prediction (config/roofline.py) against hand arithmetic on Llama-3.1-8B's
plan for a v5e-8 at --mesh 2x4."""

from __future__ import annotations

import json

import pytest

from jaxserve.benchmarks.published_configs import LLAMA_3_1_8B
from jaxserve.config.accelerators import preset
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.plan import make_plan
from jaxserve.config.roofline import predict


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    config = EngineConfig.create(str(folder), on_accelerator=True, mesh="2x4")
    return make_plan(config, preset("v5e-8").memory_bytes, tiled=True)


def test_decode_adds_the_context_reads_and_takes_the_slower_roof(plan):
    v5e = preset("v5e-8").device
    flops, weights = 2.0e9, 4.0e9  # per device, as the compiler would count them
    p = predict(plan, ("step", 16, 8), flops, weights, v5e, context=1024)
    kv = 8 * 1024 * plan.bytes_per_token  # 8 sequences' K and V of 1024 tokens
    assert p.mode == "decode" and p.bytes == weights + kv
    heads = 32 // 4  # query heads on a device
    assert p.flops == flops + 4 * 8 * 1024 * heads * 128
    assert p.memory_seconds == pytest.approx((weights + kv) / 8.2e11)
    assert p.bound == "memory" and p.seconds == p.memory_seconds
    assert p.tokens_per_second == pytest.approx(8 * 2 / p.seconds)  # 2 replicas


def test_prefill_counts_prompt_tokens(plan):
    v5e = preset("v5e-8").device
    p = predict(plan, ("step", 2048, 8), 5e13, 5e9, v5e, context=1024)
    assert p.mode == "prefill" and p.bound == "compute"
    assert p.tokens_per_second == pytest.approx(2048 * 2 / p.compute_seconds)


def test_an_accelerator_without_peak_flops_is_refused(plan):
    import dataclasses

    unknown = dataclasses.replace(preset("v5e-8").device, bf16_flops=0.0)
    with pytest.raises(ValueError, match="no peak FLOP/s"):
        predict(plan, ("step", 16, 8), 1.0, 1.0, unknown, context=16)


def test_buckets_with_a_token_per_row_are_decode(plan):
    v5e = preset("v5e-8").device
    assert predict(plan, ("step", 128, 128), 1e9, 1e9, v5e, context=64).mode == "decode"
    assert predict(plan, ("step", 128, 64), 1e9, 1e9, v5e, context=64).mode == "prefill"
