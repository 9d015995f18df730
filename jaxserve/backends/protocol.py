"""The runner protocol: what the host engine needs from a device backend.

The host side (engine, scheduler, KV block manager, input builder, detokenizer, server)
imports neither jax nor torch; it drives one Runner, built by selection.create_runner:
backends/jax/runner.py's ModelRunner or backends/torch/runner.py's TorchRunner. A step is
dispatched (returning at once, so host work overlaps the device's) and fetched later:

    handle = runner.dispatch(scheduler_output, score_targets, grammar_masks)  # starts it
    result = runner.fetch(handle)                                # waits: a StepResult

Every runner pads the step to a (T, R) bucket of the same policy (SchedulerConfig.step_buckets)
and takes the same inputs (input_builder.StepInputBuilder). Shape letters as in
docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from jaxserve.config.kv_groups import KVGroups
from jaxserve.core.scheduler_output import SchedulerOutput


@dataclasses.dataclass
class StepResult:
    """Host copies of one step's outputs. sampled: per row (the first num_seqs valid), with
    numpy fields token_ids i32[R], logprobs f32[R] (of the sampled token, from the raw model
    distribution), ranks i32[R] (1 = most likely), top_ids i32[R, 20], top_logprobs
    f32[R, 20] (sampler.SampleResult's); prompt_scores: the same per token of the step, when
    prompt_logprobs was asked for."""

    sampled: Any
    prompt_scores: Any | None
    # i32[R] tokens each row emitted, when the engine speculates: then sampled's fields hold
    # W = 1 + num_speculative_tokens entries per row (row r's at r*W ..), the first
    # num_emitted[r] of them emitted. None: one token per row, sampled's fields are [R].
    num_emitted: Any | None = None
    # f32[R, X]: each row's pooled hidden states (a sum, or one token's; logits through a
    # classification head) on a pooling engine, when the step pooled any (core/pooling.py).
    pooled: Any | None = None


@dataclasses.dataclass(frozen=True)
class RunnerStats:
    """A runner's counters, read on the engine thread."""

    compilations: int  # XLA (or other) compilations in this process so far
    compiling: int  # functions being compiled right now
    warm_up_done: bool  # every bucket compiled (a background warm-up may still run)
    steps: int = 0
    token_padding: float = 0.0  # fraction of the buckets' token slots that were padding
    row_padding: float = 0.0


@dataclasses.dataclass
class PaddingStats:
    """How much of the compiled bucket shapes held real work, summed over steps."""

    steps: int = 0
    tokens: int = 0  # scheduled tokens
    token_slots: int = 0  # the T of each step's bucket
    rows: int = 0
    row_slots: int = 0

    def record(self, tokens: int, token_slots: int, rows: int, row_slots: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.token_slots += token_slots
        self.rows += rows
        self.row_slots += row_slots

    @property
    def token_padding(self) -> float:
        """Fraction of token slots that were padding."""
        return 1.0 - self.tokens / self.token_slots if self.token_slots else 0.0

    @property
    def row_padding(self) -> float:
        return 1.0 - self.rows / self.row_slots if self.row_slots else 0.0


class Runner(Protocol):
    """A device backend: the weights, the paged KV cache and the compiled step per bucket."""

    num_blocks: int  # KV blocks on each device, block 0 (the null block) included
    bytes_per_block: int  # KV bytes of one block on each device
    blocks_per_seq: int  # B: block-table width (max_model_len / block_size, rounded up)
    kv_groups: KVGroups  # the layers sharing block tables (config/kv_groups.py)

    def dispatch(self, out: SchedulerOutput, score_targets: np.ndarray | None = None,
                 grammar_masks: list[tuple[int, np.ndarray]] | None = None) -> Any:
        """Start one step and return a handle at once. score_targets: i32[total tokens], the
        token whose logprob to score at each position (-1: none), for prompt_logprobs.
        grammar_masks: (sampler row, i32[W] next-token bitmask) of each constrained request
        that samples in this step (SchedulerOutput.samples), for structured
        outputs."""

    def fetch(self, handle: Any) -> StepResult:
        """Wait for a dispatched step; its results."""

    def warm_up(self, background: bool = False) -> None:
        """Compile every bucket (background: the first now, the rest in a thread)."""

    def step_limits(self) -> tuple[int, int] | None:
        """(tokens, sequences) a step may hold while a background warm-up runs, else None."""

    def stats(self) -> RunnerStats: ...

    def close(self) -> None:
        """Stop background work and release other hosts."""

