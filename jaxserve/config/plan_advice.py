"""What `jaxserve plan` says around one plan: the meshes a rented shape can take, and what
fits when the asked configuration does not.

Every number here is a plan.make_plan of a changed EngineConfig, so it is the engine's own
arithmetic (the same weights table, KV sizing and block accounting), never an estimate of
its own. Changes are tried in the order that keeps the most of the model's quality: a wider
model axis (the same numbers, computed on more devices), int8 weights, an fp8 KV cache,
then a shorter max_model_len (the model itself unchanged, but it serves shorter requests).
Host-side: no jax import.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config.accelerators import DevicePreset
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_sizing import ITEMSIZE, cache_element
from jaxserve.config.mesh import MeshShape, ModelDims, plan_sharding
from jaxserve.config.plan import DoesNotFit, Plan, make_plan, plan_dict
from jaxserve.config.plan_text import format_plan, size_text

MAX_MODEL_AXIS = 64  # the widest model axis a wider-axis suggestion tries without a preset


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One configuration tried: the flags that make it (beside the user's) and its plan, or
    why it does not fit (DoesNotFit.brief)."""

    flags: tuple[str, ...]  # e.g. ("--quantization int8", "--kv-cache-dtype fp8")
    mesh: MeshShape
    plan: Plan | None
    reason: str = ""

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def total_sequences(self) -> int:
        """Sequences of max_model_len all replicas hold at once (0 when it does not fit)."""
        return self.mesh.data * self.plan.max_concurrency if self.plan else 0

    def numbers(self) -> str:
        """'weights 8.46 GiB per device, 46,352 KV tokens, 5 sequences of max_model_len=8192
        (5.66)': one replica's capacity."""
        p = self.plan
        if p is None:
            return f"does not fit: {self.reason}"
        return (f"weights {size_text(p.weight_bytes_per_device)} per device, {p.kv_tokens:,} KV "
                f"tokens, {p.max_concurrency:,} sequences of max_model_len={p.max_model_len} "
                f"({p.concurrency:.2f})")

    def as_dict(self) -> dict:
        out = {"flags": list(self.flags), "mesh": str(self.mesh), "fits": self.fits}
        if self.plan is None:
            return {**out, "reason": self.reason}
        p = self.plan
        return {**out, "weight_bytes_per_device": p.weight_bytes_per_device,
                "kv_tokens": p.kv_tokens, "max_model_len": p.max_model_len,
                "max_concurrency": p.max_concurrency, "concurrency": p.concurrency,
                "total_kv_tokens": self.mesh.data * p.kv_tokens,
                "total_sequences": self.total_sequences}


def variant(config: EngineConfig, *, mesh: MeshShape | None = None,
            quantization: str | None = None, kv_cache_dtype: str | None = None,
            max_model_len: int | None = None) -> EngineConfig:
    """config with the given settings changed (None: kept)."""
    model, cache = config.model, config.cache
    scheduler, parallel = config.scheduler, config.parallel
    if quantization is not None:
        model = dataclasses.replace(model, quantization=quantization)
    if max_model_len is not None:
        model = dataclasses.replace(model, max_model_len=max_model_len)
        scheduler = dataclasses.replace(scheduler, max_model_len=max_model_len)
    if kv_cache_dtype is not None:
        cache = dataclasses.replace(cache, kv_cache_dtype=kv_cache_dtype)
    if mesh is not None:
        parallel = dataclasses.replace(parallel, mesh=mesh)
    return dataclasses.replace(config, model=model, cache=cache, scheduler=scheduler,
                               parallel=parallel)


def attempt(config: EngineConfig, memory: int, flags: tuple[str, ...] = (),
            tiled: bool = False) -> Outcome:
    """make_plan of config, as an Outcome."""
    try:
        return Outcome(flags, config.parallel.mesh, make_plan(config, memory, tiled=tiled))
    except DoesNotFit as err:
        return Outcome(flags, config.parallel.mesh, None, err.brief)


def splits(config: EngineConfig, model_axis: int) -> bool:
    """Whether the model's heads (and experts) split over a model axis of this size."""
    try:
        plan_sharding(ModelDims.from_hf(config.model.hf_config), model_axis,
                      config.parallel.expert_parallel)
    except ValueError:
        return False
    return True


