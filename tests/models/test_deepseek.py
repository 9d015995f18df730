"""DeepSeek V2 / V3 (multi-head latent attention, grouped routing, shared experts): logprobs
against HF transformers under scheduler pressure, the routing against HF's routers, meshes
and expert parallelism, bfloat16, the MLA kernels carrying a generation, the checkpoint's
multi-token-prediction layers, and what the latent cache refuses. Greedy token parity on
the tiny checkpoints (plain and under chunked prefill, small blocks and preemption) is in
test_parity.py with the other families."""

from __future__ import annotations

import functools
import json
import logging
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

ARCHS = ("deepseek_v3", "deepseek_v2")


def hf_model(folder):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]):
    """f64[len(ids), V]: HF's next-token log-probabilities at every position."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers_under_pressure(arch, tiny_checkpoints, checkpoint_script):
    """Chunked prefill (16-token steps), 16-token blocks and a KV pool that preempts: every
    generated token's logprob and the top 3 alternatives equal HF's on the same sequence."""
    folder = tiny_checkpoints[arch]
    prompts = checkpoint_script.check_prompts()[:6]
    llm = LLM(str(folder), dtype="float32", max_model_len=128, precompile=False,
              block_size=16, num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=6)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                ignore_eos=True, logprobs=3), use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    model = hf_model(folder)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        want = hf_logprobs(model, prompt + tokens)[len(prompt) - 1:-1]  # [12, V]
        for step, (token, top) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert token == int(want[step].argmax())
            best = np.argsort(-want[step])[:3]
            assert set(top) >= {int(t) for t in best}
            for t, entry in top.items():
                assert abs(entry.logprob - want[step][t]) < 1e-4, (arch, step, t)


def test_routing_equals_transformers_routers():
    """route() against HF's V3 router (sigmoid, correction bias, groups by their two best)
    and V2's (softmax; greedy and group_limited_greedy), on random tokens."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from jaxserve.models.deepseek_arch import DeepseekArch
    from jaxserve.models.jax.deepseek import route

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=16, moe_intermediate_size=8,
                num_experts_per_tok=3, first_k_dense_replace=0)
    cases = [("v3", DeepseekV3Config(**base, n_group=4, topk_group=2, norm_topk_prob=True,
                                     routed_scaling_factor=2.5), DeepseekV3TopkRouter),
             ("v2-grouped", DeepseekV2Config(**base, n_group=4, topk_group=2,
                                             topk_method="group_limited_greedy",
                                             routed_scaling_factor=1.5), DeepseekV2TopkRouter),
             ("v2-greedy", DeepseekV2Config(**base, topk_method="greedy"),
              DeepseekV2TopkRouter)]
    for name, config, router_cls in cases:
        router = router_cls(config)
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape) * 0.5)
            correction = None
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
                correction = jnp.asarray(router.e_score_correction_bias.numpy())
            _, want_w, want_e = router(torch.tensor(x))
        hf = {**config.to_dict(), "architectures": [
            "DeepseekV3ForCausalLM" if name == "v3" else "DeepseekV2ForCausalLM"]}
        arch = DeepseekArch.from_hf(hf)
        got_w, got_e = route(jnp.asarray(x), (jnp.asarray(router.weight.detach().numpy().T),
                                              correction), arch=arch)
        order = np.argsort(want_e.numpy(), -1)
        want_e, want_w = (np.take_along_axis(a.numpy(), order, -1) for a in (want_e, want_w))
        order = np.argsort(np.asarray(got_e), -1)
        got_e, got_w = (np.take_along_axis(np.asarray(a), order, -1) for a in (got_e, got_w))
        np.testing.assert_array_equal(got_e, want_e, err_msg=name)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5, err_msg=name)


