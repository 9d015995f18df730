"""DeepSeek V2 / V3 (and Kimi K2, built on V3) architecture settings and checkpoint layout,
shared by the host side (plan, sizing) and the JAX model (models/jax/deepseek.py). numpy only.

Attention is multi-head latent attention (MLA). Per token, a layer computes
* queries: q = x W_q ([D, N, P + R]) or, with a query LoRA (q_lora_rank Q), q = norm(x W_qa)
  W_qb ([D, Q], [Q, N, P + R]); the last R (qk_rope_head_dim) dims of each head turn with
  RoPE, the first P (qk_nope_head_dim) do not;
* the cache entry: x W_kva ([D, C + R]) = [latent, rope key]; the latent (C = kv_lora_rank)
  is RMS-normalised, the rope key (one for all heads) turned: C + R values per token and
  layer, where multi-head attention would keep N (P + R) keys and N V values;
* keys and values expand from the latent through W_uk [C, N, P] and W_uv [C, N, V] (the
  checkpoint's kv_b_proj, split): k = [c W_uk, k_r], v = c W_uv. The engine never expands
  them: queries absorb W_uk (q_latent = W_uk q_nope), attention runs over the latent
  cache (kernels_pallas/mla_ref.py), and its latent output goes through W_uv.
RoPE turns interleaved pairs (V2 always, V3 with rope_interleave, its default) or halves; the
softmax scale is (P + R)^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2.

MLP: the first first_k_dense_replace layers (and those off moe_layer_freq) are dense gated
MLPs of intermediate_size; the others route each token to top_k of E experts (width
moe_intermediate_size) plus n_shared_experts always-on experts (one MLP of
n_shared_experts * moe_intermediate_size). Routing: V2 softmax scores ("greedy", or
"group_limited_greedy": only the topk_group of n_group expert groups with the best single
score), V3 sigmoid scores plus e_score_correction_bias for the choice ("noaux_tc": groups
ranked by the sum of their two best corrected scores) with the uncorrected scores as
weights; weights renormalised with norm_topk_prob and multiplied by routed_scaling_factor.

Checkpoints name layers model.layers.{i}; published V3 checkpoints also hold
num_nextn_predict_layers multi-token-prediction layers after the last decoder layer, which
are skipped at load (and named in the log).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

from jaxserve.models import llama_arch, mixtral_arch
from jaxserve.models.llama_arch import LlamaArch
from jaxserve.models.quantization import kernel_shapes

logger = logging.getLogger(__name__)

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekArch(LlamaArch):
    """LlamaArch (head_dim: the RoPE dims R, num_kv_heads: 1, the shared latent) plus MLA's
    and the MoE's settings."""

    q_lora_rank: int  # Q; 0: queries straight from x (V2-Lite)
    kv_lora_rank: int  # C
    qk_nope_head_dim: int  # P
    qk_rope_head_dim: int  # R
    v_head_dim: int  # V
    rope_interleave: bool  # RoPE on interleaved pairs (else on halves)
    softmax_scale: float
    num_experts: int  # E
    top_k: int
    moe_intermediate_size: int  # F of one expert
    shared_expert_size: int  # F of the shared experts' MLP (n_shared_experts * F); 0: none
    sparse_layers: tuple  # per layer: True where the MLP is the MoE block
    scoring: str  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # greedy, group_limited_greedy or noaux_tc
    num_groups: int  # n_group (1: no groups)
    topk_groups: int  # topk_group
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_mtp_layers: int  # multi-token-prediction layers in the checkpoint, skipped

    @property
    def latent_dim(self) -> int:
        """C + R: one cache entry per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def correction_bias(self) -> bool:
        """Whether the router has V3's e_score_correction_bias."""
        return self.topk_method == "noaux_tc"

    @classmethod
    def from_hf(cls, hf: dict) -> DeepseekArch:
        name = (hf.get("architectures") or [""])[0]
        v3 = name == "DeepseekV3ForCausalLM"
        rope_dim = _size(hf, "qk_rope_head_dim")
        nope = _size(hf, "qk_nope_head_dim")
        if rope_dim % 2:
            raise ValueError(f"DeepSeek qk_rope_head_dim must be even (RoPE rotates pairs), "
                             f"got {rope_dim}.")
        base_hf = {**hf, "head_dim": rope_dim, "num_key_value_heads": 1}
        base = {f.name: getattr(LlamaArch.from_hf(base_hf), f.name)
                for f in dataclasses.fields(LlamaArch)}
        base["attention_bias"] = bool(hf.get("attention_bias", False))
        base["rotary_dim"] = 0
        n = base["num_layers"]
        experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
        first_dense = int(hf.get("first_k_dense_replace") or 0)
        freq = int(hf.get("moe_layer_freq") or 1)
        method = hf.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if method not in _TOPK_METHODS:
            raise ValueError(f"DeepSeek topk_method {method!r} is not supported; jaxserve "
                             f"supports {', '.join(_TOPK_METHODS)}.")
        scoring = hf.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"DeepSeek scoring_func {scoring!r} is not supported; jaxserve "
                             "supports softmax (V2) and sigmoid (V3).")
        groups = int(hf.get("n_group") or 1)
        kept_groups = int(hf.get("topk_group") or groups)
        top_k = int(hf.get("num_experts_per_tok") or 0)
        if experts:
            _check_routing(experts, groups, kept_groups, top_k, method)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"DeepSeek hidden_act {act!r} is not supported (silu only).")
        return cls(
            **base,
            q_lora_rank=int(hf.get("q_lora_rank") or 0),
            kv_lora_rank=_size(hf, "kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=_size(hf, "v_head_dim"),
            rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
            softmax_scale=_softmax_scale(nope + rope_dim, dict(base["rope_scaling"])),
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            shared_expert_size=int(hf.get("n_shared_experts") or 0)
            * int(hf.get("moe_intermediate_size") or 0),
            sparse_layers=tuple(experts > 0 and i >= first_dense and i % freq == 0
                                for i in range(n)),
            scoring=scoring,
            topk_method=method,
            num_groups=groups,
            topk_groups=kept_groups,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            num_mtp_layers=int(hf.get("num_nextn_predict_layers")
                               or hf.get("num_mtp_layers") or 0),
        )


def check_latent_attention(config) -> None:
    """What a DeepSeek model's latent cache (multi-head latent attention) does not take yet,
    for an EngineConfig being built: ValueError naming the setting. (The torch backend,
    which has no DeepSeek model, refuses it by the family table: models/__init__.py.)"""
    names = config.model.hf_config.get("architectures") or ()
    if not set(names) & set(ARCHITECTURES):
        return
    if config.lora is not None:
        raise ValueError(f"enable_lora: LoRA adapters on {names[0]} (multi-head latent "
                         "attention) are not supported; drop enable_lora.")


def _size(hf: dict, key: str) -> int:
    """A required positive integer of config.json, or a ValueError naming it."""
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"DeepSeek config.json needs {key} as a positive integer, got "
                         f"{value!r}.")
    return value


