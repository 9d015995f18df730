"""KV-cache sizing: the bytes of one block and how many blocks a budget holds.

One home for both users: the runner sizes its cache at start-up from the device's memory
statistics (after the weights are placed), and `jaxserve plan` predicts the same number from
a given device memory without touching a device. Shape letters as in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config.engine_config import CacheConfig

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "int8": 1}
CPU_KV_BYTES = 1 << 30  # the KV budget on the host when nothing else is given


@dataclasses.dataclass(frozen=True)
class KVBudget:
    blocks: int  # P, the null block included
    budget_bytes: int  # per device
    source: str  # "num_kv_blocks", "kv_cache_memory_bytes", "device memory" or "host default"


def cache_element(model_dtype: str, kv_cache_dtype: str) -> str:
    """What one cache element is (a key of ITEMSIZE): the model's dtype for kv_cache_dtype
    auto, else the quantized format (fp8 is fp8_e4m3)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def bytes_per_block(num_layers: int, block_size: int, kv_heads_per_device: int,
                    head_dim: int, element: str) -> int:
    """K and V of one block on one device (its share of the kv heads), every layer;
    element: cache_element's. A quantized cache's scales (a float32 per layer and kv head)
    are not per block."""
    return 2 * num_layers * block_size * kv_heads_per_device * head_dim * ITEMSIZE[element]


# Bytes per vocabulary entry of one sampler-state row (sampler.PenaltyState, on every device):
# output-token counts (int32), the prompt mask (bool) and the logit-bias row (float32); plus
# the grammar bitmask, one bit per entry in int32 words.
SAMPLER_STATE_BYTES_PER_ENTRY = 4 + 1 + 4


def sampler_state_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """The sampler state on each device: one row per running request plus a scratch row."""
    per_row = vocab_size * SAMPLER_STATE_BYTES_PER_ENTRY + (vocab_size + 31) // 32 * 4
    return (max_num_seqs + 1) * per_row


def blocks_per_seq(max_model_len: int, block_size: int) -> int:
    """B: the block-table width, one sequence of max_model_len tokens."""
    return -(-max_model_len // block_size)


def kv_budget(cache: CacheConfig, per_block: int, *, device_limit: int | None, in_use: int,
              max_seq_blocks: int | None = None) -> KVBudget:
    """The blocks the cache gets: num_kv_blocks when given; else kv_cache_memory_bytes;
    else on an accelerator (device_limit: its memory) device_limit x gpu_memory_utilization
    minus the bytes in use (the weights); else (the host) CPU_KV_BYTES, capped at
    max_seq_blocks (what max_num_seqs sequences can use at once)."""
    if cache.num_kv_blocks is not None:
        return KVBudget(cache.num_kv_blocks, cache.num_kv_blocks * per_block, "num_kv_blocks")
    if cache.kv_cache_memory_bytes is not None:
        blocks, source = cache.kv_cache_memory_bytes // per_block, "kv_cache_memory_bytes"
        budget = cache.kv_cache_memory_bytes
    elif device_limit is not None:
        budget = int(device_limit * cache.gpu_memory_utilization - in_use)
        blocks, source = max(budget, 0) // per_block, "device memory"
    else:
        budget, source = CPU_KV_BYTES, "host default"
        blocks = budget // per_block
    if device_limit is None and max_seq_blocks is not None:
        blocks = min(blocks, max_seq_blocks)  # host memory: no point holding more
    return KVBudget(int(blocks), int(budget), source)


def latent_bytes_per_block(num_layers: int, block_size: int, latent_dim: int,
                           element: str) -> int:
    """One block of a latent cache (multi-head latent attention, DeepSeek): one [C + R] entry
    per token and layer, the whole of it on every device (it is replicated)."""
    return num_layers * block_size * latent_dim * ITEMSIZE[element]


def device_bytes_per_block(config, groups, kv_heads_per_device: int, head_dim: int,
                           latent_dim: int = 0) -> int:
    """bytes_per_block of an engine of `config` (an EngineConfig) whose blocks hold
    groups.num_slots layers (config/kv_groups.py), on one device; latent_dim C + R: a
    latent cache's (latent_bytes_per_block) instead."""
    element = cache_element(config.model.dtype, config.cache.kv_cache_dtype)
    if latent_dim:
        return latent_bytes_per_block(groups.num_slots, config.cache.block_size, latent_dim,
                                      element)
    return bytes_per_block(groups.num_slots, config.cache.block_size, kv_heads_per_device,
                           head_dim, element)


def device_blocks(config, groups, per_block: int, *, device_limit: int | None, in_use: int,
                  share=None) -> int:
    """The KV blocks of one device of an engine of `config`: kv_budget (capped on the host
    at what max_num_seqs sequences of max_model_len hold, KVGroups.blocks_held), agreed
    across hosts by share(blocks) when given, and checked to hold one sequence of
    max_model_len while a step computes max_num_batched_tokens of it."""
    model_len, size = config.model.max_model_len, config.cache.block_size
    held = groups.blocks_held(model_len, size)
    blocks = kv_budget(config.cache, per_block, device_limit=device_limit, in_use=in_use,
                       max_seq_blocks=config.scheduler.max_num_seqs * held + 1).blocks
    if share is not None:
        blocks = share(blocks)
    check_holds_one_sequence(blocks, size, model_len, groups.blocks_held(
        model_len, size, config.scheduler.max_num_batched_tokens))
    return int(blocks)


def check_holds_one_sequence(blocks: int, block_size: int, max_model_len: int,
                             held: int | None = None) -> None:
    """ValueError unless the cache holds one sequence of max_model_len (plus the null
    block), saying what would help. held: the blocks that sequence holds
    (KVGroups.blocks_held; default one block table's worth)."""
    needed = (held or blocks_per_seq(max_model_len, block_size)) + 1
    if blocks < needed:
        raise ValueError(
            f"The KV cache has room for {blocks} blocks of {block_size} tokens, but one "
            f"sequence of max_model_len={max_model_len} needs {needed} (with the reserved "
            "null block). Raise num_gpu_blocks_override (num_kv_blocks), "
            "kv_cache_memory_bytes or gpu_memory_utilization, or lower max_model_len.")
