"""The CPU-fallback warning names the install command for the accelerator that is there."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from jaxserve.backends.jax.accelerators import warn_if_cpu_fallback

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("node,what,extra", [
    ("dev/nvidia0", "NVIDIA GPU", '"jax[cuda12]"'),
    ("dev/accel0", "TPU", '"jax[tpu]"'),
    ("dev/vfio/0", "TPU", '"jax[tpu]"'),
    ("dev/kfd", "AMD GPU", '"jax[rocm7-local]"'),
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



def test_every_install_hint_names_something_that_installs():
    """The name `jaxserve` on PyPI is an unrelated project's: messages and docs name jax's
    extras as jax publishes them, jaxserve's own extras from a clone (`-e ".[x]"`), or plain
    distributions; never `jaxserve[...]`."""
    import importlib.metadata
    import re

    tomllib = pytest.importorskip("tomllib")
    ours = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])
    jax_extras = set(importlib.metadata.metadata("jax").get_all("Provides-Extra"))
    files = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("jaxserve/**/*.py"),
             *ROOT.glob("server/*.py"), *ROOT.glob("models/**/*.py"),
             *ROOT.glob("docker/*"), *ROOT.glob("examples/*.ipynb")]
    seen = set()
    for path in files:
        text = path.read_text()
        assert "jaxserve[" not in text, path
        for extra in re.findall(r"\bjax\[([\w-]+)\]", text):
            assert extra in jax_extras, (path, extra)
            seen.add(extra)
        for group in re.findall(r"-e \\?[\"']?\.\[([\w,-]+)\]", text):
            assert set(group.split(",")) <= ours, (path, group)
    assert {"cuda12", "tpu", "rocm7-local"} <= seen
