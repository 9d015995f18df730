"""PEFT LoRA adapters read into the engine's layout (models/lora.py): the A and B it keeps per
kernel reproduce PEFT's own per-module delta (llama's seven modules, qwen2 with rank and
alpha patterns under rsLoRA, Phi-3's fused projections; kv heads replicated as the base
kernels'), and every unsupported adapter is refused with a message naming the problem."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil

import ml_dtypes
import numpy as np
import pytest
from support.lora_helpers import lora_module_names, make_adapter, make_phi3, peft_deltas

from jaxserve.models import lora, model_family
from jaxserve.models.lora import LORA_MODULES, LoRARequest, inspect_adapter, load_adapter

QWEN2_PATTERNS = dict(  # PEFT: each key matches a dotted suffix of the module's name
    rank_pattern={"layers.0.self_attn.q_proj": 4, "v_proj": 12},
    alpha_pattern={r"mlp\.(up|down)_proj": 5, "model.layers.1.self_attn.o_proj": 40})


def hf_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def replicated(folder):
    """The family's arch of a checkpoint with every kv head repeated twice (tensor
    parallelism over more devices than kv heads)."""
    config = hf_config(folder)
    arch = model_family(config).arch_from_hf(config)
    return dataclasses.replace(arch, num_kv_heads=arch.num_kv_heads * 2, kv_replicas=2)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    phi3 = make_phi3(root / "phi3-base")
    return {
        "llama": (tiny_checkpoints["llama"],
                  make_adapter(tiny_checkpoints["llama"], root / "llama", seed=1)),
        "qwen2": (tiny_checkpoints["qwen2"],
                  make_adapter(tiny_checkpoints["qwen2"], root / "qwen2", seed=2,
                               use_rslora=True, lora_alpha=24, **QWEN2_PATTERNS)),
        "phi3": (phi3, make_adapter(phi3, root / "phi3", seed=3, rank=6,
                                    target_modules=["qkv_proj", "gate_up_proj", "o_proj"])),
    }


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("kv_replicas", [1, 2])
def test_engine_layout_reproduces_peft_deltas(adapters, name, kv_replicas):
    base, adapter = adapters[name]
    config = hf_config(base)
    arch = replicated(base) if kv_replicas == 2 else None
    weights = load_adapter(adapter, config, max_lora_rank=16, arch=arch)
    rng = np.random.default_rng(0)
    modules = lora_module_names(adapter)
    inputs = {m: rng.standard_normal((3, size_in)).astype(np.float32)
              for m, (size_in, _) in modules.items()}
    deltas = peft_deltas(base, adapter, inputs)
    covered = set()
    for module, x in inputs.items():
        layer, kind = int(module.split(".")[2]), module.rsplit(".", 1)[1]
        start = 0
        for block, kernel in LORA_MODULES[kind]:
            path = ("layers", layer, block, kernel)
            a, b = weights[path]  # [*in, R], [R, *out]
            assert a.shape[-1] == b.shape[0] == 16 and a.dtype == b.dtype == np.float32
            rank = weights.spec.config.rank_of(module)
            assert not a[..., rank:].any() and not b[rank:].any()  # zero-padded
            got = np.tensordot(np.tensordot(x.reshape(3, *a.shape[:-1]), a, axes=a.ndim - 1),
                               b, axes=1)  # [T, *out]
            rep = kv_replicas if kernel in ("wk", "wv") else 1
            rows = int(np.prod(got.shape[1:])) // rep
            want = deltas[module][:, start:start + rows]
            start += rows
            want = np.repeat(want.reshape(3, got.shape[1] // rep, *got.shape[2:]), rep, axis=1)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(path))
            covered.add(path)
        assert start == deltas[module].shape[1]
    assert set(weights) == covered
    assert weights.nbytes == weights.spec.nbytes() == sum(a.nbytes + b.nbytes
                                                          for a, b in weights.values())


def test_patterns_and_rslora_follow_peft(adapters):
    """PEFT's pattern semantics: a key matches a dotted suffix (so "v_proj" is every layer's
    v_proj, and the layer-0 q_proj key not layer 1's), the first match wins; rsLoRA divides
    by sqrt(r)."""
    spec = inspect_adapter(adapters["qwen2"][1], hf_config(adapters["qwen2"][0]), 16)
    config = spec.config
    assert config.rank_of("model.layers.0.self_attn.q_proj") == 4
    assert config.rank_of("model.layers.1.self_attn.q_proj") == 8
    assert config.rank_of("model.layers.1.self_attn.v_proj") == 12
    assert config.scaling("model.layers.0.mlp.down_proj") == pytest.approx(5 / 8 ** 0.5)
    assert config.scaling("model.layers.1.self_attn.o_proj") == pytest.approx(40 / 8 ** 0.5)
    assert config.scaling("model.layers.0.self_attn.q_proj") == pytest.approx(24 / 2)
    assert spec.rank == 12


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
def test_inspect_reads_no_tensor_data_and_agrees_with_load(adapters, name, monkeypatch):
    base, adapter = adapters[name]
    weights = load_adapter(adapter, hf_config(base), 16)
    with monkeypatch.context() as m:
        m.setattr(np, "memmap", None)  # any read of the data would fail
        spec = inspect_adapter(adapter, hf_config(base), 16)
    assert spec.targets == tuple(sorted(weights)) == weights.spec.targets
    assert spec.rank == weights.spec.rank and spec.config == weights.spec.config
    assert spec.nbytes() == weights.nbytes
    assert pickle.loads(pickle.dumps(weights)).spec == spec


def test_half_precision_files_load_as_float32(adapters, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    base, adapter = adapters["llama"]
    half = shutil.copytree(adapter, tmp_path / "bf16")
    tensors = load_file(str(half / lora.WEIGHTS_FILE))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(half / lora.WEIGHTS_FILE))
    full = load_adapter(adapter, hf_config(base), 8)
    got = load_adapter(half, hf_config(base), 8)
    for path, (a, b) in got.items():
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, full[path][0], rtol=1e-2, atol=1e-3)
        np.testing.assert_allclose(b, full[path][1], rtol=1e-2, atol=1e-3)
    bf16 = load_adapter(adapter, hf_config(base), 8, dtype=ml_dtypes.bfloat16)
    assert next(iter(bf16.values()))[1].dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("edit,message", [
    ({"peft_type": "LOHA"}, "peft_type 'LOHA' is not supported"),
    ({"use_dora": True}, "use_dora=True: DoRA is not supported"),
    ({"bias": "all"}, "bias 'all' is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
    ({"r": 32}, "gives r = 32, over max_lora_rank 16; raise --max-lora-rank to at least 32"),
    ({"rank_pattern": {"q_proj": 17}}, "rank_pattern['q_proj'] = 17, over max_lora_rank 16"),
    ({"rank_pattern": {"q_proj": 4}}, "self_attn.q_proj has rank 8 but adapter_config.json "
                                      "gives it 4"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules names 'lm_head': LoRA on the "
                                                "embeddings or the lm_head is not supported"),
    ({"target_modules": ["w1"]}, "unknown target module 'w1'"),
    ({"target_modules": ["q_proj"]}, "is not among adapter_config.json's target_modules"),
    ({"target_modules": "(["}, "target_modules '([' is not a valid regex"),
    ({"layers_to_transform": [0]}, "model.layers.1."),
    ({"lora_alpha": "16"}, "lora_alpha must be a number"),
    ({"r": 0}, "r must be a positive integer"),
])
def test_unsupported_configs_are_refused(adapters, tmp_path, edit, message):
    base, adapter = adapters["llama"]
    folder = shutil.copytree(adapter, tmp_path / "edited")
    config = json.loads((folder / lora.CONFIG_FILE).read_text())
    (folder / lora.CONFIG_FILE).write_text(json.dumps({**config, **edit}))
    for read in (inspect_adapter, load_adapter):
        with pytest.raises(ValueError) as err:
            read(folder, hf_config(base), 16)
        assert message in str(err.value)


def test_a_regex_target_modules_matches_whole_names(adapters, tmp_path):
    base, adapter = adapters["llama"]
    folder = shutil.copytree(adapter, tmp_path / "regex")
    config = json.loads((folder / lora.CONFIG_FILE).read_text())
    config["target_modules"] = r".*\.(self_attn|mlp)\.\w+_proj"
    (folder / lora.CONFIG_FILE).write_text(json.dumps(config))
    assert len(inspect_adapter(folder, hf_config(base), 8).targets) == 14
    config["target_modules"] = r"self_attn\.\w+_proj"  # fullmatch: no module's whole name
    (folder / lora.CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is not among adapter_config.json's target_modules"):
        inspect_adapter(folder, hf_config(base), 8)


def test_ranks_over_the_limit_are_refused(adapters, tmp_path):
    base, adapter = adapters["llama"]
    with pytest.raises(ValueError, match="gives r = 8, over max_lora_rank 4"):
        inspect_adapter(adapter, hf_config(base), 4)
    folder = shutil.copytree(adapter, tmp_path / "understated")  # the tensors' own rank
    config = json.loads((folder / lora.CONFIG_FILE).read_text())
    (folder / lora.CONFIG_FILE).write_text(json.dumps({**config, "r": 4}))
    with pytest.raises(ValueError, match="has rank 8, over max_lora_rank 4"):
        inspect_adapter(folder, hf_config(base), 4)
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        inspect_adapter(adapter, hf_config(base), 0)


def test_peft_built_unsupported_adapters_are_refused(tiny_checkpoints, tmp_path):
    llama = tiny_checkpoints["llama"]
    cases = [
        (dict(use_dora=True, target_modules=["q_proj"]), "DoRA is not supported"),
        (dict(bias="all", target_modules=["q_proj"]), "bias 'all' is not supported"),
        (dict(target_modules=["q_proj", "lm_head"]), "'lm_head': LoRA on the embeddings"),
        (dict(target_modules=["embed_tokens"]), "'embed_tokens': LoRA on the embeddings"),
    ]
    for i, (extra, message) in enumerate(cases):
        folder = make_adapter(llama, tmp_path / str(i), seed=i, rank=4, **extra)
        with pytest.raises(ValueError, match=message):
            inspect_adapter(folder, hf_config(llama), 8)


def test_adapters_of_other_models_are_refused(adapters, tiny_checkpoints, tmp_path):
    base, adapter = adapters["llama"]
    wider = {**hf_config(base), "intermediate_size": 256}
    with pytest.raises(ValueError, match=r"mlp.down_proj's lora_A \[8, 128\] and lora_B "
                                         r"\[64, 8\] do not fit the base model: expected "
                                         r"lora_A \[r, 256\] and lora_B \[64, r\]"):
        inspect_adapter(adapter, wider, 8)
    shallower = {**hf_config(base), "num_hidden_layers": 1}
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj is in layer 1, but the "
                                         "base model has 1 layers"):
        inspect_adapter(adapter, shallower, 8)
    # Mixtral's MLPs are experts: a dense gate_proj has no kernel to go to.
    with pytest.raises(ValueError, match="mlp.down_proj targets mlp.w_down, which layer 0 of "
                                         "the base model does not have"):
        inspect_adapter(adapter, hf_config(tiny_checkpoints["mixtral"]), 8)
    # Qwen2-MoE: the shared expert's gate_proj, which LoRA here does not cover.
    moe = make_adapter(tiny_checkpoints["qwen2_moe"], tmp_path / "moe", seed=4, rank=4,
                       target_modules=["q_proj", "shared_expert.gate_proj"])
    with pytest.raises(ValueError, match=r"mlp\.shared_expert\.gate_proj\.lora_A\.weight' is "
                                         "not the lora_A/lora_B weight of a supported module"):
        inspect_adapter(moe, hf_config(tiny_checkpoints["qwen2_moe"]), 8)


def test_folders_without_a_usable_adapter_are_refused(adapters, tmp_path):
    base, adapter = adapters["llama"]
    config = hf_config(base)
    with pytest.raises(ValueError, match="does not exist; a LoRA path must be a local folder"):
        inspect_adapter(tmp_path / "nowhere", config, 8)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(adapter / lora.CONFIG_FILE, pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="adapter_model.bin: PyTorch pickles are never loaded"):
        inspect_adapter(pickled, config, 8)
    (pickled / lora.CONFIG_FILE).unlink()
    with pytest.raises(ValueError, match="cannot read adapter_config.json"):
        inspect_adapter(pickled, config, 8)
    (pickled / lora.CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        inspect_adapter(pickled, config, 8)
    (pickled / lora.CONFIG_FILE).write_text(" " * (lora.MAX_CONFIG_BYTES + 1))
    with pytest.raises(ValueError, match="larger than 1048576 bytes"):
        inspect_adapter(pickled, config, 8)
    cut = shutil.copytree(adapter, tmp_path / "cut")
    data = (cut / lora.WEIGHTS_FILE).read_bytes()
    (cut / lora.WEIGHTS_FILE).write_bytes(data[:-4])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        inspect_adapter(cut, config, 8)


def test_lora_request_is_vllms():
    request = LoRARequest("sql", 3, "/adapters/sql", base_model_name="base")
    assert (request.name, request.adapter_id, request.path) == ("sql", 3, "/adapters/sql")
    assert pickle.loads(pickle.dumps(request)) == request
    assert hash(request) == hash(LoRARequest("sql", 3, "/adapters/sql", base_model_name="base"))
    assert LoRARequest("sql", 3).lora_path == ""
    with pytest.raises(TypeError):
        LoRARequest("sql", 3, "/p", "base")  # base_model_name is a keyword
    for args, message in [(("", 1), "lora_name must be a non-empty string"),
                          (("a", 0), "lora_int_id must be an integer >= 1"),
                          (("a", True), "lora_int_id must be an integer >= 1"),
                          (("a", "1"), "lora_int_id must be an integer >= 1"),
                          (("a", 1, None), "lora_path must be a string")]:
        with pytest.raises(ValueError, match=message):
            LoRARequest(*args)
