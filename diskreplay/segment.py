"""Arrow IPC files of a store: row segments, group sidecars and saved states.

A segment is one uncompressed Arrow IPC *file* holding one record batch of
unpadded rows. It is read through a memory map: opening parses the footer
only, and every column comes back as numpy views of the mapped pages, so a
read touches just the bytes it returns.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from ._fileio import crc32c
from .errors import CorruptStoreError, FormatError
from .ragged import numpy_view
from .schema import RAGGED, VECTOR, Schema

_PAGE = mmap.PAGESIZE
_STATE_META = b"diskreplay.state"


def encode_ipc(batch: pa.RecordBatch) -> pa.Buffer:
    """One record batch as the bytes of an uncompressed Arrow IPC file."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def group_sidecar(keys: pa.Array, first_row: int) -> pa.RecordBatch:
    """The group sidecar of a segment whose per-row group keys are ``keys``.

    One row per group in order of first appearance: ``key``, ``count`` and the
    global ``rows`` of that group (ascending, i.e. insertion order).
    """
    enc = keys.dictionary_encode()
    codes = numpy_view(enc.indices).astype(np.int64)
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes, minlength=len(enc.dictionary)).astype(np.int64)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    rows = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(order + first_row, type=pa.int64()))
    return pa.RecordBatch.from_arrays([enc.dictionary, pa.array(counts), rows], names=["key", "count", "rows"])


def read_group_sidecar(path: str, nbytes: int, crc: int, key_type: pa.DataType, first_row: int,
                       num_rows: int) -> Tuple[pa.Array, np.ndarray, np.ndarray]:
    """``(keys, counts, rows)`` of a segment's group sidecar, every invariant checked.

    Raises ``CorruptStoreError`` naming the file unless the sidecar has the
    documented columns and types and its rows are exactly the segment's.
    """
    batch = ArrowFile(path, nbytes, crc).batch
    want = {"key": key_type, "count": pa.int64(), "rows": pa.large_list(pa.int64())}
    got = {f.name: f.type for f in batch.schema}
    if got != want:
        raise CorruptStoreError(f"{path} has columns {got}; a group sidecar has {want}")
    keys = batch.column("key")
    counts = numpy_view(batch.column("count"))
    rows_col = batch.column("rows")
    rows = numpy_view(rows_col.values)
    offsets = numpy_view(rows_col.offsets)
    if (keys.null_count or batch.column("count").null_count or rows_col.null_count
            or np.any(counts <= 0) or int(counts.sum()) != num_rows or len(rows) != num_rows
            or not np.array_equal(np.diff(offsets), counts)
            or (len(rows) and (rows.min() < first_row or rows.max() >= first_row + num_rows))
            or len(np.unique(rows)) != num_rows):
        raise CorruptStoreError(f"{path} does not index the {num_rows} rows of its segment")
    return keys, counts, rows


