"""Sliding-window layers holding only their window, against every layer holding everything,
on a Gemma 3-shaped model at a long max_model_len: how many sequences the KV cache holds and
the throughput a KV-bound workload gets.

    python scripts/bench_hybrid_kv.py [--layers 12] [--hidden 128] [--window 128]
        [--max-model-len 4096] [--kv-mib 48] [--requests 24] [--prompt 1024] [--output 64]
        [--dtype float32] [--json OUT]

The model is Gemma 3's layer pattern (five sliding-window layers, then one full-attention
layer; local and global RoPE bases) scaled down, with random weights (load_format="dummy":
no checkpoint is read). Both engines get the same KV budget (kv_cache_memory_bytes), and
run the same requests (random prompt ids, ignore_eos, greedy) in this one process, side by
side: the start-up figures (blocks, sequences of max_model_len the cache holds), the most
sequences running at once, and output tokens per second of the workload's second run (the
first compiles the buckets it uses). The ratios are what the report gives (this machine is
shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

from jaxserve.benchmarks.device_plan import write_model_folder


def gemma3_config(layers: int, hidden: int, window: int, max_model_len: int) -> dict:
    heads, head_dim = 4, 32
    return dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=hidden,
        intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=2, head_dim=head_dim, vocab_size=8192, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=head_dim,
        sliding_window=window, sliding_window_pattern=6,
        max_position_embeddings=max_model_len, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)


def run(folder: str, hybrid: bool, args) -> dict:
    from jaxserve import LLM, SamplingParams

    llm = LLM(folder, load_format="dummy", dtype=args.dtype, max_model_len=args.max_model_len,
              kv_cache_memory_bytes=args.kv_mib << 20, max_num_seqs=args.requests,
              max_num_batched_tokens=max(args.requests, 512), precompile=False,
              enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid)
    engine = llm.engine
    groups, blocks = engine.runner.kv_groups, engine.runner.num_blocks
    held = groups.blocks_held(args.max_model_len, engine.config.cache.block_size)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(5, 8192, args.prompt).tolist()}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # the same run first: every bucket compiled
    most = [0]
    schedule = engine.scheduler.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        most[0] = max(most[0], len(engine.scheduler.running))
        return out

    engine.scheduler.schedule = counted
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(hybrid=hybrid, groups=list(map(str, groups.windows)), blocks=blocks - 1,
                bytes_per_block=engine.runner.bytes_per_block,
                seqs_at_max_model_len=(blocks - 1) / held, most_running=most[0],
                preemptions=engine.num_preemptions, seconds=seconds,
                output_tok_s=tokens / seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-mib", type=int, default=48, help="KV budget, MiB per device")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=64, help="output tokens per request")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = str(write_model_folder(pathlib.Path(tmp), gemma3_config(
            args.layers, args.hidden, args.window, args.max_model_len)))
        rows = [run(folder, hybrid, args) for hybrid in (False, True)]
    for row in rows:
        label = "window layers hold their window" if row["hybrid"] else "every layer holds all"
        print(f"{label:32s}: {row['blocks']:6d} blocks of {row['bytes_per_block']:7d} B, "
              f"{row['seqs_at_max_model_len']:6.2f} sequences of max_model_len, "
              f"{row['most_running']:3d} running at most, {row['preemptions']:3d} preemptions, "
              f"{row['output_tok_s']:8.1f} output tok/s ({row['seconds']:.1f} s)", flush=True)
    plain, hybrid = rows
    ratios = dict(capacity=hybrid["seqs_at_max_model_len"] / plain["seqs_at_max_model_len"],
                  running=hybrid["most_running"] / max(plain["most_running"], 1),
                  throughput=hybrid["output_tok_s"] / plain["output_tok_s"])
    print("ratios (window layers holding their window / holding everything): "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows, "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
