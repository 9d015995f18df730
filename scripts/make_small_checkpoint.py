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

from jaxserve.benchmarks.checkpoints import SMALL_DIR, make_small_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=SMALL_DIR)
    args = parser.parse_args()
    make_small_checkpoint(args.out)


if __name__ == "__main__":
    main()
