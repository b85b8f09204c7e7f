"""Stored dtype names <-> torch and numpy dtypes. Pure; no I/O.

Decoding looks names up in these tables and nowhere else: a stored string never
reaches getattr(torch, ...), and a numpy description is rebuilt field by field
under the limits of tree.LIMITS.

The grammar needs only names and item sizes (DTYPE_ITEMSIZES), so reading manifests
does not import torch: `tsck refs`, `log`, `fsck`, `gc` start in a fraction of a
second instead of paying torch's import (~3 s here). The torch objects (TORCH_DTYPES,
QUANT_REPR, QUANT_BY_NAME, PACKED_QUANT) are built on first use; tests/cli/test_cli_no_torch.py
checks that the static table is exactly this torch build's dtypes.
"""

from __future__ import annotations

import functools

import numpy as np

from ..errors import FormatError

# Also TORCH_DTYPES, QUANT_REPR, QUANT_BY_NAME and PACKED_QUANT, built on first use (__getattr__).
__all__ = ["DTYPE_ITEMSIZES", "QUANT_NAMES", "PACKED_QUANT_NAMES", "torch_dtype", "torch_dtype_name",
           "np_dtype_out", "np_dtype_in", "code_units"]

# Every dense dtype of torch 2.13 (the pinned build), by name, with its item size.
DTYPE_ITEMSIZES: dict[str, int] = {
    "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "bool": 1, "qint8": 1, "quint8": 1, "qint32": 4,
    "bfloat16": 2, "quint4x2": 1, "quint2x4": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1,
    "bits16": 2, "float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2fnuz": 1, "float8_e4m3fnuz": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1,
    "uint6": 1, "uint7": 1, "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
}
# Quantized dtypes are stored as their integer representation plus affine parameters.
QUANT_NAMES = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
PACKED_QUANT_NAMES = {"quint4x2", "quint2x4"}  # no way to rebuild them: refused both ways


@functools.cache
def _torch_tables() -> tuple:
    import torch
    dtypes = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    quant_repr = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}
    quant_by_name = {str(k).removeprefix("torch."): (k, v) for k, v in quant_repr.items()}
    packed = {torch.quint4x2, torch.quint2x4}
    return dtypes, quant_repr, quant_by_name, packed


_LAZY = {"TORCH_DTYPES": 0, "QUANT_REPR": 1, "QUANT_BY_NAME": 2, "PACKED_QUANT": 3}


def __getattr__(name: str):
    """TORCH_DTYPES (name -> torch.dtype), QUANT_REPR, QUANT_BY_NAME, PACKED_QUANT: built
    (importing torch) when first asked for."""
    if name in _LAZY:
        return _torch_tables()[_LAZY[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_dtype(name: str):
    """The torch.dtype of a name the grammar accepted (in DTYPE_ITEMSIZES). FormatError if
    the torch installed lacks it (the table is the pinned build's; another may differ)."""
    dt = _torch_tables()[0].get(name)
    if dt is None:
        raise FormatError(f"torch dtype {name!r} is not known to the installed torch (tensorstore_ck pins 2.13.0)")
    return dt


def torch_dtype_name(dt) -> str:
    return str(dt).removeprefix("torch.")


# Limits on numpy dtype descriptions (both directions: put refuses what checkout would).
MAX_DTYPE_STR = 64
MAX_DTYPE_DEPTH = 8
MAX_FIELDS = 1024
MAX_SUBARRAY_DIM = 1 << 20


def np_dtype_out(d: np.dtype):
    """numpy dtype -> a msgpack-able description (dtype.str, or the structured descr)."""
    return d.str if d.fields is None else np.lib.format.dtype_to_descr(d)


def _descr_in(x, depth=0):
    """The msgpack form of a numpy descr (lists for tuples) back to what numpy expects."""
    if depth > MAX_DTYPE_DEPTH:
        raise ValueError(f"dtype description nested deeper than {MAX_DTYPE_DEPTH}")
    if isinstance(x, str):
        if len(x) > MAX_DTYPE_STR:
            raise ValueError("dtype string too long")
        return x
    if not isinstance(x, list) or not 0 < len(x) <= MAX_FIELDS:
        raise ValueError(f"a structured dtype needs 1..{MAX_FIELDS} fields")
    fields = []
    for f in x:
        if not isinstance(f, list) or len(f) not in (2, 3):
            raise ValueError("bad structured dtype field")
        name = f[0] if isinstance(f[0], str) else tuple(f[0]) if isinstance(f[0], list) else None
        if name is None or (isinstance(name, tuple) and not all(isinstance(n, str) for n in name)):
            raise ValueError("bad structured dtype field name")
        entry = (name, _descr_in(f[1], depth + 1))
        if len(f) == 3:
            if not isinstance(f[2], list) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and 0 <= n < MAX_SUBARRAY_DIM for n in f[2]):
                raise ValueError(f"bad subarray shape (dims must be < {MAX_SUBARRAY_DIM})")
            entry += (tuple(f[2]),)
        fields.append(entry)
    return fields


def np_dtype_in(desc) -> np.dtype:
    """A stored description -> numpy dtype; FormatError for anything hostile or object-holding."""
    try:
        d = np.lib.format.descr_to_dtype(_descr_in(desc))
    except Exception as e:  # numpy raises ValueError, TypeError, KeyError, ... on bad descriptions
        raise FormatError(f"bad numpy dtype {str(desc)[:80]!r}: {e}") from None
    if d.hasobject:
        raise FormatError(f"numpy dtype {d} holds Python objects")
    return d


def code_units(raw: bytes, dtype: np.dtype) -> list[int]:
    """The UTF-32 code units of a numpy '<U'/'>U' value, in its byte order."""
    return np.frombuffer(raw, dtype=np.dtype("u4").newbyteorder(dtype.byteorder)).tolist()
