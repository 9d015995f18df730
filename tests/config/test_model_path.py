"""Which model folder loads: a local folder, a Hugging Face Hub id from the Hub cache (a
cache layout built on disk here, no network), or the built-in model; `jaxserve serve MODEL`
and `jaxserve plan MODEL` take it positionally, as `vllm serve MODEL` does."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

SCRIPT = pathlib.Path(sys.executable).parent / "jaxserve"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: pathlib.Path, repo_id: str, folder: pathlib.Path) -> pathlib.Path:
    """The Hub cache layout huggingface_hub reads: models--org--name/refs/main naming a
    snapshot folder that holds the files."""
    from huggingface_hub.file_download import repo_folder_name

    repo = root / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def run(*args, cache: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_a_hub_id_loads_from_the_cache_and_a_missing_one_says_what_to_run(tiny_checkpoint,
                                                                          tmp_path):
    cache = tmp_path / "hub"
    hub_cache(cache, "tiny-org/tiny-llama", tiny_checkpoint)
    plan = ["--device-memory", "1GiB", "--max-model-len", "128"]
    out = run("plan", "tiny-org/tiny-llama", *plan, cache=cache)  # positional, as vLLM
    assert out.returncode == 0, out.stderr
    assert "LlamaForCausalLM" in out.stdout and "from the Hugging Face cache" in out.stderr
    same = run("plan", "--model", "tiny-org/tiny-llama", *plan, cache=cache)
    assert same.returncode == 0 and same.stdout == out.stdout

    missing = run("plan", "tiny-org/absent", *plan, cache=cache)
    assert missing.returncode == 2
    assert "hf download tiny-org/absent" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_positional_model_and_a_different_flag_are_refused(tiny_checkpoint, tmp_path):
    out = run("plan", str(tiny_checkpoint), "--model", str(tmp_path), "--device-memory", "1GiB",
              cache=tmp_path)
    assert out.returncode == 2 and "given twice" in out.stderr


def test_a_local_folder_wins_over_a_hub_id_of_the_same_name(tiny_checkpoint, tmp_path,
                                                            monkeypatch):
    import logging

    from jaxserve.config.model_path import resolve_model

    local = tmp_path / "org" / "name"
    shutil.copytree(tiny_checkpoint, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/name", logging.getLogger("t")) == "org/name"
    assert resolve_model(str(local), logging.getLogger("t")) == str(local)


def test_serve_takes_the_model_positionally():
    from jaxserve.cli import build_parser

    args = build_parser().parse_args(["serve", "Qwen/Qwen2.5-0.5B-Instruct", "--port", "9"])
    assert args.model_tag == "Qwen/Qwen2.5-0.5B-Instruct" and args.model is None


def test_revision_and_download_dir_pick_the_snapshot(tiny_checkpoints, tmp_path, monkeypatch):
    """--download-dir is the cache read (not $HF_HUB_CACHE), --revision picks the ref's
    snapshot, a revision on a local folder is refused, and a missing revision says what to
    download (offline: the network is not tried)."""
    import logging

    import pytest
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    from jaxserve.config.engine_args import EngineArgs

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    cache = tmp_path / "my-cache"
    main_snapshot = hub_cache(cache, "tiny-org/tiny", tiny_checkpoints["llama"])
    repo = cache / repo_folder_name(repo_id="tiny-org/tiny", repo_type="model")
    shutil.copytree(tiny_checkpoints["llama"], repo / "snapshots" / ("f" * 40))
    (repo / "refs" / "v2").write_text("f" * 40)
    log = logging.getLogger("t")

    def folder(**kwargs) -> str:
        return EngineArgs(model="tiny-org/tiny", download_dir=str(cache),
                          **kwargs).model_folder(log)

    assert folder() == str(main_snapshot)
    assert folder(revision="v2") == str(repo / "snapshots" / ("f" * 40))
    with pytest.raises(ValueError, match="--revision v3 --cache-dir"):
        folder(revision="v3")
    with pytest.raises(ValueError, match="local folder"):
        EngineArgs(model=str(tiny_checkpoints["llama"]), revision="v2").model_folder(log)


def test_the_token_and_revision_are_handed_to_huggingface_hub(monkeypatch, tmp_path):
    import logging

    import huggingface_hub

    from jaxserve.config.engine_args import EngineArgs

    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    args = EngineArgs(model="org/name", revision="abc", download_dir=str(tmp_path / "c"),
                      hf_token="hf_secret")
    assert args.model_folder(logging.getLogger("t")) == str(tmp_path)
    repo_id, kwargs = calls[0]
    assert repo_id == "org/name" and kwargs["revision"] == "abc"
    assert kwargs["cache_dir"] == str(tmp_path / "c") and kwargs["token"] == "hf_secret"
