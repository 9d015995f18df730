"""The family table (models/__init__.py's FAMILIES) and the per-backend capability table
(jaxserve/config/backend_capabilities.py): every family resolves, what a backend lacks is
refused by name, and docs/usage.md shows the table as capability_markdown renders it."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest

from jaxserve.config.backend_capabilities import (
    CAPABILITIES,
    FEATURE,
    FEATURES,
    capability_markdown,
    check_family,
    check_supported,
    supports,
)
from jaxserve.config.engine_config import EngineConfig
from jaxserve.models import FAMILIES, FAMILY_OF, SUPPORTED_ARCHITECTURES, model_family

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "usage.md"
NO_TORCH_MODEL = [family for family in FAMILIES if family.torch_model is None]


def test_docs_usage_shows_the_capability_table():
    table = capability_markdown()
    header = table.splitlines()[0]
    lines = DOC.read_text().splitlines()
    assert header in lines, (
        f"{DOC.relative_to(ROOT)} has no capability table; paste the output of python -c "
        "'from jaxserve.config.backend_capabilities import capability_markdown as m; "
        "print(m())' into its PyTorch/Triton backend section")
    start = lines.index(header)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    assert "\n".join(lines[start:end]) + "\n" == table


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_every_family_resolves(family):
    arch_module = importlib.import_module(family.arch.partition(":")[0])
    assert family.arch_module is arch_module
    assert family.arch_from_hf == getattr(arch_module, family.arch.partition(":")[2]).from_hf
    assert callable(family.param_path) and callable(family.param_shapes)
    pytest.importorskip("flax")
    assert isinstance(family.model_cls, type)
    if family.torch_model is None:
        assert family.torch_cls is None and family.torch_gap
    else:
        pytest.importorskip("torch")
        assert isinstance(family.torch_cls, type)


def test_every_architecture_belongs_to_one_family():
    assert sum(len(family.architectures) for family in FAMILIES) == len(FAMILY_OF)
    assert SUPPORTED_ARCHITECTURES == {name: f.name for name, f in FAMILY_OF.items()}
    for name, family in FAMILY_OF.items():
        assert model_family({"architectures": ["Unknown", name]}) is family


def test_reading_the_tables_imports_no_framework():
    code = textwrap.dedent("""
        import sys
        from jaxserve.config.backend_capabilities import capability_markdown
        from jaxserve.models import FAMILIES, model_family

        capability_markdown()
        for family in FAMILIES:
            family.arch_from_hf, family.param_path, family.param_shapes
        model_family({"architectures": ["LlamaForCausalLM"]})
        loaded = [m for m in sys.modules if m.split(".")[0] in ("jax", "flax", "torch")]
        assert not loaded, loaded
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("family", NO_TORCH_MODEL, ids=lambda family: family.name)
def test_a_family_without_a_torch_model_is_refused_on_torch_by_name(family):
    for name in family.architectures:
        check_family("jax", {"architectures": [name]})
        with pytest.raises(ValueError, match="runs on the JAX backend only") as err:
            check_family("torch", {"architectures": [name]})
        message = str(err.value)
        assert family.label in message and name in message and "torch backend" in message
        assert "backend='jax'" in message


@pytest.mark.parametrize("arch,label", [("gpt_oss", "GPT-OSS"), ("deepseek_v3", "DeepSeek")])
def test_engine_config_refuses_those_families_on_torch(tiny_checkpoints, arch, label):
    with pytest.raises(ValueError, match=f"{label} .* runs on the JAX backend only"):
        EngineConfig.create(str(tiny_checkpoints[arch]), backend="torch", max_model_len=64)


def test_the_jax_backend_has_every_feature_and_the_torch_backend_refuses_them():
    assert CAPABILITIES["jax"].features == set(FEATURE)
    config = types.SimpleNamespace(model=types.SimpleNamespace(model="/models/x"),
                                   parallel=types.SimpleNamespace(mesh="1x2"))
    for feature in FEATURES:
        if feature.fallback:  # not refused: the backend does the fallback instead
            assert not supports("torch", feature.name)
            continue
        with pytest.raises(ValueError) as err:
            check_supported("torch", feature.name, config)
        message = str(err.value)
        assert "JAX backend" in message, message  # the backend that has it
        check_supported("jax", feature.name, config)
        check_supported("auto", feature.name, config)


def test_multi_host_on_torch_names_the_backend():
    with pytest.raises(ValueError, match="the torch backend runs on one device"):
        check_supported("torch", "multi_host")
