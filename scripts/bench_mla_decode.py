"""Decode throughput of a DeepSeek-V3-shaped model (multi-head latent attention, MLA) with
random weights at several batch sizes, beside what its latent KV cache holds against a
multi-head cache of the same heads, in one run.

    python scripts/bench_mla_decode.py [--preset small|v3|tiny] [--layers N] [--experts E]
        [--batch-sizes 1 8 32 64] [--prompt-len 32] [--output-len 32] [--dtype D]
        [--max-model-len 512] [--kv-gib G] [--kv-cache-dtype auto|fp8|int8]
        [--attention-backend auto] [--json OUT]

The model is a config.json in a temporary folder (architectures DeepseekV3ForCausalLM) run
with load_format="dummy" (random weights, no checkpoint). Presets:

  small  (default) V3's attention per head (kv_lora_rank C 512, qk_rope_head_dim R 64,
         qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536, V3's YaRN rope) and V3's
         MoE routing (sigmoid scores, noaux_tc with n_group / topk_group, one shared expert,
         the first layer dense), with fewer heads, layers and experts and a smaller hidden
         size: hidden 1024, 16 heads, 3 layers, 16 experts of 256 (top 4, 4 groups, 2
         kept), vocab 32000. It runs on 2 CPU cores in a few minutes.
  v3     DeepSeek-V3's own config.json (hidden 7168, 128 heads, 61 layers, 256 experts of
         2048, top 8, vocab 129280): for an accelerator that holds it; --layers and
         --experts cut it down.
  tiny   small's attention per head on a toy model (hidden 128, 4 heads, 2 layers, 8
         experts of 64): the tests' preset.

(--preset v3 --layers 4 --experts 32: V3's three dense layers and one MoE layer, about
5.2B parameters, 10.5 GB in bfloat16.)

One engine (precompile: every bucket compiled at start-up, prefix caching off). For each
batch size B: B requests of --prompt-len random token ids (temperature 0, ignore_eos)
are stepped until all of them decode (engine_measures.measure_decode), then --output-len
decode steps are timed: decode tok/s = tokens per step / median step time (the prefill is
not in it). Then one LLM.generate of B fresh prompts of --output-len tokens each, for the
output tok/s a whole request sees (prefill included). Reported beside them: the latent
cache's bytes per block (layers x S x (C + R) x itemsize: one entry per token, shared by
every head), the bytes a multi-head cache of the same heads would need (layers x S x N x
(qk_nope + qk_rope + v_head) x itemsize: a key and a value per head), the blocks and
tokens each holds in one budget (--kv-gib, default the engine's cache as allocated), and
the compilations after the start-up (process-wide; must be 0: exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

START = time.perf_counter()

# DeepSeek-V3's config.json (hub deepseek-ai/DeepSeek-V3), without its fp8
# quantization_config: the dummy weights are made in --dtype.
V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=1.0,
                      mscale_all_dim=1.0, original_max_position_embeddings=4096),
    attention_bias=False, tie_word_embeddings=False, num_nextn_predict_layers=1,
    vocab_size=129280, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
# V3's attention per head and routing on fewer, narrower layers.
PRESETS = {
    "v3": {},
    "small": dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
                  num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16,
                  n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                  first_k_dense_replace=1, num_nextn_predict_layers=0, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                 first_k_dense_replace=1, q_lora_rank=256, num_nextn_predict_layers=0,
                 vocab_size=1024),
}
ITEMSIZE = {"float32": 4, "bfloat16": 2}


def say(line: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {line}", flush=True)


def model_config(args) -> dict:
    """The preset's config.json with --layers / --experts applied."""
    config = {**V3, **PRESETS[args.preset]}
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
        config["first_k_dense_replace"] = min(config["first_k_dense_replace"],
                                              max(args.layers - 1, 0))
    if args.experts is not None:
        config["n_routed_experts"] = args.experts
        config["n_group"] = math.gcd(config["n_group"], args.experts)
        config["topk_group"] = min(config["topk_group"], config["n_group"])
        config["num_experts_per_tok"] = min(config["num_experts_per_tok"], args.experts)
    return config


# ----------------------------------------------------------------------------- KV capacity

