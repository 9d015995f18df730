"""Host-side cost of one engine step, with the model replaced by a null step.

    python scripts/bench_host_overhead.py [--seqs 1 64 256] [--steps 200]

Runs the real LLMEngine.step (scheduling, input building and packing, output processing,
detokenization, output objects) with a runner that does the host work of a real step
(StepInputBuilder.build + pack) but returns made-up tokens instead of calling the device
(benchmarks/standin_runners.py). Each case first admits N requests and finishes their
prefill, then times decode steps with all N running. Prints microseconds per step (median
and p90 over the timed steps), as the server runs it (an output object per request per
step) and as LLM.generate runs it (final outputs only). Both include the cost of the
requests' final outputs (made once at the end, when the text of deferred detokenization is
produced), spread over the timed steps.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxserve import default_model_path
from jaxserve.benchmarks.standin_runners import NullRunner, start_decoding
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine


def measure(num_seqs: int, steps: int, final_only: bool) -> tuple[float, float]:
    model = str(default_model_path())
    config = EngineConfig.create(model, max_model_len=1024, max_num_seqs=max(num_seqs, 1),
                                 max_num_batched_tokens=max(2048, num_seqs),
                                 compilation_cache_dir=None, precompile=False)
    engine = LLMEngine(config, runner=NullRunner(config, config.model.vocab_size))
    start_decoding(engine, num_seqs, steps + 64, prompt_len=64)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step(final_only=final_only)
        times.append(time.perf_counter() - start)
    assert len(engine.scheduler.running) == num_seqs
    # The final outputs (text of every request, detokenized then if it was deferred) are
    # part of the work: spread their cost over the timed steps.
    start = time.perf_counter()
    for i in range(num_seqs):
        engine.abort_request(str(i))
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
        for final_only in (False, True):
            median, p90 = measure(n, args.steps, final_only)
            kind = "final" if final_only else "every"
            print(f"{n:14d}{kind:>10}{median:16.0f}{p90:14.0f}{median / n:10.1f}")


if __name__ == "__main__":
    main()
