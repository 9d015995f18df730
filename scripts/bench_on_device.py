"""End-to-end benchmark of jaxserve on one GPU: a Llama-3-8B-shaped model with random weights.

On a GPU machine (one NVIDIA H200 in mind), from the repository root:

    pip install -e ".[cuda,torch]"    # jax with CUDA; torch (CUDA build): HF, torch backend
    python scripts/bench_on_device.py [--quick] [--json out.json]

One command, at most 10 minutes (--quick: 4; --max-seconds changes the budget). The
model is Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 kv heads, intermediate
14336, vocab 128256, rope_theta 500000) with random bfloat16 weights made on the device
(load_format="dummy"): nothing is downloaded and no checkpoint is read. The model folder is a
temporary directory holding config.json and the built-in model's tokenizer; prompts are token
ids, so the tokenizer only detokenizes. Engine: max_model_len 2048, max_num_seqs 256,
max_num_batched_tokens 2048, every shape bucket compiled before anything is timed. With no
accelerator (jax.default_backend() == "cpu"), or with --tiny, a tiny Llama (hidden 64, 2
layers, vocab 8192: twice the tokenizer's, as the 8B model's exceeds it) runs the same code
end to end with 12 requests, decode batches 1, 4 and 8 and HF (float32, on the CPU) on 4
requests: a minute or two on 2 cores, most of it compiling (tests/benchmarks/test_bench_on_device.py
runs it). On a machine with a GPU that JAX does not see (its CPU-only build), the script
stops at once (exit 2) and says what to install, instead of benchmarking the tiny model.

What it measures, each printed and (with --json) written out:

1. throughput: the sharegpt-like workload of scripts/bench_offline.py (log-normal prompt
   lengths, median 96, and output lengths, median 64; random token ids; ignore_eos, so every
   output has its length), 256 requests (--quick 64), all added at once. The engine is
   driven step by step (engine.add_request / engine.step), so each token's arrival time is
   known: output tok/s and total (prompt + output) tok/s over the run's wall time; TTFT =
   first token's arrival - the time the requests were added (offline: queueing included);
   ITL = time between successive token arrivals of a request (when one step brings k new
   tokens, the gap counts as k gaps of gap/k). p50/p90/p99 of each; ITLs pooled over all
   requests.
2. decode step time at batch 1, 32 and 256: that many requests (128-token prompts) are
   started, and once all of them are decoding, the wall time of each engine.step() is taken
   (the median over 32 steps, --quick 16): the step as the engine runs it, host work
   overlapped with the device's. Compared with the weight-bandwidth floor = weight bytes
   (every parameter is read once per step) / the device's copy bandwidth, measured with a
   jitted `x + 1` over a 2 GiB array (bandwidth = 2 x bytes / best time: read + write).
   ratio = step time / floor (1.0 would be perfect). The floor with the KV cache read too
   (batch x context x KV bytes per token) is reported beside it. The largest batch runs
   again with asynchronous scheduling off (sync_step_s; async_speedup = sync step time /
   async step time: what overlapping the host's work with the device's gains).
3. HF transformers generate on the same device: LlamaForCausalLM(config) with random
   bfloat16 weights, static batches of 32 in workload order, left padding, greedy, each
   batch generating its longest request's length, on the first 64 requests (--quick 32).
   jaxserve runs the same 64 requests again, and the ratio of output tok/s (requested tokens
   / wall time) is reported. Skipped, with a line saying why, when torch cannot use the GPU.
4. the torch backend (LLM(..., backend="torch"): the Triton kernels and CUDA graphs on a GPU,
   the PyTorch reference attention on the CPU) on the same model folder, engine arguments,
   workload and decode batches (the same prompts: the same seeds), last, after the JAX and HF
   numbers are in (the --json report is written once before it starts, so a crash there
   cannot lose them). Its KV cache gets the JAX engine's block count, or on a GPU fewer when
   that would not fit beside JAX's memory pool (num_gpu_blocks_override; the report says
   which). Reported beside the JAX numbers, with torch / JAX speed ratios (vs_jax: > 1 means
   the torch backend is faster): output and total tok/s, and per decode batch JAX step time /
   torch step time. When torch or triton is not installed the section is skipped; when the
   torch backend cannot start (a CPU-only torch on a GPU machine, a build error) the error is
   reported (exit status 1) and the JAX numbers stand. The HF section leaves the torch
   section the time it needs.

5. quantized: the same model with int8 weights (quantization="int8", quantized while
   loading), as a checkpoint published in FP8 (e4m3 weights in 128x128 blocks with a scale
   each, activations quantized per token and 128-column group: DeepSeek-V3 / Qwen3-FP8's
   format) and in W4A16 (compressed-tensors pack-quantized: int4 weights with a scale per
   group of 128 input rows, 16-bit activations), and with an fp8 KV cache
   (kv_cache_dtype="fp8"). The FP8 and W4A16 engines read a folder of their own whose
   config.json adds the format's quantization_config (groups of 32 on the tiny model): the
   random weights are made in the format's stored layout (codes and scales), which the
   compiled step computes with, so a step reads ~1 (FP8) or ~0.5 (W4A16) bytes per weight
   against bf16's 2; the embeddings and lm_head stay bf16. Each engine in turn after the bf16 one is
   freed (same memory budget: more KV blocks for all), shapes compiled on first use: KV
   blocks, weight bytes (bytes_vs_bf16 = these / bf16's) and the decode step time at the two
   largest decode batches, with vs_bf16 = bf16 step time / quantized step time (> 1:
   faster) and bytes_per_token_vs_bf16 = weight bytes per generated token / bf16's (< 1:
   fewer bytes read, which a weight-bandwidth-bound decode step turns into time).

The JAX GPU allocator is capped at XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 unless set (the HF
baseline needs room on the same GPU). Compiling every shape bucket of the 8B model is most
of the start-up; a rerun on the same machine loads them from jaxserve's compilation cache.
Sections that would not fit the time budget are skipped with a note. Exits non-zero when a
section failed (the JSON says which and why).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

from jaxserve.benchmarks.device_plan import Clock, Plan, Report
from jaxserve.benchmarks.device_sections import run_engine_sections
from jaxserve.benchmarks.engine_measures import measure_copy_bandwidth, throughput_line
from jaxserve.benchmarks.torch_section import ratios_line


def main() -> int:
    args = parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # room for torch (HF)
    import jax

    backend = jax.default_backend()
    unused = _unused_accelerator() if backend == "cpu" and not args.tiny else None
    if unused is not None:
        what, command = unused
        print(f"This machine has {what}, but JAX runs on the CPU: install JAX's accelerator "
              f"build ({command}), or pass --tiny to run the tiny CPU configuration.",
              file=sys.stderr, flush=True)
        return 2
    plan = Plan(tiny=args.tiny or backend == "cpu", quick=args.quick, args=args)
    clock = Clock(plan.budget_s)
    device = jax.devices()[0]
    clock.say(f"device: {device.device_kind} (backend {backend}, {jax.device_count()} "
              f"device(s), jax {jax.__version__}); model {plan.model_name}; "
              f"{'quick, ' if plan.quick else ''}budget {plan.budget_s:.0f} s")
    report = Report(plan, clock, device=device.device_kind, backend=backend,
                    jax=jax.__version__, model=plan.model_name, model_config=plan.model_config,
                    quick=plan.quick, tiny=plan.tiny, budget_s=plan.budget_s)
    bandwidth = measure_copy_bandwidth(plan.copy_bytes)
    report.data["bandwidth"] = bandwidth
    clock.say(f"copy bandwidth: {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s (x + 1 over "
              f"{plan.copy_bytes / 2**30:.2f} GiB, best of {bandwidth['reps']}: "
              f"{1e3 * bandwidth['best_s']:.2f} ms)")
    def save() -> None:
        if args.json:
            report.data["total_s"] = clock.elapsed
            pathlib.Path(args.json).write_text(json.dumps(report.data, indent=1))

    try:
        with tempfile.TemporaryDirectory(prefix="bench-on-device-") as tmp:
            run_engine_sections(report, pathlib.Path(tmp), args.seed, save)
    except Exception as err:  # noqa: BLE001 - the engine could not be built: say why
        report.failed("engine", err)
    report.data["total_s"] = clock.elapsed
    print_summary(report.data)
    if args.json:
        save()
        clock.say(f"wrote {args.json}")
    return 1 if report.data["errors"] else 0


def _unused_accelerator() -> tuple[str, str] | None:
    """(what, install command) when the machine has an accelerator JAX does not use."""
    try:
        from jaxserve.backends.jax.accelerators import unused_accelerator
    except ImportError:
        return None
    return unused_accelerator()


def print_summary(report: dict) -> None:
    print(f"\n== summary: {report['model']} on {report['device']} ({report['backend']}), "
          f"{report['total_s']:.0f} s ==")
    print(f"engine start-up (random weights + compile): {report.get('warm_up_s', 0):.1f} s; "
          f"copy bandwidth {report['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s")
    t = report.get("throughput", {})
    if "output_tok_s" in t:
        print(throughput_line("throughput", t))
    for r in report.get("decode", {}).get("batches", []):
        print(f"decode batch {r['batch']:3d}: {1e3 * r['step_s']:.3f} ms/step, floor "
              f"{1e3 * r['floor_s']:.3f} ms ({r['ratio']:.2f}x), with KV "
              f"{1e3 * r['floor_with_kv_s']:.3f} ms ({r['ratio_with_kv']:.2f}x)")
    t = report.get("torch", {})
    if "output_tok_s" in t.get("throughput", {}):
        print(throughput_line("torch backend throughput", t["throughput"]))
    for r in t.get("decode", {}).get("batches", []):
        print(f"torch decode batch {r['batch']:3d}: {1e3 * r['step_s']:.3f} ms/step, floor "
              f"{1e3 * r['floor_s']:.3f} ms ({r['ratio']:.2f}x), with KV "
              f"{1e3 * r['floor_with_kv_s']:.3f} ms ({r['ratio_with_kv']:.2f}x)")
    if t.get("vs_jax"):
        print("torch / JAX speed: " + ratios_line(t["vs_jax"]))
    hf = report.get("hf", {})
    if "ratio" in hf:
        print(f"HF baseline: jaxserve {hf['jaxserve']['output_tok_s']:.1f} vs HF "
              f"{hf['transformers']['output_tok_s']:.1f} output tok/s on "
              f"{hf['requests']} requests: {hf['ratio']:.2f}x")
    for name, q in report.get("quantized", {}).items():
        for r in q.get("decode", {}).get("batches", []):
            vs = f"; bf16 / {name}: {r['vs_bf16']:.2f}x" if "vs_bf16" in r else ""
            print(f"{name} decode batch {r['batch']:3d}: {1e3 * r['step_s']:.3f} ms/step "
                  f"({q['kv_blocks']} KV blocks){vs}")
    for section, why in {**report["skipped"], **report["errors"]}.items():
        print(f"{section}: {why}")
    sys.stdout.flush()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer requests and steps: about 2 minutes on a GPU")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny model and sizes (the default with no accelerator)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--max-seconds", type=float,
                   help="time budget (default 600, --quick 240): later sections are skipped")
    p.add_argument("--requests", type=int, help="requests in the throughput workload")
    p.add_argument("--hf-requests", type=int, help="requests in the HF comparison")
    p.add_argument("--hf-batch-size", type=int, help="HF static batch size")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
