"""Builds one step's padded numpy inputs from a SchedulerOutput (host side, numpy only).

Work is per sequence (slices of each request's token and block arrays), never per token in
Python. The arrays follow DESIGN.md's batch layout and SamplingInputs, padded to the (T, R)
bucket the runner picked.
"""

from __future__ import annotations

import numpy as np

from jaxserve.scheduler import SchedulerOutput

MAX_BANNED_IDS = 16  # stop tokens masked while a request is below min_tokens
_INT32_MAX = 2**31 - 1


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
    banned_ids = np.full((num_rows, MAX_BANNED_IDS), -1, np.int32)

    start = 0
    for row, (req, count) in enumerate(zip(out.requests, out.num_scheduled_tokens)):
        first = req.num_computed_tokens
        end = start + count
        pos = np.arange(first, first + count, dtype=np.int32)
        blocks = np.asarray(req.block_ids, np.int32)
        token_ids[start:end] = req.token_ids[first: first + count]
        positions[start:end] = pos
        slot_mapping[start:end] = blocks[pos // block_size] * block_size + pos % block_size
        block_tables[row, : len(blocks)] = blocks
        kv_lens[row] = first + count
        cu_q_lens[row + 1] = end
        logits_indices[row] = end - 1
        start = end

        p = req.params
        temperature[row] = p.temperature
        top_k[row] = min(p.top_k, _INT32_MAX)  # k >= V means all tokens anyway
        top_p[row] = p.top_p
        min_p[row] = p.min_p
        presence[row] = p.presence_penalty
        frequency[row] = p.frequency_penalty
        repetition[row] = p.repetition_penalty
        seeds[row] = req.seed
        sample_positions[row] = first + count
        state_slots[row] = req.state_slot
        reset_state[row] = req.needs_state_reset
        req.needs_state_reset = False
        prompt_lens[row] = req.num_prompt_tokens
        if req.num_output_tokens < p.min_tokens:
            stops = sorted(req.eos_token_ids | req.stop_token_ids)[:MAX_BANNED_IDS]
            banned_ids[row, : len(stops)] = stops
    cu_q_lens[len(out.requests) + 1:] = start

    batch = dict(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                 cu_q_lens=cu_q_lens, kv_lens=kv_lens, block_tables=block_tables,
                 num_seqs=np.array([len(out.requests)], np.int32),
                 logits_indices=logits_indices)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    presence_penalty=presence, frequency_penalty=frequency,
                    repetition_penalty=repetition, seeds=seeds,
                    sample_positions=sample_positions, state_slots=state_slots,
                    reset_state=reset_state, prompt_lens=prompt_lens, banned_ids=banned_ids)
    return batch, sampling
