"""Check the Triton attention kernels against the PyTorch reference, then time them on the GPU.

    python scripts/check_triton_kernels.py [--quick] [--max-seconds 150] [--json OUT]

scripts/check_kernels_on_device.py runs the same checks after its JAX checks
(jaxserve/benchmarks/triton_run.py's run(), in the same process) and folds their report and
failures into its own. Nothing here imports JAX.

* correctness: kernels_triton/attention.py (compiled on a GPU; Triton's interpreter and small
  shapes on the CPU) against kernels_triton/ref.py on random ragged batches (decode-only,
  prefill-only, mixed, sliding window + soft cap, and pages beyond 4 GiB into the caches) in
  float32 and bfloat16. Error = max |kernel - ref| / max |ref| over the real tokens, with ref
  run on the float32 upcast of the same inputs and TF32 off (torch's matmul and cuDNN flags).
  The kernel's float32 dots use input_precision="ieee" (attention.py), hence the float32
  tolerance of 1e-5; its 16-bit dots use TF32, exact for bf16 operands. Rows of padding tokens
  must be exactly 0, and every page no real sequence owns holds NaN. kv_write.write_kv against
  ref.write_kv: in place, the written slots equal (a float32 -> bf16 conversion within one
  unit in the last place: the interpreter truncates where a GPU rounds), every other slot
  untouched.
* timing (GPU only; "skipped: no GPU" elsewhere): CUDA events, a warm-up, the median of
  --repeats rounds, each call timed both eagerly (Python launches included) and replayed from
  a CUDA graph (as the torch backend runs it; `ms` is the graph time when the capture works).
  Decode batches 1..256 x context 512..32k and mixed prefill + decode batches (bf16, head dim
  128, 64 query / 8 kv heads, block size 16), with the achieved bandwidth (K/V read + q + out
  bytes / time) against the device's copy bandwidth (torch.add over a --copy-gib array), and
  torch's scaled_dot_product_attention (flash / cuDNN / efficient only, enable_gqa=True) on
  the dense equivalent of the uniform batches: the same keys and values in contiguous
  [R, K, L, H] tensors (made first and freed before the paged cache, so a case needs its K/V
  bytes once). Its output is compared with the kernel's (sdpa_err). Cases that would not fit
  the GPU's free memory (JAX may hold most of it when run after the JAX checks) or the
  --max-seconds budget are skipped with a note. Small cases sit in L2 and are launch-bound.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from jaxserve.benchmarks import triton_run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing shapes")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--max-seconds", type=float,
                        help="skip the remaining timing cases after this many seconds "
                             f"(default {triton_run.MAX_SECONDS['full']:g}, --quick "
                             f"{triton_run.MAX_SECONDS['quick']:g})")
    parser.add_argument("--max-kv-gib", type=float, default=40, help="skip bigger decode KV")
    parser.add_argument("--copy-gib", type=float, default=2, help="copy-bandwidth array size")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="default: cuda when torch sees a GPU")
    parser.add_argument("--json", metavar="OUT", help="write every result here")
    args = parser.parse_args()
    print(f"python={platform.python_version()} torch={torch.__version__}", flush=True)
    try:
        report, failures = triton_run.run(quick=args.quick, max_seconds=args.max_seconds,
                                          repeats=args.repeats, max_kv_gib=args.max_kv_gib,
                                          copy_gib=args.copy_gib, device=args.device)
    except Exception as exc:  # still write what happened
        report = {"error": f"{type(exc).__name__}: {exc}"}
        failures = [report["error"]]
        print(f"FAILED: {report['error']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
