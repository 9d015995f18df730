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

from jaxserve.benchmarks.engine_measures import decode_step_ms


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
