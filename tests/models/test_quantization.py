"""int8 weights (`quantization="int8"`): per-output-channel quantization, the models' int8
products, loading (checkpoint and dummy), meshes, `jaxserve plan`, and what is refused.

How much int8 changes a real model's outputs (perplexity of the built-in model, greedy
agreement on the small benchmark model) is measured by scripts/eval_quantization.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from support.mesh import mesh_runs

from jaxserve import LLM, SamplingParams
from jaxserve.models.quantization import CONTRACTED, quantize_int8

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, precompile=False)


SHAPES = {"wq": (24, 6, 8), "wk": (24, 2, 8), "wv": (24, 2, 8), "wo": (6, 8, 24),
          "w_gate": (24, 16), "w_up": (24, 16), "w_down": (16, 24),
          "experts_gate": (4, 24, 16), "experts_up": (4, 24, 16), "experts_down": (4, 16, 24),
          # DeepSeek's latent attention: [D, Q], [Q, N, P + R], [D, C + R], [C, N, P | V]
          "wq_a": (24, 12), "wq_b": (12, 6, 8), "wkv_a": (24, 20), "wk_b": (16, 6, 4),
          "wv_b": (16, 6, 8)}


@pytest.mark.parametrize("name", sorted(CONTRACTED))
def test_per_channel_round_trip_error_is_at_most_half_a_step(name):
    rng = np.random.default_rng(0)
    shape = SHAPES[name]
    w = rng.normal(size=shape).astype(np.float32) * rng.uniform(0.01, 3, size=shape[-1])
    w[..., 0] = 0.0  # an all-zero output channel
    q, scale = quantize_int8(w, name)
    assert q.dtype == np.int8 and q.shape == w.shape and np.abs(q).max() <= 127
    assert scale.shape == tuple(1 if i in CONTRACTED[name] else n
                                for i, n in enumerate(shape))
    assert (np.abs(q * scale - w) <= scale / 2 + 1e-6).all()
    assert (q[..., 0] == 0).all()
    # Each output channel uses the full range: its largest weight maps to +-127.
    assert (np.abs(q).max(axis=CONTRACTED[name])[..., 1:] == 127).all()


def greedy(llm, prompts, tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def prompt_logprobs(llm, prompts):
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    return [np.array([entry[token].logprob for entry, token in zip(o.prompt_logprobs[1:],
                                                                     p[1:])])
            for o, p in zip(llm.generate(prompts, params, use_tqdm=False), prompts)]


def dequantize_into(base, int8) -> None:
    """Give the unquantized engine `base` the int8 engine's weights, dequantized (q * s)."""
    from flax import nnx

    quantized = {tuple(path): var.get_value()
                 for path, var in nnx.to_flat_state(int8.engine.runner.params)}
    flat = []
    for path, var in nnx.to_flat_state(base.engine.runner.params):
        path, value = tuple(path), var.get_value()
        scale = quantized.get((*path[:-1], f"{path[-1]}_scale"))
        if scale is not None:
            value = (quantized[path].astype(np.float32) * scale).astype(value.dtype)
        flat.append((path, var.replace(value)))
    base.engine.runner.params = nnx.from_flat_state(flat)


