"""The Llama family and its mixture-of-experts variants in PyTorch: the torch backend's models.

The same architectures as llama.py and mixtral.py (Llama 2/3, Mistral, Qwen2, Qwen3;
Mixtral, Qwen2-MoE, Qwen3-MoE), configured by the same LlamaArch / MixtralArch and loaded
from the same checkpoint layout (llama_arch.hf_param_path, mixtral_arch.hf_param_path):
parameters keep the engine's shapes (wq [D, N, H], wk/wv [D, K, H], wo [N, H, D], MLP
weights [in, out], experts [E, D, F] / [E, F, D]) and their paths, so the module's
parameter named "layers.3.attn.wq" is the JAX model's ("layers", 3, "attn", "wq").

The forward pass takes the ragged batch of docs/architecture.md (T tokens of R sequences)
as torch tensors, writes each layer's K/V into its paged cache in place and attends through
`attend` (the torch runner picks the Triton kernels or the PyTorch reference). The MoE block
runs each expert on the tokens routed to it (a loop over experts), as HF does.

With `quantization` (a checkpoint's LinearQuant) the kernels it covers are QuantizedKernel
modules holding the stored components ("layers.3.attn.wq.values", ...), run through
models/torch/quantized.py's helpers: dequantized in the step, activations rounded as the
scheme says.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from jaxserve.models.llama_arch import LlamaArch, rope_attention_factor, rope_inv_freq
from jaxserve.models.torch.quantized import activation_quantizer, kernel, matmul, weight


def _param(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


def apply_rope(x, cos, sin):
    """x: [T, N, H]; cos, sin: [T, R] (HF's rotate_half convention: halves, not pairs): the
    first R dims of each head turn, the rest pass (partial rotary: R < H)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    norm_cls = RMSNorm  # the q/k norms' class (Gemma's: models/torch/gemma.py)

    def __init__(self, arch: LlamaArch, layer: int, dtype, quantization=None) -> None:
        super().__init__()
        d, n, k, h = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
        kernel(self, "wq", (d, n, h), dtype, quantization)  # [D, N, H]
        kernel(self, "wk", (d, k, h), dtype, quantization)  # [D, K, H]
        kernel(self, "wv", (d, k, h), dtype, quantization)  # [D, K, H]
        kernel(self, "wo", (n, h, d), dtype, quantization)  # [N, H, D]
        self.heads = (n, k, h)
        if arch.attention_bias:
            self.bq, self.bk, self.bv = (_param(n, h, dtype=dtype), _param(k, h, dtype=dtype),
                                         _param(k, h, dtype=dtype))
        if arch.qk_norm:
            self.q_norm = self.norm_cls(h, arch.rms_norm_eps, dtype)
            self.k_norm = self.norm_cls(h, arch.rms_norm_eps, dtype)
        self.bias, self.qk_norm = arch.attention_bias, arch.qk_norm
        self.scale = h ** -0.5
        self.window = arch.sliding_windows[layer]
        self.soft_cap = None  # attention logits' tanh cap (Gemma 2)

    def forward(self, x, cos, sin, kv_cache, batch, attend):
        t, (n, kv, h) = x.shape[0], self.heads
        q = matmul(x, self, "wq").view(t, n, h)  # [T, N, H]
        k = matmul(x, self, "wk").view(t, kv, h)  # [T, K, H]
        v = matmul(x, self, "wv").view(t, kv, h)
        if self.bias:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, kv_cache, batch, scale=self.scale, sliding_window=self.window,
                     soft_cap=self.soft_cap)
        return matmul(out.reshape(t, -1), self, "wo")


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, quantization=None) -> None:
        super().__init__()
        kernel(self, "w_gate", (hidden, intermediate), dtype, quantization)  # [D, F]
        kernel(self, "w_up", (hidden, intermediate), dtype, quantization)  # [D, F]
        kernel(self, "w_down", (intermediate, hidden), dtype, quantization)  # [F, D]

    def act(self, gate):
        return F.silu(gate)

    def forward(self, x):
        gate = self.act(matmul(x, self, "w_gate"))
        return matmul(gate * matmul(x, self, "w_up"), self, "w_down")


