"""The built-in default model: shipped, loadable by transformers, served token-exactly, and
actually trained (held-out perplexity far below the vocabulary size)."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, default_model_path

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])
# Files of the packages the training script holds out (never trained on).
HELD_OUT_FILES = ("email/message.py", "json/encoder.py", "xmlrpc/client.py",
                  "wsgiref/handlers.py")
PROMPTS = ["def fibonacci(n):", "import os\n\n\nclass ", "    for i in range(", "# Copyright"]
# The vocabulary has 4096 tokens: an untrained model scores ~4000. The shipped model scores
# ~80 on these file openings (licence headers and docstrings are its hardest text).
MAX_PERPLEXITY = 120.0


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, max_num_seqs=4,
               max_num_batched_tokens=256, precompile=False)


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(default_model_path(),
                                                dtype=torch.float32).eval()


def test_the_default_model_is_a_complete_hf_folder():
    folder = default_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (folder / name).is_file(), name
    assert "held-out perplexity" in (folder / "README.md").read_text()


def test_held_out_perplexity_matches_transformers_and_shows_learning(llm, hf_model):
    import torch

    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer((STDLIB / f).read_text())["input_ids"][:512] for f in HELD_OUT_FILES]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    ours, theirs = [], []
    for ids, out in zip(prompts, outs):
        ours += [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
        theirs += torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]].tolist()
    ppl_ours, ppl_theirs = math.exp(-np.mean(ours)), math.exp(-np.mean(theirs))
    assert ppl_ours == pytest.approx(ppl_theirs, rel=1e-3)
    assert ppl_ours < MAX_PERPLEXITY, ppl_ours


def test_greedy_matches_transformers(llm, hf_model):
    import torch

    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    hf_model.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt


def test_cli_without_model_writes_python():
    script = pathlib.Path(sys.executable).parent / "jaxserve"
    out = subprocess.run([str(script), "generate", "def fibonacci(n):", "--max-tokens", "64",
                          "--max-num-seqs", "4", "--max-num-batched-tokens", "64"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "built-in default model" in out.stderr
    text = out.stdout.split("--- finish_reason")[0]
    keywords = sum(k in text for k in ("return", "if ", "self", " = ", "(", ":\n"))
    assert keywords >= 3, text
