"""Section 4 of scripts/bench_on_device.py: the torch backend (LLM(..., backend="torch"):
the Triton kernels and CUDA graphs on a GPU, the PyTorch reference attention on the CPU) on
the JAX engine's model folder, engine arguments, workload and decode batches, its KV cache
sized to fit beside JAX's memory pool, and the torch / JAX speed ratios. torch is imported
only inside the functions (the section is skipped without it).
"""

from __future__ import annotations

import gc
import pathlib
import time

import numpy as np

from jaxserve.benchmarks.device_plan import Report
from jaxserve.benchmarks.engine_measures import (
    add_floor,
    measure_decode,
    run_stream,
    throughput_line,
)
from jaxserve.benchmarks.workloads import Workload

TORCH_HEADROOM = 4 << 30  # bytes the torch engine needs beside weights and KV (activations,
# logits, sampler state, CUDA graph pools)


def torch_unavailable(backend: str) -> str | None:
    """Why the torch backend's section cannot run here (torch or triton not installed), or
    None."""
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as err:
        return (f"torch / triton not importable ({err}); pip install -e '.[torch]' brings "
                "both")
    return None


def torch_kv_blocks(jax_blocks: int, bytes_per_block: int, weight_bytes: int,
                    free_bytes: int | None) -> int:
    """KV blocks for the torch engine: the JAX engine's count, or on a GPU (free_bytes: what
    torch can still allocate, beside JAX's pool) fewer when that would not fit; at least 2
    (the engine then says what one sequence needs)."""
    if free_bytes is None:
        return jax_blocks
    fit = int((0.9 * free_bytes - weight_bytes - TORCH_HEADROOM) // bytes_per_block)
    return min(jax_blocks, max(fit, 2))


def torch_free_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def compare_backends(data: dict, section: dict) -> dict:
    """torch / JAX speed ratios (> 1: the torch backend is faster): output and total tok/s
    of the throughput run, and per decode batch JAX step time / torch step time."""
    ratios: dict = {}
    jax_run, torch_run = data.get("throughput", {}), section.get("throughput", {})
    if "output_tok_s" in jax_run and "output_tok_s" in torch_run:
        ratios["output_tok_s"] = torch_run["output_tok_s"] / jax_run["output_tok_s"]
        ratios["total_tok_s"] = torch_run["total_tok_s"] / jax_run["total_tok_s"]
        ratios["truncated"] = jax_run["truncated"] or torch_run["truncated"]
    jax_steps = {r["batch"]: r["step_s"] for r in data.get("decode", {}).get("batches", [])}
    decode = {str(r["batch"]): jax_steps[r["batch"]] / r["step_s"]
              for r in section.get("decode", {}).get("batches", []) if r["batch"] in jax_steps}
    if decode:
        ratios["decode_step"] = decode
    return ratios


def run_torch_section(report: Report, folder: pathlib.Path, workload: Workload, *,
                      jax_runner, id_limit: int, seed: int,
                      deadline: float | None = None) -> None:
    """The torch backend on the JAX engine's model folder, engine arguments (backend="torch",
    the KV blocks of torch_kv_blocks), workload and decode batches (the same prompts); the
    results and the torch / JAX ratios go to data["torch"]. An engine that cannot start or a
    run that fails is reported (errors["torch"]), never raised; the engine is freed after."""
    import torch

    from jaxserve import LLM

    plan, clock, data = report.plan, report.clock, report.data
    deadline = clock.deadline if deadline is None else deadline
    section = data.setdefault("torch", {})
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    llm = None
    gc.collect()  # what the HF section left is free for the torch engine
    try:
        if data["backend"] == "gpu" and not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} cannot use the GPU "
                               "(torch.cuda.is_available() is False: a CPU-only build?)")
        blocks = torch_kv_blocks(jax_runner.num_blocks, jax_runner.bytes_per_block,
                                 data["weights"]["bytes"], torch_free_bytes())
        engine_args = dict(data["engine_args"], backend="torch", num_gpu_blocks_override=blocks)
        section.update(engine_args=engine_args, jax_kv_blocks=jax_runner.num_blocks)
        clock.say(f"building the torch backend's engine (random weights, "
                  f"{'capturing every bucket' if torch.cuda.is_available() else 'eager'}): "
                  f"{blocks} KV blocks (JAX: {jax_runner.num_blocks})")
        start = time.perf_counter()
        llm = LLM(str(folder), **engine_args)
        engine = llm.engine
        section["warm_up_s"] = time.perf_counter() - start
        params = list(engine.runner.model.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        floor_s = weight_bytes / data["bandwidth"]["bytes_per_s"]
        section["weights"] = {"bytes": weight_bytes, "params": sum(p.numel() for p in params),
                              "floor_s": floor_s}
        section["device"] = str(getattr(engine.runner, "device", "?"))
        section["cuda_graphs"] = getattr(engine.runner, "graphs", None) is not None
        clock.say(f"torch engine ready in {section['warm_up_s']:.1f} s on {section['device']} "
                  f"(CUDA graphs: {'yes' if section['cuda_graphs'] else 'no'}): "
                  f"{weight_bytes / 1e9:.3f} GB of weights")

        section["throughput"] = run_stream(engine, workload, "t", deadline)
        clock.say(throughput_line("torch throughput", section["throughput"]))

        rng = np.random.default_rng(seed + 1)  # the JAX decode section's prompts
        section["decode"] = {"batches": []}
        for batch in plan.decode_batches:
            left = deadline - time.perf_counter()
            why = None
            if left < plan.need["decode"]:
                why = f"{left:.0f} s left, a decode batch needs about {plan.need['decode']} s"
            else:
                try:
                    r = measure_decode(engine, batch, plan.decode_prompt, plan.decode_steps,
                                       rng, id_limit, deadline)
                except TimeoutError as err:
                    why = str(err)
            if why is not None:
                section["decode"]["skipped"] = f"batch {batch} and up: {why}"
                data["skipped"]["torch decode"] = section["decode"]["skipped"]
                clock.say(f"SKIPPED torch decode: {section['decode']['skipped']}")
                break
            section["decode"]["batches"].append(r)
            clock.say(f"torch decode batch {batch:3d}: " +
                      add_floor(r, plan, data["bandwidth"], floor_s))
    except Exception as err:  # noqa: BLE001 - the JAX numbers stand
        report.failed("torch", err)
    finally:
        section["vs_jax"] = compare_backends(data, section)
        if llm is not None:
            llm.engine.close()
        llm = engine = None
        gc.collect()  # the runner and its graph cache refer to each other
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
    if section["vs_jax"]:
        clock.say("torch / JAX speed: " + ratios_line(section["vs_jax"]))


def ratios_line(ratios: dict) -> str:
    parts = []
    if "output_tok_s" in ratios:
        parts.append(f"throughput {ratios['output_tok_s']:.2f}x output tok/s, "
                     f"{ratios['total_tok_s']:.2f}x total tok/s"
                     + (" (a run was truncated)" if ratios["truncated"] else ""))
    parts += [f"decode batch {b} {ratio:.2f}x"
              for b, ratio in ratios.get("decode_step", {}).items()]
    return "; ".join(parts)
