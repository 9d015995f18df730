"""Multi-LoRA throughput: one batch on the base model, spread over LoRA adapters, and through
the LoRA engine with no adapter, side by side in one process.

    python scripts/bench_lora.py [--model DIR] [--num-prompts 64] [--output-len 64]
                                 [--num-adapters 4] [--rank 16] [--repeats 3]
                                 [--dtype float32] [--json OUT]

--model defaults to the "small" benchmark Llama (~125M parameters, random weights, made by
make_small_checkpoint.py on first use), so that the adapters' cost is measured on realistic
widths. The batch: --num-prompts random token-id prompts (seeded), log-normal lengths
(median --median-len, clipped to [--min-len, --max-len]), each generating exactly
--output-len tokens (greedy, ignore_eos), all in one LLM.generate call. Three
configurations:

  base      an engine without LoRA, the base model;
  lora      an engine with enable_lora=True, max_loras=--num-adapters,
            max_lora_rank=--rank, the prompts spread over --num-adapters adapters (prompt i
            gets adapter i mod N);
  lora-off  the same LoRA engine, every prompt without an adapter (the base model through
            the LoRA path: its fixed cost).

The adapters are PEFT folders made by the real peft library (tests/support/lora_helpers.py's
make_adapter: rank --rank, all seven projection modules, random nonzero A and B), built once
into --adapter-dir (default ~/.cache/jaxserve-bench/lora/, one folder per model). Both
engines are built first (precompile=True: every bucket compiled) and stay alive; every
configuration runs one untimed pass (the adapters loaded into their slots), then --repeats
rounds, the configurations taking turns in a rotating order, so that a change in this
shared machine's load falls on all of them. Prefix caching is off in both engines (the
rounds repeat the same prompts: a cached prefill would not measure anything). Reported:
output tok/s of each (the median over rounds), the ratios lora / base and lora-off / base
(the median over rounds of each round's own ratio), ms per engine step, the compilations
after the warm-up (process-wide; must be 0), and two checks: lora-off gives the base
model's tokens, and the adapters change them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

from jaxserve.benchmarks.checkpoints import ensure_small_checkpoint
from jaxserve.benchmarks.workloads import FIRST_REGULAR_ID

ROOT = pathlib.Path(__file__).resolve().parents[1]
ADAPTER_CACHE = pathlib.Path.home() / ".cache" / "jaxserve-bench" / "lora"
CONFIGS = ("base", "lora", "lora-off")
GOAL = 0.8  # lora / base, the goal on the 2-core CPU

START = time.perf_counter()


def say(line: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {line}", flush=True)


def make_prompts(args, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(np.round(rng.lognormal(math.log(args.median_len), 0.8, args.num_prompts)),
                      args.min_len, args.max_len).astype(int)
    return [rng.integers(FIRST_REGULAR_ID, vocab, int(n)).tolist() for n in lengths]


# ----------------------------------------------------------------------------- adapters

def _lora_helpers():
    """tests/support/lora_helpers.py (make_adapter: the tests' PEFT adapters), loaded by path."""
    spec = importlib.util.spec_from_file_location("lora_helpers",
                                                  ROOT / "tests" / "support" / "lora_helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def adapter_folder(model: str, args) -> pathlib.Path:
    """Where this model's adapters live: named by the model folder and a hash of its path
    and config.json, so another model (or a rebuilt one of another shape) gets its own."""
    folder = pathlib.Path(model).resolve()
    key = hashlib.sha256(str(folder).encode() + (folder / "config.json").read_bytes())
    root = pathlib.Path(args.adapter_dir).expanduser() if args.adapter_dir else ADAPTER_CACHE
    return root / f"{folder.name}-{key.hexdigest()[:8]}"


def ensure_adapters(model: str, args) -> list[pathlib.Path]:
    """--num-adapters PEFT adapters of rank --rank on every projection, made on first use
    (each in a temporary folder renamed into place: a killed run leaves no half adapter)."""
    root = adapter_folder(model, args)
    root.mkdir(parents=True, exist_ok=True)
    folders, helpers = [], None
    for i in range(args.num_adapters):
        out = root / f"r{args.rank}-seed{args.seed + i}"
        if not (out / "adapter_model.safetensors").is_file():
            if helpers is None:
                helpers = _lora_helpers()
                say(f"making adapters in {root} (peft, rank {args.rank}, "
                    f"{', '.join(helpers.ALL_MODULES)})")
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root))
            try:
                helpers.make_adapter(model, tmp, seed=args.seed + i, rank=args.rank,
                                     target_modules=helpers.ALL_MODULES)
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        folders.append(out)
    return folders


