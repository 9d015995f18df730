"""`jaxserve plan` and the start-up log for multi-head latent attention (DeepSeek-V3): the
latent cache's bytes (61 layers x 576 values, whole on every device) beside what multi-head
attention with the same heads would keep, and the weights of the published FP8 checkpoint,
counted here by hand from config.json (not from the model's parameter table)."""

from __future__ import annotations

import json
import logging

import pytest

from jaxserve.benchmarks.published_configs import DEEPSEEK_V3
from jaxserve.cli import main
from jaxserve.config.accelerators import preset
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.latent_cache import kv_log_note
from jaxserve.config.mesh import MeshShape
from jaxserve.config.plan import DoesNotFit, make_plan, plan_dict
from jaxserve.config.plan_advice import plan_report, suggest
from jaxserve.config.plan_text import format_plan

GiB = 2**30
# V, D, F (dense), F of an expert, layers (dense ones), N, Q, C, R, P (nope), H_v, E
V, D, F, FE, L, DENSE, N, Q, C, R, P, HV, E = (129280, 7168, 18432, 2048, 61, 3, 128, 1536,
                                               512, 64, 128, 128, 256)
MOE = L - DENSE
LATENT = C + R  # 576 values per token and layer
MHA = N * (P + R) + N * HV  # 40,960: K of N heads of P + R, V of N heads of H_v
V5P_64 = preset("v5p-64")  # 32 chips (TensorCores counted as in the preset names), 8 hosts


def kernels(m: int) -> list[tuple[int, int, int, str]]:
    """Every linear kernel of one replica on a model axis of m devices (expert
    parallelism): (count, input rows, output columns, split: "rows", "out" or "" for
    replicated); the checkpoint quantizes all of them in 128 x 128 blocks."""
    return [
        (L, D, Q, ""), (L, D, C + R, ""),  # q_a_proj, kv_a_proj_with_mqa
        (L, Q, N * (P + R), "out"),  # q_b_proj: the heads split
        (L, C, N * P, "out"), (L, C, N * HV, "out"),  # kv_b_proj, as wk_b and wv_b
        (L, N * HV, D, "rows"),  # o_proj
        (2 * DENSE, D, F, "out"), (DENSE, F, D, "rows"),  # dense gate, up; down
        (2 * MOE, D, FE, "out"), (MOE, FE, D, "rows"),  # the shared expert's
        (2 * MOE * E, D, FE, "out"), (MOE * E, FE, D, "out")]  # experts, E / m whole each


# bfloat16 everywhere: embeddings and lm_head (split on D), the norms (two per layer, the
# query and latent norms, the final one), the router (replicated); the router's correction
# bias is kept in float32 (replicated)
SPLIT_BF16 = 2 * V * D
WHOLE_BF16 = L * (2 * D + Q + C) + D + MOE * D * E
CORRECTION = MOE * E


def num_params() -> int:
    return (sum(n * rows * out for n, rows, out, _ in kernels(1)) + SPLIT_BF16 + WHOLE_BF16
            + CORRECTION)


def fp8_bytes(m: int) -> int:
    """One device's bytes of the FP8 kernels: a byte per weight, and a float32 scale per 128
    input rows and output column (the engine expands the checkpoint's 128 x 128 block
    scales over the rows of each block), split as the kernel is; a scale split on its rows
    stays whole where a device's rows are not whole blocks (mesh._whole_groups)."""
    total = 0
    for n, rows, out, split in kernels(m):
        values, scales = rows * out, rows // 128 * out * 4
        whole_scales = split == "rows" and rows // m % 128
        total += n * (values // (m if split else 1) + scales // (1 if whole_scales or not split
                                                               else m))
    return total


