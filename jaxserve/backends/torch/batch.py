"""The torch backend's step inputs: the JAX backend's Batch and SamplingInputs
(backends/jax/batch.py) as torch tensors on the runner's device.

Both types are made from the step's field table (core/step_fields.py), with its fields in
its order: TorchBatch the "batch" fields (what the model and its attention read),
TorchSamplingInputs the "sampling" fields (what the sampler reads).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from jaxserve.core.step_fields import BATCH_FIELDS, SAMPLING_FIELDS, fields_comment

BATCH_NAMES = tuple(f.name for f in BATCH_FIELDS)
SAMPLING_NAMES = tuple(f.name for f in SAMPLING_FIELDS)


def _tensors(name: str, fields, doc: str, frozen: bool) -> type:
    """A dataclass of torch.Tensor fields."""
    cls = dataclasses.make_dataclass(name, [(f.name, torch.Tensor) for f in fields],
                                     frozen=frozen)
    cls.__module__, cls.__doc__ = __name__, f"{doc}\n\n{fields_comment(fields)}\n"
    return cls


# Not frozen: a step's placeholders replace its token_ids on the device.
TorchBatch = _tensors("TorchBatch", BATCH_FIELDS, "batch.Batch's fields as int32 torch "
                      "tensors on the runner's device (one KV group: no G).", False)
TorchSamplingInputs = _tensors("TorchSamplingInputs", SAMPLING_FIELDS, "batch.SamplingInputs' "
                               "fields as torch tensors on the runner's device (uint32 as "
                               "its int32 bits).", True)


def to_device(value: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host input on the device; bool stays bool, uint32 travels as its int32 bits."""
    if value.dtype == np.uint32:
        value = value.view(np.int32)
    return torch.from_numpy(np.ascontiguousarray(value)).to(device, non_blocking=True)


def batch_on(arrays: dict, device: torch.device) -> TorchBatch:
    """input_builder's batch arrays (the "feed" field left out) as a TorchBatch."""
    return TorchBatch(**{name: to_device(arrays[name], device) for name in BATCH_NAMES})


def sampling_on(arrays: dict, device: torch.device) -> TorchSamplingInputs:
    """input_builder's sampling arrays as TorchSamplingInputs."""
    return TorchSamplingInputs(**{name: to_device(arrays[name], device)
                                  for name in SAMPLING_NAMES})


def token_rows(batch: dict, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(row i64[T], real bool[T]) of each token of a step's host batch arrays."""
    cu = batch["cu_q_lens"]
    num_seqs = int(batch["num_seqs"][0])
    tok = np.arange(num_tokens)
    seq = np.minimum(np.searchsorted(cu[1:], tok, side="right"), len(cu) - 2)
    return seq.astype(np.int64), tok < cu[num_seqs]
