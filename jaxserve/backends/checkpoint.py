"""Hugging Face safetensors checkpoints read into the engine's parameter layout, numpy only.

Both backends load weights through this module: it reads the format directly (a JSON
header, then raw little-endian tensors, memory-mapped), so no code from the model folder
runs and nothing is unpickled, and bfloat16 comes through ml_dtypes. A model family maps
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

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.config.progress import progress
from jaxserve.models.pieces import Piece
from jaxserve.models.quant_config import LinearQuant
from jaxserve.models.quant_tensors import QuantTensor, combine, engine_layout, is_piece, pieces
from jaxserve.models.quantization import CONTRACTED

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
# safetensors' MAX_HEADER_SIZE: refuse a hostile length before reading or allocating it.
_MAX_HEADER = 100_000_000


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's shard files, in index order; a clear error when there are none."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    found = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    hint = (f" It has {', '.join(sorted(found))}: PyTorch pickles are never loaded (they can run "
            "code); convert them to safetensors first." if found else "")
    raise ValueError(f"No *.safetensors weights in {folder}.{hint}")


def _read_header(path: Path) -> tuple[int, dict]:
    """(header length, {tensor name: info}) of a safetensors file, metadata dropped, after
    checking the header and the tensors' layout as the safetensors library does; a
    ValueError naming the file (and tensor) and the fault otherwise."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path.name}: only {size} bytes, too short for a safetensors file "
                             "(it starts with an 8-byte header length); truncated or not "
                             "safetensors.")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER:
            raise ValueError(f"{path.name}: header length {header_len} exceeds safetensors' "
                             f"limit of {_MAX_HEADER} bytes; corrupt or not safetensors.")
        if 8 + header_len > size:
            raise ValueError(f"{path.name}: header length {header_len} runs past the end of "
                             f"the {size}-byte file; truncated or corrupt.")
        raw = f.read(header_len)
    if len(raw) != header_len:  # the file shrank after stat
        raise ValueError(f"{path.name}: file is truncated inside its header.")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, or hostile nesting
        raise ValueError(f"{path.name}: header is not valid UTF-8 JSON ({type(e).__name__}: "
                         f"{str(e)[:200]}).") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: header is a JSON {type(header).__name__}, not an "
                         "object of tensor entries.")
    metadata = header.pop("__metadata__", None)  # null is allowed, as safetensors allows it
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise ValueError(f"{path.name}: __metadata__ must be a JSON object of string to string.")
    _check_layout(path, header, size - 8 - header_len)
    return header_len, header


def _is_count(value) -> bool:
    """A non-negative JSON integer (Python's bool is an int, JSON's true is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(path: Path, header: dict, buffer_size: int) -> None:
    """Every entry well formed with as many bytes as its shape and dtype need, and the
    entries tiling the data buffer exactly from 0, as safetensors requires: a gap or an
    overlap means a corrupt or crafted file, never a valid one."""
    spans = []
    for name, info in header.items():
        where = f"{path.name}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ValueError(f"{where}: entry is not a JSON object.")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ValueError(f"{where} has unsupported dtype {dtype!r:.40} (known: "
                             f"{', '.join(_DTYPES)}).")
        if not (isinstance(shape, list) and all(map(_is_count, shape))):
            raise ValueError(f"{where}: shape {shape!r:.80} is not a list of non-negative integers.")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise ValueError(f"{where}: data_offsets {offsets!r:.80} is not two non-negative "
                             "integers.")
        begin, end = offsets
        if begin > end:
            raise ValueError(f"{where}: data_offsets begin {begin} is after end {end}.")
        if end > buffer_size:
            raise ValueError(f"{where}: data ends at {end}, past the {buffer_size}-byte data "
                             "buffer; truncated or corrupt.")
        # Capped so a hostile shape cannot build a huge int; any capped count is too big.
        count = 0 if 0 in shape else 1
        for dim in shape:
            count = min(count * dim, buffer_size + 1)
        need = count * np.dtype(_DTYPES[dtype]).itemsize
        if end - begin != need:
            needs = f"{need} bytes" if count <= buffer_size else "more bytes than the file has"
            raise ValueError(f"{where}: data_offsets span {end - begin} bytes, but shape "
                             f"{shape!r:.80} of {dtype} needs {needs}.")
        spans.append((begin, end, name))
    reached = 0
    for begin, end, name in sorted(spans):
        if begin != reached:
            fault = "overlaps the data before it" if begin < reached else "starts after a gap"
            raise ValueError(f"{path.name}: tensor {name!r} at bytes {begin}-{end} {fault} "
                             f"(previous data ends at {reached}); corrupt or crafted file.")
        reached = end
    if reached != buffer_size:
        raise ValueError(f"{path.name}: data buffer is {buffer_size} bytes but the tensors "
                         f"cover {reached}; truncated, padded or corrupt.")


def read_safetensors(path: Path):
    """Yield (name, numpy array view) for every tensor of one file, memory-mapped, after
    _read_header's checks."""
    header_len, header = _read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        try:
            array = data[begin:end].view(dtype).reshape(info["shape"])
        except ValueError as e:  # e.g. more dimensions than numpy supports
            raise ValueError(f"{path.name}: tensor {name!r} cannot be read: {e}") from None
        yield name, array


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
    value = np.asarray(transform(array) if transform else array).astype(dtype)
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
