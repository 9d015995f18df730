"""scripts/check_kernels_on_device.py runs on the CPU: both Pallas kernels in interpret mode,
jax's GPU paged_attention through our layout conversion, the GPU MLA (latent attention)
kernel against mla_ref, and the in-place KV-cache write; then the checks of
scripts/check_triton_kernels.py, the torch backend's Triton kernels (interpret mode;
jaxserve/benchmarks/triton_*.py).

The timing halves need an accelerator; here the shared bookkeeping (the batch builder, the
bytes and flops a case moves, the shape grid's memory cap) is checked, and the Triton
half's timing path runs whole on CPU tensors (Triton's interpreter, a wall-clock timer in
place of CUDA events and graphs), SDPA baseline and memory skip included. Wrong kernels
injected into the Triton checks must come out as failures, and the Triton part's failures,
skips and crashes must reach the combined script's report and exit status.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.benchmarks import kernel_checks
from jaxserve.benchmarks.ragged_batch import make_batch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "check_kernels_on_device.py"


def load_script():
    spec = importlib.util.spec_from_file_location("check_kernels_on_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def triton_modules():
    """(triton_checks, triton_run, triton_timing): they import torch."""
    from jaxserve.benchmarks import triton_checks, triton_run, triton_timing

    return triton_checks, triton_run, triton_timing


@pytest.mark.slow  # ~95 s; the kernels themselves are tested in test_pallas_kernels.py
def test_cpu_run_checks_every_kernel_in_interpret_mode(tmp_path):
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", str(report)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    first = out.stdout.splitlines()[0]
    for field in ("python=", "jax=", "jaxlib=", "platform=cpu", "device_kind="):
        assert field in first
    assert "interpret mode" in out.stdout and "all checks passed" in out.stdout
    data = json.loads(report.read_text())
    checks = data["checks"]
    for kernel in ("gpu", "tpu"):
        mine = [c for c in checks if c["kernel"] == kernel]
        assert {c["kind"] for c in mine} == {"decode", "prefill", "mixed", "far-decode"}
        assert {c["dtype"] for c in mine} == {"float32", "bfloat16"}
        assert any(c["sliding_window"] and c["soft_cap"] for c in mine)
        assert all(c["ok"] for c in mine)
    assert [c["ok"] for c in checks if c["kernel"] == "jax-paged-attention"] == [True]
    quantized = data["quantized"]  # fp8 / int8 caches, each kernel, vs ref on their values
    assert {(q["kernel"], q["dtype"]) for q in quantized} == {
        (k, f"bf16+{f}-kv") for k in ("gpu", "tpu") for f in ("fp8", "int8")}
    assert all(q["ok"] and 0 < q["error_vs_unquantized"] < 0.1 for q in quantized)
    mla = data["mla"]  # the GPU MLA kernel in interpret mode against mla_ref; no timing
    assert [(c["kernel"], c["kind"], c["dtype"]) for c in mla] == [
        ("gpu-mla", kind, f"bf16+{case[6]}-kv" if len(case) > 6 else dtype)
        for case in kernel_checks.MLA_CHECKS["cpu"] for kind, dtype in [case[:2]]]
    assert all(c["ok"] for c in mla)
    lines = [line for line in out.stdout.splitlines() if line.startswith("check ")]
    assert len(lines) == len(checks) + len(quantized) + len(mla)
    assert all(" ok [" in line for line in lines)
    writes = data["write_kv"]
    assert [w["pages"] for w in writes] == [64, 256, 1024]
    assert all(w["ok"] and w["same_buffer"] for w in writes)
    assert data["attention"] == []  # no timing without an accelerator
    triton = data["triton"]  # the torch backend's kernels, after the JAX ones
    assert triton["status"] == "ran" and triton["mode"] == "interpret"
    assert triton["failures"] == [] and all(c["ok"] for c in triton["checks"] + triton["write_kv"])
    assert triton["timing"] == {"skipped": "no GPU (torch.cuda.is_available() is False)"}
    assert "triton kernels: all checks passed" in out.stdout


def test_mla_checks_in_interpret_mode():
    """~10 s: the script's MLA part on the CPU, the GPU MLA kernel in interpret mode against
    mla_ref on a decode and a padded mixed batch, and over an fp8 latent cache (scales
    folded in as the engine does, against mla_ref on the dequantized cache); no timing
    without a device."""
    m = load_script()
    results = m.run_mla(["gpu", "tpu"], {}, interpret=True, args=m.parse_args([]),
                        copy_bw=None, rng=np.random.default_rng(0))
    json.dumps(results)
    cases = kernel_checks.MLA_CHECKS["cpu"]
    assert [(r["kernel"], r["kind"], r["dtype"], r["N"], r["latent"], r["rope"])
            for r in results] == [("gpu-mla", kind, f"bf16+{fmt[0]}-kv" if fmt else dtype, N,
                                   C, R) for kind, dtype, _, N, C, R, *fmt in cases]
    assert "bf16+fp8-kv" in {r["dtype"] for r in results}
    for r, (_, dtype, *_) in zip(results, cases):
        assert r["ok"] and r["error"] <= r["tol"] == kernel_checks.TOL[dtype]
        assert r["K"] == 1 and r["H"] == f"{r['latent']}+{r['rope']}"
    mixed = results[1]
    assert mixed["T"] > 1 and mixed["R"] > 1 and mixed["T"] & (mixed["T"] - 1) == 0  # padded
    assert m.run_mla(["tpu"], {}, interpret=True, args=m.parse_args([]), copy_bw=None,
                     rng=np.random.default_rng(0)) == []  # no TPU MLA kernel checked yet


def test_wrong_mla_kernels_are_failures():
    """A kernel off by a little, one that raises, and an MLA kernel that does not import are
    failed checks, each a result."""
    import jax.numpy as jnp

    from jaxserve.benchmarks import pallas_checks
    from jaxserve.kernels_pallas import mla_ref

    def off(q_latent, q_rope, cache, batch, *, scale):
        return mla_ref.ragged_paged_mla(q_latent, q_rope, cache, batch, scale=scale) * 1.1

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    case = [("mixed", "float32", 16, 2, 16, 16)]
    results = pallas_checks.run_mla_checks({"off": off, "broken": broken}, case, long=False,
                                           rng=np.random.default_rng(0))
    assert [r["kernel"] for r in results] == ["off", "broken"]
    assert not results[0]["ok"] and 0.05 < results[0]["error"] < 1
    assert not results[1]["ok"] and results[1]["exception"] == "RuntimeError: launch failed"
    assert jnp.dtype(results[0]["dtype"]) == jnp.float32
    m = load_script()
    failed: list = []
    m.MLA_KERNELS = {"gpu": "jaxserve.kernels_pallas.no_such_kernel"}
    assert m.load_mla_kernels(["gpu"], True, failed) == {}
    assert failed[0]["kernel"] == "gpu-mla" and not failed[0]["ok"]
    assert failed[0]["exception"].startswith("load: ")


@pytest.mark.slow  # the suite's time budget; the MLA correctness checks run by default
def test_mla_timing_path_on_the_cpu():
    """The device's MLA timing code on tiny shapes, the references standing in for the
    kernels: rows with bandwidth, the MHA-equivalent beside the fewest heads only, a kernel
    that raises is an error row, and past the deadline the cases are skipped."""
    from jaxserve.benchmarks import pallas_checks
    from jaxserve.kernels_pallas import mla_ref, ref

    dims = dict(block_size=16, latent=32, rope=16, heads=(2, 4), rows=(3,), context=40,
                mha_head_dim=16, dtype="bfloat16")
    rows = pallas_checks.run_mla_timing(mla_ref.ragged_paged_mla, ref.ragged_paged_attention,
                                        repeats=1, copy_bw=1e9, deadline=math.inf,
                                        rng=np.random.default_rng(0), dims=dims)
    json.dumps(rows)
    assert [(r["N"], r["rows"]) for r in rows] == [(2, 3), (4, 3)]
    for r in rows:
        assert r["ms"] > 0 and r["gbs"] > 0 and r["tflops"] > 0 and r["pct_copy"] > 0
        assert r["kv_gib"] * 2**30 == (1 + 3 * 3) * 16 * 48 * 2  # null page + 3 pages a row
    assert rows[0]["mha_ms"] > 0 and rows[0]["mha_kv_gib"] > rows[0]["kv_gib"]
    assert "mha_ms" not in rows[1]

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    bad = pallas_checks.run_mla_timing(broken, None, repeats=1, copy_bw=None,
                                       deadline=math.inf, rng=np.random.default_rng(0),
                                       dims={**dims, "heads": (2,)})
    assert bad == [dict(kernel="mla", kind="mla-timing", rows=3, N=2,
                        error="RuntimeError: launch failed")]
    assert pallas_checks.run_mla_timing(broken, None, repeats=1, copy_bw=None, deadline=0,
                                        rng=np.random.default_rng(0), dims=dims) == []


def test_make_batch_layout():
    S = 16
    specs = [(1, 40), (9, 23), (1, 17)]
    batch = make_batch(specs, block_size=S, num_tokens=16, num_rows=4,
                       rng=np.random.default_rng(0))
    tables, pages = batch.block_tables, batch.num_pages
    assert pages == 1 + 3 + 2 + 2 and tables.shape == (4, 3)
    used = np.concatenate([tables[0, :3], tables[1, :2], tables[2, :2]])
    assert sorted(used) == list(range(1, pages))  # distinct pages, never the null page
    np.testing.assert_array_equal(batch.cu_q_lens, [0, 1, 10, 11, 11])
    np.testing.assert_array_equal(batch.kv_lens, [40, 23, 17, 0])
    positions, slots = batch.positions, batch.slot_mapping
    np.testing.assert_array_equal(positions[:11], [39, *range(14, 23), 16])
    assert slots[0] == tables[0, 2] * S + 7 and slots[10] == tables[2, 1] * S
    assert np.all(slots[11:] == 0)  # padding tokens write into the null page
    np.testing.assert_array_equal(batch.logits_indices, [0, 9, 10, 0])
    assert batch.num_seqs == 3 and batch.real_tokens == 11


def test_make_batch_pool_far_pages_and_junk_tables():
    """The variants the tests and the Triton checks use: a bigger pool of pages, pages that
    start far into the cache, block-table entries beyond a row's pages pointing anywhere."""
    specs = [(1, 40), (9, 23)]
    batch = make_batch(specs, block_size=16, rng=np.random.default_rng(0), width=8, pool=20,
                       junk_tables=True)
    assert batch.num_pages == 21 and batch.block_tables.shape == (2, 8)
    owned = np.concatenate([batch.block_tables[0, :3], batch.block_tables[1, :2]])
    assert len(set(owned)) == 5 and owned.min() >= 1 and owned.max() <= 20
    far = make_batch(specs, block_size=16, rng=np.random.default_rng(0), first_page=1000)
    assert far.num_pages == 1005 and sorted(far.block_tables[far.block_tables > 0]) == \
        list(range(1000, 1005))


