"""GPT-OSS (GptOssForCausalLM) as Flax NNX modules: mixtral.py's MoE decoder with attention
sinks and an output bias, a biased router, expert biases and the clamped SwiGLU, and
RMSNorm weighted in float32 (models/gpt_oss_arch.py lists the differences)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.gpt_oss_arch import GptOssArch, hf_param_path  # noqa: F401
from jaxserve.models.jax.llama import Attention, RMSNorm
from jaxserve.models.jax.mixtral import MixtralForCausalLM, SparseMoE, moe_block
from jaxserve.models.jax.quantized import dequantized


class GptOssRMSNorm(RMSNorm):
    """RMSNorm as GPT-OSS computes it: weight * normalised x in float32, then cast."""

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * xf).astype(x.dtype)


class GptOssAttention(Attention):
    """Llama's attention (q/k/v biases, YaRN RoPE, its layer's window) with a learned sink
    per query head in every softmax and a bias on the output projection."""

    def __init__(self, arch: GptOssArch, layer: int, dtype, quantization=None) -> None:
        super().__init__(arch, layer, dtype, quantization)
        self.sinks = nnx.Param(jnp.zeros((arch.num_heads,), dtype))  # [N]
        self.bo = nnx.Param(jnp.zeros((arch.hidden_size,), dtype))  # [D]

    def attend_options(self) -> dict:
        return {**super().attend_options(), "sinks": self.sinks[...].astype(jnp.float32)}

    def __call__(self, x, cos, sin, kv_cache, batch, attend):
        out, kv_cache = super().__call__(x, cos, sin, kv_cache, batch, attend)
        return out + self.bo[...], kv_cache


class GptOssMoE(SparseMoE):
    """The MoE block with router and expert biases and the clamped SwiGLU (moe_block's
    swiglu), on any moe_fn of moe_block's signature (expert parallelism included)."""

    def __init__(self, arch: GptOssArch, dtype, moe_fn: Callable = moe_block,
                 quantization=None) -> None:
        super().__init__(arch, dtype, moe_fn, quantization)
        d, e, f = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
        self.router_bias = nnx.Param(jnp.zeros((e,), dtype))  # [E]
        self.experts_gate_bias = nnx.Param(jnp.zeros((e, f), dtype))  # [E, F]
        self.experts_up_bias = nnx.Param(jnp.zeros((e, f), dtype))  # [E, F]
        self.experts_down_bias = nnx.Param(jnp.zeros((e, d), dtype))  # [E, D]
        self.moe_fn = functools.partial(self.moe_fn,
                                        swiglu=(arch.swiglu_alpha, arch.swiglu_limit))

    def __call__(self, x):
        weights = (dequantized(self, name, x.dtype) for name in
                   ("experts_gate", "experts_up", "experts_down"))
        biases = (self.router_bias, self.experts_gate_bias, self.experts_up_bias,
                  self.experts_down_bias)
        return self.moe_fn(x, self.router[...], *weights, *(b[...] for b in biases))


class GptOssForCausalLM(MixtralForCausalLM):
    """GPT-OSS: MixtralForCausalLM (call, logits) with GPT-OSS's layers and norms."""

    def __init__(self, arch: GptOssArch, dtype=jnp.float32, moe_fn: Callable = moe_block,
                 quantization=None) -> None:
        # The MoE layers are built, then their parts replaced: free under nnx.eval_shape,
        # which is how the runner builds models.
        super().__init__(arch, dtype, moe_fn, quantization)
        for i, layer in enumerate(self.layers):
            layer.input_norm = GptOssRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
            layer.post_attention_norm = GptOssRMSNorm(arch.hidden_size, arch.rms_norm_eps,
                                                      dtype)
            layer.attn = GptOssAttention(arch, i, dtype, quantization)
            layer.mlp = GptOssMoE(arch, dtype, moe_fn, quantization)
        self.norm = GptOssRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
