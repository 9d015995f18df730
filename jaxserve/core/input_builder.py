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
                      blocks_per_seq: int) -> tuple[dict, dict]:
    """One step's inputs with a builder of its own (for a step formed by hand, and the
    shapes of a bucket); a runner keeps one StepInputBuilder for all its steps."""
    slots = max((r.state_slot for r in out.requests), default=0)
    return StepInputBuilder(slots, block_size, blocks_per_seq).build(
        out, num_tokens, num_rows, refresh=True)


class StepInputBuilder:
    """Builds each step's padded numpy inputs. Per request, a few scalars that change from
    step to step are read; its sampling settings and its block table are kept in tables by
    state slot (settings written when the slot is handed out, needs_state_reset; blocks
    as they are added), so the cost per decode row stays a few attribute reads at any batch
    size and sequence length. A block table row may hold more of the request's own blocks
    than the step reads (never another request's)."""

    def __init__(self, max_num_seqs: int, block_size: int, blocks_per_seq: int) -> None:
        self.block_size, self.blocks_per_seq = block_size, blocks_per_seq
        # Per state slot: sampling_floats, and (top_k, seed, prompt length, step_extras).
        self._floats = np.zeros((max_num_seqs + 1, 8), np.float32)
        self._ints = np.zeros((max_num_seqs + 1, 4), np.int64)
        # Per state slot: the block table of the request holding it, and how many of its
        # blocks are written there. A request's blocks only grow while it holds its slot
        # (freeing them releases the slot), so a step writes only the blocks added since the
        # last one: the cost per step does not grow with the sequences' lengths.
        self._tables = np.zeros((max_num_seqs + 1, blocks_per_seq), np.int32)
        self._written = np.zeros(max_num_seqs + 1, np.int64)

    def build(self, out: SchedulerOutput, num_tokens: int, num_rows: int,
              refresh: bool = False) -> tuple[dict, dict]:
        """Returns (batch arrays, sampling arrays) as dicts of numpy arrays, padded to the
        (T, R) bucket. refresh: rewrite every row's table entry (not only new slots').

        A placeholder position (at or past the request's known tokens: asynchronous
        scheduling) gets token 0 and `feed_slots` = the request's state slot, whose last
        sampled token the device feeds instead."""
        block_size, blocks_per_seq = self.block_size, self.blocks_per_seq
        token_ids = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        slot_mapping = np.zeros(num_tokens, np.int32)
        feed_slots = np.zeros(num_tokens, np.int32)
        cu_q_lens = np.zeros(num_rows + 1, np.int32)
        kv_lens = np.zeros(num_rows, np.int32)
        block_tables = np.zeros((num_rows, blocks_per_seq), np.int32)
        logits_indices = np.zeros(num_rows, np.int32)

        temperature = np.ones(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        min_p = np.zeros(num_rows, np.float32)
        presence = np.zeros(num_rows, np.float32)
        frequency = np.zeros(num_rows, np.float32)
        repetition = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        sample_positions = np.zeros(num_rows, np.int32)
        state_slots = np.zeros(num_rows, np.int32)
        reset_state = np.zeros(num_rows, np.bool_)
        prompt_lens = np.zeros(num_rows, np.int32)
        wants_logprobs = np.zeros(num_rows, np.bool_)
        banned_ids = np.full((num_rows, MAX_BANNED_IDS), -1, np.int32)
        has_bias = np.zeros(num_rows, np.bool_)
        has_grammar = np.zeros(num_rows, np.bool_)
        num_proposed = np.zeros(num_rows, np.int32)

        reqs, n = out.requests, len(out.requests)
        if n:
            counts = np.asarray(out.num_scheduled_tokens, np.int32)
            firsts = np.asarray(out.num_computed_tokens, np.int32)
            ends = np.cumsum(counts, dtype=np.int32)
            starts = ends - counts
            cu_q_lens[1: n + 1] = ends
            cu_q_lens[n + 1:] = ends[-1]
            kv_lens[:n] = firsts + counts
            logits_indices[:n] = ends - 1
            sample_positions[:n] = firsts + counts

            # Per request, the few scalars that change from step to step.
            slots = np.array([r.state_slot for r in reqs])
            known = np.array([r.num_tokens for r in reqs])
            resets = [r.needs_state_reset for r in reqs]
            reset_state[:n] = resets
            num_proposed[:n] = [r.num_proposed for r in reqs]
            tables, written = self._tables, self._written
            for row in (range(n) if refresh else np.flatnonzero(resets).tolist()):
                r = reqs[row]  # a new slot: its sampling settings and blocks into the tables
                slot = r.state_slot
                self._floats[slot] = r.sampling_floats
                self._ints[slot] = (r.sampling_top_k, r.seed, r.num_prompt_tokens,
                                    r.step_extras)
                tables[slot, : written[slot]] = 0
                written[slot] = 0
            # The blocks this step reads that are not in the table yet.
            needed = (kv_lens[:n] + block_size - 1) // block_size
            for row in np.flatnonzero(needed > written[slots]).tolist():
                ids, slot = reqs[row].block_ids, int(slots[row])
                tables[slot, written[slot]: len(ids)] = ids[written[slot]:]
                written[slot] = len(ids)
            floats, static = self._floats[slots], self._ints[slots]
            state_slots[:n] = slots
            top_k[:n] = static[:, 0]  # SamplingParams keeps top_k within int32
            seeds[:n], prompt_lens[:n] = static[:, 1], static[:, 2]
            temperature[:n], top_p[:n], min_p[:n] = floats[:, 0], floats[:, 1], floats[:, 2]
            presence[:n], frequency[:n], repetition[:n] = floats[:, 3], floats[:, 4], floats[:, 5]
            wants_logprobs[:n], has_bias[:n] = floats[:, 6] != 0, floats[:, 7] != 0
            step_tables = block_tables[:n] = tables[slots]

            # Token positions of the whole step, and the row of each.
            rows = np.repeat(np.arange(n), counts)
            pos = np.arange(ends[-1], dtype=np.int32) - starts[rows] + firsts[rows]
            total = len(pos)
            positions[:total] = pos
            slot_mapping[:total] = step_tables[rows, pos // block_size] * block_size + \
                pos % block_size
            # Proposals too are written past the known tokens; a step holds placeholders (as
            # its inputs) or proposals, never both: asynchronous steps do not speculate.
            placeholder = (pos >= known[rows]) & (num_proposed[rows] == 0)
            feed_slots[:total] = np.where(placeholder, slots[rows], 0)
            single = counts == 1
            firsts_list = out.num_computed_tokens
            decode = np.flatnonzero(single & (firsts < known))  # decode rows with a known token
            token_ids[starts[decode]] = [reqs[row].token_ids.item(firsts_list[row])
                                         for row in decode.tolist()]
            for row in np.flatnonzero(~single).tolist():  # chunks, proposals: known tokens
                req, first, start, count = reqs[row], firsts[row], starts[row], counts[row]
                token_ids[start: start + count] = req.token_ids[first: first + count]
            token_ids[:total][placeholder] = 0

            for row in np.flatnonzero(static[:, 3]).tolist():  # grammar, min_tokens, bad words
                req = reqs[row]
                if req.grammar_active and out.samples[row]:
                    has_grammar[row] = True  # its mask comes with the step (see the engine)
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

        batch = dict(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                     feed_slots=feed_slots, cu_q_lens=cu_q_lens, kv_lens=kv_lens,
                     block_tables=block_tables, num_seqs=np.array([len(out.requests)], np.int32),
                     logits_indices=logits_indices)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        presence_penalty=presence, frequency_penalty=frequency,
                        repetition_penalty=repetition, seeds=seeds,
                        sample_positions=sample_positions, state_slots=state_slots,
                        reset_state=reset_state, prompt_lens=prompt_lens,
                        wants_logprobs=wants_logprobs, banned_ids=banned_ids,
                        has_bias=has_bias, has_grammar=has_grammar, num_proposed=num_proposed)
        return batch, sampling


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
