"""The engine's device functions compiled for hardware that is not here, from shapes alone.

A ShapesOnlyRunner is the ModelRunner of a configuration on a mesh of compile-only devices
(compile_targets.py: libtpu's TPU topologies, a CUDA target config): the same model, KV
cache, penalty state, LoRA slots and jitted functions, with every array a
jax.ShapeDtypeStruct on the sharding the runner would give it, and the KV cache of the
number of blocks `jaxserve plan` gives (nothing is measured on a device). compile_engine
lowers and compiles each function a warm-up would (bucket_compiler.py's keys) with the
target's real compiler (XLA:TPU and Mosaic, XLA:GPU), and reads per function its
compiler's memory_analysis (bytes per device: arguments, outputs, aliased, temporaries,
code) and cost_analysis (flops, bytes accessed), or the compiler's error. Each executable
goes into the executable cache of the configuration (compilation_cache_dir), keyed as the
runner on the target's hosts keys it (executable_cache.py: the HLO, versions, devices),
so that a host of that slice with the same code and configuration (the number of KV
blocks included: --num-gpu-blocks-override) loads it instead of compiling.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.backends.jax.attend import KV_SCALE_SPEC
from jaxserve.backends.jax.runner import ModelRunner
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.mesh import AXES, param_spec
from jaxserve.config.progress import progress

logger = logging.getLogger(__name__)


class ShapesOnlyRunner(ModelRunner):
    """A ModelRunner whose arrays are their shapes: weights, KV cache (num_blocks blocks,
    the null block included), penalty state, quantized-cache scales and LoRA slots as
    ShapeDtypeStructs on their shardings. It compiles (lower(key).compile()); it cannot
    run."""

    def __init__(self, config: EngineConfig, mesh: Mesh, num_blocks: int) -> None:
        self._planned_blocks = num_blocks
        super().__init__(config, mesh)

    def _allocate(self, make):
        return jax.eval_shape(make)

    def _load_model(self, abstract: nnx.Module) -> nnx.Module:
        graphdef, state = nnx.split(abstract)
        flat = []
        for path, var in nnx.to_flat_state(state):
            like = var.get_value()
            sharding = NamedSharding(self.mesh, PartitionSpec(*param_spec(path, self.plan)))
            flat.append((path, var.replace(jax.ShapeDtypeStruct(like.shape, like.dtype,
                                                                sharding=sharding))))
        return nnx.merge(graphdef, nnx.from_flat_state(flat))

    def _num_kv_blocks(self) -> int:
        return self._planned_blocks

    def _calibrate_kv_scales(self):
        """(k_scale, v_scale) per layer: f32[K'] split as the kv heads, or latent f32[1]."""
        if self.latent_dim:
            shape, sharding = (1,), self.replicated
        else:
            shape = (self.arch.num_kv_heads,)
            sharding = NamedSharding(self.mesh, PartitionSpec(*KV_SCALE_SPEC))
        scale = jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
        return [(scale, scale) for _ in range(self.arch.num_layers)]


@dataclasses.dataclass(frozen=True)
class FunctionReport:
    """One compiled function (bucket_compiler.py's key) on one device of the target.
    Bytes per device from the compiler's memory_analysis; flops and bytes_accessed from its
    cost_analysis (None where the platform gives none); error: the compiler's, when it
    refused."""

    key: tuple
    seconds: float
    error: str | None = None
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs written over donated arguments (the KV cache, ...)
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float | None = None
    bytes_accessed: float | None = None

    @property
    def name(self) -> str:
        return "-".join(map(str, self.key))

    @property
    def peak_bytes(self) -> int:
        """HBM the function holds while it runs: its arguments, the outputs not written
        over them, its temporaries and its code."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes)


def mesh_of(devices, model: int) -> Mesh:
    """The (1, model) mesh of replica 0 over the first `model` target devices (as
    distributed.replica_mesh on the devices themselves)."""
    return Mesh(np.array(list(devices)[:model]).reshape(1, model), AXES)


def compile_engine(config: EngineConfig, devices, num_blocks: int, keys=None,
                   on_done=None) -> list[FunctionReport]:
    """Every function a warm-up compiles (or `keys`), compiled for `devices` (compile-only
    devices of one target). on_done(report) after each, in order."""
    mesh = mesh_of(devices, config.parallel.mesh.model)
    runner = ShapesOnlyRunner(config, mesh, num_blocks)
    reports = []
    for key in progress(list(keys or runner.compiled.keys()), desc="Compiling", unit="fn"):
        report = compile_function(runner, key)
        reports.append(report)
        if on_done is not None:
            on_done(report)
    return reports


def compile_function(runner: ShapesOnlyRunner, key: tuple) -> FunctionReport:
    """Key's function lowered and compiled by the target's compiler, with its analyses; a
    compiler error is reported, never raised."""
    start = time.perf_counter()
    try:
        lowered = runner.lower(key)
        compiled = lowered.compile()
    except Exception as error:  # the compiler's refusal is the report
        text = f"{type(error).__name__}: {error}"
        logger.warning("%s did not compile: %s", "-".join(map(str, key)), text[:400])
        return FunctionReport(key, time.perf_counter() - start, error=text)
    seconds = time.perf_counter() - start
    runner.store(key, lowered, compiled)  # for the target's hosts (--compilation-cache-dir)
    memory = compiled.memory_analysis()
    costs = _costs(compiled)
    return FunctionReport(
        key, seconds, None, memory.argument_size_in_bytes, memory.output_size_in_bytes,
        memory.alias_size_in_bytes, memory.temp_size_in_bytes,
        memory.generated_code_size_in_bytes, costs.get("flops"), costs.get("bytes accessed"))


def _costs(compiled) -> dict:
    """The compiled function's cost_analysis (per device), {} where the platform has none."""
    try:
        costs = compiled.cost_analysis()
    except Exception:  # (a platform without a cost model)
        return {}
    if isinstance(costs, list):  # older jax: one dict per program
        costs = costs[0] if costs else {}
    return dict(costs or {})
