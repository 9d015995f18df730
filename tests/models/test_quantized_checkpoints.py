"""Checkpoints published quantized, end to end: each scheme's folder (written as its
reference library writes it, tests/support/quant_checkpoints.py) against the exactly dequantized
float folder: the weights the engine holds, its greedy tokens on 1x1 and 1x4 meshes, in
float32 and bfloat16; schemes that quantize activations against HF transformers running the
dequantized folder with the same activation rounding; device bytes against stored bytes;
and the refusals (LLM, serve, plan) of what jaxserve does not read."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from support.mesh import mesh_runs
from support.quant_checkpoints import load_tensors, without_activations, write_quantized

from jaxserve import LLM, SamplingParams

ENGINE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, precompile=False,
              compilation_cache_dir=None)
PROMPTS = [[5, 17, 230, 41], [9, 10, 11, 12, 13, 14, 15], [600, 3]]
NEW_TOKENS = 10

CASES = {  # id: (writer scheme, writer kwargs, source checkpoint)
    "fp8-block": ("fp8-block", {}, "llama"),
    "fp8-block-128-moe": ("fp8-block", {"block": (128, 128)}, "qwen2_moe"),
    "fp8-tensor-static": ("fp8-tensor", {"activations": "static"}, "llama"),
    "ct-fp8-channel": ("ct-fp8", {}, "llama"),
    "ct-fp8-weight-only": ("ct-fp8", {"activations": None}, "llama"),
    "ct-int8": ("ct-int8", {}, "llama"),
    "ct-w4a16": ("ct-w4a16", {}, "llama"),
    "ct-w4a16-asym-actorder": ("ct-w4a16", {"symmetric": False, "act_order": True}, "llama"),
    "ct-w8a16-channel": ("ct-w4a16", {"bits": 8, "group_size": 0}, "llama"),
    "awq": ("awq", {}, "llama"),
    "awq-moe": ("awq", {}, "mixtral"),
    "gptq": ("gptq", {}, "llama"),
    "gptq-v2-asym-actorder": ("gptq", {"gptq_format": "gptq_v2", "symmetric": False,
                                       "act_order": True}, "qwen2"),
    "gptq-8bit-asym": ("gptq", {"bits": 8, "symmetric": False}, "llama"),
}
# Schemes that quantize activations: their tokens are HF's with the same rounding.
ACTIVATIONS = {"fp8-block": ("float8_e4m3fn", 32), "fp8-block-128-moe": ("float8_e4m3fn", 128),
               "fp8-tensor-static": ("float8_e4m3fn", "static"),
               "ct-fp8-channel": ("float8_e4m3fn", 0), "ct-int8": ("int8", 0)}


@pytest.fixture(scope="module")
def written(tiny_checkpoints, mesh_checkpoints, tmp_path_factory):
    """(case, dtype, mesh checkpoint?) -> (quantized folder, dequantized folder)."""
    cache = {}

    def get(case, dtype="float32", mesh=False):
        key = (case, dtype, mesh)
        if key not in cache:
            scheme, kwargs, arch = CASES[case]
            # on meshes: the 8-head llama and qwen2; the MoE checkpoints have 8 heads already
            source = (mesh_checkpoints[arch] if mesh and arch in mesh_checkpoints
                      else tiny_checkpoints[arch])
            root = tmp_path_factory.mktemp(f"{case}-{dtype}")
            write_quantized(source, root / "q", root / "d", scheme, dtype=dtype, **kwargs)
            cache[key] = root / "q", root / "d"
        return cache[key]
    return get


def greedy(folder, dtype="float32", logprobs=None, **extra):
    llm = LLM(str(folder), dtype=dtype, **ENGINE, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=logprobs)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return outputs, llm


def assert_same_or_near_tie(got: list[list[int]], reference, tolerance: float) -> None:
    """Greedy tokens equal the reference's; where they part, the token chosen must be within
    `tolerance` nats of the reference's own choice in the reference's logprobs there."""
    for tokens, ref in zip(got, reference):
        part = next((i for i, (a, b) in enumerate(zip(tokens, ref.token_ids)) if a != b), None)
        if part is None:
            continue
        top = ref.logprobs[part]
        assert tokens[part] in top, (part, tokens, ref.token_ids)
        gap = top[ref.token_ids[part]].logprob - top[tokens[part]].logprob
        assert gap <= tolerance, (part, gap, tokens, ref.token_ids)


def weights_of(llm) -> dict:
    """The engine's parameters as numpy arrays, by path; quantized kernels dequantized as
    the step does."""
    from flax import nnx

    from jaxserve.models.jax.quantized import QuantizedKernel

    model = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, QuantizedKernel):
            out[tuple(path)] = np.asarray(node.dequantized(np.float32))
        elif isinstance(node, nnx.Param) and not any(p in ("values", "scale", "zero", "g_idx",
                                                             "input_scale") for p in path[-1:]):
            out[tuple(path)] = np.asarray(node.get_value()).astype(np.float32)
    return out


# ---- the weights the engine holds --------------------------------------------------------

HELD_DEFAULT = ("fp8-block", "ct-int8", "ct-w4a16-asym-actorder", "awq-moe",
                "gptq-v2-asym-actorder")


@pytest.mark.parametrize("case", [c if c in HELD_DEFAULT else pytest.param(
    c, marks=pytest.mark.slow) for c in sorted(CASES)])
def test_every_scheme_holds_its_dequantized_weights(case, written):
    """The loader and the step's dequantization, exactly: every kernel dequantized on the
    device equals the dequantized folder's, every other tensor is the same."""
    q, d = written(case)
    quantized = LLM(str(q), load_format="auto", **ENGINE)
    plain = LLM(str(d), **ENGINE)
    got, want = weights_of(quantized), weights_of(plain)
    assert set(got) == set(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


# ---- greedy tokens -----------------------------------------------------------------------

@pytest.mark.parametrize("case", [  # by default: the mesh test compares one scheme's tokens
    pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES) if c not in ACTIVATIONS])
