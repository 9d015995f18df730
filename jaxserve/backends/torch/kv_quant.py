"""The quantized KV cache (kv_cache_dtype fp8 / int8) on the torch backend.

kv_quant.py's scheme in PyTorch, by kv_formats.py's rules: each layer's cache is
(k_cache, v_cache, k_scale, v_scale), the caches [P, S, K, H] of float8_e4m3fn or int8 and
the scales f32[K]. `attend_quantized` wraps an attend of the torch runner: the step's keys
and values are quantized before the write, the queries of kv head k are multiplied by its
key scale and the output by its value scale, so the Triton kernels and the PyTorch
reference read one-byte values and convert them as they convert any cache dtype.
`calibrate` runs the model once over the calibration text and records each layer's largest
|k| and |v| per kv head. Shape letters as in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from jaxserve.backends.kv_formats import cache_element, is_quantized, largest, scales_from_amax

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def value_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype: the model's for auto, else the one-byte format's."""
    if not is_quantized(kv_cache_dtype):
        return model_dtype
    return FORMATS[cache_element("", kv_cache_dtype)]


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, K, H] / scale f32[K] in the one-byte dtype: int8 rounds to nearest even;
    both saturate at the format's largest value."""
    top = largest("int8" if dtype == torch.int8 else "float8_e4m3fn")
    y = x.float() / scale[None, :, None]
    if dtype == torch.int8:
        y = torch.round(y)
    return y.clamp(-top, top).to(dtype)


def _per_query_head(scale: torch.Tensor, num_heads: int) -> torch.Tensor:
    """f32[K] -> f32[1, N, 1]: each query head takes its kv head's scale."""
    return scale.repeat_interleave(num_heads // scale.shape[0])[None, :, None]


def attend_quantized(write: Callable, attention: Callable) -> Callable:
    """attend(q, k, v, (k_cache, v_cache, k_scale, v_scale), batch, *, scale,
    sliding_window, soft_cap) -> out [T, N, H], from write(k_cache, v_cache, k, v,
    slot_mapping) and attention(q, k_cache, v_cache, batch, scale=, sliding_window=,
    soft_cap=) of the runner."""

    def attend(q, k, v, kv_cache, batch, *, scale, sliding_window=None, soft_cap=None):
        k_cache, v_cache, k_scale, v_scale = kv_cache
        write(k_cache, v_cache, quantize(k, k_scale, k_cache.dtype),
              quantize(v, v_scale, v_cache.dtype), batch.slot_mapping)
        queries = (q.float() * _per_query_head(k_scale, q.shape[1])).to(q.dtype)
        out = attention(queries, k_cache, v_cache, batch, scale=scale,
                        sliding_window=sliding_window, soft_cap=soft_cap)
        return (out.float() * _per_query_head(v_scale, out.shape[1])).to(out.dtype)

    return attend


@dataclasses.dataclass
class _Batch:
    token_ids: torch.Tensor
    positions: torch.Tensor


def _calibration_attend(q, k, v, amax, batch, *, scale, sliding_window=None, soft_cap=None):
    """An attend for one sequence of fresh tokens without a cache: dense causal attention;
    amax = [f32[K], f32[K]] raised in place to the largest |k| and |v| per kv head."""
    amax[0] = torch.maximum(amax[0], k.float().abs().amax(dim=(0, 2)))
    amax[1] = torch.maximum(amax[1], v.float().abs().amax(dim=(0, 2)))
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)  # [T, N, H]
    vals = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("tnh,unh->ntu", q.float(), keys) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    pos = torch.arange(num_tokens, device=q.device)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("ntu,unh->tnh", p, vals).to(q.dtype)


@torch.no_grad()
def calibrate(model, token_ids: torch.Tensor, num_layers: int, num_kv_heads: int,
              kv_cache_dtype: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_scale f32[K], v_scale f32[K]) of the torch model on i32[T] token ids,
    on the token ids' device."""
    device = token_ids.device
    amax = [[torch.zeros(num_kv_heads, device=device) for _ in range(2)]
            for _ in range(num_layers)]
    positions = torch.arange(token_ids.shape[0], dtype=torch.int32, device=device)
    model(amax, _Batch(token_ids.long(), positions), _calibration_attend)
    scale = lambda a: torch.from_numpy(scales_from_amax(a.cpu().numpy(),
                                                         kv_cache_dtype)).to(device)
    return [(scale(k), scale(v)) for k, v in amax]
