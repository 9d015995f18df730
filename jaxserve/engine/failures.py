"""How the engine keeps one request from stopping it (LLMEngine's failure isolation: the
FailureIsolation the engine holds, LLMEngine.failures).

When preparing, running or reading a step raises, the engine finds the request(s) that
caused it and fails only those (finish_reason "error", RequestOutput.error says why),
freeing their blocks:
- a step that cannot be dispatched is dispatched again one request at a time, at once
  (nothing ran on the device); a request that fails alone is the culprit;
- a step that fails on the device has unknown effects on the device state of its requests:
  they are recomputed from scratch, each in a step of its own (suspects), and a suspect
  whose own step fails is the culprit;
- a failure while reading one request's results, detokenizing it or building its output
  fails that request; so does a structured output's grammar that gives up (its mask, or a
  token it cannot take: fail_masks, advance_grammar).
After a culprit's step failed, an empty step checks the device; only when that fails too (an
error that persists with no request in it: the device is lost) does step() raise
EngineDeadError.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.structured_output import describe_error

if TYPE_CHECKING:
    from jaxserve.backends.protocol import Runner
    from jaxserve.core.scheduler import Scheduler
    from jaxserve.engine.output_processor import TrackedRequest

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine can no longer run steps: a step with no request in it failed too."""


