"""`jaxserve compile` on published models' config.json for the TPU slices they are served
on, at full size: every bucket compiled by libtpu's XLA:TPU and Mosaic on this CPU, the
HBM per device beside `jaxserve plan`'s (docs/performance.md, "Compiled for TPU slices").

    python scripts/compile_published.py                  # every case
    python scripts/compile_published.py --only llama-3.1-8b-v5e-8 --json-dir out/

Each case runs as its own `jaxserve compile` process (libtpu holds its compiler state per
process); its report is printed, and written as JSON with --json-dir.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from jaxserve.benchmarks import published_configs as published
from jaxserve.cli.compile import format_summary

# name -> (config.json, jaxserve compile's arguments)
CASES = {
    "llama-3.1-8b-v5e-8": (published.LLAMA_3_1_8B, ["--device", "v5e-8", "--mesh", "2x4"]),
    "llama-3.1-8b-v6e-8": (published.LLAMA_3_1_8B, ["--device", "v6e-8", "--mesh", "2x4"]),
    "qwen3-8b-v6e-4": (published.QWEN3_8B, ["--device", "v6e-4", "--mesh", "1x4"]),
    "mixtral-8x7b-v5p-16": (published.MIXTRAL_8X7B, ["--device", "v5p-16", "--mesh", "1x8",
                                                     "--expert-parallel"]),
    "deepseek-v3-v5p-64": (published.DEEPSEEK_V3, ["--device", "v5p-64", "--mesh", "1x32",
                                                   "--expert-parallel",
                                                   "--kv-cache-dtype", "fp8"]),
}
# Decode buckets only, for the roofline beside a published measurement (docs/performance.md):
# sglang-jax's Qwen3-8B on a v6e-4 at concurrency 8; JetStream's Llama-3-8B on a v5e-8 at
# batch 128 (two replicas of 64 here); vLLM's Llama-3.1-8B on one H200 at 16 (its costs
# compiled for one v6e device, predicted on an H200's peaks); decode at 1,536 tokens of
# context (1,024-token prompts, halfway through 1,024 output tokens).
DECODE = ["--max-num-batched-tokens", "16", "--context", "1536"]
ANCHORS = {
    "llama-3.1-8b-v5e-8-decode": (published.LLAMA_3_1_8B, [
        "--device", "v5e-8", "--mesh", "2x4", "--max-num-seqs", "64",
        "--max-num-batched-tokens", "64", "--context", "1536"]),
    "qwen3-8b-v6e-4-decode": (published.QWEN3_8B, ["--device", "v6e-4", "--mesh", "1x4",
                                                   "--max-num-seqs", "8", *DECODE]),
    "llama-3.1-8b-h200-decode": (published.LLAMA_3_1_8B, [
        "--device", "v6e-1", "--roofline-device", "h200x8", "--max-num-seqs", "16",
        *DECODE]),
}
CASES.update(ANCHORS)


def run_case(name: str, json_dir: pathlib.Path | None, extra: list[str]) -> int:
    config, args = CASES[name]
    with tempfile.TemporaryDirectory() as folder:
        (pathlib.Path(folder) / "config.json").write_text(json.dumps(config))
        command = [sys.executable, "-m", "jaxserve.cli", "compile", folder, *args, *extra,
                   "--json"]
        print(f"== {name}: jaxserve compile <config.json> {' '.join(args + extra)}", flush=True)
        start = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if run.returncode not in (0, 1):  # no report: the error
        print(run.stderr[-3000:], flush=True)
    else:
        print(format_summary(json.loads(run.stdout)), flush=True)
        if json_dir is not None:
            json_dir.mkdir(parents=True, exist_ok=True)
            (json_dir / f"{name}.json").write_text(run.stdout)
    print(f"== {name}: exit {run.returncode} after {seconds:.0f} s", flush=True)
    return run.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append",
                        help="run this case (repeatable); default: every case")
    parser.add_argument("--json-dir", type=pathlib.Path, help="write each report as JSON here")
    parser.add_argument("rest", nargs=argparse.REMAINDER,
                        help="more `jaxserve compile` arguments, after --")
    args = parser.parse_args()
    extra = [a for a in args.rest if a != "--"]
    codes = [run_case(name, args.json_dir, extra) for name in args.only or CASES]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
