"""The torch backend as its users see it: choosing it, what it refuses, and what it shares
with the JAX backend (seeded sampling, logprobs and prompt logprobs, bf16, dummy weights,
validation errors, the CLI). Greedy parity with HF transformers is in test_parity.py, the
sampler's conformance in test_sampler.py, the API over HTTP in test_server_api.py."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support.server_helpers import JAXSERVE

from jaxserve import LLM, SamplingParams

SMALL = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, precompile=False)


@pytest.fixture(scope="module")
def llms(tiny_checkpoints):
    folder = str(tiny_checkpoints["llama"])
    return {backend: LLM(folder, dtype="float32", backend=backend, **SMALL)
            for backend in ("jax", "torch")}


@pytest.mark.parametrize("engine_args,message", [
    (dict(mesh="1x2"), "runs on one device"),
    (dict(tensor_parallel_size=2), "runs on one device"),
    (dict(attention_backend="pallas"), "belongs to the jax backend"),
    (dict(attention_backend="interpret-gpu"), "belongs to the jax backend"),
    (dict(attention_backend="triton"), "needs a GPU"),
])
def test_the_torch_backend_refuses_what_it_cannot_run(tiny_checkpoint, engine_args, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_checkpoint), backend="torch", **SMALL, **engine_args)


def test_the_jax_backend_refuses_the_triton_kernels_and_unknown_backends(tiny_checkpoint):
    with pytest.raises(ValueError, match="belongs to the torch backend"):
        LLM(str(tiny_checkpoint), attention_backend="triton-interpret", **SMALL)
    with pytest.raises(ValueError, match="backend must be one of auto, jax, torch"):
        LLM(str(tiny_checkpoint), backend="tensorflow", **SMALL)


def test_without_torch_the_backend_names_the_extra_to_install(tiny_checkpoint):
    code = textwrap.dedent(f"""
        import importlib.abc, sys

        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "triton"):
                    raise ImportError(f"No module named {{name!r}}")

        sys.meta_path.insert(0, Blocker())
        from jaxserve import LLM
        try:
            LLM({str(tiny_checkpoint)!r}, backend="torch", max_model_len=128)
        except ImportError as err:
            print("ERROR:", err)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "ERROR: The torch backend needs PyTorch and Triton: pip install torch triton" \
        in proc.stdout, proc.stdout + proc.stderr


