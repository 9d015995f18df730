"""A `jaxserve serve` subprocess on this machine's loopback interface, for the benchmarks that
start one (bench_serving.py --launch-model, bench_startup.py): a free port, the command, the
start in a session of its own with its output in a log file, the wait for /health (or
/ready), the stop (signals in turn, then SIGKILL to the whole session), and the log's last
lines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

# `jaxserve` through this Python, whether or not its command is on PATH
PYTHON_CLI = [sys.executable, "-c", "import sys; from jaxserve.cli import main; sys.exit(main())"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(launcher: list[str], port: int, model: str | None = None,
                  extra: list[str] | tuple = ()) -> list[str]:
    """launcher (the `jaxserve` command, or PYTHON_CLI) + `serve` on 127.0.0.1:port, of
    `model` (None or "": the built-in model), with the extra flags."""
    cmd = [*launcher, "serve", "--host", "127.0.0.1", "--port", str(port)]
    return cmd + (["--model", model] if model else []) + list(extra)


def start_server(cmd: list[str], log, env: dict | None = None) -> subprocess.Popen:
    """cmd in a session of its own (kill_group ends it and its children), stdout and stderr
    into the open file `log`, no stdin."""
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout: float, log: str,
                 path: str = "/health") -> None:
    """Until GET path answers 200 (/health: it takes requests; /ready: its warm-up compiles
    are done too); SystemExit (with the log's tail) if the server exits or does not answer
    200 after `timeout` seconds."""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}:\n{tail(log)}")
        try:
            if httpx.get(f"{base_url}{path}", timeout=2.0, trust_env=False).status_code == 200:
                print(f"server up at {base_url} ({path}) after "
                      f"{time.monotonic() - start:.0f} s", file=sys.stderr)
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{base_url}{path} did not answer 200 after {timeout:g} s:\n{tail(log)}")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the session the process was started in (start_server's)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stop_server(proc: subprocess.Popen, steps=((signal.SIGTERM, 60.0),)) -> dict:
    """Each (signal, seconds to wait) of steps in turn until the server exits (SIGINT and
    SIGTERM: it drains first), then SIGKILL to its session. How it ended: the signal it
    exited after (None: it had already), the seconds it took, its exit code."""
    if proc.poll() is not None:
        return {"signal": None, "stop_s": 0.0, "returncode": proc.returncode}
    start = time.perf_counter()
    for sig, wait in steps:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
            return {"signal": sig.name, "stop_s": time.perf_counter() - start,
                    "returncode": proc.returncode}
        except subprocess.TimeoutExpired:
            continue
    kill_group(proc)
    return {"signal": "SIGKILL", "stop_s": time.perf_counter() - start,
            "returncode": proc.returncode}


def tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
