"""The PyTorch/Triton runner: the Runner protocol (backends/protocol.py) on one torch device.

For NVIDIA and AMD users whose stack is PyTorch: the host side (scheduler, KV block manager,
input builder, detokenizer, server) is the JAX backend's, unchanged; this runner holds the
torch model (models/torch/llama.py), the paged KV cache (per layer [P, S, K, H], written in
place) and the torch sampler (backends/torch/sampler.py), and runs each step on the same (T, R)
bucket and the same inputs (input_builder.StepInputBuilder) as the JAX runner:

    dispatch: inputs -> device, bias / grammar rows written, forward(batch) -> hidden [T, D],
              logits of each row's last token, penalty state updated, sample; prompt scores;
              a pooling engine's pooled rows (pooling.py, as the JAX backend's)
    fetch:    one wait, results to numpy (a StepResult)

On a GPU (CUDA or ROCm torch) attention is the Triton kernels of kernels_triton/ and the
forward pass of each bucket is captured once as a CUDA graph and replayed, so a step's host
cost stays flat however many layers the model has (MoE models run eagerly: their expert loop
reads the routing on the host). On the CPU everything runs eagerly with the PyTorch
reference attention, or with the Triton kernels in interpret mode
(attention_backend="triton-interpret", slow: for testing them end to end).

The runner's parts live beside it, under the JAX backend's module names where there is one:
the step's tensors (batch.py), the attention choice (attend.py), the model and its weights
(weights.py), the CUDA graphs (cuda_graphs.py), the pooled rows (pooling.py), the sampler
(sampler.py) and the quantized KV cache (kv_quant.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import torch

from jaxserve.backends.kv_formats import calibration_token_ids, is_quantized
from jaxserve.backends.protocol import PaddingStats, RunnerStats, StepResult
from jaxserve.backends.torch.attend import make_attend
from jaxserve.backends.torch.batch import (
    TorchBatch,
    batch_on,
    sampling_on,
    to_device,
    token_rows,
)
from jaxserve.backends.torch.cuda_graphs import GraphCache
from jaxserve.backends.torch.kv_quant import calibrate, value_dtype
from jaxserve.backends.torch.pooling import pool_rows
from jaxserve.backends.torch.sampler import (
    PenaltyState,
    SampleResult,
    StepFlags,
    sample,
    score_tokens,
    update_penalty_state,
)
from jaxserve.backends.torch.weights import build_model, log_weights, model_dtypes
from jaxserve.config import kv_sizing
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_groups import kv_groups_for
from jaxserve.core.input_builder import StepInputBuilder, build_step_inputs
from jaxserve.core.pooling import pool_inputs
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.models import model_family
from jaxserve.models.llama_arch import with_max_model_len

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class InFlightStep:
    result: SampleResult  # device tensors
    scores: SampleResult | None
    pooled: torch.Tensor | None = None  # f32[R, X], on a pooling engine


def torch_device() -> torch.device:
    """The GPU when torch sees one (CUDA, or ROCm through the same API), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _leave_a_core_to_the_host() -> None:
    """On the CPU, torch's intra-op threads spin-wait between ops; with every core taken, the
    engine's own threads (scheduling, detokenizing) preempt them and tiny ops take
    milliseconds (a 20x slower step measured on 2 cores). Keep one core for the host."""
    threads = max(1, (os.cpu_count() or 2) - 1)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
        logger.info("Torch on the CPU: %d intra-op threads (one core left to the engine).",
                    threads)


