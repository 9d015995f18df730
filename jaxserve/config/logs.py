"""One log format for every line a jaxserve process writes: its own loggers', uvicorn's, and
those of the engine core process (which inherits the settings through the environment).

`text` (the default): `INFO 12-03 10:15:02 jaxserve.server.launch: Serving ...`; `json`: one
object per line, {"time", "level", "logger", "message"} (and "exception" with a traceback),
for log pipelines. `--log-config-file FILE.json` hands the whole configuration to
logging.config.dictConfig instead, as vLLM's does.

Long work (weight loading, compiling buckets) shows tqdm bars on a terminal; `serve` turns
them into log lines (progress.py), so a server's log holds no bar redraws.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import time

FORMATS = ("text", "json")
_FORMAT_ENV = "JAXSERVE_LOG_FORMAT"
_CONFIG_ENV = "JAXSERVE_LOG_CONFIG_FILE"
TEXT_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
TEXT_DATE = "%m-%d %H:%M:%S"


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
                 + f".{int(record.msecs):03d}", "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, fmt: str | None = None, config_file: str | None = None) -> None:
    """Set up the root logger for this process (and, through the environment, for the
    processes it starts). fmt: "text" or "json" (default: the inherited setting, else
    text); config_file: a JSON dictConfig file that replaces all of it."""
    fmt = fmt or os.environ.get(_FORMAT_ENV, "text")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}.")
    config_file = config_file or os.environ.get(_CONFIG_ENV)
    if config_file:
        config = _read_config(config_file)  # (a bad file leaves the inherited settings alone)
        os.environ[_FORMAT_ENV], os.environ[_CONFIG_ENV] = fmt, config_file
        ours = logging.getLogger("jaxserve")
        ours.handlers.clear()  # the file decides (its "jaxserve" logger, or the root's)
        ours.propagate = True
        ours.setLevel(logging.NOTSET)
        logging.config.dictConfig(config)
        return
    os.environ[_FORMAT_ENV] = fmt
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json"
                         else logging.Formatter(TEXT_FORMAT, TEXT_DATE))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("jax").setLevel(max(logging.WARNING, root.level))
    ours = logging.getLogger("jaxserve")
    ours.handlers.clear()  # the package's own default (jaxserve/__init__.py): root's now
    ours.propagate = True
    ours.setLevel(level)


def _read_config(path: str) -> dict:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--log-config-file {path}: {err}") from None
    if not isinstance(config, dict) or "version" not in config:
        raise ValueError(f"--log-config-file {path}: expected a logging dictConfig JSON "
                         "object (with \"version\": 1).")
    return config


def configure_uvicorn(level: str, access_log: bool, quiet_paths: tuple[str, ...] = (),
                      root_path: str = "") -> None:
    """uvicorn's loggers write through the root logger's handler (uvicorn.Config with
    log_config=None leaves them alone): its level, and the access log on or off, without
    the paths in quiet_paths (health checks; under root_path, which uvicorn's lines show)."""
    numeric = 5 if level == "trace" else level.upper()  # uvicorn's TRACE_LOG_LEVEL is 5
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(numeric)
    access = logging.getLogger("uvicorn.access")
    access.handlers.clear()
    access.propagate = True
    access.disabled = not access_log
    access.setLevel(numeric)
    access.filters.clear()
    if quiet_paths:
        access.addFilter(_QuietPaths(quiet_paths + tuple(root_path + p for p in quiet_paths)))


class _QuietPaths(logging.Filter):
    """Drops uvicorn access lines for some paths (its record args: client, method, path with
    query, HTTP version, status)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]).split("?")[0] if len(args) > 2 else ""
        return path not in self.paths


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' "PyTorch was not found" advice, logged when transformers is first
    imported without torch: jaxserve's JAX install needs no torch (its tokenizers and configs
    are what it reads), and the torch backend names its own install when asked for."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found")


def quiet_torch_advice() -> None:
    """Installs the filter on transformers' logger, before transformers is imported (the
    logger object is shared, so its own handler set up later sees the filter too)."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())
