"""Which LoRA adapter each of the device's max_loras slots holds (host side).

The scheduler gives a request with an adapter a slot when it admits it and takes it back
when the request stops running (finished, preempted). A slot is shared by every running
request of its adapter; a request whose adapter has no slot waits while every slot is in
use (vLLM's max_loras). A slot nobody uses keeps its adapter (its weights stay on the
device): the adapter's next request takes it back without a load, and a new adapter takes
the slot idle the longest. The runner writes a slot's weights when the adapter a step's
rows name is not the one it holds (backends/jax/lora_weights.py).
"""

from __future__ import annotations

import itertools


class LoraSlots:
    def __init__(self, num_slots: int) -> None:
        self.holds: list = [None] * num_slots  # the adapter (LoRARequest) of each slot
        self.users = [0] * num_slots  # running requests using it
        self._idle_since = [0] * num_slots  # when its users last dropped to 0 (a clock)
        self._clock = itertools.count(1)

    def _slot_of(self, lora) -> int | None:
        for slot, held in enumerate(self.holds):
            if held == lora:
                return slot
        return None

    def can_admit(self, lora) -> bool:
        """Whether a request with adapter `lora` (None: the base model) can run now."""
        if lora is None:
            return True
        slot = self._slot_of(lora)
        return (slot is not None and self.users[slot] > 0) or 0 in self.users

    def acquire(self, lora) -> int:
        """The slot for a request admitted with `lora` (-1 for the base model): its
        adapter's slot, else the slot idle the longest (can_admit said there is one)."""
        if lora is None:
            return -1
        slot = self._slot_of(lora)
        if slot is None:
            idle = [s for s, users in enumerate(self.users) if users == 0]
            slot = min(idle, key=self._idle_since.__getitem__)
            self.holds[slot] = lora
        self.users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """A request of slot `slot` stopped running (-1: it had none)."""
        if slot < 0:
            return
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle_since[slot] = next(self._clock)

    def running_names(self) -> tuple[str, ...]:
        """The names of the adapters running requests use."""
        return tuple(sorted(held.lora_name for held, users in zip(self.holds, self.users)
                            if users))
