"""Time the attention implementations side by side on step shapes of the "small" model.

    python scripts/bench_attention.py [--impl ref cpu] [--case decode] [--repeat 5]

One layer of the 125M benchmark Llama (12 query heads, 4 kv heads, head dim 64, block 16),
jitted, on batches like the ones sharegpt-like generation produces: decode steps of 128
sequences, prefill steps, and mixed steps. Prints milliseconds per call for every
implementation on every case, measured in the same run (the machine is noisy: compare
columns, not runs).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.benchmarks.ragged_batch import jax_batch, make_batch
from jaxserve.kernels_pallas import cpu_attention, ref

IMPLS = {"ref": ref.ragged_paged_attention,
         "cpu": cpu_attention.ragged_paged_attention}
S, K, H, N, MAX_LEN = 16, 4, 64, 12, 2048

# name: (q_len, kv_len) per sequence, T bucket, R bucket
CASES = {
    "decode 4 x ctx 600 (a late, small batch)": ([(1, 600)] * 4, 16, 4),
    "decode 128 x ctx 160": ([(1, 160)] * 128, 128, 128),
    "decode 128 x ctx 20..655": ([(1, n) for n in range(20, 660, 5)], 128, 128),
    "prefill 4 x 128 fresh": ([(128, 128)] * 4, 512, 256),
    "prefill 16 x 30 fresh": ([(30, 30)] * 16, 512, 256),
    "mixed 128 decode ctx 300 + 4 x 96 fresh": ([(1, 300)] * 128 + [(96, 96)] * 4, 512, 256),
    "chunk 256 after ctx 256 + 64 decode": ([(256, 512)] + [(1, 200)] * 64, 512, 256),
    "suffix 32 after cached 1024, x 8": ([(32, 1056)] * 8, 256, 256),
}


def time_call(fn, args, repeat: int) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--case", nargs="*", help="substring filter on case names")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    jitted = {name: jax.jit(lambda q, kc, vc, b, f=IMPLS[name]: f(q, kc, vc, b, scale=0.125))
              for name in args.impl}
    print(f"{'case':44}" + "".join(f"{name + ' ms':>12}" for name in args.impl))
    for case, (specs, num_tokens, num_rows) in CASES.items():
        if args.case and not any(c in case for c in args.case):
            continue
        layout = make_batch(specs, block_size=S, num_tokens=num_tokens, num_rows=num_rows,
                            width=MAX_LEN // S, rng=rng)
        batch, pages = jax_batch(layout), layout.num_pages
        k_cache = jnp.asarray(rng.standard_normal((pages, S, K, H), np.float32))
        v_cache = jnp.asarray(rng.standard_normal((pages, S, K, H), np.float32))
        q = jnp.asarray(rng.standard_normal((num_tokens, N, H), np.float32))
        times = [time_call(jitted[name], (q, k_cache, v_cache, batch), args.repeat)
                 for name in args.impl]
        print(f"{case:44}" + "".join(f"{t * 1e3:12.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