def _check_routing(experts: int, groups: int, kept_groups: int, top_k: int,
                   method: str) -> None:
    """Top-k routing must be able to pick its experts: n_group groups of equal size (of at
    least two experts for noaux_tc, which ranks a group by its two best), topk_group of them
    kept, num_experts_per_tok experts among the kept groups' (among all experts for V2's
    greedy method, which ignores the groups)."""
    grouped = method != "greedy"
    if groups < 1 or experts % groups:
        raise ValueError(f"n_routed_experts {experts} does not divide into n_group "
                         f"{groups} groups.")
    if method == "noaux_tc" and groups > 1 and experts // groups < 2:
        raise ValueError(f"noaux_tc routing ranks each group by its two best experts, but "
                         f"n_routed_experts {experts} in n_group {groups} groups leaves "
                         f"{experts // groups} per group.")
    if not 1 <= kept_groups <= groups:
        raise ValueError(f"topk_group must be between 1 and n_group {groups}, got "
                         f"{kept_groups}.")
    pool = kept_groups * (experts // groups) if grouped else experts
    if not 1 <= top_k <= pool:
        among = (f"the {pool} experts of the topk_group {kept_groups} kept groups" if grouped
                 else f"n_routed_experts {experts}")
        raise ValueError(f"num_experts_per_tok must be between 1 and {among}, got {top_k}.")


def _softmax_scale(qk_head_dim: int, rope: dict) -> float:
    """(P + R)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (as HF and DeepSeek)."""
    scale = qk_head_dim ** -0.5
    all_dim = rope.get("mscale_all_dim")
    if rope.get("rope_type", "default") != "default" and all_dim:
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(all_dim) * math.log(factor) + 1.0
        scale *= m * m
    return scale


@functools.lru_cache(maxsize=None)
def _skip_mtp_layer(layer: int) -> None:
    logger.info("DeepSeek: skipping model.layers.%d, a multi-token-prediction layer "
                "(speculative decoding does not use it yet).", layer)


_ATTENTION = {  # HF self_attn.* -> (parameter under attn, transform of the HF [out, in] array)
    "q_a_proj.weight": ("wq_a", lambda w: w.T),
    "q_a_proj.bias": ("bq_a", None),
    "q_a_layernorm.weight": (("q_a_norm", "weight"), None),
    "kv_a_proj_with_mqa.weight": ("wkv_a", lambda w: w.T),
    "kv_a_proj_with_mqa.bias": ("bkv_a", None),
    "kv_a_layernorm.weight": (("kv_a_norm", "weight"), None),
    "o_proj.bias": ("bo", None),
}


def hf_param_path(name: str, arch: DeepseekArch):
    """One HF tensor -> (parameter path, transform), a list of them, or None (skipped);
    KeyError for unknown names. Engine layout: wq / wq_b [D | Q, N, P + R], wq_a [D, Q],
    wkv_a [D, C + R], wk_b [C, N, P], wv_b [C, N, V] (kv_b_proj split), wo [N, V, D]; the
    MLPs and experts as mixtral_arch's; the router [D, E] and its correction bias [E]."""
    parts = name.removeprefix("model.").split(".")
    if parts[0] == "layers" and len(parts) > 2 and int(parts[1]) >= arch.num_layers:
        _skip_mtp_layer(int(parts[1]))
        return None
    if parts[0] != "layers" or len(parts) < 4:
        return llama_arch.hf_param_path(name, arch)
    layer, rest = ("layers", int(parts[1])), ".".join(parts[3:])
    attn = layer + ("attn",)
    n, h = arch.num_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
    if parts[2] == "self_attn":
        if rest in _ATTENTION:
            leaf, transform = _ATTENTION[rest]
            return attn + (leaf if isinstance(leaf, tuple) else (leaf,)), transform
        if rest in ("q_proj.weight", "q_b_proj.weight"):
            leaf = "wq" if rest == "q_proj.weight" else "wq_b"
            return attn + (leaf,), lambda w: w.T.reshape(-1, n, h)
        if rest == "kv_b_proj.weight":  # [N (P + V), C] -> [C, N, P] and [C, N, V]
            p = arch.qk_nope_head_dim

            def split(w, keys):
                w = w.reshape(n, -1, w.shape[-1])
                return (w[:, :p] if keys else w[:, p:]).transpose(2, 0, 1)

            return [(attn + ("wk_b",), lambda w: split(w, True)),
                    (attn + ("wv_b",), lambda w: split(w, False))]
        if rest == "o_proj.weight":
            return attn + ("wo",), lambda w: w.T.reshape(n, arch.v_head_dim, -1)
        raise KeyError(name)
    if parts[2] == "mlp" and arch.sparse_layers[int(parts[1])]:
        mlp = layer + ("mlp",)
        if rest == "gate.weight":
            return mlp + ("router",), lambda w: w.T
        if rest == "gate.e_score_correction_bias":
            return mlp + ("score_correction",), None
        if rest.startswith("shared_experts.") and rest.endswith(".weight"):
            proj = rest.split(".")[1]
            return mlp + ("shared_expert", mixtral_arch._DENSE_PARAM[proj]), lambda w: w.T
        # experts: per-expert tensors or transformers 5's fused ones, as Qwen-MoE's
        return mixtral_arch.hf_param_path(name, arch)
    return llama_arch.hf_param_path(name, arch)


def param_shapes(arch: DeepseekArch, quantization=None) -> dict:
    """Every parameter, {path: (shape, dtype or None for the model's)}: the table `jaxserve
    plan` counts; the Flax model declares exactly these (tests compare them)."""
    d, v = arch.hidden_size, arch.vocab_size
    shapes = {("embed",): ((v, d), None)}
    for i in range(arch.num_layers):
        layer = ("layers", i)
        shapes[layer + ("input_norm", "weight")] = ((d,), None)
        shapes.update(mla_shapes(layer + ("attn",), arch, quantization))
        shapes[layer + ("post_attention_norm", "weight")] = ((d,), None)
        mlp = layer + ("mlp",)
        if not arch.sparse_layers[i]:
            shapes.update(llama_arch.mlp_shapes(mlp, d, arch.intermediate_size, quantization))
            continue
        e = arch.num_experts
        shapes[mlp + ("router",)] = ((d, e), None)
        if arch.correction_bias:
            shapes[mlp + ("score_correction",)] = ((e,), "float32")  # kept float32
        shapes.update(mixtral_arch.expert_shapes(mlp, arch, quantization))
    shapes[("norm", "weight")] = ((d,), None)
    if not arch.tie_word_embeddings:
        shapes[("lm_head",)] = ((v, d), None)
    return shapes


def mla_shapes(prefix: tuple, arch: DeepseekArch, quantization) -> dict:
    """The MLA projections under `prefix` (hf_param_path's layout), norms and biases."""
    d, n, c = arch.hidden_size, arch.num_heads, arch.kv_lora_rank
    h, q = arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.q_lora_rank
    kernels = [("wkv_a", (d, arch.latent_dim)), ("wk_b", (c, n, arch.qk_nope_head_dim)),
               ("wv_b", (c, n, arch.v_head_dim)), ("wo", (n, arch.v_head_dim, d))]
    kernels += [("wq_a", (d, q)), ("wq_b", (q, n, h))] if q else [("wq", (d, n, h))]
    shapes = {}
    for name, shape in kernels:
        shapes.update(kernel_shapes(prefix + (name,), shape, quantization))
    shapes[prefix + ("kv_a_norm", "weight")] = ((c,), None)
    if q:
        shapes[prefix + ("q_a_norm", "weight")] = ((q,), None)
    if arch.attention_bias:
        if q:
            shapes[prefix + ("bq_a",)] = ((q,), None)
        shapes[prefix + ("bkv_a",)] = ((arch.latent_dim,), None)
        shapes[prefix + ("bo",)] = ((d,), None)
    return shapes