def test_work_and_shape_grid():
    nbytes, flops = kernel_checks.attention_work([(1, 10), (3, 3)], N=4, K=2, H=8, itemsize=2)
    assert nbytes == (2 * 13 * 2 * 8 + 2 * 4 * 4 * 8) * 2
    assert flops == 4 * 4 * 8 * (10 + 1 + 2 + 3)
    # MLA: one C + R entry per key for every head; q_latent, q_rope and out per query head
    nbytes, flops = kernel_checks.mla_work([(1, 10), (3, 3)], N=4, C=32, R=16, itemsize=2)
    assert nbytes == (13 * 48 + 4 * 4 * (32 + 16 + 32)) * 2
    assert flops == 4 * (2 * 48 + 2 * 32) * (10 + 1 + 2 + 3)
    device = kernel_checks.MLA_CHECKS["device"]  # V3's latent, 16 and 128 heads, every kind
    assert {(C, R) for *_, C, R in (case[:6] for case in device)} == {(512, 64)}
    assert {case[6] for case in device if len(case) > 6} == {"fp8", "int8"}
    assert {(kind, N) for kind, dtype, _, N, *_ in device if dtype == "bfloat16"} >= {
        (kind, N) for kind in ("decode", "mixed") for N in (16, 128)} | {("prefill", 16)}
    cases = kernel_checks.bench_cases(quick=False, max_kv_gib=40)
    assert "decode 256 x ctx 32768" in cases and len(cases) == 15 + 3
    small = kernel_checks.bench_cases(quick=True, max_kv_gib=1)  # at most 1 GiB of K+V
    assert "decode 256 x ctx 32768" not in small and "decode 1 x ctx 512" in small


