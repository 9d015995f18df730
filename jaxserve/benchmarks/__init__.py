"""The library of the benchmark and device-check scripts (as vLLM's vllm/benchmarks/): the
scripts in scripts/ are the command lines, the code they share lives here once, and the
tests import it too.

  workloads          the benchmark workloads (random, sharegpt-like, shared-prefix, file)
  checkpoints        the tiny test checkpoints and the "small" benchmark Llama, made on demand
  checkpoint_checks  greedy margins and check prompts of the tiny checkpoints
  local_server       a `jaxserve serve` subprocess on loopback: start, wait, stop
  startup_report     bench_startup's table
  hf_baseline        HF transformers generate, the throughput benchmarks' baseline
  engine_measures    an engine driven step by step: throughput, TTFT/ITL, decode step time
  device_plan        bench_on_device's model, plan, clock and report
  device_sections    bench_on_device's sections, in order within its budget
  torch_section      bench_on_device's torch-backend section
  ragged_batch       ragged paged-attention batches on random pages (numpy)
  kernel_checks      what the Pallas and Triton kernel checks share
  pallas_checks      the Pallas kernels against their reference (quantized caches too)
  pallas_timing      the Pallas kernels' timing and the in-place KV-cache write
  triton_checks      the Triton kernels against their reference, the KV write
  triton_timing      the Triton kernel's timing beside SDPA
  triton_run         the Triton kernels' whole check as one call
  serve/             `jaxserve bench serve`: datasets, the client, the report

Near the top of the package's layers: it may import anything in jaxserve, and nothing in
jaxserve imports it but the command line (`jaxserve bench serve`, jaxserve/cli/bench.py).
torch, triton, transformers, httpx and matplotlib are imported only by the modules (or
inside the functions) that need them.
"""