def test_weight_only_schemes_give_the_dequantized_folders_tokens(case, written):
    q, d = written(case)
    reference, _ = greedy(d, logprobs=5)
    got, _ = greedy(q)
    assert_same_or_near_tie([o.token_ids for o in got], reference, 1e-3)


@pytest.mark.slow  # bf16 by default: the readers' bf16 cases (test_quant_writers.py)
@pytest.mark.parametrize("case", ["awq", pytest.param("fp8-block", marks=pytest.mark.slow),
                                  pytest.param("ct-w4a16-asym-actorder",
                                               marks=pytest.mark.slow)])
def test_bfloat16_checkpoints_give_the_dequantized_folders_tokens(case, written):
    """bf16 scales and activations: the step's dequantized bf16 kernels are the dequantized
    folder's bf16 weights (test_every_scheme_holds_its_dequantized_weights checks them
    exactly), so the tokens are the same but where bf16 roundings differ: decode steps sum
    the products group by group in float32, the dequantized folder's matmul rounds once to
    bf16, which moves the tiny model's logprobs by up to about a tenth of a nat."""
    q, d = written(case, dtype="bfloat16")
    reference, _ = greedy(d, dtype="bfloat16", logprobs=5)
    if case in ACTIVATIONS:
        import jaxserve.config.engine_config as engine_config
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(engine_config, "checkpoint_scheme", without_activations)
            got, _ = greedy(q, dtype="bfloat16")
    else:
        got, _ = greedy(q, dtype="bfloat16")
    assert_same_or_near_tie([o.token_ids for o in got], reference, 0.25)


def hf_with_rounded_activations(q, d, codes: str, group):
    """HF transformers on the dequantized folder with every decoder projection's input
    rounded as the scheme says: per token (group 0), per token and `group` columns, or by
    the module's stored input_scale ("static")."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    stored = load_tensors(q / "model.safetensors")
    limit = 448.0 if codes == "float8_e4m3fn" else 127.0

    def rounding(name):
        def hook(module, args):
            x = args[0]
            flat = x.reshape(*x.shape[:-1], -1, group if isinstance(group, int) and group
                             else x.shape[-1])
            if group == "static":
                scale = torch.tensor(float(np.asarray(stored[f"{name}.input_scale"],
                                                      np.float32).reshape(())))
            else:
                scale = flat.abs().amax(-1, keepdim=True) / limit
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            v = (flat / scale).clamp(-limit, limit)
            v = v.round() if codes == "int8" else v.to(torch.float8_e4m3fn).float()
            return ((v * scale).reshape(x.shape),)
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name and "gate" != name[-4:]:
            module.register_forward_pre_hook(rounding(name))
    return model


def hf_greedy(model):
    import torch

    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(NEW_TOKENS):
                logits = model(ids).logits[0, -1].log_softmax(-1)
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("case", ["ct-int8", *(pytest.param(c, marks=pytest.mark.slow)
                                               for c in ACTIVATIONS if c not in (
                                                   "ct-int8", "fp8-block-128-moe"))])
def test_activation_quantized_schemes_match_hf_with_the_same_rounding(case, written):
    """Activations rounded per token, per group or by the static input_scale (fp8), or per
    token to int8 in an int8 dot: HF on the dequantized folder with the same rounding of
    every projection's input gives the same greedy tokens."""
    q, d = written(case)
    codes, group = ACTIVATIONS[case]
    want = hf_greedy(hf_with_rounded_activations(q, d, codes, group))
    got, _ = greedy(q)
    assert [o.token_ids for o in got] == want


