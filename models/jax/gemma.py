"""Gemma 2 and Gemma 3 (text) decoders as Flax NNX modules (settings: models/gemma_arch.py).

The forward pass takes the same ragged batch and paged caches as the Llama family
(models/jax/llama.py) and attends through the same entry point, with the layer's window and
the attention logits' soft cap.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.gemma_arch import GemmaArch
from jaxserve.models.jax.llama import MLP, Attention, KVSlots, reference_attend
from jaxserve.models.jax.quantized import matmul
from jaxserve.models.llama_arch import rope_attention_factor, rope_inv_freq


class GemmaRMSNorm(nnx.Module):
    """x / rms(x) * (1 + weight), in float32, then cast back (HF's Gemma2RMSNorm)."""

    def __init__(self, dim: int, eps: float, dtype) -> None:
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GemmaAttention(Attention):
    """Llama's attention with Gemma's q/k norms, query_pre_attn_scalar and soft cap."""

    norm_cls = GemmaRMSNorm

    def __init__(self, arch: GemmaArch, layer: int, dtype, quantization=None) -> None:
        super().__init__(arch, layer, dtype, quantization)
        self.scale = arch.query_pre_attn_scalar ** -0.5
        self.soft_cap = arch.attn_logit_softcapping


class GemmaMLP(MLP):
    """GeGLU: Llama's gated MLP with gelu (tanh approximation) on the gate."""

    def __call__(self, x):
        gate = jax.nn.gelu(matmul("td,df->tf", x, self, "w_gate"), approximate=True)
        return matmul("tf,fd->td", gate * matmul("td,df->tf", x, self, "w_up"), self, "w_down")


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, arch: GemmaArch, layer: int, dtype, quantization=None) -> None:
        d, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_norm = GemmaRMSNorm(d, eps, dtype)
        self.attn = GemmaAttention(arch, layer, dtype, quantization)
        self.post_attention_norm = GemmaRMSNorm(d, eps, dtype)
        self.pre_feedforward_norm = GemmaRMSNorm(d, eps, dtype)
        self.mlp = GemmaMLP(arch, dtype, quantization)
        self.post_feedforward_norm = GemmaRMSNorm(d, eps, dtype)

    def __call__(self, x, cos, sin, kv_cache, batch, attend):
        attn_out, kv_cache = self.attn(self.input_norm(x), cos, sin, kv_cache, batch, attend)
        x = x + self.post_attention_norm(attn_out)
        return x + self.post_feedforward_norm(self.mlp(self.pre_feedforward_norm(x))), kv_cache


class GemmaForCausalLM(nnx.Module):
    def __init__(self, arch: GemmaArch, dtype=jnp.float32, quantization=None) -> None:
        self.arch = arch
        self.embed = nnx.Param(jnp.zeros((arch.vocab_size, arch.hidden_size), dtype))  # [V, D]
        self.layers = nnx.List([GemmaDecoderLayer(arch, i, dtype, quantization)
                                for i in range(arch.num_layers)])
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if not arch.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.zeros((arch.vocab_size, arch.hidden_size), dtype))

    def __call__(self, kv_caches: list, batch, attend: Callable = None, groups=None):
        """Returns (updated per-layer caches, final hidden states [T, D]); attend and
        groups as in LlamaForCausalLM, with soft_cap= too."""
        attend = attend or reference_attend
        embed = self.embed[...]
        x = embed[batch.token_ids] * jnp.asarray(self.arch.embed_scale, embed.dtype)
        positions = batch.positions.astype(jnp.float32)[:, None]
        rope = {}  # one (cos, sin) [T, H] per distinct base: full layers, sliding layers
        caches = KVSlots(kv_caches, batch, groups)
        for i, layer in enumerate(self.layers):
            layer_arch = self.arch.layer_rope(i)
            key = (layer_arch.rope_theta, layer_arch.rope_scaling)
            if key not in rope:
                freqs = positions * rope_inv_freq(layer_arch)[None, :]  # compile-time constant
                emb = jnp.concatenate([freqs, freqs], axis=-1)
                factor = rope_attention_factor(layer_arch)
                rope[key] = ((jnp.cos(emb) * factor).astype(x.dtype),
                             (jnp.sin(emb) * factor).astype(x.dtype))
            x, kv_cache = layer(x, *rope[key], *caches.of_layer(i), attend)
            caches.update(i, kv_cache)
        return caches.caches, self.norm(x)

    def logits(self, hidden):
        """hidden: [X, D] -> f32[X, V], soft-capped when the model says so (Gemma 2)."""
        head = self.embed if self.arch.tie_word_embeddings else self.lm_head
        logits = jnp.einsum("xd,vd->xv", hidden, head[...]).astype(jnp.float32)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

