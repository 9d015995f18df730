"""The PyTorch/Triton runner: the Runner protocol (backends/protocol.py) on one torch device.

For NVIDIA and AMD users whose stack is PyTorch: the host side (scheduler, KV block manager,
input builder, detokenizer, server) is the JAX backend's, unchanged; this runner holds the
torch model (models/torch/llama.py), the paged KV cache (per layer [P, S, K, H], written in
place) and the torch sampler (backends/torch/sampler.py), and runs each step on the same (T, R)
bucket and the same inputs (input_builder.StepInputBuilder) as the JAX runner:

    dispatch: inputs -> device, bias / grammar rows written, forward(batch) -> hidden [T, D],
              logits of each row's last token, penalty state updated, sample; prompt scores;
              a pooling engine's pooled rows (pool_rows, the JAX runner's pooling.py)
    fetch:    one wait, results to numpy (a StepResult)

On a GPU (CUDA or ROCm torch) attention is the Triton kernels of kernels_triton/ and the
forward pass of each bucket is captured once as a CUDA graph and replayed, so a step's host
cost stays flat however many layers the model has (MoE models run eagerly: their expert loop
reads the routing on the host). On the CPU everything runs eagerly with the PyTorch
reference attention, or with the Triton kernels in interpret mode
(attention_backend="triton-interpret", slow: for testing them end to end).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import ml_dtypes
import numpy as np
import torch

from jaxserve.backends.checkpoint import parameter_values
from jaxserve.backends.kv_formats import calibration_token_ids, is_quantized
from jaxserve.backends.protocol import PaddingStats, RunnerStats, StepResult
from jaxserve.backends.torch.kv_quant import calibrate, quantized_attend, value_dtype
from jaxserve.backends.torch.sampler import (
    PenaltyState,
    SampleResult,
    StepFlags,
    sample,
    score_tokens,
    update_penalty_state,
)
from jaxserve.config import kv_sizing
from jaxserve.config.engine_config import TORCH_ATTENTION_BACKENDS, EngineConfig
from jaxserve.config.kv_groups import kv_groups_for
from jaxserve.core.input_builder import StepInputBuilder, build_step_inputs
from jaxserve.core.pooling import pool_inputs
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.kernels_triton import ref
from jaxserve.models import model_family
from jaxserve.models.llama_arch import with_max_model_len
from jaxserve.models.torch.gemma import GemmaForCausalLM
from jaxserve.models.torch.llama import LlamaForCausalLM
from jaxserve.models.torch.quantized import component_names, fill_dummy_component

logger = logging.getLogger(__name__)

_DTYPES = {"float32": (torch.float32, np.float32),
           "bfloat16": (torch.bfloat16, ml_dtypes.bfloat16),
           "float16": (torch.float16, np.float16)}
_BATCH_FIELDS = ("token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens",
                 "block_tables", "num_seqs", "logits_indices")


@dataclasses.dataclass
class TorchBatch:
    """batch.Batch's fields as int32 torch tensors on the runner's device."""

    token_ids: torch.Tensor  # i32[T]
    positions: torch.Tensor  # i32[T]
    slot_mapping: torch.Tensor  # i32[T]
    cu_q_lens: torch.Tensor  # i32[R+1]
    kv_lens: torch.Tensor  # i32[R]
    block_tables: torch.Tensor  # i32[R, B]
    num_seqs: torch.Tensor  # i32[1]
    logits_indices: torch.Tensor  # i32[R]


@dataclasses.dataclass
class InFlightStep:
    result: SampleResult  # device tensors
    scores: SampleResult | None
    pooled: torch.Tensor | None = None  # f32[R, X], on a pooling engine


def torch_device() -> torch.device:
    """The GPU when torch sees one (CUDA, or ROCm through the same API), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def make_attend(backend: str, device: torch.device, head_dim: int,
                kv_cache_dtype: str = "auto"):
    """attend(q, k, v, kv_cache, batch, *, scale, sliding_window, soft_cap) -> out [T, N, H]
    for the models: writes the layer's new K/V into its cache in place, then attends (a quantized
    cache's layers bring their scales: kv_quant.quantized_attend); the name of the
    implementation for the log; and whether a CUDA graph can capture it (the compiled
    Triton kernels read nothing on the host). ValueError for a backend this device cannot
    run."""
    if backend not in TORCH_ATTENTION_BACKENDS:
        raise ValueError(f"The torch backend's attention_backend is one of "
                         f"{', '.join(TORCH_ATTENTION_BACKENDS)}; got {backend!r} (a JAX "
                         "backend choice).")
    on_gpu = device.type == "cuda"
    if backend == "triton" and not on_gpu:
        raise ValueError("attention_backend='triton' needs a GPU that torch can see; on the "
                         "CPU use 'triton-interpret' (the Triton kernels in interpret mode, "
                         "slow), 'reference' or 'auto'.")
    use_triton = backend in ("triton", "triton-interpret") or (backend == "auto" and on_gpu)
    if use_triton:
        try:
            from jaxserve.kernels_triton import attention, kv_write
        except ImportError as err:
            raise ImportError(f"attention_backend={backend!r} needs Triton: pip install "
                              f"triton ({err})") from None

        if not attention.supports(head_dim):
            if backend != "auto":
                raise ValueError(f"The Triton kernels need a power-of-two head_dim >= 16; this "
                                 f"model has {head_dim}. Use attention_backend='reference' or "
                                 "'auto'.")
            logger.info("Attention: the Triton kernels cannot tile head_dim %d.", head_dim)
            use_triton = False
    if not use_triton:
        write, attend_fn = ref.write_kv, ref.ragged_paged_attention
        name, capturable = "the PyTorch reference (kernels_triton/ref.py)", False
    else:
        interpret = backend == "triton-interpret"
        write = functools.partial(kv_write.write_kv, interpret=interpret)
        attend_fn = functools.partial(attention.ragged_paged_attention, interpret=interpret)
        mode = "in Triton interpret mode (slow)" if interpret else "compiled"
        name = f"the Triton kernels (kernels_triton/), {mode}"
        capturable = on_gpu and not interpret
    if is_quantized(kv_cache_dtype):
        return quantized_attend(write, attend_fn), name, capturable

    def attend(q, k, v, kv_cache, batch, *, scale, sliding_window=None, soft_cap=None):
        write(*kv_cache, k, v, batch.slot_mapping)
        return attend_fn(q, *kv_cache, batch, scale=scale, sliding_window=sliding_window,
                         soft_cap=soft_cap)

    return attend, name, capturable


