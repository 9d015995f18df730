"""How busy the engine keeps a device whose step takes a fixed time, with asynchronous
scheduling on and off: offline (LLM.generate's final-only steps) and through the HTTP server
with streaming clients.

    python scripts/bench_async_scheduling.py [--seqs 16 64 256] [--device-ms 2 5 10]
                                             [--steps 200] [--window 2] [--no-server]
                                             [--no-offline] [--pin-core]

The model is replaced by benchmarks/standin_runners.py's TimedRunner: the host half of a real
step (input building and packing) and a device that takes --device-ms per step, steps
queued in dispatch order, fetch sleeping (releasing the GIL) until the step is done. Each
case keeps N sequences decoding (the built-in model's tokenizer and config, random tokens)
and reports achieved steps/s against the ideal 1 / device time, and the engine thread's
time per step by stage (HostTimes: schedule, prepare, wait, fold, outputs; all but wait is
host work). Offline: --steps steps of LLMEngine.step(final_only=True) after the prefill.
Server: `jaxserve serve`'s app (uvicorn in a thread of this process) with N streaming
/v1/completions clients in another process; steps counted over --window seconds once all N
run. "server" steps the engine in an engine core process, as `jaxserve serve` does (its
host times are the core's); "thread" steps it on a thread of the server's process
(`--no-engine-process`). --pin-core gives the core a CPU of its own (the HTTP side and the
clients share the others), as on a host with CPUs to spare.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import subprocess
import sys
import threading
import time

from jaxserve import default_model_path
from jaxserve.benchmarks.local_server import free_port
from jaxserve.benchmarks.standin_runners import TimedRunner, start_decoding
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.core_client import EngineCoreClient
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.stats import STAGES


def _engine(num_seqs: int, device_ms: float, async_scheduling: bool) -> LLMEngine:
    config = EngineConfig.create(str(default_model_path()), max_model_len=2048,
                                 max_num_seqs=num_seqs, max_num_batched_tokens=max(512, num_seqs),
                                 compilation_cache_dir=None, precompile=False,
                                 async_scheduling=async_scheduling)
    runner = TimedRunner(config, config.model.vocab_size, device_ms / 1e3)
    return LLMEngine(config, runner=runner)


def offline(num_seqs: int, device_ms: float, steps: int, async_scheduling: bool):
    engine = _engine(num_seqs, device_ms, async_scheduling)
    start_decoding(engine, num_seqs, steps + 64, prompt_len=32)
    before = dict(engine.host_times.seconds), engine.host_times.steps
    start = time.perf_counter()
    for _ in range(steps):
        engine.step(final_only=True)
    elapsed = time.perf_counter() - start
    return _report(engine, before, steps / elapsed, device_ms)


def _report(engine: LLMEngine, before, steps_per_s: float, device_ms: float):
    seconds, count = before
    done = engine.host_times.steps - count
    stages = {s: (engine.host_times.seconds[s] - seconds[s]) / max(done, 1) * 1e3
              for s in STAGES}
    return steps_per_s, steps_per_s * device_ms / 1e3, stages


def server(num_seqs: int, device_ms: float, window: float, async_scheduling: bool,
           engine_process: bool, pin_core: bool = False):
    import uvicorn

    # Not a line per request: the clients are aborted (disconnected) at the end.
    logging.getLogger("jaxserve.server").setLevel(logging.WARNING)

    from jaxserve.server.app import ServerConfig, create_app
    from jaxserve.server.async_engine import AsyncLLMEngine
    from jaxserve.server.launch import uvicorn_config

    if engine_process:  # as `jaxserve serve` runs it; the client mirrors the core's HostTimes
        engine = EngineCoreClient(_engine, (num_seqs, device_ms, async_scheduling),
                                  log_level="WARNING")
    else:
        engine = _engine(num_seqs, device_ms, async_scheduling)
    gc.collect()
    gc.freeze()  # as `jaxserve serve` does after start-up
    cpus = os.sched_getaffinity(0)
    if pin_core:  # the core gets the last CPU; the HTTP side and the clients the others
        last = max(cpus)
        if engine_process:
            os.sched_setaffinity(engine.pid, {last})
        os.sched_setaffinity(0, cpus - {last})
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()
    port = free_port()
    server_config = ServerConfig(served_model_name="standin", host="127.0.0.1", port=port,
                                 uvicorn_log_level="warning", access_log=False)
    app = create_app(async_engine, server_config)
    uv = uvicorn.Server(uvicorn_config(app, server_config))  # as `serve` runs it
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    # Enough to outlast the window (within max_model_len, less the 4-token prompt).
    max_tokens = min(int(window * 1e3 / device_ms * 3) + 200, 2040)
    clients = subprocess.Popen([sys.executable, "-m", "jaxserve.benchmarks.stream_clients",
                                f"http://127.0.0.1:{port}", str(num_seqs), str(max_tokens)],
                               stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while async_engine.stats.running < num_seqs:  # every stream admitted and running
            if time.monotonic() > deadline or clients.poll() is not None:
                raise RuntimeError("the streaming clients did not all start")
            time.sleep(0.01)
        time.sleep(0.2)
        before = dict(engine.host_times.seconds), engine.host_times.steps
        start = time.perf_counter()
        time.sleep(window)
        steps = engine.host_times.steps - before[1]
        elapsed = time.perf_counter() - start
        return _report(engine, before, steps / elapsed, device_ms)
    finally:
        clients.kill()
        clients.wait()
        uv.should_exit = True
        thread.join(10)
        async_engine.stop()
        engine.close()
        os.sched_setaffinity(0, cpus)
        gc.unfreeze()  # this engine may go now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--device-ms", type=float, nargs="+", default=[2.0, 5.0, 10.0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=float, default=2.0)
    parser.add_argument("--no-server", action="store_true")
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--pin-core", action="store_true",
                        help="server: run the engine core on a CPU of its own (the last one), "
                        "the HTTP side and the clients on the others, as on a host with CPUs "
                        "to spare; the thread rows then get one CPU fewer")
    args = parser.parse_args()
    header = (f"{'where':>8}{'async':>7}{'seqs':>6}{'device ms':>10}{'steps/s':>9}"
              f"{'of ideal':>9}  host ms per step: " + " ".join(f"{s:>8}" for s in STAGES))
    print(header)
    places = ([] if args.no_offline else ["offline"]) + (
        [] if args.no_server else ["server", "thread"])
    for where in places:
        for num_seqs in args.seqs:
            for device_ms in args.device_ms:
                for on in (True, False):
                    if where == "offline":
                        rate, ratio, stages = offline(num_seqs, device_ms, args.steps, on)
                    else:
                        rate, ratio, stages = server(num_seqs, device_ms, args.window, on,
                                                     where == "server", args.pin_core)
                    print(f"{where:>8}{'on' if on else 'off':>7}{num_seqs:6d}{device_ms:10.1f}"
                          f"{rate:9.1f}{ratio:9.2f}  {'':17}"
                          + " ".join(f"{stages[s]:8.3f}" for s in STAGES), flush=True)


if __name__ == "__main__":
    main()
