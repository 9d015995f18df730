"""The model's generation_config.json sets the default sampling parameters, as in vLLM
(generation_config="auto"); a request's own values win; "vllm" ignores the file."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.generation_config import sampling_defaults
from jaxserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest

QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "max_new_tokens": 7, "do_sample": True, "eos_token_id": [1, 3]}
SMALL = dict(dtype="float32", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16)


def with_generation_config(folder, tmp_path, values):
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text(json.dumps(values))
    return copy


def test_the_file_sets_the_defaults_and_vllm_ignores_it(tiny_checkpoint, tmp_path):
    folder = with_generation_config(tiny_checkpoint, tmp_path, QWEN_LIKE)
    assert sampling_defaults(str(folder), "auto") == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "max_tokens": 7}
    assert sampling_defaults(str(folder), "vllm") == {}
    assert sampling_defaults(str(tiny_checkpoint), str(folder))["top_k"] == 20  # a folder
    assert sampling_defaults(str(tiny_checkpoint), "auto") == {}  # eos ids only
    with pytest.raises(ValueError, match="generation_config"):
        sampling_defaults(str(tiny_checkpoint), "nowhere")


def test_requests_take_the_defaults_and_their_own_values_win():
    defaults = {"temperature": 0.7, "top_k": 20, "max_tokens": 7}
    plain = CompletionRequest(prompt="x").sampling_params(defaults)
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (0.7, 20, 7)
    own = CompletionRequest(prompt="x", temperature=0.0, max_tokens=3).sampling_params(
        defaults)
    assert (own.temperature, own.top_k, own.max_tokens) == (0.0, 20, 3)
    # as vLLM: the model's max_new_tokens also caps a request's larger max_tokens
    assert CompletionRequest(prompt="x", max_tokens=50).sampling_params(
        defaults).max_tokens == 7
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 max_completion_tokens=4).sampling_params(defaults)
    assert (chat.temperature, chat.max_tokens) == (0.7, 4)
    assert CompletionRequest(prompt="x").sampling_params().temperature == 1.0


def test_offline_generate_uses_the_models_defaults(tiny_checkpoint, tmp_path):
    folder = with_generation_config(tiny_checkpoint, tmp_path,
                                    {"temperature": 0.0, "max_new_tokens": 5})
    llm = LLM(str(folder), **SMALL)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    prompt = "def add(a, b):"
    got = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert got == want and 1 <= len(got) <= 5
    ignored = LLM(str(folder), generation_config="vllm", **SMALL)
    assert ignored.get_default_sampling_params() == SamplingParams()
