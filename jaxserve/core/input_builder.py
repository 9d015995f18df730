"""Builds one step's padded numpy inputs from a SchedulerOutput (host side, numpy only).

Work is per sequence (slices of each request's token and block arrays), never per token in
Python. The arrays follow docs/architecture.md's batch layout and SamplingInputs, padded to
the (T, R) bucket the runner picked.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput

# Tokens masked in one step of one sequence: its stop tokens while below min_tokens, and the
# last tokens of multi-token bad words whose other tokens end the output.
MAX_BANNED_IDS = 32


def build_step_inputs(out: SchedulerOutput, num_tokens: int, num_rows: int, block_size: int,
                      blocks_per_seq: int, num_groups: int = 1,
                      lora: bool = False) -> tuple[dict, dict]:
    """One step's inputs with a builder of its own (for a step formed by hand, and the
    shapes of a bucket); a runner keeps one StepInputBuilder for all its steps."""
    slots = max((r.state_slot for r in out.requests), default=0)
    return StepInputBuilder(slots, block_size, blocks_per_seq, num_groups, lora).build(
        out, num_tokens, num_rows, refresh=True)


# The step's arrays (batch, then sampling), each with its dtype and its padding value.
BATCH_FIELDS = (("token_ids", "int32", 0), ("positions", "int32", 0),
                ("slot_mapping", "int32", 0), ("feed_slots", "int32", 0),
                ("cu_q_lens", "int32", 0), ("kv_lens", "int32", 0),
                ("block_tables", "int32", 0), ("num_seqs", "int32", 0),
                ("logits_indices", "int32", 0))
SAMPLING_FIELDS = (("temperature", "float32", 1), ("top_k", "int32", 0),
                   ("top_p", "float32", 1), ("min_p", "float32", 0),
                   ("presence_penalty", "float32", 0), ("frequency_penalty", "float32", 0),
                   ("repetition_penalty", "float32", 1), ("seeds", "uint32", 0),
                   ("sample_positions", "int32", 0), ("state_slots", "int32", 0),
                   ("reset_state", "bool", 0), ("prompt_lens", "int32", 0),
                   ("wants_logprobs", "bool", 0), ("banned_ids", "int32", -1),
                   ("has_bias", "bool", 0), ("has_grammar", "bool", 0),
                   ("num_proposed", "int32", 0))
# With LoRA adapters (enable_lora): each token's adapter slot, -1 for the base model (the
# runner pops it before the sampling inputs).
LORA_FIELDS = (("lora_slots", "int32", -1),)


class PackedStep:
    """The arrays of one (T, R) bucket as views of one flat int32 buffer, in packing.py's
    layout (float32 and uint32 bit-cast, bool as int32 0/1): the builder writes the step's
    values into the views, and the buffer is the packed step at once. The buffer is kept
    and reset to the padding values for each step (one copy each way, instead of an array
    per field and a concatenation)."""

    def __init__(self, num_tokens: int, num_rows: int, blocks_per_seq: int,
                 num_groups: int = 1, lora: bool = False) -> None:
        # Several KV groups (config/kv_groups.py): a block table and slot mapping per group.
        groups = (num_groups,) if num_groups > 1 else ()
        shapes = dict(token_ids=(num_tokens,), positions=(num_tokens,),
                      slot_mapping=groups + (num_tokens,), feed_slots=(num_tokens,),
                      cu_q_lens=(num_rows + 1,),
                      block_tables=groups + (num_rows, blocks_per_seq),
                      num_seqs=(1,), banned_ids=(num_rows, MAX_BANNED_IDS),
                      lora_slots=(num_tokens,))
        fields = BATCH_FIELDS + SAMPLING_FIELDS + (LORA_FIELDS if lora else ())
        self.layout = tuple((name, shapes.get(name, (num_rows,)), dtype)
                            for name, dtype, _ in fields)
        sizes = [int(np.prod(shape)) for _, shape, _ in self.layout]
        self.buffer = np.zeros(sum(sizes), np.int32)
        self.views, offset = {}, 0
        for (name, shape, dtype), size, (_, _, pad) in zip(self.layout, sizes, fields):
            part = self.buffer[offset: offset + size]
            view = part if dtype == "bool" else part.view(dtype)
            view[:] = pad
            self.views[name] = view.reshape(shape)
            offset += size
        self.template = self.buffer.copy()
        self.num_batch_fields = len(BATCH_FIELDS)

    def arrays(self, packed: np.ndarray) -> tuple[dict, dict]:
        """(batch, sampling) arrays with their own dtypes, as views of `packed` (a copy of
        the buffer; bools as new arrays)."""
        out, offset = [], 0
        for name, shape, dtype in self.layout:
            size = int(np.prod(shape))
            part = packed[offset: offset + size]
            part = part != 0 if dtype == "bool" else part.view(dtype)
            out.append((name, part.reshape(shape)))
            offset += size
        k = self.num_batch_fields
        return dict(out[:k]), dict(out[k:])


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
        # Per state slot: sampling_floats, and (top_k, seed, prompt length, step_extras).
        self._floats = np.zeros((max_num_seqs + 1, 8), np.float32)
        self._ints = np.zeros((max_num_seqs + 1, 4), np.int64)
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
        """Write a step's values into its bucket's views `a`. (Array methods and no
        per-row Python where avoidable: at a few hundred rows the fixed cost of each numpy
        call is what the step costs.)"""
        block_size = self.block_size
        reqs, n = out.requests, len(out.requests)
        firsts = np.array(out.num_computed_tokens, np.int32)
        total = out.total_num_scheduled_tokens
        if total == n:  # one token per row: the decode steps of a busy server
            counts = self._ones[:n]
            rows = starts = self._arange[:n]
            ends, pos, several = starts + 1, firsts, []
        else:
            counts = np.array(out.num_scheduled_tokens, np.int32)
            ends = counts.cumsum(dtype=np.int32)
            starts = ends - counts
            rows = self._arange[:n].repeat(counts)  # the row of each token of the step
            pos = self._arange[:total] - starts[rows] + firsts[rows]
            several = (counts > 1).nonzero()[0].tolist()  # chunks, a token and proposals
        a["cu_q_lens"][1: n + 1] = ends
        a["cu_q_lens"][n + 1:] = total
        kv_lens = a["kv_lens"][:n] = firsts + counts
        a["logits_indices"][:n] = ends - 1
        a["sample_positions"][:n] = kv_lens

        # Per request, the few scalars that change from step to step.
        slots = np.array([r.state_slot for r in reqs])
        known = np.array([r.num_tokens for r in reqs])
        new_rows = out.new_rows
        a["reset_state"][new_rows] = 1
        num_proposed = a["num_proposed"]
        for row in several:  # (a proposal row has more than one token)
            num_proposed[row] = reqs[row].num_proposed
        tables, written = self._tables, self._written
        for row in (range(n) if refresh else new_rows):
            r = reqs[row]  # a new slot: its sampling settings and blocks into the tables
            slot = r.state_slot
            self._floats[slot] = r.sampling_floats
            self._ints[slot] = (r.sampling_top_k, r.seed, r.num_prompt_tokens, r.step_extras)
            tables[:, slot, : written[slot]] = 0
            written[slot] = 0
        # The blocks this step reads that are not in the table yet.
        needed = (kv_lens + block_size - 1) // block_size
        for row in (needed > written[slots]).nonzero()[0].tolist():
            ids, slot = reqs[row].block_ids, int(slots[row])
            done = written[slot]
            for g, group_ids in enumerate(ids):
                tables[g, slot, done: len(group_ids)] = group_ids[done:]
            written[slot] = len(ids[0])
        floats, static = self._floats[slots].T, self._ints[slots].T
        a["state_slots"][:n] = slots
        a["top_k"][:n] = static[0]  # SamplingParams keeps top_k within int32
        a["seeds"][:n], a["prompt_lens"][:n] = static[1], static[2]
        a["temperature"][:n], a["top_p"][:n], a["min_p"][:n] = floats[0], floats[1], floats[2]
        a["presence_penalty"][:n], a["frequency_penalty"][:n] = floats[3], floats[4]
        a["repetition_penalty"][:n] = floats[5]
        a["wants_logprobs"][:n], a["has_bias"][:n] = floats[6], floats[7]  # 0.0 / 1.0
        groups, num_rows = self.num_groups, a["cu_q_lens"].shape[0] - 1
        step_tables = tables.take(slots, axis=1, out=a["block_tables"].reshape(
            groups, num_rows, -1)[:, :n])

        # Token positions of the whole step.
        a["positions"][:total] = pos
        a["slot_mapping"].reshape(groups, -1)[:, :total] = \
            step_tables[:, rows, pos // block_size] * block_size + pos % block_size
        # Proposals too are written past the known tokens; a step holds placeholders (as
        # its inputs) or proposals, never both: asynchronous steps do not speculate.
        placeholder = pos >= known[rows]
        if several:
            placeholder &= num_proposed[rows] == 0
        a["feed_slots"][:total] = slots[rows] * placeholder
        if self.lora:
            a["lora_slots"][:total] = np.array([r.lora_slot for r in reqs], np.int32)[rows]
        token_ids = a["token_ids"]
        firsts_list = out.num_computed_tokens
        decode = firsts < known  # decode rows with a known token (and chunks: rewritten)
        if several:
            decode[several] = False
        decode = decode.nonzero()[0]
        token_ids[starts[decode]] = [reqs[row].token_ids.item(firsts_list[row])
                                     for row in decode.tolist()]
        for row in several:  # chunks, proposals: known tokens
            req, first, start, count = reqs[row], firsts[row], starts[row], counts[row]
            token_ids[start: start + count] = req.token_ids[first: first + count]
        if several:
            token_ids[:total][placeholder] = 0

        banned_ids, has_grammar = a["banned_ids"], a["has_grammar"]
        for row in static[3].nonzero()[0].tolist():  # grammar, min_tokens, bad words
            req = reqs[row]
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
