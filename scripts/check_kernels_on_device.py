"""Check the ragged paged attention kernels against the reference, then time them on the device.

    python scripts/check_kernels_on_device.py [--quick] [--max-seconds 240] [--json OUT]

One run says whether the Pallas kernels are right and how fast they are on the machine at
hand, and prints the versions it ran with (Pallas moves between JAX releases):

* correctness: every kernel the platform runs (GPU: the Triton-lowered kernel; TPU: the
  Mosaic one; CPU: both in interpret mode, small shapes) against kernels_pallas/ref.py on
  random ragged batches (decode-only, prefill-only, mixed, sliding window + soft cap, and
  pages beyond 4 GiB into the cache) in float32 and bfloat16. Error = max |kernel - ref| /
  max |ref| over the real tokens, against ref on the float32 upcast of the same inputs.
  jax's own GPU paged_attention is checked on a decode batch too, to prove the layout
  conversion its timing uses.
* timing (accelerators only): decode (batch 1-256 x context 512-32k, head dim 128, GQA 8:1,
  bf16) and mixed prefill + decode batches; achieved HBM bandwidth (K/V bytes read plus q
  and out) against the device's measured copy bandwidth, and the time of
  `jax.experimental.pallas.ops.gpu.paged_attention` on the decode shapes.
* quantized KV caches (kv_cache_dtype fp8 / int8): each kernel over one-byte caches with
  the engine's scales folded into q and out (kv_quant), against ref on the dequantized
  values (the bfloat16 tolerance), with the error against the unquantized cache reported;
  on a device, a decode batch (64 x 4096 context) timed with bf16, fp8 and int8 caches.
* multi-head latent attention (MLA, DeepSeek V2/V3): the GPU MLA kernel
  (kernels_pallas/gpu_ragged_paged_mla.py; in interpret mode on the CPU, small shapes)
  against kernels_pallas/mla_ref.py on decode, prefill and mixed batches (device: V3's
  latent C 512 + R 64, 16 and 128 heads, bf16 and one float32; fp8 and int8 latent caches
  with the engine's two scales folded in, against mla_ref on the dequantized cache), the
  same error measure;
  on a GPU, decode batches (64 and 256 x 4096 context, 16 and 128 heads) timed with their
  achieved bandwidth (latent entries read plus q and out), the MHA kernel beside the 16-head
  rows on the MHA-equivalent shape (16 kv heads of 128), within --mla-max-seconds of its
  own (after the attention timing's --max-seconds).
* KV-cache write: ref.write_kv jitted with donated caches, for caches of 1x, 4x and 16x the
  pages at a fixed T: a flat time, the output in the input's buffer, and aliased bytes in
  the compiled memory analysis mean in place; the undonated call is timed beside it to
  show what a copy of the cache costs.
* the torch backend's Triton kernels (kernels_triton/), after all of the above and only when
  torch and triton import: scripts/check_triton_kernels.py's checks and GPU timing
  (jaxserve/benchmarks/triton_run.py), in this process (--triton-max-seconds budget;
  --skip-triton leaves them out). Their section is "triton" in the --json report; its
  "status" says "ran", "skipped: ..." or "error: ...".
  The report is written once before they start, so a crash there cannot lose the JAX part.

Exits non-zero if any kernel check fails (the Triton ones included).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import json
import platform
import time
import traceback

import jax
import numpy as np

from jaxserve.benchmarks.kernel_checks import DEVICE_CHECKS, FAR_BYTES, MLA_CHECKS
from jaxserve.benchmarks.pallas_checks import (
    CPU_CHECKS,
    QUANT_CHECKS,
    platform_kind,
    run_checks,
    run_mla_checks,
    run_mla_timing,
    run_quantized_checks,
)
from jaxserve.benchmarks.pallas_timing import WRITE_KV, check_write_kv, run_timing

KERNELS = {"gpu": "jaxserve.kernels_pallas.gpu_ragged_paged_attention",
           "tpu": "jaxserve.kernels_pallas.ragged_paged_attention"}
# Latent-attention kernels, by the KERNELS name whose platform runs them (the TPU one,
# kernels_pallas/ragged_paged_mla.py, is not checked here yet).
MLA_KERNELS = {"gpu": "jaxserve.kernels_pallas.gpu_ragged_paged_mla"}


def versions() -> dict:
    info = {"python": platform.python_version(), "jax": jax.__version__}
    for dist in ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                 "jax-cuda13-pjrt", "jax-rocm60-plugin", "libtpu", "triton"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    device = jax.devices()[0]
    info.update(platform=device.platform, device_kind=device.device_kind,
                num_devices=jax.device_count())
    try:
        info["platform_version"] = device.client.platform_version
    except AttributeError:
        pass
    return info


def load_kernel(name: str, interpret: bool):
    """The kernel `name` as fn(q, k_cache, v_cache, batch, **opts); interpret mode on the CPU
    (each kernel picks its own interpreter: plain for GPU-style, DMA-simulating for TPU)."""
    fn = importlib.import_module(KERNELS[name]).ragged_paged_attention
    return functools.partial(fn, interpret=True) if interpret else fn


def run_triton_section(args) -> tuple[dict, list]:
    """(section, failures) of the torch backend's Triton kernels; never raises: torch or
    triton missing is a skip, anything going wrong inside is one failure."""
    if args.skip_triton:
        print("\ntriton kernels skipped: --skip-triton")
        return {"status": "skipped: --skip-triton"}, []
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        status = f"skipped: torch/triton not installed ({exc})"
        print(f"\ntriton kernels {status}")
        return {"status": status}, []
    try:
        from jaxserve.benchmarks import triton_run  # imports torch

        section, failures = triton_run.run(
            quick=args.quick, max_seconds=args.triton_max_seconds, repeats=args.repeats,
            max_kv_gib=args.max_kv_gib, copy_gib=args.copy_gib)
    except Exception as exc:
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"[:400]
        print(f"triton kernels FAILED: {error}", flush=True)
        return {"status": f"error: {error}"}, [f"triton kernels: {error}"]
    return {"status": "ran", **section}, list(failures)


def write_report(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def load_kernels(names, interpret: bool, report: dict) -> dict:
    """{name: kernel} of those that import; a kernel that does not is a failed check."""
    kernels = {}
    for name in names:
        try:
            kernels[name] = load_kernel(name, interpret)
        except Exception as exc:
            print(f"check {name:20} FAIL cannot load {KERNELS[name]}: {exc}")
            report["checks"].append(dict(kernel=name, ok=False, informational=False,
                                         exception=f"load: {exc}"))
    return kernels


def load_mla_kernels(names, interpret: bool, results: list) -> dict:
    """{name: MLA kernel} of the chosen kernels that have one; one that does not import is a
    failed check in results."""
    kernels = {}
    for name in (n for n in names if n in MLA_KERNELS):
        try:
            fn = importlib.import_module(MLA_KERNELS[name]).ragged_paged_mla
            kernels[f"{name}-mla"] = functools.partial(fn, interpret=True) if interpret else fn
        except Exception as exc:
            print(f"check {name + '-mla':20} FAIL cannot load {MLA_KERNELS[name]}: {exc}")
            results.append(dict(kernel=f"{name}-mla", ok=False, informational=False,
                                exception=f"load: {exc}"))
    return kernels


def run_mla(names, kernels: dict, *, interpret: bool, args, copy_bw, rng) -> list:
    """The MLA kernels against mla_ref; on a device, their decode timing beside the MHA
    kernel of the same platform (kernels[name]), within --mla-max-seconds."""
    results: list = []
    mla = load_mla_kernels(names, interpret, results)
    if not mla:
        return results
    mode = "interpret mode" if interpret else "compiled"
    print(f"\nmulti-head latent attention vs mla_ref ({mode})")
    results += run_mla_checks(mla, MLA_CHECKS["cpu" if interpret else "device"],
                              long=not interpret, rng=rng)
    if not interpret:
        deadline = time.monotonic() + args.mla_max_seconds
        for name, kernel in mla.items():
            results += run_mla_timing(kernel, kernels.get(name.removesuffix("-mla")),
                                      repeats=args.repeats, copy_bw=copy_bw,
                                      deadline=deadline, rng=rng)
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing shapes")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--max-seconds", type=float, default=240,
                        help="skip the remaining timing cases after this many seconds")
    parser.add_argument("--max-kv-gib", type=float, default=40, help="skip bigger decode KV")
    parser.add_argument("--copy-gib", type=float, default=2, help="copy-bandwidth array size")
    parser.add_argument("--kernels", nargs="*", choices=list(KERNELS),
                        help="kernels to check (default: the platform's; CPU: all)")
    parser.add_argument("--json", metavar="OUT", help="write every result here")
    parser.add_argument("--triton-max-seconds", type=float,
                        help="budget of the Triton part (default 150, --quick 60)")
    parser.add_argument("--mla-max-seconds", type=float, default=40,
                        help="budget of the MLA decode timing (after its checks, ~25 s)")
    parser.add_argument("--skip-triton", action="store_true",
                        help="leave out the torch backend's Triton kernels")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    deadline = time.monotonic() + args.max_seconds
    info = versions()
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    kind = platform_kind()
    interpret = kind not in ("gpu", "tpu")
    names = args.kernels or (list(KERNELS) if interpret else [kind])
    rng = np.random.default_rng(0)
    report = dict(versions=info, checks=[], attention=[], write_kv=[])
    kernels = load_kernels(names, interpret, report)
    with_pa = kind in ("gpu", "cpu")
    print(f"\ncorrectness vs ref ({'interpret mode' if interpret else 'compiled'})")
    report["checks"] += run_checks(kernels, CPU_CHECKS if interpret else DEVICE_CHECKS,
                                   long=not interpret, with_pa=with_pa, interpret=interpret,
                                   far_bytes=FAR_BYTES["cpu" if interpret else "device"],
                                   rng=rng)
    print("\nquantized KV caches (fp8, int8) vs ref on the values they hold")
    report["quantized"] = run_quantized_checks(
        kernels, QUANT_CHECKS["cpu" if interpret else "device"], interpret=interpret, rng=rng,
        repeats=args.repeats, deadline=deadline)
    report["write_kv"] = check_write_kv(**WRITE_KV["cpu" if interpret else "device"],
                                        repeats=args.repeats, rng=rng)
    if not interpret and kind in kernels:
        report["copy_bandwidth_gbs"], report["attention"] = run_timing(
            kernels[kind], quick=args.quick, repeats=args.repeats, max_kv_gib=args.max_kv_gib,
            copy_gib=args.copy_gib, with_pa=kind == "gpu", deadline=deadline, rng=rng)
    report["mla"] = run_mla(names, kernels, interpret=interpret, args=args,
                            copy_bw=report.get("copy_bandwidth_gbs"), rng=rng)
    failed = [c for c in report["checks"] if not c["ok"] and not c["informational"]]
    failed += [w for w in report["write_kv"] if not w["ok"]]
    failed += [a for a in report["attention"] if "error" in a]
    failed += [q for q in report["quantized"] if q.get("ok") is False
               or any(k.endswith("_error") for k in q)]
    failed += [m for m in report["mla"] if m.get("ok") is False  # a check, or a timing case
               or (m.get("kind") == "mla-timing" and "error" in m)]
    if args.json:  # the JAX part, in case the torch part takes the process down
        write_report(args.json, {**report, "triton": {"status": "running"}})
    report["triton"], triton_failed = run_triton_section(args)
    failed += triton_failed
    print(f"\n{'FAILED: ' + str(len(failed)) if failed else 'all checks passed'} "
          f"({time.monotonic() - deadline + args.max_seconds:.0f}s)")
    if args.json:
        write_report(args.json, report)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
