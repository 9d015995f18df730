"""End-to-end benchmark of jaxserve on one GPU: a Llama-3-8B-shaped model with random weights.

On a GPU machine (one NVIDIA H200 in mind), from the repository root:

    pip install -e ".[cuda,torch]"    # jax with CUDA; torch (CUDA build): HF, torch backend
    python scripts/bench_on_device.py [--quick] [--json out.json]

One command, at most 10 minutes (--quick: about 3.5; --max-seconds changes the budget). The
model is Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 kv heads, intermediate
14336, vocab 128256, rope_theta 500000) with random bfloat16 weights made on the device
(load_format="dummy"): nothing is downloaded and no checkpoint is read. The model folder is a
temporary directory holding config.json and the built-in model's tokenizer; prompts are token
ids, so the tokenizer only detokenizes. Engine: max_model_len 2048, max_num_seqs 256,
max_num_batched_tokens 2048, every shape bucket compiled before anything is timed. With no
accelerator (jax.default_backend() == "cpu"), or with --tiny, a tiny Llama (hidden 64, 2
layers, vocab 8192: twice the tokenizer's, as the 8B model's exceeds it) runs the same code
end to end with 12 requests, decode batches 1, 4 and 8 and HF (float32, on the CPU) on 4
requests: a minute or two on 2 cores, most of it compiling (tests/test_bench_on_device.py
runs it). On a machine with a GPU that JAX does not see (its CPU-only build), the script
stops at once (exit 2) and says what to install, instead of benchmarking the tiny model.

What it measures, each printed and (with --json) written out:

1. throughput: the sharegpt-like workload of scripts/bench_offline.py (log-normal prompt
   lengths, median 96, and output lengths, median 64; random token ids; ignore_eos, so every
   output has its length), 256 requests (--quick 64), all added at once. The engine is
   driven step by step (engine.add_request / engine.step), so each token's arrival time is
   known: output tok/s and total (prompt + output) tok/s over the run's wall time; TTFT =
   first token's arrival - the time the requests were added (offline: queueing included);
   ITL = time between successive token arrivals of a request (when one step brings k new
   tokens, the gap counts as k gaps of gap/k). p50/p90/p99 of each; ITLs pooled over all
   requests.
2. decode step time at batch 1, 32 and 256: that many requests (128-token prompts) are
   started, and once all of them are decoding, the wall time of each engine.step() is taken
   (the median over 32 steps, --quick 16): the step as the engine runs it, host work
   overlapped with the device's. Compared with the weight-bandwidth floor = weight bytes
   (every parameter is read once per step) / the device's copy bandwidth, measured with a
   jitted `x + 1` over a 2 GiB array (bandwidth = 2 x bytes / best time: read + write).
   ratio = step time / floor (1.0 would be perfect). The floor with the KV cache read too
   (batch x context x KV bytes per token) is reported beside it.
3. HF transformers generate on the same device: LlamaForCausalLM(config) with random
   bfloat16 weights, static batches of 32 in workload order, left padding, greedy, each
   batch generating its longest request's length, on the first 64 requests (--quick 32).
   jaxserve runs the same 64 requests again, and the ratio of output tok/s (requested tokens
   / wall time) is reported. Skipped, with a line saying why, when torch cannot use the GPU.
4. the torch backend (LLM(..., backend="torch"): the Triton kernels and CUDA graphs on a GPU,
   the PyTorch reference attention on the CPU) on the same model folder, engine arguments,
   workload and decode batches (the same prompts: the same seeds), last, after the JAX and HF
   numbers are in (the --json report is written once before it starts, so a crash there
   cannot lose them). Its KV cache gets the JAX engine's block count, or on a GPU fewer when
   that would not fit beside JAX's memory pool (num_gpu_blocks_override; the report says
   which). Reported beside the JAX numbers, with torch / JAX speed ratios (vs_jax: > 1 means
   the torch backend is faster): output and total tok/s, and per decode batch JAX step time /
   torch step time. When torch or triton is not installed the section is skipped; when the
   torch backend cannot start (a CPU-only torch on a GPU machine, a build error) the error is
   reported (exit status 1) and the JAX numbers stand. The HF section leaves the torch
   section the time it needs.

5. quantized: the same model with int8 weights (quantization="int8") and with an fp8 KV
   cache (kv_cache_dtype="fp8"), each in an engine of its own after the bf16 one is freed
   (same memory budget: more KV blocks for both), shapes compiled on first use: KV blocks,
   weight bytes and the decode step time at the two largest decode batches, with
   vs_bf16 = bf16 step time / quantized step time (> 1: faster).

The JAX GPU allocator is capped at XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 unless set (the HF
baseline needs room on the same GPU). Compiling every shape bucket of the 8B model is most
of the start-up; a rerun on the same machine loads them from jaxserve's compilation cache.
Sections that would not fit the time budget are skipped with a note. Exits non-zero when a
section failed (the JSON says which and why).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_offline import FIRST_REGULAR_ID, Workload, make_workload  # noqa: E402

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
    hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
    bos_token_id=0, eos_token_id=1,  # the built-in tokenizer's ids (ignore_eos anyway)
)
# Tiny: the same code path in seconds on a CPU. The vocabulary is twice the tokenizer's, as
# the 8B model's is larger than the built-in tokenizer's: ids the tokenizer lacks get decoded.
TINY = dict(LLAMA3_8B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, vocab_size=8192,
            max_position_embeddings=2048)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja")


class Plan:
    """Sizes of one run: the 8B model on an accelerator (full or --quick), or the tiny one."""

    def __init__(self, tiny: bool, quick: bool, args) -> None:
        self.tiny, self.quick = tiny, quick
        self.model_name = "tiny-llama" if tiny else "llama-3-8b-shaped"
        self.model_config = TINY if tiny else LLAMA3_8B
        if tiny:
            self.engine_args = dict(max_model_len=1024, max_num_seqs=8,
                                    max_num_batched_tokens=64)
            self.requests, self.decode_batches, self.decode_prompt = 12, (1, 4, 8), 32
            self.decode_steps, self.hf_requests, self.hf_batch = 8, 4, 4
            self.copy_bytes = 64 << 20
        else:
            self.engine_args = dict(max_model_len=2048, max_num_seqs=256,
                                    max_num_batched_tokens=2048)
            self.requests = 64 if quick else 256
            self.decode_batches, self.decode_prompt = (1, 32, 256), 128
            self.decode_steps = 16 if quick else 32
            self.hf_requests, self.hf_batch = (32, 32) if quick else (64, 32)
            self.copy_bytes = 2 << 30
        self.requests = args.requests or self.requests
        self.hf_requests = min(args.hf_requests or self.hf_requests, self.requests)
        self.hf_batch = args.hf_batch_size or self.hf_batch
        self.budget_s = args.max_seconds or (210.0 if quick else 600.0)
        # Seconds a section needs at least to be worth starting.
        self.need = ({"throughput": 5, "decode": 5, "hf": 10, "torch": 10, "quantized": 10}
                     if tiny else
                     {"throughput": 20, "decode": 15 if quick else 30,
                      "hf": 30 if quick else 60, "torch": 45 if quick else 90,
                      "quantized": 90 if quick else 150})
        # The quantized engines' decode batches: the ones that show the bytes a step reads.
        self.quantized_batches = self.decode_batches[-2:]


class Clock:
    """Elapsed time since the start, the budget, and progress lines."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def left(self) -> float:
        return self.budget_s - self.elapsed

    @property
    def deadline(self) -> float:
        return self.start + self.budget_s

    def say(self, line: str) -> None:
        print(f"[{self.elapsed:6.1f}s] {line}", flush=True)


