"""Model families, looked up by the `architectures` entry of a Hugging Face config.json.

This folder's own modules are numpy only: the family table, each family's architecture
settings and checkpoint-tensor mapping (`*_arch.py`) and the int8 weight scheme
(`quantization.py`), shared by both backends. The models themselves are in `jax/` (Flax
NNX) and `torch/` (PyTorch). The folder sits at the repository root and installs as
`jaxserve.models` (pyproject's package-dir): import it as `jaxserve.models`."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from jaxserve.models import llama_arch


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One row of FAMILIES: a family's Hugging Face architectures and where its code lives,
    as "module:Class" names imported on first use (as vLLM's model registry), so reading the
    table imports neither jax nor torch. arch's module (numpy only, both backends) holds the
    settings class and the checkpoint mapping: hf_param_path and param_shapes."""

    name: str  # "llama", "mixtral", "gemma", "gpt_oss", "deepseek": models/<name>_arch.py
    label: str  # what messages and the docs call it
    architectures: tuple[str, ...]  # config.json's `architectures` entries it serves
    arch: str  # the settings class (a frozen dataclass: LlamaArch or a subclass)
    jax_model: str  # the Flax NNX model, (arch, dtype, ...) -> module
    torch_model: str | None  # its PyTorch twin; None: the torch backend has none
    torch_gap: str = ""  # without a twin: what the torch backend lacks for it

    @property
    def arch_module(self):
        """models/<name>_arch.py (numpy only)."""
        return importlib.import_module(self.arch.partition(":")[0])

    @property
    def arch_from_hf(self) -> Callable:
        """(hf config dict) -> arch, a frozen dataclass (LlamaArch or subclass)."""
        return _load(self.arch).from_hf

    @property
    def param_path(self) -> Callable:
        """(HF tensor name, arch) -> load_params target(s), None, or KeyError."""
        return self.arch_module.hf_param_path

    @property
    def param_shapes(self) -> Callable:
        """(arch, quantization) -> {parameter path: (shape, dtype or None)}."""
        return self.arch_module.param_shapes

    @property
    def model_cls(self) -> Callable:
        """The Flax NNX model class, (arch, dtype, ...) -> module with call(kv_caches, batch,
        ...) and logits(); imports jax and flax."""
        return _load(self.jax_model)

    @property
    def torch_cls(self) -> Callable | None:
        """The PyTorch model class, (arch, dtype, quantization=...) -> torch.nn.Module;
        imports torch. None where the family has no twin (EngineConfig refuses it on the
        torch backend)."""
        return None if self.torch_model is None else _load(self.torch_model)

    def model_path(self, backend: str) -> str | None:
        """The "module:Class" of `backend`'s ("jax" or "torch") model, None where it has none."""
        return {"jax": self.jax_model, "torch": self.torch_model}[backend]


# The model families: every architecture jaxserve serves, its family's settings and
# checkpoint mapping, and each backend's model of it.
FAMILIES = (
    ModelFamily(
        "llama", "Llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
         "Phi3ForCausalLM",  # Phi-3, Phi-4: fused projections, partial rotary
         # Pooling checkpoints (embeddings, classification heads): runner="pooling"
         *llama_arch.POOLING_ARCHITECTURES),
        arch="jaxserve.models.llama_arch:LlamaArch",
        jax_model="jaxserve.models.jax.llama:LlamaForCausalLM",
        torch_model="jaxserve.models.torch.llama:LlamaForCausalLM"),
    ModelFamily(
        "mixtral", "Mixtral",
        ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
        arch="jaxserve.models.mixtral_arch:MixtralArch",
        jax_model="jaxserve.models.jax.mixtral:MixtralForCausalLM",
        # the Llama twin runs the mixture-of-experts layers too (its SparseMoE)
        torch_model="jaxserve.models.torch.llama:LlamaForCausalLM"),
    ModelFamily(
        "gemma", "Gemma",
        ("Gemma2ForCausalLM", "Gemma3ForCausalLM",
         "Gemma3ForConditionalGeneration"),  # its language model; images are refused
        arch="jaxserve.models.gemma_arch:GemmaArch",
        jax_model="jaxserve.models.jax.gemma:GemmaForCausalLM",
        torch_model="jaxserve.models.torch.gemma:GemmaForCausalLM"),
    ModelFamily(
        # attention sinks, biased MoE; MXFP4 experts dequantized
        "gpt_oss", "GPT-OSS", ("GptOssForCausalLM",),
        arch="jaxserve.models.gpt_oss_arch:GptOssArch",
        jax_model="jaxserve.models.jax.gpt_oss:GptOssForCausalLM",
        torch_model=None,
        torch_gap="the torch backend's models have no attention sinks or biased experts"),
    ModelFamily(
        # multi-head latent attention over a latent cache, grouped routing, shared experts
        "deepseek", "DeepSeek", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
        arch="jaxserve.models.deepseek_arch:DeepseekArch",
        jax_model="jaxserve.models.jax.deepseek:DeepseekForCausalLM",
        torch_model=None,
        torch_gap="the torch backend has no latent cache or MLA kernel for its multi-head "
                  "latent attention"),
)

FAMILY_OF = {name: family for family in FAMILIES for name in family.architectures}
SUPPORTED_ARCHITECTURES = {name: family.name for name, family in FAMILY_OF.items()}


def _load(target: str):
    """The class a table entry names, "module:Class", imported."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def pooling_task(hf_config: dict) -> str | None:
    """What a pooling checkpoint does natively: "embed" (a *Model, the decoder alone),
    "classify" (a *ForSequenceClassification) or None (a generative architecture)."""
    name = resolve_architecture(hf_config)
    if name not in llama_arch.POOLING_ARCHITECTURES:
        return None
    return "classify" if name.endswith("ForSequenceClassification") else "embed"


def resolve_architecture(hf_config: dict) -> str:
    """The supported architecture name of a config, or a ValueError listing what is supported."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(
        f"Unsupported model architecture {names or hf_config.get('model_type')!r}; jaxserve "
        f"supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}.")


def model_family(hf_config: dict) -> ModelFamily:
    """The family of a config's architecture (ValueError as resolve_architecture). numpy only:
    the models load on first use of `model_cls` / `torch_cls`, so host-side code, `jaxserve
    plan` and the torch backend never import jax or flax through here."""
    return FAMILY_OF[resolve_architecture(hf_config)]
