"""compile_case: one engine's functions compiled for libtpu's v5e:2x2 with `--mesh 2x2`,
checked against `jaxserve plan` (tests/backends/test_tpu_compile*.py).

The tiny checkpoints' head_dim of 16 fills an eighth of a TPU tile's 128 lanes, which no
published model does (64 to 256), and XLA:TPU lays such arrays out otherwise (transposed,
or re-laid-out to shed the padding), so the compiled functions would not be a real
model's. Compiling reads only config.json: tpu_shaped gives the tiny model its family's
published head size (128; GPT-OSS 64, which a TPU pads to 128 lanes; DeepSeek's latent
cache of 512 + 64) in a copy of its folder."""

from __future__ import annotations

import json
import pathlib

from jaxserve.backends.jax.compile_only import compile_engine
from jaxserve.backends.jax.compile_targets import target_devices
from jaxserve.config.accelerators import preset
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.plan_advice import plan_report

DEVICE = preset("v5e-4")  # libtpu's v5e:2x2: 4 chips of 16 GiB on one host
# Small buckets: the functions' code is the engine's at any size. A KV cache of 4 GiB per
# device, far larger than anything else, so that a copy of it shows in the temporaries,
# and far from the HBM's 16 GiB: near it, XLA:TPU trades memory for time on its own (it
# keeps idle layers' caches re-laid-out without their lane padding, which the tiny
# models' head_dim of 16 makes 8x), which would hide what the step itself needs.
LIMITS = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 256,
          "kv_cache_memory_bytes": 4 << 30}


# head_dim of the published models of a family, by config.json's model_type (default 128)
HEAD_DIMS = {"gpt_oss": 64}


def tpu_shaped(folder, out: pathlib.Path) -> pathlib.Path:
    """A copy of a tiny checkpoint's folder (links, but for config.json) whose heads have
    its family's published size: HEAD_DIMS, or DeepSeek's latent cache of 512 + 64 with
    128-wide heads."""
    folder = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.name != "config.json":
            (out / path.name).symlink_to(path)
    config = json.loads((folder / "config.json").read_text())
    config["head_dim"] = HEAD_DIMS.get(config.get("model_type"), 128)
    if config.get("kv_lora_rank"):
        config.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                      v_head_dim=128)
    (out / "config.json").write_text(json.dumps(config))
    return out


def compile_case(folder, dtype: str, options: dict, extra=()) -> list:
    """The largest step bucket (and `extra`'s functions: keys, or "pool" for the pooling
    function of that bucket) of the engine of `options` on `folder`, compiled for the
    target; asserts each compiled, that no temporaries hold a layer's KV cache, and that
    the step's arguments are the plan's resident bytes within 10%."""
    config = EngineConfig.create(str(folder), dtype=dtype, mesh="2x2", on_accelerator=True,
                                 compilation_cache_dir=None, **LIMITS, **options)
    report = plan_report(config, DEVICE.memory_bytes, DEVICE)
    assert report.plan is not None, report.error
    plan = report.plan
    step = ("step", *config.scheduler.step_buckets[-1])
    keys = [step] + ([("pool", *step[1:])] if extra == "pool" else list(extra))
    functions = compile_engine(config, target_devices(DEVICE), plan.num_blocks, keys)
    for f in functions:
        assert f.error is None, f"{f.name} ({dtype}) did not compile: {f.error[:2000]}"
    kv = plan.num_blocks * plan.bytes_per_block
    layer = kv // plan.groups.num_slots
    step_report = functions[0]
    assert step_report.temp_bytes < layer / 4, (
        f"{step_report.name}: {step_report.temp_bytes:,} B of temporaries against a layer's "
        f"KV cache of {layer:,} B: the step copies the cache")
    planned = plan.weight_bytes_per_device + kv + plan.sampler_state_bytes
    assert abs(step_report.argument_bytes - planned) <= 0.1 * planned, (
        step_report.argument_bytes, planned)
    return functions
