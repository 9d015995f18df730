"""The `jaxserve` console script, run as a user would."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(sys.executable).parent / "jaxserve"
SMALL = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128"]


def run(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_subcommand():
    out = run("--help")
    assert out.returncode == 0
    assert "generate" in out.stdout and "serve" in out.stdout
    sub = run("generate", "--help")
    for flag in ("--max-model-len", "--dtype", "--num-kv-blocks", "--temperature", "--top-p",
                 "--max-tokens", "--seed"):
        assert flag in sub.stdout


# A JAX-only install: torch is absent (sys.modules[name] = None makes importlib's find_spec
# answer None, as for a package that is not installed).
WITHOUT_TORCH = ("import sys; sys.modules['torch'] = None; from jaxserve.cli import main; "
                 "sys.exit(main(sys.argv[1:]))")


def test_the_jax_only_first_screen_has_no_torch_advice():
    """The README's first command on an install without torch: transformers' "PyTorch was not
    found" advice is not printed (jaxserve needs no torch), jaxserve's own start-up lines are."""
    out = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "generate", "def f(n):",
                          "--max-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "PyTorch was not found" not in out.stderr
    assert "No model given: using the built-in default model" in out.stderr
    assert "KV cache" in out.stderr
    # transformers itself still gives the advice without jaxserve's filter (so this can fail)
    bare = subprocess.run([sys.executable, "-c",
                           "import sys; sys.modules['torch'] = None; import transformers"],
                          capture_output=True, text=True, timeout=120)
    assert "PyTorch was not found" in bare.stderr


def test_generate_prints_completions(tiny_checkpoints):
    # `jaxserve generate MODEL PROMPT...`, as `vllm serve MODEL`: the model comes first
    out = run("generate", str(tiny_checkpoints["llama"]), *SMALL, "--max-tokens", "5",
              "--ignore-eos", "--json", "def fibonacci(n):", "import os")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["def fibonacci(n):", "import os"]
    assert all(len(line["outputs"][0]["token_ids"]) == 5 for line in lines)
    assert "KV cache" in out.stderr  # start-up log says what it sized


@pytest.mark.parametrize("flags, field", [
    (["--temperature", "-1"], "temperature"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-model-len", "100000"], "max_model_len"),
])
def test_bad_flags_fail_with_a_message(tiny_checkpoints, flags, field):
    args = ["generate", "--model", str(tiny_checkpoints["llama"]), *SMALL, *flags, "hi"]
    if flags[0] == "--max-model-len":
        args = ["generate", "--model", str(tiny_checkpoints["llama"]), *flags, "hi"]
    out = run(*args)
    assert out.returncode == 2
    assert field in out.stderr and "Traceback" not in out.stderr


def test_model_folder_without_safetensors_is_refused(tmp_path, tiny_checkpoints):
    folder = tmp_path / "pickled"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_checkpoints["llama"] / name).read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    out = run("generate", "--model", str(folder), *SMALL, "hi")
    assert out.returncode == 2
    assert "pytorch_model.bin" in out.stderr and "safetensors" in out.stderr


def test_unknown_architecture_is_refused(tmp_path, tiny_checkpoints):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    config = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    out = run("generate", "--model", str(folder), *SMALL, "hi")
    assert out.returncode == 2
    assert "GPT2LMHeadModel" in out.stderr and "LlamaForCausalLM" in out.stderr


def test_generate_reads_a_first_argument_as_the_model_only_when_it_names_one(tmp_path):
    from jaxserve.cli.generate import names_a_model

    (tmp_path / "config.json").write_text("{}")
    assert names_a_model(str(tmp_path)) and names_a_model("Qwen/Qwen2.5-0.5B-Instruct")
    assert not names_a_model("def f(x):") and not names_a_model("a / b")
    assert not names_a_model(str(tmp_path / "missing"))


def test_server_flags_take_vllms_forms(monkeypatch):
    from jaxserve.cli.serve import _api_keys, _origins

    assert _origins('["*"]') == ("*",)
    assert _origins("http://a.example, http://b.example") == ("http://a.example",
                                                              "http://b.example")
    with pytest.raises(ValueError, match="allowed-origins"):
        _origins('["*"')
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _api_keys(None) == ("from-vllm",)
    monkeypatch.setenv("JAXSERVE_API_KEY", "ours")
    assert _api_keys(None) == ("ours",)
    assert _api_keys(["k1", "k2"]) == ("k1", "k2")  # the flags win


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path):
    from jaxserve.cli.serve import _chat_template, _json_object

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert _chat_template(str(path)) == "{{ messages[0].content }}"
    assert _chat_template("{{ 1 }}") == "{{ 1 }}"
    with pytest.raises(ValueError, match="chat-template"):
        _chat_template(str(tmp_path / "missing.jinja"))
    assert _json_object('{"enable_thinking": false}') == {"enable_thinking": False}