class SparseMoE(nn.Module):
    """mixtral.moe_block's function: softmax routing in float32 over all E experts, top-k,
    optionally renormalised (and cast to the model dtype, as Qwen does), each weighted
    expert output cast to the model dtype and summed, plus Qwen2-MoE's gated shared
    expert. Quantized experts are dequantized one at a time, and the rows entering their
    matmuls rounded as a dynamic activation scheme says (mixtral.moe_block's quantize_rows)."""

    names = ("experts_gate", "experts_up", "experts_down")

    def __init__(self, arch, dtype, quantization=None) -> None:
        super().__init__()
        d, e, f = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
        self.router = _param(d, e, dtype=dtype)  # [D, E]
        kernel(self, "experts_gate", (e, d, f), dtype, quantization)  # [E, D, F]
        kernel(self, "experts_up", (e, d, f), dtype, quantization)  # [E, D, F]
        kernel(self, "experts_down", (e, f, d), dtype, quantization)  # [E, F, D]
        if arch.shared_expert_size:
            self.shared_expert = MLP(d, arch.shared_expert_size, dtype, quantization)
            self.shared_gate = _param(d, 1, dtype=dtype)  # [D, 1]
        self.has_shared = bool(arch.shared_expert_size)
        self.top_k, self.normalize = arch.top_k, arch.norm_topk_prob
        self.cast_weights = arch.cast_routing_weights

    def forward(self, x):
        probs = torch.softmax((x @ self.router).float(), dim=-1)  # f32[T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.cast_weights:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        rounded = activation_quantizer(self, self.names) or (lambda rows: rows)
        # A loop over the experts that have tokens; each runs on its own tokens only.
        for e in torch.unique(experts).tolist():
            token, slot = torch.nonzero(experts == e, as_tuple=True)
            gate, up, down = (weight(self, name, x.dtype, e) for name in self.names)
            xs = rounded(x[token])
            h = rounded(F.silu(xs @ gate) * (xs @ up))
            y = (h @ down) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        if self.has_shared:
            out = out + torch.sigmoid(x @ self.shared_gate) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, layer: int, dtype, quantization=None) -> None:
        super().__init__()
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.attn = Attention(arch, layer, dtype, quantization)
        self.post_attention_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if getattr(arch, "sparse_layers", None) and arch.sparse_layers[layer]:
            self.mlp = SparseMoE(arch, dtype, quantization)
        else:
            self.mlp = MLP(arch.hidden_size, arch.intermediate_size, dtype, quantization)

    def forward(self, x, cos, sin, kv_cache, batch, attend):
        x = x + self.attn(self.input_norm(x), cos, sin, kv_cache, batch, attend)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaForCausalLM(nn.Module):
    """Every architecture of the Llama and MoE families (arch: LlamaArch or MixtralArch);
    quantization: None or a checkpoint's LinearQuant."""

    def __init__(self, arch: LlamaArch, dtype=torch.float32, quantization=None) -> None:
        super().__init__()
        self.arch = arch
        self.embed = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)  # [V, D]
        self.layers = nn.ModuleList([DecoderLayer(arch, i, dtype, quantization)
                                     for i in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if not arch.tie_word_embeddings:
            self.lm_head = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        if arch.num_labels:  # a sequence-classification head, [D, L]
            self.score = _param(arch.hidden_size, arch.num_labels, dtype=dtype)
        self.register_buffer("inv_freq", self.rope_table(arch), persistent=False)

    def init_rope(self, device) -> None:
        """The RoPE table on `device` (again after the model was built on the meta device)."""
        self.inv_freq = self.rope_table(self.arch).to(device)

    @staticmethod
    def rope_table(arch: LlamaArch) -> torch.Tensor:
        """f32[H/2]: RoPE's inverse frequencies (llama_arch.rope_inv_freq)."""
        return torch.from_numpy(rope_inv_freq(arch))

    def forward(self, kv_caches: list, batch, attend: Callable):
        """Final hidden states [T, D]. kv_caches: per layer (k_cache, v_cache), each
        [P, S, K, H], written in place; attend(q, k, v, kv_cache, batch, scale=,
        sliding_window=) -> [T, N, H] writes a layer's new K/V and attends."""
        x = self.embed[batch.token_ids]
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, H]
        factor = rope_attention_factor(self.arch)  # YaRN's mscale, else 1
        cos, sin = (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, batch, attend)
        return self.norm(x)

    def logits(self, hidden):
        """hidden: [X, D] -> f32[X, V]."""
        head = self.embed if self.arch.tie_word_embeddings else self.lm_head
        return (hidden @ head.T).float()

    def classify(self, hidden):
        """hidden: [X, D] -> f32[X, L], the sequence-classification head's logits."""
        return hidden.float() @ self.score.float()
