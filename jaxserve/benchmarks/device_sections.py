"""The engine sections of scripts/bench_on_device.py, in order and within its time budget:
the JAX engine on random weights, then 1. throughput, 2. decode step times against the
weight-bandwidth floor, 3. HF transformers generate on the same device and requests, 4. the
torch backend (torch_section.py), 5. int8 weights, FP8 and W4A16 checkpoint formats and an
fp8 KV cache, each in an engine of its own. Each section's numbers, skips and failures go to
the Report.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import numpy as np

from jaxserve.benchmarks.device_plan import (
    Clock,
    Plan,
    Report,
    quantization_config,
    write_model_folder,
)
from jaxserve.benchmarks.engine_measures import (
    add_floor,
    free_device_memory,
    measure_decode,
    run_stream,
    throughput_line,
)
from jaxserve.benchmarks.hf_baseline import run_hf_random_weights
from jaxserve.benchmarks.torch_section import run_torch_section, torch_unavailable
from jaxserve.benchmarks.workloads import FIRST_REGULAR_ID, Workload, make_workload

# The quantized section's engines, in order: extra engine arguments on the bf16 model's
# folder, or (checkpoint) a published format whose quantization_config (device_plan.
# quantization_config, groups sized to the model) goes in a folder of its own: random weights
# in that format's stored layout, which the compiled step computes with.
QUANTIZED = {"int8 weights": {"engine_args": {"quantization": "int8"}},
             "fp8 weights": {"checkpoint": "fp8"},
             "w4a16 weights": {"checkpoint": "w4a16"},
             "fp8 kv": {"engine_args": {"kv_cache_dtype": "fp8"}}}


def run_engine_sections(report: Report, folder: pathlib.Path, seed: int,
                        save=lambda: None) -> None:
    """Build the engine on random weights, run the three sections the budget allows, then
    the torch backend's (save() first writes what is in)."""
    plan, clock, data = report.plan, report.clock, report.data
    llm, floor_s = build_engine(report, folder, seed)
    engine = llm.engine
    id_limit = min(len(llm.get_tokenizer()), plan.model_config["vocab_size"])
    workload = engine_workload(report, seed, id_limit)

    # The JAX and HF sections leave the torch backend's section (4.) and the quantized
    # engines' (5.) the time they need.
    torch_why = torch_unavailable(data["backend"])
    reserve = plan.need["quantized"] + (plan.need["torch"] if torch_why is None else 0.0)
    deadline = clock.deadline - reserve

    # 1. throughput, TTFT, ITL
    if report.fits("throughput", reserve):
        try:
            data["throughput"] = run_stream(engine, workload, "r", deadline)
            clock.say(throughput_line("throughput", data["throughput"]))
        except Exception as err:  # noqa: BLE001 - report it, run the other sections
            report.failed("throughput", err)

    # 2. decode step time against the weight-bandwidth floor
    run_decode_section(report, engine, seed, id_limit, floor_s, reserve, deadline)

    # 3. HF transformers generate on the same device, same requests
    if report.fits("hf", reserve):
        try:
            data["hf"] = run_hf_section(engine, plan, workload, data["backend"], clock,
                                        deadline)
            if "skipped" in data["hf"]:
                data["skipped"]["hf"] = data["hf"]["skipped"]
        except Exception as err:  # noqa: BLE001
            report.failed("hf", err)

    # 4. the torch backend on the same model, workload and decode batches
    if torch_why is not None:
        report.skip("torch", torch_why)
    elif report.fits("torch", plan.need["quantized"]):
        save()
        run_torch_section(report, folder, workload, jax_runner=engine.runner,
                          id_limit=id_limit, seed=seed,
                          deadline=clock.deadline - plan.need["quantized"])

    # 5. int8, FP8 and W4A16 weights and an fp8 KV cache, each in an engine of its own (this
    # one freed)
    llm = engine = None
    free_device_memory()
    if report.fits("quantized"):
        save()
        run_quantized_section(report, folder, id_limit=id_limit, seed=seed)


