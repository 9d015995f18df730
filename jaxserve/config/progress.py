"""Progress of long start-up work (weight loading, compiling buckets): a tqdm bar on a
terminal, log lines in a server.

`jaxserve serve` calls use_log_lines() (and its engine core process inherits it through the
environment): a server's log, read by a log pipeline or `kubectl logs`, then holds lines such
as `INFO ... jaxserve.config.progress: Loading weights: 120/291 tensors (41%), 3.2 s` at most every
few seconds and when done, instead of bar redraws in another format.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

_MODE_ENV = "JAXSERVE_PROGRESS"
_LOG_EVERY_S = 5.0


def use_log_lines() -> None:
    """From now on (in this process and the ones it starts) progress goes to the log."""
    os.environ[_MODE_ENV] = "log"


def progress(iterable=None, *, total: int | None = None, desc: str, unit: str = "it",
             unit_scale: bool = False):
    """A tqdm bar, or a LogProgress after use_log_lines(): either iterates over iterable
    (counting each item) or counts update(n) calls up to total; a context manager.
    unit_scale: the bar shows 1.2G for 1.2e9 (bytes)."""
    if os.environ.get(_MODE_ENV) == "log":
        return LogProgress(iterable, total=total, desc=desc, unit=unit)
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale)


class LogProgress:
    """tqdm's counting surface (update, n, close, iteration, with), written as log lines."""

    def __init__(self, iterable=None, *, total: int | None, desc: str, unit: str) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.start = self._last = time.monotonic()
        self._closed = False

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= _LOG_EVERY_S and self.n != self.total:
            self._last = now
            self._log("")

    def refresh(self) -> None:
        """(tqdm's: redraw after setting n) a line when one is due."""
        self.update(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._log(", done")

    def _log(self, end: str) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        logger.info("%s: %d%s %s%s, %.1f s%s", self.desc, self.n, of, self.unit, share,
                    time.monotonic() - self.start, end)
