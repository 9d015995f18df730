"""A layer's attention on the torch backend: write the step's K/V into the paged cache, then
attend, with the Triton kernels of kernels_triton/ (compiled on a GPU, in interpret mode on
the CPU) or the PyTorch reference (kernels_triton/ref.py); make_attend picks one for an
attention_backend setting and device, as backends/jax/attend.py does on the JAX backend. A
quantized cache's layers bring their scales (kv_quant.attend_quantized).
"""

from __future__ import annotations

import functools
import logging

import torch

from jaxserve.backends.kv_formats import is_quantized
from jaxserve.backends.torch.kv_quant import attend_quantized
from jaxserve.config.engine_config import TORCH_ATTENTION_BACKENDS
from jaxserve.kernels_triton import ref

logger = logging.getLogger(__name__)


def make_attend(backend: str, device: torch.device, head_dim: int,
                kv_cache_dtype: str = "auto"):
    """attend(q, k, v, kv_cache, batch, *, scale, sliding_window, soft_cap) -> out [T, N, H]
    for the models: writes the layer's new K/V into its cache in place, then attends (a quantized
    cache's layers bring their scales: kv_quant.attend_quantized); the name of the
    implementation for the log; and whether a CUDA graph can capture it (the compiled
    Triton kernels read nothing on the host). ValueError for a backend this device cannot
    run."""
    if backend not in TORCH_ATTENTION_BACKENDS:
        raise ValueError(f"The torch backend's attention_backend is one of "
                         f"{', '.join(TORCH_ATTENTION_BACKENDS)}; got {backend!r} (a JAX "
                         "backend choice).")
    on_gpu = device.type == "cuda"
    if backend == "triton" and not on_gpu:
        raise ValueError("attention_backend='triton' needs a GPU that torch can see; on the "
                         "CPU use 'triton-interpret' (the Triton kernels in interpret mode, "
                         "slow), 'reference' or 'auto'.")
    use_triton = backend in ("triton", "triton-interpret") or (backend == "auto" and on_gpu)
    if use_triton:
        try:
            from jaxserve.kernels_triton import attention, kv_write
        except ImportError as err:
            raise ImportError(f"attention_backend={backend!r} needs Triton: pip install "
                              f"triton ({err})") from None

        if not attention.supports(head_dim):
            if backend != "auto":
                raise ValueError(f"The Triton kernels need a power-of-two head_dim >= 16; this "
                                 f"model has {head_dim}. Use attention_backend='reference' or "
                                 "'auto'.")
            logger.info("Attention: the Triton kernels cannot tile head_dim %d.", head_dim)
            use_triton = False
    if not use_triton:
        write, attend_fn = ref.write_kv, ref.ragged_paged_attention
        name, capturable = "the PyTorch reference (kernels_triton/ref.py)", False
    else:
        interpret = backend == "triton-interpret"
        write = functools.partial(kv_write.write_kv, interpret=interpret)
        attend_fn = functools.partial(attention.ragged_paged_attention, interpret=interpret)
        mode = "in Triton interpret mode (slow)" if interpret else "compiled"
        name = f"the Triton kernels (kernels_triton/), {mode}"
        capturable = on_gpu and not interpret
    if is_quantized(kv_cache_dtype):
        return attend_quantized(write, attend_fn), name, capturable

    def attend(q, k, v, kv_cache, batch, *, scale, sliding_window=None, soft_cap=None):
        write(*kv_cache, k, v, batch.slot_mapping)
        return attend_fn(q, *kv_cache, batch, scale=scale, sliding_window=sliding_window,
                         soft_cap=soft_cap)

    return attend, name, capturable
