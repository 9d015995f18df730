"""Tiny random-weight pooling checkpoints for tests/engine/test_pooling.py: Hugging Face *Model
embedders, a *ForCausalLM with sentence-transformers pooling files, and
*ForSequenceClassification heads, each with the tiny test tokenizer (the tiny llama's files).
Built with transformers from the tiny checkpoints' configs (2 layers, width 64)."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import zlib

from jaxserve.benchmarks import checkpoints

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# name -> (tiny arch, transformers class name, config overrides, sentence-transformers
# pooling mode or None, extra config.json entries)
KINDS = {
    "qwen3-embed": ("qwen3", "Qwen3Model", {}, None, {"is_matryoshka": True}),
    "llama-embed": ("llama", "LlamaModel", {}, None, {}),
    # tied, as Qwen3-Embedding: its steps are qwen3-embed's (one set of compiled buckets)
    "qwen3-st-mean": ("qwen3", "Qwen3ForCausalLM", {"tie_word_embeddings": True},
                      "pooling_mode_mean_tokens", {}),
    "llama-cls3": ("llama", "LlamaForSequenceClassification", {"num_labels": 3}, None, {}),
    "qwen2-cls3": ("qwen2", "Qwen2ForSequenceClassification", {"num_labels": 3}, None, {}),
    "llama-cls1": ("llama", "LlamaForSequenceClassification", {"num_labels": 1}, None, {}),
}


def make_pooling_checkpoint(kind: str, out: pathlib.Path, tokenizer_dir: pathlib.Path,
                            seed: int = 0) -> pathlib.Path:
    import transformers

    arch, cls_name, overrides, st_mode, extra = KINDS[kind]
    out.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    config = checkpoints.make_config(arch, overrides)
    with checkpoints.torch_threads(1):
        model = getattr(transformers, cls_name)(config).eval()
        _randomize(model, zlib.crc32(f"{kind}:{seed}".encode()))
    model.save_pretrained(str(out), safe_serialization=True)
    if extra:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    if st_mode is not None:
        write_sentence_transformers(out, st_mode, normalize=True)
    return out


def write_sentence_transformers(out: pathlib.Path, mode: str, normalize: bool,
                                extra_modules: tuple = ()) -> None:
    """modules.json (Transformer, Pooling, and Normalize when asked) and 1_Pooling/config.json
    with `mode` on, as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    modules += list(extra_modules)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    modes = {m: m == mode for m in ("pooling_mode_cls_token", "pooling_mode_mean_tokens",
                                     "pooling_mode_max_tokens",
                                     "pooling_mode_mean_sqrt_len_tokens",
                                     "pooling_mode_weightedmean_tokens",
                                     "pooling_mode_lasttoken")}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **modes, "include_prompt": True}, indent=2))


def _randomize(model, seed: int) -> None:
    """Every parameter drawn at random (norms and biases too), scaled as the tiny
    checkpoints' (checkpoints.PROJ_GAIN / sqrt(fan_in))."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    seen = set()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.data_ptr() in seen:  # a tied lm_head: drawn once, as the embedding
                continue
            seen.add(t.data_ptr())
            if name.endswith("norm.weight"):
                lo, hi = checkpoints.NORM_RANGE
                t.copy_(torch.rand(t.shape, generator=gen) * (hi - lo) + lo)
            elif name.endswith(".bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * checkpoints.BIAS_STD)
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=gen) * checkpoints.EMBED_STD)
            else:
                gain = checkpoints.PROJ_GAIN.get(name.split(".")[-2], 2.0)
                t.copy_(torch.randn(t.shape, generator=gen) * gain / math.sqrt(t.shape[-1]))
