"""How much quantization changes a model's outputs, in one process.

    python scripts/eval_quantization.py [--variants int8 kv-fp8 kv-int8] [--json OUT]

Variants: int8 weights (quantization="int8"), and a KV cache of fp8 or int8
(kv_cache_dtype). Each against the same model without quantization, in float32 and in
bfloat16:
  perplexity  the built-in model on held-out Python (the standard library packages it never
              trained on: email, json, xmlrpc, wsgiref), --windows windows of 128 tokens,
              scored with prompt_logprobs;
  agreement   greedy tokens of --prompts prompts x --tokens tokens: the fraction of positions
              where the quantized output equals the unquantized one (a position after the first
              difference counts only if the tokens happen to be equal again), and the mean
              length of the common prefix; for the built-in model (prompts: the first 64
              tokens of held-out windows) and for the small benchmark Llama (random weights,
              random prompts). For scale, the same agreement between each model in float32
              and in bfloat16, both unquantized: how much a dtype change alone moves its
              greedy tokens (the small model's random weights give near-ties everywhere).
  next-token  the same positions with the unquantized greedy output given (teacher forcing):
              the fraction where the quantized model's most likely next token is the one the
              unquantized model chose. Each position is judged on the same context, so one
              near-tie costs one position, not the rest of its sequence.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sysconfig

import numpy as np

from jaxserve.benchmarks.checkpoints import ensure_small_checkpoint

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


def next_token_agreement(llm, prompts, reference: np.ndarray) -> float:
    """Fraction of the reference's positions (greedy outputs of the unquantized model after
    `prompts`) where llm's most likely next token, given the reference before it, is the
    reference's token (its rank among prompt_logprobs is 1)."""
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    sequences = [list(p) + r.tolist() for p, r in zip(prompts, reference)]
    outputs = llm.generate(sequences, params, use_tqdm=False)
    ranks = [entry[token].rank for out, prompt, seq in zip(outputs, prompts, sequences)
             for entry, token in zip(out.prompt_logprobs[len(prompt):], seq[len(prompt):])]
    return float(np.mean(np.asarray(ranks) == 1))


def agreement(want: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(fraction of equal positions, mean common-prefix length)."""
    prefix = [int(np.argmin(np.append(w == g, False))) for w, g in zip(want, got)]
    return float((want == got).mean()), float(np.mean(prefix))


VARIANTS = {  # name -> the engine arguments it adds
    "int8": {"quantization": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "kv-int8": {"kv_cache_dtype": "int8"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
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
    builtin_tokens: dict[str, np.ndarray] = {}
    small = str(ensure_small_checkpoint())
    for dtype in args.dtypes:
        common = dict(dtype=dtype, precompile=False, max_model_len=512)
        base = LLM(**common)  # the built-in model
        windows = held_out_windows(base.get_tokenizer(), args.windows, 128, args.seed)
        code = [w[:64] for w in windows[: args.prompts]]
        ppl, builtin = perplexity(base, windows), greedy(base, code, args.tokens)
        builtin_tokens[dtype] = builtin
        del base
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(5, 32000, int(n)).tolist()
                   for n in rng.integers(16, 128, args.prompts)]
        small_base = small_tokens[dtype] = greedy(LLM(small, **common), prompts, args.tokens)
        print(f"{dtype}: built-in model held-out perplexity {ppl:.3f} over {args.windows} "
              "windows of 128 tokens", flush=True)
        report[dtype] = {"perplexity": ppl}
        for name in args.variants:
            options = dict(common, **VARIANTS[name])
            llm = LLM(**options)
            ppl_q = perplexity(llm, windows)
            agree, prefix = agreement(builtin, greedy(llm, code, args.tokens))
            forced = next_token_agreement(llm, code, builtin)
            del llm
            small_llm = LLM(small, **options)
            small_agree, small_prefix = agreement(
                small_base, greedy(small_llm, prompts, args.tokens))
            small_forced = next_token_agreement(small_llm, prompts, small_base)
            del small_llm
            rise = ppl_q / ppl - 1
            print(f"{dtype} {name}: built-in model perplexity {ppl_q:.3f} ({100 * rise:+.2f}%); "
                  f"greedy agreement {100 * agree:.1f}% of {builtin.size} positions (common "
                  f"prefix {prefix:.1f} of {args.tokens}), next-token {100 * forced:.1f}%; "
                  f"small model greedy agreement {100 * small_agree:.1f}% of "
                  f"{small_base.size} positions (common prefix {small_prefix:.1f}), "
                  f"next-token {100 * small_forced:.1f}%", flush=True)
            report[dtype][name] = dict(
                perplexity=ppl_q, rise=rise, builtin_agreement=agree,
                builtin_common_prefix=prefix, builtin_next_token_agreement=forced,
                small_agreement=small_agree, small_common_prefix=small_prefix,
                small_next_token_agreement=small_forced)
    if len(small_tokens) == 2:
        for name, tokens, model, inputs in (("built-in", builtin_tokens, None, code),
                                            ("small", small_tokens, small, prompts)):
            agree, prefix = agreement(*tokens.values())
            want, other = list(tokens)
            llm = LLM(model, dtype=other, precompile=False, max_model_len=512)
            forced = next_token_agreement(llm, inputs, tokens[want])
            del llm
            print(f"for scale: {name} model {want} vs {other}, both unquantized: agreement "
                  f"{100 * agree:.1f}%; common prefix {prefix:.1f} tokens; next-token "
                  f"{100 * forced:.1f}%", flush=True)
            report[f"{name}_{want}_vs_{other}"] = {"agreement": agree,
                                                   "mean_common_prefix": prefix,
                                                   "next_token_agreement": forced}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