class TorchRunner:
    """A Runner (backends/protocol.py) on one torch device."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch_device()
        if self.device.type == "cpu":
            _leave_a_core_to_the_host()
        self.block_size = config.cache.block_size
        self.blocks_per_seq = kv_sizing.blocks_per_seq(config.model.max_model_len,
                                                       self.block_size)
        self.inputs = StepInputBuilder(config.scheduler.max_num_seqs, self.block_size,
                                       self.blocks_per_seq)
        # One group (kv_groups_for): a window on every layer (Mistral) frees blocks behind it
        self.kv_groups = kv_groups_for(config)
        hf = config.model.hf_config
        arch = with_max_model_len(model_family(hf).arch_from_hf(hf), config.model.max_model_len)
        self.arch = arch
        # Chosen first: a backend the device cannot run fails before the weights load.
        kv_cache_dtype = config.cache.kv_cache_dtype
        self.attend, attention_name, capturable = make_attend(
            config.attention.backend, self.device, arch.head_dim, kv_cache_dtype)
        logger.info("Torch backend on %s; attention: %s.", self.device, attention_name)
        self.dtype = model_dtypes(config.model.dtype)[0]
        with torch.no_grad():
            self.model = build_model(config, self.device)
        log_weights(config, self.model)
        self.penalty_state = PenaltyState.zeros(config.scheduler.max_num_seqs + 1,
                                                arch.vocab_size, self.device)
        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.cache_dtype = value_dtype(kv_cache_dtype, self.dtype)
        scales = self._calibrate_kv_scales() if is_quantized(kv_cache_dtype) else None
        self.kv_caches = [(torch.zeros(shape, dtype=self.cache_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.cache_dtype, device=self.device))
                          + (scales[i] if scales else ()) for i in range(arch.num_layers)]
        self.padding = PaddingStats()
        # CUDA graphs: the forward pass of each bucket, captured once. Only on a GPU with
        # the Triton kernels (the reference attention reads lengths on the host) and dense
        # models (the MoE loop reads the routing on the host).
        self.graphs = None
        if capturable and not getattr(arch, "num_experts", 0):
            self.graphs = GraphCache(self._forward, self._empty_batch,
                                     config.scheduler.step_buckets)
        self._warm = self.graphs is None

    # ---- sizing -------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return kv_sizing.device_bytes_per_block(self.config, self.kv_groups,
                                                self.arch.num_kv_heads, self.arch.head_dim)

    def _calibrate_kv_scales(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A quantized cache's (k_scale, v_scale) f32[K] per layer, from the model's keys
        and values on the calibration text (kv_formats.py)."""
        from jaxserve.inputs.tokenizer import load_tokenizer

        config = self.config
        ids = calibration_token_ids(load_tokenizer(config.model.tokenizer),
                                    self.arch.vocab_size, config.model.max_model_len)
        scales = calibrate(self.model, torch.from_numpy(ids).to(self.device),
                           self.arch.num_layers, self.arch.num_kv_heads,
                           config.cache.kv_cache_dtype)
        flat = torch.stack([torch.stack(pair) for pair in scales]).cpu()
        logger.info("KV cache: %s (%s values), scales per layer and kv head calibrated on %d "
                    "tokens: keys %.3g..%.3g, values %.3g..%.3g.", config.cache.kv_cache_dtype,
                    str(self.cache_dtype).removeprefix("torch."), len(ids),
                    flat[:, 0].min(), flat[:, 0].max(), flat[:, 1].min(), flat[:, 1].max())
        return scales

    def _num_kv_blocks(self) -> int:
        """kv_sizing's budget: on a GPU its memory x gpu_memory_utilization minus what is
        allocated (weights, sampler state), on the CPU the host default."""
        limit = in_use = None
        if self.device.type == "cuda":
            _, limit = torch.cuda.mem_get_info(self.device)
            in_use = torch.cuda.memory_allocated(self.device)
        return kv_sizing.device_blocks(self.config, self.kv_groups, self.bytes_per_block,
                                       device_limit=limit, in_use=in_use or 0)

    # ---- the Runner protocol ------------------------------------------------------------
    def warm_up(self, background: bool = False) -> None:
        """Capture every bucket's CUDA graph (on the CPU there is nothing to compile). A
        background warm-up captures them now too: capturing beside running steps would
        share their stream."""
        if self.graphs is not None:
            self.graphs.capture_all()
        self._warm = True

    def step_limits(self) -> tuple[int, int] | None:
        return None

    def stats(self) -> RunnerStats:
        padding = self.padding
        return RunnerStats(compilations=len(self.graphs.graphs) if self.graphs else 0,
                           compiling=0, warm_up_done=self._warm, steps=padding.steps,
                           token_padding=padding.token_padding,
                           row_padding=padding.row_padding)

    def close(self) -> None:
        """Nothing runs in the background."""

    @torch.no_grad()
    def dispatch(self, out: SchedulerOutput, score_targets: np.ndarray | None = None,
                 grammar_masks: list[tuple[int, np.ndarray]] | None = None) -> InFlightStep:
        """Launch one step (asynchronous on a GPU; on the CPU it runs here)."""
        num_tokens, num_rows = self.config.scheduler.pick_bucket(
            out.total_num_scheduled_tokens, len(out.requests))
        self.padding.record(out.total_num_scheduled_tokens, num_tokens, len(out.requests),
                            num_rows)
        batch_np, sampling_np = self.inputs.build(out, num_tokens, num_rows)
        flags = StepFlags.of(sampling_np, len(out.requests), self.arch.vocab_size)
        feed = batch_np["feed_slots"]
        batch = batch_on(batch_np, self.device)
        if feed.any():  # placeholders: the tokens the previous step sampled, on the device
            feed = self._put(feed).long()
            batch.token_ids = torch.where(feed > 0, self.penalty_state.last_tokens[feed],
                                          batch.token_ids)
        s = sampling_on(sampling_np, self.device)
        self._write_rows(out, grammar_masks or [])
        if self.graphs is not None:
            hidden = self.graphs.forward(batch, num_tokens, num_rows)
        else:
            hidden = self._forward(batch)  # [T, D]
        logits = self.model.logits(hidden[batch.logits_indices.long()])  # f32[R, V]
        if flags.penalties:
            seq, valid = token_rows(batch_np, num_tokens)
            update_penalty_state(self.penalty_state, batch.token_ids, batch.positions, s,
                                 self._put(seq).long(), self._put(valid))
        result = sample(logits, self.penalty_state, s, flags)
        # Each row's token for a later step's placeholder (padding rows write row 0).
        self.penalty_state.last_tokens[s.state_slots.long()] = result.token_ids.to(
            torch.int32)
        scores = None
        if score_targets is not None:
            targets = np.zeros(num_tokens, np.int32)
            targets[: len(score_targets)] = np.maximum(score_targets, 0)
            scores = score_tokens(self.model.logits(hidden), self._put(targets))
        pooler = self.config.pooler
        rows = None if pooler is None else pool_inputs(out, num_tokens, num_rows,
                                                       pooler.pooling_type)
        pooled = None if rows is None else pool_rows(self.model, hidden, self._put(rows).long(),
                                                     pooler.pooling_type, pooler.applies_head)
        return InFlightStep(result, scores, pooled)

    def fetch(self, step: InFlightStep) -> StepResult:
        """Wait for a dispatched step; its results as numpy arrays."""
        scores = step.scores.to_host() if step.scores is not None else None
        pooled = step.pooled.cpu().numpy() if step.pooled is not None else None
        return StepResult(step.result.to_host(), scores, pooled=pooled)

    # ---- helpers ------------------------------------------------------------------------
    def _put(self, value: np.ndarray) -> torch.Tensor:
        return to_device(value, self.device)

    def _forward(self, batch: TorchBatch) -> torch.Tensor:
        """The model's forward pass over the runner's KV caches: hidden [T, D]."""
        return self.model(self.kv_caches, batch, self.attend)

    def _empty_batch(self, num_tokens: int, num_rows: int) -> TorchBatch:
        """The batch of a (T, R) step with no rows (the CUDA graphs' inputs)."""
        batch_np, _ = build_step_inputs(SchedulerOutput([], [], []), num_tokens, num_rows,
                                        self.block_size, self.blocks_per_seq)
        return batch_on(batch_np, self.device)

    def _write_rows(self, out: SchedulerOutput, grammar_masks: list) -> None:
        """The logit-bias rows of requests that get their sampler row this step, and the
        grammar bitmasks of the constrained rows that sample in it."""
        state, vocab = self.penalty_state, self.arch.vocab_size
        for row in out.new_rows:
            req = out.requests[row]
            if req.constraints is not None and req.constraints.has_row:
                state.logit_bias[req.state_slot] = self._put(req.constraints.row(vocab))
        if grammar_masks:
            rows = self._put(np.asarray([row for row, _ in grammar_masks], np.int64))
            masks = self._put(np.stack([mask for _, mask in grammar_masks]).astype(np.int32))
            state.grammar_mask[rows] = masks

