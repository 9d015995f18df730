"""The safetensors reader against hand-written malformed and hostile files: each fails with
a ValueError naming the file (and tensor) and the fault, never another exception or a
silent wrong load; a file from the safetensors library itself reads back exactly."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from jaxserve.backends.checkpoint import _read_header, read_safetensors


def write(path, header, data=b"", header_len=None):
    """A safetensors file by hand: u64 little-endian header length, JSON header, data.
    `header` may be bytes (written as is); `header_len` overrides the stated length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    stated = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", stated) + raw + data)
    return path


def read_all(path):
    return {name: np.array(array) for name, array in read_safetensors(path)}


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_reads_a_file_written_by_the_safetensors_library(tmp_path):
    from safetensors.numpy import save_file

    tensors = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        "q": np.arange(-5, 5, dtype=np.int8).reshape(2, 5),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    got = read_all(path)
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        np.testing.assert_array_equal(got[name], want)
    assert len(_read_header(path)[1]) == len(tensors)  # the progress bar's count


def test_reads_bfloat16_and_an_empty_file(tmp_path):
    values = np.array([1.5, -2.0, 0.25], dtype=ml_dtypes.bfloat16)
    path = write(tmp_path / "bf16.safetensors", {"x": entry("BF16", [3], 0, 6)}, values.tobytes())
    got = read_all(path)["x"]
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, values)
    assert read_all(write(tmp_path / "none.safetensors", {"__metadata__": {}})) == {}


GOOD_DATA = np.arange(4, dtype=np.float32).tobytes()  # 16 bytes: a [4] F32 tensor


@pytest.mark.parametrize("header, data, header_len, match", [
    ({}, b"", 2**63, "header length 9223372036854775808 exceeds"),
    ({}, b"", 1000, "header length 1000 runs past the end"),
    (b"{not json", b"", None, "not valid UTF-8 JSON"),
    (b'{"a": "\xff"}', b"", None, "not valid UTF-8 JSON"),
    (b"[" * 100_000 + b"]" * 100_000, b"", None, "not valid UTF-8 JSON"),
    ([1, 2], b"", None, "header is a JSON list"),
    ({"__metadata__": {"k": 1}}, b"", None, "__metadata__ must be"),
    ({"x": [1]}, b"", None, "tensor 'x': entry is not a JSON object"),
    ({"x": entry("F8_E9", [4], 0, 16)}, GOOD_DATA, None, "tensor 'x' has unsupported dtype"),
    ({"x": {"shape": [4], "data_offsets": [0, 16]}}, GOOD_DATA, None, "unsupported dtype None"),
    ({"x": entry("F32", [-4], 0, 16)}, GOOD_DATA, None, r"tensor 'x': shape \[-4\] is not"),
    ({"x": entry("F32", [2.0, 2], 0, 16)}, GOOD_DATA, None, "tensor 'x': shape"),
    ({"x": entry("F32", [True, 4], 0, 16)}, GOOD_DATA, None, "tensor 'x': shape"),
    ({"x": entry("F32", [4], -16, 0)}, GOOD_DATA, None, "tensor 'x': data_offsets"),
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0]}}, GOOD_DATA, None,
     "tensor 'x': data_offsets"),
    ({"x": entry("F32", [0], 16, 0)}, GOOD_DATA, None, "begin 16 is after end 0"),
    ({"x": entry("F32", [4], 0, 16), "y": entry("F32", [2], 8, 16)}, GOOD_DATA, None,
     "tensor 'y' at bytes 8-16 overlaps"),
    ({"x": entry("F32", [2], 0, 8), "y": entry("F32", [1], 12, 16)}, GOOD_DATA, None,
     "tensor 'y' at bytes 12-16 starts after a gap"),
    ({"x": entry("F32", [3], 0, 16)}, GOOD_DATA, None, "tensor 'x': data_offsets span 16 bytes"),
    ({"x": entry("I8", [2**40, 2**40], 0, 16)}, GOOD_DATA, None,
     "needs more bytes than the file has"),
    ({"x": entry("F32", [4], 0, 16)}, GOOD_DATA + b"\0", None, "data buffer is 17 bytes"),
    ({"x": entry("F32", [4], 0, 16)}, GOOD_DATA[:12], None, "tensor 'x': data ends at 16"),
    ({"x": entry("F32", [4], 0, 16), "y": entry("F32", [0], 20, 20)}, GOOD_DATA, None,
     "tensor 'y': data ends at 20"),
])
def test_malformed_file_raises_value_error_naming_it(tmp_path, header, data, header_len,
                                                      match):
    path = write(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(ValueError, match=match) as info:
        read_all(path)
    assert "bad.safetensors" in str(info.value)
    with pytest.raises(ValueError, match=match):  # the progress bar's count checks too
        _read_header(path)


@pytest.mark.parametrize("content", [b"", b"\x10\0\0"])
def test_file_shorter_than_the_length_prefix(tmp_path, content):
    path = tmp_path / "short.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"short.safetensors: only {len(content)} bytes"):
        read_all(path)


def test_truncated_inside_the_data(tmp_path):
    path = tmp_path / "cut.safetensors"
    good = write(tmp_path / "good.safetensors", {"x": entry("F32", [4], 0, 16)}, GOOD_DATA)
    path.write_bytes(good.read_bytes()[:-3])
    with pytest.raises(ValueError, match="cut.safetensors: tensor 'x': data ends at 16, past "
                                         "the 13-byte"):
        read_all(path)


def test_too_many_dimensions_for_numpy(tmp_path):
    path = write(tmp_path / "dims.safetensors", {"x": entry("F32", [1] * 100, 0, 4)}, b"\0" * 4)
    with pytest.raises(ValueError, match="dims.safetensors: tensor 'x' cannot be read"):
        read_all(path)