def test_relative_error_and_check_lines():
    """One error measure for numpy and torch outputs; a non-finite value anywhere is inf."""
    import torch

    want = np.array([[1.0, -2.0], [4.0, 0.0]])
    got = want + np.array([[0.0, 0.5], [100.0, 0.0]])  # row 1 (padding) is not compared
    assert kernel_checks.relative_error(got, want, 1) == 0.25
    assert kernel_checks.relative_error(torch.tensor(got), torch.tensor(want), 1) == 0.25
    got[1, 1] = np.nan
    assert kernel_checks.relative_error(got, want, 1) == math.inf
    assert kernel_checks.relative_error(torch.tensor(got), torch.tensor(want), 1) == math.inf
    result = dict(kernel="gpu", kind="decode", dtype="float32", S=16, K=1, N=8, H=128, T=5,
                  R=5, sliding_window=None, soft_cap=None, error=2e-5, tol=1e-5, ok=False,
                  informational=False, seconds=0.25)
    assert kernel_checks.check_label(result).split() == \
        ["check", "gpu", "decode", "float32", "S=16", "K=1", "N=8", "H=128", "T=5", "R=5"]
    assert kernel_checks.check_verdict(result) == "err 2.00e-05 (tol 1e-05) FAIL [0.2s]"
    result.update(informational=True)
    assert kernel_checks.check_verdict(result).endswith("(informational: jax's kernel, "
                                                        "not ours) [0.2s]")
    result.update(informational=False, padding_nonzero=3, error=0.0, ok=False)
    assert "3 nonzero padding values FAIL" in kernel_checks.check_verdict(result)


