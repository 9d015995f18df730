"""The `jaxserve` command line: `generate` (offline), `serve` (the OpenAI-compatible HTTP and
gRPC servers), `plan` (memory and buckets, without loading weights) and `convert` (an Orbax
checkpoint); engine flags come from EngineArgs."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jaxserve.bench_cli import add_bench_parser
from jaxserve.cli_common import (
    LOG_LEVELS,
    add_engine_args,
    add_model_positional,
    engine_config,
    help_for,
    model_folder,
    model_of,
)
from jaxserve.config import logs
from jaxserve.config.engine_args import EngineArgs
from jaxserve.config.engine_config import SUPPORTED_DTYPES
from jaxserve.config.version import VERSION
from jaxserve.hosts_cli import add_distributed_args, join_hosts
from jaxserve.serve_cli import add_config_flag, add_log_format_args, add_serve_parser


def _names_a_model(text: str) -> bool:
    """A local model folder (one with a config.json) or an org/name Hub id."""
    import pathlib
    import re

    if (pathlib.Path(text).expanduser() / "config.json").is_file():
        return True
    return re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and ".." not in text


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (offline)",
                       description="Generate completions offline and print them.")
    add_config_flag(p)
    add_engine_args(p)
    add_distributed_args(p.add_argument_group("Multi-host", "one command on every host"))
    p.add_argument("prompts", nargs="*", metavar="[MODEL] PROMPT",
                   help="prompt strings; with two or more, a first one that is a model folder "
                   "or a Hub id (org/name) is the model, as `jaxserve generate MODEL PROMPT`")
    p.add_argument("--prompts-file", help="a file with one prompt per line ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    prompts = list(args.prompts)
    if args.model is None and prompts and (len(prompts) > 1 or args.prompts_file) and \
            _names_a_model(prompts[0]):
        args.model = prompts.pop(0)
    if args.prompts_file:
        stream = sys.stdin if args.prompts_file == "-" else open(args.prompts_file)
        with stream:
            prompts += [line.rstrip("\n") for line in stream if line.strip()]
    if not prompts:
        raise ValueError("give at least one prompt (as arguments or with --prompts-file).")
    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.sample_seed, stop=args.stop,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    join_hosts(args, False, engine_config)  # (other hosts end here)
    llm = LLM.from_engine_args(EngineArgs.from_cli(args))  # model None: the built-in model
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    finally:
        llm.close()  # multi-host: release the worker hosts
    for prompt, output in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in output.outputs]}))
            continue
        for completion in output.outputs:
            print(f"{prompt}{completion.text}")
            print(f"--- finish_reason={completion.finish_reason} "
                  f"tokens={len(completion.token_ids)}")
    return 0


def _plan_parser(sub) -> None:
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
    device.add_argument("--device", type=_arg_type(preset), metavar="NAME",
                        help=f"what you rent: {', '.join(d.name for d in PRESETS)}")
    device.add_argument("--device-memory", type=_arg_type(parse_bytes), metavar="SIZE",
                        help="memory of one device: 16GiB or 16G (binary), 80GB (decimal), "
                        "16e9 (bytes)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=_run_plan)


def _arg_type(parse):
    """parse as an argparse type: its ValueError's message becomes argparse's error."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return convert


def _run_plan(args: argparse.Namespace) -> int:
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


def _convert_parser(sub) -> None:
    p = sub.add_parser(
        "convert", help="write a model as an Orbax checkpoint, restored straight into a mesh",
        description="Write a Hugging Face model folder (or Hub id) as an Orbax checkpoint of "
        "the engine's parameters, with its config, tokenizer and generation config beside "
        "it. `jaxserve serve DIR` and LLM(model=DIR) restore each array directly into its "
        "sharding, every host reading only its slices, on any mesh. Runs on the CPU; the "
        "parameters pass through host memory once.")
    add_model_positional(p)
    p.add_argument("--model", default=None, help="model folder or Hub id (or positional)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.add_argument("--dtype", default=None, choices=SUPPORTED_DTYPES[1:],
                   help="the saved parameters' dtype (default: the checkpoint's own)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DIR if it holds an earlier conversion")
    p.set_defaults(func=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_platforms", "cpu")  # abstract shapes and host arrays only

    from jaxserve.backends.jax.orbax_checkpoint import convert
    from jaxserve.config.model_path import resolve_model

    model = resolve_model(model_of(args), logging.getLogger("jaxserve.convert"))
    out = convert(model, args.out, args.dtype, overwrite=args.overwrite)
    print(f"Wrote {out}: serve it with `jaxserve serve {out}`")
    return 0


_SUBCOMMANDS = ("generate", "serve", "plan", "convert")


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="LLM inference and serving on JAX.")
    parser.add_argument("--version", action="version", version=f"jaxserve {VERSION}")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                        help="logging level (also accepted after the subcommand)")
    add_log_format_args(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _generate_parser(sub)
    add_serve_parser(sub)
    _plan_parser(sub)
    _convert_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jaxserve.config.config_file import expand_config

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--help=")), None)
    command = next((a for a in argv if a in _SUBCOMMANDS), None)
    if query is not None and command is not None:  # vLLM's --help=GROUP / --help=WORD
        print(help_for(_subparser(parser, command), query), end="")
        return 0
    try:
        argv, config_model = expand_config(argv, parser)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    # `generate MODEL --flag ... PROMPT...`: argparse fills a positional list once, so
    # prompts after the flags come back as extras.
    if extra and args.command == "generate" and not any(e.startswith("-") for e in extra):
        args.prompts += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if config_model is not None and getattr(args, "model_tag", None) is None and \
            args.model is None:
        args.model = config_model
    try:
        logs.configure(args.log_level, args.log_format, args.log_config_file)
        return args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
