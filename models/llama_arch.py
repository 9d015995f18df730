"""The Llama family's architecture settings and checkpoint layout, shared by both backends.

LlamaArch holds what differs between Llama 2/3, Mistral, Qwen2 and Qwen3 (read from an HF
config.json); hf_param_path maps each checkpoint tensor to its parameter in the engine's
layout (wq [D, N, H], wk/wv [D, K, H], wo [N, H, D], MLP weights [in, out]), which the JAX
model (models/jax/llama.py) and the torch model (models/torch/llama.py) both use. numpy
only.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxserve.models.quantization import kernel_shapes

# The pooling checkpoints of this family (vLLM's pooling runner): a Hugging Face *Model (the
# decoder alone: no "model." prefix, no lm_head; embeddings) or *ForSequenceClassification (a
# `score` head [num_labels, D] on the last token), each with the layers of its causal LM.
POOLING_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}


def num_labels(hf: dict) -> int:
    """The classification head's rows of a *ForSequenceClassification config: its id2label
    entries (what transformers saves), else num_labels, else transformers' default 2."""
    labels = hf.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    return int(hf.get("num_labels") or 2)


@dataclasses.dataclass(frozen=True)
class LlamaArch:
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple  # sorted (key, value) pairs of the HF rope parameters
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: tuple  # per layer: window length or None
    kv_replicas: int = 1  # each checkpoint kv head repeated this often (num_kv_heads counts them)
    # RoPE turns the first rotary_dim of each head's H dims (partial_rotary_factor * H,
    # Phi-3/Phi-4); 0: all of them.
    rotary_dim: int = 0
    # A *ForSequenceClassification checkpoint's head: score [D, L], L = num_labels (0: none).
    num_labels: int = 0

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaArch:
        name = (hf.get("architectures") or [""])[0]
        arch = POOLING_ARCHITECTURES.get(name, name)  # a pooling checkpoint's causal LM
        num_heads = int(hf["num_attention_heads"])
        num_layers = int(hf["num_hidden_layers"])
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
            raise ValueError(f"RoPE type {rope_type!r} is not supported; jaxserve supports "
                             "default, linear, llama3, yarn and longrope.")
        rope["rope_type"] = rope_type
        rope.pop("type", None)
        partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        if rope_type == "yarn":  # as transformers fills it in
            rope.setdefault("original_max_position_embeddings",
                            hf.get("max_position_embeddings"))
            if rope.get("factor") is None:
                rope["factor"] = (float(hf["max_position_embeddings"])
                                  / float(rope["original_max_position_embeddings"]))
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
        rotary_dim = 0 if partial == 1.0 else int(head_dim * partial)
        if rope_type == "longrope":
            _read_longrope(rope, hf, rotary_dim or head_dim)
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, list))),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            # A pooling checkpoint has no lm_head: the token the step samples for its last
            # position (discarded) reads the embedding.
            tie_word_embeddings=name in POOLING_ARCHITECTURES or bool(
                hf.get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(hf, arch, num_layers),
            rotary_dim=rotary_dim,
            num_labels=num_labels(hf) if name.endswith("ForSequenceClassification") else 0,
        )


def _read_longrope(rope: dict, hf: dict, dim: int) -> None:
    """LongRoPE's parameters as transformers fills them in, the factor lists as tuples, and
    which set is used ("long": the engine's choice, with_max_model_len; until then whether
    max_position_embeddings passes original_max_position_embeddings)."""
    original = rope.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling type 'longrope' needs original_max_position_embeddings "
                         "in config.json (in rope_scaling or at the top level).")
    rope["original_max_position_embeddings"] = int(original)
    if rope.get("factor") is None:
        rope["factor"] = float(hf["max_position_embeddings"]) / float(original)
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if not isinstance(factors, (list, tuple)) or len(factors) != dim // 2:
            raise ValueError(f"rope_scaling.{key} must list {dim // 2} numbers (one per "
                             f"rotary frequency of the {dim} rotary dims); got {factors!r}.")
        rope[key] = tuple(float(f) for f in factors)
    rope["long"] = int(hf["max_position_embeddings"]) > int(original)