# ----------------------------------------------------------------------------- Triton part


def wrong_attention(q, k_cache, v_cache, batch, **opts):
    """The reference, with the last token's row off: a real token (error) or, in a padded
    bucket, a padding row that is not zero."""
    from jaxserve.kernels_triton import ref

    out = ref.ragged_paged_attention(q, k_cache, v_cache, batch, **opts)
    out[-1] += 1
    return out


def wrong_write(k_cache, v_cache, k, v, slot_mapping):
    """The reference, one slot off."""
    from jaxserve.kernels_triton import ref

    ref.write_kv(k_cache, v_cache, k, v, slot_mapping + 1)


def scribbling_write(k_cache, v_cache, k, v, slot_mapping):
    """The reference, plus a write into the last slot of every page."""
    from jaxserve.kernels_triton import ref

    ref.write_kv(k_cache, v_cache, k, v, slot_mapping)
    v_cache[:, -1] = 7


def test_triton_checks_pass_in_interpret_mode():
    """~10 s: every CPU case of the Triton attention and KV write in Triton's interpreter."""
    _, triton_run, _ = triton_modules()
    report, failures = triton_run.run(device="cpu", quick=True, log=lambda *a, **k: None)
    assert failures == [] and report["failures"] == []
    json.dumps(report)  # the combined script writes it as JSON
    assert report["mode"] == "interpret" and report["versions"]["device"] == "cpu"
    assert report["precision"]["kernel_float32_dots"] == "ieee"
    assert report["tol"] == {"float32": 1e-5, "bfloat16": 2e-2}
    checks = report["checks"]
    assert {c["kind"] for c in checks} == {"decode", "prefill", "mixed", "far-decode"}
    assert {c["dtype"] for c in checks} == {"float32", "bfloat16"}
    assert any(c["sliding_window"] and c["soft_cap"] for c in checks)
    assert all(c["ok"] and c["padding_nonzero"] == 0 and c["error"] <= c["tol"] for c in checks)
    assert any(c["T"] > c["real_tokens"] for c in checks)  # padded buckets were checked
    writes = report["write_kv"]
    assert {(w["dtype"], w["cache_dtype"]) for w in writes} == \
        {("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")}
    assert any(w["far"] for w in writes)
    assert all(w["ok"] and w["in_place"] and w["others_untouched"] for w in writes)
    assert report["timing"] == {"skipped": "no GPU (torch.cuda.is_available() is False)"}


