"""The CPU-fallback warning names the install command for the accelerator that is there."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from jaxserve.backends.jax.accelerators import warn_if_cpu_fallback

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("node,what,extra", [
    ("dev/nvidia0", "NVIDIA GPU", ".[cuda]"),
    ("dev/accel0", "TPU", ".[tpu]"),
    ("dev/vfio/0", "TPU", ".[tpu]"),
])
def test_cpu_fallback_with_a_device_node_warns_with_the_install_command(tmp_path, caplog, node,
                                                                        what, extra):
    (tmp_path / node).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / node).touch()
    with caplog.at_level(logging.WARNING, logger="jaxserve.backends.jax.accelerators"):
        assert warn_if_cpu_fallback("cpu", dev_root=str(tmp_path))
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert what in record.getMessage() and extra in record.getMessage()


def test_no_warning_without_a_device_node_or_off_the_cpu(tmp_path, caplog):
    (tmp_path / "dev" / "vfio").mkdir(parents=True)
    (tmp_path / "dev" / "vfio" / "vfio").touch()  # the vfio control node alone is no TPU
    with caplog.at_level(logging.WARNING):
        assert not warn_if_cpu_fallback("cpu", dev_root=str(tmp_path))
        (tmp_path / "dev" / "nvidia0").touch()
        assert not warn_if_cpu_fallback("gpu", dev_root=str(tmp_path))
    assert not caplog.records


def test_accelerator_extras_delegate_to_jax():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(dep.startswith("jax[cuda") for dep in extras["cuda"])
    assert any(dep.startswith("jax[tpu]") for dep in extras["tpu"])
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[cuda]"' in readme and 'pip install -e ".[tpu]"' in readme
