"""Decode speed of a Llama-3-8B-shaped model with bf16, FP8 and W4A16 weights, side by side.

    python scripts/bench_quantized.py [--layers 2] [--vocab 32000] [--batches 1 8]
        [--rounds 8] [--steps 1] [--variants bf16 fp8 w4a16 awq] [--sequential] [--json OUT]

The model is Llama-3-8B's shape (hidden 4096, intermediate 14336, 32 heads, 8 kv heads,
head_dim 128) with --layers decoder layers: 2 by default, as all 32 take 16 GB in bf16 (two
thirds of a 24 GiB host, and one XLA:CPU step of them takes tens of seconds); --layers 32
runs the whole model where memory allows (the script refuses a model whose bf16 weights
would take more than 3/4 of the host's memory). The vocabulary is --vocab: 32000 by
default (Llama-2's), as Llama-3's 128256 makes the bf16 embeddings and lm_head 2.1 GB,
more than two layers, in every engine, which on 2 cores takes the run from about 4.5 minutes
to about 7 (and adds noise: each step converts the 1 GB lm_head to float32) without
changing the per-layer numbers, which leave the head out (below); --vocab 128256 runs it.
Each variant is a folder holding config.json (plus the built-in model's tokenizer) and an
engine with load_format="dummy", dtype bfloat16: random weights made on the device in the
variant's stored layout, nothing read or downloaded. Variants (--variants; bf16 always
runs, as the reference):

  bf16   the unquantized model;
  fp8    quantization_config fp8: e4m3 weights in 128x128 blocks with a float32 scale each,
         activations quantized per token and 128-column group (DeepSeek-V3, Qwen3-*-FP8);
  w4a16  compressed-tensors pack-quantized: symmetric int4 weights, two per byte, a float32
         scale per group of 128 input rows, bf16 activations;
  awq    (not by default) AutoAWQ's GEMM layout: int4 with a zero point per group of 128.

The embeddings and the lm_head stay bf16 in every variant (as the published checkpoints
keep them). The step computes with the stored codes and scales (models/jax/quantized.py).

Measured: the weight bytes on the device (the sum of the parameter arrays' nbytes: all of
them, and the decoder layers' alone), then, per batch size, the decode step time with that
many requests decoding together (prompts of 2 random tokens, so a batch of 8 prefills in
one step of the decode steps' own shape bucket, and the context stays short: the step is
the weights' work; greedy, ignore_eos, synchronous scheduling). Every engine is built
first and kept (when bf16's bytes times the engine count fit in half the host's memory;
otherwise, or with --sequential, one engine after another, each freed before the next),
then for each batch every engine starts its requests and the engines take turns, --rounds
rounds of --steps steps each (in a rotating order; each turn starts and ends with the
engine idle, so no engine's step runs beside another's): a change in this shared machine's
load lands on all of them within seconds. Step time: the median of an engine's steps;
tok/s = tokens per step / step time. Ratios against bf16, bytes (these / bf16's: < 1 is
fewer) and speed (bf16 step time / this one: > 1 is faster), the latter the median over
rounds of each round's ratio.

Per layer: the lm_head, the embedding lookup, sampling over the vocabulary and the host's
work are the same in every variant and, at 2 layers, a large part of a step, which pulls
every whole-step ratio towards 1. So a "rest" engine is timed with the others: a model with
the same vocabulary and hidden size whose one layer is shrunk to 1 head and an intermediate
size of 128 (2% of a real layer): its step is that common part. Per-layer time = (step -
rest step) / layers, per round; per-layer bytes = the decoder layers' bytes / layers. The
per-layer ratios are the linear layers' own: the ones a 32-layer model's whole step
approaches (there the lm_head is 7% of the bytes a step reads). The table ends with the whole
8B model's weight bytes (32 layers, Llama-3's vocabulary) from the measured bytes per layer.

What the ratios mean here and on an accelerator. XLA:CPU has no native bf16 matmul: each
step converts every bf16 kernel it multiplies to float32, so a CPU step is bound by that
conversion and the arithmetic on 2 cores, not by the bytes it reads. A quantized kernel's
codes go through a conversion of the same size plus their scaling (and FP8 blocks round the
activations per group too), so on the CPU the quantized variants run no faster than bf16,
usually somewhat slower: the speed ratio here measures what the format's arithmetic costs,
not what it buys. On a GPU or TPU, decode at small batches is bound by weight bandwidth:
each step reads every weight once, and dequantizing inside the matmul costs little next to
that read, so the step time follows the weight bytes per token, and the bytes ratios (per
layer 0.516 for FP8, 0.266 for W4A16: 1 or 0.5 bytes per weight plus a 4-byte scale per
128, against 2) are what predict the speed-up there (scripts/bench_on_device.py times the
same formats on a GPU). This machine is shared and noisy: compare numbers within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

from jaxserve.benchmarks.device_plan import (
    LLAMA3_8B,
    QUANT_FORMATS,
    TINY,
    quantization_config,
    write_model_folder,
)
from jaxserve.benchmarks.engine_measures import free_device_memory
from jaxserve.benchmarks.workloads import FIRST_REGULAR_ID

PROMPT_LEN = 2  # a batch of 8 prompts is one 16-token step: the decode steps' own bucket
REST = "rest"  # the engine whose step is everything but the decoder layers
VOCAB = 32000  # the default: Llama-2's (Llama-3's 128256 costs minutes more: module doc)


def model_config(args, layers: int | None = None) -> dict:
    """Llama-3-8B's shape (--tiny: the device benchmark's tiny Llama) with --layers layers
    and a --vocab vocabulary."""
    base = TINY if args.tiny else LLAMA3_8B
    return dict(base, num_hidden_layers=layers or args.layers, vocab_size=args.vocab,
                head_dim=base["hidden_size"] // base["num_attention_heads"])


def model_name(args) -> str:
    if args.tiny:
        return f"the tiny Llama (hidden 64) with {args.layers} layers"
    return f"Llama-3-8B shape with {args.layers} of its 32 layers"


def rest_config(args) -> dict:
    """One layer shrunk to nearly nothing: a step of it is the embeddings, lm_head, sampling
    and host work of the full-width model (8B shape: its layer has 3.7 M parameters against
    218 M)."""
    config = model_config(args, layers=1)
    return dict(config, num_attention_heads=1, num_key_value_heads=1,
                intermediate_size=config["head_dim"])


def weight_bytes(params) -> tuple[int, int]:
    """(all parameter bytes, the decoder layers' bytes)."""
    import jax

    total = layers = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        total += leaf.nbytes
        if any(getattr(key, "key", getattr(key, "name", None)) == "layers" for key in path):
            layers += leaf.nbytes
    return total, layers


def build(name: str, config: dict, folder: pathlib.Path, args):
    """(the engine's LLM, its report row: weight bytes, build time)."""
    from jaxserve import LLM

    write_model_folder(folder, config)
    start = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", seed=args.seed,
              max_model_len=256, max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(16, PROMPT_LEN * max(args.batches)),
              precompile=False, compilation_cache_dir=None)
    # Each step on its own: a step timed after the engine sat idle (while the others ran)
    # would otherwise return the result of one that finished meanwhile.
    llm.engine.async_scheduling = False
    build_s = time.perf_counter() - start
    scheme = llm.engine.config.model.weights_scheme
    total, layers = weight_bytes(llm.engine.runner.params)
    row = {"quantization_config": config.get("quantization_config"),
           "label": getattr(scheme, "label", "bf16"), "layers": config["num_hidden_layers"],
           "build_s": build_s, "weights": {"bytes": total, "layer_bytes": layers},
           "decode": []}
    say(f"{name}: {row['label']}, {total / 1e9:.3f} GB of weights ({layers / 1e9:.3f} GB in "
        f"{row['layers']} decoder layers), built in {build_s:.1f} s")
    return llm, row


