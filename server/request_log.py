"""--enable-log-requests: a line per request received (prompt, parameters) and finished
(tokens, time to first token, finish reason; with --enable-log-outputs the text), prompts and
outputs cut to --max-log-len."""

from __future__ import annotations

import logging

logger = logging.getLogger("jaxserve.server.requests")


def _cut(value, limit: int | None):
    return value if limit is None else value[:limit]


def log_received(request_id: str, prompts, params, max_log_len: int | None) -> None:
    """prompts: (text or None, token ids) per prompt."""
    for text, ids in prompts:
        shown = repr(_cut(text, max_log_len)) if text is not None else \
            f"ids {list(_cut(ids, max_log_len))}"
        logger.info("Received request %s: prompt %s (%d tokens), params %s",
                    request_id[:300], shown, len(ids), params)


def log_finished(output, num_prompt_tokens: int, num_tokens: int, ttft: float, total: float,
                 outputs: bool, max_log_len: int | None) -> None:
    choices = output.outputs if isinstance(output.outputs, list) else []  # (pooling: none)
    reasons = ",".join(sorted({c.finish_reason or "abort" for c in choices}
                              or {output.finish_reason or "abort"}))
    logger.info("request %s: prompt %d tokens, output %d tokens, TTFT %.3f s, total %.3f s, "
                "finish %s", output.request_id, num_prompt_tokens, num_tokens, ttft, total,
                reasons)
    if outputs:
        for choice in choices:
            logger.info("request %s: output %d: %r", output.request_id, choice.index,
                        _cut(choice.text, max_log_len))
