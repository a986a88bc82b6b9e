"""Arrow ↔ numpy without copies and without pandas, for the hot paths of ingest and profiling.

pyarrow imports pandas (a third of a second) the first time it converts Python or numpy objects
(`pa.array`, `pa.scalar`, `Array.to_numpy`). These helpers read and build Arrow buffers directly,
so profiling a large file never pays that import, and numeric columns are numpy views, not copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

#: A boolean row mask (valid rows, flags), as numpy holds it.
Mask = NDArray[np.bool_]

_NUMPY_TYPES = {
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "float": np.float32, "double": np.float64,
}


def values(column: pa.Array) -> NDArray[Any] | None:
    """A primitive array's value buffer as a read-only numpy view (null slots unspecified);
    None for types without one (strings, booleans, dictionaries)."""
    dtype = _NUMPY_TYPES.get(str(column.type))
    if dtype is None:
        return None
    buf = column.buffers()[1]
    if buf is None:
        return np.zeros(len(column), dtype)
    return np.frombuffer(buf, dtype, count=len(column), offset=column.offset * np.dtype(dtype).itemsize)


def numbers(column: pa.Array) -> NDArray[Any]:
    """`values` of a column whose type has a value buffer (an integer or float type)."""
    view = values(column)
    if view is None:
        raise TypeError(f"a {column.type} column has no numeric value buffer")
    return view


def bits(buf: pa.Buffer, offset: int, n: int) -> Mask:
    """An Arrow bitmap (validity or boolean values) as a numpy bool array."""
    raw = np.frombuffer(buf, np.uint8, count=(offset % 8 + n + 7) // 8, offset=offset // 8)
    return np.unpackbits(raw, count=offset % 8 + n, bitorder="little")[offset % 8 :].view(bool)


def valid(column: pa.Array) -> Mask | None:
    """Valid-row mask, or None when the column has no nulls."""
    if column.null_count == 0:
        return None
    if column.null_count == len(column):
        return np.zeros(len(column), bool)
    return bits(column.buffers()[0], column.offset, len(column))


def missing(column: pa.Array) -> Mask:
    """Null-row mask (all False when the column has no nulls)."""
    mask = valid(column)
    return np.zeros(len(column), bool) if mask is None else ~mask


def ints(column: pa.Array) -> tuple[NDArray[np.int64], Mask | None]:
    """(int64 values with nulls as 0, valid mask or None when there are no nulls)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    view = values(column)
    if view is None or view.dtype.kind == "f":
        column = column.cast(pa.int64())
        view = numbers(column)
    view = view.astype(np.int64, copy=False)
    mask = valid(column)
    if mask is not None:
        view = np.where(mask, view, 0)
    return view, mask


def codes(column: pa.Array) -> tuple[NDArray[np.int32] | NDArray[np.int64], Mask | None]:
    """Dictionary indices as int32 (int64 when wider) with nulls as 0, and the valid mask or None.

    Without nulls the result is a read-only view of the Arrow buffer (int32 indices: no copy).
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    view = values(column)
    if view is None:
        return ints(column)
    if view.dtype != np.int32 and view.dtype != np.int64:
        view = view.astype(np.int64 if view.dtype.itemsize == 8 else np.int32)
    mask = valid(column)
    if mask is not None:
        view = np.where(mask, view, 0)
    return view, mask


def floats(column: pa.Array) -> NDArray[np.float64]:
    """float64 with nulls as NaN."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.type != pa.float64():
        column = column.cast(pa.float64())
    view = numbers(column)
    mask = valid(column)
    return view if mask is None else np.where(mask, view, np.nan)


