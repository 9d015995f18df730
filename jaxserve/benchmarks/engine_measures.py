"""Measurements of a running engine, driven step by step (engine.add_request / engine.step),
for the benchmark scripts: a whole workload with each token's arrival time (throughput,
TTFT, ITL), the decode step time at a batch size (against the weight-bandwidth floor, with
the device's copy bandwidth), their printed lines, and freeing the device between engines.
bench_on_device.py runs all of them; bench_kv_cache_size.py and bench_cpu_dtype.py time
decode steps with decode_step_ms.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import numpy as np

from jaxserve.benchmarks.device_plan import Plan
from jaxserve.benchmarks.workloads import FIRST_REGULAR_ID, Workload


def measure_copy_bandwidth(nbytes: int, reps: int = 10) -> dict:
    """Device memory bandwidth: a jitted elementwise x + 1 over an nbytes float32 array reads
    and writes every byte once; bandwidth = 2 x nbytes / best time."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    add = jax.jit(lambda a: a + 1.0)
    add(x).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        add(x).block_until_ready()
        times.append(time.perf_counter() - start)
    best = min(times)
    return {"array_bytes": nbytes, "reps": reps, "best_s": best,
            "median_s": float(np.median(times)), "bytes_per_s": 2 * nbytes / best}


def percentiles(values) -> dict:
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return {"count": 0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"count": int(values.size), "mean": float(values.mean()), "p50": float(p50),
            "p90": float(p90), "p99": float(p99)}


def run_stream(engine, workload: Workload, prefix: str, deadline: float) -> dict:
    """Add every request at once, then step the engine to the end, timing each token's arrival.

    Past the deadline the unfinished requests are aborted and the result says truncated."""
    from jaxserve import SamplingParams

    ids = [f"{prefix}{i}" for i in range(len(workload.prompts))]
    prompt_len = dict(zip(ids, (len(p) for p in workload.prompts)))
    counts = dict.fromkeys(ids, 0)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []
    finished: set[str] = set()
    compiles = engine.num_compilations
    start = time.perf_counter()
    for rid, prompt, out_len in zip(ids, workload.prompts, workload.output_lens):
        params = SamplingParams(temperature=0.0, max_tokens=int(out_len), ignore_eos=True)
        engine.add_request(rid, None, prompt, params)
    steps = 0
    truncated = False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            rid = out.request_id
            if out.error is not None:
                raise RuntimeError(f"request {rid} failed: {out.error}")
            count = len(out.outputs[0].token_ids)
            new = count - counts[rid]
            if new > 0:
                if rid not in first:
                    first[rid] = now
                else:
                    itl.extend([(now - last[rid]) / new] * new)
                last[rid] = now
                counts[rid] = count
            if out.finished:
                finished.add(rid)
        if now > deadline and engine.has_unfinished_requests():
            truncated = True
            for rid in ids:
                if rid not in finished:
                    engine.abort_request(rid)
            break
    wall = time.perf_counter() - start
    drain(engine)
    output_tokens = sum(counts.values())
    prompt_tokens = sum(prompt_len[r] for r in first)  # prompts that got through prefill
    if not truncated and output_tokens != workload.output_tokens:
        raise RuntimeError(f"the engine produced {output_tokens} tokens, "
                           f"{workload.output_tokens} were asked for")
    return {
        "requests": len(ids), "finished": len(finished), "truncated": truncated,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "steps": steps,
        "wall_s": wall, "requests_per_s": len(finished) / wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "ttft_s": percentiles([first[r] - start for r in first]),
        "itl_s": percentiles(itl),
        "recompilations": engine.num_compilations - compiles,
    }


def drain(engine) -> None:
    """Collect a step still on the device after every request was aborted."""
    for _ in range(4):
        if engine.in_flight is None and not engine.has_unfinished_requests():
            return
        engine.step()


