"""Offline throughput, like `vllm bench throughput`: jaxserve (and optionally HF) on one workload.

    python scripts/bench_offline.py --workload sharegpt-like --baseline hf [--json OUT]
    python scripts/bench_offline.py --workload shared-prefix --compare-prefix-caching
    python scripts/bench_offline.py --workload random --input-len 128 --output-len 128
    python scripts/bench_offline.py --workload file --dataset prompts.json

--model defaults to the "small" benchmark Llama (~125M parameters, random weights, made by
make_small_checkpoint.py on first use). Workloads (all seeded, outputs forced to their
length with ignore_eos):
  random         --num-prompts prompts of --input-len random token ids, --output-len each;
  sharegpt-like  128 requests, log-normal prompt lengths (median 96, clipped 8-512) and
                 output lengths (median 64, clipped 8-256), random token ids;
  shared-prefix  64 requests: one --prefix-len random prefix, distinct --suffix-len suffixes;
  file           a JSON list of {"prompt" | "prompt_token_ids", "output_len"?} objects.

Reports requests/s, input/output/total tok/s, warm-up (load + compile) time, recompilations
after warm-up, peak RSS, preemptions, prefix-cache hit rate, KV utilisation (live tokens /
allocated slots, at the step with the most blocks allocated), bucket padding, TTFT. With
--baseline hf, HF transformers generate runs the same workload in the same process: static
batches in order, left padding, greedy, each batch generating its longest request's length;
batch sizes --hf-batch-sizes are tried on the first --hf-sweep-requests requests and the
best runs the whole workload. With --compare-prefix-caching the workload runs with prefix
caching on and off and the outputs are compared token by token.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import time

import numpy as np

from jaxserve.benchmarks.checkpoints import ensure_small_checkpoint
from jaxserve.benchmarks.hf_baseline import run_hf_baseline
from jaxserve.benchmarks.workloads import Workload, make_workload

# ----------------------------------------------------------------------------- jaxserve

def _kv_utilisation(engine) -> tuple[int, float]:
    """(distinct blocks allocated, fraction of their slots holding live tokens) right now,
    counting the tokens of the step still on the device (the scheduler counts them when it
    schedules: their KV is there by the time anyone reads it).

    A request's blocks are per KV-cache group (request.block_ids: one list per group); a
    block shared by several requests (prefix caching) counts once, as full as its fullest
    holder has it."""
    pool, size = engine.kv_manager.pool, engine.kv_manager.block_size
    distinct = pool.num_blocks - 1 - pool.num_free
    if distinct == 0:
        return 0, 0.0
    filled: dict[int, int] = {}  # block -> slots holding a live token
    for request in engine.scheduler.running:
        computed = request.num_computed_tokens
        for group in request.block_ids:
            for index, block in enumerate(group):
                if block:  # (0: the null block, in place of a window's dropped blocks)
                    slots = min(size, max(0, computed - index * size))
                    filled[block] = max(filled.get(block, 0), slots)
    return distinct, sum(filled.values()) / (distinct * size)


def run_jaxserve(model: str, workload: Workload, engine_args: dict) -> dict:
    from jaxserve import LLM, SamplingParams

    rss_before = _peak_rss_gib()
    start = time.perf_counter()
    llm = LLM(model, **engine_args)
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    if longest > llm.engine.config.model.max_model_len:
        raise ValueError(f"the workload's longest request needs {longest} tokens: run with "
                         f"--max-model-len {longest} or more.")
    warm_up = time.perf_counter() - start
    engine = llm.engine
    compiles_after_warm_up = engine.num_compilations
    ids = [f"r{i}" for i in range(len(workload.prompts))]
    first_token: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    samples: list[tuple[int, float]] = []  # (blocks allocated, utilisation) after each step
    start = time.perf_counter()
    for rid, prompt, out_len in zip(ids, workload.prompts, workload.output_lens):
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(rid, None, prompt, params)
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        now = time.perf_counter()
        for out in step_outputs:
            if out.request_id not in first_token and out.outputs[0].token_ids:
                first_token[out.request_id] = now
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        samples.append(_kv_utilisation(engine))
    wall = time.perf_counter() - start
    ttft = np.array([first_token[r] - start for r in ids])
    produced = sum(len(t) for t in outputs.values())
    if produced != workload.output_tokens:
        raise RuntimeError(f"jaxserve produced {produced} tokens, {workload.output_tokens} asked")
    # Utilisation over the loaded part of the run (>= half the peak allocation), so that the
    # first steps (one prompt in whole blocks) do not count.
    peak_blocks = max(b for b, _ in samples)
    loaded = [u for b, u in samples if b >= peak_blocks / 2]
    stats = getattr(engine, "prefix_cache_stats", None)
    return {
        "wall_s": wall, "warm_up_s": warm_up,
        "requests_per_s": len(ids) / wall,
        "input_tok_s": workload.prompt_tokens / wall,
        "output_tok_s": workload.output_tokens / wall,
        "total_tok_s": (workload.prompt_tokens + workload.output_tokens) / wall,
        "compilations_at_warm_up": compiles_after_warm_up,
        "recompilations_after_warm_up": engine.num_compilations - compiles_after_warm_up,
        "peak_rss_gib": max(_peak_rss_gib(), rss_before),
        "preemptions": engine.num_preemptions,
        "prefix_cache_hit_rate": stats.hit_rate if stats is not None else None,
        "kv_blocks_peak": peak_blocks,
        "kv_utilisation_peak": max(loaded),
        "kv_utilisation_mean": float(np.mean(loaded)),
        "token_padding": engine.runner.padding.token_padding,
        "row_padding": engine.runner.padding.row_padding,
        "steps": engine.runner.padding.steps,
        "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.median(ttft)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "engine_args": engine_args,
        "outputs": [outputs[r] for r in ids],
    }


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ----------------------------------------------------------------------------- ceiling

def flop_ceiling(model: str, workload: Workload) -> dict:
    """Output tok/s if every matmul FLOP ran at the measured XLA matmul rate: 2 x parameters
    per token, the lm_head only at sampled (output) positions."""
    import jax
    import jax.numpy as jnp

    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    d, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    body = layers * (2 * d * d + 2 * d * kv + 3 * d * f)
    head = cfg["vocab_size"] * d
    flops = 2 * body * (workload.prompt_tokens + workload.output_tokens) + \
        2 * head * workload.output_tokens
    a, w = jnp.ones((512, d), jnp.float32), jnp.ones((d, f), jnp.float32) * 0.01
    mm = jax.jit(lambda a, w: a @ w)
    mm(a, w).block_until_ready()
    best = float("inf")
    for _ in range(5):  # best of 5: the machine is shared
        start = time.perf_counter()
        for _ in range(10):
            r = mm(a, w)
        r.block_until_ready()
        best = min(best, (time.perf_counter() - start) / 10)
    rate = 2 * 512 * d * f / best
    return {"matmul_gflop_s": rate / 1e9, "total_gflop": flops / 1e9,
            "ceiling_output_tok_s": workload.output_tokens / (flops / rate)}


# ----------------------------------------------------------------------------- report

def _engine_args(args, prefix_caching: bool) -> dict:
    # Every bucket compiled before the clock starts: the run itself never compiles.
    engine_args = {"dtype": args.dtype, "enable_prefix_caching": prefix_caching,
                   "precompile": True}
    for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
                 "max_model_len"):
        if getattr(args, name) is not None:
            engine_args[name] = getattr(args, name)
    return engine_args


def print_jaxserve(label: str, r: dict) -> None:
    hit = r["prefix_cache_hit_rate"]
    print(f"{label}: {r['wall_s']:.1f} s, {r['requests_per_s']:.2f} req/s, tok/s input "
          f"{r['input_tok_s']:.1f} output {r['output_tok_s']:.1f} total {r['total_tok_s']:.1f}")
    print(f"  warm-up (load + compile) {r['warm_up_s']:.1f} s; "
          f"recompilations after warm-up: {r['recompilations_after_warm_up']}")
    print(f"  peak RSS {r['peak_rss_gib']:.2f} GiB; preemptions {r['preemptions']}; "
          f"prefix-cache hit rate {'n/a' if hit is None else f'{100 * hit:.1f}%'}; "
          f"KV utilisation peak {100 * r['kv_utilisation_peak']:.1f}% mean "
          f"{100 * r['kv_utilisation_mean']:.1f}% (peak allocation {r['kv_blocks_peak']} "
          "blocks)")
    print(f"  {r['steps']} steps; padding {100 * r['token_padding']:.1f}% of token slots, "
          f"{100 * r['row_padding']:.1f}% of sequence rows; TTFT mean "
          f"{1e3 * r['ttft_mean_s']:.0f} ms, p50 {1e3 * r['ttft_p50_s']:.0f} ms, p99 "
          f"{1e3 * r['ttft_p99_s']:.0f} ms", flush=True)


def main() -> None:
    args = parse_args()
    model = args.model or str(ensure_small_checkpoint())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
    workload = make_workload(args, vocab, tokenizer)
    print(f"workload {workload.name}: {len(workload.prompts)} requests, "
          f"{workload.prompt_tokens} prompt tokens, {workload.output_tokens} output tokens; "
          f"model {model}", flush=True)
    report: dict = {"workload": workload.name, "model": model,
                    "requests": len(workload.prompts), "prompt_tokens": workload.prompt_tokens,
                    "output_tokens": workload.output_tokens}
    runs = [("jaxserve", not args.no_prefix_caching)]
    if args.compare_prefix_caching:
        runs = [("jaxserve prefix caching on", True), ("jaxserve prefix caching off", False)]
    for label, caching in runs:
        result = run_jaxserve(model, workload, _engine_args(args, caching))
        print_jaxserve(label, result)
        report[label] = result
    if args.compare_prefix_caching:
        on, off = report[runs[0][0]], report[runs[1][0]]
        same = on["outputs"] == off["outputs"]
        print(f"prefix caching on vs off: mean TTFT {off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x "
              f"better, throughput {on['output_tok_s'] / off['output_tok_s']:.2f}x; outputs "
              f"{'token-identical' if same else 'DIFFER'}")
        report["outputs_identical"] = same
    main_run = report[runs[0][0]]
    ceiling = flop_ceiling(model, workload)
    report["ceiling"] = ceiling
    print(f"FLOP ceiling: {ceiling['ceiling_output_tok_s']:.1f} output tok/s "
          f"({ceiling['total_gflop']:.0f} GFLOP with every prompt token computed, at the "
          f"measured {ceiling['matmul_gflop_s']:.0f} GFLOP/s); jaxserve reaches "
          f"{main_run['output_tok_s'] / ceiling['ceiling_output_tok_s']:.0%}")
    if args.baseline == "hf":
        hf = run_hf_baseline(model, workload, args.hf_batch_sizes, args.hf_sweep_requests)
        report["hf"] = hf
        print(f"HF transformers generate (best static batch {hf['best_batch_size']}): "
              f"{hf['wall_s']:.1f} s, output {hf['output_tok_s']:.1f} tok/s (generated "
              f"{hf['generated_tokens']} tokens for {hf['output_tokens']} requested)")
        print(f"jaxserve / HF output tok/s: {main_run['output_tok_s'] / hf['output_tok_s']:.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the small benchmark Llama)")
    p.add_argument("--workload", choices=("random", "sharegpt-like", "shared-prefix", "file"),
                   default="sharegpt-like")
    p.add_argument("--dataset", help="JSON file for --workload file")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--compare-prefix-caching", action="store_true")
    p.add_argument("--baseline", choices=("hf",))
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--hf-sweep-requests", type=int, default=64)
    p.add_argument("--json", help="write every number (and the outputs) here")
    args = p.parse_args()
    if args.workload == "file" and not args.dataset:
        p.error("--workload file needs --dataset")
    if args.output_len is None:
        args.output_len = 32 if args.workload == "shared-prefix" else 128
    return args


if __name__ == "__main__":
    main()
