"""The model's sampling defaults and EOS ids from generation_config.json, as vLLM applies them.

`generation_config="auto"` (vLLM's default): the model folder's generation_config.json sets
the defaults of temperature, top_p, top_k, min_p, repetition_penalty and max_tokens (from
max_new_tokens); a request's own values win. "vllm": the file is ignored (SamplingParams'
own defaults). A folder: its generation_config.json instead of the model's.

load_json reads a model's JSON files (config.json too): Python's json takes NaN and
Infinity (and 1e999 as Infinity), which no model setting means, so they are refused by name.
"""

from __future__ import annotations

import json
import math
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
    values = load_json(path)
    return {field: values[key] for key, field in _KEYS.items()
            if isinstance(values, dict) and values.get(key) is not None}


def eos_token_ids(model: str, hf_config: dict, tokenizer_eos: int | None) -> set[int]:
    """EOS ids from the model folder's generation_config.json, else config.json, else the
    tokenizer's EOS token."""
    path = Path(model) / "generation_config.json"
    for source in (load_json(path) if path.is_file() else {}, hf_config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {int(eos)}
    return {tokenizer_eos} if tokenizer_eos is not None else set()


def load_json(path: Path):
    """The JSON file at path; ValueError naming the file when it is not valid JSON or holds
    a number that is not finite (naming its key path, e.g. text_config.rope_scaling.factor)."""
    try:
        value = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err}).") from None
    bad = _non_finite(value, "")
    if bad is not None:
        where, number = bad
        word = "NaN" if math.isnan(number) else "Infinity" if number > 0 else "-Infinity"
        raise ValueError(f"{path}: {where or 'the value'} is {word}; a model's JSON files "
                         "need finite numbers: fix or remove that entry.")
    return value


def _non_finite(value, where: str) -> tuple[str, float] | None:
    """(key path, number) of the first number in value that is not finite, else None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (where, value)
    if isinstance(value, dict):
        items = ((f"{where}.{key}" if where else str(key), v) for key, v in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for inner, v in items:
        bad = _non_finite(v, inner)
        if bad is not None:
            return bad
    return None