class Decoding:
    """`batch` requests of one engine decoding (prompts of PROMPT_LEN random ids, greedy,
    ignore_eos): started until every one has its first token and one decode step more (its
    bucket compiled on first use), then timed a few steps at a time.

    engine.step() collects the step launched by the call before and launches the next one
    (JAX dispatches asynchronously), so a step keeps running after the call returns. Each
    timing window therefore starts with the engine idle and ends once its last step is done
    (block_until_ready on the KV cache the step writes): an engine waiting its turn runs
    nothing beside the one being timed. Samples: the time between successive steps' ends,
    from the end of the window's first call (which collects the last window's step and
    launches the first timed one)."""

    def __init__(self, llm, batch: int, max_tokens: int, rng, id_limit: int) -> None:
        from jaxserve import SamplingParams

        self.engine, self.batch, self.tokens = llm.engine, batch, 0
        self.times: list[float] = []  # every timed step
        self.rounds: list[float] = []  # each round's mean
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.ids = [f"decode{batch}-{i}" for i in range(batch)]
        self.generated = dict.fromkeys(self.ids, 0)
        for rid in self.ids:
            self.engine.add_request(rid, None, rng.integers(FIRST_REGULAR_ID, id_limit,
                                                            PROMPT_LEN).tolist(), params)
        start = time.perf_counter()
        while min(self.generated.values()) == 0:
            self._step()
        self._step()
        self._wait()
        self.start_s = time.perf_counter() - start

    def _step(self) -> int:
        new = 0
        for out in self.engine.step():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            count = len(out.outputs[0].token_ids)
            new += count - self.generated[out.request_id]
            self.generated[out.request_id] = count
        return new

    def _wait(self) -> None:
        import jax

        jax.block_until_ready(self.engine.runner.kv_caches)

    def time(self, steps: int) -> None:
        """`steps` more step times (the engine idle before and after); their mean is the
        round's (rounds_s)."""
        collected = self._step()  # the step before this window's first: the last window's
        if self.times:  # (or, the first time, the untimed step that started the requests)
            self.tokens += collected
        last = time.perf_counter()
        for i in range(steps):
            if i < steps - 1:
                self.tokens += self._step()
            else:
                self._wait()
            now = time.perf_counter()
            self.times.append(now - last)
            last = now
        self.rounds.append(float(np.mean(self.times[-steps:])))

    def stop(self) -> dict:
        self.tokens += self._step()  # the last window's last step's tokens
        for rid in self.ids:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        # Every timed step's tokens are collected by now (one call late): per step, over all.
        step_s = float(np.median(self.times))
        tokens_per_step = self.tokens / len(self.times)
        return {"batch": self.batch, "steps": len(self.times), "step_s": step_s,
                "step_s_mean": float(np.mean(self.times)), "step_s_all": self.times,
                "rounds_s": self.rounds,
                "tokens_per_step": tokens_per_step, "tok_s": tokens_per_step / step_s,
                "start_s": self.start_s}