def kv_capacity(config: dict, block_size: int, itemsize: int, budget: int) -> dict:
    """Bytes per block of the latent cache (layers x S x (C + R)) and of a multi-head cache
    of the same heads (layers x S x N x (P + R + V): a key of P + R and a value of V per
    head), and the blocks and tokens each gets in `budget` bytes."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    per_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]
    latent_block = layers * block_size * latent * itemsize
    mha_block = layers * block_size * heads * per_head * itemsize
    return dict(block_size=block_size, budget_bytes=budget, latent_bytes_per_block=latent_block,
                mha_bytes_per_block=mha_block, latent_blocks=budget // latent_block,
                mha_blocks=budget // mha_block,
                latent_tokens=budget // latent_block * block_size,
                mha_tokens=budget // mha_block * block_size, ratio=mha_block / latent_block)


# ----------------------------------------------------------------------------- runs

def build_engine(folder: str, args):
    """The engine: its step buckets hold the largest batch's prompts in one prefill step;
    they compile in the warm-up pass (precompile off: only the buckets the runs use)."""
    from jaxserve import LLM

    most = max(args.batch_sizes)
    chunk = 1 << max(16, most * args.prompt_len - 1).bit_length()  # a power of two >= 16
    return LLM(folder, load_format="dummy", dtype=args.dtype, seed=args.seed,
               max_model_len=args.max_model_len, block_size=args.block_size,
               max_num_seqs=most, max_num_batched_tokens=chunk,
               attention_backend=args.attention_backend, enable_prefix_caching=False,
               kv_cache_dtype=args.kv_cache_dtype, precompile=False)


def generate_pass(llm, batch: int, steps: int, args, rng) -> dict:
    """One LLM.generate of `batch` fresh prompts of --prompt-len, `steps` output tokens
    each (the prefill included in its time)."""
    from jaxserve import SamplingParams
    from jaxserve.benchmarks.workloads import FIRST_REGULAR_ID

    vocab = llm.engine.config.model.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(FIRST_REGULAR_ID, vocab,
                                                 args.prompt_len).tolist()}
               for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != batch * steps:
        raise RuntimeError(f"produced {produced} tokens, {batch * steps} asked")
    return dict(generate_s=wall, generate_tok_s=produced / wall)


def measure_batch(llm, batch: int, steps: int, args, rng) -> dict:
    """Decode tok/s while `batch` requests all decode (the median of `steps` steps), then a
    generate pass of `steps` output tokens per request."""
    from jaxserve.benchmarks.engine_measures import measure_decode

    vocab = llm.engine.config.model.vocab_size
    r = measure_decode(llm.engine, batch, args.prompt_len, steps, rng, vocab,
                       deadline=time.perf_counter() + args.max_seconds)
    row = dict(batch=batch, step_ms=1e3 * r["step_s"], step_ms_mean=1e3 * r["step_s_mean"],
               tokens_per_step=r["tokens_per_step"], mean_context=r["mean_context"],
               decode_tok_s=r["tokens_per_step"] / r["step_s"])
    row.update(generate_pass(llm, batch, steps, args, rng))
    return row


def run(folder: str, args) -> dict:
    """Build the engine, measure every batch size; the report's numbers."""
    from jaxserve.backends.compile_stats import compilation_count

    start = time.perf_counter()
    llm = build_engine(folder, args)
    engine = llm.engine
    runner = engine.runner
    build_s = time.perf_counter() - start
    say(f"engine built (dummy weights) in {build_s:.1f} s; KV cache {runner.num_blocks - 1} "
        f"blocks of {runner.bytes_per_block} B")
    rng = np.random.default_rng(args.seed)
    try:
        start = time.perf_counter()
        for batch in args.batch_sizes:  # untimed: every bucket the runs use compiles here
            measure_batch(llm, batch, min(2, args.output_len), args, rng)
        warm_up_s = time.perf_counter() - start
        say(f"warm-up pass (compiles the buckets used) in {warm_up_s:.1f} s")
        compiled = compilation_count()
        rows = []
        for batch in args.batch_sizes:
            rows.append(measure_batch(llm, batch, args.output_len, args, rng))
            row = rows[-1]
            say(f"batch {batch:4d}: step {row['step_ms']:8.2f} ms, decode "
                f"{row['decode_tok_s']:9.1f} tok/s; generate {row['generate_s']:.2f} s, "
                f"{row['generate_tok_s']:9.1f} output tok/s (prefill included)")
        recompilations = compilation_count() - compiled
        engine_kv = dict(blocks=runner.num_blocks - 1, bytes_per_block=runner.bytes_per_block,
                         cache_bytes=runner.num_blocks * runner.bytes_per_block)
        attention = getattr(runner.attention_fn, "func", runner.attention_fn)
    finally:
        llm.close()
    return dict(rows=rows, recompilations_after_warm_up=recompilations, engine_kv=engine_kv,
                build_s=build_s, warm_up_s=warm_up_s,
                mla_attention=f"{attention.__module__}.{attention.__name__}")


