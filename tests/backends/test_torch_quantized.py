"""Checkpoints published quantized on the torch backend (models/torch/quantized.py): the
kernels dequantize bit for bit as the JAX backend's do and round activations with the same
formula; the torch model's components have the JAX model's paths; end to end, a weight-only
scheme's greedy tokens are the dequantized folder's and the JAX backend's, and a W8A8 scheme's
are the JAX backend's on the same folder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.quant_checkpoints import write_quantized

from jaxserve import LLM, SamplingParams
from jaxserve.models.quant_config import LinearQuant

ENGINE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, precompile=False,
              compilation_cache_dir=None)
PROMPTS = [[5, 17, 230, 41], [9, 10, 11, 12, 13, 14, 15], [600, 3]]
NEW_TOKENS = 10

CASES = {  # id: (writer scheme, writer kwargs, source checkpoint)
    "ct-w4a16-asym-actorder": ("ct-w4a16", {"symmetric": False, "act_order": True}, "llama"),
    "awq-moe": ("awq", {}, "mixtral"),
    "ct-int8": ("ct-int8", {}, "llama"),
    "fp8-block-128-moe": ("fp8-block", {"block": (128, 128)}, "qwen2_moe"),
    "fp8-block": ("fp8-block", {}, "llama"),
    "fp8-tensor-static": ("fp8-tensor", {"activations": "static"}, "llama"),
    "ct-fp8-channel": ("ct-fp8", {}, "llama"),
    "ct-fp8-weight-only": ("ct-fp8", {"activations": None}, "llama"),
    "ct-w8a16-channel": ("ct-w4a16", {"bits": 8, "group_size": 0}, "llama"),
    "gptq-v2-asym-actorder": ("gptq", {"gptq_format": "gptq_v2", "symmetric": False,
                                       "act_order": True}, "qwen2"),
    "gptq-8bit-asym": ("gptq", {"bits": 8, "symmetric": False}, "llama"),
    "ct-int8-moe": ("ct-int8", {}, "qwen3_moe"),
    "gptq-gemma2": ("gptq", {}, "gemma2"),
}
WEIGHT_ONLY = ("ct-w4a16-asym-actorder", "awq-moe", "gptq-gemma2", "ct-fp8-weight-only",
               "ct-w8a16-channel", "gptq-v2-asym-actorder", "gptq-8bit-asym")
DEFAULT = ("awq-moe",)  # the rest: -m slow


@pytest.fixture(scope="module")
def written(tiny_checkpoints, tmp_path_factory):
    """(case, dtype) -> (quantized folder, dequantized folder), written once."""
    cache = {}

    def get(case, dtype="float32"):
        if (case, dtype) not in cache:
            scheme, kwargs, arch = CASES[case]
            root = tmp_path_factory.mktemp(f"{case}-{dtype}")
            write_quantized(tiny_checkpoints[arch], root / "q", root / "d", scheme,
                            dtype=dtype, **kwargs)
            cache[case, dtype] = root / "q", root / "d"
        return cache[case, dtype]
    return get


def greedy(folder, backend: str, dtype="float32", **extra) -> list[list[int]]:
    llm = LLM(str(folder), dtype=dtype, backend=backend, **ENGINE, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


# ---- the kernels against the JAX backend's -----------------------------------------------

QUANTS = {
    "awq": LinearQuant("awq", "awq", "uint4", group_size=32, zero_point=True),
    "gptq-8bit-actorder": LinearQuant("gptq", "gptq", "uint8", group_size=32, zero_point=True,
                                      act_order=True),
    "ct-w4-partial-group": LinearQuant("compressed-tensors", "ct-pack", "uint4",
                                       group_size=48, zero=8),
    "fp8-block": LinearQuant("fp8", "fp8-block", "float8_e4m3fn", group_size=32,
                             block_rows=32, activations="dynamic-group",
                             activation_codes="float8_e4m3fn", activation_group=48),
    "fp8-static": LinearQuant("fp8", "fp8", "float8_e4m3fn", activations="static",
                              activation_codes="float8_e4m3fn"),
    "int8-token": LinearQuant("compressed-tensors", "ct-int", "int8",
                              activations="dynamic-token", activation_codes="int8"),
    "fp8-weight-only": LinearQuant("compressed-tensors", "ct-float", "float8_e4m3fn"),
    "mxfp4": LinearQuant("mxfp4", "mxfp4", "e2m1", group_size=32, kinds=("experts",)),
}
KERNELS = {"wq": (64, 4, 16), "wo": (4, 16, 64), "experts_up": (3, 64, 32)}


def _components(name, shape, quant, rng) -> dict[str, np.ndarray]:
    import ml_dtypes

    from jaxserve.models.quantization import stored_shapes

    out = {}
    for part, (part_shape, dtype) in stored_shapes(name, shape, quant).items():
        if part == "values" and dtype == "float8_e4m3fn":
            value = rng.uniform(-448, 448, part_shape).astype(ml_dtypes.float8_e4m3fn)
        elif part == "values":
            info = np.iinfo(dtype)
            value = rng.integers(info.min, info.max + 1, part_shape, dtype=dtype)
        elif part == "scale" and dtype == "uint8":
            value = rng.integers(110, 125, part_shape, dtype=np.uint8)
        elif part == "scale":
            value = rng.uniform(1e-4, 1e-2, part_shape).astype(np.float32)
        elif part == "zero":
            value = rng.integers(0, 1 << quant.bits, part_shape, dtype=np.uint8)
        elif part == "g_idx":
            value = rng.integers(0, part_shape[0] // quant.group_size, part_shape,
                                 dtype=np.int32)
        else:
            value = np.full(part_shape, 0.05, np.float32)
        out[part] = value
    return out


def _pair(name, quant, seed=0):
    """The same random kernel as a JAX and a torch QuantizedKernel."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.backends.torch.weights import _to_torch
    from jaxserve.models.jax import quantized as jq
    from jaxserve.models.torch import quantized as tq

    shape = KERNELS[name]
    parts = _components(name, shape, quant, np.random.default_rng(seed))
    jk, tk = jq.QuantizedKernel(name, shape, quant), tq.QuantizedKernel(name, shape, quant)
    for part, value in parts.items():
        setattr(jk, part, nnx.Param(jnp.asarray(value)))
        getattr(tk, part).copy_(_to_torch(value))
    return jk, tk


