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


def samples_this_step(req, count: int) -> bool:
    """Whether a request scheduled for `count` tokens samples a token at the end of this
    step (the rest of a chunked prefill does not; speculative proposals come after its
    tokens)."""
    return req.num_computed_tokens + count >= req.num_tokens


def _fill_tokens(reqs, counts, firsts, starts, block_size, token_ids, positions, slot_mapping):
    """Token ids, positions and KV slots: decode rows (one token) in one pass, prefill
    chunks by slices."""
    single = counts == 1
    rows = np.flatnonzero(single)
    if len(rows):
        where, pos = starts[rows], firsts[rows]
        token_ids[where] = [reqs[i].token_ids[p] for i, p in zip(rows.tolist(), pos.tolist())]
        positions[where] = pos
        pages = [reqs[i].block_ids[p] for i, p in zip(rows.tolist(), (pos // block_size).tolist())]
        slot_mapping[where] = np.asarray(pages, np.int32) * block_size + pos % block_size
    for row in np.flatnonzero(~single).tolist():
        req, first, start, count = reqs[row], int(firsts[row]), int(starts[row]), int(counts[row])
        pos = np.arange(first, first + count, dtype=np.int32)
        blocks = np.asarray(req.block_ids, np.int32)
        token_ids[start: start + count] = req.token_ids[first: first + count]
        positions[start: start + count] = pos
        slot_mapping[start: start + count] = blocks[pos // block_size] * block_size + \
            pos % block_size


def build_step_inputs(out: SchedulerOutput, num_tokens: int, num_rows: int, block_size: int,
                      blocks_per_seq: int) -> tuple[dict, dict]:
    """Returns (batch arrays, sampling arrays) as dicts of numpy arrays."""
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)
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
        firsts = np.fromiter((r.num_computed_tokens for r in reqs), np.int32, n)
        ends = np.cumsum(counts, dtype=np.int32)
        cu_q_lens[1: n + 1] = ends
        cu_q_lens[n + 1:] = ends[-1]
        kv_lens[:n] = firsts + counts
        logits_indices[:n] = ends - 1
        sample_positions[:n] = firsts + counts
        _fill_tokens(reqs, counts, firsts, ends - counts, block_size, token_ids, positions,
                     slot_mapping)
        for row, req in enumerate(reqs):
            block_tables[row, : len(req.block_ids)] = req.block_ids

        # Per-request constants, gathered in one conversion each.
        floats = np.array([r.sampling_floats for r in reqs], np.float32)
        temperature[:n], top_p[:n], min_p[:n] = floats[:, 0], floats[:, 1], floats[:, 2]
        presence[:n], frequency[:n], repetition[:n] = floats[:, 3], floats[:, 4], floats[:, 5]
        ints = np.array([(r.sampling_top_k, r.seed, r.num_prompt_tokens, r.state_slot,
                          r.num_proposed) for r in reqs], np.int64)
        top_k[:n] = ints[:, 0]  # SamplingParams keeps top_k within int32
        seeds[:n], prompt_lens[:n], state_slots[:n] = ints[:, 1], ints[:, 2], ints[:, 3]
        num_proposed[:n] = ints[:, 4]
        for row, (req, count) in enumerate(zip(reqs, out.num_scheduled_tokens)):
            if req.grammar_active and samples_this_step(req, count):
                has_grammar[row] = True  # its mask comes with the step (see the engine)
            if req.needs_state_reset:  # cleared by update_from_output once it ran
                reset_state[row] = True
            if req.params.logprobs is not None:
                wants_logprobs[row] = True
            banned = []
            if req.num_output_tokens < req.params.min_tokens:
                banned = sorted(req.eos_token_ids | req.stop_token_ids)
            if req.constraints is not None:
                has_bias[row] = req.constraints.has_row
                if req.constraints.bad_sequences:
                    banned += req.constraints.banned_next(
                        req.token_ids[req.num_prompt_tokens: req.num_tokens])
            if banned:  # the engine refuses requests that could need more
                banned_ids[row, : len(banned)] = banned

    batch = dict(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                 cu_q_lens=cu_q_lens, kv_lens=kv_lens, block_tables=block_tables,
                 num_seqs=np.array([len(out.requests)], np.int32),
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
    wanted = [want and req.num_computed_tokens < req.num_prompt_tokens - 1
              for req, want in zip(out.requests, wanted)]
    if not any(wanted):
        return None
    targets = np.full(out.total_num_scheduled_tokens, -1, np.int32)
    start = 0
    for req, count, want in zip(out.requests, out.num_scheduled_tokens, wanted):
        first = req.num_computed_tokens
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
    rows = [req for req, count in zip(out.requests, out.num_scheduled_tokens)
            if req.grammar_active and samples_this_step(req, count)]
    if not rows:
        return None, []
    masks = grammars.fill_masks([req.grammar for req in rows])
    broken = []
    for i, req in enumerate(rows):
        if req.grammar.is_error():
            masks[i] = -1
            broken.append(req)
    return [(req.state_slot, masks[i]) for i, req in enumerate(rows)], broken
