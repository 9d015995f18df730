"""scripts/check_kernels_on_device.py runs on the CPU: both Pallas kernels in interpret mode,
jax's GPU paged_attention through our layout conversion, and the in-place KV-cache write.

The timing half needs an accelerator; here only its bookkeeping (the batch builder, the
bytes and flops a case moves, the shape grid's memory cap) is checked.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "check_kernels_on_device.py"


def load_script():
    spec = importlib.util.spec_from_file_location("check_kernels_on_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~25 s; the kernels themselves are tested in test_pallas_kernels.py
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
    lines = [line for line in out.stdout.splitlines() if line.startswith("check ")]
    assert len(lines) == len(checks) and all(line.split()[-2] == "ok" for line in lines)
    writes = data["write_kv"]
    assert [w["pages"] for w in writes] == [64, 256, 1024]
    assert all(w["ok"] and w["same_buffer"] for w in writes)
    assert data["attention"] == []  # no timing without an accelerator


def test_make_batch_layout():
    m = load_script()
    S = 16
    specs = [(1, 40), (9, 23), (1, 17)]
    batch, pages = m.make_batch(specs, block_size=S, num_tokens=16, num_rows=4,
                                rng=np.random.default_rng(0))
    tables = np.asarray(batch.block_tables)
    assert pages == 1 + 3 + 2 + 2 and tables.shape == (4, 3)
    used = np.concatenate([tables[0, :3], tables[1, :2], tables[2, :2]])
    assert sorted(used) == list(range(1, pages))  # distinct pages, never the null page
    np.testing.assert_array_equal(np.asarray(batch.cu_q_lens), [0, 1, 10, 11, 11])
    np.testing.assert_array_equal(np.asarray(batch.kv_lens), [40, 23, 17, 0])
    positions, slots = np.asarray(batch.positions), np.asarray(batch.slot_mapping)
    np.testing.assert_array_equal(positions[:11], [39, *range(14, 23), 16])
    assert slots[0] == tables[0, 2] * S + 7 and slots[10] == tables[2, 1] * S
    assert np.all(slots[11:] == 0)  # padding tokens write into the null page


def test_work_and_shape_grid():
    m = load_script()
    nbytes, flops = m.attention_work([(1, 10), (3, 3)], N=4, K=2, H=8, itemsize=2)
    assert nbytes == (2 * 13 * 2 * 8 + 2 * 4 * 4 * 8) * 2
    assert flops == 4 * 4 * 8 * (10 + 1 + 2 + 3)
    cases = m.bench_cases(quick=False, max_kv_gib=40)
    assert "decode 256 x ctx 32768" in cases and len(cases) == 15 + 3
    small = m.bench_cases(quick=True, max_kv_gib=1)  # at most 1 GiB of K+V
    assert "decode 256 x ctx 32768" not in small and "decode 1 x ctx 512" in small
