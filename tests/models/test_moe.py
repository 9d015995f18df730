"""Sparse MoE models (models/jax/mixtral.py): logits parity with HF transformers, the expert-slice
contract of moe_block that expert parallelism relies on, and both checkpoint layouts."""

from __future__ import annotations

import functools
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxserve.backends.jax.batch import Batch
from jaxserve.backends.jax.weights import load_params
from jaxserve.models import model_family, resolve_architecture
from jaxserve.models.jax.mixtral import MixtralArch, moe_block

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
BLOCK = 16


def load_model(folder):
    """As the runner loads a model: the family's arch, an abstract model, load_params."""
    hf = json.loads((folder / "config.json").read_text())
    family = model_family(hf)
    arch = family.arch_from_hf(hf)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    abstract = nnx.eval_shape(lambda: family.model_cls(arch, jnp.float32))
    return arch, load_params(abstract, folder, functools.partial(family.param_path, arch=arch),
                             np.float32, mesh)


def prompt_logits(arch, model, ids) -> np.ndarray:
    """f32[T, V] logits of every prompt token: one sequence, prefilled in one step, with the
    reference attention (the model's default) on pages 1..n of a fresh cache."""
    t, pages = len(ids), -(-len(ids) // BLOCK)
    batch = Batch(token_ids=jnp.asarray(ids, jnp.int32), positions=jnp.arange(t, dtype=jnp.int32),
                  slot_mapping=jnp.arange(BLOCK, BLOCK + t, dtype=jnp.int32),
                  cu_q_lens=jnp.asarray([0, t], jnp.int32), kv_lens=jnp.asarray([t], jnp.int32),
                  block_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
                  num_seqs=jnp.asarray([1], jnp.int32),
                  logits_indices=jnp.asarray([t - 1], jnp.int32))
    shape = (pages + 1, BLOCK, arch.num_kv_heads, arch.head_dim)
    caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(arch.num_layers)]
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, caches, batch):
        model = nnx.merge(graphdef, params)
        return model.logits(model(caches, batch)[1])

    return np.asarray(forward(params, caches, batch))


def hf_logits(folder, ids) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("arch_name", MOE_ARCHS)
def test_logits_match_transformers(arch_name, tiny_checkpoints, checkpoint_script):
    folder = tiny_checkpoints[arch_name]
    arch, model = load_model(folder)
    if arch_name == "qwen2_moe":  # the checkpoint's dense layer and shared expert are used
        assert arch.sparse_layers == (True, False, True) and arch.shared_expert_size == 64
    ids = checkpoint_script.check_prompts()[4]  # 60 tokens
    got, want = prompt_logits(arch, model, ids), hf_logits(folder, ids)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def random_experts(rng, num_tokens=37, d=16, e=8, f=24):
    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    return (normal(num_tokens, d), normal(d, e), normal(e, d, f, scale=0.25),
            normal(e, d, f, scale=0.25), normal(e, f, d, scale=0.25))


def dense_moe(x, router, w_gate, w_up, w_down, top_k, normalize):
    """Every expert on every token, weighted by the routing (zero off the top k), in numpy."""
    x, router, w_gate, w_up, w_down = map(np.asarray, (x, router, w_gate, w_up, w_down))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    kth = -np.sort(-probs, axis=-1)[:, top_k - 1:top_k]
    weights = np.where(probs >= kth, probs, 0.0)  # [T, E]
    if normalize:
        weights /= weights.sum(-1, keepdims=True)
    gate = np.einsum("td,edf->etf", x, w_gate)
    h = gate / (1 + np.exp(-gate)) * np.einsum("td,edf->etf", x, w_up)
    return np.einsum("etf,efd,te->td", h, w_down, weights)


