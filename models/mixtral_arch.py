"""The mixture-of-experts family's architecture settings and checkpoint layout (Mixtral,
Qwen2-MoE, Qwen3-MoE), shared by both backends: MixtralArch extends LlamaArch with the MoE
settings; hf_param_path adds the routers and experts (stacked [E, D, F] / [E, F, D]) to
llama_arch's mapping. numpy only.
"""

from __future__ import annotations

import dataclasses

from jaxserve.models import llama_arch
from jaxserve.models.llama_arch import LlamaArch
from jaxserve.models.quantization import kernel_shapes


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtralArch(LlamaArch):
    """LlamaArch plus the MoE settings. intermediate_size stays HF's: the dense MLP width
    (Qwen-MoE's dense layers; for Mixtral it equals the expert width)."""

    num_experts: int  # E
    top_k: int  # experts per token
    moe_intermediate_size: int  # F of one expert
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    cast_routing_weights: bool  # Qwen: weights cast to the model dtype before weighting
    shared_expert_size: int  # F of Qwen2-MoE's gated shared expert; 0 = none
    sparse_layers: tuple  # per layer: True where the MLP is the sparse MoE block

    @classmethod
    def from_hf(cls, hf: dict) -> MixtralArch:
        arch = (hf.get("architectures") or [""])[0]
        base = {f.name: getattr(LlamaArch.from_hf(hf), f.name)
                for f in dataclasses.fields(LlamaArch)}
        n = base["num_layers"]
        # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts (Mixtral's name).
        num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
        if arch == "MixtralForCausalLM":  # every layer sparse, Mistral's window on every layer
            base["sliding_windows"] = (hf.get("sliding_window"),) * n
            return cls(**base, num_experts=num_experts,
                       top_k=int(hf["num_experts_per_tok"]),
                       moe_intermediate_size=base["intermediate_size"], norm_topk_prob=True,
                       cast_routing_weights=False, shared_expert_size=0,
                       sparse_layers=(True,) * n)
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = set(hf.get("mlp_only_layers") or ())
        if arch == "Qwen2MoeForCausalLM":
            base["attention_bias"] = bool(hf.get("qkv_bias", True))
            if not hf.get("layer_types") and hf.get("use_sliding_window"):
                # Qwen2MoeConfig's default layer_types (llama.py's fallback is Qwen2's).
                first = int(hf.get("max_window_layers", n))
                base["sliding_windows"] = tuple(hf["sliding_window"] if i % 2 == 0 and i < first
                                                else None for i in range(n))
            shared = int(hf.get("shared_expert_intermediate_size") or 0)
        else:  # Qwen3MoeForCausalLM: Qwen3's q/k norms, one window for every layer
            base["qk_norm"] = True
            window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
            base["sliding_windows"] = (window,) * n
            shared = 0
        return cls(**base, num_experts=num_experts, top_k=int(hf["num_experts_per_tok"]),
                   moe_intermediate_size=int(hf["moe_intermediate_size"]),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   cast_routing_weights=True, shared_expert_size=shared,
                   sparse_layers=tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0
                                       for i in range(n)))


_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # Mixtral -> Qwen names
_EXPERT_PARAM = {"gate_proj": "experts_gate", "up_proj": "experts_up",
                 "down_proj": "experts_down"}
_DENSE_PARAM = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def _transpose(w):  # [E, out, in] -> [E, in, out]
    return w.transpose(0, 2, 1)


def hf_param_path(name: str, arch: MixtralArch):
    """llama.hf_param_path for the MoE family. Sparse-layer MLP tensors come in two layouts:
    the Hub's per-expert tensors (`experts.{j}.w1.weight` / `experts.{j}.gate_proj.weight`),
    mapped to (path, transform, expert index j) for load_params to stack, and transformers
    5's fused `experts.gate_up_proj` [E, 2F, D] (a list of two targets: gate rows first) and
    `experts.down_proj` [E, D, F]. Mixtral's `block_sparse_moe.` reads as `mlp.`."""
    parts = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.").split(".")
    if not (len(parts) > 3 and parts[0] == "layers" and parts[2] == "mlp"
            and int(parts[1]) < arch.num_layers and arch.sparse_layers[int(parts[1])]):
        return llama_arch.hf_param_path(name, arch)
    prefix, rest = ("layers", int(parts[1]), "mlp"), parts[3:]
    if rest == ["gate", "weight"]:
        return prefix + ("router",), lambda w: w.T
    if rest == ["shared_expert_gate", "weight"]:
        return prefix + ("shared_gate",), lambda w: w.T
    if len(rest) == 3 and rest[0] == "shared_expert" and rest[2] == "weight":
        return prefix + ("shared_expert", _DENSE_PARAM[rest[1]]), lambda w: w.T
    if rest == ["experts", "gate_up_proj"]:
        f = arch.moe_intermediate_size
        return [(prefix + ("experts_gate",), lambda w: _transpose(w[:, :f])),
                (prefix + ("experts_up",), lambda w: _transpose(w[:, f:]))]
    if rest == ["experts", "down_proj"]:
        return prefix + ("experts_down",), _transpose
    if len(rest) == 4 and rest[0] == "experts" and rest[1].isdigit() and rest[3] == "weight":
        proj = _EXPERT_PROJ.get(rest[2], rest[2])
        return prefix + (_EXPERT_PARAM[proj],), lambda w: w.T, int(rest[1])
    raise KeyError(name)


def param_shapes(arch: MixtralArch, quantization: str | None = None) -> dict:
    """llama_arch.param_shapes with each sparse layer's MLP replaced by the MoE block: the
    router [D, E], the stacked experts [E, D, F] / [E, F, D], and Qwen2-MoE's shared expert
    with its gate [D, 1]."""
    d, e = arch.hidden_size, arch.num_experts
    shapes = llama_arch.param_shapes(arch, quantization)
    for i, sparse in enumerate(arch.sparse_layers):
        if not sparse:
            continue
        mlp = ("layers", i, "mlp")
        for path in [p for p in shapes if p[:3] == mlp]:
            del shapes[path]
        shapes[mlp + ("router",)] = ((d, e), None)
        shapes.update(expert_shapes(mlp, arch, quantization))
        if arch.shared_expert_size:
            shapes[mlp + ("shared_gate",)] = ((d, 1), None)
    return shapes


def expert_shapes(mlp: tuple, arch, quantization) -> dict:
    """A sparse layer's stacked experts under `mlp` ([E, D, F] gate and up, [E, F, D] down)
    and, with shared_expert_size, its shared expert's gated MLP (the MoE families and
    DeepSeek alike)."""
    d, e, f = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
    shapes = {}
    for name, shape in (("experts_gate", (e, d, f)), ("experts_up", (e, d, f)),
                        ("experts_down", (e, f, d))):
        shapes.update(kernel_shapes(mlp + (name,), shape, quantization))
    if arch.shared_expert_size:
        shapes.update(llama_arch.mlp_shapes(mlp + ("shared_expert",), d,
                                            arch.shared_expert_size, quantization))
    return shapes
