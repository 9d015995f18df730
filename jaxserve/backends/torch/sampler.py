"""Sampling for the torch backend: sampler.py's semantics in PyTorch.

Penalties (vLLM's: repetition over prompt and output tokens, presence/frequency over output
tokens), logit bias rows, grammar bitmasks, banned ids, temperature, top-k, top-p, min-p,
seeded draws and logprobs, with the same per-request device state (one row per running
request, row 0 scratch) updated from the tokens each step feeds the model, and the same
order of stages, so both backends give the same distributions and greedy tokens.

Stages that cost passes over [R, V] run only when some row of the step needs them; which
ones is read from the step's host inputs (StepFlags), so nothing here waits on the device.

Randomness: each row draws one uniform u in (0, 1] from a counter-based hash of (seed,
position) and picks its token by inverse CDF, so a seeded request draws the same tokens
whatever else shares its batch (the bits differ from the JAX backend's threefry draws, the
distribution does not).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from jaxserve.backends.torch.batch import TorchSamplingInputs
from jaxserve.core.sampling_params import MAX_LOGPROBS

_GREEDY_EPS = 1e-5  # as vLLM: temperatures below this are greedy
_MASK32 = 0xFFFFFFFF


@dataclasses.dataclass
class PenaltyState:
    """sampler.PenaltyState in torch: rows of per-request state, written in place."""

    output_counts: torch.Tensor  # i32[Q, V]   Q = max_num_seqs + 1 rows
    prompt_mask: torch.Tensor  # bool[Q, V]
    logit_bias: torch.Tensor  # f32[Q, V]
    grammar_mask: torch.Tensor  # i32[Q, W]  W = ceil(V / 32): bit t % 32 of word t // 32
    last_tokens: torch.Tensor  # i32[Q]  each row's last sampled token (placeholder inputs)

    @classmethod
    def zeros(cls, rows: int, vocab: int, device) -> PenaltyState:
        return cls(torch.zeros(rows, vocab, dtype=torch.int32, device=device),
                   torch.zeros(rows, vocab, dtype=torch.bool, device=device),
                   torch.zeros(rows, vocab, dtype=torch.float32, device=device),
                   torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32, device=device),
                   torch.zeros(rows, dtype=torch.int32, device=device))


@dataclasses.dataclass
class SampleResult:
    """sampler.SampleResult: torch tensors on the device, numpy arrays once fetched."""

    token_ids: object  # i32[R]
    logprobs: object  # f32[R]  of the sampled token, from the raw model distribution
    ranks: object  # i32[R]     1 = most likely
    top_ids: object  # i32[R, 20]
    top_logprobs: object  # f32[R, 20]

    def to_host(self) -> SampleResult:
        return SampleResult(*(getattr(self, f.name).cpu().numpy()
                              for f in dataclasses.fields(self)))


@dataclasses.dataclass(frozen=True)
class StepFlags:
    """Which sampler stages a step needs, read from its host inputs (numpy)."""

    bias: bool
    grammar: bool
    penalties: bool
    bans: bool
    all_greedy: bool
    truncation: bool
    logprobs: bool

    @classmethod
    def of(cls, s: dict, num_seqs: int, vocab: int) -> StepFlags:
        """s: input_builder's sampling arrays (numpy, by step_fields' names); rows past
        num_seqs are padding."""
        live = slice(0, num_seqs)
        top_k = s["top_k"][live]
        return cls(
            bias=bool(s["has_bias"][live].any()), grammar=bool(s["has_grammar"][live].any()),
            penalties=bool(np.any((s["presence_penalty"][live] != 0)
                                  | (s["frequency_penalty"][live] != 0)
                                  | (s["repetition_penalty"][live] != 1))),
            bans=bool((s["banned_ids"][live] >= 0).any()),
            all_greedy=bool((s["temperature"][live] < _GREEDY_EPS).all()),
            truncation=bool(np.any(((top_k > 0) & (top_k < vocab))
                                   | (s["top_p"][live] < 1.0))),
            logprobs=bool(s["wants_logprobs"][live].any()))


def update_penalty_state(state: PenaltyState, token_ids, positions, s: TorchSamplingInputs,
                         seq, valid):
    """Fold this step's input tokens into the rows of their sequences (in place).

    token_ids, positions: i32[T]; s: the sampling tensors; seq: i64[T] row of each token;
    valid: bool[T]. Prompt tokens set prompt_mask; output tokens (fed back after being
    sampled, or recomputed after preemption) add to the counts."""
    reset_rows = torch.where(s.reset_state, s.state_slots, 0).long()
    state.output_counts[reset_rows] = 0
    state.prompt_mask[reset_rows] = False
    rows = torch.where(valid, s.state_slots[seq], 0).long()
    tokens = token_ids.long()
    is_prompt = positions < s.prompt_lens[seq]
    state.prompt_mask[torch.where(is_prompt, rows, 0), tokens] = True
    state.output_counts.index_put_((torch.where(is_prompt, 0, rows), tokens),
                                   torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


def _apply_penalties(logits, state: PenaltyState, s: TorchSamplingInputs):
    slots = s.state_slots.long()
    counts = state.output_counts[slots]  # i32[R, V]
    seen = state.prompt_mask[slots] | (counts > 0)
    rep = s.repetition_penalty[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - s.frequency_penalty[:, None] * counts
    return logits - s.presence_penalty[:, None] * (counts > 0)


def _truncate(logits, s: TorchSamplingInputs):
    """Mask tokens outside top-k, then outside the top-p nucleus, as sampler._truncate."""
    vocab = logits.shape[-1]
    sorted_desc = torch.sort(logits, dim=-1, descending=True).values
    top_k = s.top_k.long()
    k = torch.where(top_k > 0, torch.clamp(top_k, max=vocab), vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    kth = sorted_desc.gather(-1, (k - 1)[:, None])
    sorted_desc = torch.where(ranks < k[:, None], sorted_desc, float("-inf"))
    probs = torch.softmax(sorted_desc, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    keep = (before < s.top_p[:, None]).sum(-1)  # >= 1: the first is always kept
    cutoff = sorted_desc.gather(-1, (keep - 1)[:, None])
    return torch.where(logits < torch.maximum(kth, cutoff), float("-inf"), logits)


def _mul32(x, constant: int):
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo, hi = constant & 0xFFFF, constant >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x):
    """A 32-bit integer mixer (xor-shift / multiply rounds) on int64 tensors."""
    x = x & _MASK32
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds, positions):
    """f32[R] in (0, 1], a function of (seed, position) only: 24 random bits per row."""
    bits = _hash32(_hash32(seeds.long() & _MASK32) ^ _hash32(positions.long() + 0x9E3779B9))
    return ((bits >> 8) + 1).float() * 2.0 ** -24


def _draw(logits, s: TorchSamplingInputs, truncation: bool):
    """Temperature, top-k/top-p, min-p, then one inverse-CDF draw per row."""
    vocab = logits.shape[-1]
    temperature = s.temperature
    greedy = temperature < _GREEDY_EPS
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if truncation:
        scaled = _truncate(scaled, s)
    probs = torch.softmax(scaled, dim=-1)
    probs = torch.where(probs < s.min_p[:, None] * probs.amax(-1, keepdim=True), 0.0, probs)
    u = uniforms(s.seeds, s.sample_positions)
    cdf = torch.cumsum(probs, dim=-1)
    below = cdf < (u * cdf[:, -1])[:, None]
    return torch.clamp(below.sum(-1), max=vocab - 1)


def _logprobs(raw_logits, token_ids):
    """Logprob and rank of each chosen token, and the top MAX_LOGPROBS, from raw logits."""
    raw = torch.log_softmax(raw_logits, dim=-1)
    chosen = raw.gather(-1, token_ids.long()[:, None])[:, 0]
    ranks = (raw > chosen[:, None]).sum(-1).int() + 1
    top_logprobs, top_ids = torch.topk(raw, min(MAX_LOGPROBS, raw.shape[-1]), dim=-1)
    return chosen, ranks, top_ids.int(), top_logprobs


def _ban(logits, banned_ids):
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None].expand_as(banned_ids)
    keep = banned_ids >= 0
    logits = logits.clone()
    logits[rows[keep], banned_ids[keep].long()] = float("-inf")
    return logits


def _apply_grammar(logits, state: PenaltyState, s: TorchSamplingInputs):
    """Tokens the row's grammar does not allow next get -inf (structured outputs)."""
    words = state.grammar_mask[s.state_slots.long()]  # i32[R, W]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    allowed = ((words[:, ids // 32] >> (ids % 32)) & 1) != 0  # bool[R, V]
    return torch.where(s.has_grammar[:, None] & ~allowed, float("-inf"), logits)


