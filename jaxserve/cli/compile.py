"""`jaxserve compile`: the engine's device functions compiled for a TPU slice that is not
here (libtpu's compile-only topologies), from the model's config.json alone, with the HBM
each takes beside `jaxserve plan`'s figures."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from jaxserve.cli.common import add_engine_args, add_model_positional, engine_config, model_folder
from jaxserve.cli.plan import arg_type
from jaxserve.cli.serve import add_config_flag

logger = logging.getLogger("jaxserve.compile")

# The compiled arguments (weights, KV cache, sampler state) may differ from the plan's by
# this much before the report calls it a disagreement: layouts pad a little (TPU tiles).
AGREEMENT = 0.10


def add_compile_parser(sub) -> None:
    from jaxserve.config.accelerators import PRESETS, preset  # host-side: no jax

    p = sub.add_parser(
        "compile", help="compile every bucket for a TPU slice without one: HBM beside the plan",
        description="Compile each function the engine would compile (every step bucket, "
        "prompt scoring, the sampler-state writes; pooling and LoRA functions when enabled) "
        "for a TPU slice, with the real XLA:TPU and Mosaic compilers, on this CPU: no TPU "
        "and no weights (only config.json is read). Prints per function whether it "
        "compiled (or the compiler's error) and its HBM per device, beside `jaxserve "
        "plan`'s weights, KV cache and sampler state, and a roofline prediction of each "
        "step. Needs libtpu (pip install \"jax[tpu]\"). Exit status 1 when a function does not compile or does not fit.")
    add_model_positional(p)
    add_config_flag(p)
    add_engine_args(p)
    tpus = [d.name for d in PRESETS if d.topology]
    p.add_argument("--device", type=arg_type(preset), metavar="NAME", required=True,
                   help=f"the slice to compile for: {', '.join(tpus)}")
    p.add_argument("--context", type=int, default=1024, metavar="TOKENS",
                   help="the roofline's decode context: tokens each sequence has (1024)")
    p.add_argument("--roofline-device", type=arg_type(preset), metavar="NAME",
                   help="predict with this preset's peak FLOP/s and HBM bandwidth instead of "
                   "--device's (the compiled step's costs are kept: a GPU's prediction from "
                   "the TPU compile of the same mesh)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run_compile)


def run_compile(args: argparse.Namespace) -> int:
    # The compilers run on this host's CPU: JAX needs no accelerator here (and with libtpu
    # installed would look for a TPU first), so its platform is the CPU unless set.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.context < 1:  # before anything is planned or compiled
        raise ValueError(f"--context must be >= 1 token, got {args.context}.")
    from jaxserve.config.plan_advice import plan_report

    model = model_folder(args, logger)
    config = engine_config(args, model, on_accelerator=True)
    report = plan_report(config, args.device.memory_bytes, args.device)
    if report.plan is None:
        print(f"error: {report.error} (jaxserve plan shows what would fit)", file=sys.stderr)
        return 2
    plan = report.plan
    from jaxserve.backends.jax.compile_only import compile_engine
    from jaxserve.backends.jax.compile_targets import target_devices

    devices = target_devices(args.device)
    logger.info("Compiling for %s (%s, %d devices) with mesh %s: %d KV blocks per device "
                "(the plan's).", args.device.name, devices[0].device_kind, len(devices),
                config.parallel.mesh, plan.num_blocks)
    functions = compile_engine(config, devices, plan.num_blocks)
    summary = compile_summary(plan, functions, args.device)
    summary["roofline"] = roofline_rows(plan, functions, args.roofline_device or args.device,
                                        args.context)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0 if summary["compiled"] and summary["fits"] else 1


def compile_summary(plan, functions, device) -> dict:
    """The report: each function's figures, the plan's, and how they compare."""
    from jaxserve.config.plan import plan_dict

    planned = plan.weight_bytes_per_device + plan.num_blocks * plan.bytes_per_block \
        + plan.sampler_state_bytes
    steps = [f for f in functions if f.key[0] == "step" and f.error is None]
    compiled_args = max((f.argument_bytes for f in steps), default=0)
    peak = max((f.peak_bytes for f in functions if f.error is None), default=0)
    return {
        "device": device.name, "device_kind": device.device.name,
        "hbm_bytes": device.memory_bytes, "mesh": str(plan.mesh),
        "plan": plan_dict(plan), "planned_resident_bytes": planned,
        "compiled_step_argument_bytes": compiled_args,
        "difference": (compiled_args - planned) / planned if planned else 0.0,
        "peak_bytes": peak,
        "compiled": all(f.error is None for f in functions),
        "fits": peak <= device.memory_bytes,
        "functions": [function_dict(f) for f in functions],
    }


def roofline_rows(plan, functions, device, context: int) -> dict:
    """The roofline prediction (config/roofline.py) of every compiled step on `device`."""
    from jaxserve.config.roofline import predict

    rows = []
    for f in functions:
        if f.key[0] == "step" and f.error is None and f.flops is not None:
            p = predict(plan, f.key, f.flops, f.bytes_accessed or 0.0, device.device, context)
            rows.append({"name": f.name, "mode": p.mode, "flops": p.flops, "bytes": p.bytes,
                         "step_seconds": p.seconds, "bound": p.bound,
                         "tokens_per_second": p.tokens_per_second})
    return {"device": device.name, "accelerator": device.device.name,
            "bf16_flops": device.device.bf16_flops,
            "hbm_bandwidth": device.device.hbm_bandwidth, "context": context,
            "replicas": plan.mesh.data, "steps": rows}


def function_dict(f) -> dict:
    return {"name": f.name, "seconds": round(f.seconds, 2), "error": f.error,
            "argument_bytes": f.argument_bytes, "output_bytes": f.output_bytes,
            "alias_bytes": f.alias_bytes, "temp_bytes": f.temp_bytes,
            "code_bytes": f.code_bytes, "peak_bytes": f.peak_bytes, "flops": f.flops,
            "bytes_accessed": f.bytes_accessed}


def format_summary(s: dict) -> str:
    from jaxserve.config.plan_text import size_text

    plan = s["plan"]
    lines = [f"{s['device']}: {s['device_kind']}, {size_text(s['hbm_bytes'])} of HBM per "
             f"device; mesh {s['mesh']}",
             f"{'function':<16}{'compile':>9}{'arguments':>13}{'temporaries':>13}"
             f"{'peak':>13}  status"]
    for f in s["functions"]:
        status = "compiled" if f["error"] is None else f"FAILED: {f['error'][:300]}"
        lines.append(f"{f['name']:<16}{f['seconds']:>8.1f}s{size_text(f['argument_bytes']):>13}"
                     f"{size_text(f['temp_bytes']):>13}{size_text(f['peak_bytes']):>13}  "
                     f"{status}")
    kv = plan["num_blocks"] * plan["bytes_per_block"]
    lines += [
        f"plan, per device      weights {size_text(plan['weight_bytes_per_device'])} + KV cache "
        f"{size_text(kv)} ({plan['num_blocks']:,} blocks) + sampler state "
        f"{size_text(plan['sampler_state_bytes'])} = {size_text(s['planned_resident_bytes'])}",
        f"compiled, per device  step arguments {size_text(s['compiled_step_argument_bytes'])} "
        f"({s['difference']:+.1%} against the plan"
        + ("" if abs(s["difference"]) <= AGREEMENT else
           f": more than {AGREEMENT:.0%} apart, a bug in the plan or the engine") + ")",
        f"peak of any function  {size_text(s['peak_bytes'])} of {size_text(s['hbm_bytes'])}"
        + ("" if s["fits"] else ": does NOT fit"),
    ]
    return "\n".join(lines + roofline_lines(s.get("roofline")))


def roofline_lines(r: dict | None) -> list[str]:
    if not r or not r["steps"]:
        return []
    lines = [f"roofline, predicted on {r['device']} ({r['bf16_flops'] / 1e12:,.0f} TFLOP/s bf16, "
             f"{r['hbm_bandwidth'] / 1e9:,.0f} GB/s per device; {r['replicas']} replica(s); "
             f"decode at {r['context']:,} tokens of context, prefill of fresh prompts)",
             f"{'step':<16}{'mode':>8}{'step time':>12}{'tokens/s':>13}  bound"]
    for row in r["steps"]:
        lines.append(f"{row['name']:<16}{row['mode']:>8}{row['step_seconds'] * 1e3:>10.2f}ms"
                     f"{row['tokens_per_second']:>13,.0f}  {row['bound']}")
    return lines
