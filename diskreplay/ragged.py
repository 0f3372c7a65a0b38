"""Ragged columns: one flat ``values`` array plus ``offsets`` into it.

A ragged column holds one variable-length 1-D array per row without padding:
row ``i`` is ``values[offsets[i]:offsets[i + 1]]``. This is exactly Arrow's
``large_list`` layout, so a column read from a segment is a view, not a copy.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np
from .errors import ArgumentError, IndexOutOfRangeError


class RaggedColumn:
    """Variable-length rows stored as flat ``values`` and int64 ``offsets``.

    ``offsets`` has one more entry than there are rows and need not start at
    0 (a slice of a larger column keeps its parent's offsets). ``validity``,
    when given, marks rows that hold no value at all (``None``: "not computed").

    >>> col = RaggedColumn.from_arrays([np.array([1, 2, 3]), np.array([4])])
    >>> len(col), col[0].tolist(), col.lengths.tolist()
    (2, [1, 2, 3], [3, 1])
    """

    __slots__ = ("values", "offsets", "validity", "token_spec")

    def __init__(self, values: np.ndarray, offsets: np.ndarray,
                 validity: Optional[np.ndarray] = None) -> None:
        self.values = values
        self.offsets = offsets
        self.validity = validity
        #: a store's read of a per-token tensor column sets its ``ColumnSpec`` here (its shape and
        #: fill), so that ``collate`` lays it out without being given the store's schema
        self.token_spec = None

    @classmethod
    def from_arrays(cls, rows: Sequence[np.ndarray], dtype=None) -> "RaggedColumn":
        """Build a column from a sequence of 1-D arrays (copies them once).

        >>> RaggedColumn.from_arrays([[1.0, 2.0], []], dtype=np.float32).offsets.tolist()
        [0, 2, 2]
        """
        arrays = [np.asarray(r, dtype=dtype).reshape(-1) for r in rows]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if arrays:
            values = np.concatenate(arrays)
            if dtype is not None:
                values = values.astype(dtype, copy=False)
        else:
            values = np.zeros(0, dtype=dtype if dtype is not None else np.float32)
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Number of elements in each row (int64)."""
        return np.diff(self.offsets)

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the values."""
        return self.values.dtype

    def __getitem__(self, i: int) -> Optional[np.ndarray]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexOutOfRangeError(f"row {i} out of range for a ragged column of {n} rows")
        if self.validity is not None and not self.validity[i]:
            return None
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def __iter__(self) -> Iterator[Optional[np.ndarray]]:
        for i in range(len(self)):
            yield self[i]

    def to_list(self) -> list:
        """Rows as a list of Python lists (``None`` for a missing row)."""
        return [None if r is None else r.tolist() for r in self]

    def __repr__(self) -> str:
        return (f"RaggedColumn(rows={len(self)}, elements={int(self.offsets[-1] - self.offsets[0])}, "
                f"dtype={self.values.dtype})")


#: the dtypes of a per-token tensor column (a ragged column with a ``shape``); a reader that
#: predates them refuses the column ("Unsupported column description") rather than misread it
TOKEN_TENSOR_DTYPES = ("uint8", "uint16", "int16")
#: alignments of a per-token tensor column: with the prompt, the completion, or the sequence
#: (every prompt and completion token but the last, as vLLM returns routed experts)
TOKEN_TENSOR_ALIGNS = ("prompt", "completion", "sequence")


def dtype_range(dtype: str) -> tuple:
    """The smallest and largest value of an integer dtype.

    >>> dtype_range("uint8"), dtype_range("int16")
    ((0, 255), (-32768, 32767))
    """
    info = np.iinfo(np.dtype(dtype))
    return int(info.min), int(info.max)


class PerTokenTensor:
    """A per-token tensor column for ``extend``: each token holds a fixed-shape tensor.

    ``values``: one array per row of shape ``[n_tokens, *shape]`` (``None``: not
    computed for that row), or a padded ``[B, T, *shape]`` array or tensor with
    ``lengths`` (tokens per row; default ``T`` for every row). ``dtype``: what the
    store keeps, ``"uint8"`` (values 0-255: up to 256 experts), ``"uint16"`` or
    ``"int16"`` (vLLM's); a value outside it is refused, naming its row and token.
    ``align``: the ids it has one tensor per token of, ``"completion"``,
    ``"prompt"`` or ``"sequence"`` (every prompt and completion token but the
    last, as vLLM returns routed experts: ``[seq_len - 1, num_layers, top_k]``).
    ``fill``: the value that pads it in a batch (``collate``). ``shape``: the
    per-token shape, taken from the rows when not given. Once stored, the column's
    declaration is the store's: later batches may pass the rows as they are.

    >>> import numpy as np
    >>> t = PerTokenTensor([np.zeros((3, 2, 4), np.int16), None], dtype="uint8", fill=255)
    >>> len(t), t.dtype, t.align
    (2, 'uint8', 'completion')
    """

    __slots__ = ("values", "dtype", "align", "fill", "shape", "lengths")

    def __init__(self, values, dtype: str, *, align: str = "completion", fill: int = 0,
                 shape: Optional[Sequence[int]] = None, lengths=None) -> None:
        if dtype not in TOKEN_TENSOR_DTYPES:
            raise ArgumentError(f"PerTokenTensor dtype={dtype!r}; expected one of {TOKEN_TENSOR_DTYPES} (uint8 "
                                "holds expert ids 0-255, uint16 0-65535, int16 what vLLM returns)")
        if align not in TOKEN_TENSOR_ALIGNS:
            raise ArgumentError(f"PerTokenTensor align={align!r}; expected one of {TOKEN_TENSOR_ALIGNS}")
        lo, hi = dtype_range(dtype)
        if not is_int(fill) or not lo <= int(fill) <= hi:
            raise ArgumentError(f"PerTokenTensor fill={fill!r}; expected an int in [{lo}, {hi}] (the range of "
                                f"{dtype}), the value that pads the column in a batch")
        self.values, self.dtype, self.align, self.fill = values, dtype, align, int(fill)
        self.shape = None if shape is None else tuple(int(x) for x in shape)
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"PerTokenTensor(rows={len(self)}, dtype={self.dtype!r}, align={self.align!r}, shape={self.shape})"


def gather_ranges(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                  out: Optional[np.ndarray] = None) -> np.ndarray:
    """Concatenate ``values[starts[i]:starts[i] + lengths[i]]`` for every ``i``.

    One fancy-index gather with no Python loop over rows, so only the returned
    elements are touched (``values`` may be a memory map).

    >>> gather_ranges(np.arange(10), np.array([7, 0]), np.array([2, 3])).tolist()
    [7, 8, 0, 1, 2]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if out is None:
        out = np.empty(total, dtype=values.dtype)
    if total == 0:
        return out
    out_starts = np.cumsum(lengths) - lengths
    # index of element j of the output = starts[row(j)] + (j - out_starts[row(j)])
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - out_starts, lengths)
    shift += np.arange(total, dtype=np.int64)
    np.take(values, shift, out=out)
    return out


def is_int(x) -> bool:
    """True for a Python or numpy integer, False for a bool (which Python calls an int).

    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    """
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def data_address(arr: np.ndarray) -> int:
    """Where ``arr``'s first element lies in this process's memory (0 for an empty array): what
    compiled kernels are handed instead of the array.

    >>> a = np.arange(4, dtype=np.int32); data_address(a[1:]) - data_address(a), data_address(a[:0])
    (4, 0)
    """
    return arr.__array_interface__["data"][0] if arr.size else 0


_DTYPES: dict = {}  # Arrow type id -> numpy dtype, for numpy_view


def numpy_view(arr) -> np.ndarray:
    """A pyarrow primitive array as numpy, zero-copy where the layout allows.

    ``pyarrow.Array.to_numpy`` imports pandas on first use (over 100 ms), which
    would dominate opening a store; fixed-width numbers are read straight from
    the Arrow data buffer instead. Null slots hold unspecified values.

    >>> import pyarrow as pa
    >>> numpy_view(pa.array([1, 2, 3], type=pa.int32())[1:]).tolist()
    [2, 3]
    >>> numpy_view(pa.array([True, False, True])).tolist()
    [True, False, True]
    """
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    n = len(arr)
    if pa.types.is_boolean(t):
        buf = arr.buffers()[1]
        if buf is None or n == 0:
            return np.zeros(n, dtype=bool)
        bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")
        return bits[arr.offset:arr.offset + n].astype(bool)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        # by type id: to_pandas_dtype costs more than the rest of a view (a cold read makes hundreds)
        dtype = _DTYPES.get(t.id)
        if dtype is None:
            dtype = _DTYPES[t.id] = np.dtype(t.to_pandas_dtype())
        buf = arr.buffers()[1]
        if buf is None or n == 0:
            return np.zeros(n, dtype=dtype)
        return np.frombuffer(buf, dtype=dtype, count=arr.offset + n)[arr.offset:]
    return arr.to_numpy(zero_copy_only=False)


def arrow_array(values, mask: Optional[np.ndarray] = None):
    """A 1-D numpy array of numbers or bools (or a sequence of ``str``/``None``) as a pyarrow
    array; ``mask`` marks null slots. The inverse of :func:`numpy_view`.

    ``pyarrow.array`` imports pandas on first use (about a second on a cold
    machine), which would dominate a writer's first append; numbers are handed
    to Arrow as buffers instead (zero-copy when contiguous).

    >>> arrow_array(np.array([1, 2, 3], dtype=np.int32)).to_pylist()
    [1, 2, 3]
    >>> arrow_array(np.array([1.5, 2.0]), mask=np.array([False, True])).to_pylist()
    [1.5, None]
    >>> arrow_array(["a", None, "ü"]).to_pylist()
    ['a', None, 'ü']
    """
    import pyarrow as pa

    validity = None
    if mask is not None and np.any(mask):
        validity = pa.py_buffer(np.packbits(~np.asarray(mask, dtype=bool), bitorder="little"))
    if not isinstance(values, np.ndarray) or values.dtype.kind in "OU":
        items = list(values)
        if validity is None and any(v is None for v in items):
            validity = pa.py_buffer(np.packbits([v is not None for v in items], bitorder="little"))
        encoded = [b"" if v is None else v.encode("utf-8") for v in items]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        return pa.Array.from_buffers(pa.large_string(), len(encoded),
                                     [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))])
    values = np.ascontiguousarray(values).reshape(-1)
    if values.dtype == bool:
        return pa.Array.from_buffers(pa.bool_(), len(values),
                                     [validity, pa.py_buffer(np.packbits(values, bitorder="little"))])
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [validity, pa.py_buffer(values)])