# ----------------------------------------------------------------------------- set-up

def write_model_folder(folder: pathlib.Path, config: dict) -> pathlib.Path:
    """config.json plus the built-in model's tokenizer files: a model folder with no weights
    (load_format="dummy" makes them on the device)."""
    import jaxserve

    source = jaxserve.default_model_path()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


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


# ----------------------------------------------------------------------------- 1. throughput

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
    _drain(engine)
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


def _drain(engine) -> None:
    """Collect a step still on the device after every request was aborted."""
    for _ in range(4):
        if engine.in_flight is None and not engine.has_unfinished_requests():
            return
        engine.step()


# ----------------------------------------------------------------------------- 2. decode

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
        _drain(engine)
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps,
            "step_s": float(np.median(times)), "step_s_mean": float(np.mean(times)),
            "tokens_per_step": tokens / steps, "mean_context": context_sum / steps / batch}


def kv_bytes_per_token(config: dict, itemsize: int = 2) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * itemsize


# ----------------------------------------------------------------------------- 3. HF baseline

def run_hf(config: dict, workload: Workload, batch_size: int, on_gpu: bool,
           clock: Clock, deadline: float | None = None) -> dict:
    """HF generate on the workload in static batches (left padding, greedy), random weights
    on the same device (bf16 on the GPU); stops between batches when the budget (deadline,
    default the clock's) would run out."""
    deadline = clock.deadline if deadline is None else deadline
    try:
        import torch
        import transformers
    except ImportError as err:
        return {"skipped": f"torch / transformers not importable ({err}); "
                           "pip install -e '.[torch]' brings torch"}
    if on_gpu and not torch.cuda.is_available():
        return {"skipped": f"torch {torch.__version__} cannot use the GPU "
                           "(torch.cuda.is_available() is False: a CPU-only build?)"}
    device = torch.device("cuda" if on_gpu else "cpu")
    # bf16 as jaxserve on the GPU; float32 on the CPU (the tiny run), where torch's bf16
    # kernels are several times slower than its float32 ones.
    dtype = torch.bfloat16 if on_gpu else torch.float32
    build_start = time.perf_counter()
    hf_config = transformers.LlamaConfig(**config)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random weights made in `dtype` on the device
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to(dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # every request runs to its length
    build_s = time.perf_counter() - build_start

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    def generate(prompts, new_tokens):
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
        return int(out.shape[1] - width) * len(prompts)

    with torch.no_grad():
        generate(workload.prompts[:batch_size], 2)  # warm-up: kernels, allocator
        sync()
        requests = useful = generated = 0
        batch_times = []
        start = time.perf_counter()
        for i in range(0, len(workload.prompts), batch_size):
            if batch_times and time.perf_counter() + max(batch_times) > deadline:
                break
            t0 = time.perf_counter()
            prompts = workload.prompts[i:i + batch_size]
            want = workload.output_lens[i:i + batch_size]
            generated += generate(prompts, max(want))
            sync()
            batch_times.append(time.perf_counter() - t0)
            requests += len(prompts)
            useful += sum(want)
        wall = time.perf_counter() - start
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "transformers": transformers.__version__, "build_s": build_s,
            "batch_size": batch_size, "requests": requests,
            "truncated": requests < len(workload.prompts), "output_tokens": useful,
            "generated_tokens": generated, "wall_s": wall, "output_tok_s": useful / wall}


