"""Hugging Face safetensors checkpoints read into the engine's parameter layout, numpy only.

Both backends load weights through this module: it reads the format directly
(models/safetensors_format.py: a JSON header, then raw little-endian tensors,
memory-mapped), so no code from the model folder runs and nothing is unpickled, and
bfloat16 comes through ml_dtypes. A model family maps
each checkpoint tensor name to its parameter path(s) and transform (models/*_arch.py);
parameter_values checks every tensor against the shapes the model expects, stacks
per-expert tensors, and yields finished parameters one by one, so a backend places each
(JAX: onto its sharding; torch: into its module) and the host never holds the whole model.
named_values does the same for tensors given by name (a weight update's: any subset of the
checkpoint's names, through the same mapping).
Each file's header is checked first as the safetensors library checks it (header size,
JSON object, known dtypes, byte sizes that match shapes, tensors tiling the data buffer
with no gap or overlap), so a malformed or hostile file fails with a ValueError naming it
instead of loading garbage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.config.progress import progress
from jaxserve.models.pieces import Piece
from jaxserve.models.quant_config import LinearQuant
from jaxserve.models.quant_tensors import QuantTensor, combine, engine_layout, is_piece, pieces
from jaxserve.models.quantization import CONTRACTED
from jaxserve.models.safetensors_format import read_header as _read_header
from jaxserve.models.safetensors_format import (  # noqa: F401 - re-exported
    read_safetensors,
    safetensors_files,
)

# The host dtype parameter values are read in, per model dtype (ModelConfig.dtype); each
# backend pairs it with its own dtype of the same name.
HOST_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Parameters kept in float32 whatever the model's dtype (vLLM keeps them so too): DeepSeek-V3's
# router correction bias, whose small differences choose the experts.
FLOAT32_PARAMS = frozenset({"score_correction"})


def _targets(target) -> list[tuple]:
    """path_of's answer as a list of (path, transform, expert index or None)."""
    if target is None:
        return []
    if isinstance(target, list):
        return [t for one in target for t in _targets(one)]
    path, transform, *index = target
    return [(path, transform, index[0] if index else None)]


def parameter_values(folder: str | Path, path_of: Callable, shapes: dict[tuple, tuple],
                     dtype, quant: LinearQuant | None = None, *, partial: bool = False
                     ) -> Iterator[tuple[tuple, np.ndarray]]:
    """Yield (parameter path, host array) for every parameter of `shapes` (path -> shape the
    model expects), read from the checkpoint in `folder`, with a progress bar. Float
    parameters come in `dtype`; a checkpoint-quantized kernel (quant: the checkpoint's
    LinearQuant) comes as its stored components (quantization.stored_shapes), each under
    the kernel's path plus the component's name, in their own dtypes.

    path_of(name) -> None (skip), (param path, transform), (param path, transform, index) for
    slice `index` of the parameter's first axis (per-expert tensors stacked into one [E, ...]
    parameter), a list of such targets (one fused tensor feeding several parameters), or a
    Piece (a tensor stored as several, e.g. MXFP4's blocks and scales: once all have
    arrived, the combined tensor is mapped by its own name); raises KeyError for unknown
    names. A quantized module's tensors (`X.qweight`, `X.scales`, ...) are gathered the same
    way and mapped as `X.weight` (quant_tensors.py). A stacked parameter is staged in one
    host array and yielded once all its slices have arrived. Raises ValueError naming the
    first tensor that does not fit, or the parameters the checkpoint lacks (partial: the
    folder may hold only some of them, as a weight update's may).
    """
    files = safetensors_files(folder)
    headers = [_read_header(f)[1] for f in files]
    names = {name for header in headers for name in header}
    mapped = _quantized_path_of(path_of, quant, names) if quant else path_of
    tensors = ((file.name, name, array) for file in files
               for name, array in read_safetensors(file))
    yield from _mapped(tensors, len(names), mapped, path_of, shapes, dtype, quant,
                       f"The checkpoint in {folder}", partial)


def named_values(tensors: dict, path_of: Callable, shapes: dict[tuple, tuple],
                 dtype) -> Iterator[tuple[tuple, np.ndarray]]:
    """parameter_values for {checkpoint tensor name: host array} (a weight update's tensors,
    any subset of the checkpoint's): the same mapping (path_of), checks and transforms, for
    the parameters those tensors give."""
    yield from _mapped(((None, name, array) for name, array in tensors.items()), len(tensors),
                       path_of, path_of, shapes, dtype, None, "update_weights", partial=True,
                       desc="Updating weights")


