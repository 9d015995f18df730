"""Multi-host serving: every host runs the same device steps; host 0 owns the scheduler.

`jaxserve serve --coordinator HOST:PORT --num-hosts N --host-id I` (or JAX's own
environment, e.g. on a Cloud TPU pod slice where jax.distributed finds everything itself)
joins the N processes with jax.distributed. The mesh then spans every host's devices. Host 0
runs the engine (scheduler, detokenizer, HTTP server); every other host runs
`backends.selection.run_worker`: it builds the same runner (weights load on each host from its own copy of the model folder,
each device taking its slice) and then, step after step, receives the step host 0 is about
to run (its (T, R) bucket, the packed int32 inputs, the prompt-scoring targets) and runs the
same compiled function on them, so the collectives inside the step line up on all hosts.

The inputs travel by StepChannel: a fixed-size header, then the buffers it announces, each
sent with multihost_utils.broadcast_one_to_all (a collective on the devices themselves).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

_STOP, _STEP = 0, 1


def initialize(coordinator: str | None, num_hosts: int | None, host_id: int | None) -> None:
    """Join the hosts (before anything touches a JAX backend). With no arguments, JAX reads
    its environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a
    TPU pod's metadata)."""
    given = [coordinator is not None, num_hosts is not None, host_id is not None]
    if any(given) and not all(given):
        raise ValueError("multi-host needs all of --coordinator HOST:PORT, --num-hosts N and "
                         "--host-id I (or none of them, to let JAX read its environment).")
    if num_hosts is not None and not 0 <= host_id < num_hosts:
        raise ValueError(f"--host-id must be in [0, {num_hosts}), got {host_id}.")
    # CPU hosts need gloo for cross-process collectives; accelerators ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_hosts,
                               process_id=host_id)
    logger.info("Host %d of %d joined; %d devices in all, %d here.", jax.process_index(),
                jax.process_count(), jax.device_count(), jax.local_device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


class StepChannel:
    """Host 0 -> all hosts: each step's bucket and inputs, or the order to stop."""

    def send(self, num_tokens: int, num_rows: int, packed: np.ndarray,
             targets: np.ndarray | None, bias_rows: list[tuple[int, np.ndarray]],
             grammar_rows: list[tuple[int, np.ndarray]]) -> None:
        """bias_rows: [(sampler row, f32[V])]; grammar_rows: [(sampler row, i32[W])]: the
        sampler-state rows to write before the step."""
        header = [_STEP, num_tokens, num_rows, packed.size,
                  -1 if targets is None else targets.size]
        for rows in (bias_rows, grammar_rows):
            header += [len(rows), rows[0][1].size if rows else 0]
        self._broadcast(np.array(header, np.int32))
        self._broadcast(packed)
        if targets is not None:
            self._broadcast(targets)
        for rows in (bias_rows, grammar_rows):
            if rows:
                self._broadcast(np.array([row for row, _ in rows], np.int32))
                self._broadcast(np.stack([values for _, values in rows]))

    def send_stop(self) -> None:
        self._broadcast(np.array([_STOP, 0, 0, 0, -1, 0, 0, 0, 0], np.int32))

    def receive(self):
        """(num_tokens, num_rows, packed i32[X], targets i32[T] or None, bias rows, grammar
        rows), or None: stop."""
        header = self._broadcast(np.zeros(9, np.int32))
        kind, num_tokens, num_rows, size, num_targets = header[:5]
        if kind == _STOP:
            return None
        packed = self._broadcast(np.zeros(size, np.int32))
        targets = self._broadcast(np.zeros(num_targets, np.int32)) if num_targets >= 0 else None
        row_sets = []
        for (count, width), dtype in zip((header[5:7], header[7:9]), (np.float32, np.int32)):
            rows = []
            if count:
                ids = self._broadcast(np.zeros(count, np.int32))
                values = self._broadcast(np.zeros((count, width), dtype))
                rows = list(zip(ids.tolist(), values))
            row_sets.append(rows)
        return int(num_tokens), int(num_rows), packed, targets, *row_sets

    def share(self, value: int) -> int:
        """Host 0's value of an integer, on every host (e.g. the KV block count)."""
        return int(self._broadcast(np.array([value], np.int64))[0])

    @staticmethod
    def _broadcast(array: np.ndarray) -> np.ndarray:
        return np.asarray(multihost_utils.broadcast_one_to_all(array))