# ----------------------------------------------------------------------------- main

class Report:
    """The JSON report, with the skipped and failed sections recorded and announced."""

    def __init__(self, plan: Plan, clock: Clock, **fields) -> None:
        self.plan, self.clock = plan, clock
        self.data: dict = {**fields, "skipped": {}, "errors": {}}

    def skip(self, section: str, why: str) -> None:
        self.data["skipped"][section] = why
        self.data.setdefault(section, {})["skipped"] = why
        self.clock.say(f"SKIPPED {section}: {why}")

    def fits(self, section: str, reserve: float = 0.0) -> bool:
        """Whether the budget leaves the time the section needs (beyond `reserve` seconds
        kept for a later section); if not, skip it."""
        need, left = self.plan.need[section], self.clock.left - reserve
        if left < need:
            kept = f" ({reserve:.0f} s kept for the torch backend)" if reserve else ""
            self.skip(section, f"{left:.0f} s of the {self.plan.budget_s:.0f} s budget left"
                               f"{kept}, the section needs about {need} s")
            return False
        return True

    def failed(self, section: str, err: Exception) -> None:
        why = f"{type(err).__name__}: {err}"
        self.data["errors"][section] = why
        self.data.setdefault(section, {})["error"] = why
        self.clock.say(f"FAILED {section}: {why}")


