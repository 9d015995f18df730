"""What the engine reports for a user request: its children's state as a RequestOutput.

TrackedRequest groups the sequences (children) of one user request (n > 1 makes several)
with their detokenizers, prompt logprobs and failure; OutputBuilder turns it into vLLM's
RequestOutput, and builds the logprob entries the step results become.
"""

from __future__ import annotations

import dataclasses
import functools

from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    Snapshot,
)


@dataclasses.dataclass
class TrackedRequest:
    """One user request: its children sequences and what has been reported."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    prompt_logprobs: list | None
    error: str | None = None  # set when the engine failed this request
    error_param: str | None = None  # the request field at fault (RequestOutput.error_param)
    # Per child, per output token {token_id: Logprob} (chosen + top-k), when asked for.
    logprobs: list[list[dict]] = dataclasses.field(default_factory=list)
    metrics: RequestMetrics | None = None  # once every child has been scheduled
    # A pooling request: its settings (PoolingParams), and its output f32[X] once finished.
    pooling: object | None = None
    pooled: object | None = None
    lora: object | None = None  # its LoRA adapter (a LoRARequest), as its outputs report

    def __post_init__(self) -> None:
        self.logprobs = self.logprobs or [[] for _ in self.children]

    @property
    def finished(self) -> bool:
        children = self.children
        return children[0].finished if len(children) == 1 else all(
            c.finished for c in children)


def track(request, children: list[Request], tokenizer) -> TrackedRequest:
    """A TrackedRequest for an admitted request (admission.EngineRequest) and its children,
    each with a detokenizer of its own."""
    params = request.params
    if request.pooling is not None:  # no text: its output is a vector
        return TrackedRequest(request.request_id, request.prompt, request.prompt_token_ids,
                              params, children, [], None, pooling=request.pooling)
    detoks = [IncrementalDetokenizer(
        tokenizer, request.prompt_token_ids, stop=params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens)
        for _ in children]
    return TrackedRequest(request.request_id, request.prompt, request.prompt_token_ids,
                          params, children, detoks,
                          [None] if params.prompt_logprobs is not None else None,
                          lora=request.lora)


class OutputBuilder:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # A token's text for logprob entries (up to 21 per sampled token), cached.
        self._decode_one = functools.lru_cache(maxsize=65536)(self._decode_token)

    def record_prompt_logprobs(self, tracked: TrackedRequest, req: Request, start: int,
                               first: int, count: int, scores) -> None:
        """Append the prompt logprobs of the positions a step computed (req's positions
        first .. first + count - 1, at rows start.. of scores) that are not recorded yet."""
        k = tracked.params.prompt_logprobs
        have = len(tracked.prompt_logprobs)  # positions 0..have-1 are done
        for pos in range(max(first, have - 1), min(first + count, req.num_prompt_tokens - 1)):
            i = start + pos - first
            target = int(req.token_ids[pos + 1])
            tracked.prompt_logprobs.append(self.logprob_dict(
                target, float(scores.logprobs[i]), int(scores.ranks[i]),
                scores.top_ids[i][:k], scores.top_logprobs[i][:k]))

    def logprob_dict(self, token, logprob, rank, top_ids, top_logprobs) -> dict[int, Logprob]:
        entries = {int(t): Logprob(float(lp), r + 1, self._decode_one(int(t)))
                   for r, (t, lp) in enumerate(zip(top_ids, top_logprobs))}
        if token not in entries:
            entries = {token: Logprob(logprob, rank, self._decode_one(token)), **entries}
        return entries

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def make_output(self, tracked: TrackedRequest) -> RequestOutput:
        """The request's output now. Its cost does not grow with the output's length while
        it runs: token ids and logprobs are Snapshots, and only new tokens are
        detokenized. A pooling request's is a PoolingRequestOutput."""
        if tracked.pooling is not None:
            return self.pooling_output(tracked)
        completions = []
        for i, (child, detok) in enumerate(zip(tracked.children, tracked.detokenizers)):
            finished = child.finished
            if not detok.checks_stop_strings:
                _catch_up(child, detok)
            logprobs = cumulative = None
            if child.params.logprobs is not None:
                entries, cumulative = tracked.logprobs[i], child.cumulative_logprob
                logprobs = list(entries) if finished else Snapshot(entries, len(entries))
            # Safe text: while running, the tail that could still become a stop string (or
            # an incomplete character) is held back, so streamed deltas never retract.
            text = detok.get_next_output_text(finished=finished, delta=False)
            count = child.num_tokens - child.num_prompt_tokens
            if finished:
                token_ids, reason = child.output_view[:count].tolist(), child.status.value
            else:
                token_ids, reason = Snapshot(child.output_view, count), None
            completions.append(CompletionOutput(i, text, token_ids, cumulative, logprobs,
                                                reason, child.stop_reason))
        # Prompt tokens served from the prefix cache, for the first choice (with n > 1 the
        # other choices usually hit the blocks the first one computed).
        cached = tracked.children[0].num_cached_tokens or 0
        return RequestOutput(tracked.request_id, tracked.prompt, tracked.prompt_token_ids,
                             tracked.prompt_logprobs, completions, tracked.finished,
                             num_cached_tokens=cached, metrics=_metrics(tracked),
                             lora_request=tracked.lora)

    def pooling_output(self, tracked: TrackedRequest) -> PoolingRequestOutput:
        """A pooling request's output: its vector once finished."""
        data = None if tracked.pooled is None else PoolingOutput(tracked.pooled)
        return PoolingRequestOutput(tracked.request_id, data, tracked.prompt_token_ids,
                                    tracked.finished, tracked.children[0].num_cached_tokens or 0,
                                    tracked.prompt, _metrics(tracked), tracked.error,
                                    tracked.error_param)

    def step_outputs(self, changed, failed: list[TrackedRequest], fail, final_only: bool,
                     wanted) -> list[RequestOutput]:
        """What a step reports (LLMEngine.step, EngineCoreClient.step): the outputs of the
        changed requests (with final_only, of those that finished; with wanted, of those it
        accepts and those that finished), then an error output for each failed one.
        fail(tracked, err): a request whose output could not be built fails (it joins
        `failed`)."""
        outputs = []
        for tracked in changed:
            if tracked.error is not None:
                continue  # failed after its tokens came: reported with the failures
            if (final_only or wanted is not None and not wanted(tracked.request_id)) and \
                    not tracked.finished:
                continue
            try:
                output = self.make_output(tracked)
            except Exception as err:  # noqa: BLE001 - this request's output only
                fail(tracked, err)
                continue
            if not final_only or output.finished:
                outputs.append(output)
        return outputs + [self.error_output(t) for t in failed]

    def error_output(self, tracked: TrackedRequest) -> RequestOutput:
        """The last output of a failed request: every choice ends with "error", with the
        tokens it had (no text: the detokenizer may be what failed)."""
        if tracked.pooling is not None:
            return dataclasses.replace(self.pooling_output(tracked), outputs=None,
                                       finished=True)
        completions = [CompletionOutput(i, "", child.output_token_ids, None, None, "error")
                       for i, child in enumerate(tracked.children)]
        return RequestOutput(tracked.request_id, tracked.prompt, tracked.prompt_token_ids,
                             None, completions, True, error=tracked.error,
                             error_param=tracked.error_param, lora_request=tracked.lora)


