"""Start-up time as a new user meets it: the README's first command, and `jaxserve serve`.

    python scripts/bench_startup.py [--models builtin small] [--skip-generate] [--skip-serve]
        [--timeout 600] [--json OUT]

Every measured run is a subprocess of the installed `jaxserve` command (the one beside this
Python) with HOME (and XDG_CACHE_HOME inside it) pointing at a fresh, empty folder, so
jaxserve's compiled-function cache and every other per-user cache start empty: that is the
"cold" run. The "warm" run repeats it with the same HOME, so it finds what the cold run left.
Environment variables that point JAX, XLA, Hugging Face or jaxserve elsewhere (JAX_*, XLA_*,
HF_*, ...) are dropped for both runs. Not made cold: the OS page cache and Python bytecode.

  generate  the README's `jaxserve generate "def fibonacci(n):"` (read from README.md's first
            bash block): wall time, exit code 0, and a printed completion.
  serve     `jaxserve serve` on a free loopback port, for the built-in model and for the
            "small" benchmark Llama (make_small_checkpoint.py; built before any timing):
            seconds from process start to /health 200, to /ready 200 (null where the
            server has no /ready), and to the first successful POST /v1/completions; then
            SIGINT (SIGTERM, then SIGKILL, if it does not exit) and the time it takes to exit.

Each run is bounded by --timeout; one that fails or times out is reported as failed (and the
script exits 1 at the end), the others still run. Server logs are kept in a temp folder whose
path is printed; a server that does not come up has its last 30 log lines printed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from jaxserve.benchmarks.checkpoints import ensure_small_checkpoint
from jaxserve.benchmarks.local_server import (
    free_port,
    kill_group,
    serve_command,
    start_server,
    stop_server,
    tail,
)
from jaxserve.benchmarks.startup_report import table

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODELS = ("builtin", "small")
POLL_S = 0.05
LOG_LINES = 30
FINISH_LINE = re.compile(r"^--- finish_reason=(\S+) tokens=(\d+)$", re.MULTILINE)
COMPLETION = {"prompt": "def add(a, b):", "max_tokens": 16}
# Ctrl-C (the server drains and exits), then SIGTERM, then SIGKILL: seconds to wait for each
STOP_STEPS = ((signal.SIGINT, 30.0), (signal.SIGTERM, 30.0))
# Settings a new user does not have, which could point a cache (or the devices) elsewhere.
DROPPED_PREFIXES = ("JAX_", "XLA_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_",
                    "JAXSERVE_", "XDG_", "TORCH", "TRITON_", "CUDA_CACHE", "PYTHONPYCACHEPREFIX")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- what a new user runs -----------------------------------------------------------------
def jaxserve_executable() -> str:
    """The `jaxserve` installed beside this Python (the venv's, whether or not it is active)."""
    path = pathlib.Path(sys.executable).parent / "jaxserve"
    if not path.is_file():
        raise SystemExit(f"no jaxserve command at {path}: run `pip install -e .` first")
    return str(path)


def readme_generate_command(readme: pathlib.Path = ROOT / "README.md") -> list[str]:
    """argv of the README's first command after the install: the part after '&& ' on the
    first line of its first bash block."""
    text = readme.read_text()
    start = text.find("```bash\n")
    if start < 0:
        raise SystemExit(f"{readme} has no ```bash block")
    first_line = text[start + len("```bash\n"):].split("\n", 1)[0]
    if "&& " not in first_line:
        raise SystemExit(f"the first line of {readme}'s first bash block has no '&& ': "
                         f"{first_line!r}")
    argv = shlex.split(first_line.split("&& ", 1)[1])
    if argv[:2] != ["jaxserve", "generate"]:
        raise SystemExit(f"expected `jaxserve generate ...` after '&& ', got {shlex.join(argv)}")
    return argv


def fresh_env(home: pathlib.Path) -> dict[str, str]:
    """This process's environment with HOME (and the XDG folders) inside `home` and no
    cache-related settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_PREFIXES)}
    env["HOME"] = str(home)
    env["XDG_CACHE_HOME"] = str(home / ".cache")
    env["XDG_CONFIG_HOME"] = str(home / ".config")
    env["XDG_DATA_HOME"] = str(home / ".local" / "share")
    bin_dir = str(pathlib.Path(sys.executable).parent)
    path = env.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        env["PATH"] = os.pathsep.join(p for p in (bin_dir, path) if p)
    return env


def dropped_variables() -> list[str]:
    return sorted(k for k in os.environ if k.startswith(DROPPED_PREFIXES))


def folder_size(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def waiting(what: str, start: float, last: list[float]) -> None:
    """A progress line every 30 s of waiting."""
    now = time.perf_counter()
    if now - last[0] >= 30:
        last[0] = now
        log(f"  ... {what}: {now - start:.0f} s so far")


# ---- 1: the README's generate command -------------------------------------------------------
def run_generate(argv: list[str], home: pathlib.Path, log_dir: pathlib.Path, label: str,
                 timeout: float) -> dict:
    cmd = [jaxserve_executable(), *argv[1:]]
    out_path = log_dir / f"generate-{label}.log"
    result = {"ok": False, "wall_s": None, "returncode": None, "error": None,
              "log": str(out_path), "load_avg_before": list(os.getloadavg())}
    log(f"generate ({label}): {shlex.join(argv)}  [HOME={home}]")
    with open(out_path, "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=fresh_env(home), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            result["error"] = f"timed out after {timeout:g} s"
            log(f"generate ({label}): FAILED, {result['error']}; last lines of {out_path}:\n"
                f"{tail(str(out_path), LOG_LINES)}")
            return result
        except BaseException:  # Ctrl-C here: the child is in its own session, end it too
            kill_group(proc)
            raise
        wall = time.perf_counter() - start
    result.update(wall_s=wall, returncode=proc.returncode, stdout=stdout)
    prompt = argv[2] if len(argv) > 2 else ""
    finish = FINISH_LINE.search(stdout)
    completion = stdout[len(prompt):finish.start()].rstrip("\n") if finish else ""
    if proc.returncode != 0:
        result["error"] = f"exit code {proc.returncode}"
    elif not stdout.startswith(prompt) or finish is None:
        result["error"] = "no completion printed"
    elif int(finish.group(2)) == 0 or not completion.strip():
        result["error"] = "an empty completion"
    else:
        result.update(ok=True, completion=completion, finish_reason=finish.group(1),
                      completion_tokens=int(finish.group(2)))
    if result["ok"]:
        log(f"generate ({label}): {wall:.1f} s, exit 0, completion {completion[:60]!r}...")
    else:
        log(f"generate ({label}): FAILED after {wall:.1f} s: {result['error']}; stdout "
            f"{stdout[-500:]!r}; last lines of {out_path}:\n{tail(str(out_path), LOG_LINES)}")
    return result


# ---- 2: jaxserve serve ----------------------------------------------------------------------
class FirstCompletion(threading.Thread):
    """Asks /v1/models for the served name, then POSTs the completion until one succeeds (or
    the deadline, or `stop`); the time of success is `done_at` (perf_counter)."""

    def __init__(self, base_url: str, deadline: float, stop: threading.Event):
        super().__init__(daemon=True)
        self.base_url, self.deadline, self.stop = base_url, deadline, stop
        self.done_at: float | None = None
        self.model: str | None = None
        self.response: dict | None = None
        self.error = "no attempt yet"
        self.logged = False
        self.attempts = 0

    def run(self) -> None:
        with httpx.Client(trust_env=False) as client:
            while not self.stop.is_set() and time.perf_counter() < self.deadline:
                try:
                    if self.attempt(client):
                        return
                except Exception as err:  # noqa: BLE001 (reported, not lost with the thread)
                    self.error = f"the client failed: {type(err).__name__}: {err}"
                    return
                time.sleep(POLL_S)

    def attempt(self, client: httpx.Client) -> bool:
        left = max(0.1, self.deadline - time.perf_counter())
        self.error = "a request is in flight"
        try:
            if self.model is None:
                r = client.get(f"{self.base_url}/v1/models", timeout=min(left, 10.0))
                if r.status_code != 200:
                    self.error = f"GET /v1/models: HTTP {r.status_code} {r.text[:200]}"
                    return False
                self.model = r.json()["data"][0]["id"]
            self.attempts += 1
            r = client.post(f"{self.base_url}/v1/completions", timeout=left,
                            json={"model": self.model, **COMPLETION})
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
            self.error = f"{type(err).__name__}: {err}"
            return False
        if r.status_code != 200:
            self.error = f"POST /v1/completions: HTTP {r.status_code} {r.text[:200]}"
            return False
        try:
            body = r.json()
            text = body["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            self.error = f"POST /v1/completions: unexpected answer {r.text[:200]}"
            return False
        if not isinstance(text, str):
            self.error = f"POST /v1/completions: no text in {r.text[:200]}"
            return False
        self.response, self.error = body, "none"
        self.done_at = time.perf_counter()  # last: the main thread reads done_at first
        return True


def run_serve(model_dir: str | None, home: pathlib.Path, log_dir: pathlib.Path, name: str,
              label: str, timeout: float) -> dict:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = serve_command([jaxserve_executable()], port, model_dir)
    log_path = log_dir / f"serve-{name}-{label}.log"
    result = {"ok": False, "health_s": None, "ready_s": None, "ready_available": None,
              "ready_last": None,
              "first_completion_s": None, "first_http_response_s": None, "error": None,
              "served_model": None, "completion": None, "completion_attempts": 0,
              "log": str(log_path), "load_avg_before": list(os.getloadavg())}
    log(f"serve {name} ({label}): jaxserve {shlex.join(cmd[1:])}  [HOME={home}]")
    stop = threading.Event()
    worker: FirstCompletion | None = None
    with open(log_path, "w") as out:
        start = time.perf_counter()
        proc = start_server(cmd, out, env=fresh_env(home))
        deadline = start + timeout
        last = [start]
        try:
            with httpx.Client(trust_env=False) as client:
                while True:
                    now = time.perf_counter()
                    if proc.poll() is not None:
                        result["error"] = f"the server exited with code {proc.returncode}"
                        break
                    completed = worker is not None and worker.done_at is not None
                    if now > deadline:
                        if completed:  # only /ready missing: noted, not a failure
                            result["ready_note"] = (f"/ready not 200 within {timeout:g} s "
                                                    f"(last: {result['ready_last']})")
                        else:
                            result["error"] = (f"timed out after {timeout:g} s waiting for "
                                               + waiting_for(result, worker))
                        break
                    poll_health(client, base_url, result, start)
                    if result["health_s"] is not None and worker is None:
                        log(f"  /health 200 after {result['health_s']:.2f} s")
                        worker = FirstCompletion(base_url, deadline, stop)
                        worker.start()
                    if result["ready_available"] is None:
                        poll_ready(client, base_url, result, start)
                    if worker is not None and not worker.is_alive():
                        # done_at read again: the worker may have finished since `completed`
                        if worker.done_at is None:
                            result["error"] = f"no completion: {worker.error}"
                            break
                        if worker.logged is False:
                            worker.logged = True
                            log(f"  first completion after {worker.done_at - start:.2f} s")
                        if result["ready_available"] is not None:
                            break
                    waiting(f"serve {name} ({label}), waiting for "
                            + waiting_for(result, worker), start, last)
                    time.sleep(POLL_S)
        finally:
            stop.set()
            if worker is not None and worker.done_at is not None:
                result["first_completion_s"] = worker.done_at - start
                result["served_model"] = worker.model
                result["completion"] = worker.response["choices"][0]["text"]
                result["usage"] = worker.response.get("usage")
            if worker is not None:
                result["completion_attempts"] = worker.attempts
            result.update(stop_server(proc, STOP_STEPS))
            if worker is not None:
                worker.join(timeout=5)
    if result["error"] is None and result["first_completion_s"] is not None:
        result["ok"] = True
        ready = (f"{result['ready_s']:.2f} s" if result["ready_s"] is not None
                 else "n/a" if result["ready_available"] is False else "not 200")
        log(f"serve {name} ({label}): /health {result['health_s']:.2f} s, /ready {ready}, "
            f"first completion {result['first_completion_s']:.2f} s "
            f"({result['completion_attempts']} attempt(s), {result['completion'][:40]!r}); "
            f"stopped by {result['signal']} in {result['stop_s']:.1f} s, "
            f"exit code {result['returncode']}")
    else:
        log(f"serve {name} ({label}): FAILED: {result['error']}; stopped by {result['signal']}"
            f" (exit code {result['returncode']}); last {LOG_LINES} lines of {log_path}:\n"
            f"{tail(str(log_path), LOG_LINES)}")
    return result


def waiting_for(result: dict, worker: FirstCompletion | None) -> str:
    if result["health_s"] is None:
        return "/health"
    if worker is not None and worker.done_at is None:
        return f"the first completion (last error: {worker.error})"
    return "/ready"


def poll_health(client: httpx.Client, base_url: str, result: dict, start: float) -> None:
    if result["health_s"] is not None:
        return
    try:
        r = client.get(f"{base_url}/health", timeout=2.0)
    except httpx.HTTPError:
        return
    now = time.perf_counter() - start
    if result["first_http_response_s"] is None:
        result["first_http_response_s"] = now
    if r.status_code == 200:
        result["health_s"] = now


def poll_ready(client: httpx.Client, base_url: str, result: dict, start: float) -> None:
    """/ready: 200 records the time, 404 means the server has no such route (null)."""
    try:
        r = client.get(f"{base_url}/ready", timeout=2.0)
    except httpx.HTTPError:
        return
    now = time.perf_counter() - start
    if result["first_http_response_s"] is None:
        result["first_http_response_s"] = now
    result["ready_last"] = f"HTTP {r.status_code} {r.text[:200]}"
    if r.status_code == 200:
        result["ready_s"], result["ready_available"] = now, True
        log(f"  /ready 200 after {now:.2f} s")
    elif r.status_code == 404:
        result["ready_available"] = False
        log("  /ready: 404, no such endpoint (reported as null)")


# ---- report ---------------------------------------------------------------------------------
def git_state() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"),
            "dirty": bool(status) if status is not None else None}


def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("jaxserve", "jax", "jaxlib"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "versions": versions, "git": git_state(),
            "dropped_env": dropped_variables()}


# ---- entry point ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                   help="models to serve: builtin (no --model) and/or small (the ~125M "
                   "benchmark Llama) (default: both)")
    p.add_argument("--skip-generate", action="store_true",
                   help="skip the README's `jaxserve generate` command")
    p.add_argument("--skip-serve", action="store_true", help="skip `jaxserve serve`")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds each run (one cold or warm start) may take (default 600)")
    p.add_argument("--json", metavar="OUT", default=None, help="write all numbers as JSON")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.timeout > 0:
        raise SystemExit("--timeout must be > 0")
    models = list(dict.fromkeys(args.models))
    argv_generate = readme_generate_command()
    jaxserve_executable()
    small_dir = None
    if not args.skip_serve and "small" in models:
        log("building the small benchmark checkpoint if needed (not timed) ...")
        small_dir = str(ensure_small_checkpoint())
        log(f"small checkpoint: {small_dir}")
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-bench-startup-"))
    log(f"logs: {log_dir}")
    dropped = dropped_variables()
    if dropped:
        log(f"not passed to the runs (cache settings a new user does not have): "
            f"{' '.join(dropped)}")
    report = {"environment": environment(), "timeout_s": args.timeout, "log_dir": str(log_dir)}

    if not args.skip_generate:
        with tempfile.TemporaryDirectory(prefix="jaxserve-home-") as tmp:
            home = pathlib.Path(tmp)
            gen = {"command": argv_generate}
            for label in ("cold", "warm"):
                gen[label] = run_generate(argv_generate, home, log_dir, label, args.timeout)
                gen[label]["home_bytes_after"] = folder_size(home)
            report["generate"] = gen

    if not args.skip_serve:
        report["serve"] = {}
        for name in models:
            model_dir = small_dir if name == "small" else None
            with tempfile.TemporaryDirectory(prefix="jaxserve-home-") as tmp:
                home = pathlib.Path(tmp)
                runs = {"model": model_dir, "completion_request": COMPLETION}
                report["serve"][name] = runs
                for label in ("cold", "warm"):
                    runs[label] = run_serve(model_dir, home, log_dir, name, label,
                                            args.timeout)
                    runs[label]["home_bytes_after"] = folder_size(home)

    print("\n" + table(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        log(f"wrote {args.json}")
    failed = [f"generate {label}" for label in ("cold", "warm")
              if not report.get("generate", {}).get(label, {"ok": True})["ok"]]
    failed += [f"serve {name} {label}" for name, runs in report.get("serve", {}).items()
               for label in ("cold", "warm") if not runs[label]["ok"]]
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