# ----------------------------------------------------------------------------- runs

def engine_args(args) -> dict:
    values = {"dtype": args.dtype, "precompile": True, "enable_prefix_caching": False,
              "seed": args.seed}
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                 "attention_backend"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return values


def run_pass(llm, prompts: list[list[int]], loras: list, args) -> dict:
    """One LLM.generate of the whole batch: (wall, output tokens, engine steps, tokens)."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    padding = llm.engine.runner.padding
    steps = padding.steps
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                           lora_request=loras, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    produced = sum(len(t) for t in tokens)
    if produced != args.output_len * len(prompts):
        raise RuntimeError(f"produced {produced} tokens, {args.output_len * len(prompts)} "
                           "asked")
    return {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall,
            "steps": padding.steps - steps, "step_ms": 1e3 * wall / max(padding.steps - steps, 1),
            "tokens": tokens}


def build_engines(model: str, args) -> dict:
    from jaxserve import LLM

    engines = {}
    for name, extra in (("base", {}),
                        ("lora", {"enable_lora": True, "max_loras": args.num_adapters,
                                  "max_lora_rank": args.rank,
                                  "max_cpu_loras": args.num_adapters})):
        start = time.perf_counter()
        engines[name] = LLM(model, **engine_args(args), **extra)
        say(f"{name} engine built (load + compile every bucket) in "
            f"{time.perf_counter() - start:.1f} s")
    return engines


def median_ratio(rows: dict, num: str, den: str) -> float:
    """The median over rounds of each round's tok/s ratio num / den (the two ran within
    seconds of each other: the machine's load cancels out of the pair)."""
    return float(np.median([a["output_tok_s"] / b["output_tok_s"]
                            for a, b in zip(rows[num], rows[den])]))


def time_rounds(engine_of: dict, prompts: list[list[int]], loras: dict, args) -> tuple:
    """An untimed warm-up pass of each configuration (adapters loaded into their slots,
    caches warm), then args.repeats timed rounds, the configurations taking turns: (the
    rows of each configuration, the compilations after the warm-up)."""
    from jaxserve.backends.compile_stats import compilation_count

    for name in CONFIGS:
        warm = run_pass(engine_of[name], prompts, loras[name], args)
        say(f"warm-up pass {name}: {warm['wall_s']:.1f} s")
    compiled = compilation_count()
    rows: dict = {name: [] for name in CONFIGS}
    for r in range(args.repeats):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for name in order:
            result = run_pass(engine_of[name], prompts, loras[name], args)
            rows[name].append(result)
            say(f"round {r + 1}/{args.repeats} {name:8s} {result['wall_s']:6.2f} s, "
                f"{result['output_tok_s']:7.1f} output tok/s, {result['steps']} steps, "
                f"{result['step_ms']:.1f} ms/step")
    return rows, compilation_count() - compiled


def make_report(model: str, args, prompts: list[list[int]], folders: list, rows: dict,
                recompilations: int) -> dict:
    """Every number of the run: each configuration's medians, the ratios, the checks."""
    lengths = [len(p) for p in prompts]
    summary = {}
    for name in CONFIGS:
        tok_s = [row["output_tok_s"] for row in rows[name]]
        summary[name] = {"output_tok_s": float(np.median(tok_s)), "output_tok_s_all": tok_s,
                         "wall_s_all": [row["wall_s"] for row in rows[name]],
                         "step_ms": float(np.median([row["step_ms"] for row in rows[name]])),
                         "steps": rows[name][0]["steps"]}
    base_tokens, lora_tokens = rows["base"][0]["tokens"], rows["lora"][0]["tokens"]
    return {
        "model": model, "dtype": args.dtype, "cpus": os.cpu_count(),
        "prompts": len(prompts), "prompt_tokens": sum(lengths),
        "output_len": args.output_len, "output_tokens": args.output_len * len(prompts),
        "num_adapters": args.num_adapters, "rank": args.rank, "repeats": args.repeats,
        "engine_args": engine_args(args), "adapters": [str(f) for f in folders],
        "configs": summary,
        "ratio_lora_vs_base": median_ratio(rows, "lora", "base"),
        "ratio_lora_off_vs_base": median_ratio(rows, "lora-off", "base"),
        "ratio_lora_vs_lora_off": median_ratio(rows, "lora", "lora-off"),
        "ratio_of_medians_lora_vs_base":
            summary["lora"]["output_tok_s"] / summary["base"]["output_tok_s"],
        "recompilations_after_warm_up": recompilations,
        "lora_off_tokens_identical_to_base": rows["lora-off"][0]["tokens"] == base_tokens,
        "prompts_changed_by_adapters": sum(a != b for a, b in zip(lora_tokens, base_tokens)),
        "goal": GOAL, "total_s": time.perf_counter() - START,
    }


