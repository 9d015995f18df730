"""Which of a step's n-gram proposals to verify (host only, numpy-free).

Verifying a proposal costs the tokens it adds to the step; it pays only when it is kept. A
step is padded to a token bucket, so the choice is one of buckets: for each bucket the step
could use, keep the proposals most likely to be kept that fit in it, and pick the bucket with
the most expected tokens per second of measured step time. Where a step is bound by reading
the weights (few sequences, an accelerator), a bigger bucket costs little and every proposal
is verified; where it is bound by arithmetic (many sequences, a CPU), each verified token
costs what a decoded one does and the proposals go.

Expected tokens: a step's plain tokens (decoded or prefilled) count one each; the j-th
proposal of a request counts the chance that it and the ones before it are kept: the
request's own rate of keeping its first proposal (its history, pulled toward the engine's
rate while it has little), times the engine's rate of keeping position i given the ones
before (i = 2..j).

Step times: the engine reports each step's wall time (dispatch to results) by token bucket;
a bucket's time is a moving average, its first step (which may have compiled it) left out.
A bucket not measured yet is assumed to cost what the nearest measured smaller one does, or
the nearest measured bigger one scaled down by size: the cheapest it could be, so it is
tried and measured. Before any step is measured, proposals fill the step's token bucket up
to its boundary but never into a bigger bucket they would leave padded.
"""

from __future__ import annotations

import bisect

from jaxserve.core.spec_decode import SpecDecodeStats

SMOOTHING = 0.3  # weight of a new step time in its bucket's moving average
PRIOR_DRAFTS = 4  # a request's first-proposal rate counts the engine's as this many drafts


class StepTimes:
    """Measured wall time of a step per token bucket."""

    def __init__(self, buckets: tuple[int, ...]):
        self.buckets = tuple(sorted(buckets))
        self._seen: set[int] = set()
        self._seconds: dict[int, float] = {}

    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket that holds num_tokens (the largest, past it)."""
        index = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[min(index, len(self.buckets) - 1)]

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step padded to num_tokens took `seconds` from dispatch to results."""
        if num_tokens not in self._seen:  # its first run may include compiling it
            self._seen.add(num_tokens)
            return
        old = self._seconds.get(num_tokens)
        self._seconds[num_tokens] = seconds if old is None else (
            (1 - SMOOTHING) * old + SMOOTHING * seconds)

    @property
    def measured(self) -> bool:
        return bool(self._seconds)

    def estimate(self, bucket: int) -> float:
        """The bucket's time, or the cheapest guess from its measured neighbours (see the
        module docstring). Needs at least one measured bucket."""
        if bucket in self._seconds:
            return self._seconds[bucket]
        smaller = [b for b in self._seconds if b < bucket]
        if smaller:
            return self._seconds[max(smaller)]
        bigger = min(b for b in self._seconds if b > bucket)
        return self._seconds[bigger] * bucket / bigger


def keep_rate(stats: SpecDecodeStats, position: int) -> float:
    """P(the proposal at `position` is kept | the ones before it were), over the engine's
    verified drafts, with one kept and one rejected assumed."""
    return (stats.accepted_per_pos[position] + 1) / (stats.reached_per_pos[position] + 2)


def expected_gains(stats: SpecDecodeStats, drafts: int, first_kept: int,
                   count: int) -> list[float]:
    """Expected kept tokens from each of a request's `count` proposals (decreasing), from
    its history: `drafts` verified, of which `first_kept` kept the first proposal."""
    prior = keep_rate(stats, 0)
    gain = (first_kept + PRIOR_DRAFTS * prior) / (drafts + PRIOR_DRAFTS)
    gains = []
    for position in range(count):
        if position:
            gain *= keep_rate(stats, position)
        gains.append(gain)
    return gains


def proposals_to_keep(plain_tokens: int, floor: int, gains: list[list[float]],
                      times: StepTimes, room: int | None = None) -> list[int]:
    """How many proposals each request keeps (its first ones, at most `room` in all), given
    the step's tokens without proposals, the token bucket it needs without them (`floor`:
    its rows may need more than its tokens do) and each request's expected gains
    (decreasing; `gains[i]` has one entry per proposal of request i)."""
    proposed = sum(len(g) for g in gains)
    if room is not None:
        proposed = min(proposed, room)
    if proposed <= 0:
        return [0] * len(gains)
    # Every proposal, most likely first; a request's own proposals stay in order.
    order = sorted(((-g, position, i) for i, row in enumerate(gains)
                    for position, g in enumerate(row)))
    candidates = {min(b - plain_tokens, proposed) for b in times.buckets
                  if b >= floor} | {0}
    if times.measured:
        best, best_rate = 0, -1.0
        prefix, taken = 0.0, 0
        for count in sorted(candidates):
            while taken < count:
                prefix -= order[taken][0]
                taken += 1
            step = max(times.bucket(plain_tokens + count), floor)
            rate = (plain_tokens + prefix) / max(times.estimate(step), 1e-9)
            if rate >= best_rate:  # ties: the more proposals
                best, best_rate = count, rate
    else:  # nothing measured: fill the plain step's bucket, or end at a bucket boundary
        filled = [b for b in times.buckets if b <= plain_tokens + proposed]
        best = max(0, min(max(filled[-1] if filled else 0, floor) - plain_tokens, proposed))
    keep = [0] * len(gains)
    for _, _, i in order[:best]:
        keep[i] += 1
    return keep
