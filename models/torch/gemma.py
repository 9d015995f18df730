"""Gemma 2 and Gemma 3 (text) in PyTorch: the torch backend's twin of models/jax/gemma.py,
configured by the same GemmaArch and loaded from the same parameter paths (what differs
from Llama is listed in models/gemma_arch.py); a checkpoint's quantization as in llama.py."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from jaxserve.models.gemma_arch import GemmaArch
from jaxserve.models.llama_arch import rope_attention_factor, rope_inv_freq
from jaxserve.models.torch.llama import MLP, Attention, _param


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, then cast back."""

    def __init__(self, dim: int, eps: float, dtype) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    """Llama's attention with Gemma's q/k norms, query_pre_attn_scalar and soft cap."""

    norm_cls = GemmaRMSNorm

    def __init__(self, arch: GemmaArch, layer: int, dtype, quantization=None) -> None:
        super().__init__(arch, layer, dtype, quantization)
        self.scale = arch.query_pre_attn_scalar ** -0.5
        self.soft_cap = arch.attn_logit_softcapping


class GemmaMLP(MLP):
    """GeGLU: Llama's gated MLP with gelu (tanh approximation) on the gate."""

    def act(self, gate):
        return F.gelu(gate, approximate="tanh")


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: GemmaArch, layer: int, dtype, quantization=None) -> None:
        super().__init__()
        d, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_norm = GemmaRMSNorm(d, eps, dtype)
        self.attn = GemmaAttention(arch, layer, dtype, quantization)
        self.post_attention_norm = GemmaRMSNorm(d, eps, dtype)
        self.pre_feedforward_norm = GemmaRMSNorm(d, eps, dtype)
        self.mlp = GemmaMLP(d, arch.intermediate_size, dtype, quantization)
        self.post_feedforward_norm = GemmaRMSNorm(d, eps, dtype)

    def forward(self, x, cos, sin, kv_cache, batch, attend):
        x = x + self.post_attention_norm(self.attn(self.input_norm(x), cos, sin, kv_cache,
                                                   batch, attend))
        return x + self.post_feedforward_norm(self.mlp(self.pre_feedforward_norm(x)))


class GemmaForCausalLM(nn.Module):
    def __init__(self, arch: GemmaArch, dtype=torch.float32, quantization=None) -> None:
        super().__init__()
        self.arch = arch
        self.embed = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)  # [V, D]
        self.layers = nn.ModuleList([GemmaDecoderLayer(arch, i, dtype, quantization)
                                     for i in range(arch.num_layers)])
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if not arch.tie_word_embeddings:
            self.lm_head = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        # sqrt(hidden) rounded to the model's dtype, as HF scales the embeddings
        self.embed_scale = float(torch.tensor(arch.embed_scale, dtype=dtype, device="cpu"))
        self.init_rope("cpu")

    def init_rope(self, device) -> None:
        """Each layer's RoPE as (inverse frequencies f32[H/2], attention factor), one pair
        per distinct setting (full and sliding layers); again after the model was built on
        the meta device."""
        settings = {}
        self.rope = []
        for a in map(self.arch.layer_rope, range(self.arch.num_layers)):
            key = (a.rope_theta, a.rope_scaling)
            if key not in settings:
                settings[key] = (torch.from_numpy(rope_inv_freq(a)).to(device),
                                 rope_attention_factor(a))
            self.rope.append(settings[key])

    def forward(self, kv_caches: list, batch, attend: Callable):
        """Final hidden states [T, D] (as LlamaForCausalLM's; attend takes soft_cap= too)."""
        x = self.embed[batch.token_ids] * self.embed_scale
        positions = batch.positions.float()[:, None]
        tables = {}  # (cos, sin) [T, H] per distinct RoPE
        for layer, kv_cache, (inv_freq, factor) in zip(self.layers, kv_caches, self.rope):
            key = id(inv_freq)
            if key not in tables:
                freqs = positions * inv_freq[None, :]
                emb = torch.cat([freqs, freqs], dim=-1)
                tables[key] = ((emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype))
            x = layer(x, *tables[key], kv_cache, batch, attend)
        return self.norm(x)

    def logits(self, hidden):
        """hidden: [X, D] -> f32[X, V], soft-capped when the model says so (Gemma 2)."""
        head = self.embed if self.arch.tie_word_embeddings else self.lm_head
        logits = (hidden @ head.T).float()
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)
