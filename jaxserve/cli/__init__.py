"""The `jaxserve` command line: `generate` (offline), `serve` (the OpenAI-compatible HTTP and
gRPC servers), `plan` (memory and buckets, without loading weights), `compile` (every bucket compiled for
a TPU slice without one), `convert` (an Orbax
checkpoint) and `bench serve`; engine flags come from EngineArgs. One module per command
(generate.py, serve.py, plan.py, compile.py, convert.py, bench.py); common.py holds what they share and
hosts.py the multi-host flags."""

from __future__ import annotations

import argparse
import sys

from jaxserve.cli.bench import add_bench_parser
from jaxserve.cli.common import LOG_LEVELS, help_for
from jaxserve.cli.compile import add_compile_parser
from jaxserve.cli.convert import add_convert_parser
from jaxserve.cli.generate import add_generate_parser
from jaxserve.cli.plan import add_plan_parser
from jaxserve.cli.serve import add_log_format_args, add_serve_parser
from jaxserve.config import logs
from jaxserve.config.version import VERSION

_SUBCOMMANDS = ("generate", "serve", "plan", "compile", "convert")


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
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_plan_parser(sub)
    add_compile_parser(sub)
    add_convert_parser(sub)
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