def run_group(names: list[str], configs: dict, tmp: pathlib.Path, args, rows: dict,
              failed: dict) -> None:
    """Build the engines of `names` (all alive at once), time each batch on them, free
    them. A quantized engine that fails is reported and dropped; bf16's failure ends the
    run."""
    llms = {}
    try:
        for name in names:
            folder = tmp / name
            folder.mkdir()
            try:
                llms[name], rows[name] = build(name, configs[name], folder, args)
            except Exception as err:  # noqa: BLE001 - report it, run the other variants
                if name == "bf16":
                    raise
                failed[name] = f"{type(err).__name__}: {err}"
                say(f"FAILED {name}: {failed[name]}")
        for batch in args.batches:
            time_batch(llms, configs, batch, args, rows, failed)
    finally:
        for llm in llms.values():
            llm.engine.close()
        llms = None
        free_device_memory()


def time_batch(llms: dict, configs: dict, batch: int, args, rows: dict,
               failed: dict) -> None:
    """Start `batch` requests on every engine, then time --rounds rounds of --steps steps
    each, the engines taking turns in a rotating order, so that a change in the machine's
    load falls on all of them alike."""
    runs = {}

    def drop(name: str, err: Exception) -> None:
        if name == "bf16":
            raise err
        failed[name] = f"batch {batch}: {type(err).__name__}: {err}"
        say(f"FAILED {name} {failed[name]}")
        runs.pop(name, None)
        llms.pop(name).engine.close()

    max_tokens = 2 + args.rounds * args.steps + 8
    for name, llm in list(llms.items()):
        id_limit = min(len(llm.get_tokenizer()), configs[name]["vocab_size"])
        rng = np.random.default_rng(args.seed + batch)  # the same prompts for every engine
        try:
            runs[name] = Decoding(llm, batch, max_tokens, rng, id_limit)
        except Exception as err:  # noqa: BLE001 - report it, time the others
            drop(name, err)
    for r in range(args.rounds):
        order = list(runs)
        for name in order[r % len(order):] + order[:r % len(order)]:
            try:
                runs[name].time(args.steps)
            except Exception as err:  # noqa: BLE001
                drop(name, err)
    for name, run in runs.items():
        result = run.stop()
        rows[name]["decode"].append(result)
        say(f"{name} batch {batch}: step {1e3 * result['step_s']:.0f} ms (median of "
            f"{result['steps']}), {result['tok_s']:.2f} tok/s (started in "
            f"{result['start_s']:.0f} s, with the first-use compile)")