def build_engine(report: Report, folder: pathlib.Path, seed: int) -> tuple:
    """The bf16 engine on random weights, every bucket compiled: (the LLM, the weight-read
    floor of one step in seconds); its weights and KV cache go in the report."""
    import jax

    from jaxserve import LLM

    plan, clock, data = report.plan, report.clock, report.data
    write_model_folder(folder, plan.model_config)
    engine_args = dict(load_format="dummy", dtype="bfloat16", seed=seed, precompile=True,
                       **plan.engine_args)
    data["engine_args"] = engine_args
    clock.say(f"building the engine (random weights on the device, compiling every bucket): "
              f"{plan.engine_args}")
    start = time.perf_counter()
    llm = LLM(str(folder), **engine_args)
    engine = llm.engine
    data["warm_up_s"] = time.perf_counter() - start
    leaves = jax.tree.leaves(engine.runner.params)
    weight_bytes = sum(leaf.nbytes for leaf in leaves)
    floor_s = weight_bytes / data["bandwidth"]["bytes_per_s"]
    data["weights"] = {"bytes": weight_bytes, "params": sum(leaf.size for leaf in leaves),
                       "floor_s": floor_s}
    data["kv_cache"] = {"blocks": engine.runner.num_blocks,
                        "bytes_per_block": engine.runner.bytes_per_block}
    clock.say(f"engine ready in {data['warm_up_s']:.1f} s: {data['weights']['params'] / 1e9:.3f}"
              f" B parameters, {weight_bytes / 1e9:.3f} GB of weights -> weight-read floor "
              f"{1e3 * floor_s:.3f} ms per step")
    return llm, floor_s


def engine_workload(report: Report, seed: int, id_limit: int) -> Workload:
    """The sharegpt-like requests every section runs (token ids in [FIRST_REGULAR_ID,
    id_limit))."""
    workload = make_workload(argparse.Namespace(workload="sharegpt-like", seed=seed,
                                                num_prompts=report.plan.requests), id_limit,
                             None)
    report.data["workload"] = {"name": workload.name, "requests": len(workload.prompts),
                               "prompt_tokens": workload.prompt_tokens,
                               "output_tokens": workload.output_tokens,
                               "token_ids": [FIRST_REGULAR_ID, id_limit]}
    report.clock.say(f"workload {workload.name}: {len(workload.prompts)} requests, "
                     f"{workload.prompt_tokens} prompt + {workload.output_tokens} output "
                     f"tokens (ids in [{FIRST_REGULAR_ID}, {id_limit}))")
    return workload


def run_decode_section(report: Report, engine, seed: int, id_limit: int, floor_s: float,
                       reserve: float, deadline: float) -> None:
    """Decode step times of each batch against the weight-read floor; the largest batch
    again with synchronous scheduling (what hiding host work gains)."""
    plan, clock, data = report.plan, report.clock, report.data
    rng = np.random.default_rng(seed + 1)
    data["decode"] = {"batches": []}
    for batch in plan.decode_batches:
        if not report.fits("decode", reserve):
            break
        try:
            r = measure_decode(engine, batch, plan.decode_prompt, plan.decode_steps, rng,
                               id_limit, deadline)
        except TimeoutError as err:
            report.skip("decode", f"batch {batch}: {err}")
            break
        except Exception as err:  # noqa: BLE001
            report.failed("decode", err)
            break
        data["decode"]["batches"].append(r)
        clock.say(f"decode batch {batch:3d}: " + add_floor(r, plan, data["bandwidth"], floor_s))
        if batch == plan.decode_batches[-1] and report.fits("decode", reserve):
            engine.async_scheduling = False
            try:
                sync = measure_decode(engine, batch, plan.decode_prompt, plan.decode_steps,
                                      rng, id_limit, deadline)
                r["sync_step_s"] = sync["step_s"]
                r["async_speedup"] = sync["step_s"] / r["step_s"]
                clock.say(f"decode batch {batch:3d} with async scheduling off: step "
                          f"{1e3 * sync['step_s']:.3f} ms; async scheduling is "
                          f"{r['async_speedup']:.2f}x faster per step")
            except Exception as err:  # noqa: BLE001 - report it, run the other sections
                report.failed("decode", err)
            finally:
                engine.async_scheduling = True


