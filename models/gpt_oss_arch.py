"""GPT-OSS (GptOssForCausalLM) architecture settings and checkpoint layout, numpy only.

GPT-OSS is a mixture-of-experts decoder in the Llama mould (mixtral_arch.MixtralArch's
settings) with these differences, each applied by the JAX model (models/jax/gpt_oss.py):

* attention: q/k/v/o biases, and a learned sink per query head (`self_attn.sinks`, f32[N])
  that joins every softmax's denominator (the attention kernels' `sinks`); sliding-window
  (128) and full layers alternate (`layer_types`); YaRN RoPE;
* the router has a bias; each token's top-k router logits are softmaxed (the weights sum
  to 1) and cast to the model dtype;
* experts have biases and a clamped SwiGLU: gate = min(gate, limit), up = clip(up, -limit,
  limit), h = (up + 1) * gate * sigmoid(alpha * gate), with alpha 1.702 and limit 7;
* RMSNorm multiplies by its weight in float32 before casting back (Llama casts first).

Checkpoint tensors: transformers' `experts.gate_up_proj` [E, D, 2F] interleaves gate and up
columns (gate at even, up at odd), `experts.down_proj` [E, F, D]; published checkpoints store
both in MXFP4 (`*_blocks`, `*_scales`; quantization_config.quant_method "mxfp4"), which stay
4-bit on the device and are dequantized in the step (quant_tensors.mxfp4_tensor,
models/jax/quantized.py).
"""

from __future__ import annotations

import dataclasses

from jaxserve.models import llama_arch, mixtral_arch
from jaxserve.models.llama_arch import LlamaArch
from jaxserve.models.mixtral_arch import MixtralArch
from jaxserve.models.pieces import Piece
from jaxserve.models.quant_tensors import mxfp4_tensor

QUANT_METHODS = (None, "mxfp4")  # quantization_config.quant_method values that load


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssArch(MixtralArch):
    swiglu_alpha: float
    swiglu_limit: float

    @classmethod
    def from_hf(cls, hf: dict) -> GptOssArch:
        method = (hf.get("quantization_config") or {}).get("quant_method")
        if method not in QUANT_METHODS:
            raise ValueError(f"GPT-OSS checkpoints quantized with {method!r} are not "
                             "supported; jaxserve loads bf16 and MXFP4 ones.")
        n = int(hf["num_hidden_layers"])
        if not hf.get("layer_types"):  # GptOssConfig's default: sliding on even layers
            hf = {**hf, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                        for i in range(n)]}
        base = {f.name: getattr(LlamaArch.from_hf(hf), f.name)
                for f in dataclasses.fields(LlamaArch)}
        base["attention_bias"] = bool(hf.get("attention_bias", True))
        return cls(**base, num_experts=int(hf["num_local_experts"]),
                   top_k=int(hf["num_experts_per_tok"]),
                   moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
                   cast_routing_weights=True, shared_expert_size=0, sparse_layers=(True,) * n,
                   swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                   swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


def _mxfp4(got: dict):
    return mxfp4_tensor(got["blocks"], got["scales"])


def hf_param_path(name: str, arch: GptOssArch):
    """llama_arch's mapping plus the o-projection bias, the sinks, the biased router and
    the experts (de-interleaved gate and up columns; MXFP4 pieces combined first)."""
    parts = name.removeprefix("model.").split(".")
    if len(parts) < 4 or parts[0] != "layers":
        return llama_arch.hf_param_path(name, arch)
    layer, rest = ("layers", int(parts[1])), ".".join(parts[2:])
    if rest.endswith(("_proj_blocks", "_proj_scales")):
        tensor, piece = name.rsplit("_", 1)
        return Piece(tensor, piece, ("blocks", "scales"), _mxfp4)
    table = {
        "self_attn.o_proj.bias": (layer + ("attn", "bo"), None),
        "self_attn.sinks": (layer + ("attn", "sinks"), None),
        "mlp.router.weight": (layer + ("mlp", "router"), lambda w: w.T),
        "mlp.router.bias": (layer + ("mlp", "router_bias"), None),
        "mlp.experts.gate_up_proj": [(layer + ("mlp", "experts_gate"), lambda w: w[..., ::2]),
                                     (layer + ("mlp", "experts_up"), lambda w: w[..., 1::2])],
        "mlp.experts.gate_up_proj_bias": [
            (layer + ("mlp", "experts_gate_bias"), lambda b: b[:, ::2]),
            (layer + ("mlp", "experts_up_bias"), lambda b: b[:, 1::2])],
        "mlp.experts.down_proj": (layer + ("mlp", "experts_down"), None),
        "mlp.experts.down_proj_bias": (layer + ("mlp", "experts_down_bias"), None),
    }
    if rest in table:
        return table[rest]
    return llama_arch.hf_param_path(name, arch)


def param_shapes(arch: GptOssArch, quantization: str | None = None) -> dict:
    """mixtral_arch.param_shapes plus the o-projection bias [D], the sinks [N], the router
    bias [E] and the experts' biases ([E, F] gate and up, [E, D] down)."""
    d, e, f, n = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size, arch.num_heads
    shapes = mixtral_arch.param_shapes(arch, quantization)
    for i in range(arch.num_layers):
        attn, mlp = ("layers", i, "attn"), ("layers", i, "mlp")
        shapes[attn + ("bo",)] = ((d,), None)
        shapes[attn + ("sinks",)] = ((n,), None)
        shapes[mlp + ("router_bias",)] = ((e,), None)
        shapes[mlp + ("experts_gate_bias",)] = ((e, f), None)
        shapes[mlp + ("experts_up_bias",)] = ((e, f), None)
        shapes[mlp + ("experts_down_bias",)] = ((e, d), None)
    return shapes