def _metrics(tracked: TrackedRequest) -> RequestMetrics:
    metrics = tracked.metrics
    if metrics is None:  # kept once every choice has been scheduled: it cannot change
        scheduled = [c.scheduled_time for c in tracked.children if c.scheduled_time is not None]
        metrics = RequestMetrics(tracked.children[0].arrival_time,
                                 min(scheduled) if scheduled else None)
        if len(scheduled) == len(tracked.children):
            tracked.metrics = metrics
    return metrics


def _catch_up(child: Request, detok: IncrementalDetokenizer) -> None:
    """Hand a detokenizer without stop strings the tokens its sequence got since its text
    was last read (the engine feeds those with stop strings token by token), in one
    update: the text does not depend on how tokens are grouped."""
    have = detok.num_tokens
    if have >= child.num_output_tokens:
        return
    new = child.token_ids[child.num_prompt_tokens + have: child.num_tokens].tolist()
    # A stop token id or EOS that ended the sequence is not part of its text.
    detok.extend(new, stop_terminated=child.ended_by_token(new[-1]), check_stop=False)


def match_stop_strings(tracked: TrackedRequest, req: Request,
                       tokens: list[int]) -> tuple[str, int] | None:
    """Feed a sequence's new tokens (one, or a speculative step's several) to its
    detokenizer one by one, looking for its stop strings. The first match, as (the stop
    string, how many of the tokens come after the one that completed it; the engine drops
    those, as if never sampled, and their logprob entries are dropped here), or None."""
    child = tracked.children.index(req)
    detok = tracked.detokenizers[child]
    for i, token in enumerate(tokens):
        later = len(tokens) - 1 - i
        # The token itself ended the request (EOS, a stop token id): its text is not shown.
        # A grammar that reached its end also stops the request, after a token that is.
        stop_str = detok.update(
            [token], stop_terminated=not later and req.ended_by_token(token),
            check_stop=req.num_output_tokens - later > req.params.min_tokens)
        if stop_str is None:
            continue
        if later and req.params.logprobs is not None:
            entries = tracked.logprobs[child]
            for token_id, entry in zip(tokens[i + 1:], entries[-later:]):
                req.cumulative_logprob -= entry[token_id].logprob
            del entries[-later:]
        return stop_str, later
    return None