def add_ratios(rows: dict, layers: int) -> None:
    """Per-layer times (against the rest engine) and every variant's ratios to bf16, each
    the median over rounds of that round's ratio: the engines of a round ran within seconds
    of each other, so a change in the machine's load cancels out of the pair."""
    rest = {r["batch"]: np.asarray(r["rounds_s"]) for r in rows.get(REST, {}).get("decode", [])}
    bf16 = rows["bf16"]
    ref = {r["batch"]: r for r in bf16["decode"]}
    for name, row in rows.items():
        if name == REST:
            continue
        w = row["weights"]
        w["bytes_per_layer"] = w["layer_bytes"] / layers
        w["bytes_vs_bf16"] = w["bytes"] / bf16["weights"]["bytes"]
        w["layer_bytes_vs_bf16"] = w["layer_bytes"] / bf16["weights"]["layer_bytes"]
        for r in row["decode"]:  # bf16's own first: its per-layer rounds are there for the rest
            rounds = np.asarray(r["rounds_s"])
            if r["batch"] in rest and len(rest[r["batch"]]) == len(rounds):
                per_layer = (rounds - rest[r["batch"]]) / layers
                r["per_layer_rounds_s"] = per_layer.tolist()
                r["per_layer_s"] = float(np.median(per_layer))
            base = ref.get(r["batch"])
            if base is None or len(base["rounds_s"]) != len(rounds):
                continue
            r["speed_vs_bf16"] = float(np.median(np.asarray(base["rounds_s"]) / rounds))
            if "per_layer_rounds_s" in r and "per_layer_rounds_s" in base:
                ours, theirs = np.asarray(r["per_layer_rounds_s"]), \
                    np.asarray(base["per_layer_rounds_s"])
                kept = (ours > 0) & (theirs > 0)  # a round whose load swamped the layers: out
                if kept.any():
                    r["per_layer_speed_vs_bf16"] = float(np.median(theirs[kept] / ours[kept]))


def projection(rows: dict, hidden: int = 4096) -> dict:
    """Weight bytes of the whole model (32 layers, Llama-3's vocabulary) from the measured
    bytes per layer: bf16 embeddings and lm_head (2 x 128256 x 4096 x 2 B) and final norm,
    plus 32 layers; per variant (bytes, ratio to bf16's)."""
    common = 2 * (2 * LLAMA3_8B["vocab_size"] * hidden + hidden)
    full = {name: common + 32 * row["weights"]["bytes_per_layer"]
            for name, row in rows.items() if name != REST}
    return {name: {"bytes": b, "vs_bf16": b / full["bf16"]} for name, b in full.items()}


def print_table(rows: dict, args, platform: str, interleave: bool) -> None:
    print(f"\n== decode: {model_name(args)}, vocab {args.vocab}, bf16 activations, on "
          f"{platform}; "
          f"{'engines taking turns' if interleave else 'one engine after another'}, "
          f"{args.rounds} rounds x {args.steps} step(s) ==")
    header = (f"{'variant':8s} {'weights GB':>10s} {'bytes x':>7s} {'MB/layer':>8s} "
              f"{'layer bytes x':>13s} {'batch':>5s} {'step ms':>7s} {'tok/s':>6s} "
              f"{'speed x':>7s} {'ms/layer':>8s} {'layer speed x':>13s}")
    print(header)
    print("-" * len(header))
    fmt = lambda v, spec: f"{'-':>{spec.split('.')[0]}}" if v is None else format(v, spec)
    for name, row in rows.items():
        w = row["weights"]
        for r in row["decode"]:
            per_layer = r.get("per_layer_s")
            print(f"{name:8s} {w['bytes'] / 1e9:10.3f} {fmt(w.get('bytes_vs_bf16'), '7.3f')} "
                  f"{w.get('bytes_per_layer', w['layer_bytes']) / 1e6:8.1f} "
                  f"{fmt(w.get('layer_bytes_vs_bf16'), '13.3f')} {r['batch']:5d} "
                  f"{1e3 * r['step_s']:7.0f} {r['tok_s']:6.2f} "
                  f"{fmt(r.get('speed_vs_bf16'), '7.2f')} "
                  f"{fmt(None if per_layer is None else 1e3 * per_layer, '8.0f')} "
                  f"{fmt(r.get('per_layer_speed_vs_bf16'), '13.2f')}")
    print("bytes x: weight bytes / bf16's (< 1: fewer); speed x: bf16 step time / this one "
          "(> 1: faster), the median of the rounds' ratios; ms/layer: (step - rest step) / "
          "layers; rest: embeddings + lm_head + sampling + host work (one near-empty layer)")
    if not args.tiny and all("bytes_per_layer" in row["weights"]
                              for name, row in rows.items() if name != REST):
        full = projection(rows)
        print("the whole model (32 layers, vocab 128256), weight bytes from the bytes per "
              "layer: " + "; ".join(f"{name} {v['bytes'] / 1e9:.2f} GB ({v['vs_bf16']:.3f}x)"
                                    for name, v in full.items()))
    sys.stdout.flush()