def test_a_seeded_request_is_reproducible_alone_and_in_any_batch(llms):
    llm = llms["torch"]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    alone = llm.generate(["def f(x):"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["import os\n", "def f(x):", "class A:"], [others, params, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["def f(x):"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    unseeded = llm.generate(["def f(x):"] * 2, params.clone(seed=None), use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_logprobs_and_prompt_logprobs_equal_the_jax_backends(llms):
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    prompt = "def fibonacci(n):\n    if n < 2:"
    outs = {b: llm.generate([prompt], params, use_tqdm=False)[0] for b, llm in llms.items()}
    jax_out, torch_out = outs["jax"], outs["torch"]
    assert torch_out.outputs[0].token_ids == jax_out.outputs[0].token_ids
    for want, got in zip(jax_out.outputs[0].logprobs, torch_out.outputs[0].logprobs):
        assert list(got) == list(want)  # same top tokens, same order
        np.testing.assert_allclose([g.logprob for g in got.values()],
                                   [w.logprob for w in want.values()], atol=1e-4)
    assert torch_out.prompt_logprobs[0] is None
    for want, got in zip(jax_out.prompt_logprobs[1:], torch_out.prompt_logprobs[1:]):
        assert set(got) == set(want)
        np.testing.assert_allclose([got[t].logprob for t in want],
                                   [want[t].logprob for t in want], atol=1e-4)


def test_sampling_fields_behave_the_same_on_both_backends(llms):
    """Penalties, stop strings, min_tokens, bad words, logit bias: greedy, so equal tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4,
                            bad_words=["def"], logit_bias={5: 2.0})
    prompts = ["def f(x):", "import os\nimport sys\n"]
    outs = {b: [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            for b, llm in llms.items()}
    assert [o.token_ids for o in outs["torch"]] == [o.token_ids for o in outs["jax"]]
    stop = params.clone(stop=[outs["jax"][0].text[3:6]], min_tokens=0)
    cut = {b: llm.generate(prompts[:1], stop, use_tqdm=False)[0].outputs[0]
           for b, llm in llms.items()}
    assert cut["torch"].text == cut["jax"].text and cut["torch"].finish_reason == "stop"


@pytest.mark.parametrize("prompt,params,error", [
    ("def f(x):", SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    ("def f(x):", SamplingParams(allowed_token_ids=[10**6]), "allowed_token_ids"),
    ("x " * 400, SamplingParams(max_tokens=4), "max_model_len"),
])
def test_bad_requests_get_the_same_error_on_both_backends(llms, prompt, params, error):
    messages = {}
    for backend, llm in llms.items():
        with pytest.raises(ValueError, match=error) as err:
            llm.generate([prompt], params, use_tqdm=False)
        messages[backend] = str(err.value)
    assert messages["torch"] == messages["jax"]


def test_bfloat16_on_the_torch_backend(tiny_checkpoint):
    """A bf16 model and KV cache: its prompt logprobs follow HF transformers' bf16 forward
    pass, and the bias row and a grammar's bitmask work on its float32 logits."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_checkpoint), dtype="bfloat16", backend="torch", **SMALL)
    runner = llm.engine.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    ids = llm.get_tokenizer().encode("def add(a, b):\n    return a + b\n\nprint(add(1, 2))")
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    got = [next(iter(entry.values())).logprob for entry in out[0].prompt_logprobs[1:]]
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    # bf16 keeps 8 bits of mantissa: within 2% (plus a little) of logprobs of up to -20
    np.testing.assert_allclose(got, want, rtol=0.02, atol=0.05)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    forced = llm.generate(["def f(x):"], params.clone(logit_bias={42: 100.0}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [42] * 12
    regex = SamplingParams(max_tokens=20, temperature=1.0, seed=4,
                           structured_outputs={"regex": "[a-d]{3}-[0-9]{2}"})
    out = llm.generate(["def f(x):"], regex, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[a-d]{3}-[0-9]{2}", out.text)


def test_dummy_weights_are_random_and_seeded(tiny_checkpoint):
    made = [LLM(str(tiny_checkpoint), backend="torch", load_format="dummy", seed=seed,
                **SMALL).engine.runner.model for seed in (0, 0, 1)]
    first = [p.clone() for p in made[0].parameters()]
    assert all(float(p.abs().max()) <= 1e-3 and float(p.abs().max()) > 0 for p in first)
    assert all(bool((a == b).all()) for a, b in zip(first, made[1].parameters()))
    assert not all(bool((a == b).all()) for a, b in zip(first, made[2].parameters()))


def test_generate_on_the_command_line(tiny_checkpoint):
    proc = subprocess.run([str(JAXSERVE), "generate", str(tiny_checkpoint), "def f(x):",
                           "--backend", "torch", "--max-tokens", "8", "--max-model-len", "128"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Torch backend on cpu" in proc.stderr
    want = LLM(str(tiny_checkpoint), backend="torch", **SMALL).generate(
        ["def f(x):"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert want[0].outputs[0].text.strip() in proc.stdout


def test_multi_host_serving_refuses_the_torch_backend(tiny_checkpoint):
    proc = subprocess.run([str(JAXSERVE), "serve", str(tiny_checkpoint), "--backend", "torch",
                           "--coordinator", "127.0.0.1:1", "--num-hosts", "2", "--host-id", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "the torch backend runs on one device" in proc.stderr, proc.stderr[-2000:]
