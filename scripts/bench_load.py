"""Weight loading: the Hugging Face folder against its Orbax conversion (`jaxserve convert`).

    python scripts/bench_load.py [--model DIR] [--dtype bfloat16] [--repeats 3] [--json OUT]

Converts the model once (default: the "small" 125M benchmark Llama, make_small_checkpoint.py)
into a temporary folder, then loads each form in fresh subprocesses, alternating HF and Orbax
so that both see the same machine load: `LLM(folder, dtype, precompile=False)` (weights
placed on the device, the KV cache allocated, nothing compiled). For each load it reports the
seconds the weights took (the runner's load_params or restore_params call, until the arrays
are ready), the engine's whole construction, the process from start, and the process's peak
resident memory (ru_maxrss). Medians of --repeats runs, and the Orbax/HF ratios measured side
by side in this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from jaxserve.benchmarks.checkpoints import ensure_small_checkpoint

CHILD = r"""
import json, resource, sys, time
started = time.perf_counter()
import jax
from jaxserve import LLM
from jaxserve.backends.jax import runner as runner_module
from jaxserve.backends.jax.orbax_checkpoint import restore_params
from jaxserve.backends.jax.weights import load_params

timed = {}
def timing(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        jax.block_until_ready(jax.tree_util.tree_leaves(out))
        timed["weights_s"] = time.perf_counter() - t
        return out
    return wrapper
runner_module.load_params = timing("hf", load_params)
runner_module.restore_params = timing("orbax", restore_params)
imported = time.perf_counter()
llm = LLM(sys.argv[1], dtype=sys.argv[2], precompile=False, max_model_len=512)
done = time.perf_counter()
print(json.dumps({"weights_s": timed["weights_s"], "engine_s": done - imported,
                  "process_s": done - started,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def load(folder: pathlib.Path, dtype: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "cpu")
    done = subprocess.run([sys.executable, "-c", CHILD, str(folder), dtype], env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"loading {folder} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, default=None,
                        help="a Hugging Face folder (default: the small benchmark Llama)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args()

    from jaxserve.backends.jax.orbax_checkpoint import convert

    model = args.model or ensure_small_checkpoint()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        started = time.perf_counter()
        orbax = convert(model, pathlib.Path(tmp) / "orbax", args.dtype)
        convert_s = time.perf_counter() - started
        size = {"hf": sum(p.stat().st_size for p in model.glob("*.safetensors")),
                "orbax": sum(p.stat().st_size for p in (orbax / "orbax").rglob("*")
                             if p.is_file())}
        runs = {"hf": [], "orbax": []}
        for _ in range(args.repeats):
            for name, folder in (("hf", model), ("orbax", orbax)):
                runs[name].append(load(folder, args.dtype))
    report = {"model": str(model), "dtype": args.dtype, "repeats": args.repeats,
              "convert_s": convert_s, "bytes_on_disk": size, "runs": runs}
    for name in runs:
        report[name] = {key: statistics.median(r[key] for r in runs[name])
                        for key in runs[name][0]}
    report["orbax_over_hf"] = {key: report["orbax"][key] / report["hf"][key]
                               for key in report["hf"]}
    print(f"model {model} as {args.dtype}; converted in {convert_s:.1f} s; on disk: HF "
          f"{size['hf'] / 2**20:.0f} MiB, Orbax {size['orbax'] / 2**20:.0f} MiB")
    print(f"{'':8} {'weights s':>10} {'engine s':>9} {'process s':>10} {'peak RSS MiB':>13}")
    for name in ("hf", "orbax"):
        r = report[name]
        print(f"{name:8} {r['weights_s']:10.2f} {r['engine_s']:9.2f} {r['process_s']:10.2f} "
              f"{r['peak_rss_mib']:13.0f}")
    ratio = report["orbax_over_hf"]
    print(f"{'orbax/hf':8} {ratio['weights_s']:10.2f} {ratio['engine_s']:9.2f} "
          f"{ratio['process_s']:10.2f} {ratio['peak_rss_mib']:13.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