def main() -> int:
    args = parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # room for torch (HF)
    import jax

    backend = jax.default_backend()
    unused = _unused_accelerator() if backend == "cpu" and not args.tiny else None
    if unused is not None:
        what, command = unused
        print(f"This machine has {what}, but JAX runs on the CPU: install JAX's accelerator "
              f"build ({command}), or pass --tiny to run the tiny CPU configuration.",
              file=sys.stderr, flush=True)
        return 2
    plan = Plan(tiny=args.tiny or backend == "cpu", quick=args.quick, args=args)
    clock = Clock(plan.budget_s)
    device = jax.devices()[0]
    clock.say(f"device: {device.device_kind} (backend {backend}, {jax.device_count()} "
              f"device(s), jax {jax.__version__}); model {plan.model_name}; "
              f"{'quick, ' if plan.quick else ''}budget {plan.budget_s:.0f} s")
    report = Report(plan, clock, device=device.device_kind, backend=backend,
                    jax=jax.__version__, model=plan.model_name, model_config=plan.model_config,
                    quick=plan.quick, tiny=plan.tiny, budget_s=plan.budget_s)
    bandwidth = measure_copy_bandwidth(plan.copy_bytes)
    report.data["bandwidth"] = bandwidth
    clock.say(f"copy bandwidth: {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s (x + 1 over "
              f"{plan.copy_bytes / 2**30:.2f} GiB, best of {bandwidth['reps']}: "
              f"{1e3 * bandwidth['best_s']:.2f} ms)")
    def save() -> None:
        if args.json:
            report.data["total_s"] = clock.elapsed
            pathlib.Path(args.json).write_text(json.dumps(report.data, indent=1))

    try:
        with tempfile.TemporaryDirectory(prefix="bench-on-device-") as tmp:
            run_engine_sections(report, pathlib.Path(tmp), args.seed, save)
    except Exception as err:  # noqa: BLE001 - the engine could not be built: say why
        report.failed("engine", err)
    report.data["total_s"] = clock.elapsed
    print_summary(report.data)
    if args.json:
        save()
        clock.say(f"wrote {args.json}")
    return 1 if report.data["errors"] else 0


def _unused_accelerator() -> tuple[str, str] | None:
    """(what, install command) when the machine has an accelerator JAX does not use."""
    try:
        from jaxserve.backends.jax.accelerators import unused_accelerator
    except ImportError:
        return None
    return unused_accelerator()


def run_engine_sections(report: Report, folder: pathlib.Path, seed: int,
                        save=lambda: None) -> None:
    """Build the engine on random weights, run the three sections the budget allows, then
    the torch backend's (save() first writes what is in)."""
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
    id_limit = min(len(llm.get_tokenizer()), plan.model_config["vocab_size"])
    workload = make_workload(argparse.Namespace(workload="sharegpt-like", seed=seed,
                                                num_prompts=plan.requests), id_limit, None)
    data["workload"] = {"name": workload.name, "requests": len(workload.prompts),
                        "prompt_tokens": workload.prompt_tokens,
                        "output_tokens": workload.output_tokens,
                        "token_ids": [FIRST_REGULAR_ID, id_limit]}
    clock.say(f"workload {workload.name}: {len(workload.prompts)} requests, "
              f"{workload.prompt_tokens} prompt + {workload.output_tokens} output tokens "
              f"(ids in [{FIRST_REGULAR_ID}, {id_limit}))")

    # The JAX and HF sections leave the torch backend's section (4.) and the quantized
    # engines' (5.) the time they need.
    torch_why = torch_unavailable(data["backend"])
    reserve = plan.need["quantized"] + (plan.need["torch"] if torch_why is None else 0.0)
    deadline = clock.deadline - reserve

    # 1. throughput, TTFT, ITL
    if report.fits("throughput", reserve):
        try:
            data["throughput"] = run_stream(engine, workload, "r", deadline)
            clock.say(_throughput_line("throughput", data["throughput"]))
        except Exception as err:  # noqa: BLE001 - report it, run the other sections
            report.failed("throughput", err)

    # 2. decode step time against the weight-bandwidth floor
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

    # 5. int8 weights and an fp8 KV cache, each in an engine of its own (this one freed)
    llm = engine = None
    free_device_memory()
    if report.fits("quantized"):
        save()
        run_quantized_section(report, folder, id_limit=id_limit, seed=seed)


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


# ----------------------------------------------------------------------------- 5. quantized

QUANTIZED = {"int8 weights": {"quantization": "int8"}, "fp8 kv": {"kv_cache_dtype": "fp8"}}


