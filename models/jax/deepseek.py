"""DeepSeek V2 / V3 as Flax NNX modules: multi-head latent attention over a latent paged
cache, and the MoE block with grouped routing and shared experts (settings and checkpoint
layout: models/deepseek_arch.py).

Attention always runs in the absorbed form: the queries' no-RoPE part is projected into the
latent space through W_uk, the layer's cache holds one [C + R] entry per token (the
normalised latent, then the turned RoPE key), attention reads only that cache, and its
latent output goes through W_uv and W_o. `attend_latent(q_latent, q_rope, entry, cache,
batch, *, scale)` writes the step's entries and attends (backends/jax/attend_mla.py on the
mesh; the reference below otherwise).

Shape letters: T tokens, D hidden, N heads, Q q_lora_rank, C kv_lora_rank, R
qk_rope_head_dim, P qk_nope_head_dim, V v_head_dim, E experts, k experts per token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.kernels_pallas.mla_ref import ragged_paged_mla, write_latent
from jaxserve.models.deepseek_arch import DeepseekArch, hf_param_path  # noqa: F401
from jaxserve.models.jax.llama import MLP, KVSlots, RMSNorm, apply_rope
from jaxserve.models.jax.mixtral import moe_block
from jaxserve.models.jax.quantized import activation_quantizer, dequantized, kernel, matmul
from jaxserve.models.llama_arch import rope_attention_factor, rope_inv_freq


def apply_rope_pairs(x, cos, sin):
    """x: [T, N, R]; cos, sin: [T, R / 2]: RoPE on interleaved pairs (x0, x1), (x2, x3), ...
    (DeepSeek's layout), each turned by one frequency. The result lists the pairs' first
    elements, then their second ones: the same dot products as the interleaved layout, for
    queries and keys alike."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_attend_latent(q_latent, q_rope, entry, kv_cache, batch, *, scale):
    """One device, the reference: write the step's entries [T, C + R] at slot_mapping into
    the layer's latent cache (kv_cache = (cache [P, S, C + R],)), then attend over it."""
    cache = write_latent(kv_cache[0], entry, batch.slot_mapping)
    return ragged_paged_mla(q_latent, q_rope, cache, batch, scale=scale), (cache,)


def route(x, router, *, arch: DeepseekArch):
    """DeepSeek's routing: (weights f32[T, k], experts i32[T, k]) of tokens x [T, D];
    router = (w [D, E], correction [E] or None). Scores are the router logits' softmax (V2)
    or sigmoid (V3), in float32; the choice adds V3's correction bias and, with groups,
    keeps only the topk_group best groups (a group's score: its best expert's, V2, or the
    sum of its two best, V3); the weights are the chosen experts' uncorrected scores,
    renormalised with norm_topk_prob, times routed_scaling_factor."""
    w, correction = router
    logits = x.astype(jnp.float32) @ w.astype(jnp.float32)  # f32[T, E]
    scores = (jax.nn.softmax(logits, axis=-1) if arch.scoring == "softmax"
              else jax.nn.sigmoid(logits))
    choice = scores if correction is None else scores + correction.astype(jnp.float32)
    groups = arch.num_groups
    if arch.topk_method != "greedy" and groups > 1:
        per_group = choice.reshape(choice.shape[0], groups, -1)  # [T, G, E / G]
        if arch.topk_method == "noaux_tc":
            group_scores = jax.lax.top_k(per_group, 2)[0].sum(-1)
        else:
            group_scores = per_group.max(-1)
        _, best = jax.lax.top_k(group_scores, arch.topk_groups)  # [T, topk_group]
        keep = jax.nn.one_hot(best, groups, dtype=jnp.bool_).any(axis=1)  # [T, G]
        keep = jnp.repeat(keep, arch.num_experts // groups, axis=1)  # [T, E]
        choice = jnp.where(keep, choice, -jnp.inf if correction is not None else 0.0)
    _, experts = jax.lax.top_k(choice, arch.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if arch.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * arch.routed_scaling_factor, experts


class MLAttention(nnx.Module):
    def __init__(self, arch: DeepseekArch, dtype, quantization=None) -> None:
        d, n, c, q = arch.hidden_size, arch.num_heads, arch.kv_lora_rank, arch.q_lora_rank
        h = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        if q:
            kernel(self, "wq_a", (d, q), dtype, quantization)  # [D, Q]
            self.q_a_norm = RMSNorm(q, arch.rms_norm_eps, dtype)
            kernel(self, "wq_b", (q, n, h), dtype, quantization)  # [Q, N, P + R]
        else:
            kernel(self, "wq", (d, n, h), dtype, quantization)  # [D, N, P + R]
        kernel(self, "wkv_a", (d, arch.latent_dim), dtype, quantization)  # [D, C + R]
        self.kv_a_norm = RMSNorm(c, arch.rms_norm_eps, dtype)
        kernel(self, "wk_b", (c, n, arch.qk_nope_head_dim), dtype, quantization)  # [C, N, P]
        kernel(self, "wv_b", (c, n, arch.v_head_dim), dtype, quantization)  # [C, N, V]
        kernel(self, "wo", (n, arch.v_head_dim, d), dtype, quantization)  # [N, V, D]
        if arch.attention_bias:
            if q:
                self.bq_a = nnx.Param(jnp.zeros((q,), dtype))
            self.bkv_a = nnx.Param(jnp.zeros((arch.latent_dim,), dtype))
            self.bo = nnx.Param(jnp.zeros((d,), dtype))
        self.bias = arch.attention_bias
        self.q_lora = bool(q)
        self.nope, self.latent = arch.qk_nope_head_dim, c
        self.rope = apply_rope_pairs if arch.rope_interleave else apply_rope
        self.scale = arch.softmax_scale

    def __call__(self, x, cos, sin, cache, batch, attend_latent):
        if self.q_lora:
            qa = matmul("td,dq->tq", x, self, "wq_a")
            if self.bias:
                qa = qa + self.bq_a[...]
            q = matmul("tq,qnh->tnh", self.q_a_norm(qa), self, "wq_b")
        else:
            q = matmul("td,dnh->tnh", x, self, "wq")
        kv = matmul("td,dl->tl", x, self, "wkv_a")  # [T, C + R]
        if self.bias:
            kv = kv + self.bkv_a[...]
        c = self.kv_a_norm(kv[:, :self.latent])
        q_rope = self.rope(q[..., self.nope:], cos, sin)
        k_rope = self.rope(kv[:, None, self.latent:], cos, sin)[:, 0]
        entry = jnp.concatenate([c, k_rope], axis=-1)  # [T, C + R]
        w_uk = dequantized(self, "wk_b", x.dtype)
        q_latent = jnp.einsum("tnp,cnp->tnc", q[..., :self.nope], w_uk)  # [T, N, C]
        out, cache = attend_latent(q_latent, q_rope, entry, cache, batch, scale=self.scale)
        out = jnp.einsum("tnc,cnv->tnv", out, dequantized(self, "wv_b", x.dtype))
        out = matmul("tnv,nvd->td", out, self, "wo")
        return (out + self.bo[...] if self.bias else out), cache


class DeepseekMoE(nnx.Module):
    """The routed experts (moe_block with `route`, any moe_fn of its signature: expert
    parallelism included) plus the shared experts' MLP."""

    def __init__(self, arch: DeepseekArch, dtype, moe_fn: Callable = moe_block,
                 quantization=None) -> None:
        d, e, f = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
        self.router = nnx.Param(jnp.zeros((d, e), dtype))  # [D, E]
        if arch.correction_bias:
            self.score_correction = nnx.Param(jnp.zeros((e,), jnp.float32))  # f32[E]
        kernel(self, "experts_gate", (e, d, f), dtype, quantization)  # [E, D, F]
        kernel(self, "experts_up", (e, d, f), dtype, quantization)  # [E, D, F]
        kernel(self, "experts_down", (e, f, d), dtype, quantization)  # [E, F, D]
        if arch.shared_expert_size:
            shared = dataclasses.replace(arch, intermediate_size=arch.shared_expert_size)
            self.shared_expert = MLP(shared, dtype, quantization)
        self.has_shared = bool(arch.shared_expert_size)
        self.has_correction = arch.correction_bias
        self.moe_fn = functools.partial(moe_fn, top_k=arch.top_k, normalize=False,
                                        route=functools.partial(route, arch=arch))

    def __call__(self, x):
        names = ("experts_gate", "experts_up", "experts_down")
        quantize = activation_quantizer(self, names)
        options = {"quantize_rows": quantize} if quantize else {}
        router = (self.router[...],
                  self.score_correction[...] if self.has_correction else None)
        out = self.moe_fn(x, router, *(dequantized(self, name, x.dtype) for name in names),
                          **options)
        if self.has_shared:
            out = out + self.shared_expert(x)
        return out


class DeepseekDecoderLayer(nnx.Module):
    def __init__(self, arch: DeepseekArch, layer: int, dtype, moe_fn: Callable,
                 quantization=None) -> None:
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.attn = MLAttention(arch, dtype, quantization)
        self.post_attention_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = (DeepseekMoE(arch, dtype, moe_fn, quantization) if arch.sparse_layers[layer]
                    else MLP(arch, dtype, quantization))

    def __call__(self, x, cos, sin, cache, batch, attend_latent):
        attn_out, cache = self.attn(self.input_norm(x), cos, sin, cache, batch, attend_latent)
        x = x + attn_out
        return x + self.mlp(self.post_attention_norm(x)), cache


class DeepseekForCausalLM(nnx.Module):
    """DeepSeek V2 / V3: call(kv_caches, batch, attend_latent, groups) -> (caches, hidden
    [T, D]) with one latent cache per layer (a 1-tuple of [P, S, C + R]), and logits()."""

    def __init__(self, arch: DeepseekArch, dtype=jnp.float32, moe_fn: Callable = moe_block,
                 quantization=None) -> None:
        self.arch = arch
        self.embed = nnx.Param(jnp.zeros((arch.vocab_size, arch.hidden_size), dtype))  # [V, D]
        self.layers = nnx.List([DeepseekDecoderLayer(arch, i, dtype, moe_fn, quantization)
                                for i in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if not arch.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.zeros((arch.vocab_size, arch.hidden_size), dtype))

    def __call__(self, kv_caches: list, batch, attend: Callable = None, groups=None):
        attend = attend or reference_attend_latent
        x = self.embed[...][batch.token_ids]
        inv_freq = rope_inv_freq(self.arch)  # f32[R / 2], a compile-time constant
        freqs = batch.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        if not self.arch.rope_interleave:  # rotate_half's layout: [T, R]
            freqs = jnp.concatenate([freqs, freqs], axis=-1)
        factor = rope_attention_factor(self.arch)  # YaRN's mscale ratio, else 1
        cos, sin = (jnp.cos(freqs) * factor).astype(x.dtype), (jnp.sin(freqs) * factor).astype(
            x.dtype)
        caches = KVSlots(kv_caches, batch, groups)
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, cos, sin, *caches.of_layer(i), attend)
            caches.update(i, cache)
        return caches.caches, self.norm(x)

    def logits(self, hidden):
        """hidden: [X, D] -> f32[X, V]."""
        head = self.embed if self.arch.tie_word_embeddings else self.lm_head
        return jnp.einsum("xd,vd->xv", hidden, head[...]).astype(jnp.float32)
