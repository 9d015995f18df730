"""Host-side cost of one engine step, with the model replaced by a null step.

    python scripts/bench_host_overhead.py [--seqs 1 64 256] [--steps 200]

Runs the real LLMEngine.step (scheduling, input building and packing, output processing,
detokenization, output objects) with a runner that does the host work of a real step
(StepInputBuilder.build + pack) but returns made-up tokens instead of calling the device
(benchmarks/standin_runners.py). Each case first admits N requests and finishes their
prefill, then times decode steps with all N running. Prints microseconds per step (median
and p90 over the timed steps) in three modes:
- every: an output object per request per step, as the engine thread of a server that
  steps its engine on a thread (`--no-engine-process`);
- core: the engine core process's step (`jaxserve serve` on hosts of 4+ CPUs): no output
  objects, each step's news pickled as for the pipe (the front end's process builds the
  outputs, in parallel);
- final: LLM.generate (final outputs only).
every and final include the cost of the requests' final outputs (made once at the end,
when the text of deferred detokenization is produced), spread over the timed steps.
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np

from jaxserve import default_model_path
from jaxserve.benchmarks.standin_runners import NullRunner, PickleSink, start_decoding
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.core_process import EngineCore
from jaxserve.engine.llm_engine import LLMEngine


def measure(num_seqs: int, steps: int, mode: str) -> tuple[float, float]:
    """mode: every (an output per request per step, as the server's engine thread), final
    (LLM.generate), core (the engine core process's step: no outputs, the news pickled)."""
    model = str(default_model_path())
    config = EngineConfig.create(model, max_model_len=1024, max_num_seqs=max(num_seqs, 1),
                                 max_num_batched_tokens=max(2048, num_seqs),
                                 compilation_cache_dir=None, precompile=False)
    engine = LLMEngine(config, runner=NullRunner(config, config.model.vocab_size))
    core = EngineCore(engine, None, PickleSink()) if mode == "core" else None
    start_decoding(engine, num_seqs, steps + 64, prompt_len=64, core=core)
    step = core.step if core is not None else functools.partial(
        engine.step, final_only=mode == "final")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    assert len(engine.scheduler.running) == num_seqs
    # The final outputs (text of every request, detokenized then if it was deferred) are
    # part of the work, except in the core (the front end makes them): spread their cost
    # over the timed steps.
    start = time.perf_counter()
    for i in range(num_seqs):
        engine.abort_request(str(i), report=core is None)
    final = (time.perf_counter() - start) / steps
    return (float(np.median(times)) + final) * 1e6, (float(np.percentile(times, 90)) + final) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"{'running seqs':>14}{'outputs':>10}{'median us/step':>16}{'p90 us/step':>14}"
          f"{'us/seq':>10}")
    for n in args.seqs:
        for mode in ("every", "core", "final"):
            median, p90 = measure(n, args.steps, mode)
            print(f"{n:14d}{mode:>10}{median:16.0f}{p90:14.0f}{median / n:10.1f}")


if __name__ == "__main__":
    main()
