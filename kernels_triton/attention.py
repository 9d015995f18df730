"""Ragged paged attention as Triton kernels: ref.py's function, without host reads.

Shape letters: T tokens, R rows, B blocks per row, P pages, S block size (slots per page),
K kv heads, N query heads, G = N / K query heads per kv head (Gp: padded to a power of two),
H head dim, Q query tokens per program (BlockSizes.q_tokens), L keys per tile
(BlockSizes.tile_keys), X kv splits.

Every launch parameter (grid, tile sizes, constexprs, buffer shapes) comes from static
shapes only; the batch's contents are read by the kernels, never by the host, so a call can
be captured in a CUDA graph per (T, R) bucket.

Layout of a program. The grid is (T // Q + R, K, X). Program (b, kh, x) owns query block b:
up to Q consecutive query tokens of ONE sequence, together with the G query heads that read
kv head kh, as the M = Q * Gp rows of its tiles (row r: token r // Gp, head r % Gp; Gp is
raised so that M >= 16, the smallest tl.dot). Sequence s owns the query blocks from
start(s) = cu_q_lens[s] // Q + s on, at least ceil(q_len / Q) of them, so T // Q + R
blocks always cover the batch. A program finds its sequence by a binary search over
start(s), and returns at once when its block is past the sequence's tokens or past the
last real sequence (padding). It then walks the keys its tokens can see (causal, sliding
window) L at a time: key j of the sequence lives in slot j % S of page
block_tables[s, j // S], so a tile may cover part of a page or several pages. Scores
[M, L] and the weighted values come from two tl.dot calls, and the online softmax state
(running max m, denominator l, accumulator [M, H]) stays in float32 registers.

Loads are masked: keys at or past kv_len (the stale tail of the last page, and the junk
table entries after it) load as 0, K and V alike, and get probability 0, so NaN or
garbage in pages a sequence does not own never reaches an output. Values are loaded in
the caches' dtype and converted to float32 before any arithmetic (on the CPU, Triton's
interpreter computes garbage with bf16 operands); float32 dots use IEEE precision, 16-bit
inputs TF32, which holds bf16 and fp16 values exactly.

Split-KV (flash-decoding). When X > 1 the key range of each query block is cut into X
parts of whole tiles, one per program; each writes its normalised partial output, m and l
(float32, [X, T, N(, H)]), and a second small kernel merges the X parts with the
log-sum-exp rule. l starts zeroed and a program whose part holds no tile returns at once,
so a part that saw no key weighs 0 (short contexts leave most parts empty). Attention
sinks (ref.py) start split 0's state at (m = sink, l = 1); split 0 always holds a tile
of a real block, so the merge counts each sink once. The merge
kernel writes every row of the output, zeros for padding tokens; without splits the output
starts zeroed and the attention kernel writes only real tokens' rows.

Block sizes come from default_block_sizes (static T, R, K, G, H): decode-heavy buckets get
one-token blocks and, when that grid would leave the GPU idle, X > 1; prefill-heavy ones
bigger blocks and X = 1. `block_sizes=` overrides them.

Both builds of each kernel come from the same Python function: a JITFunction (compiled for
CUDA tensors) and an InterpretedFunction (numpy, on the host), picked per call by
`interpret=` whatever TRITON_INTERPRET says. The kernels call no jit'd function, their own
or triton.language's: tl.max, tl.sum and tl.zeros are jit'd functions, built when
triton.language is imported in the mode TRITON_INTERPRET chose then. An interpreted kernel
cannot call a compiled one, and calling an interpreted one leaves triton.language patched
for the interpreter, which breaks every later compile in the process. So reductions are
tl.reduce (a builtin) with triton.language's own combine functions, which the interpreter
recognises and runs as numpy reductions (the compiled build gets them as JITFunctions
whatever the mode), and zeros are tl.full.
"""

import dataclasses
import types

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

TARGET_PROGRAMS = 264  # two waves on an H100/H200 (132 SMs): splits fill a small decode grid
MAX_SPLITS = 16
MIN_DOT_ROWS = 16  # tl.dot needs every dimension >= 16 on the GPU
MAX_TILE_ELEMENTS = 64 * 128  # M * H of a query tile: registers for q and the accumulator