def run_hf_section(engine, plan: Plan, workload: Workload, backend: str, clock: Clock,
                   deadline: float | None = None) -> dict:
    deadline = clock.deadline if deadline is None else deadline
    subset = Workload(f"{workload.name} (first {plan.hf_requests})",
                      workload.prompts[:plan.hf_requests],
                      workload.output_lens[:plan.hf_requests])
    ours = run_stream(engine, subset, "hf", deadline)
    clock.say(throughput_line(f"jaxserve on the first {plan.hf_requests} requests", ours))
    if ours["truncated"]:
        why = "the time budget ran out while jaxserve ran the same requests"
        clock.say(f"HF baseline SKIPPED: {why}")
        return {"requests": plan.hf_requests, "jaxserve": ours, "skipped": why}
    clock.say(f"HF transformers generate: static batches of {plan.hf_batch}, left padding, "
              f"greedy, random {'bf16' if backend == 'gpu' else 'float32'} weights")
    hf = run_hf_random_weights(plan.model_config, subset, plan.hf_batch, backend == "gpu",
                               deadline)
    section = {"requests": plan.hf_requests, "jaxserve": ours, "transformers": hf}
    if "skipped" in hf:
        section["skipped"] = hf["skipped"]
        clock.say(f"HF baseline SKIPPED: {hf['skipped']}")
        return section
    # Output tok/s over the requests each side ran (HF may stop early on the budget).
    section["ratio"] = ours["output_tok_s"] / hf["output_tok_s"]
    clock.say(f"HF: {hf['requests']} requests in {hf['wall_s']:.1f} s, {hf['output_tok_s']:.1f} "
              f"output tok/s ({hf['generated_tokens']} generated for {hf['output_tokens']} "
              f"asked; model built in {hf['build_s']:.1f} s) -> jaxserve / HF "
              f"{section['ratio']:.2f}x")
    return section


