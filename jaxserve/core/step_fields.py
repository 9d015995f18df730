"""The step's fields: one table of every array a device step takes (host side, numpy only).

Each field has a name, a dtype, the value its padding tokens and rows hold, its shape in the
shape letters of docs/architecture.md, and a group:

- "batch": the ragged batch the model reads (batch.Batch on the JAX backend, batch.TorchBatch
  on the torch backend);
- "feed": read by the step before the model runs (a placeholder position's state slot);
- "sampling": the sampler's per-row settings (batch.SamplingInputs, batch.TorchSamplingInputs);
- "lora": only with LoRA adapters (enable_lora): each token's adapter slot.

A sampling field also says where its value comes from: "step" (the input builder computes
it each step), "params" (the SamplingParams attribute of the same name) or "request" (the
request's own value: its resolved seed, prompt length, ...). The "params" and "request"
fields form a request's SamplingRow, built once per request by sampling_row and kept by
state slot in the input builder.

Everything else follows from the table: the packed step's layout (the table's order, each
field's dtype and shape: input_builder.PackedStep), both backends' batch and sampling types
and their field lists, and SamplingRow. A new sampling setting is a "params" row here (its
neutral value as the padding), its SamplingParams parameter, and its use in the samplers.
"""

from __future__ import annotations

import collections
import dataclasses

# Tokens masked in one step of one sequence (X): its stop tokens while below min_tokens,
# and the last tokens of multi-token bad words whose other tokens end the output.
MAX_BANNED_IDS = 32

GROUPS = ("batch", "feed", "sampling", "lora")
SOURCES = ("step", "params", "request")
_SHORT = {"int32": "i32", "uint32": "u32", "float32": "f32", "bool": "bool"}


@dataclasses.dataclass(frozen=True)
class StepField:
    """One array of a step's inputs. shape: letters of docs/architecture.md, plus "R+1",
    "1", X = MAX_BANNED_IDS and G, the KV groups (config/kv_groups.py), present only when
    there are several."""

    name: str
    dtype: str  # numpy dtype name; each travels as 32 bits in the packed buffer
    pad: int | float  # padding's value: for a sampling setting, its neutral value
    group: str  # one of GROUPS
    shape: tuple[str, ...]
    doc: str = ""
    source: str = "step"  # one of SOURCES (sampling fields)

    def __post_init__(self) -> None:
        if self.group not in GROUPS or self.source not in SOURCES or \
                self.dtype not in _SHORT:
            raise ValueError(f"step field {self.name!r}: group {self.group!r}, source "
                             f"{self.source!r}, dtype {self.dtype!r}")
        if self.source != "step" and self.group != "sampling":
            raise ValueError(f"step field {self.name!r}: only sampling fields come from a "
                             "request")

    @property
    def comment(self) -> str:
        """Its shape comment, as `i32[G, R, B]`."""
        return f"{_SHORT[self.dtype]}[{', '.join(self.shape)}]"

    def dims(self, num_tokens: int, num_rows: int, blocks_per_seq: int,
             num_groups: int = 1) -> tuple[int, ...]:
        """Its shape in a (T, R) bucket."""
        sizes = {"T": num_tokens, "R": num_rows, "R+1": num_rows + 1, "B": blocks_per_seq,
                 "X": MAX_BANNED_IDS, "1": 1, "G": num_groups}
        return tuple(sizes[d] for d in self.shape if d != "G" or num_groups > 1)


F = StepField
# In packing order.
STEP_FIELDS = (
    F("token_ids", "int32", 0, "batch", ("T",)),
    F("positions", "int32", 0, "batch", ("T",)),
    F("slot_mapping", "int32", 0, "batch", ("G", "T"),
      "flat KV slot = block_id * block_size + offset"),
    F("feed_slots", "int32", 0, "feed", ("T",),
      "a placeholder's state slot, whose last sampled token it takes; 0: a known token"),
    F("cu_q_lens", "int32", 0, "batch", ("R+1",),
      "query start of each sequence in the T tokens"),
    F("kv_lens", "int32", 0, "batch", ("R",), "context length of each sequence after the step"),
    F("block_tables", "int32", 0, "batch", ("G", "R", "B")),
    F("num_seqs", "int32", 0, "batch", ("1",)),
    F("logits_indices", "int32", 0, "batch", ("R",), "the token whose logits are sampled"),
    F("temperature", "float32", 1, "sampling", ("R",), "0 = greedy", "params"),
    F("top_k", "int32", 0, "sampling", ("R",), "0 = disabled", "params"),
    F("top_p", "float32", 1, "sampling", ("R",), "", "params"),
    F("min_p", "float32", 0, "sampling", ("R",), "", "params"),
    F("presence_penalty", "float32", 0, "sampling", ("R",), "", "params"),
    F("frequency_penalty", "float32", 0, "sampling", ("R",), "", "params"),
    F("repetition_penalty", "float32", 1, "sampling", ("R",), "", "params"),
    F("seeds", "uint32", 0, "sampling", ("R",), "", "request"),
    F("sample_positions", "int32", 0, "sampling", ("R",),
      "position of the token being sampled (RNG fold-in)"),
    F("state_slots", "int32", 0, "sampling", ("R",),
      "row of the penalty state; 0 = scratch row for padding"),
    F("reset_state", "bool", 0, "sampling", ("R",), "the sequence starts from scratch"),
    F("prompt_lens", "int32", 0, "sampling", ("R",), "", "request"),
    F("wants_logprobs", "bool", 0, "sampling", ("R",),
      "the request asked for logprobs of sampled tokens", "request"),
    F("banned_ids", "int32", -1, "sampling", ("R", "X"),
      "tokens masked this step (stop ids before min_tokens, bad words' last tokens); -1 pad"),
    F("has_bias", "bool", 0, "sampling", ("R",),
      "add the row's logit bias (PenaltyState.logit_bias)", "request"),
    F("has_grammar", "bool", 0, "sampling", ("R",),
      "mask by the row's grammar (PenaltyState.grammar_mask)"),
    F("num_proposed", "int32", 0, "sampling", ("R",),
      "speculative proposals among the row's last tokens: sampled at each and at the last"),
    F("lora_slots", "int32", -1, "lora", ("T",), "each token's adapter slot; -1: base model"),
)
del F

BATCH_FIELDS = tuple(f for f in STEP_FIELDS if f.group == "batch")
SAMPLING_FIELDS = tuple(f for f in STEP_FIELDS if f.group == "sampling")
# A request's sampling settings, kept by state slot (SamplingRow's fields).
ROW_FIELDS = tuple(f for f in SAMPLING_FIELDS if f.source != "step")

SamplingRow = collections.namedtuple("SamplingRow", [f.name for f in ROW_FIELDS],
                                     module=__name__)
SamplingRow.__doc__ = ("A request's sampling settings as its step rows take them: "
                       "ROW_FIELDS, built by sampling_row.")
_FROM_PARAMS = tuple(f.name for f in ROW_FIELDS if f.source == "params")


def sampling_row(params, **own) -> SamplingRow:
    """A request's SamplingRow: each "params" field read from `params` (its SamplingParams),
    each "request" field given by keyword (TypeError when one is missing or unknown)."""
    return SamplingRow(**{name: getattr(params, name) for name in _FROM_PARAMS}, **own)


def fields_comment(fields) -> str:
    """One line per field (name, shape comment, doc), for the docstrings of the types
    derived from the table."""
    return "\n".join(f"    {f.name}: {f.comment}" + (f"  {f.doc}" if f.doc else "")
                     for f in fields)

