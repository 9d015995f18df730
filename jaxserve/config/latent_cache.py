"""A multi-head latent attention cache (DeepSeek) as `jaxserve plan` and the start-up log
describe it: its size beside multi-head attention's with the same heads. Plain Python on
config values."""

from __future__ import annotations

import dataclasses

from jaxserve.config import kv_sizing
from jaxserve.models import model_family


@dataclasses.dataclass(frozen=True)
class LatentCache:
    """A multi-head latent attention cache (DeepSeek): C + R values per token and layer, the
    whole of it on every device of the model axis; beside what multi-head attention with the
    same N heads would keep, N (P + R) keys and N V values per token and layer, its heads
    split over the model axis as the query heads are."""

    rank: int  # C, kv_lora_rank: the latent
    rope_dim: int  # R, qk_rope_head_dim: the one rope key all heads share
    num_heads: int  # N
    qk_head_dim: int  # P + R, one head's key
    v_head_dim: int  # V, one head's value
    model: int  # devices on the model axis

    @property
    def dim(self) -> int:
        """C + R: the cache's values per token and layer, on every device."""
        return self.rank + self.rope_dim

    @property
    def mha_values(self) -> int:
        """N (P + R) + N V: multi-head attention's values per token and layer, all devices."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def mha_device_values(self) -> int:
        """mha_values on one device: N / model heads of keys and values."""
        return self.num_heads // self.model * (self.qk_head_dim + self.v_head_dim)

    @property
    def token_ratio(self) -> float:
        """Multi-head attention's bytes per token over the latent cache's."""
        return self.mha_values / self.dim

    @property
    def device_ratio(self) -> float:
        """The same on one device: multi-head attention's heads split, the latent whole."""
        return self.mha_device_values / self.dim


def latent_cache(hf: dict, model: int) -> LatentCache | None:
    """The latent cache of a config.json's model on a model axis of `model` devices; None
    for multi-head attention (no kv_lora_rank, as ModelDims.from_hf tells them apart)."""
    if not hf.get("kv_lora_rank"):
        return None
    arch = model_family(hf).arch_from_hf(hf)
    return LatentCache(rank=arch.kv_lora_rank, rope_dim=arch.qk_rope_head_dim,
                       num_heads=arch.num_heads,
                       qk_head_dim=arch.qk_nope_head_dim + arch.qk_rope_head_dim,
                       v_head_dim=arch.v_head_dim, model=model)


def latent_text(latent: LatentCache, num_layers: int, element: str) -> str:
    """'latent cache: 61 layers x 576 (512 latent + 64 rope) x 2 B bfloat16, replicated on
    every device'."""
    where = "replicated on every device" if latent.model > 1 else "on one device"
    return (f"latent cache: {num_layers} layers x {latent.dim} ({latent.rank} latent + "
            f"{latent.rope_dim} rope) x {kv_sizing.ITEMSIZE[element]} B {element}, {where}")


def latent_ratio_text(latent: LatentCache) -> str:
    """How much smaller than multi-head attention's the latent cache is, per token and per
    device."""
    text = (f"{latent.token_ratio:.1f}x fewer bytes per token than multi-head attention's "
            f"{latent.mha_values:,} values ({latent.num_heads} heads x ({latent.qk_head_dim} "
            f"key + {latent.v_head_dim} value))")
    if latent.model > 1:
        text += (f", {latent.device_ratio:.2f}x per device (its heads split over "
                 f"{latent.model}, the latent whole)")
    return text


def kv_log_note(config) -> str:
    """What the engine's start-up KV line adds for a latent cache ('' for any other);
    config: an EngineConfig."""
    latent = latent_cache(config.model.hf_config, config.parallel.mesh.model)
    if latent is None:
        return ""
    element = kv_sizing.cache_element(config.model.dtype, config.cache.kv_cache_dtype)
    layers = model_family(config.model.hf_config).arch_from_hf(
        config.model.hf_config).num_layers
    return f"; {latent_text(latent, layers, element)}: {latent_ratio_text(latent)}"
