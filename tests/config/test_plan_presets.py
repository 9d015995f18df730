"""`jaxserve plan --device PRESET`: the presets' memory and device counts, the meshes a
multi-device preset can take, and what fits when the configuration does not, on
Llama-3.1-8B's config.json. Every number is checked against make_plan of the changed
configuration (the engine's arithmetic) or against a formula."""

from __future__ import annotations

import json

import pytest

from jaxserve.benchmarks.published_configs import LLAMA_3_1_8B
from jaxserve.cli import main
from jaxserve.config.accelerators import preset
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.mesh import MeshShape
from jaxserve.config.plan import make_plan
from jaxserve.config.plan_advice import mesh_options, plan_report, suggest, variant

GiB = 2**30
V, D, F, L, N, K, H = 128256, 4096, 14336, 32, 32, 8, 128
# int8 linear layers: a byte per weight and a float32 scale per output channel; embeddings,
# lm_head and norms stay bfloat16
INT8_WEIGHTS = (L * (2 * D * N * H + 2 * D * K * H) + L * (N * H + 2 * K * H + D) * 4
                + L * 3 * D * F + L * (2 * F + D) * 4 + 2 * V * D * 2 + (2 * L * D + D) * 2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama-3.1-8b")
    (path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    return str(path)


def config_for(model: str, **kwargs) -> EngineConfig:
    return EngineConfig.create(model, on_accelerator=True, **kwargs)


def test_colab_v5e_1_fits_with_int8_weights(llama, capsys):
    assert main(["plan", llama, "--device", "colab-v5e-1"]) == 2
    out, err = capsys.readouterr()
    assert "the weights alone do not fit" in err and "16.00 GiB" in err
    lines = out.splitlines()
    assert lines[0].startswith("device       colab-v5e-1: 1 x TPU v5e (16.00 GiB")
    assert "What fits on colab-v5e-1, keeping the most quality first" in out
    [int8] = [line for line in lines if "--quantization int8" in line]
    # 16 GiB x 0.9 - int8 weights - the sampler state of 257 rows, in blocks of 16 tokens
    # (2 x 32 layers x 8 kv heads x 128 x 2 B = 2 MiB each), the null block aside
    state = 257 * (V * 9 + V // 32 * 4)
    blocks = int(16 * GiB * 0.9 - INT8_WEIGHTS - state) // (2 * L * 16 * K * H * 2)
    assert INT8_WEIGHTS == 9_086_705_664 and blocks == 2896
    assert (f"fits: weights 8.46 GiB per device, {(blocks - 1) * 16:,} KV tokens, "
            f"{(blocks - 1) // 512} sequences of max_model_len=8192 (5.65)") in int8
    # one device: no wider model axis to suggest; fp8 alone leaves bfloat16 weights
    assert "--mesh" not in out
    assert "--kv-cache-dtype fp8  does not fit: the weights alone do not fit" in out
    assert main(["plan", llama, "--device", "colab-v5e-1", "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert not report["fits"] and report["device"]["preset"] == "colab-v5e-1"
    first = report["suggestions"][0]
    assert first["flags"] == ["--quantization int8"] and first["fits"]
    assert first["weight_bytes_per_device"] == INT8_WEIGHTS
    assert first["kv_tokens"] == (blocks - 1) * 16


def test_v5e_16_lists_every_mesh_with_its_capacity(llama, capsys):
    assert main(["plan", llama, "--device", "v5e-16"]) == 0
    out = capsys.readouterr().out
    assert "v5e-16: 16 x TPU v5e (16.00 GiB, 820 GB/s each) on 4 hosts" in out
    table = out[out.index("meshes"):out.index("the plan below")].splitlines()
    rows = {line.split()[0]: line for line in table[2:] if line.strip()}
    for mesh in ("4x4", "2x8", "1x16", "8x2"):  # 8x2 fits: 7.48 GiB of weights per device
        data = int(mesh.split("x")[0])
        plan = make_plan(config_for(llama, mesh=mesh), 16 * GiB, tiled=True)  # a TPU's
        assert rows[mesh].split()[3:] == [
            f"{plan.kv_tokens:,}", f"{plan.max_concurrency:,}", f"{data * plan.kv_tokens:,}",
            f"{data * plan.max_concurrency:,}"], mesh
    assert "does not fit: the weights alone do not fit" in rows["16x1"]
    # the plan printed is the mesh that holds the most sequences over all replicas: 4x4, as
    # a TPU holds one bf16 kv head per device (2x8, 1x16) in the tiles of two
    assert "the plan below is 4x4" in out and "mesh         4x4: 4 replicas" in out


def test_mesh_options_need_a_model_axis_the_heads_split_over(llama):
    config = config_for(llama)
    meshes = {str(o.mesh) for o in mesh_options(config, 16 * GiB, 12)}
    assert meshes == {"12x1", "6x2", "3x4"}  # 32 heads: not over 3, 6 or 12


def test_wider_model_axis_comes_first_when_devices_allow(llama):
    config = config_for(llama)  # 1x1: 15.24 GiB of weights and state on 14.40 GiB usable
    found = suggest(config, 16 * GiB)  # --device-memory: the device count is unknown
    assert [o.flags for o in found] == [("--mesh 1x2",), ("--quantization int8",),
                                        ("--kv-cache-dtype fp8",), ("--max-model-len 1024",)]
    assert [o.fits for o in found] == [True, True, False, False]
    wider = make_plan(variant(config, mesh=MeshShape(1, 2)), 16 * GiB)
    assert found[0].plan == wider
    assert [o.flags[0] for o in suggest(config, 16 * GiB, max_devices=1)][0] \
        == "--quantization int8"


def test_kv_too_small_for_one_sequence_suggests_fp8_then_a_shorter_max_model_len(llama):
    # int8 weights leave ~5.66 GiB of KV: 46,320 tokens, not one sequence of 65,536
    config = config_for(llama, quantization="int8", max_model_len=65536)
    report = plan_report(config, 16 * GiB, preset("v5e-1"))
    assert report.plan is None and "too little room for the KV cache" in report.error
    fp8, shorter = report.suggestions
    assert fp8.flags == ("--kv-cache-dtype fp8",) and fp8.fits
    assert fp8.plan == make_plan(variant(config, kv_cache_dtype="fp8"), 16 * GiB, tiled=True)
    assert fp8.plan.kv_tokens == 2 * 46_320 + 16  # one byte per element: twice the blocks
    # the longest multiple of 1024 whose table (+ the null block) fits in 2,895 blocks
    assert shorter.flags == ("--max-model-len 46080",) and shorter.fits
    with pytest.raises(ValueError):
        make_plan(variant(config, max_model_len=46080 + 1024), 16 * GiB)


def test_changes_are_combined_when_none_fits_alone(llama):
    # 10.5 GiB: int8 weights need 8.74 GiB with the sampler state, plus 1 GiB for one
    # bfloat16 sequence of 8192 > 9.45 GiB usable; with an fp8 cache 0.5 GiB fits
    found = suggest(config_for(llama), int(10.5 * GiB), max_devices=1)
    assert not any(o.fits for o in found[:-1])
    assert found[-1].flags == ("--quantization int8", "--kv-cache-dtype fp8")
    assert found[-1].fits and found[-1].plan.max_concurrency == 1


def test_cli_device_flags(llama, capsys):
    with pytest.raises(SystemExit):  # argparse: the error lists the known presets
        main(["plan", llama, "--device", "v5e-3"])
    assert "known: colab-v5e-1, kaggle-v3-8" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one of --device and --device-memory
        main(["plan", llama, "--device", "v5e-8", "--device-memory", "16GiB"])
    with pytest.raises(SystemExit):
        main(["plan", llama])
    capsys.readouterr()
    assert main(["plan", llama, "--device", "v5e-8", "--mesh", "2x8"]) == 2
    assert "mesh 2x8 needs 16 devices, but v5e-8 has 8" in capsys.readouterr().err
    assert main(["plan", llama, "--device", "h100x8", "--mesh", "1x8"]) == 0
    out = capsys.readouterr().out
    assert "h100x8: 8 x NVIDIA H100 (80.00 GiB" in out and "meshes" not in out
    assert main(["plan", llama, "--device", "kaggle-v3-8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"]["pallas_kernel"] is False
    # 2x4: 1x8 would hold one bf16 kv head per device, in the tiles of two
    assert report["mesh"] == {"data": 2, "model": 4, "num_devices": 8}
    assert [m["mesh"] for m in report["meshes"]] == ["8x1", "4x2", "2x4", "1x8"]


def test_device_line_names_the_generation_dtype(llama, capsys):
    assert main(["plan", llama, "--device", "v6e-8", "--mesh", "1x8", "--dtype", "float32"]) == 0
    assert "the model runs in float32; TPU v6e computes in bfloat16 (--dtype bfloat16)" \
        in capsys.readouterr().out
    assert main(["plan", llama, "--device", "v6e-8", "--mesh", "1x8"]) == 0
    assert "computes in" not in capsys.readouterr().out
