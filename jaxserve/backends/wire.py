"""Plain data between hosts: what a multi-host run sends over its host links
(backends/host_link.py) is encoded here, never pickled, so that a peer can make the receiver
build nothing but data.

A Codec packs messages with msgpack. Beside msgpack's own types (None, bool, int, float,
str, bytes, list, dict) it carries, as msgpack extension types:
- tuples, sets and frozensets;
- numpy arrays and scalars, as (dtype name, shape, bytes), of the dtypes in _DTYPES only
  (numbers and bool, bfloat16 and the other ml_dtypes; never object arrays);
- dataclass instances, field by field, and enum members, by value, of the classes the Codec
  is given (its allowlist);
- exceptions of the allowlisted classes, as (class, message).

A class crosses by its name (module.qualname), and the decoder builds only the classes of
its own allowlist: a name from the wire is looked up there, never imported. A dataclass is
rebuilt as pickle rebuilds one (its fields set on an object made without __init__), so
what the sender's __post_init__ established holds as it was sent. Anything else (an
unlisted class, a function, an object array) raises WireError, on either side.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

import ml_dtypes
import msgpack
import numpy as np

_TUPLE, _ARRAY, _SCALAR, _OBJECT, _ENUM, _ERROR, _SET, _FROZENSET = range(1, 9)

_DTYPES = {np.dtype(t).name: np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4,
    ml_dtypes.uint4)}

# The exceptions every Codec carries: the built-in ones a peer's failure is reported as.
BUILTIN_ERRORS = (ValueError, RuntimeError, TypeError, KeyError, TimeoutError)


class WireError(ValueError):
    """A message that this codec does not carry (encoding) or does not accept (decoding)."""


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Codec:
    """Encodes and decodes messages of plain data and of the allowlisted classes."""

    def __init__(self, classes: Iterable[type] = ()) -> None:
        """classes: the dataclasses, enums and exception classes that may cross (beside
        BUILTIN_ERRORS)."""
        self._classes: dict[str, type] = {}
        for cls in (*BUILTIN_ERRORS, *classes):
            if not (dataclasses.is_dataclass(cls) or issubclass(cls, (enum.Enum,
                                                                      BaseException))):
                raise TypeError(f"{cls!r} is not a dataclass, an enum or an exception class")
            self._classes[qualified_name(cls)] = cls
        self._fields = {cls: tuple(f.name for f in dataclasses.fields(cls))
                        for cls in self._classes.values() if dataclasses.is_dataclass(cls)}

    @property
    def classes(self) -> tuple[type, ...]:
        return tuple(self._classes.values())

    def encode(self, message) -> bytes:
        try:
            return msgpack.packb(message, default=self._default, strict_types=True,
                                 use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as err:
            if isinstance(err, WireError):
                raise
            raise WireError(f"cannot encode the message: {err}") from None

    def decode(self, data: bytes):
        try:
            return msgpack.unpackb(data, ext_hook=self._ext, raw=False,
                                   strict_map_key=False, use_list=True)
        except WireError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever a malformed message raises
            raise WireError(f"malformed message ({type(err).__name__}: {err})") from None

    # ---- encoding ---------------------------------------------------------------------------
    def _pack(self, value) -> bytes:
        return msgpack.packb(value, default=self._default, strict_types=True,
                             use_bin_type=True)

    def _default(self, value):
        cls = type(value)
        if cls is tuple:
            return msgpack.ExtType(_TUPLE, self._pack(list(value)))
        if isinstance(value, np.ndarray):
            return msgpack.ExtType(_ARRAY, self._pack(_array_parts(value)))
        if isinstance(value, np.generic):
            return msgpack.ExtType(_SCALAR, self._pack(_array_parts(np.asarray(value))))
        if isinstance(value, (set, frozenset)):
            code = _FROZENSET if isinstance(value, frozenset) else _SET
            return msgpack.ExtType(code, self._pack(list(value)))
        if isinstance(value, enum.Enum):
            return msgpack.ExtType(_ENUM, self._pack([self._name(cls), value.value]))
        if isinstance(value, BaseException):
            return msgpack.ExtType(_ERROR, self._pack([self._name(cls), str(value)]))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            name = self._name(cls)
            state = {f: getattr(value, f) for f in self._fields[cls]}
            return msgpack.ExtType(_OBJECT, self._pack([name, state]))
        # Subclasses of the plain types (a str subclass, an OrderedDict) cross as the type.
        for plain in (bool, int, float, str, bytes, dict, list, tuple):
            if isinstance(value, plain):
                return plain(value)
        raise WireError(f"{qualified_name(cls)} does not cross between hosts (not plain data "
                        "or an allowlisted class)")

    def _name(self, cls: type) -> str:
        name = qualified_name(cls)
        if self._classes.get(name) is not cls:
            raise WireError(f"{name} does not cross between hosts (not in the allowlist)")
        return name

    # ---- decoding ---------------------------------------------------------------------------
    def _ext(self, code: int, data: bytes):
        value = msgpack.unpackb(data, ext_hook=self._ext, raw=False, strict_map_key=False,
                                use_list=True)
        if code == _TUPLE:
            return tuple(value)
        if code in (_SET, _FROZENSET):
            return (frozenset if code == _FROZENSET else set)(value)
        if code in (_ARRAY, _SCALAR):
            array = _array(value)
            return array[()] if code == _SCALAR else array
        name, payload = value
        cls = self._classes.get(name)
        if cls is None:
            raise WireError(f"the peer sent a {name!r:.200}, which does not cross between "
                            "hosts (not in the allowlist)")
        if code == _ENUM and issubclass(cls, enum.Enum):
            return cls(payload)
        if code == _ERROR and issubclass(cls, BaseException):
            return _error(cls, payload)
        if code == _OBJECT and cls in self._fields:
            if not isinstance(payload, dict) or set(payload) != set(self._fields[cls]):
                raise WireError(f"the peer's {name} has fields {sorted(payload):.300}, not "
                                f"{sorted(self._fields[cls])}")
            obj = cls.__new__(cls)
            for field, item in payload.items():
                object.__setattr__(obj, field, item)
            return obj
        raise WireError(f"the peer sent {name} as extension type {code}")


def _array_parts(array: np.ndarray) -> list:
    if array.dtype.name not in _DTYPES:
        raise WireError(f"numpy arrays of dtype {array.dtype} do not cross between hosts")
    return [array.dtype.name, list(array.shape), np.ascontiguousarray(array).tobytes()]


def _array(parts) -> np.ndarray:
    name, shape, data = parts
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise WireError(f"the peer sent an array of dtype {name!r:.100}, which does not cross")
    # (a bytearray: the array is writable, as an unpickled one)
    return np.frombuffer(bytearray(data), dtype).reshape(shape)


def _error(cls: type, message: str) -> BaseException:
    try:
        return cls(message)
    except TypeError:  # (an exception whose constructor takes no message)
        error = cls.__new__(cls)
        error.args = (message,)
        return error