# The combine functions of the kernels' tl.reduce calls: triton.language's own, which the
# interpreter recognises (by identity) and runs as numpy reductions. They are jit'd
# functions built in the mode TRITON_INTERPRET chose at import; _builds gives the compiled
# build JITFunctions of them.
_MAX_COMBINE = tl.standard._elementwise_max
_SUM_COMBINE = tl.standard._sum_combine


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of one call, all powers of two.

    q_tokens: Q, query tokens of one sequence per program. tile_keys: L >= 16, keys per
    inner step (any number of pages: L < S reads part of a page, L > S several pages).
    kv_splits: X, programs that share one query block's keys (flash-decoding)."""

    q_tokens: int
    tile_keys: int
    kv_splits: int = 1

    def __post_init__(self) -> None:
        for name, least in (("q_tokens", 1), ("tile_keys", MIN_DOT_ROWS), ("kv_splits", 1)):
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= {least}, "
                                 f"got {value}.")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head_dim (Triton tiles are powers of two >= 16)."""
    return head_dim >= MIN_DOT_ROWS and not head_dim & (head_dim - 1)


def default_block_sizes(num_tokens: int, num_rows: int, *, num_kv_heads: int = 1,
                        group: int = 1, head_dim: int = 128,
                        target_programs: int = TARGET_PROGRAMS) -> BlockSizes:
    """The tile table, from the step's static shapes only.

    About one token per row (decode-heavy): one-token blocks, since a block never spans two
    sequences and the G heads already give it rows; X doubles (up to 16) while the grid of
    T * K real blocks times X stays under half the target, so a few long decodes still
    fill the device. More tokens per row (prefill-heavy): Q up to 64 tokens with
    M * H = Q * Gp * H <= MAX_TILE_ELEMENTS, so one page read serves many queries; X = 1.
    Keys per tile: 32, 16 for head_dim > 128. Not tuned on a GPU; picked from ptxas -v
    for sm_90 over T/R buckets x GQA 1..8 x head_dim 32..256 x bf16/f32 (num_warps from
    launch_warps): no spills but for a few dozen bytes at head_dim <= 64, where 64-key tiles,
    4 warps on 2048-element query tiles or [64, 256] query tiles spill hundreds of bytes.
    """
    group_p = next_power_of_2(group)
    per_row = max(1, num_tokens // max(1, num_rows))
    if per_row <= 2:
        q_tokens = 1
    else:
        max_rows = max(1, MAX_TILE_ELEMENTS // head_dim)
        q_tokens = min(64, 1 << (per_row.bit_length() - 1), max(1, max_rows // group_p))
    tile_keys = 32 if head_dim <= 128 else 16
    splits = 1
    if q_tokens == 1:
        blocks = max(1, num_tokens) * num_kv_heads
        while splits < MAX_SPLITS and blocks * splits * 2 <= target_programs:
            splits *= 2
    return BlockSizes(q_tokens=q_tokens, tile_keys=tile_keys, kv_splits=splits)


def launch_warps(rows: int, head_dim: int) -> int:
    """num_warps for M = rows query rows of head_dim: 8 but for the smallest tiles."""
    return 4 if rows * head_dim <= 1024 else 8


ONE_BYTE_CACHES = (torch.float8_e4m3fn, torch.int8)  # kv_cache_dtype fp8, int8


def ragged_paged_attention(q, k_cache, v_cache, batch, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None, interpret: bool = False,
                           block_sizes: BlockSizes | None = None) -> torch.Tensor:
    """q: [T, N, H]; k_cache, v_cache: [P, S, K, H] in q's dtype, or a quantized cache's
    one-byte values (float8_e4m3fn, int8: backends/torch/kv_quant.py folds their scales into q and
    the output); sinks: f32[N] or None; returns [T, N, H] in q.dtype (ref.py's contract).
    interpret=True runs Triton's interpreter on the host."""
    _check(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    sizes = block_sizes or default_block_sizes(
        num_tokens, batch.block_tables.shape[0], num_kv_heads=num_kv_heads,
        group=num_heads // num_kv_heads, head_dim=head_dim)
    splits = sizes.kv_splits
    if num_tokens == 0:
        return torch.zeros_like(q)
    if sinks is not None:
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    attention = _ATTENTION[bool(interpret)]
    if splits == 1:
        out = torch.zeros_like(q)  # rows of padding tokens are never written
        _launch_attention(attention, q, k_cache, v_cache, batch, out, None, sizes, **options)
        return out
    part = q.new_empty((splits, num_tokens, num_heads, head_dim), dtype=torch.float32)
    stats = q.new_zeros((2, splits, num_tokens, num_heads), dtype=torch.float32)  # m, l
    _launch_attention(attention, q, k_cache, v_cache, batch, part, stats, sizes, **options)
    out = torch.empty_like(q)  # the merge writes every row
    _launch_merge(_MERGE[bool(interpret)], part, stats, out, batch)
    return out


def _launch_attention(kernel, q, k_cache, v_cache, batch, out, stats, sizes, *, scale,
                      sliding_window, soft_cap, sinks) -> None:
    """out: [T, N, H] (stats None) or f32 partials [X, T, N, H] with stats f32 [2, X, T, N],
    (m, l), l zeroed: a split whose program finds no key to attend leaves its l at 0."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_rows = batch.block_tables.shape[0]
    group = num_heads // num_kv_heads
    # Gp: G padded to a power of two, and so that a block has the 16 rows tl.dot needs.
    group_p = max(next_power_of_2(group), MIN_DOT_ROWS // min(sizes.q_tokens, MIN_DOT_ROWS))
    rows = sizes.q_tokens * group_p
    if stats is None:  # one split: out is the output; m and l are not written
        m, denom, split_stride, stat_strides = out, out, 0, (0, 0)
    else:
        (m, denom), split_stride, stat_strides = stats, out.stride(0), stats.stride()[1:3]
    grid = (num_tokens // sizes.q_tokens + num_rows, num_kv_heads, sizes.kv_splits)
    kernel[grid](
        q, k_cache, v_cache, out, m, denom, q if sinks is None else sinks,
        batch.cu_q_lens, batch.kv_lens, batch.block_tables, batch.num_seqs,
        float(scale), float(soft_cap or 0.0), int(sliding_window or 0),
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        split_stride, *out.stride()[-3:], *stat_strides, *batch.block_tables.stride(),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, GROUP_P=group_p, BLOCK_Q=sizes.q_tokens,
        TILE=sizes.tile_keys, SPLITS=sizes.kv_splits, HEAD_DIM=head_dim,
        SEARCH_STEPS=max(1, num_rows.bit_length()),
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=soft_cap is not None,
        HAS_SINKS=sinks is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=launch_warps(rows, head_dim), num_stages=2,
    )


def _launch_merge(kernel, part, stats, out, batch) -> None:
    """Merge the X partials [X, T, N, H] with their stats [2, X, T, N] into out [T, N, H]."""
    splits, num_tokens, num_heads, head_dim = part.shape
    heads_block = min(next_power_of_2(num_heads), max(1, 2048 // head_dim))
    grid = (num_tokens, triton.cdiv(num_heads, heads_block))
    kernel[grid](
        part, stats[0], stats[1], out, batch.cu_q_lens, batch.num_seqs,
        *part.stride()[:3], stats.stride(1), stats.stride(2), *out.stride(),
        NUM_HEADS=num_heads, HEADS_BLOCK=heads_block, HEAD_DIM=head_dim, SPLITS=splits,
        num_warps=4,
    )


def _check(q, k_cache, v_cache) -> None:
    _, num_heads, head_dim = q.shape
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if not supports(head_dim):
        raise ValueError(f"The Triton attention kernel needs a power-of-two head_dim >= 16, "
                         f"got {head_dim}; use the reference attention for this model.")
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)} disagree: caches are [P, S, K, H].")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}).")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, *ONE_BYTE_CACHES):
        raise ValueError(f"The caches must share q's dtype or be one of "
                         f"{', '.join(map(str, ONE_BYTE_CACHES))} (a quantized cache); got q "
                         f"{q.dtype}, caches {k_cache.dtype}, {v_cache.dtype}.")


def _attention_kernel(
    q_ptr, k_ptr, v_ptr,  # [T, N, H], [P, S, K, H], [P, S, K, H]
    o_ptr, m_ptr, l_ptr,  # output [T, N, H] or partials [X, T, N, H]; f32 [X, T, N] m and l
    sinks_ptr,  # f32 [N] (HAS_SINKS)
    cu_ptr, kv_lens_ptr, tables_ptr, num_seqs_ptr,  # i32 [R+1], [R], [R, B], [1]
    scale, soft_cap, window,
    q_st, q_sn, q_sh,
    k_sp, k_ss, k_sk, k_sh,
    v_sp, v_ss, v_sk, v_sh,
    o_sx, o_st, o_sn, o_sh,
    m_sx, m_st,
    table_sr, table_sb,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_seqs = tl.load(num_seqs_ptr)
    if block >= tl.load(cu_ptr + num_seqs) // BLOCK_Q + num_seqs:
        return  # past the last real sequence's blocks: padding

    # The sequence: the last s < num_seqs with start(s) = cu[s] // Q + s <= block.
    seq = num_seqs * 0
    hi = num_seqs - 1
    for _ in range(SEARCH_STEPS):
        mid = (seq + hi + 1) // 2
        ok = tl.load(cu_ptr + mid) // BLOCK_Q + mid <= block
        seq = tl.where(ok, mid, seq)
        hi = tl.where(ok, hi, mid - 1)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    first = (block - q_start // BLOCK_Q - seq) * BLOCK_Q  # first token, counted in the sequence
    if first >= q_len:
        return  # a spare block of this sequence
    kv_len = tl.load(kv_lens_ptr + seq)
    origin = kv_len - q_len  # position of the sequence's first query token

    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    token = first + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (token < q_len) & (rows % GROUP_P < GROUP)
    pos = origin + token  # each row's query position
    # Keys [lo_key, hi_key) are seen by some token of the block; this split takes its share
    # of their tiles.
    hi_key = origin + tl.minimum(first + BLOCK_Q, q_len)
    if HAS_WINDOW:
        lo_tile = tl.maximum(origin + first - window + 1, 0) // TILE
    else:
        lo_tile = hi_key * 0
    hi_tile = (hi_key + TILE - 1) // TILE
    per_split = (hi_tile - lo_tile + SPLITS - 1) // SPLITS
    tile_start = lo_tile + split * per_split
    tile_end = tl.minimum(tile_start + per_split, hi_tile)

    if SPLITS > 1:
        if tile_start >= tile_end:
            return  # no key for this split: its l stays 0, so the merge weighs it 0

    table_row = tables_ptr + seq.to(tl.int64) * table_sr
    dim = tl.arange(0, HEAD_DIM)
    q_off = (q_start + token).to(tl.int64) * q_st + head * q_sn
    q = tl.load(q_ptr + q_off[:, None] + dim[None, :] * q_sh, mask=row_ok[:, None], other=0.0)
    q = q.to(tl.float32)
    keys = tl.arange(0, TILE)
    m = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    denom = tl.full([BLOCK_Q * GROUP_P], 0.0, tl.float32)
    if HAS_SINKS:  # split 0 starts from the sinks' term: m = sink, l = 1
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf"))
        m = tl.where(split == 0, sink, m)
        denom = tl.where(m > float("-inf"), 1.0, denom)
    acc = tl.full([BLOCK_Q * GROUP_P, HEAD_DIM], 0.0, tl.float32)
    for tile in range(tile_start, tile_end):
        key = tile * TILE + keys
        live = key < kv_len  # slots past kv_len may hold anything, NaN included
        page = tl.load(table_row + (key // BLOCK_SIZE) * table_sb, mask=live, other=0)
        slot = key % BLOCK_SIZE
        k_off = page.to(tl.int64) * k_sp + slot * k_ss + kv_head * k_sk
        v_off = page.to(tl.int64) * v_sp + slot * v_ss + kv_head * v_sk
        k = tl.load(k_ptr + k_off[None, :] + dim[:, None] * k_sh, mask=live[None, :], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + dim[None, :] * v_sh, mask=live[:, None], other=0.0)
        s = tl.dot(q, k.to(tl.float32), input_precision=PRECISION) * scale  # [M, L]
        if HAS_SOFT_CAP:  # cap * tanh(s / cap), tanh from exp(-2|x|) (never overflows)
            x = s / soft_cap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = soft_cap * tl.where(x < 0, -t, t)
        visible = live[None, :] & (key[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (key[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_next = tl.maximum(m, tl.reduce(s, 1, _MAX_COMBINE))
        m_safe = tl.where(m_next == float("-inf"), 0.0, m_next)  # rows that saw no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.reduce(p, 1, _SUM_COMBINE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m = m_next

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    token_row = (q_start + token).to(tl.int64)
    o_off = split.to(tl.int64) * o_sx + token_row * o_st + head * o_sn
    tl.store(o_ptr + o_off[:, None] + dim[None, :] * o_sh, out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if SPLITS > 1:
        stat_off = split.to(tl.int64) * m_sx + token_row * m_st + head
        tl.store(m_ptr + stat_off, m, mask=row_ok)
        tl.store(l_ptr + stat_off, denom, mask=row_ok)


def _merge_kernel(
    part_ptr, m_ptr, l_ptr,  # f32 [X, T, N, H] normalised partial outputs, [X, T, N] m and l
    o_ptr,  # [T, N, H]
    cu_ptr, num_seqs_ptr,
    p_sx, p_st, p_sn,
    m_sx, m_st,
    o_st, o_sn, o_sh,
    NUM_HEADS: tl.constexpr, HEADS_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # 64-bit offsets: X * T * N * H may pass 2**31
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    dim = tl.arange(0, HEAD_DIM)
    # Padding tokens read nothing and get zeros. (No scalar bool in `&`: Triton's interpreter
    # turns a block & scalar of bools into int32, which it then refuses as a mask.)
    real_heads = tl.where(token < tl.load(cu_ptr + tl.load(num_seqs_ptr)), NUM_HEADS, 0)
    ok = heads < real_heads

    # The largest m over the splits that saw a key; each split weighs l * exp(m - max).
    stat_off = token * m_st + heads
    splits = tl.arange(0, SPLITS).to(tl.int64)
    stat_all = splits[:, None] * m_sx + stat_off[None, :]  # [X, heads]
    m_all = tl.load(m_ptr + stat_all, mask=ok[None, :], other=float("-inf"))
    l_all = tl.load(l_ptr + stat_all, mask=ok[None, :], other=0.0)
    m_max = tl.reduce(tl.where(l_all > 0, m_all, float("-inf")), 0, _MAX_COMBINE)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)

    m_x_ptr = m_ptr + stat_off
    l_x_ptr = l_ptr + stat_off
    part_x_ptr = part_ptr + (token * p_st + heads * p_sn)[:, None] + dim[None, :]
    total = tl.full([HEADS_BLOCK], 0.0, tl.float32)
    acc = tl.full([HEADS_BLOCK, HEAD_DIM], 0.0, tl.float32)
    for _ in range(SPLITS):
        m_x = tl.load(m_x_ptr, mask=ok, other=0.0)
        l_x = tl.load(l_x_ptr, mask=ok, other=0.0)
        part = tl.load(part_x_ptr, mask=ok[:, None], other=0.0)
        weight = tl.where(l_x > 0, l_x * tl.exp(tl.minimum(m_x - m_max, 0.0)), 0.0)
        total += weight
        acc += weight[:, None] * tl.where(weight[:, None] > 0, part, 0.0)  # part may be unset
        m_x_ptr += m_sx
        l_x_ptr += m_sx
        part_x_ptr += p_sx
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    o_off = token * o_st + heads * o_sn
    tl.store(o_ptr + o_off[:, None] + dim[None, :] * o_sh, out.to(o_ptr.dtype.element_ty),
             mask=(heads < NUM_HEADS)[:, None])


def _as_compiled(fn):
    """fn (a function of triton.language, built for the mode TRITON_INTERPRET chose at
    import) as a JITFunction, which a compiled kernel can call."""
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)


def _builds(fn):
    """{interpret: kernel}: the compiled (CUDA) and interpreted (host) builds of fn, made
    directly rather than through triton.jit, which picks one by TRITON_INTERPRET. The
    interpreted build reads the module's globals, so its reductions combine with
    triton.language's own functions; the compiled build reads a copy of them in which the
    combine functions are JITFunctions."""
    compiled_globals = {**fn.__globals__, "_MAX_COMBINE": _as_compiled(_MAX_COMBINE),
                        "_SUM_COMBINE": _as_compiled(_SUM_COMBINE)}
    compiled_fn = types.FunctionType(fn.__code__, compiled_globals, fn.__name__,
                                     fn.__defaults__, fn.__closure__)
    return {False: JITFunction(compiled_fn), True: InterpretedFunction(fn)}


_ATTENTION = _builds(_attention_kernel)
_MERGE = _builds(_merge_kernel)
