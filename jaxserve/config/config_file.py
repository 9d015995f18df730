"""`--config FILE.yaml`: flags from a YAML file, as vLLM's `vllm serve --config` reads them.

The file maps long flag names (without the dashes; `max-model-len` or `max_model_len`) to
values: a scalar is the flag's value, true / false a switch, a list the values of a flag
that takes several, a mapping a JSON flag (speculative-config). They go into the command
line right after the subcommand, so a flag given on the command line wins (argparse keeps
the last value); `model:` is the model unless the command line names one.
"""

from __future__ import annotations

import argparse
import json


def expand_config(argv: list[str], parser: argparse.ArgumentParser
                  ) -> tuple[list[str], str | None]:
    """(argv with --config FILE replaced by the file's flags, the file's model or None)."""
    where = _config_position(argv)
    if where is None:
        return argv, None
    start, end, path = where
    command = next((a for a in argv[:start] if a in _subcommands(parser)), None)
    if command is None:
        raise ValueError("--config goes after the subcommand: jaxserve serve --config FILE.")
    sub = _subcommands(parser)[command]
    values = _read(path)
    model = values.pop("model", None)
    flags: list[str] = []
    for key, value in values.items():
        flags += _as_flags(sub, path, str(key), value)
    rest = argv[:start] + argv[end:]
    at = rest.index(command) + 1
    return rest[:at] + flags + rest[at:], None if model is None else str(model)


def _config_position(argv: list[str]) -> tuple[int, int, str] | None:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file: --config FILE.yaml.")
            return i, i + 2, argv[i + 1]
        if arg.startswith("--config="):
            return i, i + 1, arg.split("=", 1)[1]
    return None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _read(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except OSError as err:
        raise ValueError(f"--config {path}: {err.strerror}.") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML ({str(err)[:200]}).") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got "
                         f"a {type(values).__name__}.")
    return values


def _as_flags(sub: argparse.ArgumentParser, path: str, key: str, value) -> list[str]:
    flag = "--" + key.replace("_", "-")
    action = sub._option_string_actions.get(flag)
    if action is None or key in ("config", "help"):
        raise ValueError(f"--config {path}: unknown option {key!r} (the keys are the "
                         f"command's long flag names without the dashes, such as "
                         f"max-model-len).")
    if value is None:
        return []
    if isinstance(value, bool):
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        if action.nargs == 0:  # store_true
            if not value:
                return []
            return [flag]
        return [flag, str(value).lower()]
    if isinstance(value, list):
        if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
            if isinstance(action, argparse._AppendAction):
                return [part for item in value for part in (flag, _text(item))]
            return [flag, *map(_text, value)]
        return [flag, json.dumps(value)]  # a JSON flag (--allowed-origins)
    if action.nargs == 0:
        raise ValueError(f"--config {path}: {key} is a switch: give true or false, got "
                         f"{value!r}.")
    return [flag, _text(value)]


def _text(value) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)