def run_quantized_section(report: Report, folder: pathlib.Path, *, id_limit: int,
                          seed: int) -> None:
    """Decode step times of the bf16 engine's model with int8 weights and with an fp8 KV
    cache, one engine at a time (the bf16 engine already freed, so each gets the same
    memory budget: int8 weights leave more room for KV blocks, an fp8 cache holds twice the
    blocks), shapes compiled on first use (before the timed steps); the same prompts as the
    decode section. data["quantized"][variant]: weights, KV blocks, decode batches and
    vs_bf16 = bf16 step time / this step time (> 1: faster). Failures are reported per
    variant; the engine is freed after each."""
    import jax

    from jaxserve import LLM

    plan, clock, data = report.plan, report.clock, report.data
    section = data.setdefault("quantized", {})
    bf16 = {b["batch"]: b["step_s"] for b in data.get("decode", {}).get("batches", [])}
    share = plan.need["quantized"] / len(QUANTIZED)
    for n, (name, extra) in enumerate(QUANTIZED.items()):
        deadline = clock.deadline - share * (len(QUANTIZED) - n - 1)
        entry = section.setdefault(name, {"engine_args": extra})
        llm = None
        try:
            if deadline - time.perf_counter() < plan.need["decode"]:
                raise TimeoutError("no time left in the budget")
            clock.say(f"building the {name} engine (random weights, buckets on first use)")
            start = time.perf_counter()
            llm = LLM(str(folder), **dict(data["engine_args"], precompile=False, **extra))
            runner = llm.engine.runner
            entry["start_s"] = time.perf_counter() - start
            leaves = jax.tree.leaves(runner.params)
            weight_bytes = sum(leaf.nbytes for leaf in leaves)
            floor_s = weight_bytes / data["bandwidth"]["bytes_per_s"]
            entry.update(weights={"bytes": weight_bytes, "floor_s": floor_s},
                         kv_blocks=runner.num_blocks, bytes_per_block=runner.bytes_per_block)
            clock.say(f"{name}: {weight_bytes / 1e9:.3f} GB of weights, {runner.num_blocks} "
                      f"KV blocks of {runner.bytes_per_block} B")
            rng = np.random.default_rng(seed + 1)  # prompts drawn as the decode section's
            entry["decode"] = {"batches": []}
            for batch in plan.quantized_batches:
                r = measure_decode(llm.engine, batch, plan.decode_prompt, plan.decode_steps,
                                   rng, id_limit, deadline)
                line = add_floor(r, plan, data["bandwidth"], floor_s,
                                 kv_itemsize=1 if "kv_cache_dtype" in extra else 2)
                if batch in bf16:
                    r["vs_bf16"] = bf16[batch] / r["step_s"]
                    line += f"; bf16 / {name} step time {r['vs_bf16']:.2f}x"
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


def free_device_memory() -> None:
    """Delete every live JAX array and compiled function: the engine measured last is done
    with, and the next one gets the whole memory budget (a reference cycle or a cache that
    kept the old weights alive would leave it less)."""
    import jax

    gc.collect()
    jax.clear_caches()
    for array in jax.live_arrays():
        array.delete()


# ----------------------------------------------------------------------------- 4. torch backend

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
        clock.say(_throughput_line("torch throughput", section["throughput"]))

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
        clock.say("torch / JAX speed: " + _ratios_line(section["vs_jax"]))


def _ratios_line(ratios: dict) -> str:
    parts = []
    if "output_tok_s" in ratios:
        parts.append(f"throughput {ratios['output_tok_s']:.2f}x output tok/s, "
                     f"{ratios['total_tok_s']:.2f}x total tok/s"
                     + (" (a run was truncated)" if ratios["truncated"] else ""))
    parts += [f"decode batch {b} {ratio:.2f}x"
              for b, ratio in ratios.get("decode_step", {}).items()]
    return "; ".join(parts)