def test_wrong_triton_kernels_are_failures():
    triton_checks, triton_run, _ = triton_modules()
    report, failures = triton_run.run(device="cpu", kernel=wrong_attention, writer=wrong_write,
                                      log=lambda *a, **k: None)
    checks = len(triton_checks.CPU_CHECKS) + len(triton_checks.WRITE_CHECKS["cpu"])
    assert len(failures) == checks
    assert not any(c["ok"] for c in report["checks"] + report["write_kv"])
    padded = [c for c in report["checks"] if c["T"] > c["real_tokens"]]
    assert padded and all(c["padding_nonzero"] > 0 for c in padded)
    assert all(c["error"] > c["tol"] for c in report["checks"] if c not in padded)
    assert all(w["error"] > 0 for w in report["write_kv"])
    assert any("nonzero padding" in f for f in failures)
    report, failures = triton_run.run(device="cpu", kernel=wrong_attention,
                                      writer=scribbling_write, log=lambda *a, **k: None)
    assert all(not w["others_untouched"] and not w["ok"] for w in report["write_kv"])

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    report, failures = triton_run.run(device="cpu", kernel=broken, writer=broken,
                                      log=lambda *a, **k: None)
    assert len(failures) == checks
    assert all("RuntimeError: launch failed" in c["exception"]
               for c in report["checks"] + report["write_kv"])


# Tiny stand-ins for the GPU grid: S, K, N, H, dtype.
TINY_DIMS = (16, 1, 4, 16, "bfloat16")
TINY_CASES = {"decode 2 x ctx 40": [(1, 40)] * 2,
              "prefill 2 x 24 fresh": [(24, 24)] * 2,  # padded to 64 tokens
              "mixed": [(5, 30), (1, 17), (1, 50)]}


def test_triton_timing_path_runs_on_cpu_tensors(monkeypatch):
    """~10 s: the GPU timing grid's code on CPU tensors in interpret mode, a wall-clock timer
    standing in for CUDA events: dense SDPA on the same keys and values agrees with the
    kernel (decode, causal prefill), ragged batches time the kernel alone; a kernel that
    disagrees with SDPA, and one that raises, are failures; a case too big for the free
    memory is skipped."""
    import torch

    _, triton_run, timing_module = triton_modules()
    cpu = torch.device("cpu")
    kernel, _ = triton_run.load_kernels(cpu)
    quiet = lambda *a, **k: None
    timing = timing_module.run_timing(kernel, quick=True, timer=timing_module.HostTimer(),
                                      device=cpu, max_kv_gib=1, copy_gib=2**-10,
                                      deadline=math.inf, rng=np.random.default_rng(0),
                                      dims=TINY_DIMS, cases=TINY_CASES, log=quiet)
    json.dumps(timing)
    assert timing["copy_bandwidth_gbs"] > 0 and timing["dims"]["head_dim"] == 16
    rows = {r["case"]: r for r in timing["rows"]}
    assert list(rows) == list(TINY_CASES)
    for row in rows.values():
        assert row["ms"] == row["eager_ms"] > 0 and "graph_ms" not in row  # no graphs here
        assert row["gbs"] > 0 and row["tflops"] > 0 and row["pct_copy"] > 0
        assert row["blocks"].startswith("Q")
    assert rows["prefill 2 x 24 fresh"]["T"] == 64 and rows["mixed"]["R"] == 4
    for name in ("decode 2 x ctx 40", "prefill 2 x 24 fresh"):
        assert rows[name]["sdpa_ok"] and rows[name]["sdpa_err"] < timing_module.SDPA_TOL
        assert rows[name]["sdpa_ms"] > 0 and rows[name]["sdpa_over_triton"] > 0
    assert "sdpa_ms" not in rows["mixed"]  # no dense equivalent of a ragged batch
    assert triton_run.failures_of({"timing": timing}) == []

    decode = {"decode 2 x ctx 40": TINY_CASES["decode 2 x ctx 40"]}
    zeros = lambda q, *args, **kw: torch.zeros_like(q)
    bad = timing_module.run_timing(zeros, quick=True, timer=timing_module.HostTimer(),
                                   device=cpu, max_kv_gib=1, copy_gib=2**-10,
                                   deadline=math.inf, rng=np.random.default_rng(0),
                                   dims=TINY_DIMS, cases=decode, log=quiet)
    assert bad["rows"][0]["sdpa_ok"] is False
    assert "disagree" in triton_run.failures_of({"timing": bad})[0]

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(timing_module, "free_bytes", lambda device: 1 << 40)  # as a GPU says
    row = timing_module.time_case("x", decode["decode 2 x ctx 40"], broken,
                                  timer=timing_module.HostTimer(), device=cpu, dims=TINY_DIMS,
                                  copy_bw=None, rng=np.random.default_rng(0), with_sdpa=False)
    assert row["error"] == "RuntimeError: launch failed"
    assert triton_run.failures_of({"timing": {"rows": [row]}}) == \
        ["triton timing x: " + row["error"]]
    monkeypatch.setattr(timing_module, "free_bytes", lambda device: 1 << 20)
    row = timing_module.time_case("x", [(1, 32768)] * 4, broken,
                                  timer=timing_module.HostTimer(), device=cpu,
                                  dims=(16, 8, 64, 128, "bfloat16"), copy_bw=None,
                                  rng=np.random.default_rng(0))
    assert "GiB free on the GPU" in row["skipped"] and triton_run.failures_of(
        {"timing": {"rows": [row]}}) == []


