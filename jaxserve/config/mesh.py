"""The device mesh: parsing `--mesh`, checking it against the model and the devices, and the
partition rules that give every weight and the KV cache their place on it.

`--mesh 2x4` (or `data=2,model=4`) means 2 data-parallel replicas, each tensor-parallel over
4 devices. Data parallelism runs one engine per replica on its own (1, model) sub-mesh (see
jaxserve/engine/data_parallel.py); inside a replica, weights are split over the `model` axis:

* attention: query heads over `model` (wq [D, N, H], bq, wo [N, H, D]); kv heads too when
  there are at least as many as devices, else each kv head is replicated until there is one
  per device (K' = model; GQA still maps every query head to its own kv head);
* MLP: the hidden width F (w_gate, w_up [D, F], w_down [F, D]);
* MoE experts: F inside every expert, or (expert parallelism) whole experts over `model`;
* embeddings and lm_head [V, D]: the hidden axis D, else the vocabulary, else replicated;
* norms, routers and everything small: replicated;
* KV cache [P, S, K', H]: the kv-head axis.

Everything here is plain Python on config values: the CLI, `jaxserve plan` and the config
checks use it without importing jax. Shape letters as in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import re

from jaxserve.models.quant_config import checkpoint_quant
from jaxserve.models.quantization import COMPONENTS, CONTRACTED, SCALE_SUFFIX

MODEL = "model"
DATA = "data"
AXES = (DATA, MODEL)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    data: int = 1
    model: int = 1

    @property
    def num_devices(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"{self.data}x{self.model}"


def parse_mesh(text: str | MeshShape | None) -> MeshShape:
    """'2x4', 'data=2,model=4', 'model=8' (missing axes are 1) or None (1x1)."""
    if text is None:
        return MeshShape()
    if isinstance(text, MeshShape):
        shape = text
    else:
        spec = str(text).replace(" ", "")
        plain = re.fullmatch(r"(\d+)x(\d+)", spec)
        if plain:
            shape = MeshShape(int(plain[1]), int(plain[2]))
        elif re.fullmatch(r"(data|model)=\d+(,(data|model)=\d+)?", spec):
            sizes = dict(part.split("=") for part in spec.split(","))
            if len(sizes) != spec.count("=") or set(sizes) - set(AXES):
                raise ValueError(f"mesh {text!r} names an axis twice.")
            shape = MeshShape(int(sizes.get(DATA, 1)), int(sizes.get(MODEL, 1)))
        else:
            raise ValueError(f"mesh must look like '2x4' (data x model) or 'data=2,model=4', "
                             f"got {text!r}.")
    if shape.data < 1 or shape.model < 1:
        raise ValueError(f"mesh axes must be >= 1, got {shape}.")
    return shape


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The sizes that decide how a model splits, read from its HF config.json."""

    num_heads: int  # N
    num_kv_heads: int  # K
    hidden_size: int  # D
    intermediate_size: int  # F (dense MLP)
    vocab_size: int  # V
    num_experts: int = 0  # E (0: dense)
    expert_intermediate_size: int = 0  # F of one expert
    dense_widths: tuple = ()  # MoE models: F of their dense MLPs (shared expert, dense layers)
    head_dim: int = 0  # H
    # A quantized checkpoint's groups of input rows (0: none or one per channel), and whether
    # a g_idx maps rows to groups (activation order: scales are kept whole on every device).
    quant_group: int = 0
    act_order: bool = False
    quant_kinds: tuple = ()  # the quantized kernel classes (quant_config.KINDS)
    # Multi-head latent attention (DeepSeek): C + R per cache entry, one "kv head" replicated
    # on every device; 0: multi-head attention.
    latent_dim: int = 0

    @classmethod
    def from_hf(cls, hf: dict) -> ModelDims:
        if hf.get("kv_lora_rank"):
            return cls._latent(hf)
        heads = int(hf["num_attention_heads"])
        experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
        dense = ()
        if experts and hf.get("moe_intermediate_size"):  # Qwen-MoE: dense layers, shared expert
            dense = tuple(int(w) for w in (hf["intermediate_size"],
                                           hf.get("shared_expert_intermediate_size")) if w)
        quant = checkpoint_quant(hf)
        return cls(num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                   hidden_size=int(hf["hidden_size"]),
                   intermediate_size=int(hf["intermediate_size"]),
                   vocab_size=int(hf["vocab_size"]), num_experts=experts,
                   expert_intermediate_size=int(hf.get("moe_intermediate_size")
                                                or hf["intermediate_size"]) if experts else 0,
                   dense_widths=dense,
                   head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
                   quant_group=quant.group_size if quant else 0,
                   act_order=bool(quant and quant.act_order),
                   quant_kinds=quant.kinds if quant else ())

    @classmethod
    def _latent(cls, hf: dict) -> ModelDims:
        """A DeepSeek config's: its heads split, its latent is replicated (one kv head);
        head_dim is V, the rows each head gives the output projection."""
        experts = int(hf.get("n_routed_experts") or 0)
        expert_width = int(hf.get("moe_intermediate_size") or 0)
        shared = int(hf.get("n_shared_experts") or 0) * expert_width
        quant = checkpoint_quant(hf)
        return cls(num_heads=int(hf["num_attention_heads"]), num_kv_heads=1,
                   hidden_size=int(hf["hidden_size"]),
                   intermediate_size=int(hf["intermediate_size"]),
                   vocab_size=int(hf["vocab_size"]), num_experts=experts,
                   expert_intermediate_size=expert_width if experts else 0,
                   dense_widths=tuple(w for w in (int(hf["intermediate_size"]), shared) if w)
                   if experts else (), head_dim=int(hf["v_head_dim"]),
                   quant_group=quant.group_size if quant else 0,
                   act_order=bool(quant and quant.act_order),
                   quant_kinds=quant.kinds if quant else (),
                   latent_dim=int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"]))


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """How one replica's weights split over its `model` devices."""

    model: int  # devices on the model axis
    kv_heads: int  # K': kv heads after replication (a multiple of model, or K itself)
    kv_replicas: int  # K' / K
    embed_axis: str | None  # "hidden", "vocab" or None (replicated)
    expert_parallel: bool
    # quantized kernels whose scales (and zeros) are kept whole on every device (_whole_groups)
    whole_groups: tuple = ()

    @property
    def kv_heads_per_device(self) -> int:
        return self.kv_heads // self.model


def plan_sharding(dims: ModelDims, model: int, expert_parallel: bool = False,
                  min_kv_heads_per_device: int = 1) -> ShardingPlan:
    """The split of one replica over `model` devices; ValueError if the model cannot split.
    min_kv_heads_per_device: kv heads are replicated up to this many per device where the
    query heads allow it (kv_sizing.min_kv_heads_per_device: 2 on a TPU; not a latent
    cache's)."""
    problems = _split_problems(dims, model, expert_parallel)
    if problems:
        fits = [m for m in range(1, 65) if not _split_problems(dims, m, expert_parallel)]
        raise ValueError(f"The model cannot be split over model={model} devices: "
                         f"{'; '.join(problems)}. Model-axis sizes that work: "
                         f"{', '.join(map(str, fits))}.")
    k = dims.num_kv_heads
    kv_heads = k if k % model == 0 else model
    wanted = model * min_kv_heads_per_device
    if not dims.latent_dim and kv_heads < wanted and wanted % k == 0 and \
            dims.num_heads % wanted == 0:
        kv_heads = wanted
    if dims.hidden_size % model == 0:
        embed_axis = "hidden"
    elif dims.vocab_size % model == 0:
        embed_axis = "vocab"
    else:
        embed_axis = None
    return ShardingPlan(model=model, kv_heads=kv_heads, kv_replicas=kv_heads // k,
                        embed_axis=embed_axis, expert_parallel=expert_parallel,
                        whole_groups=_whole_groups(dims, model, expert_parallel))


def _split_problems(dims: ModelDims, model: int, expert_parallel: bool) -> list[str]:
    problems = []
    if dims.num_heads % model:
        problems.append(f"its {dims.num_heads} attention heads do not divide by {model}")
    k = dims.num_kv_heads
    if k % model and model % k:
        problems.append(f"its {k} kv heads neither divide by {model} nor divide {model} "
                        "(no replication path)")
    if dims.intermediate_size % model and not dims.num_experts:
        problems.append(f"its intermediate_size {dims.intermediate_size} does not divide by "
                        f"{model}")
    if dims.num_experts:
        if expert_parallel and dims.num_experts % model:
            problems.append(f"its {dims.num_experts} experts do not divide by {model} "
                            "(expert parallelism)")
        if not expert_parallel and dims.expert_intermediate_size % model:
            problems.append(f"its expert width {dims.expert_intermediate_size} does not "
                            f"divide by {model} (try --expert-parallel)")
        problems += [f"its dense MLP width {width} does not divide by {model}"
                     for width in dims.dense_widths if width % model]
    return problems


def _whole_groups(dims: ModelDims, model: int, expert_parallel: bool) -> tuple[str, ...]:
    """The quantized kernels split on their input rows (wo, w_down, the experts' down
    projection) whose scales and zeros every device keeps whole: one group per output
    channel, groups that straddle two devices' rows (e.g. GPT-OSS's 2880-wide experts in
    groups of 32 over 8 devices), or rows mapped to groups by a g_idx (activation order)."""
    if model == 1 or not dims.quant_kinds:
        return ()
    rows = {}
    if "attention" in dims.quant_kinds:
        rows["wo"] = [dims.num_heads * dims.head_dim]
    if "mlp" in dims.quant_kinds:
        rows["w_down"] = list(dims.dense_widths if dims.num_experts
                              else (dims.intermediate_size,))
    if "experts" in dims.quant_kinds and dims.num_experts and not expert_parallel:
        rows["experts_down"] = [dims.expert_intermediate_size]
    group = dims.quant_group
    return tuple(name for name, widths in rows.items()
                 if not group or dims.act_order or any(n // model % group for n in widths))


def check_devices(shape: MeshShape, num_devices: int, dims: ModelDims | None = None,
                  expert_parallel: bool = False) -> None:
    """The mesh must use all devices or a divisor of them; ValueError lists shapes that fit."""
    if num_devices % shape.num_devices == 0:
        return
    fits = [f"{d}x{m}" for m in range(1, num_devices + 1) for d in range(1, num_devices + 1)
            if num_devices % (d * m) == 0
            and (dims is None or not _split_problems(dims, m, expert_parallel))]
    raise ValueError(f"mesh {shape} needs {shape.num_devices} devices, which does not divide "
                     f"the {num_devices} available. Meshes that work here: {', '.join(fits)}.")


def param_spec(path: tuple, plan: ShardingPlan) -> tuple:
    """The partition spec (a tuple of mesh-axis names or None per dimension) of one model
    parameter, from its path in the NNX state (e.g. ('layers', 3, 'attn', 'wq'))."""
    name = str(path[-1])
    if name in COMPONENTS and len(path) > 1 and str(path[-2]) in CONTRACTED:
        return _stored_spec(str(path[-2]), param_spec(path[:-1], plan), name,
                            str(path[-2]) in plan.whole_groups)
    if name.endswith(SCALE_SUFFIX):  # an int8 kernel's scale: the kernel's, size 1 on inputs
        kernel = name[: -len(SCALE_SUFFIX)]
        spec = param_spec((*path[:-1], kernel), plan)
        return tuple(None if i in CONTRACTED[kernel] else axis for i, axis in enumerate(spec))
    if name in ("embed", "lm_head"):  # [V, D]
        return {"hidden": (None, MODEL), "vocab": (MODEL, None)}.get(plan.embed_axis, ())
    if name in _EXPERT_RULES:
        return _EXPERT_RULES[name][plan.expert_parallel]
    return _RULES.get(name, ())


def _stored_spec(kernel: str, spec: tuple, part: str, whole_groups: bool) -> tuple:
    """A checkpoint-quantized kernel's component (quantization.stored_shapes: [*lead, C, O])
    split as the kernel is: the contracted rows C on the axis that splits the kernel's
    first contracted axis, the outputs O on its first output axis's (a split kernel
    axis is always the major one of its group)."""
    contracted = CONTRACTED[kernel]
    first, last = contracted[0], contracted[-1]
    lead = tuple(spec[:first])
    rows, outs = spec[first:last + 1], spec[last + 1:]
    if any(rows[1:]) or any(outs[1:]):
        raise ValueError(f"{kernel}: a split on a minor axis cannot keep quantized weights.")
    row, out = rows[0] if rows else None, outs[0] if outs else None
    if part == "values":
        return lead + (row, out)
    if part in ("scale", "zero"):
        return lead + (None if whole_groups else row, out)
    if part == "g_idx":
        return (row,)
    return lead  # input_scale


_RULES = {
    "wq": (None, MODEL, None), "wk": (None, MODEL, None), "wv": (None, MODEL, None),  # [D, N|K', H]
    "bq": (MODEL, None), "bk": (MODEL, None), "bv": (MODEL, None),  # [N|K', H]
    "wo": (MODEL, None, None),  # [N, H, D]
    # multi-head latent attention (DeepSeek): the heads of [Q, N, P + R], [C, N, P], [C, N, V]
    "wq_b": (None, MODEL, None), "wk_b": (None, MODEL, None), "wv_b": (None, MODEL, None),
    "w_gate": (None, MODEL), "w_up": (None, MODEL),  # [D, F]
    "w_down": (MODEL, None),  # [F, D]
    "sinks": (MODEL,),  # [N]: attention sinks, split like the query heads
}
# stacked experts: (tensor parallel inside each expert, expert parallel)
_EXPERT_RULES = {
    "experts_gate": ((None, None, MODEL), (MODEL, None, None)),  # [E, D, F]
    "experts_up": ((None, None, MODEL), (MODEL, None, None)),  # [E, D, F]
    "experts_down": ((None, MODEL, None), (MODEL, None, None)),  # [E, F, D]
    "experts_gate_bias": ((None, MODEL), (MODEL, None)),  # [E, F] (GPT-OSS)
    "experts_up_bias": ((None, MODEL), (MODEL, None)),  # [E, F]
    "experts_down_bias": ((), (MODEL, None)),  # [E, D]
}
KV_CACHE_SPEC = (None, None, MODEL, None)  # [P, S, K', H]