@pytest.mark.slow
def test_moe_with_blockwise_fp8_matches_its_weights_with_activations_off(written):
    """Qwen2-MoE (experts, shared expert) in FP8 blocks of 128 (partial blocks of the tiny
    model): with the activation rounding taken away the tokens are the dequantized
    folder's, and with it they stay close (logprobs of the same tokens)."""
    import jaxserve.config.engine_config as engine_config

    q, d = written("fp8-block-128-moe")
    reference, _ = greedy(d, logprobs=5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_config, "checkpoint_scheme", without_activations)
        got, _ = greedy(q)
    assert_same_or_near_tie([o.token_ids for o in got], reference, 1e-3)
    rounded, _ = greedy(q)
    assert all(len(o.token_ids) == NEW_TOKENS for o in rounded)


# ---- meshes --------------------------------------------------------------------------------

MESH_CASES = ["ct-w4a16-asym-actorder", *(pytest.param(c, marks=pytest.mark.slow)
                                          for c in sorted(CASES)
                                          if c != "ct-w4a16-asym-actorder")]


@pytest.mark.parametrize("case", MESH_CASES)
def test_quantized_tokens_do_not_depend_on_the_mesh(case, written):
    """1x4 (8-head checkpoints: kv heads replicated, groups split with their rows or kept
    whole: activation order, per-channel scales, Mixtral's 16 expert rows per device in
    groups of 32) gives 1x1's tokens, and for weight-only schemes the dequantized
    folder's. Where activations are rounded, 1x4's partial sums (split contractions) can
    move a value across a rounding boundary, so its tokens may part from 1x1's only at a
    near tie in 1x1's logprobs."""
    q, d = written(case, mesh=True)
    runs = mesh_runs(q, ["1x1:lp", "1x4", f"1x1@{d}"])
    single = runs["1x1:lp"]
    if case in ACTIVATIONS:
        reference = [SimpleNamespace(token_ids=tokens, logprobs=[
            {int(t): SimpleNamespace(logprob=lp) for t, lp in top.items()} for top in tops])
            for tokens, tops in zip(single["tokens"], single["logprobs"])]
        assert_same_or_near_tie(runs["1x4"]["tokens"], reference, 0.05)
    else:
        assert runs["1x4"]["tokens"] == single["tokens"]
        assert single["tokens"] == runs[f"1x1@{d}"]["tokens"]


# ---- bytes ---------------------------------------------------------------------------------

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16")
CT_GROUPS = {"targets": ["Linear"], "input_activations": None}
PUBLISHED = {  # scheme: (quantization_config, stored bytes per linear weight element)
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, 1 + 4 / 128 ** 2),
    "w8a8": ({"quant_method": "compressed-tensors", "format": "int-quantized",
              "config_groups": {"g": {**CT_GROUPS, "weights": {
                  "num_bits": 8, "type": "int", "strategy": "channel"},
                  "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                        "dynamic": True}}}}, 1.0),
    "w4a16": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"g": {**CT_GROUPS, "weights": {
                   "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
              0.5 + 2 / 128),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
             "version": "gemm"}, 0.5 + (2 + 0.5) / 128),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
              "sym": True}, 0.5 + (2 + 0.5) / 128),
}


@pytest.mark.parametrize("scheme", sorted(PUBLISHED))
@pytest.mark.parametrize("mesh", ["1x1", "1x8"])
def test_plan_counts_within_ten_percent_of_the_stored_bytes(scheme, mesh, tmp_path):
    """An 8B model's weights per device, as `jaxserve plan` counts them, against the bytes
    the published format stores (linear layers quantized, the rest bf16) split over the
    devices; the plan names the scheme."""
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.config.plan import make_plan, plan_dict

    qc, per_element = PUBLISHED[scheme]
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_8B, "quantization_config": qc}))
    config = EngineConfig.create(str(tmp_path), mesh=mesh, on_accelerator=True)
    plan = plan_dict(make_plan(config, 80 << 30))
    d, f, layers, v = 4096, 14336, 32, 128256
    linear = layers * (d * (4096 + 2 * 1024) + 4096 * d + 3 * d * f)
    other = 2 * v * d + (2 * layers + 1) * d
    stored = (linear * per_element + other * 2) / int(mesh[-1])
    assert abs(plan["weight_bytes_per_device"] - stored) < 0.10 * stored, scheme
    assert plan["num_params"] == linear + other
    assert plan["quantization"] == config.model.weights_label


