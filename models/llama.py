"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) as a Flax NNX module.

The variants differ only through LlamaArch: GQA, RoPE (default, linear, llama3 scaling),
optional q/k/v bias (Qwen2), optional per-head q/k RMSNorm (Qwen3), sliding-window layers
(Mistral), tied or untied lm_head. The forward pass takes the ragged batch of
docs/architecture.md, writes each layer's K/V into its paged cache at slot_mapping and
attends through one entry point.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.kernels_pallas.ref import ragged_paged_attention, write_kv


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

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaArch:
        arch = (hf.get("architectures") or [""])[0]
        num_heads = int(hf["num_attention_heads"])
        num_layers = int(hf["num_hidden_layers"])
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"RoPE type {rope_type!r} is not supported; jaxserve supports "
                             "default, linear and llama3.")
        rope["rope_type"] = rope_type
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, list))),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(hf, arch, num_layers),
        )


def _sliding_windows(hf: dict, arch: str, num_layers: int) -> tuple:
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (window,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if hf.get("use_sliding_window") and window:
        first = int(hf.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def rope_inv_freq(arch: LlamaArch) -> np.ndarray:
    """f32[H/2] inverse frequencies, with linear or llama3 scaling applied as HF does."""
    dim = arch.head_dim
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
    return inv.astype(np.float32)


def apply_rope(x, cos, sin):
    """x: [T, N, H]; cos, sin: [T, H] (HF's rotate_half convention: halves, not pairs)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, arch: LlamaArch, layer: int, dtype) -> None:
        d, n, k, h = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.wq = nnx.Param(jnp.zeros((d, n, h), dtype))  # [D, N, H]
        self.wk = nnx.Param(jnp.zeros((d, k, h), dtype))  # [D, K, H]
        self.wv = nnx.Param(jnp.zeros((d, k, h), dtype))  # [D, K, H]
        self.wo = nnx.Param(jnp.zeros((n, h, d), dtype))  # [N, H, D]
        if arch.attention_bias:
            self.bq = nnx.Param(jnp.zeros((n, h), dtype))
            self.bk = nnx.Param(jnp.zeros((k, h), dtype))
            self.bv = nnx.Param(jnp.zeros((k, h), dtype))
        if arch.qk_norm:
            self.q_norm = RMSNorm(h, arch.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.bias = arch.attention_bias
        self.qk_norm = arch.qk_norm
        self.scale = h ** -0.5
        self.window = arch.sliding_windows[layer]

    def __call__(self, x, cos, sin, kv_cache, batch, attend):
        q = jnp.einsum("td,dnh->tnh", x, self.wq[...])
        k = jnp.einsum("td,dkh->tkh", x, self.wk[...])
        v = jnp.einsum("td,dkh->tkh", x, self.wv[...])
        if self.bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = attend(q, k, v, kv_cache, batch, scale=self.scale,
                               sliding_window=self.window)
        return jnp.einsum("tnh,nhd->td", out, self.wo[...]), kv_cache


class MLP(nnx.Module):
    def __init__(self, arch: LlamaArch, dtype) -> None:
        d, f = arch.hidden_size, arch.intermediate_size
        self.w_gate = nnx.Param(jnp.zeros((d, f), dtype))  # [D, F]
        self.w_up = nnx.Param(jnp.zeros((d, f), dtype))  # [D, F]
        self.w_down = nnx.Param(jnp.zeros((f, d), dtype))  # [F, D]

    def __call__(self, x):
        gate = jax.nn.silu(x @ self.w_gate[...])
        return (gate * (x @ self.w_up[...])) @ self.w_down[...]


class DecoderLayer(nnx.Module):
    def __init__(self, arch: LlamaArch, layer: int, dtype) -> None:
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.attn = Attention(arch, layer, dtype)
        self.post_attention_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype)

    def __call__(self, x, cos, sin, kv_cache, batch, attend):
        attn_out, kv_cache = self.attn(self.input_norm(x), cos, sin, kv_cache, batch, attend)
        x = x + attn_out
        return x + self.mlp(self.post_attention_norm(x)), kv_cache


class LlamaForCausalLM(nnx.Module):
    def __init__(self, arch: LlamaArch, dtype=jnp.float32) -> None:
        self.arch = arch
        self.embed = nnx.Param(jnp.zeros((arch.vocab_size, arch.hidden_size), dtype))  # [V, D]
        self.layers = nnx.List([DecoderLayer(arch, i, dtype) for i in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if not arch.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.zeros((arch.vocab_size, arch.hidden_size), dtype))

    def __call__(self, kv_caches: list, batch, attend: Callable = None):
        """Returns (updated per-layer (k, v) caches, final hidden states [T, D]).

        attend(q, k, v, kv_cache, batch, scale=, sliding_window=) -> (out, kv_cache) writes a
        layer's new K/V and attends (jaxserve/attend.py; the reference when not given)."""
        attend = attend or reference_attend
        x = self.embed[...][batch.token_ids]
        inv_freq = rope_inv_freq(self.arch)  # a compile-time constant
        freqs = batch.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, H]
        cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
        new_caches = []
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, kv_cache = layer(x, cos, sin, kv_cache, batch, attend)
            new_caches.append(kv_cache)
        return new_caches, self.norm(x)

    def logits(self, hidden):
        """hidden: [X, D] -> f32[X, V]."""
        head = self.embed if self.arch.tie_word_embeddings else self.lm_head
        return jnp.einsum("xd,vd->xv", hidden, head[...]).astype(jnp.float32)


def reference_attend(q, k, v, kv_cache, batch, *, scale, sliding_window=None):
    """One device, the reference: write the step's K/V at slot_mapping, then attend."""
    k_cache, v_cache = write_kv(*kv_cache, k, v, batch.slot_mapping)
    out = ragged_paged_attention(q, k_cache, v_cache, batch, scale=scale,
                                 sliding_window=sliding_window)
    return out, (k_cache, v_cache)


def hf_param_path(name: str, arch: LlamaArch):
    """Map one HF tensor name to (our parameter path, transform of the HF array), or None
    for tensors to skip. Raises KeyError for a name this family does not know."""
    d, n, k, h = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    name = name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "embed_tokens.weight":
        return ("embed",), None
    if name == "norm.weight":
        return ("norm", "weight"), None
    if name == "lm_head.weight":
        return (None if arch.tie_word_embeddings else (("lm_head",), None))
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
