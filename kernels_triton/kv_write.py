"""The KV-cache write as a Triton kernel: ref.write_kv's function, without host reads.

Shape letters: T tokens, P pages, S block size (slots per page), K kv heads, H head dim.

Program (t, kb) copies token t's keys and values for a block of kv heads ([K', H] of k and
v, [T, K, H]) to slot_mapping[t] of the caches ([P, S, K, H]; slot = page * S + offset),
converting them to the caches' dtype in place. Padding tokens point at slot 0 of the null
page 0, which no sequence reads; a negative slot skips the token. The grid (T, K / K')
and every tile size come from static shapes, so the call can be captured in a CUDA graph.
Offsets are 64-bit: a cache can hold more than 2**31 elements.

As in attention.py, the compiled (CUDA) and interpreted (host) builds come from the same
function (which calls only triton.language builtins) and are chosen per call by
`interpret=`, whatever TRITON_INTERPRET says. One difference between them: Triton's
interpreter converts float32 to bfloat16 by truncation, where a GPU rounds to nearest even.
"""

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

MAX_TILE = 4096  # elements of [K', H] per program


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, interpret: bool = False) -> None:
    """Scatter k, v ([T, K, H]) into k_cache, v_cache ([P, S, K, H]) at slot_mapping (int[T])
    in place. interpret=True runs Triton's interpreter on the host."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape or \
            tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} ([T, K, H]) do not fit the "
                         f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} ([P, S, K, H]).")
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(head_dim)
    block_k = min(triton.next_power_of_2(num_kv_heads), max(1, MAX_TILE // block_h))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_k))
    _WRITE[bool(interpret)][grid](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_K=block_k, BLOCK_H=block_h, num_warps=4,
    )


def _write_kernel(
    k_ptr, v_ptr,  # [T, K, H]
    kc_ptr, vc_ptr,  # [P, S, K, H]
    slot_ptr,  # int[T]
    k_st, k_sk, k_sh, v_st, v_sk, v_sh,
    kc_sp, kc_ss, kc_sk, kc_sh, vc_sp, vc_ss, vc_sk, vc_sh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    dim = tl.arange(0, BLOCK_H)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    page = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    # A negative slot masks every head. (No scalar bool in `&`: Triton's interpreter turns a
    # block & scalar of bools into int32, which it then refuses as a mask.)
    live_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads < live_heads)[:, None] & (dim < HEAD_DIM)[None, :]
    src = token.to(tl.int64)
    k = tl.load(k_ptr + src * k_st + heads[:, None] * k_sk + dim[None, :] * k_sh, mask=mask)
    v = tl.load(v_ptr + src * v_st + heads[:, None] * v_sk + dim[None, :] * v_sh, mask=mask)
    kc = kc_ptr + page * kc_sp + offset * kc_ss + heads[:, None] * kc_sk + dim[None, :] * kc_sh
    vc = vc_ptr + page * vc_sp + offset * vc_ss + heads[:, None] * vc_sk + dim[None, :] * vc_sh
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


_WRITE = {False: JITFunction(_write_kernel), True: InterpretedFunction(_write_kernel)}
