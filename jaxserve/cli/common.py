"""What the `jaxserve` subcommands share: the engine flags, the model given positionally or
as --model, and the EngineConfig of the parsed flags."""

from __future__ import annotations

import argparse

from jaxserve.config.engine_args import EngineArgs

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that loads a model: one per EngineArgs field
    (vLLM's names, jaxserve's older ones as aliases, in vLLM's --help groups), and
    --log-level."""
    EngineArgs.add_cli_args(parser)
    # Also after the subcommand (`jaxserve serve --log-level DEBUG`); SUPPRESS keeps the
    # main parser's value when it is not given here.
    parser.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                        help="logging level (default: INFO)")


def engine_config(args: argparse.Namespace, model: str, precompile: bool | str = True,
                  on_accelerator: bool | None = None):
    """The EngineConfig of the parsed flags for a resolved model folder; precompile: the
    command's default (generate: on first use, serve: background)."""
    engine_args = EngineArgs.from_cli(args)
    if on_accelerator is None:
        from jaxserve.backends.selection import on_accelerator as accelerated

        on_accelerator = accelerated(engine_args.backend)
    return engine_args.engine_config(model, on_accelerator=on_accelerator,
                                     default_precompile=precompile)


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    """`jaxserve serve MODEL` as `vllm serve MODEL` (the same as --model)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model folder or Hugging Face Hub id (the same as --model)")


def model_of(args: argparse.Namespace) -> str | None:
    """The model of the positional argument or --model (one of them, or both the same)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"the model is given twice, as {tag!r} and --model {args.model!r}; "
                         "give one of them.")
    args.model = tag if tag is not None else args.model
    return args.model


def model_folder(args: argparse.Namespace, logger) -> str:
    """The model as a local folder (model_of, then EngineArgs.model_folder: the built-in
    model, or a Hub id at --revision in --download-dir with --hf-token)."""
    model_of(args)
    return EngineArgs.from_cli(args).model_folder(logger)


def help_for(parser: argparse.ArgumentParser, query: str) -> str:
    """`--help=QUERY`, as vLLM's: `listgroup` names the --help groups, a group's name (any
    case: `--help=CacheConfig`) shows that group, any other word the flags whose names
    contain it (`--help=max`)."""
    groups = [g for g in parser._action_groups if any(
        a.help != argparse.SUPPRESS for a in g._group_actions)]
    if query == "listgroup":
        return "\n".join(["The --help groups:", *(f"  {g.title}" for g in groups)]) + "\n"
    formatter = parser._get_formatter()
    chosen = [g for g in groups if g.title.lower() == query.lower()]
    if chosen:
        formatter.start_section(chosen[0].title)
        formatter.add_text(chosen[0].description)
        formatter.add_arguments(chosen[0]._group_actions)
        formatter.end_section()
        return formatter.format_help()
    word = query.lstrip("-").replace("_", "-").lower()
    found = [a for g in groups for a in g._group_actions if a.help != argparse.SUPPRESS
             and any(word in s.lower() for s in a.option_strings)]
    if not found:
        return (f"No --help group or flag matches {query!r}; --help=listgroup lists the "
                "groups.\n")
    formatter.start_section(f"flags matching {query!r}")
    formatter.add_arguments(found)
    formatter.end_section()
    return formatter.format_help()