@pytest.mark.parametrize("top_k,normalize", [(2, True), (3, False)])
def test_moe_block_matches_dense_routing(top_k, normalize):
    args = random_experts(np.random.default_rng(0))
    got = jax.jit(functools.partial(moe_block, top_k=top_k, normalize=normalize))(*args)
    np.testing.assert_allclose(got, dense_moe(*args, top_k, normalize), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slices", [2, 4])
def test_moe_block_expert_slices_sum_to_the_whole(slices):
    """Expert parallelism: each device runs its slice of the experts (first_expert traced, as
    axis_index * E_local is under shard_map); the psum of the slices is the full block."""
    x, router, w_gate, w_up, w_down = random_experts(np.random.default_rng(1))
    whole = moe_block(x, router, w_gate, w_up, w_down, top_k=2, normalize=True)
    run = jax.jit(functools.partial(moe_block, top_k=2, normalize=True))
    n = w_gate.shape[0] // slices
    parts = [run(x, router, w_gate[i:i + n], w_up[i:i + n], w_down[i:i + n],
                 first_expert=jnp.int32(i)) for i in range(0, w_gate.shape[0], n)]
    assert all(float(jnp.abs(p).max()) > 0 for p in parts)
    np.testing.assert_allclose(sum(parts), whole, atol=1e-5, rtol=1e-5)


def fuse_experts(src, dst):
    """Rewrite a checkpoint from the Hub's per-expert layout, which save_pretrained writes
    (`...experts.{j}.w1.weight` for Mixtral, `...experts.{j}.gate_proj.weight` for Qwen), into
    transformers 5's fused in-memory layout: `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows
    first) and `mlp.experts.down_proj` [E, D, F]; Mixtral's `block_sparse_moe.` becomes `mlp.`."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    fused, experts = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.fullmatch(r"(.*)\.experts\.(\d+)\.(\w+)\.weight", name)
        if m is None:
            fused[name] = w
            continue
        proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}.get(m[3], m[3])
        experts.setdefault(m[1], {}).setdefault(proj, {})[int(m[2])] = w
    for prefix, projs in experts.items():
        stack = {p: np.stack([ws[j] for j in sorted(ws)]) for p, ws in projs.items()}
        fused[f"{prefix}.experts.gate_up_proj"] = np.concatenate(
            [stack["gate_proj"], stack["up_proj"]], axis=1)
        fused[f"{prefix}.experts.down_proj"] = stack["down_proj"]
    save_file(fused, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("arch_name", ["mixtral", "qwen2_moe"])
def test_per_expert_and_fused_layouts_load_the_same(arch_name, tiny_checkpoints, tmp_path):
    from safetensors import safe_open

    src, dst = tiny_checkpoints[arch_name], tmp_path / "fused"
    with safe_open(src / "model.safetensors", "np") as f:  # save_pretrained wrote per expert
        assert any(".experts.7." in name for name in f.keys())
    fuse_experts(src, dst)
    ids = [0, 17, 300, 999, 5, 6]
    # HF reads it too (transformers 5.24 computes the two layouts with different rounding).
    np.testing.assert_allclose(hf_logits(dst, ids), hf_logits(src, ids), rtol=1e-5, atol=2e-5)
    per_expert = nnx.to_flat_state(nnx.state(load_model(src)[1]))
    fused = dict(nnx.to_flat_state(nnx.state(load_model(dst)[1])))
    assert len(per_expert) == len(fused)
    for path, var in per_expert:
        np.testing.assert_array_equal(var.get_value(), fused[path].get_value(), err_msg=str(path))


def test_a_missing_expert_is_refused(tiny_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    src, dst = tiny_checkpoints["mixtral"], tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 weights .*layers\.1\.mlp\.experts_up"):
        load_model(dst)


def test_model_family_and_sparse_layers():
    assert resolve_architecture({"architectures": ["Qwen3MoeForCausalLM"]})
    with pytest.raises(ValueError, match="Unsupported model architecture.*MixtralForCausalLM"):
        model_family({"architectures": ["JambaForCausalLM"]})
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=8)
    qwen2 = {**base, "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 2,
             "mlp_only_layers": [3], "shared_expert_intermediate_size": 8}
    arch = model_family(qwen2).arch_from_hf(qwen2)
    assert isinstance(arch, MixtralArch)
    assert arch.sparse_layers == (False, True, False, False)
    assert arch.attention_bias and not arch.norm_topk_prob and arch.cast_routing_weights
    mixtral = {**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
               "sliding_window": 64}
    arch = MixtralArch.from_hf(mixtral)
    assert arch.sparse_layers == (True,) * 4 and arch.sliding_windows == (64,) * 4
    assert arch.norm_topk_prob and arch.moe_intermediate_size == 32
    llama = model_family({"architectures": ["LlamaForCausalLM"]})
    assert llama.model_cls.__name__ == "LlamaForCausalLM"