def flags(column: pa.Array) -> Mask:
    """A boolean column as numpy bools, nulls as False."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not pa.types.is_boolean(column.type):
        column = column.cast(pa.bool_())
    if column.null_count == len(column):
        return np.zeros(len(column), bool)
    out = bits(column.buffers()[1], column.offset, len(column))
    mask = valid(column)
    return out if mask is None else out & mask


def bool_array(mask: Mask) -> pa.BooleanArray:
    """numpy bools → Arrow booleans without nulls."""
    mask = np.ascontiguousarray(mask, dtype=bool)
    packed = np.packbits(mask, bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), mask.size, [None, pa.py_buffer(packed)])


def numeric_array(data: NDArray[Any], mask: Mask | None = None) -> pa.Array:
    """numpy numbers → an Arrow array of the same type; `mask` marks the valid rows."""
    data = np.ascontiguousarray(data)
    typ = pa.from_numpy_dtype(data.dtype)
    validity = None if mask is None or mask.all() else pa.py_buffer(np.packbits(mask, bitorder="little"))
    return pa.Array.from_buffers(typ, data.size, [validity, pa.py_buffer(data)])


def string_array(items: list[str]) -> pa.StringArray:
    """A few Python strings (a dictionary) → an Arrow string array."""
    encoded = [s.encode() for s in items]
    offsets = np.zeros(len(encoded) + 1, np.int32)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    )


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_PY_TYPES: dict[pa.DataType, type] = {pa.int64(): int, pa.float64(): float, pa.bool_(): bool, pa.string(): str}


def from_pylist(values: list[Any], typ: pa.DataType) -> pa.Array:
    """pa.array(values, typ), the same array, built from buffers where every value is None or of
    typ's own Python type (int64 in range, float, bool, str): pa.array first asks whether a list
    is a pandas object, which imports pandas where it is installed (~0.2 s of a profile of
    OpenAI-style logs, whose rows take this path). Anything else goes to pa.array as before."""
    expected = _PY_TYPES.get(typ)
    n = len(values)
    present = [v for v in values if v is not None]
    if expected is None or not n or any(type(v) is not expected for v in present):
        return pa.array(values, typ)
    mask = None if len(present) == n else np.fromiter((v is not None for v in values), bool, n)
    if expected is str:
        try:
            encoded = [b"" if v is None else v.encode() for v in values]
        except UnicodeEncodeError:  # a lone surrogate: pa.array's own error
            return pa.array(values, typ)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        validity = None if mask is None else pa.py_buffer(np.packbits(mask, bitorder="little"))
        return pa.Array.from_buffers(pa.string(), n, [validity, pa.py_buffer(offsets),
                                                       pa.py_buffer(b"".join(encoded))])
    if expected is int and not all(_INT64_MIN <= v <= _INT64_MAX for v in present):
        return pa.array(values, typ)
    if expected is bool:
        return pa.Array.from_buffers(pa.bool_(), n, [
            None if mask is None else pa.py_buffer(np.packbits(mask, bitorder="little")),
            pa.py_buffer(np.packbits(np.fromiter((v is True for v in values), bool, n), bitorder="little"))])
    dtype = np.int64 if expected is int else np.float64
    return numeric_array(np.fromiter((0 if v is None else v for v in values), dtype, n), mask)


def dictionary(indices: NDArray[np.integer[Any]], names: list[str], mask: Mask | None = None) -> pa.DictionaryArray:
    """dictionary<int32, string> from numpy codes into `names`; `mask` marks the valid rows."""
    codes = numeric_array(indices.astype(np.int32, copy=False), mask)
    return pa.DictionaryArray.from_arrays(codes, string_array(names))


def scaled(column: pa.Array, factor: float) -> pa.DoubleArray:
    """float64(column) × factor, nulls kept (numpy's multiply: the same IEEE result as Arrow's)."""
    if column.type != pa.float64():
        column = column.cast(pa.float64())
    if factor == 1.0:
        return column
    mask = valid(column)
    data = numbers(column) if mask is None else np.where(mask, numbers(column), 0.0)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and nan stay, as Arrow's multiply
        return numeric_array(data * factor, mask)


_NULLS: dict[pa.DataType, pa.Array] = {}


def nulls(n: int, typ: pa.DataType) -> pa.Array:
    """An all-null array, sliced from one shared array per type: a column a log format never
    fills costs no memory per batch (Arrow arrays are immutable, so sharing is safe)."""
    shared = _NULLS.get(typ)
    if shared is None or len(shared) < n:
        shared = _NULLS[typ] = pa.nulls(max(n, 1 << 16), typ)
    return shared.slice(0, n)


def rows(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """A batch's rows as Python dicts that always convert: timestamps and dates as ISO text
    (datetime holds years 1 to 9999 only, and ns times would become pandas Timestamps), and
    strings that are not UTF-8 (a damaged Parquet page) with their bad bytes as lone surrogates,
    which the row reading skips as invalid text."""
    columns = []
    for column in batch.columns:
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        if pa.types.is_timestamp(column.type) or pa.types.is_date(column.type):
            columns.append(column.cast(pa.string()).to_pylist())
        elif (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)) and not utf8(column):
            columns.append([None if v is None else v.decode("utf-8", "surrogateescape")
                            for v in column.cast(pa.binary()).to_pylist()])
        else:
            columns.append(column.to_pylist())
    names = batch.schema.names
    if not columns:
        return [{} for _ in range(batch.num_rows)]
    return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]


def utf8(column: pa.Array) -> bool:
    """Whether a string (or dictionary-of-string) column holds valid UTF-8: Parquet and JSON
    readers copy string bytes as they find them."""
    try:
        (column.dictionary if pa.types.is_dictionary(column.type) else column).validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True