START = time.perf_counter()


def say(line: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {line}", flush=True)


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def bf16_bytes(config: dict) -> int:
    """The bf16 model's weight bytes: embeddings, lm_head and the layers' kernels."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    attn = d * hd * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    return 2 * (2 * v * d + config["num_hidden_layers"] * (attn + 3 * d * f + 2 * d) + d)


def main() -> int:
    args = parse_args()
    import jax

    platform = f"{jax.devices()[0].device_kind} ({jax.default_backend()}, " \
               f"{os.cpu_count()} CPUs)"
    need = bf16_bytes(model_config(args))
    if need > 0.75 * host_memory_bytes():
        print(f"{args.layers} layers take {need / 2**30:.1f} GiB in bf16, more than 3/4 of "
              f"this host's {host_memory_bytes() / 2**30:.1f} GiB: use fewer --layers.",
              file=sys.stderr)
        return 2
    names = ["bf16", *[v for v in args.variants if v != "bf16"]] + [REST]
    configs = {}
    for name in names:
        configs[name] = rest_config(args) if name == REST else model_config(args)
        if name not in ("bf16", REST):
            configs[name]["quantization_config"] = quantization_config(name, configs[name])
    # Every engine alive at once (bounded by bf16's bytes each), or one after another.
    interleave = not args.sequential and len(names) * need <= 0.5 * host_memory_bytes()
    say(f"{platform}; {model_name(args)} (bf16 weights {need / 1e9:.2f} GB), vocab "
        f"{args.vocab}; engines {', '.join(names)}, "
        + ("all built, then timed taking turns" if interleave else "one after another")
        + f"; batches {args.batches}, {args.rounds} rounds of {args.steps} steps each")
    rows: dict = {}
    failed: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-quantized-") as tmp:
        for group in ([names] if interleave else [[n] for n in names]):
            run_group(group, configs, pathlib.Path(tmp), args, rows, failed)
    add_ratios(rows, args.layers)
    print_table(rows, args, platform, interleave)
    for name, why in failed.items():
        print(f"{name}: FAILED: {why}")
    if args.json:
        report = {"platform": platform, "layers": args.layers, "vocab": args.vocab,
                  "batches": args.batches, "rounds": args.rounds, "steps": args.steps,
                  "interleaved": interleave, "prompt_len": PROMPT_LEN,
                  "model_config": model_config(args), "variants": rows,
                  "whole_model_bytes": None if args.tiny else projection(rows),
                  "errors": failed, "total_s": time.perf_counter() - START}
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        say(f"wrote {args.json}")
    say("done")
    return 1 if failed else 0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2,
                   help="decoder layers (Llama-3-8B has 32; default 2 for a 2-core CPU)")
    p.add_argument("--vocab", type=int,
                   help=f"vocabulary size (the bf16 embeddings and lm_head; default {VOCAB}, "
                        f"Llama-2's; Llama-3's is {LLAMA3_8B['vocab_size']})")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny Llama of scripts/bench_on_device.py (hidden 64, vocab 8192, "
                        "groups of 32): the same code path in seconds, for tests")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8],
                   help="decode batch sizes")
    p.add_argument("--rounds", type=int, default=8,
                   help="rounds of timed steps per batch, the engines taking turns")
    p.add_argument("--steps", type=int, default=1, help="timed decode steps per round")
    p.add_argument("--sequential", action="store_true",
                   help="one engine at a time (the default when they do not all fit)")
    p.add_argument("--variants", nargs="+", default=["bf16", "fp8", "w4a16"],
                   choices=["bf16", *QUANT_FORMATS], help="weight formats (bf16 always runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every number here")
    args = p.parse_args()
    args.vocab = args.vocab or (TINY["vocab_size"] if args.tiny else VOCAB)
    if min(args.layers, args.rounds, args.steps, *args.batches) < 1:
        p.error("--layers, --rounds, --steps and --batches must be positive")
    return args


if __name__ == "__main__":
    sys.exit(main())
