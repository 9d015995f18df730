"""The benchmarks' workloads (as vLLM's benchmark datasets): prompts of token ids and the
number of tokens each answer must have (ignore_eos). scripts/bench_offline.py names them on
its command line; bench_on_device.py and bench_spec_decode.py run the sharegpt-like one.

  random         num_prompts prompts of input_len random token ids, output_len each;
  sharegpt-like  128 requests, log-normal prompt lengths (median 96, clipped 8-512) and
                 output lengths (median 64, clipped 8-256), random token ids;
  shared-prefix  64 requests: one prefix_len random prefix, distinct suffix_len suffixes;
  file           a JSON list of {"prompt" | "prompt_token_ids", "output_len"?} objects.

Every workload is seeded; random ids start after the benchmark tokenizers' special tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

FIRST_REGULAR_ID = 5  # ids 0..4 are the benchmark tokenizers' special tokens


@dataclasses.dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def _lognormal_lengths(rng, count: int, median: float, sigma: float, lo: int, hi: int):
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, count)), lo, hi).astype(int)


def make_workload(args, vocab: int, tokenizer) -> Workload:
    """args.workload's requests (args: bench_offline.py's flags, or a Namespace of those the
    workload reads), token ids below vocab; tokenizer encodes a file's text prompts."""
    rng = np.random.default_rng(args.seed)
    ids = lambda n: rng.integers(FIRST_REGULAR_ID, vocab, int(n)).tolist()
    if args.workload == "random":
        n = args.num_prompts or 128
        return Workload("random", [ids(args.input_len) for _ in range(n)], [args.output_len] * n)
    if args.workload == "sharegpt-like":
        n = args.num_prompts or 128
        inputs = _lognormal_lengths(rng, n, 96, 0.8, 8, 512)
        outputs = _lognormal_lengths(rng, n, 64, 0.8, 8, 256)
        return Workload("sharegpt-like", [ids(k) for k in inputs], outputs.tolist())
    if args.workload == "shared-prefix":
        n = args.num_prompts or 64
        prefix = ids(args.prefix_len)
        return Workload("shared-prefix", [prefix + ids(args.suffix_len) for _ in range(n)],
                        [args.output_len] * n)
    items = json.loads(pathlib.Path(args.dataset).read_text())
    if not isinstance(items, list) or not items:
        raise ValueError(f"{args.dataset}: expected a non-empty JSON list of prompt objects.")
    prompts, outputs = [], []
    for item in items[: args.num_prompts or None]:
        item = {"prompt": item} if isinstance(item, str) else item
        prompts.append(list(item["prompt_token_ids"]) if "prompt_token_ids" in item
                       else tokenizer.encode(item["prompt"]))
        outputs.append(int(item.get("output_len", args.output_len)))
    return Workload(pathlib.Path(args.dataset).name, prompts, outputs)