@pytest.mark.slow  # four meshes in a subprocess: the suite's time budget
def test_greedy_tokens_and_logprobs_do_not_depend_on_the_mesh(tiny_checkpoints):
    """1x2 and 1x4 split the 4 heads (each device keeps the whole latent cache), 1x4:ep puts
    2 whole experts on each device; int8 weights (the MLA projections too: wk_b and wv_b
    split by heads with their per-channel scales) give the same tokens on 1x1 and 1x2."""
    from support.mesh import mesh_runs

    runs = mesh_runs(tiny_checkpoints["deepseek_v3"],
                     ["1x1:lp", "1x2:lp", "1x4:lp", "1x4:ep,lp", "1x1:int8", "1x2:int8"])
    single = runs["1x1:lp"]
    for mesh in ("1x2:lp", "1x4:lp", "1x4:ep,lp"):
        assert runs[mesh]["tokens"] == single["tokens"], mesh
        for got, want in zip(runs[mesh]["logprobs"], single["logprobs"]):
            for a, b in zip(got, want):
                assert a.keys() == b.keys()
                assert max(abs(a[t] - b[t]) for t in a) < 1e-4, mesh
    assert runs["1x2:int8"]["tokens"] == runs["1x1:int8"]["tokens"]


def test_two_devices_with_expert_parallelism(tiny_checkpoints):
    """The default suite's mesh check: V2-Lite's shape on 1x2 with expert parallelism gives
    the one-device tokens."""
    from support.mesh import mesh_runs

    runs = mesh_runs(tiny_checkpoints["deepseek_v2"], ["1x1", "1x2:ep"])
    assert runs["1x2:ep"]["tokens"] == runs["1x1"]["tokens"]


def prompt_scores(model_or_llm, prompts) -> np.ndarray:
    """Each prompt token's logprob after the tokens before it, all prompts concatenated:
    from an HF model or, through prompt_logprobs, from an LLM."""
    if isinstance(model_or_llm, LLM):
        outs = model_or_llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0),
                                     use_tqdm=False)
        return np.concatenate([[entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:],
                                                                      p[1:])]
                               for o, p in zip(outs, prompts)])
    return np.concatenate([hf_logprobs(model_or_llm, p)[np.arange(len(p) - 1), p[1:]]
                           for p in prompts])


@pytest.mark.parametrize("arch", ["deepseek_v3", pytest.param("deepseek_v2",
                                                             marks=pytest.mark.slow)])
