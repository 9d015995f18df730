"""Meshes: `--mesh` parsing, the split checks at start-up, the partition rules, and greedy
tokens that do not depend on the mesh (tensor, kv-head replication, data parallel) on 8 fake
CPU devices (in a subprocess: the device count is fixed when JAX starts)."""

from __future__ import annotations

import pytest
from support import mesh_runs as mesh_runs_module
from support.mesh import mesh_runs
from support.parity import hf_greedy

from jaxserve import LLM
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.mesh import (
    MODEL,
    MeshShape,
    ModelDims,
    check_devices,
    param_spec,
    parse_mesh,
    plan_sharding,
)

NEW_TOKENS = mesh_runs_module.NEW_TOKENS
mesh_prompts = mesh_runs_module.prompts


@pytest.mark.parametrize("text,shape", [
    ("2x4", MeshShape(2, 4)), ("1x8", MeshShape(1, 8)), (" 8x1 ", MeshShape(8, 1)),
    ("data=2,model=4", MeshShape(2, 4)), ("model=4,data=2", MeshShape(2, 4)),
    ("model=8", MeshShape(1, 8)), ("data=2", MeshShape(2, 1)), (None, MeshShape(1, 1)),
])
def test_parse_mesh(text, shape):
    assert parse_mesh(text) == shape


@pytest.mark.parametrize("text", ["2x", "3*3", "x4", "data=2,data=1", "expert=2", "0x4",
                                  "2x4x1", "model=-1"])
def test_bad_mesh_strings_say_what_is_expected(text):
    with pytest.raises(ValueError, match="mesh"):
        parse_mesh(text)


DENSE = ModelDims(num_heads=8, num_kv_heads=2, hidden_size=64, intermediate_size=128,
                  vocab_size=1000)


@pytest.mark.parametrize("model,kv_heads,per_device", [(1, 2, 2), (2, 2, 1), (4, 4, 1),
                                                        (8, 8, 1)])
def test_kv_heads_split_or_replicate(model, kv_heads, per_device):
    plan = plan_sharding(DENSE, model)
    assert (plan.kv_heads, plan.kv_heads_per_device) == (kv_heads, per_device)
    assert plan.kv_replicas == kv_heads // 2


def test_models_that_cannot_split_are_refused_with_sizes_that_work():
    four_heads = ModelDims(4, 2, 64, 128, 1000)
    with pytest.raises(ValueError, match="4 attention heads do not divide by 8") as err:
        plan_sharding(four_heads, 8)
    assert "sizes that work: 1, 2, 4." in str(err.value)
    three_kv = ModelDims(6, 3, 60, 120, 1000)
    with pytest.raises(ValueError, match="no replication path"):
        plan_sharding(three_kv, 2)


def test_meshes_that_do_not_divide_the_devices_are_refused():
    with pytest.raises(ValueError, match="3x3 needs 9 devices") as err:
        check_devices(MeshShape(3, 3), 8, DENSE)
    assert "1x8" in str(err.value) and "2x4" in str(err.value) and "4x2" in str(err.value)
    check_devices(MeshShape(1, 4), 8, DENSE)  # a divisor: uses the first 4 devices


def test_partition_rules():
    plan = plan_sharding(DENSE, 4)
    assert param_spec(("layers", 0, "attn", "wq"), plan) == (None, MODEL, None)
    assert param_spec(("layers", 0, "attn", "wo"), plan) == (MODEL, None, None)
    assert param_spec(("layers", 1, "mlp", "w_down"), plan) == (MODEL, None)
    assert param_spec(("embed",), plan) == (None, MODEL)  # hidden 64 splits over 4
    assert param_spec(("layers", 1, "input_norm", "weight"), plan) == ()
    odd = plan_sharding(ModelDims(8, 2, 66, 128, 1000), 4)  # hidden 66: split the vocabulary
    assert param_spec(("lm_head",), odd) == (MODEL, None)


def test_start_up_refuses_a_bad_mesh_before_loading(tiny_checkpoints):
    with pytest.raises(ValueError, match="cannot be split over model=8"):
        LLM(str(tiny_checkpoints["mistral"]), mesh="1x8")  # 4 heads: 1, 2 or 4
    with pytest.raises(ValueError, match="sizes that work: 1, 2, 4"):
        LLM(str(tiny_checkpoints["llama"]), mesh="3x3")  # heads split by 3: no
    with pytest.raises(ValueError, match="1x2 needs 2 devices, which does not divide the 1"):
        LLM(str(tiny_checkpoints["llama"]), mesh="1x2", precompile=False)  # one device here
    with pytest.raises(ValueError, match="contradicts"):
        EngineConfig.create(str(tiny_checkpoints["llama"]), mesh="1x2", tensor_parallel_size=4)


# The 8-head tiny checkpoints: 1x4 and 1x8 replicate their 2 kv heads, 2x2 and 2x4 are two
# replicas. By default llama on the shapes that differ in kind (2x2: two replicas with the kv
# heads split; 1x8: kv heads replicated); every mesh of the issue, and qwen2 (tied embeddings,
# qkv bias), with -m slow (the suite's time budget).
ALL_MESHES = ["1x1", "1x2", "1x4", "2x2", "2x4", "1x8"]
MESH_CASES = [("llama", ["1x1", "2x2", "1x8"])] + [
    pytest.param(arch, ALL_MESHES, marks=pytest.mark.slow) for arch in ("llama", "qwen2")]


@pytest.mark.parametrize("arch,meshes", MESH_CASES, ids=["llama-kinds", "llama", "qwen2"])
def test_greedy_tokens_do_not_depend_on_the_mesh(arch, meshes, mesh_checkpoints):
    runs = mesh_runs(mesh_checkpoints[arch], meshes)
    single = runs["1x1"]["tokens"]
    for mesh, run in runs.items():
        assert run["tokens"] == single, mesh
        shape = parse_mesh(mesh)
        # replica r on devices r*M .. r*M + M - 1; every replica served requests and ran steps
        assert run["devices"] == [list(range(r * shape.model, (r + 1) * shape.model))
                                  for r in range(shape.data)]
        assert run["routed"] == [mesh_runs_module.NUM_PROMPTS // shape.data] * shape.data
        assert min(run["steps"]) > 0


@pytest.mark.parametrize("meshes", [["1x8:ep"], pytest.param(["1x4:ep"], marks=pytest.mark.slow),
                                    pytest.param(["1x4"], marks=pytest.mark.slow)],
                         ids=["expert-parallel-8", "expert-parallel-4", "tensor-parallel-4"])
def test_mixtral_matches_transformers_with_experts_sharded(meshes, tiny_checkpoints):
    """Experts split whole over 4 and 8 devices (expert parallelism), or split inside every
    expert (tensor parallelism): HF's greedy tokens each time (1 device: test_parity.py)."""
    folder = tiny_checkpoints["mixtral"]
    runs = mesh_runs(folder, meshes)
    want = hf_greedy(folder, mesh_prompts(), new_tokens=NEW_TOKENS)
    for mesh, run in runs.items():
        assert run["tokens"] == want, mesh
