"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) as a Flax NNX module.

The variants differ only through LlamaArch: GQA, RoPE (default, linear, llama3 scaling),
optional q/k/v bias (Qwen2), optional per-head q/k RMSNorm (Qwen3), sliding-window layers
(Mistral), tied or untied lm_head. quantization="int8" stores the projections' kernels as
int8 with per-output-channel scales (models/quantization.py). The forward pass takes the
ragged batch of docs/architecture.md, writes each layer's K/V into its paged cache at slot_mapping and
attends through one entry point.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.kernels_pallas.ref import ragged_paged_attention, write_kv
from jaxserve.models.jax.quantized import kernel, matmul
from jaxserve.models.llama_arch import (  # noqa: F401
    LlamaArch,
    hf_param_path,
    rope_attention_factor,
    rope_inv_freq,
)


class KVSlots:
    """A step's KV caches as the layers read and write them. Without KV groups: one cache
    per layer and the batch as it is. With them (config/kv_groups.py), one cache per slot:
    layer i uses slot groups.layer_slot[i] with its group's block table and slot mapping
    (the batch carries them as [G, R, B] and [G, T]); layers sharing a slot write disjoint
    blocks, each in turn into the tensor the one before it returned."""

    def __init__(self, kv_caches, batch, groups=None) -> None:
        self.caches, self.groups = list(kv_caches), groups
        self.batches = [batch] if groups is None else [
            dataclasses.replace(batch, block_tables=batch.block_tables[g],
                                slot_mapping=batch.slot_mapping[g])
            for g in range(groups.num_groups)]

    def of_layer(self, i: int) -> tuple:
        """(layer i's cache, its batch)."""
        if self.groups is None:
            return self.caches[i], self.batches[0]
        return self.caches[self.groups.layer_slot[i]], self.batches[self.groups.layer_group[i]]

    def update(self, i: int, kv_cache) -> None:
        self.caches[i if self.groups is None else self.groups.layer_slot[i]] = kv_cache


def apply_rope(x, cos, sin):
    """x: [T, N, H]; cos, sin: [T, R] (HF's rotate_half convention: halves, not pairs): the
    first R dims of each head turn, the rest pass (partial rotary: R < H)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
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
    norm_cls = RMSNorm  # the q/k norms' class (Gemma's: models/jax/gemma.py)

    def __init__(self, arch: LlamaArch, layer: int, dtype, quantization=None) -> None:
        d, n, k, h = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
        kernel(self, "wq", (d, n, h), dtype, quantization)  # [D, N, H]
        kernel(self, "wk", (d, k, h), dtype, quantization)  # [D, K, H]
        kernel(self, "wv", (d, k, h), dtype, quantization)  # [D, K, H]
        kernel(self, "wo", (n, h, d), dtype, quantization)  # [N, H, D]
        if arch.attention_bias:
            self.bq = nnx.Param(jnp.zeros((n, h), dtype))
            self.bk = nnx.Param(jnp.zeros((k, h), dtype))
            self.bv = nnx.Param(jnp.zeros((k, h), dtype))
        if arch.qk_norm:
            self.q_norm = self.norm_cls(h, arch.rms_norm_eps, dtype)
            self.k_norm = self.norm_cls(h, arch.rms_norm_eps, dtype)
        self.bias = arch.attention_bias
        self.qk_norm = arch.qk_norm
        self.scale = h ** -0.5
        self.window = arch.sliding_windows[layer]
        self.soft_cap = None  # attention logits' tanh cap (Gemma 2)

    def __call__(self, x, cos, sin, kv_cache, batch, attend):
        q = matmul("td,dnh->tnh", x, self, "wq")
        k = matmul("td,dkh->tkh", x, self, "wk")
        v = matmul("td,dkh->tkh", x, self, "wv")
        if self.bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = attend(q, k, v, kv_cache, batch, **self.attend_options())
        return matmul("tnh,nhd->td", out, self, "wo"), kv_cache

    def attend_options(self) -> dict:
        """attend's keywords for this layer (GPT-OSS adds its sinks)."""
        return dict(scale=self.scale, sliding_window=self.window, soft_cap=self.soft_cap)