def measure_decode(engine, batch: int, prompt_len: int, steps: int, rng, id_limit: int,
                   deadline: float) -> dict:
    """Wall time per engine.step() while `batch` requests all decode (median of `steps`)."""
    from jaxserve import SamplingParams

    chunk = engine.config.scheduler.max_num_batched_tokens
    # Steps until every prompt is in, with room: decodes share the token budget meanwhile.
    prefill_steps = 2 * math.ceil(batch * prompt_len / chunk) + 2
    settle = 2
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + settle + steps + 8,
                            ignore_eos=True)
    ids = [f"decode{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, None, rng.integers(FIRST_REGULAR_ID, id_limit,
                                                   prompt_len).tolist(), params)
    started: set[str] = set()
    times: list[float] = []
    tokens = 0
    generated = dict.fromkeys(ids, 0)
    context_sum = 0.0
    try:
        while len(started) < batch or settle > 0:  # until every request decodes, and then some
            if time.perf_counter() > deadline:
                raise TimeoutError("time budget spent before all requests were decoding")
            for out in engine.step():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                generated[out.request_id] = len(out.outputs[0].token_ids)
                started.add(out.request_id)
            if len(started) == batch:
                settle -= 1
        last = time.perf_counter()
        for _ in range(steps):
            outputs = engine.step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
            for out in outputs:
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                new = len(out.outputs[0].token_ids)
                tokens += new - generated[out.request_id]
                generated[out.request_id] = new
            context_sum += sum(prompt_len + g for g in generated.values())
    finally:
        for rid in ids:
            engine.abort_request(rid)
        drain(engine)
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps,
            "step_s": float(np.median(times)), "step_s_mean": float(np.mean(times)),
            "tokens_per_step": tokens / steps, "mean_context": context_sum / steps / batch}


def kv_bytes_per_token(config: dict, itemsize: int = 2) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * itemsize


def add_floor(r: dict, plan: Plan, bandwidth: dict, floor_s: float,
              kv_itemsize: int = 2) -> str:
    """Add the weight-bandwidth floor and the ratios to a decode batch's result; its line.
    kv_itemsize: bytes per KV-cache element (2: bf16; 1: an fp8 cache)."""
    kv_s = r["batch"] * r["mean_context"] * kv_bytes_per_token(plan.model_config,
                                                               kv_itemsize) / \
        bandwidth["bytes_per_s"]
    r.update(floor_s=floor_s, ratio=r["step_s"] / floor_s, floor_with_kv_s=floor_s + kv_s,
             ratio_with_kv=r["step_s"] / (floor_s + kv_s),
             output_tok_s=r["tokens_per_step"] / r["step_s"])
    return (f"step {1e3 * r['step_s']:.3f} ms (median of {r['steps']}), weight floor "
            f"{1e3 * floor_s:.3f} ms -> {r['ratio']:.2f}x; with KV reads (context "
            f"~{r['mean_context']:.0f}) {1e3 * (floor_s + kv_s):.3f} ms -> "
            f"{r['ratio_with_kv']:.2f}x; {r['output_tok_s']:.0f} tok/s")


def throughput_line(label: str, r: dict) -> str:
    ttft, itl = r["ttft_s"], r["itl_s"]
    ms = lambda p: "n/a" if p["count"] == 0 else \
        f"p50 {1e3 * p['p50']:.1f} / p90 {1e3 * p['p90']:.1f} / p99 {1e3 * p['p99']:.1f} ms"
    cut = " (TRUNCATED by the time budget)" if r["truncated"] else ""
    return (f"{label}: {r['finished']}/{r['requests']} requests in {r['wall_s']:.2f} s{cut}: "
            f"output {r['output_tok_s']:.1f} tok/s, total {r['total_tok_s']:.1f} tok/s; "
            f"TTFT {ms(ttft)}; ITL {ms(itl)}; {r['steps']} steps, "
            f"{r['recompilations']} recompilations")


def free_device_memory() -> None:
    """Delete every live JAX array and compiled function: the engine measured last is done
    with, and the next one gets the whole memory budget (a reference cycle or a cache that
    kept the old weights alive would leave it less)."""
    import jax

    gc.collect()
    jax.clear_caches()
    for array in jax.live_arrays():
        array.delete()


def decode_step_ms(llm, num_seqs: int, steps: int) -> float:
    """Median wall time of one engine step while num_seqs sequences decode."""
    from jaxserve import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = llm.engine.config.model.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        ids = rng.integers(5, vocab, 32).tolist()
        engine.add_request(f"r{i}", None, ids, params)
    while engine.scheduler.waiting:  # the prompts' prefill steps
        engine.step()
    for _ in range(4):  # the first decode steps (and their buckets' first calls)
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * statistics.median(times)