def test_triton_gpu_only_pieces_on_the_cpu():
    """What the GPU run uses beyond the CPU checks: the fused-only SDPA (CPU flash), the
    device grid's dense shapes, the device-shaped cases (no far one: 8.5 GiB) and the
    reference's compacted inputs."""
    import torch

    triton_checks, _, timing_module = triton_modules()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.bfloat16)
               for shape in ((2, 4, 1, 32), (2, 1, 40, 32), (2, 1, 40, 32)))
    fused = timing_module.sdpa(q, k, v, scale=0.2, causal=False, fused_only=True)()
    plain = timing_module.sdpa(q, k, v, scale=0.2, causal=False, fused_only=False)()
    assert (fused.float() - plain.float()).abs().max() < 2e-2

    cases = kernel_checks.bench_cases(quick=False, max_kv_gib=40)
    dense_shape = timing_module.dense_shape
    assert dense_shape(cases["decode 8 x ctx 4096"]) == (8, 1, 4096, False)
    assert dense_shape(cases["prefill 8 x 2048 fresh"]) == (8, 2048, 2048, True)
    assert dense_shape(cases["mixed 1 x 2048 fresh + 127 decodes @ 4k"]) is None

    rng = np.random.default_rng(0)
    cpu = torch.device("cpu")
    for kind, dtype, S, K, N, H, *_ in kernel_checks.DEVICE_CHECKS:
        if kind == "far-decode":
            continue
        q, k_cache, v_cache, batch = triton_checks.random_case(
            kind, getattr(torch, dtype), S, K, N, H, rng=rng, long=True, far_bytes=0,
            device=cpu)
        assert q.shape == (batch.slot_mapping.shape[0], N, H) and k_cache.shape[1:] == (S, K, H)
        assert max(kv for _, kv in batch.specs) > 5 * S  # long contexts, as on the GPU
        owned = torch.unique(batch.block_tables[:int(batch.num_seqs[0])])
        owned = owned[owned > 0]
        assert bool(torch.isnan(k_cache[0]).all()) and bool(torch.isnan(v_cache[-1]).all())
        assert not bool(torch.isnan(k_cache[owned]).any())
        k32, v32, compact = triton_checks.compact_for_reference(k_cache, v_cache, batch)
        assert k32.dtype == torch.float32 and k32.shape[0] == len(owned) + 1  # + null page
        assert torch.allclose(k32[compact.block_tables.long()],  # NaN: the null page
                              k_cache[batch.block_tables.long()].float(), rtol=0, atol=0,
                              equal_nan=True)

    from jaxserve.kernels_triton import ref  # the GPU's write checks' shapes, checking ref

    writes = triton_checks.check_write_kv(
        ref.write_kv, [c for c in triton_checks.WRITE_CHECKS["cuda"] if not c[-1]],
        far_bytes=0, device=cpu, rng=rng, log=lambda *a, **k: None)
    assert len(writes) == 3 and all(w["ok"] and w["error"] == 0 for w in writes)

    far_bytes = kernel_checks.FAR_BYTES["cpu"]
    far = triton_checks.random_case("far-decode", torch.bfloat16, 16, 1, 4, 32, rng=rng,
                                    long=False, far_bytes=far_bytes, device=cpu)
    tables = far[3].block_tables
    assert int(tables[tables > 0].min()) * far[1][0].numel() * 2 >= far_bytes


