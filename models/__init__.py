"""Model families, looked up by the `architectures` entry of a Hugging Face config.json.

This folder's own modules are numpy only: the family table, each family's architecture
settings and checkpoint-tensor mapping (`*_arch.py`) and the int8 weight scheme
(`quantization.py`), shared by both backends. The models themselves are in `jax/` (Flax
NNX) and `torch/` (PyTorch). The folder sits at the repository root and installs as
`jaxserve.models` (pyproject's package-dir): import it as `jaxserve.models`."""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxserve.models import deepseek_arch, gemma_arch, gpt_oss_arch, llama_arch, mixtral_arch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",  # Phi-3, Phi-4: fused projections, partial rotary
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Gemma3ForConditionalGeneration": "gemma",  # its language model; images are refused
    "GptOssForCausalLM": "gpt_oss",  # attention sinks, biased MoE; MXFP4 experts dequantized
    # multi-head latent attention over a latent cache, grouped routing, shared experts
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    # Pooling checkpoints (embeddings, classification heads): served with runner="pooling"
    **dict.fromkeys(llama_arch.POOLING_ARCHITECTURES, "llama"),
}


def pooling_task(hf_config: dict) -> str | None:
    """What a pooling checkpoint does natively: "embed" (a *Model, the decoder alone),
    "classify" (a *ForSequenceClassification) or None (a generative architecture)."""
    name = resolve_architecture(hf_config)
    if name not in llama_arch.POOLING_ARCHITECTURES:
        return None
    return "classify" if name.endswith("ForSequenceClassification") else "embed"


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """How to build and load one family: its settings and checkpoint mapping (numpy, both
    backends) and, imported only when asked for, its Flax model."""

    name: str  # "llama", "mixtral", "gemma", "gpt_oss", "deepseek": models/<name>_arch.py, jax/<name>.py
    arch_from_hf: Callable  # (hf config dict) -> arch, a frozen dataclass (LlamaArch or subclass)
    param_path: Callable  # (HF tensor name, arch) -> load_params target(s), None, or KeyError
    param_shapes: Callable  # (arch, quantization) -> {parameter path: (shape, dtype or None)}

    @property
    def model_cls(self) -> Callable:
        """The Flax NNX model class, (arch, dtype, ...) -> module with call(kv_caches, batch,
        ...) and logits(); imports jax and flax."""
        if self.name == "mixtral":
            from jaxserve.models.jax.mixtral import MixtralForCausalLM

            return MixtralForCausalLM
        if self.name == "gemma":
            from jaxserve.models.jax.gemma import GemmaForCausalLM

            return GemmaForCausalLM
        if self.name == "gpt_oss":
            from jaxserve.models.jax.gpt_oss import GptOssForCausalLM

            return GptOssForCausalLM
        if self.name == "deepseek":
            from jaxserve.models.jax.deepseek import DeepseekForCausalLM

            return DeepseekForCausalLM
        from jaxserve.models.jax.llama import LlamaForCausalLM

        return LlamaForCausalLM


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
    the Flax model loads on first use of `model_cls`, so host-side code, `jaxserve plan` and
    the torch backend never import jax or flax through here."""
    family = SUPPORTED_ARCHITECTURES[resolve_architecture(hf_config)]
    if family == "mixtral":
        return ModelFamily("mixtral", mixtral_arch.MixtralArch.from_hf,
                           mixtral_arch.hf_param_path, mixtral_arch.param_shapes)
    if family == "gemma":
        return ModelFamily("gemma", gemma_arch.GemmaArch.from_hf, gemma_arch.hf_param_path,
                           gemma_arch.param_shapes)
    if family == "gpt_oss":
        return ModelFamily("gpt_oss", gpt_oss_arch.GptOssArch.from_hf,
                           gpt_oss_arch.hf_param_path, gpt_oss_arch.param_shapes)
    if family == "deepseek":
        return ModelFamily("deepseek", deepseek_arch.DeepseekArch.from_hf,
                           deepseek_arch.hf_param_path, deepseek_arch.param_shapes)
    return ModelFamily("llama", llama_arch.LlamaArch.from_hf, llama_arch.hf_param_path,
                       llama_arch.param_shapes)
