"""The attention_backend setting: validation, the choice per (backend, platform), and the TPU
kernel in Pallas interpret mode reproducing the parity test's greedy tokens end to end."""

from __future__ import annotations

import functools
import importlib
import logging
import sys

import jax
import pytest
from support.parity import hf_greedy, run_jaxserve

from jaxserve.backends.jax.attend import attention_for
from jaxserve.cli import build_parser
from jaxserve.config.engine_args import EngineArgs
from jaxserve.config.engine_config import (
    ATTENTION_BACKENDS,
    JAX_ATTENTION_BACKENDS,
    AttentionConfig,
    EngineConfig,
)
from jaxserve.kernels_pallas import cpu_attention, ref

KERNELS = "jaxserve.kernels_pallas"
TPU_KERNEL = f"{KERNELS}.ragged_paged_attention"
GPU_KERNEL = f"{KERNELS}.gpu_ragged_paged_attention"


def test_unknown_backend_is_refused_with_the_accepted_values(tiny_checkpoint):
    with pytest.raises(ValueError, match="attention_backend") as err:
        EngineConfig.create(str(tiny_checkpoint), attention_backend="cudnn")
    assert all(name in str(err.value) for name in ATTENTION_BACKENDS)
    assert "'cudnn'" in str(err.value)
    # the torch backend's kernels, on the JAX backend: what the JAX backend takes instead
    with pytest.raises(ValueError, match="belongs to the torch backend") as err:
        EngineConfig.create(str(tiny_checkpoint), attention_backend="triton")
    assert all(name in str(err.value) for name in JAX_ATTENTION_BACKENDS)
    assert EngineConfig.create(str(tiny_checkpoint)).attention == AttentionConfig("auto")


def test_pallas_on_cpu_is_refused_with_what_to_use_instead():
    with pytest.raises(ValueError, match="attention_backend='pallas'") as err:
        attention_for("pallas", "cpu")
    assert "'interpret'" in str(err.value) and "'reference'" in str(err.value)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="pallas is valid on an accelerator")
def test_engine_start_up_refuses_pallas_on_cpu(tiny_checkpoint):
    from jaxserve import LLM

    with pytest.raises(ValueError, match="needs a TPU or GPU"):
        LLM(str(tiny_checkpoint), attention_backend="pallas", precompile=False)


def test_cli_flag_reaches_the_engine_arguments():
    args = build_parser().parse_args(["generate", "--attention-backend", "interpret", "hi"])
    assert EngineArgs.from_cli(args).attention_backend == "interpret"
    assert EngineArgs.from_cli(build_parser().parse_args(["generate", "hi"])) \
        .attention_backend == "auto"
    with pytest.raises(SystemExit):  # argparse lists the choices on stderr
        build_parser().parse_args(["generate", "--attention-backend", "cudnn", "hi"])


# (backend, platform) -> (module, interpret): interpret None means the plain function.
CHOICES = [
    ("auto", "cpu", cpu_attention.__name__, None),
    ("auto", "tpu", TPU_KERNEL, False),
    ("auto", "gpu", GPU_KERNEL, False),
    ("auto", "cuda", GPU_KERNEL, False),
    ("auto", "rocm", GPU_KERNEL, False),
    ("auto", "metal", ref.__name__, None),  # no kernel for the platform: the reference
    ("pallas", "tpu", TPU_KERNEL, False),
    ("pallas", "gpu", GPU_KERNEL, False),
    ("reference", "cpu", ref.__name__, None),
    ("reference", "tpu", ref.__name__, None),
    ("reference", "gpu", ref.__name__, None),
    ("interpret", "cpu", TPU_KERNEL, True),
    ("interpret", "gpu", TPU_KERNEL, True),
    ("interpret-gpu", "cpu", GPU_KERNEL, True),
    ("interpret-gpu", "tpu", GPU_KERNEL, True),
]


@pytest.mark.parametrize("backend, platform, module, interpret", CHOICES)
def test_each_backend_and_platform_gets_its_implementation(backend, platform, module,
                                                           interpret, caplog, monkeypatch):
    expected = pytest.importorskip(module).ragged_paged_attention
    monkeypatch.setattr(logging.getLogger("jaxserve"), "propagate", True)  # to caplog
    with caplog.at_level(logging.INFO, logger="jaxserve.backends.jax.runner"):
        fn = attention_for(backend, platform)
    if interpret is None:
        assert fn is expected
    else:
        assert isinstance(fn, functools.partial) and fn.func is expected
        assert fn.keywords == {"interpret": interpret} and not fn.args
    assert f"attention_backend={backend} on {platform}" in caplog.text  # the log says why


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_cpu_choices_do_not_need_the_kernel_modules(backend, monkeypatch):
    package = importlib.import_module(KERNELS)
    for name in (TPU_KERNEL, GPU_KERNEL):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
        monkeypatch.delattr(package, name.rsplit(".", 1)[1], raising=False)
    assert attention_for(backend, "cpu") in (cpu_attention.ragged_paged_attention,
                                            ref.ragged_paged_attention)
    with pytest.raises(ImportError):
        attention_for("interpret", "cpu")


# Two of the parity prompts (7 and 33 tokens), 8 new tokens. A 32-token budget chunks the
# longer prompt, so one step mixes a decode with a prefill chunk over cached context; the run
# compiles three buckets: (32, 2), (16, 2), and (16, 1) for the longer prompt's last step.
INTERPRET_PROMPTS = (1, 3)
INTERPRET_TOKENS = 8


# Slow (about 40 s on 2 cores: the suite's time budget); the TPU kernel against the reference
# on random ragged cases stays in the default suite (test_pallas_kernels.py).
@pytest.mark.slow
def test_tpu_kernel_in_interpret_mode_matches_the_parity_tokens(tiny_checkpoints,
                                                                 checkpoint_script):
    module = pytest.importorskip(TPU_KERNEL)
    prompts = [checkpoint_script.check_prompts()[i] for i in INTERPRET_PROMPTS]
    folder = tiny_checkpoints["llama"]
    got, llm = run_jaxserve(folder, prompts, new_tokens=INTERPRET_TOKENS,
                            attention_backend="interpret", block_size=16, max_num_seqs=2,
                            max_num_batched_tokens=32)
    assert llm.engine.runner.attention_fn.func is module.ragged_paged_attention
    assert got == hf_greedy(folder, prompts, new_tokens=INTERPRET_TOKENS)


def test_gpu_head_dim_the_kernel_cannot_tile():
    """auto falls back to the reference (and says so); pallas refuses with what to use."""
    module = pytest.importorskip(GPU_KERNEL)
    assert attention_for("auto", "cuda", head_dim=128).func is module.ragged_paged_attention
    assert attention_for("auto", "cuda", head_dim=80) is ref.ragged_paged_attention
    with pytest.raises(ValueError, match="head_dim"):
        attention_for("pallas", "cuda", head_dim=96)
