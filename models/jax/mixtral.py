"""Sparse mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) as Flax NNX modules.

A MoE model is llama.py's decoder with a sparse MoE block in place of the MLP on its sparse
layers: attention, norms, RoPE, embeddings, the forward pass and the logits are llama.py's.
The block is one pure function, `moe_block`, which routes each token to its top-k experts and
runs them as grouped matmuls (`jax.lax.ragged_dot`) over the assignments sorted by expert. It
can run on a slice of the experts, so expert parallelism is `moe_block` under `shard_map` on
each device's experts plus a `psum` (see `expert_parallel`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxserve.models.jax.llama import MLP, DecoderLayer, LlamaForCausalLM
from jaxserve.models.jax.quantized import activation_quantizer, dequantized, kernel
from jaxserve.models.mixtral_arch import MixtralArch, hf_param_path  # noqa: F401


def moe_block(x, router_w, w_gate, w_up, w_down, *biases, top_k: int, normalize: bool,
              first_expert=0, cast_weights: bool = False, swiglu=None, quantize_rows=None,
              route: Callable | None = None):
    """The sparse MoE MLP of tokens x: [T, D] -> [T, D], as HF computes it.

    router_w: [D, E] over all E experts. w_gate, w_up: [E_local, D, F], w_down: [E_local, F, D]
    hold experts first_expert .. first_expert + E_local - 1 (all of them by default).
    first_expert may be traced (e.g. axis_index * E_local under shard_map). biases (GPT-OSS):
    (router [E], gate [E_local, F], up [E_local, F], down [E_local, D]), or none.

    Routing: softmax over all E experts in float32, top_k, optionally renormalised to sum 1
    (Mixtral always; Qwen with norm_topk_prob), cast to x's dtype first if cast_weights (Qwen).
    With swiglu = (alpha, limit) (GPT-OSS) the top-k logits are softmaxed instead (the same
    weights as renormalising, in HF's order) and each expert's activation is the clamped
    SwiGLU, (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
    Every shard routes identically; an assignment to an expert outside this slice contributes
    zero, so summing (psum) the results of disjoint slices that cover all experts gives the
    result on all experts. Shapes are static: T * top_k assignment rows whatever the routing.
    quantize_rows (a quantized checkpoint's dynamic activation scheme) rounds the rows that
    enter the expert matmuls, as its fp8 / int8 kernels would.
    route(x, router_w) -> (weights f32[T, k], experts i32[T, k]) replaces the routing above
    (DeepSeek's grouped routing, models/jax/deepseek.py); router_w is then whatever it reads.
    """
    num_tokens, num_local = x.shape[0], w_gate.shape[0]
    if route is not None:
        weights, experts = route(x, router_w)
    else:
        weights, experts = _route_top_k(x, router_w, biases[0] if biases else None, top_k,
                                        normalize, swiglu is not None)
    if cast_weights:
        weights = weights.astype(x.dtype)
    local = experts - first_expert  # i32[T, k]
    is_local = (local >= 0) & (local < num_local)
    group = jnp.where(is_local, local, num_local).reshape(-1)  # i32[T*k]; num_local = elsewhere
    order = jnp.argsort(group, stable=True)  # assignments grouped by local expert, others last
    group_sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)
    xs = x[order // top_k]  # [T*k, D]: the token of each sorted assignment
    if quantize_rows is not None:
        xs = quantize_rows(xs)
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)  # [T*k, F]
    up = jax.lax.ragged_dot(xs, w_up, group_sizes)
    expert_of = jnp.minimum(group[order], num_local - 1)  # each sorted row's (local) expert
    if biases:
        gate, up = gate + biases[1][expert_of], up + biases[2][expert_of]
    if swiglu is None:
        h = jax.nn.silu(gate) * up
    else:
        alpha, limit = swiglu
        gate = jnp.minimum(gate, limit)
        h = (jnp.clip(up, -limit, limit) + 1) * gate * jax.nn.sigmoid(gate * alpha)
    if quantize_rows is not None:
        h = quantize_rows(h)
    ys = jax.lax.ragged_dot(h, w_down, group_sizes)  # [T*k, D]
    if biases:
        ys = ys + biases[3][expert_of]
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(num_tokens, top_k, -1)  # [T, k, D]
    # Each weighted expert output is cast to x's dtype and then summed, like HF's index_add_.
    contrib = jnp.where(is_local[..., None], y * weights[..., None], 0).astype(x.dtype)
    return contrib.sum(axis=1)


def _route_top_k(x, router_w, router_bias, top_k: int, normalize: bool, softmax_top: bool):
    """(weights f32[T, k], experts i32[T, k]): softmax over all experts then top_k (and
    renormalised), or (softmax_top, GPT-OSS) the top_k logits softmaxed."""
    logits = x @ router_w
    if router_bias is not None:
        logits = logits + router_bias
    if softmax_top:
        top, experts = jax.lax.top_k(logits.astype(jnp.float32), top_k)  # [T, k]
        return jax.nn.softmax(top, axis=-1), experts
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # f32[T, E]
    weights, experts = jax.lax.top_k(probs, top_k)  # [T, k]
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts


def expert_parallel(mesh: Mesh, axis: str) -> Callable:
    """moe_block with the experts sharded over mesh axis `axis` (E divisible by its size):
    each device runs its own experts on all tokens, then the results are summed. x, the
    router (any pytree: moe_block's route reads it) and its bias are replicated over `axis`;
    the experts' biases split like them.
    Pass it as MixtralForCausalLM(..., moe_fn=...)."""

    def fn(x, router_w, w_gate, w_up, w_down, *biases, **kw):
        def local(x, router_w, w_gate, w_up, w_down, *biases):
            first = jax.lax.axis_index(axis) * w_gate.shape[0]
            out = moe_block(x, router_w, w_gate, w_up, w_down, *biases, first_expert=first,
                            **kw)
            return jax.lax.psum(out, axis)

        rep, split = PartitionSpec(), PartitionSpec(axis)
        specs = (rep, rep, split, split, split) + ((rep, split, split, split) if biases else ())
        return jax.shard_map(local, mesh=mesh, in_specs=specs,
                             out_specs=rep)(x, router_w, w_gate, w_up, w_down, *biases)

    return fn


class SparseMoE(nnx.Module):
    def __init__(self, arch: MixtralArch, dtype, moe_fn: Callable = moe_block,
                 quantization=None) -> None:
        d, e, f = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
        self.router = nnx.Param(jnp.zeros((d, e), dtype))  # [D, E]
        kernel(self, "experts_gate", (e, d, f), dtype, quantization)  # [E, D, F]
        kernel(self, "experts_up", (e, d, f), dtype, quantization)  # [E, D, F]
        kernel(self, "experts_down", (e, f, d), dtype, quantization)  # [E, F, D]
        if arch.shared_expert_size:
            shared = dataclasses.replace(arch, intermediate_size=arch.shared_expert_size)
            self.shared_expert = MLP(shared, dtype, quantization)
            self.shared_gate = nnx.Param(jnp.zeros((d, 1), dtype))  # [D, 1]
        self.has_shared = bool(arch.shared_expert_size)
        self.moe_fn = functools.partial(moe_fn, top_k=arch.top_k, normalize=arch.norm_topk_prob,
                                        cast_weights=arch.cast_routing_weights)

    def __call__(self, x):
        names = ("experts_gate", "experts_up", "experts_down")
        quantize = activation_quantizer(self, names)
        options = {"quantize_rows": quantize} if quantize else {}
        out = self.moe_fn(x, self.router[...], *(dequantized(self, name, x.dtype)
                                                 for name in names), **options)
        if self.has_shared:
            out = out + jax.nn.sigmoid(x @ self.shared_gate[...]) * self.shared_expert(x)
        return out


class MoEDecoderLayer(DecoderLayer):
    """llama.py's decoder layer (its forward pass included) with the MoE block as its MLP on
    sparse layers; dense layers keep llama's MLP of intermediate_size."""

    def __init__(self, arch: MixtralArch, layer: int, dtype, moe_fn: Callable,
                 quantization=None) -> None:
        super().__init__(arch, layer, dtype, quantization)
        if arch.sparse_layers[layer]:
            self.mlp = SparseMoE(arch, dtype, moe_fn, quantization)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE and Qwen3-MoE: LlamaForCausalLM (call, logits) with MoE layers.
    moe_fn replaces moe_block (same signature), e.g. by expert_parallel(mesh, axis)."""

    def __init__(self, arch: MixtralArch, dtype=jnp.float32, moe_fn: Callable = moe_block,
                 quantization=None) -> None:
        # llama's dense layers are built, then replaced: free under nnx.eval_shape, which is
        # how the runner builds models.
        super().__init__(arch, dtype, quantization)
        self.layers = nnx.List([MoEDecoderLayer(arch, i, dtype, moe_fn, quantization)
                                for i in range(arch.num_layers)])
