"""The memory and compile plan of an engine configuration, from config.json alone.

`jaxserve plan` prints it, and the engine logs it at start-up: per-device bytes of the
weights (by group) and of the KV cache, the number of KV blocks, the concurrency at
max_model_len and the compiled (T, R) buckets. The weights' shapes come from the model built
abstractly (`nnx.eval_shape`, as the runner builds it) and their placement from mesh.py's
partition rules, so the numbers are the runner's, without reading a weight or allocating an
array. The KV budget follows runner._num_kv_blocks on an accelerator: device memory x
gpu_memory_utilization - the weights (the runner subtracts the bytes its device reports in
use after loading, so a real start-up can differ from the plan by runtime overheads).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

from jaxserve.config import kv_sizing
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_groups import KVGroups, kv_groups_for
from jaxserve.config.latent_cache import LatentCache, latent_cache
from jaxserve.config.mesh import (
    MODEL,
    MeshShape,
    ModelDims,
    ShardingPlan,
    param_spec,
    plan_sharding,
)
from jaxserve.config.plan_text import size_text
from jaxserve.models import model_family, resolve_architecture
from jaxserve.models.lora import lora_targets
from jaxserve.models.quant_config import LinearQuant
from jaxserve.models.quantization import COMPONENTS, CONTRACTED, SCALE_SUFFIX

GROUPS = ("embeddings", "attention", "mlp", "norms", "other", "lora slots")


@dataclasses.dataclass(frozen=True)
class WeightGroup:
    name: str  # one of GROUPS
    params: int  # parameters of one replica (replicated kv heads counted K' times)
    bytes_per_device: int
    split: str  # "split", "replicated" or "partly split" over the model axis


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    architecture: str
    dtype: str
    mesh: MeshShape
    sharding: ShardingPlan
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K, as in the checkpoint
    head_dim: int  # H
    intermediate_size: int  # F of the dense MLP
    num_experts: int  # E (0: dense)
    expert_intermediate_size: int  # F of one expert (0: dense)
    device_memory_bytes: int
    gpu_memory_utilization: float
    weights: tuple[WeightGroup, ...]
    sampler_state_bytes: int  # per device: penalty counts, prompt mask, logit bias rows
    kv_budget_bytes: int  # per device
    kv_budget_source: str  # "device memory", "kv_cache_memory_bytes" or "num_kv_blocks"
    bytes_per_block: int  # KV bytes of one block on each device
    block_size: int  # S
    num_blocks: int  # P, the null block included
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    token_buckets: tuple[int, ...]
    step_buckets: tuple[tuple[int, int], ...]
    # "int8": the linear layers' weights quantized while loading; or what a quantized
    # checkpoint's scheme is called (LinearQuant.label)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # CacheConfig.kv_cache_dtype
    kv_groups: KVGroups | None = None  # config/kv_groups.py; None: one group of every layer
    latent: LatentCache | None = None  # multi-head latent attention's cache (DeepSeek)
    tpu_layout: bool = False  # bytes_per_block as a TPU lays the cache out (tpu_tiled)

    @property
    def groups(self) -> KVGroups:
        return self.kv_groups or KVGroups.single(self.num_layers)

    @property
    def kv_element(self) -> str:
        """One cache element (kv_sizing.cache_element): the dtype or the quantized format."""
        return kv_sizing.cache_element(self.dtype, self.kv_cache_dtype)

    @property
    def weight_bytes_per_device(self) -> int:
        return sum(g.bytes_per_device for g in self.weights)

    @property
    def num_params(self) -> int:
        """The model's (the LoRA slots are not)."""
        return sum(g.params for g in self.weights if g.name != "lora slots")

    @property
    def usable_memory_bytes(self) -> int:
        return int(self.device_memory_bytes * self.gpu_memory_utilization)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token in every layer (a block holds groups.num_slots layers)."""
        return self.bytes_per_block * self.num_layers // (self.groups.num_slots
                                                          * self.block_size)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1  # block 0 is the null block padding writes into

    @property
    def kv_tokens(self) -> int:
        """Tokens the usable blocks hold in every layer."""
        return self.groups.tokens_held(self.usable_blocks, self.block_size)

    @property
    def blocks_per_seq(self) -> int:
        return kv_sizing.blocks_per_seq(self.max_model_len, self.block_size)

    @property
    def blocks_held(self) -> int:
        """Blocks one sequence of max_model_len holds (all of its table with one group;
        window groups hold only their window)."""
        return self.groups.blocks_held(self.max_model_len, self.block_size)

    @property
    def max_concurrency(self) -> int:
        """Sequences of max_model_len tokens that fit in the cache at once."""
        return self.usable_blocks // self.blocks_held

    @property
    def concurrency(self) -> float:
        return self.usable_blocks / self.blocks_held

    @property
    def blocks_per_gib(self) -> float:
        return 2**30 / self.bytes_per_block

    @property
    def mha_bytes_per_block(self) -> int:
        """A latent cache's block as multi-head attention with the same heads would keep it
        on one device (0 without a latent cache)."""
        if self.latent is None:
            return 0
        return (self.groups.num_slots * self.block_size * self.latent.mha_device_values
                * kv_sizing.ITEMSIZE[self.kv_element])

    @property
    def mha_blocks_per_gib(self) -> float:
        return 2**30 / self.mha_bytes_per_block if self.latent is not None else 0.0


class DoesNotFit(ValueError):
    """The weights, or one sequence's KV cache, do not fit; shortfall says what and by how
    much (the message adds what would help: plan_advice.suggest computes the numbers)."""

    def __init__(self, shortfall: str, hints: str = "", brief: str = "") -> None:
        super().__init__(f"{shortfall} {hints}".strip())
        self.shortfall = shortfall
        self.brief = brief or shortfall  # one line: what does not fit, in numbers


def make_plan(config: EngineConfig, device_memory_bytes: int, *, tiled: bool = False) -> Plan:
    """The plan of `config` on devices of `device_memory_bytes` each; tiled: TPUs (the KV
    cache as a TPU lays it out, kv_sizing.tpu_tiled). DoesNotFit (a ValueError saying what
    would help) when the weights do not fit, or the KV cache cannot hold one sequence."""
    if device_memory_bytes <= 0:
        raise ValueError(f"device memory must be > 0 bytes, got {device_memory_bytes}.")
    hf, dtype = config.model.hf_config, config.model.dtype
    dims = ModelDims.from_hf(hf)
    mesh = config.parallel.mesh
    element = kv_sizing.cache_element(dtype, config.cache.kv_cache_dtype)
    sharding = plan_sharding(dims, mesh.model, config.parallel.expert_parallel,
                             kv_sizing.min_kv_heads_per_device(element, tiled))
    scheme = config.model.weights_scheme
    weights = _weight_groups(hf, sharding, dtype, scheme)
    if config.lora is not None:  # the adapter slots live beside the weights from the start
        weights += (_lora_group(hf, sharding, dtype, config.lora),)
    arch = model_family(hf).arch_from_hf(hf)
    cache, sched = config.cache, config.scheduler
    groups = kv_groups_for(config)
    per_block = _bytes_per_block(hf, sharding, cache.block_size, element, groups.num_slots,
                                 tiled)
    state = kv_sizing.sampler_state_bytes(sched.max_num_seqs, arch.vocab_size)
    used = sum(g.bytes_per_device for g in weights) + state
    usable = device_memory_bytes * cache.gpu_memory_utilization
    held = groups.blocks_held(config.model.max_model_len, cache.block_size,
                              sched.max_num_batched_tokens)
    needed = held + 1
    kv = kv_sizing.kv_budget(cache, per_block, device_limit=device_memory_bytes, in_use=used)
    blocks, budget, source = kv.blocks, kv.budget_bytes, kv.source
    if used + max(blocks, needed) * per_block > usable:
        raise DoesNotFit(*_no_fit_message(config, device_memory_bytes, used,
                                          max(blocks, needed) * per_block, tiled))
    try:
        kv_sizing.check_holds_one_sequence(blocks, cache.block_size,
                                           config.model.max_model_len, held)
    except ValueError as err:  # num_kv_blocks or kv_cache_memory_bytes too small
        raise DoesNotFit(str(err), brief=f"the KV cache's {blocks:,} blocks hold less than "
                         f"one sequence of max_model_len={config.model.max_model_len} "
                         f"({needed:,} blocks)") from None
    return Plan(
        model=config.model.model, architecture=resolve_architecture(hf), dtype=dtype,
        quantization=getattr(scheme, "label", scheme), kv_cache_dtype=cache.kv_cache_dtype,
        mesh=mesh,
        sharding=sharding, num_layers=arch.num_layers, num_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads, head_dim=arch.head_dim,
        intermediate_size=dims.intermediate_size, num_experts=dims.num_experts,
        expert_intermediate_size=dims.expert_intermediate_size,
        device_memory_bytes=int(device_memory_bytes),
        gpu_memory_utilization=cache.gpu_memory_utilization, weights=weights,
        sampler_state_bytes=state, kv_budget_bytes=int(budget), kv_budget_source=source,
        bytes_per_block=per_block, tpu_layout=tiled,
        block_size=cache.block_size, num_blocks=int(blocks),
        max_model_len=config.model.max_model_len, max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        token_buckets=sched.token_buckets, step_buckets=sched.step_buckets,
        kv_groups=groups, latent=latent_cache(hf, mesh.model))


def _bytes_per_block(hf: dict, sharding: ShardingPlan, block_size: int, element: str,
                     layers: int | None = None, tiled: bool = False) -> int:
    """runner.bytes_per_block: K and V of one block, this device's share of the kv heads, or
    a latent cache's block, whole; element: kv_sizing.cache_element's; layers: a block's
    (KVGroups.num_slots; default every layer); tiled: on a TPU."""
    arch = model_family(hf).arch_from_hf(hf)
    if getattr(arch, "latent_dim", 0):
        return kv_sizing.latent_bytes_per_block(layers or arch.num_layers, block_size,
                                                arch.latent_dim, element, tiled)
    return kv_sizing.bytes_per_block(layers or arch.num_layers, block_size,
                                     sharding.kv_heads_per_device, arch.head_dim, element,
                                     tiled)


def _no_fit_message(config: EngineConfig, memory: int, used: int,
                    kv: int, tiled: bool = False) -> tuple[str, str, str]:
    """Why one replica's weights and KV cache do not fit on its devices, what would, and
    the why in one line (DoesNotFit's three parts)."""
    cache, mesh = config.cache, config.parallel.mesh
    hf, dtype = config.model.hf_config, config.model.dtype
    element = kv_sizing.cache_element(dtype, cache.kv_cache_dtype)
    usable = memory * cache.gpu_memory_utilization
    groups = kv_groups_for(config)
    needed = groups.blocks_held(config.model.max_model_len, cache.block_size,
                                config.scheduler.max_num_batched_tokens) + 1
    state = kv_sizing.sampler_state_bytes(config.scheduler.max_num_seqs,
                                          model_family(hf).arch_from_hf(hf).vocab_size)
    what = ("the weights alone do not fit" if used > usable
            else "the weights leave too little room for the KV cache")
    hints = []
    for m in range(mesh.model + 1, 65):  # the smallest model axis that fits, if any
        try:
            sharding = plan_sharding(ModelDims.from_hf(hf), m, config.parallel.expert_parallel,
                                     kv_sizing.min_kv_heads_per_device(element, tiled))
        except ValueError:
            continue
        weights = sum(g.bytes_per_device for g in _weight_groups(
            hf, sharding, dtype, config.model.weights_scheme))
        if weights + state + needed * _bytes_per_block(
                hf, sharding, cache.block_size, element, groups.num_slots, tiled) <= usable:
            hints.append(f"a model axis of {m} fits (--mesh {mesh.data}x{m}, "
                         f"{mesh.data * m} devices)")
            break
    if dtype == "float32":
        hints.append("--dtype bfloat16 halves the weights and the KV cache")
    if config.model.weights_scheme is None:
        hints.append("--quantization int8 stores the linear layers' weights in about half "
                     "of bfloat16's bytes")
    if kv_sizing.ITEMSIZE[element] > 1:
        hints.append("--kv-cache-dtype fp8 (or int8) stores the KV cache in one byte per "
                     "element")
    if used <= usable:
        hints.append("a lower --max-model-len (or --num-kv-blocks)")
    hints.append("devices with more memory")
    return (f"Mesh {mesh}: {what}. Each device of a replica needs {size_text(used)} of "
            f"{dtype} weights and sampler state and {size_text(kv)} of KV cache, but "
            f"{size_text(memory)} x gpu_memory_utilization {cache.gpu_memory_utilization:g} = "
            f"{size_text(usable)} is usable.", f"What helps: {'; '.join(hints)}.",
            f"{what} ({size_text(used)} of weights and sampler state + {size_text(kv)} of KV "
            f"cache per device, {size_text(usable)} usable)")


@functools.lru_cache(maxsize=32)
def _cached_groups(hf_json: str, sharding: ShardingPlan, dtype: str,
                   quantization: str | LinearQuant | None = None) -> tuple[WeightGroup, ...]:
    # The family's parameter table (numpy): no model is built, and jax is never imported.
    hf = json.loads(hf_json)
    family = model_family(hf)
    arch = dataclasses.replace(family.arch_from_hf(hf), num_kv_heads=sharding.kv_heads,
                               kv_replicas=sharding.kv_replicas)  # as ModelRunner builds it
    params = {g: 0 for g in GROUPS}
    split = {g: 0 for g in GROUPS}
    whole = {g: 0 for g in GROUPS}
    for path, (full, stored) in family.param_shapes(arch, quantization).items():
        spec = param_spec(path, sharding)
        shape = [-(-n // sharding.model) if i < len(spec) and spec[i] == MODEL else n
                 for i, n in enumerate(full)]
        group = _group(path)
        part = str(path[-1])
        if part == "values":  # a checkpoint-quantized kernel's codes, two per byte if packed
            params[group] += math.prod(full) * (2 if quantization.packed else 1)
        elif not part.endswith(SCALE_SUFFIX) and part not in COMPONENTS:  # scales: bytes only
            params[group] += math.prod(full)
        nbytes = math.prod(shape) * _ITEMSIZE[stored or dtype]
        (split if MODEL in spec else whole)[group] += nbytes
    return tuple(WeightGroup(g, params[g], split[g] + whole[g],
                             "replicated" if not split[g] else
                             "split" if not whole[g] else "partly split")
                 for g in GROUPS if params[g])


_ITEMSIZE = {**kv_sizing.ITEMSIZE, "float8_e4m3fn": 1, "uint8": 1, "int32": 4}


def _lora_group(hf: dict, sharding: ShardingPlan, dtype: str, lora) -> WeightGroup:
    """The LoRA slots' parameters and bytes per device (backends/jax/lora_weights.py):
    max_loras x (A [*in, R] + B [R, *out]) per target kernel, A split as the kernel's
    inputs and B as its outputs."""
    family = model_family(hf)
    arch = dataclasses.replace(family.arch_from_hf(hf), num_kv_heads=sharding.kv_heads,
                               kv_replicas=sharding.kv_replicas)
    params = nbytes = 0
    split = False
    for path, inputs, outputs in lora_targets(family.param_shapes(arch)).values():
        spec = tuple(param_spec(path, sharding)) + (None,) * (len(inputs) + len(outputs))
        contracted = CONTRACTED[path[-1]]
        dims = range(len(inputs) + len(outputs))
        for shape, axes in ((inputs, [spec[i] for i in dims if i in contracted]),
                            (outputs, [spec[i] for i in dims if i not in contracted])):
            params += math.prod(shape) * lora.max_lora_rank  # A or B
            nbytes += math.prod(-(-n // sharding.model) if axis == MODEL else n
                                for n, axis in zip(shape, axes)) * lora.max_lora_rank
            split |= MODEL in axes
    return WeightGroup("lora slots", params * lora.max_loras,
                       nbytes * lora.max_loras * _ITEMSIZE[dtype],
                       "partly split" if split else "replicated")


def _weight_groups(hf: dict, sharding: ShardingPlan, dtype: str,
                   quantization: str | LinearQuant | None = None) -> tuple[WeightGroup, ...]:
    """Parameters and per-device bytes by group; cached, as the no-fit hints try many."""
    return _cached_groups(json.dumps(hf, sort_keys=True), sharding, dtype, quantization)


def _group(path: tuple) -> str:
    names = [str(p) for p in path]
    if names[-1] in ("embed", "lm_head"):
        return "embeddings"
    if any("norm" in n for n in names):
        return "norms"
    if "attn" in names:
        return "attention"
    if "mlp" in names:
        return "mlp"
    return "other"


def plan_dict(plan: Plan) -> dict:
    """The plan as plain JSON values (`jaxserve plan --json`), derived numbers included."""
    out = dataclasses.asdict(plan)
    out["mesh"] = {"data": plan.mesh.data, "model": plan.mesh.model,
                   "num_devices": plan.mesh.num_devices}
    out["sharding"]["kv_heads_per_device"] = plan.sharding.kv_heads_per_device
    for name in ("weight_bytes_per_device", "num_params", "usable_memory_bytes",
                 "bytes_per_token", "usable_blocks", "kv_tokens", "blocks_per_seq", "blocks_held",
                 "max_concurrency", "concurrency", "blocks_per_gib"):
        out[name] = getattr(plan, name)
    if plan.latent is not None:  # and multi-head attention's with the same heads
        latent = plan.latent
        out["latent"].update(
            dim=latent.dim, mha_values=latent.mha_values,
            mha_device_values=latent.mha_device_values, token_ratio=latent.token_ratio,
            device_ratio=latent.device_ratio, mha_bytes_per_block=plan.mha_bytes_per_block,
            mha_blocks_per_gib=plan.mha_blocks_per_gib)
    return out