def bf16_bytes(m: int) -> int:
    return 2 * sum(n * rows * out // (m if split else 1) for n, rows, out, split in kernels(m))


def weights_per_device(m: int, quantized: bool = True) -> int:
    return ((fp8_bytes(m) if quantized else bf16_bytes(m)) + 2 * (SPLIT_BF16 // m + WHOLE_BF16)
            + 4 * CORRECTION)


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> dict[str, str]:
    """'fp8': the published config; 'bf16': the same without quantization_config."""
    folders = {}
    for name, config in (("fp8", DEEPSEEK_V3),
                         ("bf16", {k: v for k, v in DEEPSEEK_V3.items()
                                   if k != "quantization_config"})):
        path = tmp_path_factory.mktemp(f"deepseek-v3-{name}")
        (path / "config.json").write_text(json.dumps(config))
        folders[name] = str(path)
    return folders


def plan_for(model: str, mesh: str, memory: int, **kwargs):
    config = EngineConfig.create(model, on_accelerator=True, mesh=mesh, expert_parallel=True,
                                 **kwargs)
    return make_plan(config, memory)


def test_parameters_are_the_main_model_without_the_mtp_layer(v3):
    """671.0B: DeepSeek's "671B" main model. The checkpoint's 685B add the MTP module
    (model.layers.61: one MoE decoder layer, its eh_proj [2D, D], enorm, hnorm and
    shared_head.norm, its own embed_tokens and shared_head.head), which the engine skips."""
    plan = plan_for(v3["fp8"], "1x8", preset("h200x8").memory_bytes)
    assert plan.num_params == num_params() == 671_026_419_200
    attention = D * Q + D * (C + R) + Q * N * (P + R) + C * N * (P + HV) + N * HV * D
    moe = 3 * (E + 1) * D * FE + D * E + E
    mtp = attention + moe + (2 * D + Q + C) + 2 * D * D + 3 * D + 2 * V * D
    assert (attention + moe, mtp) == (11_507_269_888, 13_463_426_304)
    assert round((num_params() + mtp) / 1e9) == 684  # "685B" on the Hub


@pytest.mark.parametrize("where,mesh", [("h200x8", "1x8"), ("v5p-64", "2x16"),
                                        ("v5p-64", "1x32")])
def test_fp8_checkpoint_weights_and_latent_cache(v3, where, mesh):
    """The published FP8 checkpoint with expert parallelism: weights per device as counted
    by hand; the latent cache's block 61 x 16 x 576 x 2 B on every device; 71x the blocks
    per GiB of multi-head attention per token, (N / m heads per device) / 576 per device."""
    memory = V5P_64.memory_bytes if where == "v5p-64" else preset(where).memory_bytes
    plan = plan_for(v3["fp8"], mesh, memory)
    m = plan.mesh.model
    assert plan.weight_bytes_per_device == weights_per_device(m)
    assert plan.bytes_per_block == 61 * 16 * 576 * 2 == 1_124_352
    assert plan.bytes_per_token == 61 * 576 * 2
    assert plan.num_blocks == (int(memory * 0.9) - weights_per_device(m)
                               - plan.sampler_state_bytes) // 1_124_352
    assert MHA == 40_960 and plan.latent.mha_values == MHA
    assert plan.mha_bytes_per_block == 61 * 16 * (MHA // m) * 2
    assert plan.blocks_per_gib / plan.mha_blocks_per_gib == pytest.approx(MHA / m / LATENT)
    assert plan.latent.token_ratio == pytest.approx(MHA / LATENT) and MHA / LATENT >= 40
    assert plan.latent.device_ratio == pytest.approx(MHA / m / LATENT)
    text = format_plan(plan)
    assert ("latent cache: 61 layers x 576 (512 latent + 64 rope) x 2 B bfloat16, replicated "
            "on every device") in text
    assert "= 40,960 values per token and layer" in text and "71.1x per token" in text
    assert f"{MHA / m / LATENT:.2f}x per device" in text
    assert "kv head" not in text.split("KV cache per device")[1].split("\n")[0]
    out = plan_dict(plan)
    assert out["latent"]["dim"] == 576 and out["latent"]["mha_values"] == MHA
    assert out["latent"]["mha_bytes_per_block"] == plan.mha_bytes_per_block


def test_fp8_latent_cache_halves_the_block(v3):
    """kv_cache_dtype fp8: one byte per latent value, so twice the blocks per GiB of the
    bf16 latent cache (and 142x multi-head attention's per token); the plan names the
    scales."""
    memory = preset("h200x8").memory_bytes
    bf16 = plan_for(v3["fp8"], "1x8", memory)
    fp8 = plan_for(v3["fp8"], "1x8", memory, kv_cache_dtype="fp8")
    assert fp8.bytes_per_block == 61 * 16 * 576 == bf16.bytes_per_block // 2
    assert fp8.blocks_per_gib == pytest.approx(2 * bf16.blocks_per_gib)
    text = format_plan(fp8)
    assert "x 1 B fp8_e4m3" in text and "a float32 scale per layer for the latent" in text


def test_numbers_for_the_report(v3):
    """The figures the report quotes (h200x8 at 1x8, v5p-64 at 2x16), stated once here."""
    h200 = plan_for(v3["fp8"], "1x8", preset("h200x8").memory_bytes)
    assert (h200.weight_bytes_per_device, h200.num_blocks) == (87_758_297_088, 42_865)
    assert h200.latent.device_ratio == pytest.approx(8.89, abs=0.01)
    v5p = plan_for(v3["fp8"], "2x16", V5P_64.memory_bytes)
    assert (v5p.weight_bytes_per_device, v5p.num_blocks) == (44_462_778_368, 41_836)
    # one device: the latent's 955 blocks per GiB against multi-head attention's 13.4
    one = plan_for(v3["fp8"], "1x1", 1024 * GiB)
    assert round(one.blocks_per_gib) == 955 and round(one.mha_blocks_per_gib, 1) == 13.4
    assert one.blocks_per_gib >= 40 * one.mha_blocks_per_gib


def test_v5p_64_meshes_plan_the_latent_cache(v3):
    """Every mesh of v5p-64 that fits sizes the same latent block; more replicas hold more
    of it in all (the latent is replicated over the model axis, not split)."""
    config = EngineConfig.create(v3["fp8"], on_accelerator=True, expert_parallel=True)
    report = plan_report(config, V5P_64.memory_bytes, V5P_64, mesh_given=False)
    fitting = [o for o in report.meshes if o.fits]
    assert [str(o.mesh) for o in fitting] == ["4x8", "2x16", "1x32"]
    # as a TPU tiles it: each token's 576 values in 5 tiles of 128 lanes (kv_sizing.tpu_tiled)
    assert {o.plan.bytes_per_block for o in fitting} == {L * 16 * 640 * 2}
    assert str(report.chosen.mesh) == "2x16"


def test_bf16_weights(v3):
    """Without quantization_config: bfloat16 weights, 1.25 TiB per replica. On 8 x H200
    they do not fit, and the suggestions offer int8 weights and an fp8 latent cache; on
    v5p-64 at 1x32 they do."""
    memory = preset("h200x8").memory_bytes
    config = EngineConfig.create(v3["bf16"], on_accelerator=True, mesh="1x8",
                                 expert_parallel=True)
    assert main(["plan", v3["bf16"], "--device", "h200x8", "--mesh", "1x8",
                 "--expert-parallel"]) == 2
    outcomes = suggest(config, memory, 8)
    flags = [f for o in outcomes for f in o.flags]
    assert "--quantization int8" in flags and "--kv-cache-dtype fp8" in flags
    with pytest.raises(DoesNotFit, match=r"--kv-cache-dtype fp8 \(or int8\) stores the KV"):
        make_plan(config, memory)
    plan = plan_for(v3["bf16"], "1x32", V5P_64.memory_bytes)
    assert plan.num_params == num_params()
    assert plan.weight_bytes_per_device == weights_per_device(32, quantized=False)
    assert plan.bytes_per_block == 1_124_352
    assert MeshShape(1, 32) == plan.mesh


def test_cli_prints_the_latent_cache(v3, capsys):
    assert main(["plan", v3["fp8"], "--device", "h200x8", "--mesh", "1x8",
                 "--expert-parallel"]) == 0
    out = capsys.readouterr().out
    assert "70,272 B per token (latent cache: 61 layers x 576" in out
    assert "as plain MHA       128 heads x (192 key + 128 value) = 40,960 values" in out
    assert main(["plan", v3["fp8"], "--device", "h200x8", "--mesh", "1x8",
                 "--expert-parallel", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_block"] == 1_124_352 and out["latent"]["dim"] == 576


def test_start_up_log_describes_the_latent_cache(tiny_checkpoints, caplog):
    """The tiny DeepSeek-V3 (3 layers, C 32 + R 16, 4 heads of 16 + 16 keys and 16 values):
    the engine's KV line says it is a latent cache and how much smaller."""
    from jaxserve import LLM

    model = str(tiny_checkpoints["deepseek_v3"])
    note = kv_log_note(EngineConfig.create(model, dtype="float32", max_model_len=128))
    mha = 4 * (32 + 16)
    assert note == (f"; latent cache: 3 layers x 48 (32 latent + 16 rope) x 4 B float32, on "
                    f"one device: {mha / 48:.1f}x fewer bytes per token than multi-head "
                    f"attention's {mha} values (4 heads x (32 key + 16 value))")
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.llm_engine"), LLM(
            model, dtype="float32", max_model_len=128, num_kv_blocks=16) as llm:
        assert llm.engine.runner.bytes_per_block == 3 * 16 * 48 * 4
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")]
    assert line.endswith(note)
    assert kv_log_note(EngineConfig.create(str(tiny_checkpoints["llama"]))) == ""