class FailureIsolation:
    """LLMEngine's failure handling: it fails requests through the engine's scheduler, checks
    the device through its runner, and finds a child's request in the engine's by_child map
    (child id -> TrackedRequest, the engine's own dict, shared). Its own state: the children
    that run alone (suspects: child id -> the computed length up to which it does), the
    requests failed since step() last returned (failed), and the failure that makes the
    next step() check the device (device_failure)."""

    def __init__(self, scheduler: Scheduler, runner: Runner,
                 by_child: dict[str, TrackedRequest]) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.by_child = by_child
        # Children whose step failed on the device -> the computed length up to which they
        # run alone (the end of that step): a culprit fails alone before it catches up.
        self.suspects: dict[str, int] = {}
        self.failed: list[TrackedRequest] = []  # failed since the last step() returned
        self.device_failure: BaseException | None = None  # a culprit's step failed

    # ---- what the engine asks ---------------------------------------------------------
    def take_failed(self) -> list[TrackedRequest]:
        """The requests failed since the last call (each reported once), then none."""
        failed, self.failed = self.failed, []
        return failed

    @property
    def has_suspects(self) -> bool:
        """Whether some child runs alone (then steps are synchronous)."""
        return bool(self.suspects)

    def is_suspect(self, request_id: str) -> bool:
        """Whether this child runs in a step of its own."""
        return request_id in self.suspects

    def clear_caught_up(self, out: SchedulerOutput) -> None:
        """After step `out` ran: a suspect that ran alone up to its failed step is cleared."""
        for req, first, count in zip(out.requests, out.num_computed_tokens,
                                     out.num_scheduled_tokens):
            if first + count >= self.suspects.get(req.request_id, 0):
                self.suspects.pop(req.request_id, None)

    def forget(self, tracked: TrackedRequest) -> None:
        """A request the engine no longer tracks: its children are no longer suspects."""
        for child in tracked.children:
            self.suspects.pop(child.request_id, None)

    # ---- failing requests -------------------------------------------------------------
    def fail_all(self, tracked_requests: list[TrackedRequest], err: Exception) -> None:
        """The engine failed outside any one request: fail every request (the engine drops
        its steps in flight first); the next step() checks the device."""
        logger.error("The engine failed outside any one request (%s): failing all %d "
                     "requests", describe(err), len(tracked_requests), exc_info=err)
        for tracked in tracked_requests:
            self.fail(tracked, err, "in the engine", log=False)
        self.device_failure = err

    def fail_masks(self, broken: list[Request]) -> None:
        """Fail the requests whose structured output's next-token mask ran past its budget."""
        for req in broken:
            logger.info("Request %s failed: its structured output's next-token mask could not "
                        "be computed within the per-step budget", req.request_id[:64])
            self.fail(self.by_child[req.request_id], RuntimeError(
                f"the grammar's next-token mask ran past its per-step budget: "
                f"{describe_error(req.grammar.get_error())}"), "while computing its "
                "structured output's next-token mask", log=False, param="structured_outputs")

    def advance_grammar(self, tracked: TrackedRequest, req: Request, token: int) -> bool:
        """Feed a sampled token to the request's grammar; a grammar that has reached its end
        finishes the request ("stop"). False (the request failed) if the grammar refuses
        the token, which the step's mask should have made impossible."""
        if req.grammar_waits_for is not None:  # free text (reasoning) until its end token
            if token == req.grammar_waits_for:
                req.grammar_waits_for = None
            return True
        if not req.grammar.consume_token(token):
            logger.info("Request %s failed: its structured output's grammar gave up at a "
                        "token (over its per-step budget)", tracked.request_id[:64])
            self.fail(tracked, RuntimeError(
                f"the grammar gave up at the output's token {req.num_output_tokens} (its "
                f"lexer or parser ran past its per-step budget): "
                f"{describe_error(req.grammar.get_error())}"),
                "while matching its structured output", log=False, param="structured_outputs")
            return False
        if req.grammar.is_stopped() and not req.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        return True

    def step_failed(self, out: SchedulerOutput, err: Exception) -> None:
        """A step failed on the device. What it did to its requests' KV and penalty state is
        unknown, so they are recomputed from scratch, each alone; one that was alone already
        is the culprit."""
        self.scheduler.drop_step(out)
        # Rows of requests that are no longer running (finished, or sent back to be
        # recomputed: the step was launched behind one that had failed already) say nothing.
        live = [(req, first + count) for req, first, count in zip(
            out.requests, out.num_computed_tokens, out.num_scheduled_tokens)
            if req.status is RequestStatus.RUNNING]
        if not live:
            return
        if len(out.requests) == 1:
            self.fail(self.by_child[out.requests[0].request_id], err, "while its step ran",
                      device=True)
            return
        logger.warning("A step of %d requests failed on the device (%s); recomputing each "
                       "alone", len(out.requests), describe(err))
        for req, end in live:
            self.suspects[req.request_id] = end
            self.scheduler.recompute(req)

    def fail(self, tracked: TrackedRequest, err: BaseException, stage: str, *,
             device: bool = False, log: bool = True, param: str | None = None) -> None:
        """End a request with finish_reason "error" and free what it holds. device: the
        error came from its own step on the runner, so the device is checked next. param:
        the request field whose value caused it (the error then says what, and the server
        answers as to a bad request)."""
        if tracked.error is not None:
            return
        if param is not None:
            tracked.error, tracked.error_param = f"{param}: {str(err)[:300]}", param
        else:
            tracked.error = f"the engine failed on this request {stage} ({type(err).__name__})"
        if log:
            logger.error("Request %s failed %s: %s", tracked.request_id, stage,
                         describe(err), exc_info=err)
        for child in tracked.children:
            self.suspects.pop(child.request_id, None)
            if not child.finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ERROR)
        self.failed.append(tracked)
        if device:
            self.device_failure = err

    def check_device(self) -> None:
        """After a culprit's step failed (else nothing): does the device still run an empty
        step? EngineDeadError if not."""
        if self.device_failure is None:
            return
        cause, self.device_failure = self.device_failure, None
        try:
            self.runner.fetch(self.runner.dispatch(SchedulerOutput([], [], [])))
        except Exception as err:  # noqa: BLE001 - reported as the reason the engine died
            raise EngineDeadError(f"the device fails even an empty step: {describe(err)} "
                                  f"(first failure: {describe(cause)})") from err


def describe(err: BaseException) -> str:
    """A one-line, bounded description of an exception (no traceback)."""
    text = str(err).splitlines()[0] if str(err) else ""
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