def run_hf_section(engine, plan: Plan, workload: Workload, backend: str, clock: Clock,
                   deadline: float | None = None) -> dict:
    deadline = clock.deadline if deadline is None else deadline
    subset = Workload(f"{workload.name} (first {plan.hf_requests})",
                      workload.prompts[:plan.hf_requests],
                      workload.output_lens[:plan.hf_requests])
    ours = run_stream(engine, subset, "hf", deadline)
    clock.say(_throughput_line(f"jaxserve on the first {plan.hf_requests} requests", ours))
    if ours["truncated"]:
        why = "the time budget ran out while jaxserve ran the same requests"
        clock.say(f"HF baseline SKIPPED: {why}")
        return {"requests": plan.hf_requests, "jaxserve": ours, "skipped": why}
    clock.say(f"HF transformers generate: static batches of {plan.hf_batch}, left padding, "
              f"greedy, random {'bf16' if backend == 'gpu' else 'float32'} weights")
    hf = run_hf(plan.model_config, subset, plan.hf_batch, backend == "gpu", clock, deadline)
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


def _throughput_line(label: str, r: dict) -> str:
    ttft, itl = r["ttft_s"], r["itl_s"]
    ms = lambda p: "n/a" if p["count"] == 0 else \
        f"p50 {1e3 * p['p50']:.1f} / p90 {1e3 * p['p90']:.1f} / p99 {1e3 * p['p99']:.1f} ms"
    cut = " (TRUNCATED by the time budget)" if r["truncated"] else ""
    return (f"{label}: {r['finished']}/{r['requests']} requests in {r['wall_s']:.2f} s{cut}: "
            f"output {r['output_tok_s']:.1f} tok/s, total {r['total_tok_s']:.1f} tok/s; "
            f"TTFT {ms(ttft)}; ITL {ms(itl)}; {r['steps']} steps, "
            f"{r['recompilations']} recompilations")


def print_summary(report: dict) -> None:
    print(f"\n== summary: {report['model']} on {report['device']} ({report['backend']}), "
          f"{report['total_s']:.0f} s ==")
    print(f"engine start-up (random weights + compile): {report.get('warm_up_s', 0):.1f} s; "
          f"copy bandwidth {report['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s")
    t = report.get("throughput", {})
    if "output_tok_s" in t:
        print(_throughput_line("throughput", t))
    for r in report.get("decode", {}).get("batches", []):
        print(f"decode batch {r['batch']:3d}: {1e3 * r['step_s']:.3f} ms/step, floor "
              f"{1e3 * r['floor_s']:.3f} ms ({r['ratio']:.2f}x), with KV "
              f"{1e3 * r['floor_with_kv_s']:.3f} ms ({r['ratio_with_kv']:.2f}x)")
    t = report.get("torch", {})
    if "output_tok_s" in t.get("throughput", {}):
        print(_throughput_line("torch backend throughput", t["throughput"]))
    for r in t.get("decode", {}).get("batches", []):
        print(f"torch decode batch {r['batch']:3d}: {1e3 * r['step_s']:.3f} ms/step, floor "
              f"{1e3 * r['floor_s']:.3f} ms ({r['ratio']:.2f}x), with KV "
              f"{1e3 * r['floor_with_kv_s']:.3f} ms ({r['ratio_with_kv']:.2f}x)")
    if t.get("vs_jax"):
        print("torch / JAX speed: " + _ratios_line(t["vs_jax"]))
    hf = report.get("hf", {})
    if "ratio" in hf:
        print(f"HF baseline: jaxserve {hf['jaxserve']['output_tok_s']:.1f} vs HF "
              f"{hf['transformers']['output_tok_s']:.1f} output tok/s on "
              f"{hf['requests']} requests: {hf['ratio']:.2f}x")
    for name, q in report.get("quantized", {}).items():
        for r in q.get("decode", {}).get("batches", []):
            vs = f"; bf16 / {name}: {r['vs_bf16']:.2f}x" if "vs_bf16" in r else ""
            print(f"{name} decode batch {r['batch']:3d}: {1e3 * r['step_s']:.3f} ms/step "
                  f"({q['kv_blocks']} KV blocks){vs}")
    for section, why in {**report["skipped"], **report["errors"]}.items():
        print(f"{section}: {why}")
    sys.stdout.flush()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer requests and steps: about 2 minutes on a GPU")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny model and sizes (the default with no accelerator)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--max-seconds", type=float,
                   help="time budget (default 480, --quick 120): later sections are skipped")
    p.add_argument("--requests", type=int, help="requests in the throughput workload")
    p.add_argument("--hf-requests", type=int, help="requests in the HF comparison")
    p.add_argument("--hf-batch-size", type=int, help="HF static batch size")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
