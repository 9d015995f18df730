"""Counts XLA compilations in this process, times the runner's compiles, and sets up JAX's
persistent compilation cache.

Every backend compilation (including a load from the persistent cache) fires JAX's
backend-compile monitoring event; counting those catches any stray recompilation, not just
the runner's own buckets. The runner reports each function it builds (trace, lower and
compile) through record_compile; /metrics shows both (server/metrics.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

logger = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _on_event(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def install_counter() -> None:
    global _installed
    import jax  # here, not at import: /metrics reads the counts without jax

    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _installed = True


def compilation_count() -> int:
    """Number of XLA compilations since install_counter() (process-wide)."""
    return _count


COMPILE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


@dataclasses.dataclass
class CompileTimes:
    """A histogram of one kind of compile's seconds (cumulative bucket counts, as
    Prometheus wants them)."""

    buckets: list[int] = dataclasses.field(default_factory=lambda: [0] * len(COMPILE_BUCKETS))
    count: int = 0
    total: float = 0.0


_times: dict[str, CompileTimes] = {}
COMPILE_KINDS = ("step", "score")  # the runner's functions
_loads = 0


def record_compile(kind: str, seconds: float) -> None:
    """One function of `kind` (step, score) traced, lowered and compiled in `seconds`."""
    with _lock:
        times = _times.setdefault(kind, CompileTimes())
        times.count += 1
        times.total += seconds
        for i, bound in enumerate(COMPILE_BUCKETS):
            if seconds <= bound:
                times.buckets[i] += 1


def record_load() -> None:
    """One function loaded from the executable cache instead of compiled."""
    global _loads
    with _lock:
        _loads += 1


def executable_loads() -> int:
    return _loads


def compile_times() -> dict[str, CompileTimes]:
    """A copy of the compile histograms so far, by kind."""
    with _lock:
        times = {kind: dataclasses.replace(t, buckets=list(t.buckets))
                 for kind, t in _times.items()}
    for kind in COMPILE_KINDS:  # shown at zero when everything came from the cache
        times.setdefault(kind, CompileTimes())
    return times


@dataclasses.dataclass(frozen=True)
class CompileRecords:
    """This process's compile records at one time (what /metrics shows): XLA compilations,
    executable-cache loads, and compile times by kind."""

    compilations: int = 0
    executable_loads: int = 0
    times: dict = dataclasses.field(default_factory=dict)  # kind -> CompileTimes


def compile_records() -> CompileRecords:
    """A snapshot of this process's records."""
    return CompileRecords(compilation_count(), executable_loads(), compile_times())


def enable_persistent_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache in `directory`, for multi-host runs (one process
    uses the runner's executable cache instead, which skips tracing too). None leaves JAX's
    setting alone."""
    import jax

    if not directory:
        return
    if jax.config.jax_compilation_cache_dir not in (None, directory):
        return  # the user configured JAX's cache themselves
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.info("Persistent XLA compilation cache: %s", directory)
