"""The step's field table (core/step_fields.py) and what is derived from it: the packed
step's layout and padding (input_builder.PackedStep), both backends' batch and sampling
types, the fields the two samplers read, and a request's SamplingRow. No model, no compile.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import numpy as np
import pytest

from jaxserve.core import step_fields
from jaxserve.core.input_builder import PackedStep
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_fields import (
    BATCH_FIELDS,
    ROW_FIELDS,
    SAMPLING_FIELDS,
    STEP_FIELDS,
    SamplingRow,
    StepField,
    sampling_row,
)

BATCH = [f.name for f in BATCH_FIELDS]
SAMPLING = [f.name for f in SAMPLING_FIELDS]
DTYPES = {f.name: f.dtype for f in STEP_FIELDS}


def test_the_table_names_each_field_once_with_a_32_bit_dtype():
    names = [f.name for f in STEP_FIELDS]
    assert len(names) == len(set(names))
    assert all(np.dtype(f.dtype).itemsize in (1, 4) for f in STEP_FIELDS)  # bool widened
    assert [f.group for f in STEP_FIELDS if f.group in ("feed", "lora")] == ["feed", "lora"]
    with pytest.raises(ValueError, match="only sampling fields"):
        StepField("x", "int32", 0, "batch", ("T",), source="params")


@pytest.mark.parametrize("groups,lora", [(1, False), (3, True)])
def test_the_packed_step_is_laid_out_and_padded_by_the_table(groups, lora):
    T, R, B = 32, 8, 5
    step = PackedStep(T, R, B, groups, lora)
    fields = [f for f in STEP_FIELDS if lora or f.group != "lora"]
    assert step.layout == tuple((f.name, f.dims(T, R, B, groups), f.dtype) for f in fields)
    g = (groups,) if groups > 1 else ()
    shapes = {name: shape for name, shape, _ in step.layout}
    assert shapes["block_tables"] == g + (R, B) and shapes["slot_mapping"] == g + (T,)
    assert shapes["cu_q_lens"] == (R + 1,) and shapes["num_seqs"] == (1,)
    assert shapes["banned_ids"] == (R, step_fields.MAX_BANNED_IDS)
    batch, sampling = step.arrays(step.template.copy())
    assert list(batch) == [f.name for f in fields if f.group in ("batch", "feed")]
    assert list(sampling) == [f.name for f in fields if f.group in ("sampling", "lora")]
    for field in fields:
        array = {**batch, **sampling}[field.name]
        assert array.dtype == np.dtype(field.dtype), field.name
        assert (array == np.asarray(field.pad, field.dtype)).all(), field.name


def test_the_jax_batch_and_sampling_inputs_are_the_tables():
    import jax

    from jaxserve.backends.jax.batch import Batch, SamplingInputs
    from jaxserve.backends.jax.packing import unpack

    assert [f.name for f in dataclasses.fields(Batch)] == BATCH
    assert [f.name for f in dataclasses.fields(SamplingInputs)] == SAMPLING
    step = PackedStep(16, 4, 3, lora=True)
    arrays = jax.eval_shape(lambda packed: unpack(packed, step.layout), step.buffer)
    assert {name: a.dtype.name for name, a in arrays.items()} == DTYPES
    sampling = SamplingInputs(**{name: arrays[name] for name in SAMPLING})
    assert len(jax.tree_util.tree_leaves(sampling)) == len(SAMPLING)


def test_the_torch_batch_and_sampling_inputs_are_the_tables():
    import torch

    from jaxserve.backends.torch.batch import (
        TorchBatch,
        TorchSamplingInputs,
        batch_on,
        sampling_on,
    )

    assert [f.name for f in dataclasses.fields(TorchBatch)] == BATCH
    assert [f.name for f in dataclasses.fields(TorchSamplingInputs)] == SAMPLING
    step = PackedStep(16, 4, 3)
    batch_np, sampling_np = step.arrays(step.template.copy())
    cpu = torch.device("cpu")
    on_device = {**vars(batch_on(batch_np, cpu)), **vars(sampling_on(sampling_np, cpu))}
    # uint32 travels as its int32 bits (torch has no uint32 arithmetic)
    expected = {"int32": torch.int32, "uint32": torch.int32, "float32": torch.float32,
                "bool": torch.bool}
    assert {name: t.dtype for name, t in on_device.items()} == {
        name: expected[DTYPES[name]] for name in BATCH + SAMPLING}


@pytest.mark.parametrize("module", ["jaxserve.backends.jax.sampler",
                                    "jaxserve.backends.torch.sampler"])
def test_the_samplers_read_only_the_tables_sampling_fields(module):
    import importlib

    source = inspect.getsource(importlib.import_module(module))
    # s.name on the device, s["name"] on the host (torch's StepFlags)
    read = set(re.findall(r"\bs\.([a-z_]+)\b", source)) | set(
        re.findall(r"\bs\[\"([a-z_]+)\"\]", source))
    assert read and read <= set(SAMPLING), read - set(SAMPLING)


def test_a_requests_sampling_row_is_a_named_tuple_of_the_row_fields():
    assert issubclass(SamplingRow, tuple)
    assert SamplingRow._fields == tuple(f.name for f in ROW_FIELDS)
    settings = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {f.name for f in ROW_FIELDS if f.source == "params"} <= settings
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1,
                            presence_penalty=0.25, frequency_penalty=-0.5,
                            repetition_penalty=1.5, logprobs=2, seed=11)
    request = Request("r", [1, 2, 3], params, seed=11, max_model_len=16,
                      eos_token_ids=frozenset())
    row = request.sampling_row
    assert isinstance(row, SamplingRow)
    for field in ROW_FIELDS:
        if field.source == "params":
            assert getattr(row, field.name) == getattr(params, field.name), field.name
    assert (row.seeds, row.prompt_lens, row.wants_logprobs, row.has_bias) == (11, 3, True,
                                                                               False)
    with pytest.raises(TypeError):
        sampling_row(params, seeds=1, prompt_lens=3, wants_logprobs=False)  # has_bias missing
