"""What the two kernel checks share: scripts/check_kernels_on_device.py (the Pallas kernels,
pallas_checks.py and pallas_timing.py) and scripts/check_triton_kernels.py (the Triton
kernels, triton_checks.py and triton_timing.py) check the same kinds of batches against
their references with the same tolerances, print the same lines and time the same grid.

Framework-free (numpy only): the Triton checks never import JAX, the Pallas ones never
import torch.
"""

from __future__ import annotations

import math

import numpy as np

TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max abs error / max abs reference output
# (kind, dtype, S block size, K kv heads, N query heads, H head dim, sliding_window, soft_cap,
# attention sinks)
DEVICE_CHECKS = [(kind, dtype, 16, 8, 64, 128, None, None, False)
                 for kind in ("decode", "prefill", "mixed")
                 for dtype in ("float32", "bfloat16")]
DEVICE_CHECKS += [("mixed", dtype, 32, 2, 16, 64, 700, 30.0, False)
                  for dtype in ("float32", "bfloat16")]
# GPT-OSS's attention: 64 heads of 64 over 8 kv heads, a 128-token window, sinks
DEVICE_CHECKS += [(kind, "bfloat16", 16, 8, 64, 64, 128, None, True)
                  for kind in ("decode", "mixed")]
DEVICE_CHECKS += [("far-decode", "bfloat16", 16, 8, 64, 128, None, None, False)]
# far-decode: a decode batch on pages past this many bytes into each cache, so 32-bit
# element offsets (2**32 bytes of bf16 and up) would go wrong; on the CPU only the plumbing
FAR_BYTES = {"cpu": 1 << 20, "device": (1 << 32) + (1 << 28)}
# The timing grid's shapes: Llama-3-8B-like heads, bf16.
BENCH = dict(block_size=16, kv_heads=8, q_heads=64, head_dim=128, dtype="bfloat16")
# Multi-head latent attention (DeepSeek V2/V3; kernels_pallas/gpu_ragged_paged_mla.py):
# (kind, dtype, S block size, N query heads, C latent width, R rope width). The device runs
# V3's latent (C 512, R 64) with 16 heads (V3 at tensor parallelism 8; every kind, bf16 and
# one float32) and all 128 (decode, mixed); the CPU (interpret mode) a small latent on
# short contexts.
MLA_CHECKS = {  # (kind, dtype, S, N, C, R[, a one-byte cache: fp8 / int8])
    "cpu": [("decode", "bfloat16", 16, 4, 32, 16), ("mixed", "float32", 16, 2, 32, 16),
            ("mixed", "bfloat16", 16, 2, 32, 16, "fp8")],
    "device": [(kind, "bfloat16", 16, 16, 512, 64) for kind in ("decode", "prefill", "mixed")]
    + [(kind, "bfloat16", 16, 128, 512, 64) for kind in ("decode", "mixed")]
    + [("mixed", "float32", 16, 16, 512, 64), ("decode", "bfloat16", 16, 16, 512, 64, "fp8"),
       ("mixed", "bfloat16", 16, 16, 512, 64, "int8")],
}
# The MLA decode timing: rows x context on V3's latent, per head count; the MHA kernel on
# the MHA-equivalent shape (K = N heads of H 128) beside the 16-head rows.
MLA_TIMING = dict(block_size=16, latent=512, rope=64, heads=(16, 128), rows=(64, 256),
                  context=4096, mha_head_dim=128, dtype="bfloat16")


