"""Structured outputs' cost: a batch with half its requests JSON-constrained against the same
batch unconstrained, side by side in one process (one engine, every bucket compiled first).

    python scripts/bench_structured.py [--model DIR] [--num-requests 32] [--output-len 96]
                                        [--json OUT]

--model defaults to the "small" benchmark Llama (~125M parameters, random weights). Every
request is seeded and samples at temperature 1.0 with ignore_eos: an unconstrained request
writes --output-len tokens; a constrained one writes a JSON array of at least 200
three-digit integers, so it also writes --output-len tokens (finish_reason length). The
score is output tokens per second of the whole batch, constrained / unconstrained (the goal
is >= 0.85), the median of --repeats alternated runs of each; the host time per step spent on masks (llguidance filling the bitmasks, feeding
it sampled tokens) is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from jaxserve.benchmarks.checkpoints import ensure_small_checkpoint

# At least 200 three-digit numbers: longer than any --output-len used here, so that every
# request, constrained or not, writes exactly --output-len tokens and the two batches compare
# step for step.
SCHEMA = {"type": "array", "minItems": 200, "maxItems": 400,
          "items": {"type": "integer", "minimum": 100, "maximum": 999}}


def _timed(obj, name: str, totals: dict) -> None:
    """Wrap obj.name to add its wall time to totals[name] and count calls."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
            totals[name + "_calls"] = totals.get(name + "_calls", 0) + 1

    setattr(obj, name, wrapper)


def run(llm, constrained: bool, args) -> dict:
    from jaxserve import SamplingParams
    from jaxserve.core.sampling_params import StructuredOutputsParams

    prompts, params = [], []
    for i in range(args.num_requests):
        prompts.append(f"# request {i}: numbers\n")
        grammar = (StructuredOutputsParams(json=SCHEMA) if constrained and i % 2 == 0
                   else None)
        params.append(SamplingParams(temperature=1.0, seed=i, ignore_eos=True,
                                     max_tokens=args.output_len, structured_outputs=grammar))
    engine = llm.engine
    totals: dict = {}
    timed = [(engine.grammars, "fill_masks"), (engine.failures, "advance_grammar"),
             (engine.runner, "dispatch")]
    for obj, name in timed:
        _timed(obj, name, totals)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for obj, name in timed:  # unwrap
        delattr(obj, name)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = totals.get("dispatch_calls", 0)
    mask_s = totals.get("fill_masks", 0.0) + totals.get("advance_grammar", 0.0)
    return {"constrained": constrained, "output_tokens": tokens, "seconds": elapsed,
            "output_tok_s": tokens / elapsed, "steps": steps,
            "mask_ms_per_step": 1e3 * mask_s / max(steps, 1),
            "step_ms": 1e3 * elapsed / max(steps, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each batch, alternated; the median is reported")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="default: --num-requests (the whole batch in one step)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    from jaxserve import LLM

    model = args.model or str(ensure_small_checkpoint())
    llm = LLM(model, dtype="float32", max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs or args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens, precompile=True)
    compiled = llm.engine.num_compilations
    run(llm, True, args)  # a first pass: the grammar compiles, caches warm
    runs = {False: [], True: []}
    for _ in range(args.repeats):  # alternated, so that drift on a shared machine is shared
        for constrained in (False, True):
            runs[constrained].append(run(llm, constrained, args))
    # The median run of each (by throughput).
    free, half = (sorted(runs[c], key=lambda r: r["output_tok_s"])[len(runs[c]) // 2]
                  for c in (False, True))
    result = {"model": model, "num_requests": args.num_requests,
              "output_len": args.output_len, "unconstrained": free,
              "half_constrained": half,
              "throughput_ratio": half["output_tok_s"] / free["output_tok_s"],
              "recompilations_after_warm_up": llm.engine.num_compilations - compiled}
    for row in (free, half):
        print(f"{'half JSON-constrained' if row['constrained'] else 'unconstrained':<22} "
              f"{row['output_tokens']:>6} tokens in {row['seconds']:.2f} s = "
              f"{row['output_tok_s']:.1f} tok/s; {row['steps']} steps, "
              f"{row['step_ms']:.1f} ms/step, masks {row['mask_ms_per_step']:.3f} ms/step")
    print(f"throughput ratio (half constrained / unconstrained): "
          f"{result['throughput_ratio']:.3f}; recompilations after warm-up: "
          f"{result['recompilations_after_warm_up']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