def test_triton_section_skips_and_errors(monkeypatch):
    m = load_script()
    args = m.parse_args(["--quick"])
    assert args.triton_max_seconds is None and not args.skip_triton
    assert m.run_triton_section(m.parse_args(["--skip-triton"])) == \
        ({"status": "skipped: --skip-triton"}, [])
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    section, failures = m.run_triton_section(args)
    assert section["status"].startswith("skipped: torch/triton not installed") and not failures
    monkeypatch.undo()

    def broken_run(**kwargs):
        raise RuntimeError("no kernels today")

    _, triton_run, _ = triton_modules()
    monkeypatch.setattr(triton_run, "run", broken_run)
    section, failures = m.run_triton_section(args)
    assert section == {"status": "error: RuntimeError: no kernels today"}
    assert failures == ["triton kernels: RuntimeError: no kernels today"]


class Crash(BaseException):
    """What no except clause of the script catches: a stand-in for the process dying."""


@pytest.mark.parametrize("outcome", ["pass", "fail", "crash"])
def test_main_folds_the_triton_part_into_report_and_exit(monkeypatch, tmp_path, outcome):
    """The JAX part stubbed out: the Triton part's arguments, its section in the JSON, its
    failures in the exit status, and the JAX report on disk before it starts."""
    m = load_script()
    monkeypatch.setattr(m, "load_kernels", lambda names, interpret, report: {})
    monkeypatch.setattr(m, "run_checks", lambda *a, **k: [])
    monkeypatch.setattr(m, "check_write_kv", lambda **k: [])
    monkeypatch.setattr(m, "run_mla", lambda *a, **k: [])
    out = tmp_path / "report.json"
    calls = []

    def run(**kwargs):
        calls.append(kwargs)
        assert json.loads(out.read_text())["triton"] == {"status": "running"}
        if outcome == "crash":
            raise Crash
        return {"checks": [{"ok": outcome == "pass"}]}, [] if outcome == "pass" else ["bad"]

    _, triton_run, _ = triton_modules()
    monkeypatch.setattr(triton_run, "run", run)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--quick", "--json", str(out),
                                      "--triton-max-seconds", "30"])
    if outcome == "crash":
        with pytest.raises(Crash):
            m.main()
        data = json.loads(out.read_text())  # the JAX part survived
        assert data["triton"] == {"status": "running"} and "versions" in data
        return
    assert m.main() == (0 if outcome == "pass" else 1)
    assert calls == [dict(quick=True, max_seconds=30.0, repeats=5, max_kv_gib=40,
                          copy_gib=2)]
    data = json.loads(out.read_text())
    assert data["triton"] == {"status": "ran", "checks": [{"ok": outcome == "pass"}]}


@pytest.mark.parametrize("row", [{"ok": False, "error": 0.5}, {"ok": True, "error": 1e-3},
                                 {"kind": "mla-timing", "error": "RuntimeError: x"},
                                 {"kind": "mla-timing", "mha_error": "informational"}])
def test_main_counts_mla_failures(monkeypatch, tmp_path, row):
    """A failed MLA check or timing case fails the run; a passing check (its "error" is the
    measured one) and the MHA comparison's error do not. The MLA part gets the platform's
    MHA kernels and the attention timing's copy bandwidth."""
    m = load_script()
    monkeypatch.setattr(m, "load_kernels", lambda names, interpret, report: {})
    monkeypatch.setattr(m, "run_checks", lambda *a, **k: [])
    monkeypatch.setattr(m, "check_write_kv", lambda **k: [])
    calls = []

    def run_mla(names, kernels, **kwargs):
        calls.append((names, kernels, kwargs["interpret"], kwargs["copy_bw"]))
        return [row]

    monkeypatch.setattr(m, "run_mla", run_mla)
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--json", str(out), "--skip-triton"])
    assert m.main() == (1 if row.get("ok") is False or isinstance(row.get("error"), str)
                        else 0)
    assert calls == [(["gpu", "tpu"], {}, True, None)]
    assert json.loads(out.read_text())["mla"] == [row]
