"""Builds one step's padded numpy inputs from a SchedulerOutput (host side, numpy only).

Work is per sequence (slices of each request's token and block arrays), never per token in
Python. The arrays are step_fields.STEP_FIELDS (docs/architecture.md's batch layout and
SamplingInputs), padded to the (T, R) bucket the runner picked.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.step_fields import ROW_FIELDS, STEP_FIELDS


def build_step_inputs(out: SchedulerOutput, num_tokens: int, num_rows: int, block_size: int,
                      blocks_per_seq: int, num_groups: int = 1,
                      lora: bool = False) -> tuple[dict, dict]:
    """One step's inputs with a builder of its own (for a step formed by hand, and the
    shapes of a bucket); a runner keeps one StepInputBuilder for all its steps."""
    slots = max((r.state_slot for r in out.requests), default=0)
    return StepInputBuilder(slots, block_size, blocks_per_seq, num_groups, lora).build(
        out, num_tokens, num_rows, refresh=True)


class PackedStep:
    """The arrays of one (T, R) bucket as views of one flat int32 buffer, in packing.py's
    layout (float32 and uint32 bit-cast, bool as int32 0/1): the builder writes the step's
    values into the views, and the buffer is the packed step at once. The buffer is kept
    and reset to the padding values for each step (one copy each way, instead of an array
    per field and a concatenation). Fields, order, dtypes, shapes and padding are
    step_fields.STEP_FIELDS' (the "lora" field only with LoRA adapters)."""

    def __init__(self, num_tokens: int, num_rows: int, blocks_per_seq: int,
                 num_groups: int = 1, lora: bool = False) -> None:
        fields = [f for f in STEP_FIELDS if lora or f.group != "lora"]
        self.layout = tuple((f.name, f.dims(num_tokens, num_rows, blocks_per_seq, num_groups),
                             f.dtype) for f in fields)
        sizes = [int(np.prod(shape)) for _, shape, _ in self.layout]
        self.buffer = np.zeros(sum(sizes), np.int32)
        self.views, offset = {}, 0
        for (name, shape, dtype), size, field in zip(self.layout, sizes, fields):
            part = self.buffer[offset: offset + size]
            view = part if dtype == "bool" else part.view(dtype)
            view[:] = field.pad
            self.views[name] = view.reshape(shape)
            offset += size
        self.template = self.buffer.copy()
        # arrays()' first dict: what the model and the step's feed read.
        self.batch_names = frozenset(f.name for f in fields if f.group in ("batch", "feed"))

    def arrays(self, packed: np.ndarray) -> tuple[dict, dict]:
        """(batch, sampling) arrays with their own dtypes, as views of `packed` (a copy of
        the buffer; bools as new arrays): the "batch" and "feed" fields, then the
        "sampling" and "lora" ones."""
        batch, sampling, offset = {}, {}, 0
        for name, shape, dtype in self.layout:
            size = int(np.prod(shape))
            part = packed[offset: offset + size]
            part = part != 0 if dtype == "bool" else part.view(dtype)
            (batch if name in self.batch_names else sampling)[name] = part.reshape(shape)
            offset += size
        return batch, sampling


# A request's SamplingRow as the builder keeps it by state slot: its float fields in one
# table, the others (integers, flags) in another, stored wide and cast (wrapping) into the
# step's arrays. (Two plain tables: gathering a structured array's rows costs more than
# the rest of a decode step's settings.)
_FLOATS = tuple(i for i, f in enumerate(ROW_FIELDS) if f.dtype == "float32")
_INTS = tuple(i for i, f in enumerate(ROW_FIELDS) if f.dtype != "float32")
_FLOAT_NAMES = tuple(ROW_FIELDS[i].name for i in _FLOATS)
_INT_NAMES = tuple(ROW_FIELDS[i].name for i in _INTS)


class _StepTokens(NamedTuple):
    """Where a step's tokens sit. Per row: its first position, token count, and start and
    end in the T tokens (i32[n]); per token: its row and position (i32[total]); the rows
    of several tokens (a prompt chunk, a token and its proposals)."""

    firsts: np.ndarray
    counts: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    rows: np.ndarray
    pos: np.ndarray
    several: list[int]
    total: int


