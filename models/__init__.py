"""Model families, looked up by the `architectures` entry of a Hugging Face config.json."""

from __future__ import annotations

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
}


def resolve_architecture(hf_config: dict) -> str:
    """The supported architecture name of a config, or a ValueError listing what is supported."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(
        f"Unsupported model architecture {names or hf_config.get('model_type')!r}; jaxserve "
        f"supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}.")