def random_sinks(rng, num_heads: int) -> np.ndarray:
    """f32[N] attention sinks from -2 to 6 (scores of the random cases are ~N(0, 1)), so
    that some heads' sinks outweigh most keys."""
    return rng.uniform(-2.0, 6.0, num_heads).astype(np.float32)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name; "bfloat16" too (ml_dtypes registers it with numpy)."""
    import ml_dtypes  # noqa: F401

    return np.dtype(dtype).itemsize


def check_specs(kind: str, rng, S: int, long: bool):
    """[(q_len, kv_len)] for a decode-only, prefill-only or mixed batch; contexts end
    mid-page and start at 1 and S + 1. long: contexts up to ~2k, else a few pages."""
    hi, n = (2048, 12) if long else (5 * S, 3)
    decode = [(1, 1), (1, S + 1)] + [(1, int(c)) for c in rng.integers(2, hi, n)]
    fresh = [(int(q),) * 2 for q in rng.integers(2, hi // 4, max(1, n // 3))]
    chunks = [(int(q), int(q + c)) for q, c in zip(rng.integers(2, hi // 4, max(1, n // 3)),
                                                   rng.integers(1, hi, n))]
    if kind == "decode":
        return decode
    if kind == "prefill":
        return fresh + chunks
    rows = decode + fresh + chunks
    return [rows[i] for i in rng.permutation(len(rows))]


def relative_error(got, want, real: int) -> float:
    """max |got - want| / max |want| over the first `real` tokens; inf if any value of got
    is not finite. got, want: float64 numpy arrays or torch tensors (on any device)."""
    if not abs(got).max() < math.inf:  # a NaN anywhere makes the max NaN
        return math.inf
    got, want = got[:real], want[:real]
    return float(abs(got - want).max() / abs(want).max())


def check_label(r: dict, prefix: str = "check", kernel_width: int = 20) -> str:
    """The start of a check's line, printed before it runs (a crash shows what ran)."""
    extra = ""
    if r["sliding_window"] is not None or r["soft_cap"] is not None:
        extra = f" window={r['sliding_window']} cap={r['soft_cap']}"
    if r.get("sinks"):
        extra += " sinks"
    shape = f"S={r['S']} K={r['K']} N={r['N']} H={r['H']} T={r.get('T')} R={r.get('R')}{extra}"
    return f"{prefix} {r['kernel']:{kernel_width}} {r['kind']:10} {r['dtype']:8} {shape:44}"


def check_verdict(r: dict) -> str:
    """The end of a check's line: the error against the tolerance, or the exception."""
    if "exception" in r:
        verdict = f"FAIL {r['exception']}"
    else:
        verdict = f"err {r['error']:.2e} (tol {r['tol']:.0e}) "
        if r.get("padding_nonzero"):
            verdict += f"{r['padding_nonzero']} nonzero padding values "
        verdict += "ok" if r["ok"] else "FAIL"
    if r.get("informational") and not r["ok"]:
        verdict += " (informational: jax's kernel, not ours)"
    return f"{verdict} [{r['seconds']:.1f}s]"


def attention_work(specs, N, K, H, itemsize):
    """(bytes, flops) one step must move and compute: each row's K/V read once, q and out
    once; 4 N H flops per (query token, visible key)."""
    kv_tokens = sum(kv for _, kv in specs)
    q_tokens = sum(q for q, _ in specs)
    nbytes = (2 * kv_tokens * K * H + 2 * q_tokens * N * H) * itemsize
    visible = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in specs)
    return nbytes, 4 * N * H * visible


def mla_work(specs, N, C, R, itemsize):
    """(bytes, flops) one MLA step must move and compute: each row's latent entries [C + R]
    read once (one entry per token, shared by the N heads), q_latent, q_rope and out once;
    2 (C + R) + 2 C flops per (query token, head, visible key): scores, then p . c."""
    kv_tokens = sum(kv for _, kv in specs)
    q_tokens = sum(q for q, _ in specs)
    nbytes = (kv_tokens * (C + R) + q_tokens * N * (2 * C + R)) * itemsize
    visible = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in specs)
    return nbytes, 2 * N * (2 * C + R) * visible


def bench_cases(quick: bool, max_kv_gib: float, dims=None):
    """{name: specs}: the decode grid (within max_kv_gib of K+V) and mixed batches; dims
    (S, K, H, dtype), default BENCH's."""
    S, K, H, dtype = dims or (BENCH["block_size"], BENCH["kv_heads"], BENCH["head_dim"],
                              BENCH["dtype"])
    per_token = 2 * K * H * itemsize(dtype)
    batches = (1, 32, 256) if quick else (1, 8, 32, 128, 256)
    contexts = (512, 32768) if quick else (512, 4096, 32768)
    cases = {f"decode {b} x ctx {c}": [(1, c)] * b for b in batches for c in contexts
             if b * -(-c // S) * S * per_token <= max_kv_gib * 2**30}
    ragged = [(1, int(c)) for c in np.geomspace(512, 32768, 252)]
    cases["mixed 4 x chunk 512 @ 4k + 252 decodes 512..32k"] = [(512, 4096)] * 4 + ragged
    if not quick:
        cases["mixed 1 x 2048 fresh + 127 decodes @ 4k"] = [(2048, 2048)] + [(1, 4096)] * 127
        cases["prefill 8 x 2048 fresh"] = [(2048, 2048)] * 8
    return cases
