"""The ragged batch one device step consumes (docs/architecture.md's layout), as JAX pytrees.

T tokens from R sequences, padded to a (T, R) bucket. Padding tokens write their K/V into the
null block 0 and their rows are ignored; padding sequences have kv_len 0.

Both types are made from the step's field table (core/step_fields.py): Batch holds its
"batch" fields, SamplingInputs its "sampling" fields, in the table's order, so a field added
there is a field here.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.core.step_fields import BATCH_FIELDS, SAMPLING_FIELDS, fields_comment


def _pytree(name: str, fields, doc: str) -> type:
    """A frozen dataclass of jax.Array fields, registered as a pytree."""
    cls = dataclasses.make_dataclass(name, [(f.name, jax.Array) for f in fields],
                                     frozen=True)
    cls.__module__, cls.__doc__ = __name__, f"{doc}\n\n{fields_comment(fields)}\n"
    return jax.tree_util.register_dataclass(cls)


Batch = _pytree("Batch", BATCH_FIELDS, "The ragged batch the model reads (G: with several "
                "KV groups only).")
SamplingInputs = _pytree("SamplingInputs", SAMPLING_FIELDS, "Per-sequence sampling settings "
                         "as arrays, so any mix runs in one compiled step.")
