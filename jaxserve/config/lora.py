"""LoRA serving settings (vLLM's LoRAConfig): `enable_lora`, `max_loras`, `max_lora_rank`,
`max_cpu_loras`, checked once. The adapters themselves: models/lora.py (PEFT folders read
into the engine's layout), core/lora_slots.py (which adapter each device slot holds),
backends/jax/lora_weights.py (the slots on the device), models/jax/lora.py (applied in the
step)."""

from __future__ import annotations

import dataclasses

MAX_LORA_RANK_LIMIT = 512  # vLLM's largest max_lora_rank choice


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """max_loras adapters at once on the device (one slot each, every slot max_lora_rank
    wide: a smaller adapter is padded with zeros), max_cpu_loras adapters kept read on the
    host (least recently used dropped first)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.max_lora_rank > MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK_LIMIT}, got "
                             f"{self.max_lora_rank}.")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool)
                                or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {cpu!r}.")

    @property
    def host_capacity(self) -> int:
        """Adapters kept on the host."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @classmethod
    def create(cls, enable_lora: bool, max_loras: int, max_lora_rank: int,
               max_cpu_loras: int | None) -> LoraConfig | None:
        """None when LoRA is off (the settings must then be left at their defaults, or
        they would be silently ignored)."""
        if not isinstance(enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {enable_lora!r}.")
        if not enable_lora:
            given = [name for name, value, default in (
                ("max_loras", max_loras, 1), ("max_lora_rank", max_lora_rank, 16),
                ("max_cpu_loras", max_cpu_loras, None)) if value != default]
            if given:
                raise ValueError(f"{', '.join(given)} set without enable_lora=True "
                                 "(--enable-lora); turn LoRA on or drop them.")
            return None
        return cls(max_loras, max_lora_rank, max_cpu_loras)