def test_bfloat16_stays_as_close_to_float32_as_transformers_does(arch, tiny_checkpoints,
                                                                 checkpoint_script):
    """Real checkpoints are bfloat16. These tiny random models (large gains, a latent of 32)
    move ~0.2 in mean |logprob| from float32 to bfloat16 in HF transformers itself, so the
    bound is HF's own gap: jaxserve's bfloat16 scores stay within 1.25x of it from float32,
    and closer to HF's bfloat16 scores than that gap."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, prompts = tiny_checkpoints[arch], checkpoint_script.check_prompts()[:6]
    hf = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        hf[dtype] = prompt_scores(model, prompts)
    ours = {dtype: prompt_scores(LLM(str(folder), dtype=dtype, max_model_len=256,
                                     precompile=False), prompts)
            for dtype in ("float32", "bfloat16")}
    hf_gap = np.abs(hf[torch.bfloat16] - hf[torch.float32]).mean()
    assert np.isfinite(ours["bfloat16"]).all()
    assert np.abs(ours["float32"] - hf[torch.float32]).max() < 1e-4
    assert np.abs(ours["bfloat16"] - ours["float32"]).mean() < 1.25 * hf_gap
    assert np.abs(ours["bfloat16"] - hf[torch.bfloat16]).mean() < hf_gap


@pytest.mark.slow  # Pallas interpret mode compiles each bucket slowly
@pytest.mark.parametrize("backend", ["interpret", "interpret-gpu"])
def test_mla_kernels_carry_a_generation(backend, tiny_checkpoints, checkpoint_script):
    """The TPU and GPU MLA kernels (interpret mode) in the engine's step give the reference's
    greedy tokens, with chunked prefill and decode rows mixed."""
    prompts = checkpoint_script.check_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for name in ("reference", backend):
        llm = LLM(str(tiny_checkpoints["deepseek_v3"]), dtype="float32", max_model_len=128,
                  precompile=False, max_num_batched_tokens=32, max_num_seqs=4,
                  attention_backend=name)
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
    assert tokens[backend] == tokens["reference"]


def test_multi_token_prediction_layers_are_skipped_and_named(tiny_checkpoints, tmp_path,
                                                             caplog, checkpoint_script):
    """A published V3 checkpoint holds num_nextn_predict_layers layers after the last decoder
    layer: they are skipped (logged by name) and the tokens do not change."""
    from safetensors.numpy import load_file, save_file

    src, dst = tiny_checkpoints["deepseek_v3"], tmp_path / "with-mtp"
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    extra = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items()
             if ".layers.2." in k}
    extra["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    prompts = checkpoint_script.check_prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = []
    for folder in (src, dst):
        with caplog.at_level(logging.INFO, logger="jaxserve.models.deepseek_arch"):
            llm = LLM(str(folder), dtype="float32", max_model_len=64, precompile=False)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)])
    assert runs[0] == runs[1]
    assert "skipping model.layers.3, a multi-token-prediction layer" in caplog.text


def test_fp8_block_checkpoint_gives_its_dequantized_weights_tokens(tiny_checkpoints, tmp_path,
                                                                   checkpoint_script):
    """DeepSeek-V3's published format: every projection (the MLA ones, kv_b_proj split into
    W_uk and W_uv, the experts and the shared expert) in FP8 blocks with weight_scale_inv,
    partial blocks included (kv_a_proj's 48 rows in blocks of 32), the router in float. With
    the activations' FP8 rounding taken away, the tokens are the dequantized folder's."""
    from support.quant_checkpoints import without_activations, write_quantized

    import jaxserve.config.engine_config as engine_config

    q, d = tmp_path / "q", tmp_path / "d"
    write_quantized(tiny_checkpoints["deepseek_v3"], q, d, "fp8-block", block=(32, 32))
    prompts = checkpoint_script.check_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=128, precompile=False)
    want = [o.outputs[0].token_ids for o in LLM(str(d), **engine).generate(prompts, params,
                                                                           use_tqdm=False)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_config, "checkpoint_scheme", without_activations)
        llm = LLM(str(q), **engine)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    from flax import nnx

    kinds = {str(p[-2]) for p, _ in nnx.to_flat_state(llm.engine.runner.params)
             if p[-1] == "values"}
    assert {"wq_a", "wq_b", "wkv_a", "wk_b", "wv_b", "wo", "experts_gate", "w_down"} <= kinds
    assert got == want


@pytest.mark.parametrize("engine_args,message", [
    (dict(backend="torch"), "runs on the JAX backend only"),
    (dict(enable_lora=True), "LoRA adapters on DeepseekV3ForCausalLM"),
])
def test_what_the_latent_cache_refuses(engine_args, message, tiny_checkpoints):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_checkpoints["deepseek_v3"]), dtype="float32", max_model_len=64,
            precompile=False, **engine_args)


@pytest.mark.parametrize("change,message", [
    ({"topk_method": "sinkhorn"}, "topk_method 'sinkhorn' is not supported"),
    ({"scoring_func": "relu"}, "scoring_func 'relu' is not supported"),
    ({"n_group": 3}, "does not divide into n_group 3"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"topk_group": 5}, "topk_group must be between 1 and n_group 4, got 5"),
    ({"num_experts_per_tok": 5}, "between 1 and the 4 experts of the topk_group 2 kept"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be between 1"),
    ({"kv_lora_rank": None}, "needs kv_lora_rank as a positive integer, got None"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    ({"v_head_dim": "128"}, "needs v_head_dim as a positive integer, got '128'"),
    ({"n_group": 8, "topk_group": 4}, "leaves 1 per group"),
])
def test_unsupported_configs_are_refused_by_name(change, message, tiny_checkpoints):
    from jaxserve.models import model_family

    hf = json.loads((tiny_checkpoints["deepseek_v3"] / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        model_family(hf).arch_from_hf({**hf, **change})


def test_parameter_table_is_the_models(tiny_checkpoints):
    """param_shapes (what `jaxserve plan` counts) lists exactly the Flax model's parameters,
    with and without the query LoRA and with int8 weights."""
    from flax import nnx

    from jaxserve.models import model_family

    for arch_name in ARCHS:
        hf = json.loads((tiny_checkpoints[arch_name] / "config.json").read_text())
        family = model_family(hf)
        arch = family.arch_from_hf(hf)
        for quantization in (None, "int8"):
            model = nnx.eval_shape(functools.partial(family.model_cls, arch, jnp.float32,
                                                     quantization=quantization))
            declared = {tuple(p): v.get_value().shape
                        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
            table = {p: s for p, (s, _) in family.param_shapes(arch, quantization).items()}
            assert declared == table, arch_name
