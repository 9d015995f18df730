"""The Triton kernels' whole check as one call, `run()`: correctness (triton_checks.py),
then on a GPU the timing grid (triton_timing.py), as a JSON-able report and a list of
failure lines. scripts/check_triton_kernels.py runs it alone; scripts/check_kernels_on_device.py
runs it after the Pallas checks, in the same process, and folds it into its own report.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import platform
import time

import numpy as np
import torch

from jaxserve.benchmarks.kernel_checks import DEVICE_CHECKS, FAR_BYTES, TOL
from jaxserve.benchmarks.triton_checks import (
    CPU_CHECKS,
    WRITE_CHECKS,
    check_write_kv,
    run_checks,
)
from jaxserve.benchmarks.triton_timing import SDPA_TOL, CudaTimer, run_timing

TF32_F32_TOL = 1e-3  # if attention.py ever runs float32 dots in TF32 on a GPU
MAX_SECONDS = {"quick": 60.0, "full": 150.0}


def versions(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": device.type}
    for dist in ("triton", "pytorch-triton"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["capability"] = "%d.%d" % torch.cuda.get_device_capability(device)
    return info


def f32_dot_precision() -> str:
    """The input_precision attention.py gives float32 tl.dot calls: "ieee" when its launch says
    so (read from its source), else "tf32" (Triton's default on a GPU)."""
    from jaxserve.kernels_triton import attention

    try:
        source = inspect.getsource(attention)
    except (OSError, TypeError):
        return "unknown"
    return "ieee" if '"ieee"' in source or "'ieee'" in source else "tf32"


def tolerances(device: torch.device) -> dict:
    tol = dict(TOL)
    if device.type == "cuda" and f32_dot_precision() != "ieee":
        tol["float32"] = TF32_F32_TOL
    return tol


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_kernels(device: torch.device):
    """(attention, write_kv) of kernels_triton: compiled on a GPU, interpreted on the CPU."""
    from jaxserve.kernels_triton import attention, kv_write

    interpret = device.type != "cuda"
    return (functools.partial(attention.ragged_paged_attention, interpret=interpret),
            functools.partial(kv_write.write_kv, interpret=interpret))


def failures_of(report: dict) -> list[str]:
    """One line per failed check, write check and timing case (an SDPA that cannot run is
    informational; one that disagrees with the kernel means the comparison is wrong)."""
    failed = []
    for c in report.get("checks", []):
        if not c["ok"]:
            why = c.get("exception") or (f"err {c['error']:.2e} > tol {c['tol']:.0e}"
                                         if c["error"] > c["tol"] else
                                         f"{c['padding_nonzero']} nonzero padding values")
            failed.append(f"triton check {c['kind']} {c['dtype']} S={c['S']} K={c['K']} "
                          f"N={c['N']} H={c['H']} window={c['sliding_window']} "
                          f"cap={c['soft_cap']}: {why}")
    for w in report.get("write_kv", []):
        if not w["ok"]:
            why = w.get("exception") or (f"err {w['error']:.1e}, in place {w['in_place']}, "
                                         f"others untouched {w['others_untouched']}")
            failed.append(f"triton write_kv {w['dtype']} -> {w['cache_dtype']} T={w['T']}"
                          f"{' far' if w['far'] else ''}: {why}")
    timing = report.get("timing", {})
    if "error" in timing:
        failed.append(f"triton timing: {timing['error']}")
    for r in timing.get("rows", []):
        if "error" in r:
            failed.append(f"triton timing {r['case']}: {r['error']}")
        elif r.get("sdpa_ok") is False:
            failed.append(f"triton timing {r['case']}: the kernel and SDPA disagree "
                          f"(err {r['sdpa_err']:.1e} > {SDPA_TOL:.0e})")
    return failed


def run(*, quick: bool = False, max_seconds: float | None = None, repeats: int = 5,
        max_kv_gib: float = 40.0, copy_gib: float = 2.0, device=None, kernel=None,
        writer=None, seed: int = 0, log=print):
    """Check (and on a GPU time) the Triton kernels. Returns (report, failures).

    kernel, writer: the attention and KV-write functions under test (default: the Triton
    kernels, interpreted on the CPU)."""
    start = time.monotonic()
    device = torch.device(device) if device is not None else default_device()
    on_gpu = device.type == "cuda"
    max_seconds = max_seconds or MAX_SECONDS["quick" if quick else "full"]
    deadline = start + max_seconds
    if kernel is None or writer is None:
        kernel_default, writer_default = load_kernels(device)
        kernel, writer = kernel or kernel_default, writer or writer_default
    tol = tolerances(device)
    report = dict(versions=versions(device), mode="compiled" if on_gpu else "interpret",
                  precision={"reference": "float32, TF32 off",
                             "kernel_float32_dots": f32_dot_precision(),
                             "kernel_16bit_dots": "tf32 (exact for bf16/fp16 operands)"},
                  tol=tol, max_seconds=max_seconds)
    mode = f"compiled on {device}" if on_gpu else "interpret mode"
    log(f"\ntriton kernels vs kernels_triton/ref.py ({mode}): "
        + " ".join(f"{k}={v}" for k, v in report["versions"].items()), flush=True)
    rng = np.random.default_rng(seed)
    far_bytes = FAR_BYTES["device" if on_gpu else "cpu"]
    report["checks"] = run_checks(kernel, DEVICE_CHECKS if on_gpu else CPU_CHECKS,
                                  long=on_gpu, far_bytes=far_bytes, device=device, tol=tol,
                                  rng=rng, log=log)
    report["write_kv"] = check_write_kv(writer, WRITE_CHECKS["cuda" if on_gpu else "cpu"],
                                        far_bytes=far_bytes, device=device, rng=rng, log=log)
    if on_gpu:
        try:
            report["timing"] = run_timing(kernel, quick=quick, timer=CudaTimer(repeats),
                                          device=device, max_kv_gib=max_kv_gib,
                                          copy_gib=copy_gib, deadline=deadline, rng=rng,
                                          log=log)
        except Exception as exc:
            report["timing"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            log(f"triton timing FAILED: {report['timing']['error']}")
    else:
        report["timing"] = {"skipped": "no GPU (torch.cuda.is_available() is False)"}
        log(f"triton timing skipped: {report['timing']['skipped']}")
    failures = failures_of(report)
    report["failures"] = failures
    report["seconds"] = time.monotonic() - start
    log(f"triton kernels: {'FAILED: ' + str(len(failures)) if failures else 'all checks passed'}"
        f" ({report['seconds']:.0f}s)", flush=True)
    for line in failures:
        log(f"  {line}", flush=True)
    return report, failures


