"""Pooling requests on the host: which hidden states a step pools for each row, what the
rows' results add to their requests, and a request's output once its prompt is done.

A pooling request is a Request (core/request.py) with `pooling` set to its PoolingState. It
is scheduled like any prompt (chunked prefill, prefix hits, preemption); its last chunk's
row samples a token like any prompt's end, which is never appended: when that step is
folded in, the request's pooled state is finished (normalized, truncated or passed through
the classifier's activation) and the scheduler finishes the request, freeing its blocks.

The device returns, per row of a step, one f32 vector (the runner's pooling function:
backends/jax/runner.py, backends/torch/runner.py), from pool_inputs' i32[T + R]:
- MEAN: entry t < T names the row whose sum token t joins (R: none, a padding token); the
  device sums each row's tokens, and the host adds each chunk's sum until the prompt ends,
  then divides by its length. A chunk that starts at position 0 starts the sum over (a
  request preempted or recomputed runs its prompt again);
- LAST: entry T + r is the index of row r's last token (read in the row that ends the
  prompt); CLS: the index of its first token (read in the row that starts at position 0).
With a classification head the device applies it to each row's vector (linear, no bias:
a sum of hidden states gives the sum of their logits).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.request import RequestStatus
from jaxserve.core.scheduler_output import SchedulerOutput


@dataclasses.dataclass
class PoolingState:
    """One pooling request's progress: its settings, what is pooled so far, the output."""

    params: PoolingParams  # resolved against the engine's pooler (PoolingParams.resolve)
    pooling_type: str  # LAST | MEAN | CLS (config.pooler.POOLING_TYPES)
    task: str  # the engine's: "embed" | "classify"
    pooled: np.ndarray | None = None  # f32[X]: MEAN's sum so far, LAST's or CLS's vector
    count: int = 0  # prompt tokens in MEAN's sum
    result: np.ndarray | None = None  # f32[X'], the output once the prompt is done

    @property
    def reads_all_tokens(self) -> bool:
        """MEAN and CLS need every position's hidden state: no prefix-cache hits."""
        return self.pooling_type != "LAST"


def pool_inputs(out: SchedulerOutput, num_tokens: int, num_rows: int,
                pooling_type: str) -> np.ndarray | None:
    """The step's i32[T + R] pooling inputs (see the module docstring), or None when no row
    pools anything in this step (LAST: no row ends its prompt; CLS: none starts at 0)."""
    rows = np.full(num_tokens + num_rows, num_rows, np.int32)
    rows[num_tokens:] = 0
    wanted = False
    start = 0
    for r, (req, first, count, samples) in enumerate(zip(
            out.requests, out.num_computed_tokens, out.num_scheduled_tokens, out.samples)):
        if req.pooling is not None:
            if pooling_type == "MEAN":
                rows[start: start + count] = r
                wanted = True
            elif pooling_type == "LAST" and samples:
                rows[num_tokens + r] = start + count - 1
                wanted = True
            elif pooling_type == "CLS" and first == 0:
                rows[num_tokens + r] = start
                wanted = True
        start += count
    return rows if wanted else None


def fold_pooled(scheduler, out: SchedulerOutput, pooled: np.ndarray | None):
    """A step's pooled rows (f32[R, X]) into their requests; each request whose prompt the
    step ended gets its output (PoolingState.result) and is finished by the scheduler.
    Rows of requests that stopped running since the step was scheduled are dropped.
    Returns ([(request, row, 0)] finished, [(request, error)] whose output failed)."""
    done, failed = [], []
    for r, (req, first, count, samples) in enumerate(zip(
            out.requests, out.num_computed_tokens, out.num_scheduled_tokens, out.samples)):
        state = req.pooling
        if state is None or req.status is not RequestStatus.RUNNING:
            continue
        kind = state.pooling_type
        if kind == "MEAN":
            if first == 0:
                state.pooled, state.count = None, 0
            row = pooled[r].astype(np.float32)
            state.pooled = row if state.pooled is None else state.pooled + row
            state.count += count
        elif (kind == "LAST" and samples) or (kind == "CLS" and first == 0):
            state.pooled = pooled[r].astype(np.float32, copy=True)
        if not samples:
            continue
        try:
            state.result = finish(state, req.num_prompt_tokens)
        except Exception as err:  # noqa: BLE001 - this request only
            failed.append((req, err))
            continue
        scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        done.append((req, r, 0))
    return done, failed


def finish(state: PoolingState, num_prompt_tokens: int) -> np.ndarray:
    """The output of a request whose prompt is pooled: f32[D'] (an embedding: mean taken,
    truncated to dimensions, L2-normalized) or f32[L] (a classification: probabilities, or
    logits without activation)."""
    if state.pooled is None:
        raise RuntimeError("the request's prompt ended before its pooled state was read")
    vector = state.pooled
    if state.pooling_type == "MEAN":
        if state.count != num_prompt_tokens:
            raise RuntimeError(f"mean pooling summed {state.count} of the prompt's "
                               f"{num_prompt_tokens} tokens")
        vector = vector / np.float32(num_prompt_tokens)
    params = state.params
    if state.task == "embed":
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if params.normalize:
            vector = normalize(vector)
    elif params.use_activation:
        vector = activation(vector)
    return np.ascontiguousarray(vector, dtype=np.float32)


def normalize(vector: np.ndarray) -> np.ndarray:
    """L2-normalized (as torch.nn.functional.normalize: eps 1e-12)."""
    return vector / max(float(np.linalg.norm(vector)), 1e-12)


def activation(logits: np.ndarray) -> np.ndarray:
    """A classifier's probabilities: sigmoid for one label (a cross-encoder's score),
    softmax over several."""
    if logits.shape[-1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)
