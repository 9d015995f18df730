"""Start a real `jaxserve serve` process on a free loopback port, for server tests."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx

JAXSERVE = pathlib.Path(sys.executable).parent / "jaxserve"
# Small buckets: start-up compiles 7 step shapes (cached on disk after the first run). The
# offline tests that need every bucket use the same shape (SMALL_ENGINE_ARGS), so that the
# executable cache serves one set of compiles to all of them.
SMALL_ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512)
SMALL_ENGINE = [arg for name, value in SMALL_ENGINE_ARGS.items()
                for arg in ("--" + name.replace("_", "-"), str(value))]
# The shared server's --request-read-timeout (conftest.api_server): short, so that tests of
# stalled requests finish quickly.
SHARED_READ_TIMEOUT = 2.0


@dataclasses.dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: pathlib.Path
    grpc_port: int | None = None  # --grpc-port, when started with grpc=True

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, never one this process handed out before: the
    kernel may give a just-closed port again, and a server started with two of them (HTTP and
    gRPC) would then fail to bind its second."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@contextlib.contextmanager
def running_server(model, *args: str, log_dir: pathlib.Path, ready_timeout: float = 240.0,
                   wait_for: str = "/ready", grpc: bool = False):
    """Yield a Server once wait_for answers 200 (/ready: every bucket compiled; /health: it
    takes requests, the warm-up may still run); SIGTERM it (then kill) on exit. grpc: also
    serve gRPC (--grpc-port, on a free port of its own)."""
    port = free_port()
    grpc_port = free_port() if grpc else None
    log_path = log_dir / f"server-{port}.log"
    cmd = [str(JAXSERVE), "serve", "--model", str(model), "--port", str(port),
           "--served-model-name", "tiny", *SMALL_ENGINE, *args,
           *(["--grpc-port", str(grpc_port)] if grpc else [])]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(f"http://127.0.0.1:{port}", process, log_path, grpc_port)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
            try:
                if httpx.get(f"{server.url}{wait_for}", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {ready_timeout} s:\n{server.log()}")
            time.sleep(0.25)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
