"""Helpers of the Triton kernel tests: JAX/numpy arrays and batches as torch tensors, launches
recorded instead of run and compiled for a CUDA GPU without one (sm_90), meta-tensor
(shapes-only) cases, and interpreted_then_compiled, the check that
kernels/test_triton_kernels.py also runs in fresh processes under each TRITON_INTERPRET."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from jaxserve.kernels_triton import attention, kv_write, ref
from jaxserve.kernels_triton.attention import BlockSizes


def to_torch(x) -> torch.Tensor:
    """A JAX or numpy array as a torch tensor (bfloat16 through its bits)."""
    a = np.asarray(x)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def torch_batch(batch):
    return types.SimpleNamespace(**{name: to_torch(getattr(batch, name)) for name in
                                    ("cu_q_lens", "kv_lens", "block_tables", "num_seqs")})


class Recorder:
    """Stands in for a compiled kernel: records each launch instead of running it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@contextlib.contextmanager
def recording(builds):
    """builds ({interpret: kernel}) with its compiled kernel replaced by a Recorder."""
    recorder = builds[False] = Recorder(builds[False])
    try:
        yield recorder
    finally:
        builds[False] = recorder.kernel


def interpreted_then_compiled():
    """Interpreted launches match the reference; then, in the same process, compiled
    launches still build for CUDA. The TRITON_INTERPRET tests run this in fresh processes."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(4, 16, 1, 32, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(3, 2, 32, generator=gen).bfloat16()
    batch = types.SimpleNamespace(
        cu_q_lens=torch.tensor([0, 1, 3, 3], dtype=torch.int32),
        kv_lens=torch.tensor([9, 12, 0], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 0], [0, 0]], dtype=torch.int32),
        num_seqs=torch.tensor([2], dtype=torch.int32))
    want = ref.ragged_paged_attention(q, k_cache, v_cache, batch, scale=0.2)
    for sizes in (BlockSizes(1, 16, 2), BlockSizes(2, 16, 1)):
        got = attention.ragged_paged_attention(q, k_cache, v_cache, batch, scale=0.2,
                                               interpret=True, block_sizes=sizes)
        assert (got.float() - want.float()).abs().max() < 2e-2, sizes
    new = torch.randn(3, 1, 32, generator=gen).bfloat16()
    kv_write.write_kv(k_cache, v_cache, new, new, torch.tensor([21, 62, 0]), interpret=True)
    assert torch.equal(k_cache[1, 5], new[0]) and torch.equal(v_cache[3, 14], new[1])

    with recording(attention._ATTENTION) as attend, recording(attention._MERGE) as merge:
        attention.ragged_paged_attention(*meta_case(4, 4, 8, 2, 64, 16, 64, 8, torch.bfloat16),
                                         scale=0.125, soft_cap=20.0)
    for recorder in (attend, merge):
        (_, args, kwargs), = recorder.launches
        assert compile_for_cuda(recorder.kernel, args, kwargs).asm["cubin"]


TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.int32: "i32", torch.int64: "i64"}


def compile_for_cuda(kernel, args, kwargs):
    """The kernel, as one launch would build it, compiled to a cubin for sm_90 (H100/H200)."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    signature = {}
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
    signature.update({name: "constexpr" for name in kwargs})
    source = ASTSource(kernel, signature=signature, constexprs=dict(kwargs))
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def meta_case(num_tokens, num_rows, num_heads, num_kv_heads, head_dim, block_size,
              num_pages, width, dtype):
    """Shapes only: meta tensors hold no data, so any host read of a value would fail."""
    def ints(*shape):
        return torch.empty(shape, dtype=torch.int32, device="meta")

    batch = types.SimpleNamespace(cu_q_lens=ints(num_rows + 1), kv_lens=ints(num_rows),
                                  block_tables=ints(num_rows, width), num_seqs=ints(1))
    cache = torch.empty((num_pages, block_size, num_kv_heads, head_dim), dtype=dtype,
                        device="meta")
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=dtype, device="meta")
    return q, cache, cache, batch
