"""`jaxserve plan`: per-device memory, KV blocks and compile buckets from a model's
config.json, without loading weights or importing jax."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jaxserve.cli.common import add_engine_args, add_model_positional, engine_config, model_folder
from jaxserve.cli.serve import add_config_flag


def add_plan_parser(sub) -> None:
    from jaxserve.config.accelerators import PRESETS, preset  # host-side: no jax
    from jaxserve.config.plan_text import parse_bytes

    p = sub.add_parser(
        "plan", help="per-device memory, KV blocks and compile buckets, without loading weights",
        description="Print what the engine would place on each device for a model folder "
        "(only its config.json is read), a mesh and a device (a preset such as v5e-8, or a "
        "per-device memory size): weight and KV bytes, KV blocks, concurrency at "
        "max_model_len, compile buckets; the meshes a multi-device preset can take; what "
        "would fit when the configuration does not. Runs on the CPU; no accelerator is "
        "touched. Defaults are the engine's on an accelerator.")
    add_model_positional(p)
    add_config_flag(p)
    add_engine_args(p)
    device = p.add_mutually_exclusive_group(required=True)
    device.add_argument("--device", type=arg_type(preset), metavar="NAME",
                        help=f"what you rent: {', '.join(d.name for d in PRESETS)}")
    device.add_argument("--device-memory", type=arg_type(parse_bytes), metavar="SIZE",
                        help="memory of one device: 16GiB or 16G (binary), 80GB (decimal), "
                        "16e9 (bytes)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=run_plan)


def arg_type(parse):
    """parse as an argparse type: its ValueError's message becomes argparse's error."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return convert


def run_plan(args: argparse.Namespace) -> int:
    # The plan is arithmetic on config.json (the families' numpy parameter tables): it never
    # imports jax, so it cannot claim an accelerator that a running server may be using.
    from jaxserve.config.plan_advice import format_report, plan_report, report_dict

    model = model_folder(args, logging.getLogger("jaxserve.plan"))
    config = engine_config(args, model, on_accelerator=True)
    memory = args.device.memory_bytes if args.device else args.device_memory
    mesh_given = (args.mesh is not None or args.tensor_parallel_size != 1
                  or args.data_parallel_size != 1)
    report = plan_report(config, memory, args.device, mesh_given=mesh_given)
    if report.plan is None:
        print(f"error: {report.error}", file=sys.stderr, flush=True)
    print(json.dumps(report_dict(report), indent=2) if args.json else format_report(report))
    return 0 if report.plan is not None else 2
