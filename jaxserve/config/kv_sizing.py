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


# A TPU stores an array's last two dims in tiles of 128 lanes by up to 8 rows of 32 bits.
TPU_LANES = 128
TPU_SUBLANES = 8


def tpu_tiled(rows: int, minor: int, itemsize: int) -> int:
    """Elements a TPU holds for the last two dims [rows, minor] of a row-major array (the
    KV cache's layout, runner.py): minor in whole 128-lane tiles; rows in tiles of 8, or of
    the next power of two for a smaller dim, never fewer than one 32-bit row packs (2 of
    bf16, 4 of one byte). XLA:TPU's tiling, as libtpu's compiler reports it: [2, 64] bf16
    takes [2, 128], [1, 128] bf16 [2, 128], [3, 128] f32 [4, 128]."""
    packed = 4 // itemsize
    tile = min(TPU_SUBLANES, max(packed, 1 << max(rows - 1, 0).bit_length()))
    return -(-rows // tile) * tile * -(-minor // TPU_LANES) * TPU_LANES


def min_kv_heads_per_device(element: str, tiled: bool) -> int:
    """The fewest kv heads one device holds (mesh.plan_sharding replicates up to it): 2 on a
    TPU for caches of less than 32 bits. There a page's [S, 1, H] is padded to 2 rows or
    more anyway (tpu_tiled), and XLA:TPU writes new keys into a cache of one 16-bit head per
    device out of place, copying each layer's cache in and out of every step; with two
    heads it writes in place, in the same memory."""
    return 2 if tiled and ITEMSIZE[element] < 4 else 1


def bytes_per_block(num_layers: int, block_size: int, kv_heads_per_device: int,
                    head_dim: int, element: str, tiled: bool = False) -> int:
    """K and V of one block on one device (its share of the kv heads), every layer;
    element: cache_element's; tiled: as a TPU stores them (tpu_tiled's padding of
    [K', H]). A quantized cache's scales (a float32 per layer and kv head) are not per
    block."""
    size = ITEMSIZE[element]
    entry = (tpu_tiled(kv_heads_per_device, head_dim, size) if tiled
             else kv_heads_per_device * head_dim)
    return 2 * num_layers * block_size * entry * size


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
                           element: str, tiled: bool = False) -> int:
    """One block of a latent cache (multi-head latent attention, DeepSeek): one [C + R] entry
    per token and layer, the whole of it on every device (it is replicated); tiled: as a
    TPU stores it (tpu_tiled's padding of [S, C + R])."""
    size = ITEMSIZE[element]
    block = (tpu_tiled(block_size, latent_dim, size) if tiled
             else block_size * latent_dim)
    return num_layers * block * size


def device_bytes_per_block(config, groups, kv_heads_per_device: int, head_dim: int,
                           latent_dim: int = 0, tiled: bool = False) -> int:
    """bytes_per_block of an engine of `config` (an EngineConfig) whose blocks hold
    groups.num_slots layers (config/kv_groups.py), on one device; latent_dim C + R: a
    latent cache's (latent_bytes_per_block) instead; tiled: on a TPU."""
    element = cache_element(config.model.dtype, config.cache.kv_cache_dtype)
    if latent_dim:
        return latent_bytes_per_block(groups.num_slots, config.cache.block_size, latent_dim,
                                      element, tiled)
    return bytes_per_block(groups.num_slots, config.cache.block_size, kv_heads_per_device,
                           head_dim, element, tiled)


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
