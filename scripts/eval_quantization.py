"""How much int8 weights (`quantization="int8"`) change a model's outputs, in one process.

    python scripts/eval_quantization.py [--json OUT]

Each against the same model without quantization, in float32 and in bfloat16:
  perplexity  the built-in model on held-out Python (the standard library packages it never
              trained on: email, json, xmlrpc, wsgiref), --windows windows of 128 tokens,
              scored with prompt_logprobs;
  agreement   greedy tokens of --prompts prompts x --tokens tokens: the fraction of positions
              where the int8 output equals the unquantized one (a position after the first
              difference counts only if the tokens happen to be equal again), and the mean
              length of the common prefix; for the built-in model (prompts: the first 64
              tokens of held-out windows) and for the small benchmark Llama (random weights,
              random prompts). For scale, the same agreement between the small model in
              float32 and in bfloat16, both unquantized: how much a dtype change alone moves
              its greedy tokens (its random weights give near-ties everywhere).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import sysconfig

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_small_checkpoint import ensure_small_checkpoint  # noqa: E402

HELD_OUT = ("email", "json", "xmlrpc", "wsgiref")  # train_default_model.py's


def held_out_windows(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for name in HELD_OUT for p in (stdlib / name).rglob("*.py")
                   if "test" not in p.parts)
    stream: list[int] = []
    for path in files:
        stream += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
    rng = np.random.default_rng(seed)
    starts = rng.choice(len(stream) - length, size=count, replace=False)
    return [stream[s:s + length] for s in sorted(starts)]


def perplexity(llm, windows) -> float:
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(windows, params, use_tqdm=False)
    nll = [-entry[token].logprob for out, window in zip(outputs, windows)
           for entry, token in zip(out.prompt_logprobs[1:], window[1:])]
    return math.exp(float(np.mean(nll)))


def greedy(llm, prompts, tokens: int) -> np.ndarray:
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return np.array([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)])


def agreement(want: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(fraction of equal positions, mean common-prefix length)."""
    prefix = [int(np.argmin(np.append(w == g, False))) for w, g in zip(want, got)]
    return float((want == got).mean()), float(np.mean(prefix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args()
    from jaxserve import LLM

    report: dict = {}
    small_tokens: dict[str, np.ndarray] = {}
    small = str(ensure_small_checkpoint())
    for dtype in args.dtypes:
        common = dict(dtype=dtype, precompile=False, max_model_len=512)
        base = LLM(**common)  # the built-in model
        windows = held_out_windows(base.get_tokenizer(), args.windows, 128, args.seed)
        ppl = perplexity(base, windows)
        del base
        ppl_int8 = perplexity(LLM(quantization="int8", **common), windows)
        rise = ppl_int8 / ppl - 1
        print(f"{dtype}: built-in model held-out perplexity {ppl:.3f}, int8 {ppl_int8:.3f} "
              f"({100 * rise:+.2f}%) over {args.windows} windows of 128 tokens", flush=True)

        code = [w[:64] for w in windows[: args.prompts]]
        agree, prefix = agreement(greedy(LLM(**common), code, args.tokens),
                                  greedy(LLM(quantization="int8", **common), code, args.tokens))
        print(f"{dtype}: built-in model greedy agreement {100 * agree:.1f}% of "
              f"{len(code) * args.tokens} positions; common prefix {prefix:.1f} of "
              f"{args.tokens} tokens on average", flush=True)
        report.setdefault(dtype, {}).update(builtin_agreement=agree,
                                            builtin_common_prefix=prefix)

        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(5, 32000, int(n)).tolist()
                   for n in rng.integers(16, 128, args.prompts)]
        want = small_tokens[dtype] = greedy(LLM(small, **common), prompts, args.tokens)
        got = greedy(LLM(small, quantization="int8", **common), prompts, args.tokens)
        agree, prefix = agreement(want, got)
        print(f"{dtype}: small model greedy agreement {100 * agree:.1f}% of "
              f"{want.size} positions; common prefix {prefix:.1f} of "
              f"{args.tokens} tokens on average", flush=True)
        report[dtype].update(perplexity=ppl, perplexity_int8=ppl_int8, rise=rise,
                             agreement=agree, mean_common_prefix=prefix)
    if len(small_tokens) == 2:
        agree, prefix = agreement(*small_tokens.values())
        print(f"for scale: small model float32 vs bfloat16, both unquantized: agreement "
              f"{100 * agree:.1f}%; common prefix {prefix:.1f} tokens", flush=True)
        report["small_float32_vs_bfloat16"] = {"agreement": agree, "mean_common_prefix": prefix}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
