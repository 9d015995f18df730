"""Model runner: owns the weights, the paged KV cache and the compiled step per (T, R) bucket.

The step is one jitted function (step.py), compiled per bucket (bucket_compiler.py: on
first use or by a warm-up, through the executable cache):

    step(params, kv_caches, penalty_state, packed_inputs, loras)
        -> (kv_caches, penalty_state, hidden, packed_sample_result)

loras holds the LoRA adapter slots (lora_weights.py: enable_lora; {} otherwise).

With speculative decoding (K proposals at most), a step in which some row verifies
proposals samples at each proposal of a row and at its last token, and keeps the proposals
that match the draws (rejection_sampler.py). The packed result then holds L = min(T, R*(K+1))
entries, row after row (row r's num_proposed[r] + 1 entries first, at the sum of the earlier
rows' counts), and the count each row emitted. Steps without proposals run the one-token
sampler into the same layout.

It is the step of docs/architecture.md ("Device side"): the Batch and SamplingInputs travel
packed into one int32 buffer (one host-to-device transfer; unpacked inside by static
slices, see packing.py), and the penalty state (per-request token counts, logit-bias rows,
grammar bitmasks) rides along with the KV cache. kv_caches and penalty_state
are donated, so both are updated in place. hidden (the final hidden states, [T, D]) stays
on the device for prompt_logprobs and, on a pooling engine, the pooling function (pooling.py).
Every device array is placed through the engine's Mesh (one device by default).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import layout as xla_layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.backends.checkpoint import HOST_DTYPES
from jaxserve.backends.compile_stats import (
    compilation_count,
    enable_persistent_cache,
    install_counter,
    record_compile,
    record_load,
)
from jaxserve.backends.jax import distributed, kv_quant
from jaxserve.backends.jax.accelerators import warn_if_cpu_fallback
from jaxserve.backends.jax.attend import KV_SCALE_SPEC, attention_for, make_attend
from jaxserve.backends.jax.attend_mla import (
    LATENT_CACHE_SPEC,
    make_attend_latent,
    mla_attention_for,
)
from jaxserve.backends.jax.bucket_compiler import CompiledFunctions
from jaxserve.backends.jax.executable_cache import executable_cache_for
from jaxserve.backends.jax.lora_weights import DeviceLoras
from jaxserve.backends.jax.orbax_checkpoint import is_orbax_folder, restore_params
from jaxserve.backends.jax.packing import Layout, layout_of, pack_device, unpack_host
from jaxserve.backends.jax.pooling import pool_rows
from jaxserve.backends.jax.sampler import (
    MASK_ROWS_PER_CALL,
    PenaltyState,
    SampleResult,
    score_tokens,
    set_bias_row,
    set_grammar_rows,
)
from jaxserve.backends.jax.sleep import RunnerSleep
from jaxserve.backends.jax.step import StepSettings, step_fn
from jaxserve.backends.jax.weights import device_bytes, load_params, place, random_params
from jaxserve.backends.protocol import PaddingStats, RunnerStats, StepResult
from jaxserve.config import kv_sizing
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_groups import kv_groups_for
from jaxserve.config.mesh import KV_CACHE_SPEC, MODEL, ModelDims, param_spec, plan_sharding
from jaxserve.core.input_builder import StepInputBuilder, build_step_inputs
from jaxserve.core.pooling import pool_inputs
from jaxserve.core.sampling_params import MAX_LOGPROBS
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.kernels_pallas import ref
from jaxserve.models import model_family
from jaxserve.models.jax.mixtral import expert_parallel
from jaxserve.models.llama_arch import with_max_model_len

logger = logging.getLogger(__name__)

# (JAX dtype, host dtype) per model dtype name: jnp names its dtypes as the config does.
_DTYPES = {name: (getattr(jnp, name), host) for name, host in HOST_DTYPES.items()}


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step: device arrays not yet waited for."""

    result: jax.Array  # packed SampleResult
    scores: jax.Array | None  # packed prompt scores, when asked for
    num_tokens: int  # the step's (T, R) bucket
    num_rows: int
    pooled: jax.Array | None = None  # f32[R, X] pooled rows, on a pooling engine