# mixtral (its experts dequantized inside the step) with -m slow: the suite's time budget.
@pytest.mark.parametrize("arch", ["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_int8_model_computes_with_its_dequantized_weights(arch, tiny_checkpoints,
                                                          checkpoint_script):
    """float32: the int8 engine's outputs are those of the same model with each kernel
    replaced by q * s (scaling the product equals scaling the kernel), so the int8 products,
    axes and scales are right; and they stay near the checkpoint's own."""
    folder = str(tiny_checkpoints[arch])
    prompts = checkpoint_script.check_prompts()
    base = LLM(folder, dtype="float32", **ENGINE)
    int8 = LLM(folder, dtype="float32", quantization="int8", **ENGINE)
    original = prompt_logprobs(base, prompts)
    got = prompt_logprobs(int8, prompts)
    # The tiny models' random weights give sharp logits; per-channel int8 moves them by
    # about a tenth of a nat per token on average (a wrong axis or scale: whole nats).
    gap = np.concatenate([np.abs(a - b) for a, b in zip(original, got)]).mean()
    assert 0 < gap < 0.5, gap
    dequantize_into(base, int8)
    for a, b in zip(prompt_logprobs(base, prompts), got):
        np.testing.assert_allclose(a, b, atol=2e-4)
    # The weights a device holds: int8 kernels, float32 scales.
    kinds = {str(path[-1]): var.get_value().dtype
             for path, var in nnx_flat(int8.engine.runner.params)}
    kernel = "wq" if arch == "llama" else "experts_gate"
    assert kinds[kernel] == np.int8 and kinds[kernel + "_scale"] == np.float32
    assert kinds["embed"] == np.float32


def nnx_flat(state):
    from flax import nnx

    return nnx.to_flat_state(state)


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_int8_in_bfloat16_stays_close_to_the_checkpoint(arch, tiny_checkpoints,
                                                       checkpoint_script):
    """Real checkpoints are bfloat16: int8 kernels with bfloat16 activations score the
    prompts close to the bfloat16 model and mostly pick the same greedy tokens."""
    folder = str(tiny_checkpoints[arch])
    prompts = checkpoint_script.check_prompts()
    base = LLM(folder, dtype="bfloat16", **ENGINE)
    int8 = LLM(folder, dtype="bfloat16", quantization="int8", **ENGINE)
    gap = np.concatenate([np.abs(a - b) for a, b in zip(prompt_logprobs(base, prompts),
                                                        prompt_logprobs(int8, prompts))])
    assert gap.mean() < 0.5, gap.mean()
    want, got = np.array(greedy(base, prompts)), np.array(greedy(int8, prompts))
    assert (want[:, :4] == got[:, :4]).mean() >= 0.75


@pytest.mark.slow  # three meshes in a subprocess (the suite's time budget)
def test_int8_tokens_do_not_depend_on_the_mesh(mesh_checkpoints):
    """Scales are per output channel, computed before the kernels are split: 1x1, 1x4 (kv
    heads replicated) and 2x2 hold the same int8 model and give the same tokens."""
    runs = mesh_runs(mesh_checkpoints["llama"], ["1x1:int8", "1x4:int8", "2x2:int8"])
    tokens = {mesh: run["tokens"] for mesh, run in runs.items()}
    assert tokens["1x4:int8"] == tokens["1x1:int8"] == tokens["2x2:int8"]


@pytest.mark.slow
def test_int8_experts_sharded_or_whole_give_the_same_tokens(tiny_checkpoints):
    runs = mesh_runs(tiny_checkpoints["mixtral"], ["1x1:int8", "1x4:int8", "1x4:ep,int8"])
    tokens = [run["tokens"] for run in runs.values()]
    assert tokens[0] == tokens[1] == tokens[2]


@pytest.mark.slow  # another engine's compiles, ~23 s cold (the suite's time budget)
def test_dummy_weights_load_as_int8(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), load_format="dummy", quantization="int8",
              dtype="bfloat16", **ENGINE)
    out = greedy(llm, [[5, 6, 7]], tokens=4)
    assert len(out[0]) == 4


def test_plan_shows_the_smaller_weights_and_the_larger_kv_budget(tiny_checkpoints):
    def plan(*extra):
        out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "plan",
                              str(tiny_checkpoints["llama"]), "--dtype", "bfloat16",
                              "--device-memory", "8MiB", "--json", *extra],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    base, int8 = plan(), plan("--quantization", "int8")
    by_group = lambda p: {g["name"]: g["bytes_per_device"] for g in p["weights"]}
    b, q = by_group(base), by_group(int8)
    # int8 kernels are half of bf16's bytes; their scales add 4 bytes per output channel.
    assert q["attention"] < 0.6 * b["attention"] and q["mlp"] < 0.6 * b["mlp"]
    assert q["embeddings"] == b["embeddings"] and q["norms"] == b["norms"]
    assert int8["num_blocks"] > base["num_blocks"]


def test_start_up_logs_the_int8_weight_bytes(tiny_checkpoints, caplog):
    caplog.set_level("INFO", logger="jaxserve.backends.jax.runner")
    LLM(str(tiny_checkpoints["llama"]), quantization="int8", dtype="bfloat16", **ENGINE)
    assert "int8 linear layers" in caplog.text


def test_refused_values_name_the_argument(tiny_checkpoints, tmp_path):
    folder = str(tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match="quantization must be one of int8"):
        LLM(folder, quantization="fp4", **ENGINE)
    with pytest.raises(ValueError, match="quantization='fp8' names a checkpoint format, but"):
        LLM(folder, quantization="fp8", **ENGINE)
    with pytest.raises(ValueError, match="quantization: int8 weights run on the JAX backend"):
        LLM(folder, quantization="int8", backend="torch", **ENGINE)
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "generate", folder,
                          "--quantization", "int4", "hi"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--quantization" in out.stderr


def test_eval_scripts_next_token_agreement_counts_the_models_own_choices(tiny_checkpoints):
    """eval_quantization.py's teacher-forced measure: a model agrees with its own greedy
    output everywhere; a reference whose last token is not the model's choice loses exactly
    that position."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "eval_quantization.py"
    spec = importlib.util.spec_from_file_location("eval_quantization", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", **ENGINE)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    reference = module.greedy(llm, prompts, 8)
    assert reference.shape == (2, 8)
    assert module.next_token_agreement(llm, prompts, reference) == 1.0
    wrong = reference.copy()
    wrong[:, -1] = (wrong[:, -1] + 1) % llm.engine.config.model.vocab_size
    assert module.next_token_agreement(llm, prompts, wrong) == 14 / 16