class MLP(nnx.Module):
    def __init__(self, arch: LlamaArch, dtype, quantization=None) -> None:
        d, f = arch.hidden_size, arch.intermediate_size
        kernel(self, "w_gate", (d, f), dtype, quantization)  # [D, F]
        kernel(self, "w_up", (d, f), dtype, quantization)  # [D, F]
        kernel(self, "w_down", (f, d), dtype, quantization)  # [F, D]

    def __call__(self, x):
        gate = jax.nn.silu(matmul("td,df->tf", x, self, "w_gate"))
        return matmul("tf,fd->td", gate * matmul("td,df->tf", x, self, "w_up"), self, "w_down")


class DecoderLayer(nnx.Module):
    def __init__(self, arch: LlamaArch, layer: int, dtype, quantization=None) -> None:
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.attn = Attention(arch, layer, dtype, quantization)
        self.post_attention_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype, quantization)

    def __call__(self, x, cos, sin, kv_cache, batch, attend):
        attn_out, kv_cache = self.attn(self.input_norm(x), cos, sin, kv_cache, batch, attend)
        x = x + attn_out
        return x + self.mlp(self.post_attention_norm(x)), kv_cache


class LlamaForCausalLM(nnx.Module):
    def __init__(self, arch: LlamaArch, dtype=jnp.float32, quantization=None) -> None:
        self.arch = arch
        self.embed = nnx.Param(jnp.zeros((arch.vocab_size, arch.hidden_size), dtype))  # [V, D]
        self.layers = nnx.List([DecoderLayer(arch, i, dtype, quantization)
                                for i in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if not arch.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.zeros((arch.vocab_size, arch.hidden_size), dtype))
        if arch.num_labels:  # a sequence-classification head, [D, L]
            self.score = nnx.Param(jnp.zeros((arch.hidden_size, arch.num_labels), dtype))

    def __call__(self, kv_caches: list, batch, attend: Callable = None, groups=None):
        """Returns (updated per-layer (k, v) caches, final hidden states [T, D]).

        attend(q, k, v, kv_cache, batch, scale=, sliding_window=) -> (out, kv_cache) writes a
        layer's new K/V and attends (backends/jax/attend.py; the reference when not given).
        groups: the KV groups (config/kv_groups.py) when layers share cache tensors; then
        kv_caches holds one per slot and the batch a block table per group (KVSlots)."""
        attend = attend or reference_attend
        x = self.embed[...][batch.token_ids]
        inv_freq = rope_inv_freq(self.arch)  # a compile-time constant
        freqs = batch.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, H]
        factor = rope_attention_factor(self.arch)  # YaRN's mscale, else 1
        cos, sin = (jnp.cos(emb) * factor).astype(x.dtype), (jnp.sin(emb) * factor).astype(x.dtype)
        caches = KVSlots(kv_caches, batch, groups)
        for i, layer in enumerate(self.layers):
            x, kv_cache = layer(x, cos, sin, *caches.of_layer(i), attend)
            caches.update(i, kv_cache)
        return caches.caches, self.norm(x)

    def logits(self, hidden):
        """hidden: [X, D] -> f32[X, V]."""
        head = self.embed if self.arch.tie_word_embeddings else self.lm_head
        return jnp.einsum("xd,vd->xv", hidden, head[...]).astype(jnp.float32)

    def classify(self, hidden):
        """hidden: [X, D] -> f32[X, L], the sequence-classification head's logits (linear,
        no bias: it may be applied to sums of hidden states)."""
        return jnp.einsum("xd,dl->xl", hidden.astype(jnp.float32),
                          self.score[...].astype(jnp.float32))


def reference_attend(q, k, v, kv_cache, batch, *, scale, sliding_window=None, soft_cap=None,
                     sinks=None):
    """One device, the reference: write the step's K/V at slot_mapping, then attend."""
    k_cache, v_cache = write_kv(*kv_cache, k, v, batch.slot_mapping)
    out = ragged_paged_attention(q, k_cache, v_cache, batch, scale=scale,
                                 sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return out, (k_cache, v_cache)
