"""Embedding throughput: LLM.embed against HF transformers' forward pass (AutoModel and the
same pooling) on the same inputs, measured in one run, side by side.

    python scripts/bench_embeddings.py [--model DIR] [--num-inputs 256] [--hf-batch-size 32]
                                       [--json OUT]

--model defaults to the small benchmark Llama (~125M parameters, random weights, made by
make_small_checkpoint.py on first use), served as an embedding model (runner="pooling": a
*ForCausalLM gets convert="embed", last-token pooling, normalized; a pooling checkpoint its
own pooler). The inputs: --num-inputs random token-id prompts (seeded), log-normal lengths
(median --median-len, clipped to [--min-len, --max-len]), so that batches mix short and long
prompts. jaxserve embeds them all in one LLM.embed call (continuous batching, chunked
prefill) after a warm-up that compiles every bucket; HF runs AutoModel's forward over
padded batches of --hf-batch-size in input order (right padding with the attention mask;
--hf-sort-by-length batches similar lengths together) and pools its last hidden state as
the engine's pooler does (LAST, MEAN or CLS; then L2-normalized when the pooler
normalizes), after one warm-up batch. Both count prompt tokens (padding not counted) per
second; the report adds the warm-up, recompilations after it, HF's padded tokens, and the
largest cosine distance between the two sides' embeddings (they must agree).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import numpy as np

from jaxserve.benchmarks.checkpoints import ensure_small_checkpoint

FIRST_REGULAR_ID = 5  # ids below are the test tokenizers' special tokens


def make_inputs(args, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(np.round(rng.lognormal(math.log(args.median_len), 0.8, args.num_inputs)),
                      args.min_len, args.max_len).astype(int)
    return [rng.integers(FIRST_REGULAR_ID, vocab, int(n)).tolist() for n in lengths]


def engine_args(args) -> dict:
    values = {"dtype": args.dtype, "runner": "pooling", "precompile": True}
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                 "attention_backend", "seed"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return values


def run_jaxserve(model: str, inputs: list[list[int]], args) -> dict:
    from jaxserve import LLM

    start = time.perf_counter()
    llm = LLM(model, **engine_args(args))
    try:
        warm_up = time.perf_counter() - start
        compiles = llm.engine.num_compilations
        start = time.perf_counter()
        outputs = llm.embed([{"prompt_token_ids": ids} for ids in inputs], use_tqdm=False)
        wall = time.perf_counter() - start
        pooler = llm.engine.config.pooler
        tokens = sum(len(ids) for ids in inputs)
        return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                "warm_up_s": warm_up,
                "recompilations_after_warm_up": llm.engine.num_compilations - compiles,
                "preemptions": llm.engine.num_preemptions,
                "pooling_type": pooler.pooling_type, "normalize": pooler.normalize,
                "embeddings": np.stack([o.outputs.embedding for o in outputs])}
    finally:
        llm.close()


def hf_pool(hidden, mask, pooling_type: str, normalize: bool):
    """f32[B, D] from the last hidden state [B, L, D] of a right-padded batch."""
    import torch

    if pooling_type == "LAST":
        last = mask.sum(dim=1) - 1
        pooled = hidden[torch.arange(hidden.shape[0]), last]
    elif pooling_type == "MEAN":
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1)
    else:  # CLS: the first token
        pooled = hidden[:, 0]
    pooled = pooled.float()
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def run_hf(model: str, inputs: list[list[int]], args, pooling_type: str,
           normalize: bool) -> dict:
    import torch
    from transformers import AutoModel

    torch.set_num_threads(args.hf_threads)
    hf = AutoModel.from_pretrained(model, dtype=getattr(torch, args.dtype)).eval()
    order = list(range(len(inputs)))
    if args.hf_sort_by_length:
        order.sort(key=lambda i: len(inputs[i]))
    batches = [order[i:i + args.hf_batch_size] for i in range(0, len(order),
                                                               args.hf_batch_size)]

    def forward(rows: list[int]):
        width = max(len(inputs[i]) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, i in enumerate(rows):  # right padding
            ids[row, :len(inputs[i])] = torch.tensor(inputs[i])
            mask[row, :len(inputs[i])] = 1
        hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        return hf_pool(hidden, mask, pooling_type, normalize), len(rows) * width

    embeddings = np.zeros((len(inputs), hf.config.hidden_size), np.float32)
    with torch.no_grad():
        forward(batches[0][:2])  # warm-up: the first call's one-time costs
        padded, start = 0, time.perf_counter()
        for rows in batches:
            pooled, slots = forward(rows)
            embeddings[rows] = pooled.numpy()
            padded += slots
        wall = time.perf_counter() - start
    tokens = sum(len(ids) for ids in inputs)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "padded_tokens": padded, "batch_size": args.hf_batch_size,
            "threads": args.hf_threads, "embeddings": embeddings}


def max_cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((1.0 - (a * b).sum(axis=1)).max())


def main() -> None:
    args = parse_args()
    model = args.model or str(ensure_small_checkpoint())
    vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
    inputs = make_inputs(args, vocab)
    lengths = [len(ids) for ids in inputs]
    print(f"{len(inputs)} inputs, {sum(lengths)} tokens (lengths {min(lengths)}-"
          f"{max(lengths)}, median {int(np.median(lengths))}); model {model}", flush=True)
    report: dict = {"model": model, "inputs": len(inputs), "tokens": sum(lengths),
                    "dtype": args.dtype}
    ours = run_jaxserve(model, inputs, args)
    print(f"jaxserve LLM.embed: {ours['wall_s']:.2f} s, {ours['tok_s']:.0f} tok/s "
          f"({ours['pooling_type']} pooling{', normalized' if ours['normalize'] else ''}); "
          f"warm-up (load + compile) {ours['warm_up_s']:.1f} s, recompilations after it "
          f"{ours['recompilations_after_warm_up']}, preemptions {ours['preemptions']}",
          flush=True)
    report["jaxserve"] = {k: v for k, v in ours.items() if k != "embeddings"}
    if not args.skip_hf:
        hf = run_hf(model, inputs, args, ours["pooling_type"], ours["normalize"])
        distance = max_cosine_distance(ours["embeddings"], hf["embeddings"])
        print(f"HF transformers forward (padded batches of {hf['batch_size']}, "
              f"{hf['threads']} threads): {hf['wall_s']:.2f} s, {hf['tok_s']:.0f} tok/s "
              f"({hf['padded_tokens']} token slots with padding)")
        print(f"jaxserve / HF tok/s: {ours['tok_s'] / hf['tok_s']:.2f}x; largest cosine "
              f"distance between the two sides' embeddings: {distance:.2e}")
        report["hf"] = {k: v for k, v in hf.items() if k != "embeddings"}
        report["ratio"] = ours["tok_s"] / hf["tok_s"]
        report["max_cosine_distance"] = distance
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the small benchmark Llama)")
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--median-len", type=int, default=96)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--attention-backend")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--hf-threads", type=int, default=2)
    p.add_argument("--hf-sort-by-length", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args()
    if not 1 <= args.min_len <= args.max_len:
        p.error("--min-len must be >= 1 and at most --max-len")
    return args


if __name__ == "__main__":
    main()
