"""Stored dtype names <-> torch and numpy dtypes. Pure; no I/O.

Decoding looks names up in these tables and nowhere else: a stored string never
reaches getattr(torch, ...), and a numpy description is rebuilt field by field
under the limits of tree.LIMITS.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import FormatError

__all__ = ["TORCH_DTYPES", "QUANT_REPR", "QUANT_BY_NAME", "QUANT_NAMES", "PACKED_QUANT", "torch_dtype_name",
           "np_dtype_out", "np_dtype_in", "code_units"]

# Every dense dtype this torch build knows, by name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
# Quantized dtypes are stored as their integer representation plus affine parameters.
QUANT_REPR = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}
QUANT_BY_NAME = {str(k).removeprefix("torch."): (k, v) for k, v in QUANT_REPR.items()}
QUANT_NAMES = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
PACKED_QUANT = {torch.quint4x2, torch.quint2x4}  # no way to rebuild them: refused both ways

# Limits on numpy dtype descriptions (both directions: put refuses what checkout would).
MAX_DTYPE_STR = 64
MAX_DTYPE_DEPTH = 8
MAX_FIELDS = 1024
MAX_SUBARRAY_DIM = 1 << 20


def torch_dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


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