def sample(logits, state: PenaltyState, s: TorchSamplingInputs,
           flags: StepFlags) -> SampleResult:
    """logits: f32[R, V] raw model logits for each sequence's last token; s: the step's
    sampling tensors. As sampler.sample: bias and bans before the penalties, logprobs of
    the raw logits."""
    raw_logits = logits
    if flags.bias:
        bias = state.logit_bias[s.state_slots.long()]
        logits = torch.where(s.has_bias[:, None], logits + bias, logits)
    if flags.grammar:
        logits = _apply_grammar(logits, state, s)
    if flags.penalties:
        logits = _apply_penalties(logits, state, s)
    if flags.bans:
        logits = _ban(logits, s.banned_ids)
    greedy_ids = torch.argmax(logits, dim=-1)
    if flags.all_greedy:
        token_ids = greedy_ids
    else:
        greedy = s.temperature < _GREEDY_EPS
        token_ids = torch.where(greedy, greedy_ids, _draw(logits, s, flags.truncation))
    token_ids = token_ids.int()
    rows, k = logits.shape[0], min(MAX_LOGPROBS, logits.shape[-1])
    if flags.logprobs:
        chosen, ranks, top_ids, top_logprobs = _logprobs(raw_logits, token_ids)
    else:
        device = logits.device
        chosen = torch.zeros(rows, dtype=torch.float32, device=device)
        ranks = torch.ones(rows, dtype=torch.int32, device=device)
        top_ids = torch.zeros(rows, k, dtype=torch.int32, device=device)
        top_logprobs = torch.zeros(rows, k, dtype=torch.float32, device=device)
    return SampleResult(token_ids, chosen, ranks, top_ids, top_logprobs)


def score_tokens(logits, targets) -> SampleResult:
    """Logprobs of given next tokens (prompt_logprobs): logits f32[X, V], targets i32[X]."""
    return SampleResult(targets, *_logprobs(logits, targets))
