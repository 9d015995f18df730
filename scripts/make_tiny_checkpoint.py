"""Write tiny, deterministic random-weight Hugging Face checkpoints for tests.

Each checkpoint is a real `transformers` model (float32, one model.safetensors)
with a byte-level BPE tokenizer trained offline on Python standard-library
sources, so parity tests need no download. Every parameter is drawn at random,
biases and norm weights included, so a dropped bias or a wrong norm shows up.

    python scripts/make_tiny_checkpoint.py --arch llama --out DIR [--seed 0]
    python scripts/make_tiny_checkpoint.py --arch all --out DIR   # DIR/<arch>
    python scripts/make_tiny_checkpoint.py --arch all --out DIR --check
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from jaxserve.benchmarks.checkpoint_checks import (
    cache_consistency,
    check_prompts,
    greedy_margins,
    load,
)
from jaxserve.benchmarks.checkpoints import ARCHS, BOS_ID, make_checkpoint


def run_check(root: pathlib.Path, archs) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(root / archs[0]))
    text = "héllo wörld — 你好, мир! 🙂 def f(x):\n\treturn x ** 2  # ok"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok(text)["input_ids"][0] == BOS_ID
    text = pathlib.Path(__file__).read_text(encoding="utf-8")[:3000]
    long_prompt = [BOS_ID] + tok(text, add_special_tokens=False)["input_ids"][:219]
    for arch in archs:
        model = load(root / arch)
        res = greedy_margins(model, check_prompts())
        print(f"{arch:8s} min gap {min(r['gap'] for r in res):.4f}  "
              f"min relative gap {min(r['rel_gap'] for r in res):.2e}  "
              f"max|logit| {max(r['max_logit'] for r in res):.1f}  "
              f"distinct tokens/40 {min(len(set(r['tokens'])) for r in res)}.."
              f"{max(len(set(r['tokens'])) for r in res)}")
        print("         per-prompt min gaps: " + " ".join(f"{r['gap']:.3f}" for r in res))
        ok = all(cache_consistency(model, p) for p in (long_prompt[:180], long_prompt))
        print(f"         generate(cache) == full forwards on 180+40 and 220+40 tokens: {ok}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True, choices=(*ARCHS, "all"))
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="also report greedy top1-top2 logit gaps and cache consistency")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # see torch_threads
    t0 = time.perf_counter()
    if args.arch == "all":
        archs = ARCHS
        for arch in archs:
            make_checkpoint(arch, args.out / arch, args.seed)
        root = args.out
    else:
        archs = (args.arch,)
        make_checkpoint(args.arch, args.out, args.seed)
        root = args.out.parent
        if args.out.name != args.arch and args.check:
            sys.exit("--check with one arch needs --out ending in the arch name")
    print(f"wrote {', '.join(archs)} to {args.out} in {time.perf_counter() - t0:.1f} s")
    if args.check:
        run_check(root, archs)


if __name__ == "__main__":
    main()
