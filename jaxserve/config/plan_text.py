"""The text of a plan (plan.Plan): sizes read and written (parse_bytes, size_text) and the
table `jaxserve plan` prints (format_plan), with a latent cache's lines beside multi-head
attention's. `plan` below is a plan.Plan (which imports this module for size_text)."""

from __future__ import annotations

import re

from jaxserve.config import kv_sizing
from jaxserve.config.kv_groups import describe_groups
from jaxserve.config.latent_cache import latent_text

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """'16GiB', '16Gi' and '16G' (binary), '80GB' (decimal), '16e9' or '17179869184' (bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kmgtKMGT]?)(i?)([bB]?)\s*",
                         str(text))
    if not match or (match[3] and not match[2]):
        raise ValueError(f"device memory must look like 16GiB, 16G (binary), 80GB (decimal) or "
                         f"16e9 (bytes), got {text!r}.")
    number, prefix, binary, byte = match.groups()
    unit = _UNITS[prefix.lower()]
    if prefix and byte and not binary:  # "GB": decimal, as disk and GPU vendors count
        unit = 1000 ** ("kmgt".index(prefix.lower()) + 1)
    value = int(float(number) * unit)
    if value <= 0:
        raise ValueError(f"device memory must be > 0, got {text!r}.")
    return value


def size_text(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


_LABELS = {"embeddings": "embeddings", "attention": "attention", "mlp": "MLP",
           "norms": "norms", "other": "other", "lora slots": "LoRA slots"}


def format_plan(plan) -> str:
    """A readable table of the plan (what `jaxserve plan` prints)."""
    s, mesh = plan.sharding, plan.mesh
    embed = {"hidden": "on the hidden axis D", "vocab": "on the vocabulary V"}.get(
        s.embed_axis, "not split (replicated)")
    if not plan.num_experts:
        mlp = f"MLP width {plan.intermediate_size} -> {plan.intermediate_size // s.model}"
    elif s.expert_parallel:
        mlp = f"experts {plan.num_experts} -> {plan.num_experts // s.model} whole"
    else:
        mlp = (f"experts {plan.num_experts}, each of width {plan.expert_intermediate_size} -> "
               f"{plan.expert_intermediate_size // s.model}")
    labels = dict(_LABELS, mlp="MLP + experts" if plan.num_experts else "MLP")
    lines = [
        f"model        {plan.model} ({plan.architecture}, {plan.dtype}"
        f"{_scheme_text(plan.quantization)}, "
        f"{plan.num_params:,} parameters per replica)",
        f"mesh         {mesh}: {_count(mesh.data, 'replica')}, each split over "
        f"{_count(mesh.model, 'device')} = {_count(mesh.num_devices, 'device')}; numbers below "
        "are per device",
        f"split        query heads {plan.num_heads} -> {plan.num_heads // s.model} per device; "
        f"{_kv_split_text(plan)}",
        f"             {mlp} per device; embeddings / lm_head split {embed}",
        f"memory       {size_text(plan.device_memory_bytes)} x gpu_memory_utilization "
        f"{plan.gpu_memory_utilization:g} = {size_text(plan.usable_memory_bytes)} usable per device",
        "",
        f"{'weights per device':<20} {'parameters':>15} {'bytes':>15} {'':>10}  placement",
    ]
    placement = {"split": f"split over {s.model}", "replicated": f"replicated x{s.model}",
                 "partly split": f"partly split over {s.model}"}
    for g in plan.weights:
        lines.append(f"  {labels[g.name]:<18} {g.params:>15,} {g.bytes_per_device:>15,} "
                     f"{size_text(g.bytes_per_device):>10}  "
                     f"{placement[g.split] if s.model > 1 else 'one device'}")
    used = plan.weight_bytes_per_device
    state = plan.sampler_state_bytes
    lines += [
        f"  {'total':<18} {plan.num_params:>15,} {used:>15,} {size_text(used):>10}",
        f"{'sampler state':<20} {'':>15} {state:>15,} {size_text(state):>10}  "
        f"{plan.max_num_seqs + 1} rows x vocabulary x "
        f"{kv_sizing.SAMPLER_STATE_BYTES_PER_ENTRY} B + 1 bit (penalties, logit bias, grammar)",
        "",
        *_kv_cache_lines(plan),
        f"  budget             {plan.kv_budget_bytes:,} B ({size_text(plan.kv_budget_bytes)}), "
        + ("usable memory - weights - sampler state"
           if plan.kv_budget_source == "device memory"
           else f"from {plan.kv_budget_source}"),
        f"  blocks             {plan.num_blocks:,} ({plan.usable_blocks:,} usable + the null "
        f"block) = {plan.kv_tokens:,} tokens" + describe_groups(plan.groups),
        f"  max concurrency    {plan.max_concurrency:,} sequences of max_model_len="
        f"{plan.max_model_len} ({plan.concurrency:.2f}; {plan.blocks_held} blocks each); "
        f"max_num_seqs={plan.max_num_seqs}",
        "",
        f"compile buckets      {len(plan.step_buckets)} step shapes (T tokens x R sequences), "
        f"max_num_batched_tokens={plan.max_num_batched_tokens}",
        "  " + " ".join(f"{t}x{r}" for t, r in plan.step_buckets),
    ]
    return "\n".join(lines)


def _kv_split_text(plan) -> str:
    """How the KV cache splits: by kv heads (replicated when fewer than devices), or a latent
    cache whole on every device."""
    s = plan.sharding
    if plan.latent is not None:
        return "the latent cache is not split (every device holds all of it)"
    kv_split = (f"{plan.num_kv_heads} -> K'={s.kv_heads} (each replicated {s.kv_replicas}x)"
                if s.kv_replicas > 1 else f"{s.kv_heads} (not replicated)")
    return f"kv heads {kv_split} -> {s.kv_heads_per_device} per device"


def _tpu_padding(plan) -> str:
    """How a TPU's tiles pad the cache's last two dims, when they do (plan.tpu_layout)."""
    if not plan.tpu_layout:
        return ""
    size = kv_sizing.ITEMSIZE[plan.kv_element]
    rows, minor = ((plan.block_size, plan.latent.dim) if plan.latent is not None
                   else (plan.sharding.kv_heads_per_device, plan.head_dim))
    stored = kv_sizing.tpu_tiled(rows, minor, size)
    if stored == rows * minor:
        return ""
    return (f"; x {stored / (rows * minor):.2f} as a TPU tiles it: [{rows}, {minor}] in "
            f"{stored:,} elements")


def _kv_cache_lines(plan) -> list[str]:
    """`jaxserve plan`'s lines on the KV cache of a plan (plan.Plan): its bytes per token and
    block; for a latent cache, also multi-head attention's with the same heads, and both
    in blocks per GiB."""
    element, latent = plan.kv_element, plan.latent
    per_block = (f"{plan.bytes_per_block:,} B ({size_text(plan.bytes_per_block)}) per block "
                 f"of {plan.block_size} tokens")
    padding = _tpu_padding(plan)
    if latent is None:
        return [f"KV cache per device  {plan.bytes_per_token:,} B per token (2 x "
                f"{plan.num_layers} layers x {_count(plan.sharding.kv_heads_per_device, 'kv head')}"
                f" x {plan.head_dim} x {kv_sizing.ITEMSIZE[element]} B {element}{padding}); "
                f"{per_block}"
                + ("" if plan.kv_cache_dtype == "auto"
                   else "; plus a float32 scale per layer and kv head")]
    mha = plan.mha_bytes_per_block
    heads = latent.num_heads // latent.model
    return [
        f"KV cache per device  {plan.bytes_per_token:,} B per token "
        f"({latent_text(latent, plan.num_layers, element)}{padding}); {per_block}"
        + ("" if plan.kv_cache_dtype == "auto"
           else "; plus a float32 scale per layer for the latent and one for the rope key"),
        f"  as plain MHA       {latent.num_heads} heads x ({latent.qk_head_dim} key + "
        f"{latent.v_head_dim} value) = {latent.mha_values:,} values per token and layer"
        + (f"; split over {latent.model} devices, {heads} heads = "
           f"{latent.mha_device_values:,} each" if latent.model > 1 else "")
        + f": {mha:,} B ({size_text(mha)}) per block",
        f"  blocks per GiB     {plan.blocks_per_gib:,.1f} latent, {plan.mha_blocks_per_gib:,.1f} "
        f"multi-head: {latent.token_ratio:.1f}x per token, {latent.device_ratio:.2f}x per "
        "device" + (" (MHA would split its heads over the model axis, the latent is "
                    "replicated)" if latent.model > 1 else ""),
    ]


def _scheme_text(quantization: str | None) -> str:
    if quantization is None:
        return ""
    return (" with int8 linear layers" if quantization == "int8"
            else f", checkpoint quantized: {quantization}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
