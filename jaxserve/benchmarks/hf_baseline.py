"""The HF transformers baseline of the throughput benchmarks: `generate` in static batches
in workload order, left padding, greedy, each batch generating its longest request's length
(every request runs to its length: EOS off). bench_offline.py runs a checkpoint on the CPU
over a sweep of batch sizes; bench_on_device.py runs random weights on the device, within
its time budget.
"""

from __future__ import annotations

import time

from jaxserve.benchmarks.workloads import Workload


def generate_left_padded(model, prompts: list[list[int]], new_tokens: int,
                         device="cpu") -> int:
    """Greedy generate of exactly new_tokens after each prompt, as one left-padded batch on
    `device`; the tokens generated (rows x new tokens)."""
    import torch

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


def run_hf(model: str, workload: Workload, batch_size: int, count: int | None = None) -> dict:
    """HF generate over the first `count` requests in static batches of batch_size."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = _hf_model(model, AutoModelForCausalLM, torch)
    prompts = workload.prompts[:count]
    lens = workload.output_lens[:count]
    useful = generated = 0
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            want = lens[i:i + batch_size]
            generated += generate_left_padded(hf, prompts[i:i + batch_size], max(want))
            useful += sum(want)
    wall = time.perf_counter() - start
    return {"batch_size": batch_size, "requests": len(prompts), "wall_s": wall,
            "output_tokens": useful, "generated_tokens": generated,
            "output_tok_s": useful / wall}


_HF_CACHE: dict = {}


def _hf_model(model: str, cls, torch):
    """The checkpoint's HF model, loaded once per process (float32, 2 threads, EOS off)."""
    if model not in _HF_CACHE:
        torch.set_num_threads(2)
        hf = cls.from_pretrained(model, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # every request runs to its length
        _HF_CACHE[model] = hf
    return _HF_CACHE[model]


def run_hf_baseline(model: str, workload: Workload, batch_sizes, sweep_requests: int) -> dict:
    """Each batch size on the first sweep_requests requests, then the fastest on them all."""
    sweep = []
    for b in batch_sizes:
        result = run_hf(model, workload, b, sweep_requests)
        print(f"  HF sweep: batch {b:3d} on {result['requests']} requests: "
              f"{result['output_tok_s']:.1f} output tok/s", flush=True)
        sweep.append(result)
    best = max(sweep, key=lambda r: r["output_tok_s"])["batch_size"]
    full = run_hf(model, workload, best)
    return {"best_batch_size": best, "sweep": sweep, **full}


def run_hf_random_weights(config: dict, workload: Workload, batch_size: int, on_gpu: bool,
                          deadline: float) -> dict:
    """HF generate on the workload in static batches (left padding, greedy), a Llama of
    `config` with random weights on the same device (bf16 on the GPU); stops between
    batches when the deadline (perf_counter) would pass."""
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

    with torch.no_grad():
        # warm-up: kernels, allocator
        generate_left_padded(model, workload.prompts[:batch_size], 2, device)
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
            generated += generate_left_padded(model, prompts, max(want), device)
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


