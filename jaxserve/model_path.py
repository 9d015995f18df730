"""The model folder to load: the one given, or the built-in default model shipped inside the
package (no download)."""

from __future__ import annotations

import pathlib


def default_model_path() -> pathlib.Path:
    """The built-in model shipped inside the package (a small Llama trained on the Python
    standard library by scripts/train_default_model.py; see its README.md)."""
    return pathlib.Path(__file__).resolve().parent / "default_model"


def resolve_model(model: str | None, logger) -> str:
    """The model folder to load: the given one, or the built-in default (and say so)."""
    if model is not None:
        return str(model)
    path = default_model_path()
    if not (path / "config.json").is_file():
        raise ValueError(f"No model given and the built-in default model is missing from {path};"
                         " pass a model folder.")
    logger.info("No model given: using the built-in default model at %s", path)
    return str(path)