def _mapped(tensors, total: int, mapped: Callable, path_of: Callable, shapes: dict, dtype,
            quant, source: str, partial: bool, desc: str = "Loading weights"):
    """parameter_values over (file name or None, tensor name, array) triples; source names
    where they come from in the errors about the whole set."""
    staged: dict[tuple, tuple[np.ndarray, set]] = {}  # path -> (stack, slices filled)
    pieces: dict[str, dict] = {}  # tensor name -> {piece: array} of a Piece-stored tensor
    done: set[tuple] = set()
    with progress(total=total, desc=desc, unit="tensor") as bar:
        for file, name, array in tensors:
            bar.update(1)
            at = f"{file}: " if file else ""
            try:
                target = mapped(name)
                if isinstance(target, Piece):  # the tensor once all its pieces arrived
                    name, array = _combine(pieces, target, array, f"{at}{name!r}")
                    if array is None:
                        continue
                    target = path_of(name)
                targets = _targets(target)
            except KeyError:
                hint = ("the checkpoint does not match its config.json" if file else
                        "this model has no weight of that name (give the Hugging Face "
                        "checkpoint's tensor names)")
                raise ValueError(f"{at}unexpected tensor {name!r} for this architecture; "
                                 f"{hint}.") from None
            for path, transform, index in targets:
                where = f"{at}tensor {name!r}"
                for part_path, value in _values(path, transform, index, array, shapes,
                                                dtype, quant, where):
                    if index is not None:
                        value = _stage(staged, part_path, value, index,
                                       shapes[part_path], where)
                        if value is None:
                            continue
                    done.add(part_path)
                    yield part_path, value
    if pieces:
        name, got = next(iter(pieces.items()))
        raise ValueError(f"{source} has only the {', '.join(sorted(got))} of tensor "
                         f"{name!r} (and {len(pieces) - 1} more incomplete); it is truncated "
                         "or corrupt.")
    if partial and staged:
        path, (stack, filled) = next(iter(staged.items()))
        raise ValueError(f"{source}: {'.'.join(map(str, path))} is stacked from one tensor "
                         f"per expert, and only {len(filled)} of its {stack.shape[0]} were "
                         "given; give every expert's tensor (the parameter is replaced "
                         "whole).")
    missing = sorted(set(shapes) - done, key=str)
    if missing and not partial:
        names = ", ".join(".".join(map(str, p)) for p in missing[:5])
        raise ValueError(f"{source} lacks {len(missing)} weights the model needs, e.g. "
                         f"{names}.")


def _quantized_path_of(path_of: Callable, quant: LinearQuant, names: set[str]) -> Callable:
    """path_of with a quantized module's tensors as Pieces of its `X.weight`."""

    def mapped(name: str):
        module, _, suffix = name.rpartition(".")
        if module and is_piece(quant, suffix):
            parts = pieces(quant, module, names)
            if parts is not None and suffix in parts:
                return Piece(f"{module}.weight", suffix, parts,
                             lambda got, module=module: combine(quant, got, module))
        return path_of(name)

    return mapped


def _values(path: tuple, transform, index, array, shapes: dict, dtype, quant, where: str):
    """[(parameter path, host value)] of one target: the transformed tensor, or a quantized
    kernel's stored components; ValueError when it does not fit the model."""
    wanted = lambda p: shapes[p][1:] if index is not None else shapes[p]
    stored = path + ("values",) in shapes
    if isinstance(array, QuantTensor):
        if not stored:
            raise ValueError(f"{where} is stored quantized ({quant.label if quant else 'MXFP4'}), "
                             f"but {'.'.join(map(str, path))} is not among the kernels "
                             "jaxserve keeps quantized (the attention, MLP and expert "
                             "projections that quantization_config covers).")
        contracted = tuple(c - (index is not None) for c in CONTRACTED[str(path[-1])])
        try:
            parts = engine_layout(array, transform, contracted, quant)
        except ValueError as e:
            raise ValueError(f"{where}: {e}.") from None
        out = []
        for part, value in parts.items():
            if value.shape != tuple(wanted(path + (part,))):
                raise ValueError(f"{where} has shape {array.shape}, which does not fit "
                                 f"{'.'.join(map(str, path))} from config.json (its {part} "
                                 f"would be {value.shape}, not {tuple(wanted(path + (part,)))}).")
            out.append((path + (part,), value))
        return out
    if stored:
        raise ValueError(f"{where} is stored unquantized ({array.dtype}), but "
                         f"quantization_config ({quant.label if quant else '?'}) quantizes "
                         f"{'.'.join(map(str, path))}; per-layer exceptions are not supported.")
    if path not in shapes:
        raise ValueError(f"{where} has no place in the model built from config.json.")
    kept = np.float32 if path[-1] in FLOAT32_PARAMS else dtype
    value = np.asarray(transform(array) if transform else array).astype(kept)
    if value.shape != tuple(wanted(path)):
        raise ValueError(f"{where} has shape {array.shape}, which does not fit "
                         f"{tuple(wanted(path))} from config.json.")
    return [(path, value)]


def _combine(pending: dict, target: Piece, array, where: str):
    """(tensor name, combined array) once target's last piece arrives, else (name, None)."""
    got = pending.setdefault(target.tensor, {})
    if target.piece in got:
        raise ValueError(f"{where}: a second {target.piece} of {target.tensor!r}.")
    got[target.piece] = array
    if len(got) < len(target.pieces):
        return target.tensor, None
    del pending[target.tensor]
    try:
        return target.tensor, target.combine(got)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _stage(staged: dict, path: tuple, value: np.ndarray, index: int, shape: tuple, where: str):
    """Put one slice of a stacked parameter into its host staging array; the whole stack
    (and the staging array released) once every slice has arrived, else None."""
    if not 0 <= index < shape[0]:
        raise ValueError(f"{where} is slice (expert) {index} of a parameter that has "
                         f"{shape[0]} from config.json.")
    stack, filled = staged.setdefault(path, (np.empty(shape, value.dtype), set()))
    stack[index] = value
    filled.add(index)
    if len(filled) < shape[0]:
        return None
    del staged[path]
    return stack
