"""Runners that stand in for the device, for the benchmarks of the engine's host side.

NullRunner does the host half of a real runner's dispatch (StepInputBuilder.build and
pack: what ModelRunner.dispatch does before it launches the step) and returns random
tokens at once. TimedRunner adds a device that takes a fixed time per step: steps queue on
it in dispatch order, as on an accelerator, and fetch sleeps (releasing the GIL, as a real
runner does while it waits for the device) until the fetched step has finished. Its busy
fraction is then what an accelerator would get from the engine's host work.
"""

from __future__ import annotations

import time

import numpy as np

from jaxserve.backends.jax.sampler import SampleResult
from jaxserve.backends.protocol import RunnerStats, StepResult
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_groups import KVGroups
from jaxserve.core.input_builder import StepInputBuilder
from jaxserve.core.scheduler_output import SchedulerOutput


class NullRunner:
    """The host half of ModelRunner.dispatch / fetch; the device half returns random tokens
    (5 .. vocab - 1: never a special token)."""

    def __init__(self, config: EngineConfig, vocab: int) -> None:
        self.config = config
        self.block_size = config.cache.block_size
        self.blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        self.num_blocks = config.scheduler.max_num_seqs * self.blocks_per_seq + 1
        self.bytes_per_block = 1
        self.kv_groups = KVGroups.single(1)
        self.inputs = StepInputBuilder(config.scheduler.max_num_seqs, self.block_size,
                                       self.blocks_per_seq)
        self.vocab = vocab
        self.rng = np.random.default_rng(0)

    def warm_up(self, background: bool = False) -> None:
        pass

    def step_limits(self) -> None:
        return None

    def fetch(self, result):
        return result

    def stats(self) -> RunnerStats:
        return RunnerStats(compilations=0, compiling=0, warm_up_done=True)

    def close(self) -> None:
        pass

    def dispatch(self, out: SchedulerOutput, score_targets=None,
                 grammar_masks=None) -> StepResult:
        sched = self.config.scheduler
        num_tokens, num_rows = sched.pick_bucket(out.total_num_scheduled_tokens,
                                                 len(out.requests))
        self.inputs.build_packed(out, num_tokens, num_rows)
        tokens = self.rng.integers(5, self.vocab, num_rows).astype(np.int32)
        zeros = np.zeros(num_rows, np.float32)
        top = np.zeros((num_rows, 20), np.int32)
        return StepResult(SampleResult(tokens, zeros, zeros.astype(np.int32) + 1, top,
                                       top.astype(np.float32)), None)


class TimedRunner(NullRunner):
    """NullRunner on a device whose every step takes device_seconds."""

    def __init__(self, config: EngineConfig, vocab: int, device_seconds: float) -> None:
        super().__init__(config, vocab)
        self.device_seconds = device_seconds
        self._free_at = 0.0  # when the device finishes the last step dispatched

    def dispatch(self, out: SchedulerOutput, score_targets=None, grammar_masks=None):
        result = super().dispatch(out, score_targets, grammar_masks)
        start = max(time.perf_counter(), self._free_at)  # queued behind the last step
        self._free_at = start + self.device_seconds
        return result, self._free_at

    def fetch(self, handle) -> StepResult:
        result, done = handle
        delay = done - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return result


def start_decoding(engine, num_seqs: int, max_tokens: int, prompt_len: int,
                   core=None) -> None:
    """Admit num_seqs requests of random prompt_len-token prompts (sampled at temperature
    0.8, EOS ignored) and step until every one has its first token: all of them decode.
    core: an engine.core_process.EngineCore of the engine, to add and step through."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True)
    rng = np.random.default_rng(1)
    for i in range(num_seqs):
        ids = rng.integers(5, 4000, prompt_len).tolist()
        if core is None:
            engine.add_request(str(i), None, ids, params)
        else:
            core.add(engine.processor.process(str(i), None, ids, params))
    scheduler = engine.scheduler
    while any(r.num_output_tokens == 0 for r in
              list(scheduler.running) + list(scheduler.waiting)):
        if core is None:
            engine.step(final_only=True)
        else:
            core.step()


class PickleSink:
    """Where an EngineCore's messages go in a benchmark: pickled as a pipe would, and
    dropped."""

    def send(self, message) -> None:
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler.dumps(message)
