"""Model runner: owns the weights, the paged KV cache and the compiled step per (T, R) bucket.

The step is one jitted function, compiled for every bucket at start-up:

    step(params, kv_caches, penalty_state, packed_inputs)
        -> (kv_caches, penalty_state, hidden, packed_sample_result)

It is DESIGN.md's step(params, kv_caches, batch, sampling) with two additions: the Batch and
SamplingInputs travel packed into one int32 buffer (one host-to-device transfer; unpacked
inside by static slices, see packing.py), and the penalty state (per-request token counts)
rides along with the KV cache. kv_caches and penalty_state are donated, so both are updated
in place. hidden (the final hidden states, [T, D]) stays on the device for prompt_logprobs.
Every device array is placed through the engine's Mesh (one device by default).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxserve.accelerators import warn_if_cpu_fallback
from jaxserve.attend import attention_for, make_attend
from jaxserve.batch import Batch, SamplingInputs
from jaxserve.compilation import record_compile, record_load
from jaxserve.config import EngineConfig
from jaxserve.distributed import StepChannel, is_leader
from jaxserve.executable_cache import executable_cache_for
from jaxserve.input_builder import build_step_inputs
from jaxserve.kernels_pallas import ref
from jaxserve.kernels_pallas.ref import token_layout
from jaxserve.mesh import (
    AXES,
    KV_CACHE_SPEC,
    MODEL,
    ModelDims,
    check_devices,
    param_spec,
    plan_sharding,
)
from jaxserve.models import model_family
from jaxserve.models.mixtral import expert_parallel
from jaxserve.packing import Layout, layout_of, pack, pack_device, unpack, unpack_host
from jaxserve.sampler import (
    PenaltyState,
    SampleResult,
    sample,
    score_tokens,
    update_penalty_state,
    uses_penalties,
)
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.scheduler import SchedulerOutput
from jaxserve.weights import load_params, place, random_params

logger = logging.getLogger(__name__)

_DTYPES = {"float32": (jnp.float32, np.float32), "bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16),
           "float16": (jnp.float16, np.float16)}
_CPU_KV_BYTES = 1 << 30
_BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(Batch))


@dataclasses.dataclass
class StepResult:
    """Host copies of one step's outputs, for the scheduled requests only."""

    sampled: SampleResult  # numpy fields, first num_seqs rows valid
    prompt_scores: SampleResult | None  # per token of the step, when prompt_logprobs was asked


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


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step: device arrays not yet waited for."""

    result: jax.Array  # packed SampleResult
    scores: jax.Array | None  # packed prompt scores, when asked for
    num_tokens: int  # the step's (T, R) bucket
    num_rows: int


# Functions compiled at once by a warm-up: XLA compiles in parallel and releases the GIL,
# so half the host's cores (at most 8) shorten a warm-up without starving the engine.
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


def replica_mesh(config: EngineConfig, rank: int = 0) -> Mesh:
    """The (1, model) mesh of data-parallel replica `rank`: the rank-th run of `model`
    devices. Checks first that the configured mesh fits the devices there are."""
    parallel = config.parallel
    devices = jax.devices()
    check_devices(parallel.mesh, len(devices), ModelDims.from_hf(config.model.hf_config),
                  parallel.expert_parallel)
    if jax.process_count() > 1 and parallel.mesh.data != 1:
        raise ValueError("A multi-host run is one replica over every host's devices: use "
                         f"--mesh 1x{len(devices)}.")
    model = parallel.mesh.model
    mine = devices[rank * model:(rank + 1) * model]
    return Mesh(np.array(mine).reshape(1, model), AXES)


class ModelRunner:
    def __init__(self, config: EngineConfig, mesh: Mesh | None = None) -> None:
        """mesh: this replica's (1, model) mesh; replica 0's when not given."""
        self.config = config
        self.mesh = mesh or replica_mesh(config)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.local_device = next(d for d in self.mesh.devices.flat
                                 if d.process_index == jax.process_index())
        self.channel = StepChannel() if jax.process_count() > 1 else None
        hf = config.model.hf_config
        family = model_family(hf)
        self.plan = plan_sharding(ModelDims.from_hf(hf), self.mesh.shape[MODEL],
                                  config.parallel.expert_parallel)
        self.arch = dataclasses.replace(family.arch_from_hf(hf), num_kv_heads=self.plan.kv_heads,
                                        kv_replicas=self.plan.kv_replicas)
        warn_if_cpu_fallback(self.mesh.devices.flat[0].platform)
        # Chosen first: a backend the platform cannot run fails before the weights load.
        self.attention_fn = attention_for(config.attention.backend,
                                          self.mesh.devices.flat[0].platform, self.arch.head_dim)
        self.dtype, np_dtype = _DTYPES[config.model.dtype]
        options = {}
        if config.parallel.expert_parallel:  # whole experts per device, summed over `model`
            options["moe_fn"] = expert_parallel(self.mesh, MODEL)
        abstract = nnx.eval_shape(lambda: family.model_cls(self.arch, self.dtype, **options))
        spec_of = lambda path: PartitionSpec(*param_spec(path, self.plan))
        if config.model.load_format == "dummy":
            model = random_params(abstract, self.mesh, config.model.seed, spec_of)
        else:
            model = load_params(abstract, config.model.model,
                                functools.partial(family.param_path, arch=self.arch), np_dtype,
                                self.mesh, spec_of)
        self.attend = make_attend(self.attention_fn, self.mesh)
        self.graphdef, self.params = nnx.split(model)
        self._log_placement()
        self.padding = PaddingStats()
        self.block_size = config.cache.block_size
        self.blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        # Before sizing the KV cache, so that the device's bytes in use count it.
        self.penalty_state = PenaltyState.zeros(config.scheduler.max_num_seqs + 1,
                                                self.arch.vocab_size, self.replicated)
        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        # On the CPU a bf16 / f16 cache holds its bits as integers (ref.kv_storage_dtype).
        self.cache_dtype = ref.kv_storage_dtype(self.dtype, self.mesh.devices.flat[0].platform)
        zeros = jax.jit(functools.partial(jnp.zeros, shape, self.cache_dtype),
                        out_shardings=NamedSharding(self.mesh, PartitionSpec(*KV_CACHE_SPEC)))
        self.kv_caches = [(zeros(), zeros()) for _ in range(self.arch.num_layers)]
        self._step = jax.jit(self._step_fn, donate_argnums=(1, 2), static_argnames=("layout",))
        self._score = jax.jit(self._score_fn)
        # Shapes and shardings to compile for: the live arrays are donated at every step.
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        self._params_spec = jax.tree.map(spec, self.params)
        self._kv_spec = jax.tree.map(spec, self.kv_caches)
        self._penalty_spec = jax.tree.map(spec, self.penalty_state)
        self.executables = executable_cache_for(config, self)
        self._lock = threading.Lock()
        self._functions: dict[tuple, object] = {}  # ("step", T, R) | ("score", T) -> compiled
        self._pending: dict[tuple, concurrent.futures.Future] = {}  # being built
        self._warming: threading.Thread | None = None
        self._warm_up_total = 0
        self._warm_up_failed = False
        self._closed = False
        self._pools: list[concurrent.futures.ThreadPoolExecutor] = []

    # ---- sizing -------------------------------------------------------------------------
    def _log_placement(self) -> None:
        """The split and the weight bytes one device holds (`jaxserve plan` predicts both)."""
        held = sum(shard.data.nbytes for leaf in jax.tree.leaves(self.params)
                   for shard in leaf.addressable_shards if shard.device == self.local_device)
        plan, arch = self.plan, self.arch
        logger.info("Mesh %s: model axis %d; kv heads %d -> %d (%d per device); embeddings "
                    "split on %s; weights %.2f MiB per device.",
                    self.config.parallel.mesh, plan.model, arch.num_kv_heads // plan.kv_replicas,
                    plan.kv_heads, plan.kv_heads_per_device, plan.embed_axis or "nothing",
                    held / 2**20)

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block on each device (its share of the kv heads)."""
        a = self.arch
        itemsize = jnp.dtype(self.dtype).itemsize
        return (2 * a.num_layers * self.block_size * self.plan.kv_heads_per_device * a.head_dim
                * itemsize)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        needed = self.blocks_per_seq + 1
        if cache.num_kv_blocks is not None:
            blocks = cache.num_kv_blocks
        else:
            stats = self.local_device.memory_stats() or {}
            if cache.kv_cache_memory_bytes is not None:
                budget = cache.kv_cache_memory_bytes
            elif "bytes_limit" in stats:
                budget = int(stats["bytes_limit"] * cache.gpu_memory_utilization
                             - stats.get("bytes_in_use", 0))
            else:
                budget = _CPU_KV_BYTES
            blocks = budget // self.bytes_per_block
            if "bytes_limit" not in stats:
                # Host memory: no point holding more than every sequence can use at once.
                blocks = min(blocks, self.config.scheduler.max_num_seqs * self.blocks_per_seq + 1)
        if self.channel is not None:  # every host must build the same cache shape
            blocks = self.channel.share(blocks)
        if blocks < needed:
            raise ValueError(
                f"The KV cache has room for {blocks} blocks of {self.block_size} tokens, but one "
                f"sequence of max_model_len={self.config.model.max_model_len} needs {needed} "
                "(with the reserved null block). Raise num_kv_blocks / the memory budget, or "
                "lower max_model_len.")
        return int(blocks)

    # ---- device functions ---------------------------------------------------------------
    def _step_fn(self, params, kv_caches, penalty_state, packed, layout: Layout):
        arrays = unpack(packed, layout)
        batch = Batch(**{f: arrays.pop(f) for f in _BATCH_FIELDS})
        sampling = SamplingInputs(**arrays)
        model = nnx.merge(self.graphdef, params)
        kv_caches, hidden = model(kv_caches, batch, self.attend)
        hidden = jax.lax.with_sharding_constraint(hidden, self.replicated)  # [T, D]
        # The sampler sees the whole vocabulary on every device.
        logits = jax.lax.with_sharding_constraint(
            model.logits(hidden[batch.logits_indices]), self.replicated)  # f32[R, V]
        seq, _, valid = token_layout(batch, batch.token_ids.shape[0])
        # The penalty rows are only read by requests with penalties, which are in the
        # steps that update them: other steps skip the scatter.
        penalty_state = jax.lax.cond(
            uses_penalties(sampling), update_penalty_state, lambda state, *_: state,
            penalty_state, batch, sampling, seq, valid)
        result = sample(logits, penalty_state, sampling)
        return kv_caches, penalty_state, hidden, pack_device(result)

    def _score_fn(self, params, hidden, targets):
        model = nnx.merge(self.graphdef, params)
        return pack_device(score_tokens(model.logits(hidden), targets))

    def _layout(self, num_tokens: int, num_rows: int) -> Layout:
        batch, sampling = build_step_inputs(SchedulerOutput([], [], []), num_tokens, num_rows,
                                            self.block_size, self.blocks_per_seq)
        return layout_of({**batch, **sampling})

    def _result_like(self, rows: int) -> SampleResult:
        k = min(MAX_LOGPROBS, self.arch.vocab_size)
        i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
        shape = jax.ShapeDtypeStruct
        return SampleResult(shape((rows,), i32), shape((rows,), f32), shape((rows,), i32),
                            shape((rows, k), i32), shape((rows, k), f32))

    # ---- compiled functions -------------------------------------------------------------
    def _compile_step(self, num_tokens: int, num_rows: int):
        """The step compiled for bucket (T, R): compiled (or loaded) once, then reused."""
        return self._function(("step", num_tokens, num_rows))

    def _compile_score(self, num_tokens: int):
        return self._function(("score", num_tokens))

    def _function(self, key: tuple):
        """The compiled function for key, built by whichever thread asks first; a thread
        asking while another builds it waits for that build."""
        with self._lock:
            ready = self._functions.get(key)
            if ready is not None:
                return ready
            pending = self._pending.get(key)
            owner = pending is None
            if owner:
                pending = self._pending[key] = concurrent.futures.Future()
        if not owner:
            return pending.result()
        try:
            compiled = self._build(key)
        except BaseException as error:
            with self._lock:
                del self._pending[key]
            pending.set_exception(error)
            raise
        with self._lock:
            self._functions[key] = compiled
            del self._pending[key]
        pending.set_result(compiled)
        return compiled

    def _build(self, key: tuple):
        """Load key's executable from the executable cache (by its index, else by its HLO
        after tracing and lowering), or compile it (and store it there)."""
        name = "-".join(map(str, key))
        cache = self.executables
        compiled = cache.load(name) if cache is not None else None
        if compiled is not None:
            record_load()
            return compiled
        start = time.perf_counter()
        lowered = self._lower(key)
        hlo = lowered.as_text() if cache is not None else ""
        compiled = cache.load_lowered(name, hlo) if cache is not None else None
        if compiled is not None:
            record_load()
            return compiled
        compiled = lowered.compile()
        record_compile(key[0], time.perf_counter() - start)
        if cache is not None:
            cache.store(name, hlo, compiled)
        return compiled

    def _lower(self, key: tuple) -> jax.stages.Lowered:
        if key[0] == "step":
            _, num_tokens, num_rows = key
            layout = self._layout(num_tokens, num_rows)
            size = sum(math.prod(shape) for _, shape, _ in layout)
            packed = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self.replicated)
            return self._step.lower(self._params_spec, self._kv_spec, self._penalty_spec,
                                    packed, layout=layout)
        num_tokens = key[1]
        hidden = jax.ShapeDtypeStruct((num_tokens, self.arch.hidden_size), self.dtype,
                                      sharding=self.replicated)
        targets = jax.ShapeDtypeStruct((num_tokens,), jnp.int32, sharding=self.replicated)
        return self._score.lower(self._params_spec, hidden, targets)

    def _warm_up_order(self) -> list[tuple]:
        """Every function to compile, the first one alone able to serve: the smallest T with
        its largest R, then the decode buckets of a few sequences, then by T."""
        pairs = list(self.config.scheduler.step_buckets)
        first = max((p for p in pairs if p[0] == pairs[0][0]), key=lambda p: p[1])
        order = [("step", *first)]
        for t, r in pairs:
            if (t, r) != first:
                order.append(("step", t, r))
            if t == pairs[0][0] and r == 1:
                order.append(("score", t))
        order += [("score", t) for t in self.config.scheduler.token_buckets
                  if ("score", t) not in order]
        return order

    def warm_up(self, background: bool = False) -> None:
        """Compile (or load) every (T, R) step bucket and the prompt-scoring function per T,
        with progress, in a pool of compile threads (XLA compiles in parallel). background:
        compile the first bucket (it alone can run any step of the smallest size, see
        step_limits) now and the rest in a thread; steps meanwhile use only compiled
        buckets, and warm_up_done says when all are."""
        order = self._warm_up_order()
        self._warm_up_total = len(order)
        start = time.perf_counter()
        if background:
            logger.info("Warm-up: compiling step bucket (T, R) = %s first; the other %d "
                        "functions compile in the background while requests are served.",
                        order[0][1:], len(order) - 1)
            self._function(order[0])
            self._warming = threading.Thread(target=self._warm_up_rest,
                                             args=(order[1:], start), daemon=True,
                                             name="jaxserve-warm-up")
            self._warming.start()
            return
        with tqdm(total=len(order), desc="Compiling buckets") as bar:
            self._compile_all(order, bar.update)
        self._log_warm_up(start)

    def _compile_all(self, keys: list[tuple], done: Callable[[int], object]) -> None:
        """Build every key, in order, on COMPILE_THREADS threads; done(1) after each. close()
        cancels the builds not started yet."""
        pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS,
                                                     thread_name_prefix="jaxserve-compile")
        with self._lock:
            self._pools.append(pool)
        try:
            futures = [pool.submit(self._function, key) for key in keys]
            for future in concurrent.futures.as_completed(futures):
                if future.cancelled():
                    continue
                future.result()
                done(1)
        finally:
            pool.shutdown(wait=not self._closed, cancel_futures=True)
            with self._lock:
                self._pools.remove(pool)

    def _warm_up_rest(self, order: list[tuple], start: float) -> None:
        try:
            self._compile_all(order, lambda _: None)
        except Exception:  # a step that needs it compiles it again and reports the error
            logger.exception("Background warm-up stopped; buckets compile on first use.")
            self._warm_up_failed = True
            return
        if not self._closed:
            self._log_warm_up(start)

    @property
    def compiling(self) -> int:
        """Functions being compiled right now (a background warm-up's, or a step's)."""
        with self._lock:
            return len(self._pending)

    def _log_warm_up(self, start: float) -> None:
        cache = self.executables
        loaded = f"; {cache.hits} loaded from the executable cache" if cache else ""
        logger.info("Warm-up finished: %d functions ready in %.1f s%s (step buckets (T, R): "
                    "%s).", self._warm_up_total, time.perf_counter() - start, loaded,
                    list(self.config.scheduler.step_buckets))

    @property
    def warm_up_done(self) -> bool:
        """Whether every bucket is compiled (always true without a background warm-up)."""
        with self._lock:
            return len(self._functions) >= self._warm_up_total or self._warm_up_failed

    def step_limits(self) -> tuple[int, int] | None:
        """(tokens, sequences) a step may hold so that a compiled bucket holds it, while a
        background warm-up runs; None when any step may run (warm-up done, or none)."""
        if self._warming is None or self.warm_up_done:
            return None
        with self._lock:
            ready = [k[1:] for k in self._functions if k[0] == "step"]
        return max(t for t, _ in ready), max(r for t, r in ready if t == max(ready)[0])

    def _pick_bucket(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """The smallest bucket that holds the step; while a background warm-up runs, the
        smallest compiled one (step_limits guarantees there is one). Otherwise an
        uncompiled bucket compiles now, on first use: a bigger compiled one would cost
        every later step of that size its padding."""
        if self.step_limits() is not None:
            with self._lock:
                for t, r in self.config.scheduler.step_buckets:
                    if t >= num_tokens and r >= num_rows and ("step", t, r) in self._functions:
                        return t, r
        return self.config.scheduler.pick_bucket(num_tokens, num_rows)

    # ---- one step -----------------------------------------------------------------------
    def dispatch(self, out: SchedulerOutput,
                 score_targets: np.ndarray | None = None) -> InFlightStep:
        """Start one step on the device and return at once (JAX dispatch is asynchronous):
        the host can do other work until fetch. score_targets (i32[total tokens], -1 where
        not wanted) asks for the logprob of given next tokens at each position
        (prompt_logprobs)."""
        num_tokens, num_rows = self._pick_bucket(out.total_num_scheduled_tokens,
                                                 len(out.requests))
        self.padding.record(out.total_num_scheduled_tokens, num_tokens, len(out.requests),
                            num_rows)
        batch, sampling = build_step_inputs(out, num_tokens, num_rows, self.block_size,
                                            self.blocks_per_seq)
        packed = pack({**batch, **sampling})
        targets = None
        if score_targets is not None:
            targets = np.zeros(num_tokens, np.int32)
            targets[: len(score_targets)] = np.maximum(score_targets, 0)
        if self.channel is not None:  # multi-host: the other hosts run the same step
            self.channel.send(num_tokens, num_rows, packed, targets)
        return self._run(num_tokens, num_rows, packed, targets)

    def _run(self, num_tokens: int, num_rows: int, packed: np.ndarray,
             targets: np.ndarray | None) -> InFlightStep:
        """Launch the compiled step (and prompt scoring) on packed host inputs."""
        step = self._compile_step(num_tokens, num_rows)
        self.kv_caches, self.penalty_state, hidden, result = step(
            self.params, self.kv_caches, self.penalty_state, place(packed, self.replicated))
        scores = None
        if targets is not None:
            score = self._compile_score(num_tokens)
            scores = score(self.params, hidden, place(targets, self.replicated))
        return InFlightStep(result, scores, num_tokens, num_rows)

    def follow(self) -> int:
        """A non-zero host's loop: run host 0's steps until it says stop; the step count."""
        steps = 0
        while (message := self.channel.receive()) is not None:
            jax.block_until_ready(self._run(*message).result)
            steps += 1
        return steps

    def close(self) -> None:
        """Stop a background warm-up (builds not started are cancelled; one already
        compiling runs to its end: see compiling); host 0 of a multi-host run: tell the
        other hosts to stop following."""
        self._closed = True
        with self._lock:
            pools = list(self._pools)
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        if self.channel is not None and is_leader():
            self.channel.send_stop()
            self.channel = None

    def fetch(self, step: InFlightStep) -> StepResult:
        """Wait for a dispatched step; its results in one device-to-host transfer."""
        result, scores = jax.device_get((_local(step.result), _local(step.scores)))
        result = unpack_host(result, self._result_like(step.num_rows))
        if scores is not None:
            scores = unpack_host(scores, self._result_like(step.num_tokens))
        return StepResult(result, scores)


def _local(array: jax.Array | None) -> jax.Array | None:
    """A replicated result as one array this process can read (multi-host: its own copy)."""
    if array is None or array.is_fully_addressable:
        return array
    return array.addressable_data(0)
