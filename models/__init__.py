"""Model families, looked up by the `architectures` entry of a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from typing import Callable

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "mixtral",
}


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """How to build and load one family (one file in models/)."""

    arch_from_hf: Callable  # (hf config dict) -> arch, a frozen dataclass (LlamaArch or subclass)
    model_cls: Callable  # (arch, dtype) -> the nnx model: call(kv_caches, batch, ...), logits()
    param_path: Callable  # (HF tensor name, arch) -> load_params target(s), None, or KeyError


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
    """The family of a config's architecture (ValueError as resolve_architecture). The model
    modules are imported here, lazily: host-side code imports this package without jax."""
    if SUPPORTED_ARCHITECTURES[resolve_architecture(hf_config)] == "mixtral":
        from jaxserve.models import mixtral

        return ModelFamily(mixtral.MixtralArch.from_hf, mixtral.MixtralForCausalLM,
                           mixtral.hf_param_path)
    from jaxserve.models import llama

    return ModelFamily(llama.LlamaArch.from_hf, llama.LlamaForCausalLM, llama.hf_param_path)