class ModelRunner:
    def __init__(self, config: EngineConfig, mesh: Mesh | None = None) -> None:
        """mesh: this replica's (1, model) mesh; replica 0's when not given. Three stages:
        the model (_build_model), the KV cache (_build_kv_cache), the step
        (_build_step)."""
        install_counter()
        if jax.process_count() > 1:  # one process: the executable cache below instead
            enable_persistent_cache(config.compilation_cache_dir)
        self.config = config
        self.num_speculative = (config.speculative.num_speculative_tokens
                                if config.speculative is not None else 0)  # K
        self._build_model(mesh)
        self._build_kv_cache()
        self._build_step()
        self.sleep_mode = RunnerSleep(self)

    def _build_model(self, mesh: Mesh | None) -> None:
        """The mesh and the sharding plan, the architecture, the attention kernel, the model
        with its weights (graphdef, params) and the LoRA slots."""
        config = self.config
        self.mesh = mesh or distributed.replica_mesh(config)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.local_device = next(d for d in self.mesh.devices.flat
                                 if d.process_index == jax.process_index())
        # A replica over several hosts: its lead host sends each step to the others.
        self.channel = distributed.step_channel(self.mesh) if jax.process_count() > 1 else None
        hf = config.model.hf_config
        family = model_family(hf)
        platform = self.mesh.devices.flat[0].platform
        element = kv_sizing.cache_element(config.model.dtype, config.cache.kv_cache_dtype)
        self.plan = plan_sharding(ModelDims.from_hf(hf), self.mesh.shape[MODEL],
                                  config.parallel.expert_parallel,
                                  kv_sizing.min_kv_heads_per_device(element, platform == "tpu"))
        arch = with_max_model_len(family.arch_from_hf(hf), config.model.max_model_len)
        # DeepSeek's multi-head latent attention: one latent cache per layer (attend_mla.py).
        self.latent_dim = getattr(arch, "latent_dim", 0)
        self.arch = arch if self.latent_dim else dataclasses.replace(
            arch, num_kv_heads=self.plan.kv_heads, kv_replicas=self.plan.kv_replicas)
        warn_if_cpu_fallback(platform)
        # Chosen first: a backend the platform cannot run fails before the weights load.
        self.attention_fn = (mla_attention_for(config.attention.backend, platform)
                             if self.latent_dim else
                             attention_for(config.attention.backend, platform,
                                           self.arch.head_dim,
                                           self.mesh.devices.flat[0].device_kind))
        self.dtype, np_dtype = _DTYPES[config.model.dtype]
        options = {}
        if config.parallel.expert_parallel:  # whole experts per device, summed over `model`
            options["moe_fn"] = expert_parallel(self.mesh, MODEL)
        scheme = config.model.weights_scheme  # None, "int8" or the checkpoint's LinearQuant
        if scheme is not None:
            options["quantization"] = scheme
        abstract = nnx.eval_shape(lambda: family.model_cls(self.arch, self.dtype, **options))
        model = self._load_model(abstract)
        self.graphdef, self.params = nnx.split(model)
        self._log_placement()
        # LoRA slots (enable_lora), and each token's slot among the step's inputs.
        spec_of = lambda path: PartitionSpec(*param_spec(path, self.plan))
        self.loras = None if config.lora is None else DeviceLoras(
            config.lora, hf, self.arch, family.param_shapes(self.arch), spec_of, self.mesh,
            self.dtype, np_dtype, allocate=self._allocate)

    def _build_kv_cache(self) -> None:
        """The block geometry and KV groups, the penalty state (allocated first, so that the
        device's bytes in use count it), the number of blocks the device holds, and the
        zeroed cache per layer slot (with calibrated scales when quantized)."""
        config = self.config
        self.block_size = config.cache.block_size
        self.blocks_per_seq = kv_sizing.blocks_per_seq(config.model.max_model_len,
                                                       self.block_size)
        self.kv_groups = kv_groups_for(config)  # layers sharing block tables and tensors
        self.penalty_state = self._allocate(functools.partial(
            PenaltyState.zeros, config.scheduler.max_num_seqs + 1, self.arch.vocab_size,
            self.replicated))
        self.num_blocks = self._num_kv_blocks()
        # Per layer (slot): K and V [P, S, K', H], or one latent cache [P, S, C + R].
        self.cache_tensors = 1 if self.latent_dim else 2
        shape = ((self.num_blocks, self.block_size, self.latent_dim) if self.latent_dim else
                 (self.num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim))
        kv_cache_dtype = config.cache.kv_cache_dtype
        # On the CPU a bf16 / f16 / fp8 cache holds its bits as integers (ref.kv_storage_dtype).
        self.cache_dtype = ref.kv_storage_dtype(kv_quant.value_dtype(kv_cache_dtype, self.dtype),
                                                self.mesh.devices.flat[0].platform)
        spec = LATENT_CACHE_SPEC if self.latent_dim else KV_CACHE_SPEC
        # Row-major, on every platform: a TPU's default layout of [P, S, K', H] puts P
        # innermost (the fewest padded tiles), while the TPU kernel and the KV writes take
        # the cache row-major, so under the default every step would copy each layer's
        # cache in and out (temporaries of the whole cache: `jaxserve compile` on v5e).
        self.cache_format = xla_layout.Format(xla_layout.Layout(tuple(range(len(shape)))),
                                              NamedSharding(self.mesh, PartitionSpec(*spec)))
        zeros = jax.jit(functools.partial(jnp.zeros, shape, self.cache_dtype),
                        out_shardings=self.cache_format)
        scales = self._calibrate_kv_scales() if kv_quant.is_quantized(kv_cache_dtype) else None
        self.kv_caches = [tuple(self._allocate(zeros) for _ in range(self.cache_tensors))
                          + (scales[i] if scales else ())
                          for i in range(self.kv_groups.num_slots)]
        self._kv_zeros = zeros  # (wake_up: the cache again, by the same compiled function)

    def _build_step(self) -> None:
        """The step's input builder and attention, the jitted step and its helper functions
        (scores, pooling, bias and grammar rows), the shapes to compile for, the executable
        cache and the per-bucket compiled functions (warm_up compiles them ahead)."""
        config = self.config
        self.padding = PaddingStats()
        self.inputs = StepInputBuilder(config.scheduler.max_num_seqs, self.block_size,
                                       self.blocks_per_seq, self.kv_groups.num_groups,
                                       lora=self.loras is not None)
        kv_cache_dtype = config.cache.kv_cache_dtype
        kv_values = kv_quant.value_dtype(kv_cache_dtype, self.dtype)
        quantized_values = kv_values if kv_quant.is_quantized(kv_cache_dtype) else None
        self.attend = (make_attend_latent if self.latent_dim else make_attend)(
            self.attention_fn, self.mesh, quantized_values)
        self._step = jax.jit(functools.partial(
            step_fn, StepSettings(self.graphdef, self.attend, self.replicated,
                                  self.kv_groups if self.kv_groups.num_groups > 1 else None,
                                  self.num_speculative)),
            donate_argnums=(1, 2), static_argnames=("layout",),
            out_shardings=(jax.tree.map(_format_of, self.kv_caches), None, None, None))
        self._score = jax.jit(self._score_fn)
        self._pool = jax.jit(self._pool_fn)
        self._set_bias = jax.jit(set_bias_row, donate_argnums=0)
        self._set_grammar = jax.jit(set_grammar_rows, donate_argnums=0)
        # Shapes and shardings to compile for: the live arrays are donated at every step.
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        self._params_spec = jax.tree.map(spec, self.params)
        self._kv_spec = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_format_of(a)),
            self.kv_caches)
        self._penalty_spec = jax.tree.map(spec, self.penalty_state)
        self.executables = executable_cache_for(config, self)
        self.compiled = CompiledFunctions(self._build, config.scheduler, self.executables,
                                          pooling=config.pooler is not None,
                                          extra=("lora",) if self.loras else ())

    # ---- the arrays it places: compile_only.ShapesOnlyRunner gives their shapes instead ----
    def _allocate(self, make):
        """The arrays of make() (a function making zeroed device arrays on their shardings:
        the KV cache, the penalty state, LoRA slots)."""
        return make()

    def _load_model(self, abstract: nnx.Module) -> nnx.Module:
        """The weights into an abstract model, on their shardings: random ones
        (load_format="dummy"), an Orbax folder's, or the Hugging Face checkpoint's (at
        start-up, and when the weights wake up from sleep level 2)."""
        model, family = self.config.model, model_family(self.config.model.hf_config)
        spec_of = lambda path: PartitionSpec(*param_spec(path, self.plan))
        if model.load_format == "dummy":
            return random_params(abstract, self.mesh, model.seed, spec_of)
        if is_orbax_folder(model.model):
            return restore_params(abstract, model.model, self.dtype, self.mesh, spec_of,
                                  self.plan.kv_replicas)
        path_of, scheme = functools.partial(family.param_path, arch=self.arch), \
            model.weights_scheme
        return load_params(abstract, model.model, path_of, _DTYPES[model.dtype][1], self.mesh,
                           spec_of, None if scheme == "int8" else scheme)

    # ---- sizing -------------------------------------------------------------------------
    def _log_placement(self) -> None:
        """The split and the weight bytes one device holds (`jaxserve plan` predicts both)."""
        held = device_bytes(self.params)
        plan, arch = self.plan, self.arch
        quantization = self.config.model.weights_label
        logger.info("Mesh %s: model axis %d; kv heads %d -> %d (%d per device); embeddings "
                    "split on %s; weights %.2f MiB per device%s.",
                    self.config.parallel.mesh, plan.model, arch.num_kv_heads // plan.kv_replicas,
                    plan.kv_heads, plan.kv_heads_per_device, plan.embed_axis or "nothing",
                    held / 2**20, f" ({quantization})" if quantization else "")

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block on each device (its share of the kv heads)."""
        return kv_sizing.device_bytes_per_block(
            self.config, self.kv_groups, self.plan.kv_heads_per_device, self.arch.head_dim,
            self.latent_dim, tiled=self.mesh.devices.flat[0].platform == "tpu")

    def _calibrate_kv_scales(self) -> list[tuple[jax.Array, jax.Array]]:
        """Per layer (k_scale, v_scale) f32[K'] split as the kv heads, or latent f32[1] pairs."""
        scales = kv_quant.calibrated_scales(self.config, self.graphdef, self.params,
                                            self.arch.num_layers, self.arch.num_kv_heads,
                                            self.arch.vocab_size, self.replicated,
                                            latent=bool(self.latent_dim))
        split = self.replicated if self.latent_dim else NamedSharding(
            self.mesh, PartitionSpec(*KV_SCALE_SPEC))
        return [(place(k, split), place(v, split)) for k, v in scales]

    def _num_kv_blocks(self) -> int:
        """kv_sizing's budget on this device (what is in use already counts: the weights);
        with several hosts, every host builds the same cache shape."""
        stats = self.local_device.memory_stats() or {}
        return kv_sizing.device_blocks(
            self.config, self.kv_groups, self.bytes_per_block,
            device_limit=stats.get("bytes_limit"), in_use=stats.get("bytes_in_use", 0),
            share=self.channel.share if self.channel is not None else None)

    # ---- device functions ---------------------------------------------------------------
    def _score_fn(self, params, hidden, targets):
        model = nnx.merge(self.graphdef, params)
        return pack_device(score_tokens(model.logits(hidden), targets))

    def _pool_fn(self, params, hidden, rows):
        pooler = self.config.pooler
        return pool_rows(nnx.merge(self.graphdef, params), hidden, rows, pooler.pooling_type,
                         pooler.applies_head)

    def _layout(self, num_tokens: int, num_rows: int) -> Layout:
        batch, sampling = build_step_inputs(SchedulerOutput([], [], []), num_tokens, num_rows,
                                            self.block_size, self.blocks_per_seq,
                                            self.kv_groups.num_groups, self.loras is not None)
        return layout_of({**batch, **sampling})

    def _step_result_like(self, num_tokens: int, num_rows: int):
        """The packed result of a (T, R) step: R entries; speculating, L = min(T, R*(K+1))
        entries and the count each row emitted."""
        if not self.num_speculative:
            return self._result_like(num_rows)
        slots = min(num_tokens, num_rows * (1 + self.num_speculative))
        return self._result_like(slots), jax.ShapeDtypeStruct((num_rows,), np.dtype(np.int32))

    def _result_like(self, rows: int) -> SampleResult:
        k = min(MAX_LOGPROBS, self.arch.vocab_size)
        i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
        shape = jax.ShapeDtypeStruct
        return SampleResult(shape((rows,), i32), shape((rows,), f32), shape((rows,), i32),
                            shape((rows, k), i32), shape((rows, k), f32))

    # ---- compiled functions -------------------------------------------------------------
    def _compile_step(self, num_tokens: int, num_rows: int):
        """The step compiled for bucket (T, R): compiled (or loaded) once, then reused."""
        return self.compiled.get(("step", num_tokens, num_rows))

    def _compile_score(self, num_tokens: int):
        return self.compiled.get(("score", num_tokens))

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
        lowered = self.lower(key)
        compiled = (cache.load_lowered(name, _cache_text(lowered)) if cache is not None
                    else None)
        if compiled is not None:
            record_load()
            return compiled
        compiled = lowered.compile()
        record_compile(key[0], time.perf_counter() - start)
        self.store(key, lowered, compiled)
        return compiled

    def store(self, key: tuple, lowered: jax.stages.Lowered, compiled) -> None:
        """Key's executable into the executable cache, when there is one (also for an
        executable compiled for devices that are not here: compile_only.py)."""
        if self.executables is not None:
            self.executables.store("-".join(map(str, key)), _cache_text(lowered), compiled)

    def lower(self, key: tuple) -> jax.stages.Lowered:
        """Key's function (bucket_compiler.py's keys) traced and lowered for the runner's
        shapes and shardings."""
        if key[0] == "bias":
            row = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
            values = jax.ShapeDtypeStruct((self.arch.vocab_size,), jnp.float32,
                                          sharding=self.replicated)
            return self._set_bias.lower(self._penalty_spec, row, values)
        if key[0] == "grammar":
            k, words = MASK_ROWS_PER_CALL, (self.arch.vocab_size + 31) // 32
            rows = jax.ShapeDtypeStruct((k,), jnp.int32, sharding=self.replicated)
            masks = jax.ShapeDtypeStruct((k, words), jnp.int32, sharding=self.replicated)
            return self._set_grammar.lower(self._penalty_spec, rows, masks)
        if key[0] == "pool":
            _, num_tokens, num_rows = key
            hidden = jax.ShapeDtypeStruct((num_tokens, self.arch.hidden_size), self.dtype,
                                          sharding=self.replicated)
            rows = jax.ShapeDtypeStruct((num_tokens + num_rows,), jnp.int32,
                                        sharding=self.replicated)
            return self._pool.lower(self._params_spec, hidden, rows)
        if key[0] == "step":
            _, num_tokens, num_rows = key
            layout = self._layout(num_tokens, num_rows)
            size = sum(math.prod(shape) for _, shape, _ in layout)
            packed = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self.replicated)
            loras = {} if self.loras is None else jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                self.loras.arrays)
            return self._step.lower(self._params_spec, self._kv_spec, self._penalty_spec,
                                    packed, loras, layout=layout)
        if key[0] == "lora":
            return self.loras.lower_write()
        num_tokens = key[1]
        hidden = jax.ShapeDtypeStruct((num_tokens, self.arch.hidden_size), self.dtype,
                                      sharding=self.replicated)
        targets = jax.ShapeDtypeStruct((num_tokens,), jnp.int32, sharding=self.replicated)
        return self._score.lower(self._params_spec, hidden, targets)

    # ---- compiled functions: bucket_compiler.py ------------------------------------------
    def warm_up(self, background: bool = False) -> None:
        self.compiled.warm_up(background)

    def step_limits(self) -> tuple[int, int] | None:
        return self.compiled.step_limits()

    @property
    def compiling(self) -> int:
        return self.compiled.compiling

    @property
    def warm_up_done(self) -> bool:
        return self.compiled.warm_up_done

    def stats(self) -> RunnerStats:
        padding = self.padding
        return RunnerStats(compilations=compilation_count(), compiling=self.compiling,
                           warm_up_done=self.warm_up_done, steps=padding.steps,
                           token_padding=padding.token_padding,
                           row_padding=padding.row_padding)

    # ---- one step -----------------------------------------------------------------------
    def dispatch(self, out: SchedulerOutput, score_targets: np.ndarray | None = None,
                 grammar_masks: list[tuple[int, np.ndarray]] | None = None) -> InFlightStep:
        """Start one step on the device and return at once (JAX dispatch is asynchronous):
        the host can do other work until fetch. score_targets (i32[total tokens], -1 where
        not wanted) asks for the logprob of given next tokens at each position
        (prompt_logprobs); grammar_masks: (sampler row, i32[W]) of the constrained rows."""
        num_tokens, num_rows = self.compiled.pick_bucket(out.total_num_scheduled_tokens,
                                                         len(out.requests))
        self.padding.record(out.total_num_scheduled_tokens, num_tokens, len(out.requests),
                            num_rows)
        packed, _ = self.inputs.build_packed(out, num_tokens, num_rows)
        targets = None
        if score_targets is not None:
            targets = np.zeros(num_tokens, np.int32)
            targets[: len(score_targets)] = np.maximum(score_targets, 0)
        # A request that has just been given its sampler row brings its logit bias row.
        bias_rows = [(req.state_slot, req.constraints.row(self.arch.vocab_size))
                     for req in map(out.requests.__getitem__, out.new_rows)
                     if req.constraints is not None and req.constraints.has_row]
        grammar_rows = list(grammar_masks or [])
        pooler = self.config.pooler
        pool = None if pooler is None else pool_inputs(out, num_tokens, num_rows,
                                                       pooler.pooling_type)
        loads = self.loras.loads_for(out.requests) if self.loras is not None else []
        if self.channel is not None:  # the replica's other hosts run the same step
            self.channel.send(num_tokens, num_rows, packed, targets, bias_rows, grammar_rows,
                              pool, loads)
        return self._run(num_tokens, num_rows, packed, targets, bias_rows, grammar_rows, pool,
                         loads)

    def _run(self, num_tokens: int, num_rows: int, packed: np.ndarray,
             targets: np.ndarray | None, bias_rows: list, grammar_rows: list,
             pool: np.ndarray | None = None, loads: list = ()) -> InFlightStep:
        """Launch the compiled step (and prompt scoring, and pooling: pool i32[T + R]) on
        packed host inputs, after writing the LoRA adapters [(slot, LoRARequest)] its rows
        need, the logit bias rows [(row, f32[V])] of requests starting this step and the
        grammar bitmasks [(row, i32[W])] of its constrained rows."""
        for slot, lora in loads:
            self.loras.write(slot, lora, self.compiled.get(("lora",)))
        if bias_rows:
            set_bias = self.compiled.get(("bias",))
            for row, values in bias_rows:
                self.penalty_state = set_bias(self.penalty_state,
                                              place(np.asarray(row, np.int32), self.replicated),
                                              place(values, self.replicated))
        for start in range(0, len(grammar_rows), MASK_ROWS_PER_CALL):
            part = grammar_rows[start: start + MASK_ROWS_PER_CALL]
            rows = np.zeros(MASK_ROWS_PER_CALL, np.int32)  # padding: the scratch row 0
            masks = np.full((MASK_ROWS_PER_CALL, (self.arch.vocab_size + 31) // 32), -1,
                            np.int32)
            for i, (row, mask) in enumerate(part):
                rows[i], masks[i] = row, mask
            set_grammar = self.compiled.get(("grammar",))
            self.penalty_state = set_grammar(self.penalty_state, place(rows, self.replicated),
                                             place(masks, self.replicated))
        step = self._compile_step(num_tokens, num_rows)
        self.kv_caches, self.penalty_state, hidden, result = step(
            self.params, self.kv_caches, self.penalty_state, place(packed, self.replicated),
            self.loras.arrays if self.loras is not None else {})
        scores = None
        if targets is not None:
            score = self._compile_score(num_tokens)
            scores = score(self.params, hidden, place(targets, self.replicated))
        pooled = None
        if pool is not None:
            pooled = self.compiled.get(("pool", num_tokens, num_rows))(
                self.params, hidden, place(pool, self.replicated))
        return InFlightStep(result, scores, num_tokens, num_rows, pooled)

    # ---- sleep mode and weight updates: sleep.py ------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self.sleep_mode.sleeping

    def sleep(self, level: int) -> None:
        self.sleep_mode.sleep(level)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        self.sleep_mode.wake_up(tags)

    def update_weights(self, weights) -> int:
        return self.sleep_mode.update_weights(weights)

    def follow(self) -> int:
        """The loop of a host that does not lead its replica: run the lead host's steps
        until it says stop (or is gone); the step count."""
        steps = 0
        while (message := self.channel.receive()) is not None:
            jax.block_until_ready(self._run(*message).result)
            steps += 1
        return steps

    def close(self) -> None:
        """Stop a background warm-up (builds not started are cancelled; one already
        compiling runs to its end: see compiling); the lead host of a replica over several
        hosts: tell the others to stop following."""
        self.compiled.close()
        if self.channel is not None and self.channel.leads:
            self.channel.send_stop()
            self.channel = None

    def fetch(self, step: InFlightStep) -> StepResult:
        """Wait for a dispatched step; its results in one device-to-host transfer."""
        result, scores, pooled = jax.device_get((_local(step.result), _local(step.scores),
                                                 _local(step.pooled)))
        num_emitted = None
        result = unpack_host(result, self._step_result_like(step.num_tokens, step.num_rows))
        if self.num_speculative:
            result, num_emitted = result
        if scores is not None:
            scores = unpack_host(scores, self._result_like(step.num_tokens))
        return StepResult(result, scores, num_emitted, pooled)


def _cache_text(lowered: jax.stages.Lowered) -> str:
    """What the executable cache keys an entry by: the lowered HLO with the inputs' tree
    and shapes (jit drops unused arguments from the HLO: scoring reads only the embeddings,
    so models differing elsewhere lower to the same text)."""
    inputs = jax.tree.leaves(lowered.in_avals)
    return f"{lowered.as_text()}\n// inputs: {lowered.in_tree} {inputs}"


def _format_of(array):
    """An array's (or ShapeDtypeStruct's) layout and sharding when it has a layout (the KV
    cache tensors), else its sharding."""
    return getattr(array, "format", None) or array.sharding


def _local(array: jax.Array | None) -> jax.Array | None:
    """A replicated result as one array this process can read (multi-host: its own copy)."""
    if array is None or array.is_fully_addressable:
        return array
    return array.addressable_data(0)