class StepInputBuilder:
    """Builds each step's padded inputs. Per request, a few scalars that change from step
    to step are read; its sampling settings and its block table are kept in tables by
    state slot (settings written when the slot is handed out, SchedulerOutput.new_rows;
    blocks as they are added), so the cost per decode row stays a few attribute reads at any batch
    size and sequence length. A block table row may hold more of the request's own blocks
    than the step reads, and a window group's row the ids of blocks it released behind
    its window (which may be another request's by then: no query's window reaches them,
    so they are read masked, never weighed or written)."""

    def __init__(self, max_num_seqs: int, block_size: int, blocks_per_seq: int,
                 num_groups: int = 1, lora: bool = False) -> None:
        self.block_size, self.blocks_per_seq = block_size, blocks_per_seq
        self.lora = lora  # each token's LoRA slot too (Request.lora_slot)
        self.num_groups = num_groups  # KV groups: block tables [G, R, B] when G > 1
        # Per state slot: its request's SamplingRow (float fields, other fields), and
        # whether its rows need more than their scalars (Request.step_extras).
        self._floats = np.zeros((max_num_seqs + 1, len(_FLOATS)), np.float32)
        self._ints = np.zeros((max_num_seqs + 1, len(_INTS)), np.int64)
        self._extras = np.zeros(max_num_seqs + 1, bool)
        # Per KV group and state slot: the block table of the request holding it, and how
        # many of its blocks are written there. A request's blocks only grow while it holds
        # its slot (freeing them releases the slot), so a step writes only the blocks added
        # since the last one: the cost per step does not grow with the sequences' lengths.
        # (A block a window group releases stays in its table: its keys are outside every
        # later query's window, so no attention weighs them.)
        self._tables = np.zeros((num_groups, max_num_seqs + 1, blocks_per_seq), np.int32)
        self._written = np.zeros(max_num_seqs + 1, np.int64)
        self._arange = np.arange(0)  # grown to the largest step seen (rows or tokens)
        self._ones = np.ones(0, np.int32)
        self._packed: dict[tuple[int, int], PackedStep] = {}  # by (T, R)

    def build(self, out: SchedulerOutput, num_tokens: int, num_rows: int,
              refresh: bool = False) -> tuple[dict, dict]:
        """Returns (batch arrays, sampling arrays) as dicts of numpy arrays, padded to the
        (T, R) bucket (see build_packed)."""
        packed, _ = self.build_packed(out, num_tokens, num_rows, refresh)
        return self._packed[num_tokens, num_rows].arrays(packed)

    def build_packed(self, out: SchedulerOutput, num_tokens: int, num_rows: int,
                     refresh: bool = False) -> tuple[np.ndarray, tuple]:
        """The step's arrays packed for the device (packing.py): (i32 buffer, layout).
        refresh: rewrite every row's table entry (not only new slots').

        A placeholder position (at or past the request's known tokens: asynchronous
        scheduling) gets token 0 and `feed_slots` = the request's state slot, whose last
        sampled token the device feeds instead."""
        step = self._packed.get((num_tokens, num_rows))
        if step is None:
            step = self._packed[num_tokens, num_rows] = PackedStep(
                num_tokens, num_rows, self.blocks_per_seq, self.num_groups, self.lora)
            if len(self._arange) < max(num_tokens, num_rows):
                self._arange = np.arange(max(num_tokens, num_rows), dtype=np.int32)
            if len(self._ones) < num_rows:
                self._ones = np.ones(num_rows, np.int32)
        np.copyto(step.buffer, step.template)
        a = step.views
        a["num_seqs"][0] = len(out.requests)
        if out.requests:
            self._fill(out, a, refresh)
        return step.buffer.copy(), step.layout

    def _fill(self, out: SchedulerOutput, a: dict, refresh: bool) -> None:
        """Write a step's values into its bucket's views `a`, stage by stage. (Array methods
        and no per-row Python where avoidable: at a few hundred rows the fixed cost of each
        numpy call is what the step costs.)"""
        reqs = out.requests
        step = self._tokens(out)
        # Per request, the few scalars that change from step to step.
        slots = np.array([r.state_slot for r in reqs])
        known = np.array([r.num_tokens for r in reqs])
        kv_lens = _write_extents(out, a, step)
        self._hand_out_slots(out, refresh)
        self._add_blocks(out, slots, kv_lens)
        self._write_settings(a, slots)
        placeholder = self._write_positions(out, a, step, slots, known)
        _write_tokens(out, a, step, known, placeholder)
        self._write_masks(out, a, step, slots)

    def _tokens(self, out: SchedulerOutput) -> _StepTokens:
        """Where the step's tokens sit (_StepTokens)."""
        n, total = len(out.requests), out.total_num_scheduled_tokens
        firsts = np.array(out.num_computed_tokens, np.int32)
        if total == n:  # one token per row: the decode steps of a busy server
            starts = self._arange[:n]
            return _StepTokens(firsts, self._ones[:n], starts, starts + 1, starts, firsts, [],
                               total)
        counts = np.array(out.num_scheduled_tokens, np.int32)
        ends = counts.cumsum(dtype=np.int32)
        starts = ends - counts
        rows = self._arange[:n].repeat(counts)  # the row of each token of the step
        pos = self._arange[:total] - starts[rows] + firsts[rows]
        several = (counts > 1).nonzero()[0].tolist()  # chunks, a token and proposals
        return _StepTokens(firsts, counts, starts, ends, rows, pos, several, total)

    def _hand_out_slots(self, out: SchedulerOutput, refresh: bool) -> None:
        """Each new slot's sampling row into the settings, its block table emptied (with
        refresh: every row's)."""
        reqs, tables, written = out.requests, self._tables, self._written
        for row in (range(len(reqs)) if refresh else out.new_rows):
            r = reqs[row]
            slot = r.state_slot
            row_settings = r.sampling_row
            self._floats[slot] = [row_settings[i] for i in _FLOATS]
            self._ints[slot] = [row_settings[i] for i in _INTS]
            self._extras[slot] = r.step_extras
            tables[:, slot, : written[slot]] = 0
            written[slot] = 0

    def _add_blocks(self, out: SchedulerOutput, slots: np.ndarray, kv_lens: np.ndarray) -> None:
        """The blocks this step reads that are not in the block tables yet."""
        tables, written = self._tables, self._written
        needed = (kv_lens + self.block_size - 1) // self.block_size
        for row in (needed > written[slots]).nonzero()[0].tolist():
            ids, slot = out.requests[row].block_ids, int(slots[row])
            done = written[slot]
            for g, group_ids in enumerate(ids):
                tables[g, slot, done: len(group_ids)] = group_ids[done:]
            written[slot] = len(ids[0])

    def _write_settings(self, a: dict, slots: np.ndarray) -> None:
        """Each row's state slot and its request's sampling settings, field by field of
        SamplingRow (SamplingParams keeps top_k within int32)."""
        n = len(slots)
        a["state_slots"][:n] = slots
        for name, column in zip(_FLOAT_NAMES, self._floats[slots].T):
            a[name][:n] = column
        for name, column in zip(_INT_NAMES, self._ints[slots].T):
            a[name][:n] = column

    def _write_positions(self, out: SchedulerOutput, a: dict, step: _StepTokens,
                         slots: np.ndarray, known: np.ndarray) -> np.ndarray:
        """The rows' block tables; each token's position, KV slot, placeholder feed and LoRA
        slot. Returns which tokens are placeholders (bool[total])."""
        n, total, rows, pos = len(slots), step.total, step.rows, step.pos
        block_size, groups = self.block_size, self.num_groups
        num_rows = a["cu_q_lens"].shape[0] - 1
        step_tables = self._tables.take(slots, axis=1, out=a["block_tables"].reshape(
            groups, num_rows, -1)[:, :n])
        a["positions"][:total] = pos
        a["slot_mapping"].reshape(groups, -1)[:, :total] = \
            step_tables[:, rows, pos // block_size] * block_size + pos % block_size
        # Proposals too are written past the known tokens; a step holds placeholders (as
        # its inputs) or proposals, never both: asynchronous steps do not speculate.
        placeholder = pos >= known[rows]
        if step.several:
            placeholder &= a["num_proposed"][rows] == 0
        a["feed_slots"][:total] = slots[rows] * placeholder
        if self.lora:
            a["lora_slots"][:total] = np.array([r.lora_slot for r in out.requests],
                                               np.int32)[rows]
        return placeholder

    def _write_masks(self, out: SchedulerOutput, a: dict, step: _StepTokens,
                     slots: np.ndarray) -> None:
        """The rows that need more than their scalars (Request.step_extras): a grammar's
        flag, the stop tokens banned below min_tokens, bad words' last tokens."""
        banned_ids, has_grammar = a["banned_ids"], a["has_grammar"]
        firsts, counts = step.firsts, step.counts
        for row in self._extras[slots].nonzero()[0].tolist():
            req = out.requests[row]
            if req.grammar_active and out.samples[row]:
                has_grammar[row] = 1  # its mask comes with the step (see the engine)
            banned = []
            # The output index of the token this row samples.
            if firsts[row] + counts[row] - req.num_proposed - req.num_prompt_tokens < \
                    req.params.min_tokens:
                banned = sorted(req.eos_token_ids | req.stop_token_ids)
            if req.constraints is not None and req.constraints.bad_sequences:
                banned += req.constraints.banned_next(
                    req.token_ids[req.num_prompt_tokens: req.num_tokens])
            if banned:  # the engine refuses requests that could need more
                banned_ids[row, : len(banned)] = banned


def _write_extents(out: SchedulerOutput, a: dict, step: _StepTokens) -> np.ndarray:
    """Each row's token range, context length, sampled token and its position, whether its
    state starts afresh, and its proposals. Returns the context lengths (i32[n])."""
    n = len(out.requests)
    a["cu_q_lens"][1: n + 1] = step.ends
    a["cu_q_lens"][n + 1:] = step.total
    kv_lens = a["kv_lens"][:n] = step.firsts + step.counts
    a["logits_indices"][:n] = step.ends - 1
    a["sample_positions"][:n] = kv_lens
    a["reset_state"][out.new_rows] = 1
    num_proposed = a["num_proposed"]
    for row in step.several:  # (a proposal row has more than one token)
        num_proposed[row] = out.requests[row].num_proposed
    return kv_lens


def _write_tokens(out: SchedulerOutput, a: dict, step: _StepTokens, known: np.ndarray,
                  placeholder: np.ndarray) -> None:
    """Each token's id: a decode row's known token, a chunk's or proposal row's tokens, and
    0 at placeholders (the device feeds those)."""
    reqs, token_ids, several = out.requests, a["token_ids"], step.several
    decode = step.firsts < known  # decode rows with a known token (and chunks: rewritten)
    if several:
        decode[several] = False
    decode = decode.nonzero()[0]
    firsts_list = out.num_computed_tokens
    token_ids[step.starts[decode]] = [reqs[row].token_ids.item(firsts_list[row])
                                      for row in decode.tolist()]
    for row in several:  # chunks, proposals: known tokens
        first, start, count = step.firsts[row], step.starts[row], step.counts[row]
        token_ids[start: start + count] = reqs[row].token_ids[first: first + count]
    if several:
        token_ids[: step.total][placeholder] = 0


def prompt_score_targets(out: SchedulerOutput, wanted: list[bool]) -> np.ndarray | None:
    """i32[T]: for each token of the step, the next prompt token whose logprob it scores
    (-1: none), for the rows where `wanted` (a prompt-logprobs request) while they still
    read their prompt; None when no row scores anything."""
    wanted = [want and first < req.num_prompt_tokens - 1
              for req, first, want in zip(out.requests, out.num_computed_tokens, wanted)]
    if not any(wanted):
        return None
    targets = np.full(out.total_num_scheduled_tokens, -1, np.int32)
    start = 0
    for req, first, count, want in zip(out.requests, out.num_computed_tokens,
                                       out.num_scheduled_tokens, wanted):
        end = min(first + count, req.num_prompt_tokens - 1)
        if want and end > first:
            targets[start: start + end - first] = req.token_ids[first + 1: end + 1]
        start += count
    return targets


def grammar_masks(out: SchedulerOutput, grammars):
    """The next-token bitmask of each constrained request that samples in this step, as
    (state slot, i32[W] mask) pairs (None when none does; grammars: the engine's
    structured_output.GrammarCompiler), and the requests whose matcher failed to give one
    (out of its per-step fuel: they fail alone; their rows sample freely meanwhile and
    their results are dropped)."""
    rows = [req for req, samples in zip(out.requests, out.samples)
            if samples and req.grammar_active]
    if not rows:
        return None, []
    masks = grammars.fill_masks([req.grammar for req in rows])
    broken = []
    for i, req in enumerate(rows):
        if req.grammar.is_error():
            masks[i] = -1
            broken.append(req)
    return [(req.state_slot, masks[i]) for i, req in enumerate(rows)], broken
