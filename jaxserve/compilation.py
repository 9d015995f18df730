"""Counts XLA compilations in this process, and sets up JAX's persistent compilation cache.

Every backend compilation (including a load from the persistent cache) fires JAX's
backend-compile monitoring event; counting those catches any stray recompilation, not just
the runner's own buckets.
"""

from __future__ import annotations

import logging
import threading

import jax

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
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _installed = True


def compilation_count() -> int:
    """Number of XLA compilations since install_counter() (process-wide)."""
    return _count


def enable_persistent_cache(directory: str | None) -> None:
    """Reuse compiled executables across processes (start-up drops from seconds per bucket to
    a file read). None leaves JAX's setting alone."""
    if not directory:
        return
    if jax.config.jax_compilation_cache_dir not in (None, directory):
        return  # the user configured JAX's cache themselves
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.info("Persistent XLA compilation cache: %s", directory)
