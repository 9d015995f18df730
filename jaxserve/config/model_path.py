"""The model folder to load: the one given, or the built-in default model shipped inside the
package (no download)."""

from __future__ import annotations

import pathlib


def default_model_path() -> pathlib.Path:
    """The built-in model shipped inside the package (a small Llama trained on the Python
    standard library by scripts/train_default_model.py; see its README.md)."""
    return pathlib.Path(__file__).resolve().parents[1] / "default_model"  # jaxserve/default_model


def resolve_model(model: str | None, logger) -> str:
    """The model folder to load: a local folder as given; a Hugging Face Hub id (such as
    Qwen/Qwen2.5-0.5B-Instruct) from the Hub cache, downloaded into it first when it is not
    there and the network may be used (not with HF_HUB_OFFLINE=1); or, with no model, the
    built-in default (and say so)."""
    if model is None:
        path = default_model_path()
        if not (path / "config.json").is_file():
            raise ValueError(f"No model given and the built-in default model is missing from "
                             f"{path}; pass a model folder.")
        logger.info("No model given: using the built-in default model at %s", path)
        return str(path)
    model = str(model)
    local = pathlib.Path(model).expanduser()
    if local.is_dir():
        return str(local)
    if not _looks_like_hub_id(model):
        return model  # config.read_hf_config says what is wrong with it
    return _from_hub(model, logger)


_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.tiktoken", "*.txt"]


def _looks_like_hub_id(model: str) -> bool:
    """org/name or name: no path beyond one slash, no leading dot or slash."""
    parts = model.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not model.startswith((".", "~")) and \
        not any(p in (".", "..") for p in parts)


def _from_hub(repo_id: str, logger) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, local_files_only=True, allow_patterns=_HUB_FILES)
        logger.info("Model %s: from the Hugging Face cache at %s", repo_id, path)
        return path
    except LocalEntryNotFoundError:
        pass
    except Exception as err:  # a malformed id or cache entry: say so, with what to run
        raise ValueError(f"model {repo_id!r} is neither a local folder nor a usable Hugging "
                         f"Face Hub id ({type(err).__name__}: {str(err)[:160]}).") from None
    hint = (f"model {repo_id!r} is not a local folder and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it first with `hf download {repo_id}`, or "
            "pass a local model folder.")
    if constants.HF_HUB_OFFLINE:
        raise ValueError(hint + " (HF_HUB_OFFLINE is set: the network is not used.)")
    logger.info("Model %s: downloading from the Hugging Face Hub (safetensors, config and "
                "tokenizer files) into %s", repo_id, constants.HF_HUB_CACHE)
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except Exception as err:  # no network, no such repository, gated: the same advice
        raise ValueError(f"{hint} Downloading failed: {type(err).__name__}: "
                         f"{str(err)[:160]}") from None