class ArrowFile:
    """A memory-mapped Arrow IPC file holding one record batch.

    ``path`` is opened with ``O_NOFOLLOW`` (a symlink planted in a store is
    refused) and its size checked against the manifest before parsing, so a
    truncated or swapped file gives ``CorruptStoreError`` naming it.
    """

    def __init__(self, path: str, expected_bytes: Optional[int] = None,
                 expected_crc: Optional[int] = None) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise CorruptStoreError(f"cannot open {path}: {exc.strerror} (a symlink is not allowed)") from None
        try:
            size = os.fstat(fd).st_size
            if expected_bytes is not None and size != expected_bytes:
                raise CorruptStoreError(f"{path} has {size} bytes but the manifest records {expected_bytes}; "
                                        "the file is truncated or was replaced")
            if size == 0:
                raise CorruptStoreError(f"{path} is empty")
            self._mmap = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            self.fd = fd
            # Rows are read at random: without this, each page fault reads ahead
            # (up to MBs on some VMs) and cold batches pay for bytes they never use.
            # Readers that need many pages ask for them explicitly (advise, advise_all).
            try:
                self._mmap.madvise(mmap.MADV_RANDOM)
            except (AttributeError, OSError):
                pass
            self.advised_all = False
        except BaseException:
            os.close(fd)
            raise
        self.size = size
        self._base = pa.py_buffer(self._mmap)
        # The checksum is checked before Arrow parses a byte: a damaged file must
        # neither be served nor reach the parser (some flips crash it).
        if expected_crc is not None and crc32c(self._base) != expected_crc:
            self.close()
            raise CorruptStoreError(f"{path} fails its checksum (crc32c); the file is damaged and is not "
                                    "served; run `diskreplay verify` / `diskreplay repair`")
        try:
            reader = pa.ipc.open_file(self._base)
            if reader.num_record_batches != 1:
                raise CorruptStoreError(f"{path} holds {reader.num_record_batches} record batches; expected 1")
            self.batch = reader.get_batch(0)
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            if isinstance(exc, CorruptStoreError):
                raise
            raise CorruptStoreError(f"{path} is not a readable Arrow IPC file ({exc})") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def advise_all(self) -> None:
        """Ask the kernel to read the whole file ahead (for scans: export, compact)."""
        if not self.advised_all:
            self.advised_all = True
            try:
                self._mmap.madvise(mmap.MADV_WILLNEED)
            except OSError:
                pass

    def advise(self, ranges: List[Tuple[int, int]]) -> None:
        """Ask the kernel to read the given byte ranges ahead (WILLNEED)."""
        base = self._base.address
        for start, length in ranges:
            if length <= 0:
                continue
            lo = (start - base) // _PAGE * _PAGE
            hi = start - base + length
            try:
                self._mmap.madvise(mmap.MADV_WILLNEED, lo, max(0, min(hi, self.size) - lo))
            except (OSError, ValueError):
                return


class Segment(ArrowFile):
    """One committed row segment, with numpy views of its columns.

    >>> import tempfile
    >>> rb = pa.record_batch({"x": pa.array([1, 2], type=pa.int64())})
    >>> p = tempfile.mktemp(); open(p, "wb").write(encode_ipc(rb).to_pybytes()) > 0
    True
    >>> Segment(p).scalar("x").tolist()
    [1, 2]
    """

    def __init__(self, path: str, expected_bytes: Optional[int] = None,
                 schema: Optional[Schema] = None, num_rows: Optional[int] = None,
                 expected_crc: Optional[int] = None) -> None:
        super().__init__(path, expected_bytes, expected_crc)
        if num_rows is not None and self.batch.num_rows != num_rows:
            raise CorruptStoreError(f"{path} holds {self.batch.num_rows} rows; the manifest records {num_rows}")
        if schema is not None:
            want = schema.arrow_schema()
            if not self.batch.schema.equals(want):
                raise CorruptStoreError(f"{path} has schema {self.batch.schema.types} which disagrees with "
                                        f"FORMAT.json ({want.types})")
        self._cache: Dict[str, Any] = {}
        self._offset_keys: Dict[str, str] = {}

    @property
    def num_rows(self) -> int:
        return self.batch.num_rows

    def column(self, name: str) -> pa.Array:
        return self.batch.column(name)

    def ragged(self, name: str) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """``(values, offsets, validity)`` numpy views of a ragged column."""
        hit = self._cache.get(name)
        if hit is None:
            arr = self.batch.column(name)
            offsets = numpy_view(arr.offsets)
            values = numpy_view(arr.values)
            validity = None if arr.null_count == 0 else numpy_view(arr.is_valid())
            self._check_offsets(name, offsets, len(values))
            hit = self._cache[name] = (values, offsets, validity)
        return hit

    def offsets_key(self, name: str) -> str:
        """The first ragged column (in asking order) whose offsets equal ``name``'s.

        Columns aligned with the same ids share it, so a read can compute its
        gather indices once for all of them.
        """
        key = self._offset_keys.get(name)
        if key is None:
            offsets = self.ragged(name)[1]
            key = next((canon for canon in set(self._offset_keys.values())
                        if np.array_equal(self.ragged(canon)[1], offsets)), name)
            self._offset_keys[name] = key
        return key

    def _check_offsets(self, name: str, offsets: np.ndarray, n_values: int) -> None:
        if len(offsets) and (offsets[0] < 0 or offsets[-1] > n_values or np.any(np.diff(offsets) < 0)):
            raise CorruptStoreError(f"{self.path}: column {name!r} has invalid offsets")

    def scalar(self, name: str) -> Any:
        """A per-row column as a numpy array (``[n, width]`` for vectors) or list of str."""
        hit = self._cache.get(name)
        if hit is None:
            arr = self.batch.column(name)
            t = arr.type
            if pa.types.is_large_string(t) or pa.types.is_string(t):
                hit = arr
            elif pa.types.is_fixed_size_list(t):
                flat = numpy_view(arr.values)
                hit = flat.reshape(len(arr), t.list_size)
            else:
                hit = numpy_view(arr)
            self._cache[name] = hit
        return hit

    def value_ranges(self, name: str, local_rows: np.ndarray) -> List[Tuple[int, int]]:
        """Byte ranges (absolute addresses) that reading ``local_rows`` of a ragged column touches."""
        arr = self.batch.column(name)
        values, offsets, _ = self.ragged(name)
        if values.size == 0 or len(local_rows) == 0:
            return []
        item = values.itemsize
        addr = values.__array_interface__["data"][0]
        starts = offsets[local_rows]
        ends = offsets[local_rows + 1]
        return [(addr + int(s) * item, int(e - s) * item) for s, e in zip(starts, ends)] + [
            (arr.offsets.buffers()[1].address, 8 * (len(arr) + 1))]


