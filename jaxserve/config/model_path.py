"""The model folder to load: the one given, or the built-in default model shipped inside the
package (no download)."""

from __future__ import annotations

import pathlib


def default_model_path() -> pathlib.Path:
    """The built-in model shipped inside the package (a small Llama trained on the Python
    standard library by scripts/train_default_model.py; see its README.md)."""
    return pathlib.Path(__file__).resolve().parents[1] / "default_model"  # jaxserve/default_model


def resolve_model(model: str | None, logger, *, revision: str | None = None,
                  cache_dir: str | None = None, token: str | bool | None = None) -> str:
    """The model folder to load: a local folder as given; a Hugging Face Hub id (such as
    Qwen/Qwen2.5-0.5B-Instruct) from the Hub cache, downloaded into it first when it is not
    there and the network may be used (not with HF_HUB_OFFLINE=1); or, with no model, the
    built-in default (and say so). revision, cache_dir and token are the Hub's (a branch,
    tag or commit; the cache folder instead of $HF_HUB_CACHE; a token, or True for the
    stored one); they apply to Hub ids only, and a revision given with a local folder is
    refused (a folder has no revisions)."""
    hub = dict(revision=revision, cache_dir=cache_dir, token=token)
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
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face Hub ids, but "
                             f"{model} is a local folder; drop the revision or give the "
                             "Hub id.")
        return str(local)
    if not _looks_like_hub_id(model):
        return model  # config.read_hf_config says what is wrong with it
    return _from_hub(model, logger, hub)


_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.tiktoken", "*.txt"]


def _looks_like_hub_id(model: str) -> bool:
    """org/name or name: no path beyond one slash, no leading dot or slash."""
    parts = model.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not model.startswith((".", "~")) and \
        not any(p in (".", "..") for p in parts)


def _from_hub(repo_id: str, logger, hub: dict) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    at = f" at revision {hub['revision']}" if hub["revision"] else ""
    cache = hub["cache_dir"] or constants.HF_HUB_CACHE
    try:
        path = snapshot_download(repo_id, local_files_only=True, allow_patterns=_HUB_FILES,
                                 **hub)
        logger.info("Model %s%s: from the Hugging Face cache at %s", repo_id, at, path)
        return path
    except LocalEntryNotFoundError:
        pass
    except Exception as err:  # a malformed id or cache entry: say so, with what to run
        raise ValueError(f"model {repo_id!r} is neither a local folder nor a usable Hugging "
                         f"Face Hub id ({type(err).__name__}: {str(err)[:160]}).") from None
    command = f"hf download {repo_id}" + (f" --revision {hub['revision']}" if at else "") + (
        f" --cache-dir {cache}" if hub["cache_dir"] else "")
    hint = (f"model {repo_id!r}{at} is not a local folder and not in the Hugging Face cache "
            f"({cache}); download it first with `{command}`, or pass a local model folder.")
    if constants.HF_HUB_OFFLINE:
        raise ValueError(hint + " (HF_HUB_OFFLINE is set: the network is not used.)")
    logger.info("Model %s%s: downloading from the Hugging Face Hub (safetensors, config and "
                "tokenizer files) into %s", repo_id, at, cache)
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES, **hub)
    except Exception as err:  # no network, no such repository, gated: the same advice
        raise ValueError(f"{hint} Downloading failed: {type(err).__name__}: "
                         f"{str(err)[:160]}") from None