@pytest.mark.slow  # random 8B-wide weights on the CPU; by default the tiny AWQ model's below
@pytest.mark.parametrize("scheme", ["w4a16", "fp8-block", "w8a8", "awq"])
def test_device_bytes_within_ten_percent_of_the_stored_bytes(scheme, tmp_path, caplog):
    """Random weights (load_format dummy) of one 8B-wide layer in each format:
    the bytes the device holds (and the start-up log prints) against the bytes the published
    format stores, and equal to the plan's count."""
    import jax

    from jaxserve.benchmarks.device_plan import write_model_folder
    from jaxserve.config.plan import make_plan

    caplog.set_level("INFO", logger="jaxserve.backends.jax.runner")
    qc, per_element = PUBLISHED[scheme]
    config = {**LLAMA_8B, "num_hidden_layers": 1, "vocab_size": 1024,
              "quantization_config": qc}
    write_model_folder(tmp_path, config)
    llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", **ENGINE)
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(llm.engine.runner.params))
    d, f = 4096, 14336
    linear = d * (4096 + 2 * 1024) + 4096 * d + 3 * d * f
    stored = linear * per_element + (2 * 1024 * d + 3 * d) * 2
    assert stored <= held < 1.10 * stored
    assert f"weights {held / 2**20:.2f} MiB per device" in caplog.text
    assert make_plan(llm.engine.config, 80 << 30).weight_bytes_per_device == held


def test_start_up_log_counts_the_quantized_bytes(written, caplog):
    caplog.set_level("INFO", logger="jaxserve.backends.jax.runner")
    q, _ = written("awq")
    llm = LLM(str(q), **ENGINE)
    assert "AWQ int4, groups of 32" in caplog.text
    import jax

    held = sum(leaf.nbytes for leaf in jax.tree.leaves(llm.engine.runner.params))
    stored = sum(math.prod(a.shape) * a.dtype.itemsize
                 for a in load_tensors(q / "model.safetensors").values())
    # AWQ's f16 scales are held as f32 and its packed zeros one per byte: 4-bit codes
    # plus 5 bytes per group of 32 against the file's 2.5
    assert stored < held < 1.15 * stored
    from jaxserve.config.plan import make_plan

    assert make_plan(llm.engine.config, 1 << 30).weight_bytes_per_device == held


# ---- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("method,name", [("gguf", "GGUF"), ("bitsandbytes", "bitsandbytes"),
                                         ("hqq", "HQQ")])
def test_unsupported_methods_are_refused_by_llm_serve_and_plan(method, name, tiny_checkpoints,
                                                               tmp_path):
    folder = tmp_path / method
    folder.mkdir()
    for file in tiny_checkpoints["llama"].iterdir():
        (folder / file.name).symlink_to(file)
    (folder / "config.json").unlink()
    config = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    message = f"{name} checkpoints are not supported"
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), **ENGINE)
    if method != "gguf":  # serve and plan: once
        return
    for command in (["serve", str(folder), "--port", "18431"],
                    ["plan", str(folder), "--device-memory", "1GiB"]):
        out = subprocess.run([sys.executable, "-m", "jaxserve.cli", *command],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and message in out.stderr, (command, out.stderr[-2000:])


def test_quantization_flag_must_match_the_checkpoint(written):
    q, d = written("awq")
    with pytest.raises(ValueError, match="quantization='gptq' does not match"):
        LLM(str(q), quantization="gptq", **ENGINE)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(q), quantization="int8", **ENGINE)
    LLM(str(q), quantization="awq_marlin", **ENGINE)  # vLLM's name for the same format


def test_a_plain_tensor_where_the_config_says_quantized_is_named(written, tmp_path):
    from safetensors.numpy import save_file

    q, d = written("gptq")
    tensors = load_tensors(q / "model.safetensors")
    plain = load_tensors(d / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{name}.{suffix}"]
    tensors[f"{name}.weight"] = plain[f"{name}.weight"]
    folder = tmp_path / "mixed"
    folder.mkdir()
    for file in q.iterdir():
        if file.name != "model.safetensors":
            (folder / file.name).symlink_to(file)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"{name}.weight.*stored unquantized"):
        LLM(str(folder), **ENGINE)