def with_max_model_len(arch: LlamaArch, max_model_len: int) -> LlamaArch:
    """arch as an engine of max_model_len runs it. LongRoPE (Phi-3.5, Phi-4-mini) uses its
    long factors for every sequence when max_model_len passes
    original_max_position_embeddings, else its short factors: one set per engine, so that a
    sequence's cached keys and its later queries always turn alike (transformers picks the
    set by the forward's longest position and recomputes the whole cache when a generation
    crosses over; vLLM chooses by max_model_len, as here)."""
    params = dict(arch.rope_scaling)
    if params.get("rope_type") != "longrope":
        return arch
    params["long"] = max_model_len > int(params["original_max_position_embeddings"])
    return dataclasses.replace(arch, rope_scaling=tuple(sorted(params.items())))


def _sliding_windows(hf: dict, arch: str, num_layers: int) -> tuple:
    window = hf.get("sliding_window")
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return (window,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if hf.get("use_sliding_window") and window:
        first = int(hf.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def rope_inv_freq(arch: LlamaArch) -> np.ndarray:
    """f32[H/2] inverse frequencies, with linear, llama3, YaRN or LongRoPE scaling applied as
    HF does (YaRN's and LongRoPE's attention factor scales cos and sin:
    rope_attention_factor)."""
    dim = arch.rotary_dim or arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    params = dict(arch.rope_scaling)
    kind = params["rope_type"]
    if kind == "linear":
        inv = inv / float(params["factor"])
    elif kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn_inv_freq(dim, arch.rope_theta, params)
    elif kind == "longrope":
        factors = np.asarray(params["long_factor" if params["long"] else "short_factor"],
                             dtype=np.float32)
        shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
        inv = 1.0 / (factors * arch.rope_theta ** shape)
    return inv.astype(np.float32)


def _yarn_inv_freq(dim: int, base: float, params: dict) -> np.ndarray:
    """YaRN: each frequency interpolated (divided by factor), extrapolated (kept) or blended
    on a linear ramp between the dimensions that turn beta_fast and beta_slow times over the
    original context (transformers' _compute_yarn_parameters)."""
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(arch: LlamaArch) -> float:
    """What cos and sin are multiplied by: YaRN's or LongRoPE's attention factor, else 1."""
    params = dict(arch.rope_scaling)
    if params["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    if params["rope_type"] == "longrope":  # both factor sets, as transformers
        original = float(params["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, float(params["mscale"])) / mscale(factor,
                                                                float(params["mscale_all_dim"]))
    return mscale(factor)


def hf_param_path(name: str, arch: LlamaArch):
    """Map one HF tensor name to (our parameter path, transform of the HF array), or None
    for tensors to skip. Raises KeyError for a name this family does not know."""
    d, n, k, h = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    name = name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")):
        return _fused(name, arch)
    if name == "embed_tokens.weight":
        return ("embed",), None
    if name == "norm.weight":
        return ("norm", "weight"), None
    if name == "lm_head.weight":
        return (None if arch.tie_word_embeddings else (("lm_head",), None))
    if name == "score.weight" and arch.num_labels:  # [L, D] -> [D, L]
        return ("score",), lambda w: w.T
    parts = name.split(".")
    if parts[0] != "layers":
        raise KeyError(name)
    layer, rest = int(parts[1]), ".".join(parts[2:])
    heads_in = {"q": n, "k": k // arch.kv_replicas, "v": k // arch.kv_replicas}
    repeat = {"q": 1, "k": arch.kv_replicas, "v": arch.kv_replicas}
    table = {
        "input_layernorm.weight": (("input_norm", "weight"), None),
        "post_attention_layernorm.weight": (("post_attention_norm", "weight"), None),
        "self_attn.q_norm.weight": (("attn", "q_norm", "weight"), None),
        "self_attn.k_norm.weight": (("attn", "k_norm", "weight"), None),
        "self_attn.o_proj.weight": (("attn", "wo"), lambda w: w.T.reshape(n, h, d)),
        "mlp.gate_proj.weight": (("mlp", "w_gate"), lambda w: w.T),
        "mlp.up_proj.weight": (("mlp", "w_up"), lambda w: w.T),
        "mlp.down_proj.weight": (("mlp", "w_down"), lambda w: w.T),
    }
    for p, heads in heads_in.items():
        table[f"self_attn.{p}_proj.weight"] = (
            ("attn", f"w{p}"),
            lambda w, heads=heads, r=repeat[p]: np.repeat(w.T.reshape(d, heads, h), r, axis=1))
        table[f"self_attn.{p}_proj.bias"] = (
            ("attn", f"b{p}"),
            lambda b, heads=heads, r=repeat[p]: np.repeat(b.reshape(heads, h), r, axis=0))
    path, transform = table[rest]
    return ("layers", layer) + path, transform


def _fused(name: str, arch: LlamaArch) -> list:
    """Phi-3's fused projections as the separate parameters: qkv_proj [(N + 2K) H, D] is
    q, k and v rows in that order; gate_up_proj [2F, D] the gate rows, then the up rows."""
    prefix = name.removeprefix("model.").rsplit(".", 3)[0]  # layers.{i}
    if name.endswith("gate_up_proj.weight"):
        f = arch.intermediate_size
        return [hf_param_path(f"{prefix}.mlp.gate_proj.weight", arch)[:1] + (lambda w: w[:f].T,),
                hf_param_path(f"{prefix}.mlp.up_proj.weight", arch)[:1] + (lambda w: w[f:].T,)]
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads // arch.kv_replicas * arch.head_dim
    parts = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
    targets = []
    for p, rows in parts.items():
        path, transform = hf_param_path(f"{prefix}.self_attn.{p}_proj.weight", arch)
        targets.append((path, lambda w, rows=rows, transform=transform: transform(w[rows])))
    return targets


def param_shapes(arch: LlamaArch, quantization: str | None = None) -> dict:
    """Every parameter of the model, {path: (shape, dtype)} with dtype None for the model's
    dtype: the table `jaxserve plan` counts without building a model. The Flax model declares
    exactly these (tests/config/test_plan.py compares them)."""
    d, f, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    shapes = {("embed",): ((v, d), None)}  # [V, D]
    for i in range(arch.num_layers):
        layer = ("layers", i)
        shapes[layer + ("input_norm", "weight")] = ((d,), None)
        shapes.update(attention_shapes(layer + ("attn",), arch, quantization))
        shapes[layer + ("post_attention_norm", "weight")] = ((d,), None)
        shapes.update(mlp_shapes(layer + ("mlp",), d, f, quantization))
    shapes[("norm", "weight")] = ((d,), None)
    if not arch.tie_word_embeddings:
        shapes[("lm_head",)] = ((v, d), None)
    if arch.num_labels:
        shapes[("score",)] = ((d, arch.num_labels), None)  # [D, L]
    return shapes


def attention_shapes(prefix: tuple, arch: LlamaArch, quantization: str | None) -> dict:
    """The attention's kernels (wq [D, N, H], wk/wv [D, K, H], wo [N, H, D]), biases and
    q/k norms under `prefix`."""
    d, n, k, h = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    shapes = {}
    for name, shape in (("wq", (d, n, h)), ("wk", (d, k, h)), ("wv", (d, k, h)),
                        ("wo", (n, h, d))):
        shapes.update(kernel_shapes(prefix + (name,), shape, quantization))
    if arch.attention_bias:
        shapes.update({prefix + ("bq",): ((n, h), None), prefix + ("bk",): ((k, h), None),
                       prefix + ("bv",): ((k, h), None)})
    if arch.qk_norm:
        shapes[prefix + ("q_norm", "weight")] = ((h,), None)
        shapes[prefix + ("k_norm", "weight")] = ((h,), None)
    return shapes


def mlp_shapes(prefix: tuple, d: int, f: int, quantization: str | None) -> dict:
    """The gated MLP's kernels (w_gate, w_up [D, F], w_down [F, D]) under `prefix`."""
    shapes = {}
    for name, shape in (("w_gate", (d, f)), ("w_up", (d, f)), ("w_down", (f, d))):
        shapes.update(kernel_shapes(prefix + (name,), shape, quantization))
    return shapes
