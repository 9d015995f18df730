"""The engine's throughput line, every few seconds (vLLM's "Avg prompt throughput: ..."), and
the speculative-decoding line for the same interval; off with --disable-log-stats."""

from __future__ import annotations

import logging
import time

from jaxserve.engine.stats import EngineStats

logger = logging.getLogger("jaxserve.server.async_engine")

LOG_INTERVAL_S = 10.0


class StatsLog:
    """What the last line said, so that the next one reports the interval since."""

    def __init__(self, compilations: int) -> None:
        self._last_log = time.monotonic()
        self._logged_tokens = (0, 0)
        self._logged_compiles = compilations
        self._logged_spec = (0, 0, 0)  # speculative decoding: drafts, proposed, accepted

    def maybe_log(self, stats: EngineStats, metrics) -> None:
        """The lines, once LOG_INTERVAL_S has passed since the last (metrics: the server's
        EngineMetrics, whose token totals give the throughput)."""
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S:
            return
        prompt, gen = metrics.token_totals()
        elapsed = now - self._last_log
        compiles = stats.compilations
        compiled = compiles - self._logged_compiles
        busy = stats.running or stats.waiting
        if (prompt, gen) != self._logged_tokens or busy or compiled:
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
                        "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache "
                        "usage: %.1f%%, Prefix cache hit rate: %.1f%%%s",
                        (prompt - self._logged_tokens[0]) / elapsed,
                        (gen - self._logged_tokens[1]) / elapsed, stats.running,
                        stats.waiting, 100 * stats.kv_usage,
                        100 * stats.prefix_cache_hit_rate,
                        f", XLA compilations: {compiled}"
                        f"{'' if stats.warm_up_done else ' (warm-up running)'}"
                        if compiled else "")
        spec = (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens)
        drafts, proposed, accepted = (a - b for a, b in zip(spec, self._logged_spec))
        if drafts:  # vLLM's SpecDecoding line, for the same interval
            logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d "
                        "tokens, Drafted: %d tokens, Acceptance rate: %.1f%%",
                        1 + accepted / drafts, accepted, proposed, 100 * accepted / proposed)
        self._logged_spec = spec
        self._logged_tokens = (prompt, gen)
        self._logged_compiles = compiles
        self._last_log = now
