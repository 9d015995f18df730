"""Request: one sequence's tokens, progress, sampling settings and KV blocks (host side)."""

from __future__ import annotations

import enum
import time

import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_fields import sampling_row
from jaxserve.core.token_constraints import TokenConstraints


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed on this request (as vLLM v1's ERROR)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """One sequence. There is no prefill or decode phase: each step advances
    num_computed_tokens toward num_tokens by some number of new tokens."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, seed: int, max_model_len: int, eos_token_ids: frozenset[int],
                 priority: int = 0, constraints: TokenConstraints | None = None,
                 grammar=None, pooling=None, lora=None,
                 max_output_tokens: int | None = None) -> None:
        """max_output_tokens: its output budget as admission computed it
        (EngineRequest.budget); None: max_tokens cut to what max_model_len leaves."""
        self.request_id = request_id
        self.params = params
        self.seed = seed
        self.priority = priority
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None  # first admitted to running (queue time)
        self.num_prompt_tokens = len(prompt_token_ids)
        room = max_model_len - self.num_prompt_tokens
        self.max_output_tokens = (max_output_tokens if max_output_tokens is not None else
                                  min(params.max_tokens or room, room))
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        # Its sampling settings as its step rows take them (kept by state slot).
        self.sampling_row = sampling_row(
            params, seeds=seed, prompt_lens=self.num_prompt_tokens,
            wants_logprobs=params.logprobs is not None,
            has_bias=constraints is not None and constraints.has_row)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self._stops = self.eos_token_ids | self.stop_token_ids  # either ends it
        self._min_outputs = max(params.min_tokens, 1)  # before a stop token may end it
        # logit_bias, allowed_token_ids, bad_words (shared by a request's n children).
        self.constraints = constraints
        # Structured outputs: this sequence's llguidance matcher (None: unconstrained), and
        # the token it waits for before it applies (None: it applies from the start).
        self.grammar = grammar
        self.grammar_waits_for: int | None = None
        # A pooling request (embeddings, classification: core/pooling.py's PoolingState):
        # it ends when its prompt is computed, its sampled token discarded. None: generation.
        self.pooling = pooling
        # The LoRA adapter it runs with (a models.lora.LoRARequest; None: the base model),
        # and the device slot the scheduler gave it while it runs (-1: none).
        self.lora = lora
        self.lora_slot = -1
        self._init_tokens(prompt_token_ids)
        self._init_kv_state()
        self._init_policies(params, constraints, grammar, pooling)
        self.num_cached_tokens: int | None = None  # cache hits at its first admission
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_proposed = 0  # proposals in its last scheduled step (speculative decoding)
        self.spec_drafts = 0  # its steps that verified proposals
        self.spec_first_kept = 0  # of those, the ones that kept the first proposal
        self.state_slot = 0  # row of the device-side penalty state; 0 = none held
        # Set when a row is handed out; cleared when the next step is scheduled (the step
        # that reset the row has been dispatched by then).
        self.needs_state_reset = False
        self.cumulative_logprob = 0.0  # of the output tokens, when logprobs are asked for

    def _init_tokens(self, prompt_token_ids: list[int]) -> None:
        """Its token array (prompt, then room for its output budget) and the counts of what
        is known, computed and in flight."""
        # i32[max_model_len]: prompt then outputs; the first num_tokens entries are valid.
        self.token_ids = np.zeros(self.num_prompt_tokens + self.max_output_tokens, np.int32)
        self.token_ids[: self.num_prompt_tokens] = prompt_token_ids
        self.output_view = self.token_ids[self.num_prompt_tokens:]  # the outputs' slots
        self.num_tokens = self.num_prompt_tokens
        # Tokens whose KV is computed or being computed: the scheduler advances it when it
        # schedules a step (a step's first position is in SchedulerOutput.num_computed_tokens).
        self.num_computed_tokens = 0
        # Tokens that steps in flight are sampling for it, not known yet (asynchronous
        # scheduling schedules the next step before they come): its next input may be one.
        self.num_placeholders = 0
        self.steps_in_flight = 0  # scheduled steps holding it that are not folded in yet

    def _init_kv_state(self) -> None:
        """What it holds of the KV cache: its blocks and their prefix-cache hashes."""
        # Its KV blocks: one list per KV group (kv_cache_manager.py), all of one length;
        # [] while it holds none. dropped_blocks: per group, the leading entries released
        # behind a sliding window.
        self.block_ids: list[list[int]] = []
        self.dropped_blocks: list[int] = []
        # Prefix caching: the hash chain of every full block of token_ids (grows as blocks
        # fill, outputs included), and how many leading blocks are registered in the cache.
        self.block_hashes: list[bytes] = []
        self.extra_keys: tuple = ()  # hashed into every block (its adapter, a cache salt)
        self.num_registered_blocks = 0
        # The computed-token count its blocks hold with nothing for the KV cache manager to
        # do (no new block, no block to name): kept by the manager, read by the scheduler.
        self.kv_room = 0

    def _init_policies(self, params: SamplingParams, constraints: TokenConstraints | None,
                       grammar, pooling) -> None:
        """What its settings allow the scheduler and input builder (prefix-cache hits,
        speculation, steps over placeholders), decided once."""
        no_penalties = (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
                        and params.repetition_penalty == 1.0)
        # Prompt scoring needs every prompt position computed, and the device-side penalty
        # state counts only the tokens fed to the model: both must compute everything.
        # So does mean or first-token pooling (every position's hidden state is pooled).
        self.reads_prefix_cache = params.prompt_logprobs is None and no_penalties and not (
            pooling is not None and pooling.reads_all_tokens)
        # Speculative decoding proposes tokens only where every sampling stage is the same at
        # each proposed position: not with penalties (their counts would have to include the
        # proposals), bad words or structured outputs (their masks depend on the tokens
        # before), nor below min_tokens (see may_speculate).
        self.speculates = no_penalties and grammar is None and not (
                constraints is not None and constraints.bad_sequences)
        # What its step inputs read from its known output tokens, not only their count:
        # then no step is scheduled for it while a token it needs is still a placeholder.
        self.needs_known_tokens = grammar is not None or (
            constraints is not None and bool(constraints.bad_sequences))
        # Whether its step inputs need more than its scalars (a grammar mask, tokens banned
        # below min_tokens or by bad words): the input builder looks at those rows alone.
        self.step_extras = grammar is not None or params.min_tokens > 0 or (
            constraints is not None and bool(constraints.bad_sequences))

    @property
    def grammar_active(self) -> bool:
        return self.grammar is not None and self.grammar_waits_for is None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens].tolist()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens: self.num_tokens].tolist()

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, value: RequestStatus) -> None:
        self._status = value
        # Plain attributes: read for every request at every step.
        self.finished = value.finished
        self.running = value is RequestStatus.RUNNING

    @property
    def may_speculate(self) -> bool:
        """Whether proposals may be verified for it in its next step: it speculates, has
        reached min_tokens (no stop-token masks) and only its last token is left to compute
        (it is decoding)."""
        return (self.speculates and self.num_output_tokens >= self.params.min_tokens
                and self.num_computed_tokens == self.num_tokens - 1)

    @property
    def max_proposals(self) -> int:
        """Proposals that can still be used: one token always follows them, and the output
        ends at max_output_tokens."""
        return self.max_output_tokens - self.num_output_tokens - 1

    def set_proposals(self, token_ids) -> None:
        """Write proposed tokens after the known ones (scratch room: num_tokens stays), for
        the next step's input builder to feed."""
        self.token_ids[self.num_tokens: self.num_tokens + len(token_ids)] = token_ids

    def append_token(self, token_id: int) -> None:
        self.token_ids[self.num_tokens] = token_id
        self.num_tokens += 1

    def take_token(self, token: int) -> bool:
        """Append a sampled token and finish on it if it ends the sequence: EOS or a stop
        token id (once min_tokens are out), or the length limit. Whether it finished."""
        count = self.num_tokens
        self.token_ids[count] = token
        self.num_tokens = count + 1
        outputs = count + 1 - self.num_prompt_tokens
        if token in self._stops and outputs >= self._min_outputs:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = None if token in self.eos_token_ids else token
            return True
        if outputs >= self.max_output_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def drop_tokens_after(self, num_tokens: int) -> None:
        """Forget the tokens past the first num_tokens (of a finished request: a stop string
        ended it within the tokens one speculative step appended)."""
        if not self.finished or num_tokens < self.num_prompt_tokens:
            raise RuntimeError("only a finished request's output tokens can be dropped")
        self.num_tokens = min(self.num_tokens, num_tokens)

    def ended_by_token(self, token: int) -> bool:
        """Whether `token`, its last one, ended it: EOS or a stop token id (whose text is
        not part of the output)."""
        return self._status is RequestStatus.FINISHED_STOPPED and token in self._stops
