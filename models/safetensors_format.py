"""The safetensors format read directly, numpy only: a JSON header, then raw little-endian
tensors, memory-mapped, so nothing is unpickled and no code runs; bfloat16 and fp8 through
ml_dtypes. Each file's header is checked first as the safetensors library checks it (header
size, JSON object, known dtypes, byte sizes that match shapes, tensors tiling the data buffer
with no gap or overlap), so a malformed or hostile file fails with a ValueError naming it
instead of loading garbage. Checkpoints (backends/checkpoint.py) and LoRA adapters
(models/lora.py) are read through it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
# safetensors' MAX_HEADER_SIZE: refuse a hostile length before reading or allocating it.
MAX_HEADER = 100_000_000


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


def read_header(path: Path) -> tuple[int, dict]:
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
        if header_len > MAX_HEADER:
            raise ValueError(f"{path.name}: header length {header_len} exceeds safetensors' "
                             f"limit of {MAX_HEADER} bytes; corrupt or not safetensors.")
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
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"{where} has unsupported dtype {dtype!r:.40} (known: "
                             f"{', '.join(DTYPES)}).")
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
        need = count * np.dtype(DTYPES[dtype]).itemsize
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
    read_header's checks."""
    header_len, header = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]])
        try:
            array = data[begin:end].view(dtype).reshape(info["shape"])
        except ValueError as e:  # e.g. more dimensions than numpy supports
            raise ValueError(f"{path.name}: tensor {name!r} cannot be read: {e}") from None
        yield name, array
