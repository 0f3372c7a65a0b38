"""A long manifest's segment entries as one Arrow file: the *segment table* (docs/FORMAT.md).

A full manifest of ``SEGMENT_TABLE_MIN`` or more segments names, besides its JSON entries, a
table of the same entries in columns (``groups/table.<id>.arrow``, CRC-32C in the manifest). A
reader that knows it skips the JSON entries, checks and maps the table, and makes an entry
object only when one is asked for, so that opening a store costs about the same however many
segments it has. The JSON entries stay the truth: a reader that does not know the table reads
them, and one that finds the table missing or damaged reads them too.

>>> entries = (SegmentEntry(1, 0, 8, 900, 7), SegmentEntry(2, 8, 4, 600, 9, group=5))
>>> table = SegmentTable.of(entries)
>>> SegmentTable.from_bytes(table_bytes(table), "t")[1] == entries[1], len(table + entries[:1])
(True, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from ..errors import FormatError
from .entries import SegmentEntry
from .jsondoc import int_field
from .names import GROUPS_DIR, MAX_ID

#: full manifests with at least this many segments name a segment table
SEGMENT_TABLE_MIN = 128
TABLE_FORMAT = b"diskreplay.segment_table"
_COLUMNS = (("id", pa.int64()), ("first_row", pa.int64()), ("num_rows", pa.int64()), ("bytes", pa.int64()),
            ("crc32c", pa.uint32()), ("groups_bytes", pa.int64()), ("groups_crc32c", pa.uint32()),
            ("group", pa.int64()))
_SCHEMA = pa.schema([pa.field(n, t, nullable=(n == "group")) for n, t in _COLUMNS],
                    metadata={b"format": TABLE_FORMAT, b"version": b"1"})
_INTS = tuple(n for n, _ in _COLUMNS if n != "group")
_NUMPY = {n: np.dtype(np.uint32 if t == pa.uint32() else np.int64) for n, t in _COLUMNS}


def segment_table_file(table_id: int) -> str:
    return f"{GROUPS_DIR}/table.{table_id:012d}.arrow"


@dataclass(frozen=True)
class SegmentTableEntry:
    """Where a manifest's segment table lies: ``groups/table.<id>.arrow`` of ``bytes`` bytes and
    CRC-32C ``crc32c``, holding ``count`` entries (the manifest's segments, in order).

    >>> e = SegmentTableEntry(12, 4096, 77, 300)
    >>> SegmentTableEntry.from_dict(e.to_dict(), "m") == e, e.file
    (True, 'groups/table.000000000012.arrow')
    """

    id: int
    bytes: int
    crc32c: int
    count: int

    @property
    def file(self) -> str:
        return segment_table_file(self.id)

    def to_dict(self) -> dict:
        return {"file": self.file, "id": self.id, "bytes": self.bytes, "crc32c": self.crc32c, "count": self.count}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "SegmentTableEntry":
        if not isinstance(d, dict):
            raise FormatError(f"Unsupported segment_table {d!r} in {where}; expected an object")
        e = cls(int_field(d, "id", where, hi=MAX_ID), int_field(d, "bytes", where, lo=1),
                int_field(d, "crc32c", where, hi=0xFFFFFFFF), int_field(d, "count", where, lo=1))
        if d.get("file", e.file) != e.file:
            raise FormatError(f"Unsupported segment_table file {d.get('file')!r} in {where}; expected {e.file!r}")
        return e


class SegmentTable(Sequence[SegmentEntry]):
    """A manifest's segments as int64 columns, each :class:`SegmentEntry` made when first asked
    for: a tuple of entries to every caller (indexing, slicing, iterating, ``+``, ``==``), and
    ``column(name)`` for those that want all of one field at once.

    >>> t = SegmentTable.of([SegmentEntry(3, 10, 2, 80, 1)])
    >>> t[0].end_row, t.column("first_row").tolist(), t == (SegmentEntry(3, 10, 2, 80, 1),)
    (12, [10], True)
    """

    __slots__ = ("_cols", "_entries", "_complete")

    def __init__(self, cols: Dict[str, np.ndarray], entries: Optional[List[Optional[SegmentEntry]]] = None,
                 complete: bool = False) -> None:
        self._cols = cols
        self._entries = entries if entries is not None else [None] * len(cols["id"])
        self._complete = complete  # every entry made already (iterating is then the list's own)

    @classmethod
    def of(cls, entries: Sequence[SegmentEntry]) -> "SegmentTable":
        """The table of ``entries`` (itself when it is one)."""
        if isinstance(entries, SegmentTable):
            return entries
        entries = list(entries)
        cols = {n: np.array([getattr(e, n) for e in entries], dtype=np.int64) for n in _INTS}
        groups = [e.group for e in entries]
        cols["has_group"] = np.array([g is not None for g in groups], dtype=bool)
        cols["group"] = np.array([0 if g is None else g for g in groups], dtype=np.int64)
        return cls(cols, list(entries), complete=True)

    def column(self, name: str) -> np.ndarray:
        """All values of one field (``id``, ``first_row``, ``num_rows``, ``bytes``, ``crc32c``,
        ``groups_bytes``, ``groups_crc32c``; ``group`` is 0 where ``has_group`` is False)."""
        return self._cols[name]

    def ids_unique(self) -> bool:
        """Whether no segment id appears twice (ids in row order usually grow: then no sort)."""
        ids = self._cols["id"]
        return bool(np.all(ids[1:] > ids[:-1])) or np.unique(ids).size == ids.size

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, i: int) -> SegmentEntry:
        e = self._entries[i]
        if e is None:
            c = self._cols
            e = object.__new__(SegmentEntry)  # checked columns straight in (see SegmentEntry.from_dict)
            e.__dict__.update({n: int(c[n][i]) for n in _INTS})
            e.__dict__["group"] = int(c["group"][i]) if c["has_group"][i] else None
            self._entries[i] = e
        return e

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            return SegmentTable({n: v[i] for n, v in self._cols.items()}, self._entries[i], self._complete)
        n = len(self._entries)
        if not -n <= i < n:
            raise IndexError("segment index out of range")
        return self._entry(i % n)

    def __iter__(self) -> Iterator[SegmentEntry]:
        if not self._complete:
            for i in range(len(self._entries)):
                self._entry(i)
            self._complete = True
        return iter(self._entries)  # type: ignore[arg-type]

    def __add__(self, other: Sequence[SegmentEntry]) -> "SegmentTable":
        other = SegmentTable.of(other)
        return SegmentTable({n: np.concatenate([v, other._cols[n]]) for n, v in self._cols.items()},
                            self._entries + other._entries, self._complete and other._complete)

    def __radd__(self, other: Sequence[SegmentEntry]) -> "SegmentTable":
        return SegmentTable.of(other) + self

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, SegmentTable):
            return all(np.array_equal(v, other._cols[n]) for n, v in self._cols.items())
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"SegmentTable({len(self)} segments)"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "SegmentTable":
        """The table a segment table file holds (``FormatError`` if it is not one)."""
        return _from_bytes(data, where)

    def problem(self) -> Optional[str]:
        """What makes these entries invalid (as :meth:`SegmentEntry.from_dict` checks one), or None."""
        c = self._cols
        bad = ((c["id"] < 0) | (c["id"] > MAX_ID) | (c["first_row"] < 0) | (c["num_rows"] < 1)
               | (c["bytes"] < 1) | (c["groups_bytes"] < 0) | (c["num_rows"] > 8 * c["bytes"])
               | (c["has_group"] & ((c["groups_bytes"] != 0) | (c["groups_crc32c"] != 0)))
               | (~c["has_group"] & (c["group"] != 0)))
        if not bad.any():
            return None
        i = int(np.flatnonzero(bad)[0])
        return f"segment {int(c['id'][i])} (entry {i}) has invalid fields"


def table_bytes(table: SegmentTable) -> bytes:
    """The file form of ``table``: one Arrow IPC record batch of its columns."""
    c = table._cols
    n_rows = len(table)

    def column(n: str, t: pa.DataType) -> pa.Array:
        data = pa.py_buffer(np.ascontiguousarray(c[n], dtype=_NUMPY[n]))
        if n != "group":
            return pa.Array.from_buffers(t, n_rows, [None, data])
        # the validity bitmap made here (a mask given to pa.array would import pandas)
        present = c["has_group"]
        validity = pa.py_buffer(np.packbits(present, bitorder="little"))
        return pa.Array.from_buffers(t, n_rows, [validity, data], null_count=int(n_rows - present.sum()))

    arrays = [column(n, t) for n, t in _COLUMNS]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, _SCHEMA) as writer:
        writer.write_batch(pa.record_batch(arrays, schema=_SCHEMA))
    return sink.getvalue().to_pybytes()


def _from_bytes(data: bytes, where: str) -> SegmentTable:
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        if reader.num_record_batches != 1 or not reader.schema.equals(_SCHEMA, check_metadata=True):
            raise FormatError(f"Unsupported segment table {where}; expected one batch of {TABLE_FORMAT.decode()} "
                              "version 1")
        batch = reader.get_batch(0)
    except pa.ArrowException as exc:
        raise FormatError(f"Unsupported segment table {where}: not an Arrow IPC file ({exc})") from None
    cols = {}
    n_rows = batch.num_rows
    for n, _ in _COLUMNS:
        col = batch.column(n)
        validity, values = col.buffers()
        # the buffers themselves (pyarrow's null handling would import pyarrow.compute: ~0.1 s)
        data = np.frombuffer(values, dtype=_NUMPY[n], count=n_rows,
                             offset=col.offset * col.type.byte_width) if n_rows else np.zeros(0)
        if n == "group":
            present = (np.ones(n_rows, dtype=bool) if not col.null_count else
                       np.unpackbits(np.frombuffer(validity, dtype=np.uint8), bitorder="little")
                       [col.offset:col.offset + n_rows].astype(bool))
            cols["has_group"] = present
            data = np.where(present, data, 0)
        elif col.null_count:
            raise FormatError(f"Unsupported segment table {where}: column {n!r} has nulls")
        cols[n] = data.astype(np.int64)
    table = SegmentTable(cols)
    why = table.problem()
    if why is not None:
        raise FormatError(f"Unsupported segment table {where}: {why}")
    return table



def cut_entries(raw: bytes) -> Optional[Tuple[bytes, int, int]]:
    """``raw`` (a signed manifest's bytes, checksum already proved) with its JSON segment entries
    cut out (``"segments":[]``), and where they were, when it names a segment table; else None.

    In the canonical JSON the keys are sorted, so ``"segments"`` directly follows the
    ``"segment_table"`` object, and no entry holds a ``]`` (ints and file names only).

    >>> cut_entries(b'{"segment_table":{"id":1},"segments":[{"id":1},{"id":2}],"states":{}}')[0]
    b'{"segment_table":{"id":1},"segments":[],"states":{}}'
    """
    at = raw.find(b'"segment_table":{')
    if at < 0:
        return None
    start = raw.find(b'},"segments":[', at)
    if start < 0:
        return None
    start += len(b'},"segments":[')
    end = raw.find(b"]", start)
    if end < 0 or raw[end + 1:end + 2] not in (b",", b"}"):
        return None
    return raw[:start] + raw[end:], start, end