def run_quantized_section(report: Report, folder: pathlib.Path, *, id_limit: int,
                          seed: int) -> None:
    """Decode step times of the bf16 engine's model with int8 weights (quantized while
    loading), with FP8-block and W4A16 weights (a checkpoint published in that format: a
    folder whose config.json has its quantization_config, random codes and scales in its
    layout, computed with in the step) and with an fp8 KV cache, one engine at a time (the
    bf16 engine already freed, so each gets the same memory budget: smaller weights leave
    more room for KV blocks, an fp8 cache holds twice the blocks), shapes compiled on first
    use (before the timed steps); the same prompts as the decode section.
    data["quantized"][variant]: engine_args or quantization_config, weights (bytes, floor_s,
    bytes_vs_bf16 = these bytes / bf16's), KV blocks and decode batches, each with
    vs_bf16 = bf16 step time / this step time (> 1: faster), weight_bytes_per_token (weight
    bytes / tokens per step) and bytes_per_token_vs_bf16 (/ bf16's at that batch: < 1 reads
    fewer). Failures are reported per variant; the engine is freed after each."""
    import jax

    from jaxserve import LLM

    plan, clock, data = report.plan, report.clock, report.data
    section = data.setdefault("quantized", {})
    bf16_batches = {b["batch"]: b for b in data.get("decode", {}).get("batches", [])}
    bf16_bytes = data.get("weights", {}).get("bytes")
    share = plan.need["quantized"] / len(QUANTIZED)
    with tempfile.TemporaryDirectory(prefix="bench-quantized-") as tmp:
        for n, (name, variant) in enumerate(QUANTIZED.items()):
            deadline = clock.deadline - share * (len(QUANTIZED) - n - 1)
            extra = variant.get("engine_args", {})
            model = folder
            if "checkpoint" in variant:
                qc = quantization_config(variant["checkpoint"], plan.model_config)
                entry = section.setdefault(name, {"quantization_config": qc})
                model = pathlib.Path(tmp) / variant["checkpoint"]
                model.mkdir(exist_ok=True)
                write_model_folder(model, {**plan.model_config, "quantization_config": qc})
            else:
                entry = section.setdefault(name, {"engine_args": extra})
            llm = None
            try:
                if deadline - time.perf_counter() < plan.need["decode"]:
                    raise TimeoutError("no time left in the budget")
                clock.say(f"building the {name} engine (random weights, buckets on first use)")
                start = time.perf_counter()
                llm = LLM(str(model), **dict(data["engine_args"], precompile=False, **extra))
                runner = llm.engine.runner
                entry["start_s"] = time.perf_counter() - start
                weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.params))
                floor_s = weight_bytes / data["bandwidth"]["bytes_per_s"]
                entry.update(weights={"bytes": weight_bytes, "floor_s": floor_s},
                             kv_blocks=runner.num_blocks, bytes_per_block=runner.bytes_per_block)
                vs_bytes = ""
                if bf16_bytes:
                    entry["weights"]["bytes_vs_bf16"] = weight_bytes / bf16_bytes
                    vs_bytes = f" ({entry['weights']['bytes_vs_bf16']:.3f}x bf16's)"
                clock.say(f"{name}: {weight_bytes / 1e9:.3f} GB of weights{vs_bytes}, "
                          f"{runner.num_blocks} KV blocks of {runner.bytes_per_block} B")
                rng = np.random.default_rng(seed + 1)  # prompts drawn as the decode section's
                entry["decode"] = {"batches": []}
                for batch in plan.quantized_batches:
                    r = measure_decode(llm.engine, batch, plan.decode_prompt, plan.decode_steps,
                                       rng, id_limit, deadline)
                    line = add_floor(r, plan, data["bandwidth"], floor_s,
                                     kv_itemsize=1 if "kv_cache_dtype" in extra else 2)
                    line += compare_bf16(r, name, weight_bytes, bf16_batches.get(batch),
                                         bf16_bytes)
                    entry["decode"]["batches"].append(r)
                    clock.say(f"{name} decode batch {batch:3d}: {line}")
            except TimeoutError as err:
                entry["skipped"] = str(err)
                data["skipped"][f"quantized {name}"] = str(err)
                clock.say(f"SKIPPED {name}: {err}")
            except Exception as err:  # noqa: BLE001 - the other numbers stand
                report.failed(f"quantized {name}", err)
            finally:
                if llm is not None:
                    llm.engine.close()
                llm = runner = None
                free_device_memory()


def compare_bf16(r: dict, name: str, weight_bytes: int, bf16: dict | None,
                 bf16_bytes: int | None) -> str:
    """Add a quantized engine's decode batch's ratios against the bf16 engine's same batch
    (bf16: its decode result, when the decode section measured it): vs_bf16 = bf16 step
    time / this one (> 1: faster); weight_bytes_per_token = weight bytes / tokens per step
    and bytes_per_token_vs_bf16 = that / bf16's (< 1: fewer bytes read per token, what a
    weight-bandwidth-bound decode step gains). The line's tail."""
    r["weight_bytes_per_token"] = weight_bytes / max(r["tokens_per_step"], 1e-9)
    if bf16 is None:
        return ""
    r["vs_bf16"] = bf16["step_s"] / r["step_s"]
    line = f"; bf16 / {name} step time {r['vs_bf16']:.2f}x"
    if bf16_bytes:
        per_token = bf16_bytes / max(bf16["tokens_per_step"], 1e-9)
        r["bytes_per_token_vs_bf16"] = r["weight_bytes_per_token"] / per_token
        line += f", weight bytes per token {r['bytes_per_token_vs_bf16']:.3f}x bf16's"
    return line