def _leave_a_core_to_the_host() -> None:
    """On the CPU, torch's intra-op threads spin-wait between ops; with every core taken, the
    engine's own threads (scheduling, detokenizing) preempt them and tiny ops take
    milliseconds (a 20x slower step measured on 2 cores). Keep one core for the host."""
    threads = max(1, (os.cpu_count() or 2) - 1)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
        logger.info("Torch on the CPU: %d intra-op threads (one core left to the engine).",
                    threads)


_BIT_VIEWS = {np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16),
              np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn)}


def _to_torch(value: np.ndarray) -> torch.Tensor:
    """A host array as a torch tensor (bfloat16 and float8 e4m3 through their bits: numpy
    has neither)."""
    value = np.ascontiguousarray(value).reshape(value.shape)  # 0-d stays 0-d
    if value.dtype in _BIT_VIEWS:
        bits, dtype = _BIT_VIEWS[value.dtype]
        return torch.from_numpy(value.view(bits)).view(dtype)
    return torch.from_numpy(value)


def _path(name: str) -> tuple:
    """A torch parameter name as the checkpoint loader's path ("layers.3.attn.wq" ->
    ("layers", 3, "attn", "wq"))."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def build_model(config: EngineConfig, device: torch.device) -> torch.nn.Module:
    """The torch model of config with its weights on `device`: read from the checkpoint one
    parameter at a time (checkpoint.parameter_values, as the JAX runner), or random
    (load_format="dummy": uniform in [-1e-3, 1e-3], as vLLM's dummy weights). A checkpoint
    published quantized (config.model.weights_scheme, a LinearQuant) builds the kernels it
    covers as their stored components (models/torch/quantized.py), loaded as stored."""
    hf = config.model.hf_config
    family = model_family(hf)
    arch = with_max_model_len(family.arch_from_hf(hf), config.model.max_model_len)
    dtype, np_dtype = _DTYPES[config.model.dtype]
    model_cls = GemmaForCausalLM if family.name == "gemma" else LlamaForCausalLM
    scheme = config.model.weights_scheme  # None or the checkpoint's LinearQuant on torch
    with torch.device("meta"):
        model = model_cls(arch, dtype, quantization=scheme)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    model.init_rope(device)
    if config.model.load_format == "dummy":
        generator = torch.Generator(device=device).manual_seed(config.model.seed)
        components = component_names(model)
        for name, param in params.items():
            if name in components:
                fill_dummy_component(param, name.rpartition(".")[2], generator)
            else:
                param.uniform_(-1e-3, 1e-3, generator=generator)
        return model.eval()
    # Every parameter's path, a quantized kernel's components under the kernel's path.
    shapes = {_path(name): tuple(p.shape) for name, p in params.items()}
    by_path = {_path(name): p for name, p in params.items()}
    path_of = lambda name: family.param_path(name, arch)
    for path, value in parameter_values(config.model.model, path_of, shapes, np_dtype,
                                        scheme):
        by_path[path].copy_(_to_torch(value))
    return model.eval()


def _log_weights(config: EngineConfig, model: torch.nn.Module) -> None:
    """The weight bytes the device holds, and the checkpoint's scheme when quantized."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    label = config.model.weights_label
    logger.info("Weights: %.2f MiB%s.", held / 2**20, f" ({label})" if label else "")


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
        self.dtype = _DTYPES[config.model.dtype][0]
        with torch.no_grad():
            self.model = build_model(config, self.device)
        _log_weights(config, self.model)
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
        self.graphs = GraphCache(self) if capturable and not getattr(arch, "num_experts", 0) \
            else None
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
        feed = batch_np.pop("feed_slots")
        batch = TorchBatch(**{k: self._put(v) for k, v in batch_np.items()})
        if feed.any():  # placeholders: the tokens the previous step sampled, on the device
            feed = self._put(feed).long()
            batch.token_ids = torch.where(feed > 0, self.penalty_state.last_tokens[feed],
                                          batch.token_ids)
        s = {k: self._put(v) for k, v in sampling_np.items()}
        self._write_rows(out, grammar_masks or [])
        if self.graphs is not None:
            hidden = self.graphs.forward(batch, num_tokens, num_rows)
        else:
            hidden = self.model(self.kv_caches, batch, self.attend)  # [T, D]
        logits = self.model.logits(hidden[batch.logits_indices.long()])  # f32[R, V]
        if flags.penalties:
            seq, valid = token_rows(batch_np, num_tokens)
            update_penalty_state(self.penalty_state, batch.token_ids, batch.positions, s,
                                 self._put(seq).long(), self._put(valid))
        result = sample(logits, self.penalty_state, s, flags)
        # Each row's token for a later step's placeholder (padding rows write row 0).
        self.penalty_state.last_tokens[s["state_slots"].long()] = result.token_ids.to(
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
        """A host input on the device; bool stays bool, uint32 travels as its int32 bits."""
        if value.dtype == np.uint32:
            value = value.view(np.int32)
        return torch.from_numpy(np.ascontiguousarray(value)).to(self.device, non_blocking=True)

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


def pool_rows(model, hidden: torch.Tensor, rows: torch.Tensor, pooling_type: str,
              head: bool) -> torch.Tensor:
    """The JAX runner's pooling function (backends/jax/pooling.py) in torch: hidden [T, D],
    rows i64[T + R] (core/pooling.py's pool_inputs) -> f32[R, X]."""
    num_tokens = hidden.shape[0]
    num_rows = rows.shape[0] - num_tokens
    if pooling_type == "MEAN":  # each row's tokens summed; tokens of row R (padding) dropped
        sums = torch.zeros(num_rows + 1, hidden.shape[1], dtype=torch.float32,
                           device=hidden.device)
        pooled = sums.index_add_(0, rows[:num_tokens], hidden.float())[:num_rows]
    else:
        pooled = hidden[rows[num_tokens:]].float()
    return model.classify(pooled) if head else pooled


def token_rows(batch: dict, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(row i64[T], real bool[T]) of each token of a step's host batch arrays."""
    cu = batch["cu_q_lens"]
    num_seqs = int(batch["num_seqs"][0])
    tok = np.arange(num_tokens)
    seq = np.minimum(np.searchsorted(cu[1:], tok, side="right"), len(cu) - 2)
    return seq.astype(np.int64), tok < cu[num_seqs]


class GraphCache:
    """The forward pass of each (T, R) bucket as a CUDA graph over static input tensors:
    captured on first use or by warm_up, then replayed after copying a step's batch into
    its inputs. The KV caches and weights are the runner's own tensors, so a replay
    writes the live cache in place."""

    def __init__(self, runner: TorchRunner) -> None:
        self.runner = runner
        self.graphs: dict[tuple[int, int], tuple] = {}  # bucket -> (graph, inputs, hidden)
        self.pool = None

    def capture_all(self) -> None:
        from jaxserve.config.progress import progress

        buckets = self.runner.config.scheduler.step_buckets
        start = time.perf_counter()
        for num_tokens, num_rows in progress(buckets, desc="Capturing CUDA graphs",
                                             unit="bucket"):
            self._capture(num_tokens, num_rows)
        logger.info("Captured %d CUDA graphs in %.1f s.", len(buckets),
                    time.perf_counter() - start)

    def forward(self, batch: TorchBatch, num_tokens: int, num_rows: int) -> torch.Tensor:
        graph, inputs, hidden = self._capture(num_tokens, num_rows)
        for field in _BATCH_FIELDS:
            getattr(inputs, field).copy_(getattr(batch, field), non_blocking=True)
        graph.replay()
        return hidden

    @torch.no_grad()
    def _capture(self, num_tokens: int, num_rows: int):
        key = (num_tokens, num_rows)
        if key in self.graphs:
            return self.graphs[key]
        runner = self.runner
        empty = SchedulerOutput([], [], [])
        batch_np, _ = build_step_inputs(empty, num_tokens, num_rows, runner.block_size,
                                        runner.blocks_per_seq)
        batch_np.pop("feed_slots")
        inputs = TorchBatch(**{k: runner._put(v).clone() for k, v in batch_np.items()})
        # An empty batch writes only into the null block 0: safe to run on the live cache.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the Triton kernels before the capture
                runner.model(runner.kv_caches, inputs, runner.attend)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = runner.model(runner.kv_caches, inputs, runner.attend)
        self.pool = graph.pool()
        self.graphs[key] = (graph, inputs, hidden)
        return self.graphs[key]
