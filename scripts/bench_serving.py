"""Benchmark an OpenAI-compatible server: `jaxserve bench serve` (the same flags, vLLM's names:
`jaxserve bench serve --help`), with a `jaxserve serve` started on this machine for the run.

    python scripts/bench_serving.py --launch-model [DIR] [--server-args "--max-num-seqs 64"] \\
        --random-input-len 128 --random-output-len 64 --num-prompts 64 --num-warmups 4 \\
        --max-concurrency 1,2,4,8 --plot sweep.png --save-result --result-dir results
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 0.5,1,2,4 \\
        --random-input-len 128 --random-output-len 64 --num-prompts 32 --plot rates.png

--launch-model starts `jaxserve serve` (of DIR, or the built-in model without DIR) on a free
loopback port, waits for /ready (the warm-up compiles done), points the benchmark at it and
stops it at the end. Without it, this is `jaxserve bench serve` itself, against any URL.
Exit status: 0 when every request succeeded, 1 when some failed, 2 for a bad flag or file.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile

from jaxserve.benchmarks.local_server import (
    PYTHON_CLI,
    free_port,
    serve_command,
    start_server,
    stop_server,
    wait_healthy,
)
from jaxserve.benchmarks.serve.run import check_args
from jaxserve.cli.bench import add_serve_args, run_bench_serve


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("local server (this script only)")
    g.add_argument("--launch-model", nargs="?", const="", default=None, metavar="DIR",
                   help="start `jaxserve serve [--model DIR]` on a free loopback port for the "
                   "run (no DIR: the built-in model); --base-url/--host/--port are ignored")
    g.add_argument("--server-args", default="",
                   help="with --launch-model: extra `jaxserve serve` flags, one string")
    g.add_argument("--launch-timeout", type=float, default=900.0,
                   help="with --launch-model: seconds to wait for /ready")
    add_serve_args(p)
    return p


@contextlib.contextmanager
def launched_server(args: argparse.Namespace):
    """With --launch-model: `jaxserve serve` on a free loopback port for the block, and
    args.base_url pointing at it; without it, nothing."""
    if args.launch_model is None:
        yield
        return
    port = free_port()
    cmd = serve_command(PYTHON_CLI, port, args.launch_model, shlex.split(args.server_args))
    with tempfile.NamedTemporaryFile(prefix="jaxserve-bench-", suffix=".log",
                                     delete=False) as log:
        print(f"starting: jaxserve {shlex.join(cmd[len(PYTHON_CLI):])} (log: {log.name})",
              file=sys.stderr)
        proc = start_server(cmd, log)
        args.base_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, args.base_url, args.launch_timeout, log.name, path="/ready")
            yield
        finally:
            stop_server(proc)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.launch_model is not None:
            check_args(args)  # a bad flag or file now, not after the server's start
        with launched_server(args):
            return run_bench_serve(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
