"""Write the "small" benchmark checkpoint: a random-weight Llama of ~125M parameters.

    python scripts/make_small_checkpoint.py --out DIR

hidden 768, 12 layers, 12 heads, 4 kv heads, intermediate 2048, vocab 32000, float32,
transformers' own initialisation (std 0.02), untied lm_head, max_position_embeddings 2048.
The tokenizer is a byte-level BPE of 32,000 tokens trained offline on the Python standard
library (the same recipe as the tiny test checkpoints). The weights are random: the model
exists to measure speed, not quality. Written once and reused (`ensure_small_checkpoint`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import sysconfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import make_tiny_checkpoint as tiny  # noqa: E402

SMALL_CONFIG = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=tiny.BOS_ID,
    eos_token_id=tiny.EOS_ID,
    pad_token_id=tiny.PAD_ID,
)
DEFAULT_DIR = pathlib.Path.home() / ".cache" / "jaxserve-bench" / "small-llama-125m"


def _stdlib_files() -> list[pathlib.Path]:
    """All standard-library sources (~30 MB): enough text for 32,000 BPE merges."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)


def make_small_checkpoint(out_dir) -> pathlib.Path:
    import torch
    import transformers

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL_CONFIG, dtype="float32")
    model = transformers.LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tiny.BOS_ID, eos_token_id=tiny.EOS_ID, pad_token_id=tiny.PAD_ID)
    model.save_pretrained(str(out), safe_serialization=True)
    tiny.train_tokenizer(out, _stdlib_files(), vocab_size=SMALL_CONFIG["vocab_size"])
    print(f"wrote {out}: {params / 1e6:.1f}M parameters", file=sys.stderr)
    return out


def ensure_small_checkpoint(out_dir=DEFAULT_DIR) -> pathlib.Path:
    """The checkpoint in out_dir, made first if it is not there yet."""
    out = pathlib.Path(out_dir)
    if not (out / "model.safetensors").is_file() or not (out / "tokenizer.json").is_file():
        make_small_checkpoint(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_DIR)
    args = parser.parse_args()
    make_small_checkpoint(args.out)


if __name__ == "__main__":
    main()