def print_report(report: dict, args) -> None:
    print(f"\n== multi-LoRA: {pathlib.Path(report['model']).name}, {args.dtype}, "
          f"{report['prompts']} prompts ({report['prompt_tokens']} tokens) x "
          f"{args.output_len} output tokens, {args.num_adapters} adapters of rank "
          f"{args.rank} (all 7 projections), median of {args.repeats} rounds ==")
    labels = {"base": "base model, engine without LoRA",
              "lora": f"{args.num_adapters} adapters, LoRA engine",
              "lora-off": "no adapter, LoRA engine"}
    for name in CONFIGS:
        s = report["configs"][name]
        print(f"{labels[name]:32s} {s['output_tok_s']:8.1f} output tok/s  "
              f"{s['step_ms']:7.1f} ms/step ({s['steps']} steps)")
    verdict = "meets" if report["ratio_lora_vs_base"] >= GOAL else "BELOW"
    print(f"ratios (median of the rounds' own): lora / base {report['ratio_lora_vs_base']:.3f} "
          f"({verdict} the goal {GOAL}); lora-off / base "
          f"{report['ratio_lora_off_vs_base']:.3f}; lora / lora-off "
          f"{report['ratio_lora_vs_lora_off']:.3f}")
    same_off = report["lora_off_tokens_identical_to_base"]
    print(f"compilations after warm-up: {report['recompilations_after_warm_up']}; lora-off "
          f"tokens {'identical to' if same_off else 'DIFFER from'} the base model's; the "
          f"adapters changed {report['prompts_changed_by_adapters']} of {report['prompts']} "
          f"outputs; {report['total_s']:.0f} s in all")


def main() -> int:
    args = parse_args()
    from jaxserve import LoRARequest

    model = args.model or str(ensure_small_checkpoint())
    vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args, vocab)
    lengths = [len(p) for p in prompts]
    say(f"model {model}, {args.dtype}; {len(prompts)} prompts, {sum(lengths)} tokens (lengths "
        f"{min(lengths)}-{max(lengths)}, median {int(np.median(lengths))}), {args.output_len} "
        f"output tokens each, greedy; {args.num_adapters} adapters of rank {args.rank}; "
        f"{os.cpu_count()} CPUs")
    folders = ensure_adapters(model, args)
    adapters = [LoRARequest(f"adapter{i}", i + 1, str(path)) for i, path in enumerate(folders)]
    loras = {"base": None, "lora": [adapters[i % len(adapters)] for i in range(len(prompts))],
             "lora-off": None}
    engines = build_engines(model, args)
    engine_of = {"base": engines["base"], "lora": engines["lora"],
                 "lora-off": engines["lora"]}
    try:
        rows, recompilations = time_rounds(engine_of, prompts, loras, args)
    finally:
        for llm in engines.values():
            llm.close()
    report = make_report(model, args, prompts, folders, rows, recompilations)
    print_report(report, args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        say(f"wrote {args.json}")
    return 0 if recompilations == 0 else 1


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the small benchmark Llama)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--median-len", type=int, default=96)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-adapters", type=int, default=4,
                   help="adapters, and the LoRA engine's max_loras (one slot each)")
    p.add_argument("--rank", type=int, default=16,
                   help="the adapters' rank, and the LoRA engine's max_lora_rank")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds, the configurations taking turns; medians reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--attention-backend")
    p.add_argument("--adapter-dir", help="where the adapters are made and kept (default "
                   f"{ADAPTER_CACHE}/<model>-<hash>)")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args()
    if not 1 <= args.min_len <= args.max_len:
        p.error("--min-len must be >= 1 and at most --max-len")
    if min(args.num_prompts, args.output_len, args.num_adapters, args.rank, args.repeats) < 1:
        p.error("--num-prompts, --output-len, --num-adapters, --rank and --repeats must be "
                "positive")
    return args


if __name__ == "__main__":
    sys.exit(main())