def print_report(report: dict, args) -> None:
    config, kv = report["config"], report["kv"]
    print(f"\n== DeepSeek-V3-shaped decode (MLA): preset {args.preset}, "
          f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"{config['num_attention_heads']} heads (C {config['kv_lora_rank']}, R "
          f"{config['qk_rope_head_dim']}), {config['n_routed_experts']} experts of "
          f"{config['moe_intermediate_size']} (top {config['num_experts_per_tok']}), "
          f"{args.dtype}, KV cache {args.kv_cache_dtype}, {report['platform']}; prompts of "
          f"{args.prompt_len}, "
          f"{args.output_len} decode steps timed; attention {report['mla_attention']} ==")
    print(f"{'batch':>5} {'step ms':>9} {'decode tok/s':>13} {'generate tok/s':>15}")
    for row in report["rows"]:
        print(f"{row['batch']:5d} {row['step_ms']:9.2f} {row['decode_tok_s']:13.1f} "
              f"{row['generate_tok_s']:15.1f}")
    print(f"KV cache, blocks of {kv['block_size']} tokens, in {kv['budget_bytes'] / 2**20:.1f} "
          f"MiB: latent {kv['latent_bytes_per_block']:,} B/block -> {kv['latent_blocks']:,} "
          f"blocks ({kv['latent_tokens']:,} tokens); MHA-equivalent "
          f"{kv['mha_bytes_per_block']:,} B/block -> {kv['mha_blocks']:,} blocks "
          f"({kv['mha_tokens']:,} tokens): {kv['ratio']:.1f}x the tokens in latent form")
    print(f"compilations after warm-up: {report['recompilations_after_warm_up']}; "
          f"{report['total_s']:.0f} s in all")


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from jaxserve.benchmarks.device_plan import write_model_folder

    platform = jax.devices()[0].platform
    args.dtype = args.dtype or ("float32" if platform == "cpu" else "bfloat16")
    config = model_config(args)
    say(f"preset {args.preset}: {config['num_hidden_layers']} layers, "
        f"{config['n_routed_experts']} experts; {args.dtype} on {platform} "
        f"({os.cpu_count()} CPUs); batch sizes {args.batch_sizes}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(write_model_folder(pathlib.Path(tmp), config))
        report = run(folder, args)
    budget = int(args.kv_gib * 2**30) if args.kv_gib else report["engine_kv"]["cache_bytes"]
    itemsize = 1 if args.kv_cache_dtype != "auto" else ITEMSIZE[args.dtype]  # fp8 / int8
    kv = kv_capacity(config, args.block_size, itemsize, budget)
    report.update(config=config, kv=kv, platform=platform, dtype=args.dtype,
                  kv_cache_dtype=args.kv_cache_dtype,
                  args=vars(args), total_s=time.perf_counter() - START)
    if report["engine_kv"]["bytes_per_block"] != kv["latent_bytes_per_block"]:
        raise RuntimeError(f"the engine's blocks are {report['engine_kv']['bytes_per_block']} "
                           f"B, the latent layout's {kv['latent_bytes_per_block']} B")
    print_report(report, args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        say(f"wrote {args.json}")
    return 0 if report["recompilations_after_warm_up"] == 0 else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=list(PRESETS))
    p.add_argument("--layers", type=int, help="num_hidden_layers (default: the preset's)")
    p.add_argument("--experts", type=int, help="n_routed_experts (default: the preset's)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32, help="decode steps timed")
    p.add_argument("--dtype", choices=list(ITEMSIZE),
                   help="default: float32 on the CPU, bfloat16 on an accelerator")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-gib", type=float,
                   help="the budget of the KV comparison (default: the engine's cache)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "int8"),
                   help="the latent cache's values: the model's dtype, or one byte with "
                   "calibrated scales")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-seconds", type=float, default=600,
                   help="per batch size, until every request decodes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    if min(args.batch_sizes + [args.prompt_len, args.output_len]) < 1:
        p.error("--batch-sizes, --prompt-len and --output-len must be positive")
    return args


if __name__ == "__main__":
    sys.exit(main())