def _runs(quant: LinearQuant, name: str) -> bool:
    """Whether `quant` quantizes kernel `name` (no g_idx or static scales on experts)."""
    return quant.covers(name) and not (name.startswith("experts") and (
        quant.act_order or quant.activations == "static"))


@pytest.mark.parametrize("scheme,name", [  # every scheme on wo; wq and experts with -m slow
    (s, n) if n == "wo" else pytest.param(s, n, marks=pytest.mark.slow)
    for s in sorted(QUANTS) for n in sorted(KERNELS) if _runs(QUANTS[s], n)])
def test_kernels_dequantize_and_multiply_as_the_jax_backends(scheme, name):
    """Dequantized kernels (float32, bfloat16, one expert) and rounded activations bit for
    bit as the JAX model computes them (under jit); products to float32 accumulation order."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.models.jax import quantized as jq
    from jaxserve.models.torch import quantized as tq

    quant = QUANTS[scheme]
    jk, tk = _pair(name, quant)
    contracted = len(jq.CONTRACTED[name])
    x = np.random.default_rng(1).normal(0, 2, (5,) + KERNELS[name][:contracted])
    x = x.astype(np.float32)
    x[1] = 0  # an all-zero row: scale 1
    experts = name.startswith("experts")

    class Holder(nnx.Module):
        def __init__(self):
            setattr(self, name, jk)

    def jax_side(x):
        out = [jk.dequantized(jnp.float32), jk.dequantized(jnp.bfloat16).astype(jnp.float32)]
        if not experts:
            scale = jk.input_scale[...] if hasattr(jk, "input_scale") else None
            spec = {"wq": "td,dnh->tnh", "wo": "tnh,nhd->td"}[name]
            out += [jq.quantize_activations(x, quant, contracted, scale),
                    jq.matmul(spec, x, Holder(), name)]
        return [o.reshape(5, -1) if i > 1 else o for i, o in enumerate(out)]

    want = [np.asarray(o) for o in jax.jit(jax_side)(jnp.asarray(x))]
    np.testing.assert_array_equal(tk.dequantized(torch.float32).numpy(), want[0])
    np.testing.assert_array_equal(tk.dequantized(torch.bfloat16).float().numpy(), want[1])
    if experts:
        for e in range(KERNELS[name][0]):
            np.testing.assert_array_equal(tk.dequantized(torch.float32, e).numpy(), want[0][e])
        return
    flat = torch.from_numpy(x.reshape(5, -1))
    got = tq.quantize_activations(flat, quant, getattr(tk, "input_scale", None))
    np.testing.assert_array_equal(got.numpy(), want[2])
    holder = torch.nn.Module()
    setattr(holder, name, tk)
    got = tq.matmul(flat, holder, name).numpy()
    np.testing.assert_allclose(got, want[3], rtol=1e-5, atol=1e-6 * np.abs(want[3]).max())


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "gemma2"])
def test_the_torch_models_components_have_the_jax_models_paths(tiny_checkpoints, arch):
    import json

    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.backends.torch.weights import _path
    from jaxserve.models import model_family
    from jaxserve.models.torch.gemma import GemmaForCausalLM
    from jaxserve.models.torch.llama import LlamaForCausalLM

    hf = json.loads((tiny_checkpoints[arch] / "config.json").read_text())
    family = model_family(hf)
    model_arch = family.arch_from_hf(hf)
    quant = QUANTS["awq"]
    cls = GemmaForCausalLM if family.name == "gemma" else LlamaForCausalLM
    with torch.device("meta"):
        model = cls(model_arch, torch.float32, quantization=quant)
    got = {_path(n): (tuple(p.shape), str(p.dtype).removeprefix("torch."))
           for n, p in model.named_parameters()}
    abstract = nnx.eval_shape(lambda: family.model_cls(model_arch, jnp.float32,
                                                       quantization=quant))
    want = {tuple(path): (tuple(v.shape), str(v.dtype))
            for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    assert got == want
    assert ("layers", 0, "attn", "wq", "zero") in got


def test_dummy_weights_make_random_components(written):
    q, _ = written("ct-w4a16-asym-actorder")
    llm = LLM(str(q), backend="torch", load_format="dummy", **ENGINE)
    wq = llm.engine.runner.model.layers[0].attn.wq
    assert wq.values.dtype == torch.uint8 and len(torch.unique(wq.values)) > 100
    w = wq.dequantized(torch.float32)
    assert w.abs().max() <= 16 * 1e-3 / 8 and w.std() > 1e-4
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_int8_quantization_while_loading_stays_on_the_jax_backend(tiny_checkpoints):
    with pytest.raises(ValueError, match="int8 weights run on the JAX backend only"):
        LLM(str(tiny_checkpoints["llama"]), backend="torch", quantization="int8", **ENGINE)


# ---- greedy tokens -----------------------------------------------------------------------

@pytest.mark.parametrize("case", list(DEFAULT) + [
    pytest.param(c, marks=pytest.mark.slow) for c in WEIGHT_ONLY if c not in DEFAULT])
def test_weight_only_schemes_give_the_dequantized_folders_tokens(case, written):
    """The dequantized kernels are the dequantized folder's weights, bit for bit: the same
    tokens."""
    q, d = written(case)
    assert greedy(q, "torch") == greedy(d, "torch")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["awq-moe", "ct-w4a16-asym-actorder", "gptq-8bit-asym"])
def test_bfloat16_checkpoints_give_the_dequantized_folders_tokens(case, written):
    """bf16 scales and activations: the kernels dequantized to bf16 are the dequantized
    folder's bf16 weights."""
    q, d = written(case, "bfloat16")
    assert greedy(q, "torch", "bfloat16") == greedy(d, "torch", "bfloat16")


@pytest.mark.slow  # a JAX engine each (~10 s); by default the kernels are compared instead
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_torch_backend_gives_the_jax_backends_tokens(case, written):
    """The same rounding of activations and the same products: the same tokens (for the
    weight-only schemes, the JAX backend's tokens on the dequantized folder too)."""
    q, _ = written(case)
    assert greedy(q, "torch") == greedy(q, "jax")
