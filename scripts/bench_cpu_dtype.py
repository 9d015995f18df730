"""bfloat16 against float32 compute on this platform: what dtype="auto" should pick.

    python scripts/bench_cpu_dtype.py [--models builtin small] [--steps 32] [--json OUT]

For each model (the built-in default model; "small", the ~125M benchmark Llama made by
make_small_checkpoint.py) and each dtype, builds an engine, then measures side by side in
this one process: the median decode step with 1 and 16 sequences
(jaxserve/benchmarks/engine_measures.decode_step_ms, after warm-up steps) and the best of three
prefills of 8 prompts of 128 tokens (one token out each; the first compiles its bucket). Prints each time and the bf16 / f32 ratio (below 1: bf16 is
faster).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from jaxserve.benchmarks.checkpoints import ensure_small_checkpoint
from jaxserve.benchmarks.engine_measures import decode_step_ms

DTYPES = ("float32", "bfloat16")


def prefill_s(llm, prompts: int = 8, length: int = 128, repeats: int = 3) -> float:
    """Best wall time of generating 1 token for `prompts` prompts of `length` tokens."""
    from jaxserve import SamplingParams

    rng = np.random.default_rng(1)
    vocab = llm.engine.config.model.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        batch = [rng.integers(5, vocab, length).tolist() for _ in range(prompts)]
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["builtin", "small"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxserve import LLM

    folders = {"builtin": None, "small": None}
    if "small" in args.models:
        folders["small"] = str(ensure_small_checkpoint())
    rows = []
    for name in args.models:
        for dtype in DTYPES:
            llm = LLM(folders[name], dtype=dtype, max_model_len=512, max_num_seqs=16,
                      max_num_batched_tokens=512, enable_prefix_caching=False)
            row = {"model": name, "dtype": dtype,
                   "decode_1_ms": decode_step_ms(llm, 1, args.steps),
                   "decode_16_ms": decode_step_ms(llm, 16, args.steps),
                   "prefill_8x128_s": prefill_s(llm)}
            rows.append(row)
            print(f"{name:8s} {dtype:9s} decode x1 {row['decode_1_ms']:7.2f} ms  decode x16 "
                  f"{row['decode_16_ms']:7.2f} ms  prefill 8x128 {row['prefill_8x128_s']:.3f} s",
                  flush=True)
            del llm
    print("\nbfloat16 / float32 (below 1: bf16 faster):")
    for name in args.models:
        f32, bf16 = (next(r for r in rows if r["model"] == name and r["dtype"] == d)
                     for d in DTYPES)
        ratios = {k: bf16[k] / f32[k] for k in ("decode_1_ms", "decode_16_ms",
                                                "prefill_8x128_s")}
        print(f"  {name:8s} " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        rows.append({"model": name, "ratios": ratios})
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
