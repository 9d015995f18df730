"""Step time against the size of the KV cache: a step must cost what it reads, not what the
cache holds.

    python scripts/bench_kv_cache_size.py [--blocks 256 4096 16384] [--dtypes bfloat16 float32]
                                          [--seqs 1 16] [--steps 32] [--model DIR] [--json OUT]

For each dtype and cache size (num_kv_blocks), builds an engine (the built-in default model
unless --model; compiled buckets come from the persistent cache after the first size), runs
--seqs sequences of a 32-token prompt through a warm-up, then times --steps decode steps
(ignore_eos, greedy) and reports the median step time per configuration and the ratio of
each size to the smallest. All configurations run in this one process, side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def decode_step_ms(llm, num_seqs: int, steps: int) -> float:
    """Median wall time of one engine step while num_seqs sequences decode."""
    from jaxserve import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = llm.engine.config.model.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        ids = rng.integers(5, vocab, 32).tolist()
        engine.add_request(f"r{i}", None, ids, params)
    while engine.scheduler.waiting:  # the prompts' prefill steps
        engine.step()
    for _ in range(4):  # the first decode steps (and their buckets' first calls)
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: built-in model)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[256, 4096, 16384])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    from jaxserve import LLM

    rows = []
    for dtype in args.dtypes:
        for blocks in args.blocks:
            llm = LLM(args.model, dtype=dtype, num_kv_blocks=blocks, precompile=False,
                      max_num_seqs=max(args.seqs), max_num_batched_tokens=512,
                      attention_backend=args.attention_backend)
            for seqs in args.seqs:
                ms = decode_step_ms(llm, seqs, args.steps)
                rows.append({"dtype": dtype, "blocks": blocks, "seqs": seqs, "step_ms": ms})
                print(f"{dtype:9s} blocks={blocks:6d} seqs={seqs:3d}: {ms:8.2f} ms/step",
                      flush=True)
            del llm
    print("\nstep time relative to the smallest cache:")
    for row in rows:
        base = next(r for r in rows if r["dtype"] == row["dtype"] and r["seqs"] == row["seqs"]
                    and r["blocks"] == min(args.blocks))
        row["ratio"] = row["step_ms"] / base["step_ms"]
        print(f"  {row['dtype']:9s} seqs={row['seqs']:3d} blocks={row['blocks']:6d}: "
              f"{row['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