def mesh_options(config: EngineConfig, memory: int, num_devices: int,
                 tiled: bool = False) -> tuple[Outcome, ...]:
    """Every DxM mesh with D * M = num_devices whose model axis M the model splits over, most
    replicas first, each with its plan or why it does not fit."""
    return tuple(attempt(variant(config, mesh=MeshShape(num_devices // m, m)), memory,
                         (f"--mesh {num_devices // m}x{m}",), tiled)
                 for m in range(1, num_devices + 1)
                 if num_devices % m == 0 and splits(config, m))


def best_mesh(options: tuple[Outcome, ...]) -> Outcome | None:
    """The fitting mesh that holds the most sequences of max_model_len over all replicas
    (then the most KV tokens, then the most replicas); None when none fits."""
    fitting = [o for o in options if o.fits]
    if not fitting:
        return None
    return max(fitting, key=lambda o: (o.total_sequences, o.mesh.data * o.plan.kv_tokens,
                                       o.mesh.data))


def suggest(config: EngineConfig, memory: int,
            max_devices: int | None = None, tiled: bool = False) -> tuple[Outcome, ...]:
    """What would fit where config does not, most quality kept first: each change alone
    (the narrowest wider model axis that fits, within max_devices; int8 weights; an fp8 KV
    cache, latent caches included; the longest max_model_len that fits), then, when none fits alone, int8 weights and an fp8 KV cache together, and with
    the longest max_model_len that fits if that is not enough. Changes that are already
    made are skipped."""
    mesh, found = config.parallel.mesh, []
    widest = (max_devices // mesh.data if max_devices else MAX_MODEL_AXIS)
    for m in range(mesh.model + 1, widest + 1):
        if splits(config, m):
            wider = attempt(variant(config, mesh=MeshShape(mesh.data, m)), memory,
                            (f"--mesh {mesh.data}x{m}",), tiled)
            if wider.fits:
                found.append(wider)
                break
    steps = []
    if config.model.weights_scheme is None:
        steps.append(({"quantization": "int8"}, "--quantization int8"))
    element = cache_element(config.model.dtype, config.cache.kv_cache_dtype)
    if ITEMSIZE[element] > 1:
        steps.append(({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"))
    for change, flag in steps:
        found.append(attempt(variant(config, **change), memory, (flag,), tiled))
    found.append(shorter_max_model_len(config, memory, tiled=tiled))
    if steps and not any(o and o.fits for o in found):  # all of them together
        change = {k: v for step, _ in steps for k, v in step.items()}
        flags = tuple(flag for _, flag in steps)
        every = (attempt(variant(config, **change), memory, flags, tiled) if len(steps) > 1
                 else None)
        found.append(every if every is not None and every.fits
                     else shorter_max_model_len(variant(config, **change), memory, flags,
                                                tiled))
    return tuple(o for o in found if o is not None)


def shorter_max_model_len(config: EngineConfig, memory: int,
                          flags: tuple[str, ...] = (), tiled: bool = False) -> Outcome | None:
    """The longest max_model_len below config's that fits (a multiple of 1024, or of
    block_size below 2048), found by bisection over make_plan: what one sequence holds only
    grows with its length, so the lengths that fit are those up to some bound. None when
    there is no shorter length to try; the shortest one's outcome when none fits."""
    current = config.model.max_model_len
    step = 1024 if current >= 2048 else config.cache.block_size
    low, high = 1, (current - 1) // step  # lengths step * [low, high]
    if high < 1:
        return None

    def at(length: int) -> Outcome:
        return attempt(variant(config, max_model_len=length), memory,
                       (*flags, f"--max-model-len {length}"), tiled)

    best = at(step)
    if not best.fits:
        return best
    while low < high:
        mid = (low + high + 1) // 2
        trial = at(step * mid)
        if trial.fits:
            low, best = mid, trial
        else:
            high = mid - 1
    return best


def format_suggestions(outcomes: tuple[Outcome, ...], where: str) -> str:
    """The suggestion lines `jaxserve plan` prints when the configuration does not fit."""
    lines = [f"What fits {where}, keeping the most quality first (numbers per replica):"]
    width = max((len(" ".join(o.flags)) for o in outcomes), default=0)
    for o in outcomes:
        verdict = "fits: " if o.fits else ""
        lines.append(f"  {' '.join(o.flags):<{width}}  {verdict}{o.numbers()}")
    if not any(o.fits for o in outcomes):
        lines.append("  nothing above fits: a larger device (or more of them) is needed")
    return "\n".join(lines)


def format_meshes(options: tuple[Outcome, ...], preset: DevicePreset,
                  chosen: Outcome | None) -> str:
    """The mesh table for a multi-device preset: per replica and in total."""
    lines = [f"meshes       on {preset.num_devices} devices (data x model), per replica and "
             "over all replicas:",
             f"  {'mesh':<7} {'weights/device':>14} {'KV tokens':>12} {'seqs':>6} "
             f"{'total KV tokens':>16} {'total seqs':>11}"]
    for o in options:
        if not o.fits:
            continue
        p = o.plan
        lines.append(f"  {str(o.mesh):<7} {size_text(p.weight_bytes_per_device):>14} "
                     f"{p.kv_tokens:>12,} {p.max_concurrency:>6,} "
                     f"{o.mesh.data * p.kv_tokens:>16,} {o.total_sequences:>11,}")
    for o in options:
        if not o.fits:
            lines.append(f"  {str(o.mesh):<7} does not fit: {o.reason}")
    if chosen is not None:
        lines.append(f"  the plan below is {chosen.mesh}, the mesh that holds the most "
                     "sequences of max_model_len; choose another with --mesh")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """What `jaxserve plan` prints: the plan (None when nothing asked for fits), the mesh
    table of a multi-device preset, and the suggestions when the plan does not fit."""

    plan: Plan | None
    memory_bytes: int  # of one device
    dtype: str  # the model's (ModelConfig.dtype)
    preset: DevicePreset | None = None
    meshes: tuple[Outcome, ...] = ()
    chosen: Outcome | None = None
    error: str = ""  # DoesNotFit.shortfall (the suggestions say what helps)
    suggestions: tuple[Outcome, ...] = ()


def plan_report(config: EngineConfig, memory: int, preset: DevicePreset | None = None, *,
                mesh_given: bool = True) -> PlanReport:
    """The plan of config on devices of `memory` bytes, or on a preset's devices. With a
    multi-device preset and no mesh given, every mesh it can take is planned and the plan
    is the one that holds the most sequences. ValueError for a mesh larger than the
    preset. A TPU preset's KV cache is sized as a TPU lays it out (kv_sizing.tpu_tiled)."""
    tiled = preset is not None and preset.device.platform == "tpu"
    need = config.parallel.mesh.num_devices
    if preset is not None and mesh_given and need > preset.num_devices:
        raise ValueError(f"mesh {config.parallel.mesh} needs {need} devices, but "
                         f"{preset.name} has {preset.num_devices}; give a mesh of at most "
                         f"{preset.num_devices} devices (or none, to see them all).")
    meshes, chosen = (), None
    if preset is not None and preset.num_devices > 1 and not mesh_given:
        meshes = mesh_options(config, memory, preset.num_devices, tiled)
        chosen = best_mesh(meshes)
        # none fits: the widest model axis, whose suggestions need the fewest changes
        config = variant(config, mesh=chosen.mesh if chosen else meshes[-1].mesh)
    try:
        return PlanReport(make_plan(config, memory, tiled=tiled), memory, config.model.dtype,
                          preset, meshes, chosen)
    except DoesNotFit as err:
        return PlanReport(None, memory, config.model.dtype, preset, meshes, None,
                          err.shortfall, suggest(
            config, memory, preset.num_devices if preset is not None else None, tiled))


def format_report(report: PlanReport) -> str:
    """The report's text for stdout (the error itself goes to stderr)."""
    parts = []
    if report.preset is not None:
        device = report.preset.device
        line = f"device       {report.preset.describe()}"
        if not device.kernel:
            line += (f"\n             {device.name}: {device.kernel_note}; attention_backend="
                     "auto uses the reference attention there")
        if report.dtype != device.dtype:
            line += (f"\n             the model runs in {report.dtype}; {device.name} computes "
                     f"in {device.dtype} (--dtype {device.dtype})")
        parts.append(line)
    if report.meshes:
        parts.append(format_meshes(report.meshes, report.preset, report.chosen))
    if report.plan is not None:
        parts.append(format_plan(report.plan))
    else:
        where = (f"on {report.preset.name}" if report.preset is not None
                 else f"on devices of {size_text(report.memory_bytes)}")
        parts.append(format_suggestions(report.suggestions, where))
    return "\n\n".join(parts)


def report_dict(report: PlanReport) -> dict:
    """The report as plain JSON values (`jaxserve plan --json`)."""
    out = plan_dict(report.plan) if report.plan is not None else {
        "fits": False, "error": report.error,
        "suggestions": [o.as_dict() for o in report.suggestions]}
    if report.preset is not None:
        p = report.preset
        out["device"] = {"preset": p.name, "accelerator": p.accelerator,
                         "num_devices": p.num_devices, "num_hosts": p.num_hosts,
                         "memory_bytes": p.memory_bytes, "pallas_kernel": p.device.kernel}
    if report.meshes:
        out["meshes"] = [o.as_dict() for o in report.meshes]
    return out
