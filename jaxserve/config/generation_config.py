"""The model's sampling defaults and EOS ids from generation_config.json, as vLLM applies them.

`generation_config="auto"` (vLLM's default): the model folder's generation_config.json sets
the defaults of temperature, top_p, top_k, min_p, repetition_penalty and max_tokens (from
max_new_tokens); a request's own values win. "vllm": the file is ignored (SamplingParams'
own defaults). A folder: its generation_config.json instead of the model's.
"""

from __future__ import annotations

import json
from pathlib import Path

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param set).
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model: str, generation_config: str) -> dict:
    """The SamplingParams fields the model's generation config sets ({} for "vllm", or when
    the file sets none of them)."""
    if generation_config == "vllm":
        return {}
    folder = Path(model) if generation_config == "auto" else Path(generation_config)
    if generation_config != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                         f"generation_config.json; {generation_config!r} is none of them.")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err}).") from None
    return {field: values[key] for key, field in _KEYS.items()
            if isinstance(values, dict) and values.get(key) is not None}


def eos_token_ids(model: str, hf_config: dict, tokenizer_eos: int | None) -> set[int]:
    """EOS ids from the model folder's generation_config.json, else config.json, else the
    tokenizer's EOS token."""
    path = Path(model) / "generation_config.json"
    for source in (json.loads(path.read_text()) if path.is_file() else {}, hf_config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {int(eos)}
    return {tokenizer_eos} if tokenizer_eos is not None else set()