# ---------------------------------------------------------------------------
# Saved states: JSON for the structure, Arrow columns for the arrays.


def encode_state(state: Dict[str, Any]) -> pa.Buffer:
    """Serialise a state dict (JSON values, numpy arrays, torch tensors) without pickle.

    >>> buf = encode_state({"step": 3, "prio": np.array([0.5, 1.0], dtype=np.float32)})
    >>> d = decode_state(buf, "x"); d["step"], d["prio"].dtype.name
    (3, 'float32')
    """
    arrays: List[np.ndarray] = []

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                if not isinstance(k, str):
                    raise TypeError(f"state keys must be strings, got {k!r}")
                out[k] = walk(v)
            return {"__dict__": out} if "__array__" in out or "__dict__" in out else out
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor
            x = x.detach().cpu().numpy()
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in "biuf":
                raise TypeError(f"state arrays must be numeric, got dtype {x.dtype}")
            arrays.append(np.ascontiguousarray(x))
            return {"__array__": len(arrays) - 1, "shape": list(x.shape), "dtype": x.dtype.str}
        if isinstance(x, np.generic):
            return x.item()
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot store a {type(x).__name__} in a state; use JSON values and arrays")

    doc = walk(state)
    cols = [pa.LargeListArray.from_arrays(pa.array([0, a.size], type=pa.int64()), pa.array(a.reshape(-1)))
            for a in arrays]
    names = [f"a{i}" for i in range(len(arrays))]
    schema = pa.schema([pa.field(n, c.type) for n, c in zip(names, cols)],
                       metadata={_STATE_META: json.dumps(doc).encode()})
    rb = pa.RecordBatch.from_arrays(cols, schema=schema) if cols else pa.RecordBatch.from_pylist([], schema=schema)
    return encode_ipc(rb)


def decode_state(buf: Any, path: str) -> Dict[str, Any]:
    try:
        reader = pa.ipc.open_file(pa.py_buffer(buf) if not isinstance(buf, pa.Buffer) else buf)
        batch = reader.read_all()
        doc = json.loads(reader.schema.metadata[_STATE_META])
    except (pa.ArrowException, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CorruptStoreError(f"{path} is not a readable state file ({exc})") from None

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if "__array__" in x:
                i = x["__array__"]
                if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < batch.num_columns:
                    raise CorruptStoreError(f"{path}: bad array reference {i!r}")
                try:
                    dtype = np.dtype(x["dtype"])
                    if dtype.kind not in "biuf":
                        raise TypeError(f"non-numeric dtype {dtype}")
                    flat = numpy_view(batch.column(i).chunk(0).values)
                    return flat.astype(dtype, copy=False).reshape(x["shape"]).copy()
                except (KeyError, TypeError, ValueError) as exc:
                    raise CorruptStoreError(f"{path}: bad array {x!r} ({exc})") from None
            if "__dict__" in x:
                inner = x["__dict__"]
                if not isinstance(inner, dict):
                    raise CorruptStoreError(f"{path}: bad object {inner!r}")
                return {k: walk(v) for k, v in inner.items()}
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    try:
        return walk(doc)
    except RecursionError:
        raise CorruptStoreError(f"{path}: state nested too deeply") from None
