"""A model's config.json and generation_config.json may not hold NaN or Infinity (Python's
json reads them, and 1e999 as Infinity): loading refuses them, naming the file and the key."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.generation_config import eos_token_ids, load_json, sampling_defaults


def edited_copy(folder, tmp_path, name: str, changes: dict):
    """A copy of the checkpoint folder whose JSON file `name` has `changes` merged in."""
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    path = copy / name
    values = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**values, **changes}))  # (json writes NaN and Infinity)
    return copy


def test_a_nan_in_config_json_is_refused_by_name(tiny_checkpoints, tmp_path):
    folder = edited_copy(tiny_checkpoints["llama"], tmp_path, "config.json",
                         {"rope_theta": float("nan")})
    with pytest.raises(ValueError, match=r"config\.json: rope_theta is NaN") as info:
        EngineConfig.create(str(folder), max_model_len=64, precompile=False)
    assert str(folder / "config.json") in str(info.value)


def test_a_nested_infinity_in_config_json_is_refused_with_its_key_path(tiny_checkpoints,
                                                                      tmp_path):
    folder = edited_copy(tiny_checkpoints["llama"], tmp_path, "config.json", {
        "text_config": {"rope_scaling": {"rope_type": "linear", "factor": float("inf")}}})
    with pytest.raises(ValueError, match=r"config\.json: text_config\.rope_scaling\.factor "
                                         r"is Infinity"):
        EngineConfig.create(str(folder), max_model_len=64, precompile=False)


def test_a_nan_in_generation_config_json_is_refused_by_name(tiny_checkpoints, tmp_path):
    folder = edited_copy(tiny_checkpoints["llama"], tmp_path, "generation_config.json",
                         {"temperature": float("nan")})
    with pytest.raises(ValueError, match=r"generation_config\.json: temperature is NaN"):
        sampling_defaults(str(folder), "auto")
    with pytest.raises(ValueError, match=r"generation_config\.json: temperature is NaN"):
        eos_token_ids(str(folder), {}, None)


@pytest.mark.parametrize("text, where", [
    ('{"a": [1.0, {"b": -Infinity}]}', r"a\[1\]\.b is -Infinity"),
    ('{"a": 1e999}', "a is Infinity"),  # too large for a float: read as Infinity
    ("NaN", "the value is NaN"),
])
def test_load_json_names_where_the_number_is(tmp_path, text, where):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=where):
        load_json(path)
    path.write_text('{"a": [1.5, -2, {"b": 1e300}], "c": "NaN"}')  # finite, and a string
    assert load_json(path)["a"][2]["b"] == 1e300
