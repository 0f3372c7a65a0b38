"""Group sidecars and persisted group indexes: the files a store keeps beside its segments, encoded and decoded.

A segment's group sidecar lists its prompt groups (key, count, rows) and
carries the segment's page checksums in its schema metadata; a persisted
group index holds every group of a range of rows at once, with the page
checksums of the segments it covers (docs/FORMAT.md "Group sidecars" and
"Group index").
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import pyarrow as pa

from .._fileio import crc32c
from ..errors import CorruptStoreError
from ..groups import arrow_indices
from ..ragged import arrow_array, numpy_view
from ..segment import (META_PAGE_CRCS, ArrowFile, PageChecksums, batch_body, buffer_ranges, encode_ipc,
                       frame_crc)

_META_LOCAL_ROWS = b"diskreplay.rows"  # "segment": a group sidecar's rows count from its segment's first


def group_sidecar(keys: pa.Array, first_row: Optional[int], checksums: Optional[PageChecksums] = None
                  ) -> pa.RecordBatch:
    """The group sidecar of a segment whose per-row group keys are ``keys``.

    One row per group in order of first appearance: ``key``, ``count`` and the
    global ``rows`` of that group (ascending, i.e. insertion order); the
    segment's page checksums ride in the schema metadata. ``first_row=None``
    records rows counted from the segment's first (``diskreplay.rows:
    segment`` in the metadata), so the file does not depend on where the
    segment lands (an append delta's).
    """
    n = len(keys)
    if _one_group(keys):  # a small commit holds the completions of one prompt: no encoding to do
        first = numpy_view(keys)[:1].copy()
        dictionary = pa.Array.from_buffers(keys.type, 1, [None, pa.py_buffer(first)])
        counts = np.array([n], dtype=np.int64)
        order = np.arange(n, dtype=np.int64)
    else:
        enc = keys.dictionary_encode()
        dictionary = enc.dictionary
        codes = numpy_view(enc.indices).astype(np.int64)
        order = np.argsort(codes, kind="stable")
        counts = np.bincount(codes, minlength=len(dictionary)).astype(np.int64)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if first_row:
        order += first_row
    rows = pa.Array.from_buffers(_ROWS_TYPE, len(counts), [None, pa.py_buffer(offsets)],
                                 children=[arrow_array(order)])
    meta = {} if checksums is None else checksums.metadata()
    if first_row is None:
        meta[_META_LOCAL_ROWS] = b"segment"
    schema = pa.schema([pa.field("key", keys.type), _COUNT_FIELD, _ROWS_FIELD], metadata=meta or None)
    return pa.RecordBatch.from_arrays([dictionary, arrow_array(counts), rows], schema=schema)


def encode_group_sidecar(keys: pa.Array, first_row: Optional[int], checksums: Optional[PageChecksums] = None
                         ) -> pa.Buffer:
    """``encode_ipc(group_sidecar(keys, first_row, checksums))``, the bytes of a group sidecar file.

    (A small segment of one prompt group has none in a format v5 store: :func:`inline_group`.)

    >>> keys = pa.array([7, 7, 8], pa.int64())
    >>> encode_group_sidecar(keys, None).equals(encode_ipc(group_sidecar(keys, None)))
    True
    """
    return encode_ipc(group_sidecar(keys, first_row, checksums))


_ROWS_TYPE = pa.large_list(pa.int64())
_COUNT_FIELD, _ROWS_FIELD = pa.field("count", pa.int64()), pa.field("rows", _ROWS_TYPE)


def _one_group(keys: pa.Array) -> bool:
    """Whether every one of ``keys`` (integers, no nulls) is the same."""
    if keys.null_count or not len(keys) or not pa.types.is_integer(keys.type):
        return False
    v = numpy_view(keys)
    return bool((v == v[0]).all())


_INT64_ID = pa.int64().id


def inline_group(keys: pa.Array) -> Optional[int]:
    """The key of ``keys`` when all of them are one int64 key (no nulls), else None: a segment
    of these rows needs no sidecar in a store with inline groups (``SegmentEntry.group``).

    >>> inline_group(pa.array([7, 7], pa.int64())), inline_group(pa.array([7, 8], pa.int64()))
    (7, None)
    """
    n = len(keys)
    if not n or keys.type.id != _INT64_ID or keys.null_count:
        return None
    # the values buffer itself (this runs on every small commit: numpy_view's generality costs 3x)
    v = np.frombuffer(keys.buffers()[1], dtype=np.int64, count=n, offset=8 * keys.offset)
    first = v[0]
    return int(first) if n == 1 or bool((v == first).all()) else None


def inline_group_sidecar(key: int, key_type: pa.DataType, first_row: int, num_rows: int
                         ) -> Tuple[pa.Array, np.ndarray, np.ndarray, None]:
    """What :func:`read_group_sidecar` returns for a segment whose entry names its one group
    (``SegmentEntry.group``): that key, all ``num_rows`` rows, no page checksums (a small segment
    is checked whole).

    >>> keys, counts, rows, pages = inline_group_sidecar(5, pa.int64(), 10, 3)
    >>> keys.to_pylist(), counts.tolist(), rows.tolist(), pages
    ([5], [3], [10, 11, 12], None)
    """
    if key_type != pa.int64():
        raise CorruptStoreError(f"a segment of rows [{first_row}, {first_row + num_rows}) names its group {key} in "
                                f"the manifest, but the store's group key is {key_type}, not int64")
    return (arrow_array(np.array([key], dtype=np.int64)), np.array([num_rows], dtype=np.int64),
            np.arange(first_row, first_row + num_rows, dtype=np.int64), None)


def segment_local_rows(sidecar: pa.RecordBatch) -> bool:
    """Whether a group sidecar's rows count from its segment's first row (see :func:`group_sidecar`)."""
    return (sidecar.schema.metadata or {}).get(_META_LOCAL_ROWS) == b"segment"


def read_group_sidecar(path: str, nbytes: int, crc: int, key_type: pa.DataType, first_row: int,
                       num_rows: int) -> Tuple[pa.Array, np.ndarray, np.ndarray, Optional[PageChecksums]]:
    """``(keys, counts, rows, page checksums)`` of a segment's group sidecar, every invariant checked.

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
    if segment_local_rows(batch):
        rows = rows + first_row
    if (keys.null_count or batch.column("count").null_count or rows_col.null_count
            or np.any(counts <= 0) or int(counts.sum()) != num_rows or len(rows) != num_rows
            or not np.array_equal(np.diff(offsets), counts)
            or (len(rows) and (rows.min() < first_row or rows.max() >= first_row + num_rows))):
        raise CorruptStoreError(f"{path} does not index the {num_rows} rows of its segment")
    seen = np.zeros(num_rows, dtype=bool)
    seen[rows - first_row] = True
    if not seen.all():  # num_rows ids in range, all present: each row exactly once
        raise CorruptStoreError(f"{path} does not index the {num_rows} rows of its segment")
    return keys, counts, rows, PageChecksums.from_metadata(batch.schema.metadata, path)


_META_INDEX_ROWS = b"diskreplay.index.rows"  # "first end": the rows the index covers
# layout 1: per segment whose page checksums the index carries, little-endian int64
# [segment id, bytes, crc32c, page_bytes, body start, body end, pages]
_META_INDEX_SEGMENTS = b"diskreplay.index.segments"
# layout 2: "2", and the CRC-32C of each column's buffers, in column order
_META_INDEX_LAYOUT = b"diskreplay.index.layout"
_META_INDEX_CRCS = b"diskreplay.index.crc32c"
# little-endian int64: the number of fields whose buffers are recorded for each entry of the
# "segments" column, in its order (0: none), then those fields' "start end" ranges (as a
# sidecar's diskreplay.buffers), concatenated in the same order
_META_INDEX_BUFFERS = b"diskreplay.index.buffers"
_INDEX_COLUMNS = ("key", "rows", "segments", "page_crc32c")
_SEGMENT_FIELDS = 7


def _index_schema(key_type: pa.DataType) -> Dict[str, pa.DataType]:
    return {"key": pa.large_list(key_type), "rows": pa.large_list(pa.large_list(pa.int64())),
            "segments": pa.large_list(pa.int64()), "page_crc32c": pa.large_list(pa.uint32())}


def _column_crc(col: pa.Array) -> int:
    """CRC-32C of a column's buffers (its children's included) in ``buffers()`` order: the bytes a reader uses."""
    value = 0
    for b in col.buffers():
        if b is not None and b.size:
            value = crc32c(b, value)
    return value




def encode_group_index(keys: pa.Array, offsets: np.ndarray, rows: np.ndarray, first_row: int, end_row: int,
                       pages: Dict[int, Tuple[int, int, PageChecksums]]) -> Tuple[pa.Buffer, Tuple[int, int, int]]:
    """A persisted group index (layout 2, docs/FORMAT.md "Group index") and its frame
    ``(body_start, body_end, crc32c)`` for the manifest.

    The groups of rows ``[first_row, end_row)``: group ``g`` has key ``keys[g]`` and rows
    ``rows[offsets[g]:offsets[g + 1]]`` (groups ordered by their oldest row, rows ascending); and the
    page checksums of segments (``pages``: id -> ``(bytes, crc32c, checksums)``), so that a reader opens
    neither the sidecars nor more than the segments it reads. One record batch of one row whose columns
    are lists: each column is a zero-copy view of the mapped file, and its CRC-32C rides in the schema
    metadata, which the frame's checksum covers.

    >>> data, frame = encode_group_index(pa.array([7, 9]), np.array([0, 2, 3]), np.array([0, 1, 2]), 0, 3, {})
    >>> b = pa.ipc.open_file(data).get_batch(0)
    >>> b.column("key")[0].as_py(), b.column("rows")[0].as_py()
    ([7, 9], [[0, 1], [2]])
    """
    ids = sorted(pages)
    table = np.array([(sid, pages[sid][0], pages[sid][1], pages[sid][2].page_bytes, pages[sid][2].body[0],
                       pages[sid][2].body[1], len(pages[sid][2].crcs)) for sid in ids],
                     dtype=np.int64).reshape(-1, _SEGMENT_FIELDS)
    crcs = (np.concatenate([pages[sid][2].crcs for sid in ids]).astype(np.uint32) if ids
            else np.zeros(0, dtype=np.uint32))

    def one(values: pa.Array) -> pa.Array:  # the whole array as the one row of a list column
        return pa.LargeListArray.from_arrays(arrow_indices(np.array([0, len(values)])), values)

    groups = pa.LargeListArray.from_arrays(arrow_indices(offsets), arrow_indices(rows))
    columns = [one(keys), one(groups), one(arrow_indices(table.ravel())),
               one(pa.Array.from_buffers(pa.uint32(), len(crcs), [None, pa.py_buffer(crcs)]))]
    batch = pa.RecordBatch.from_arrays(columns, names=list(_INDEX_COLUMNS))
    meta = {_META_INDEX_LAYOUT: b"2", _META_INDEX_ROWS: f"{first_row} {end_row}".encode()}
    recorded = [pages[sid][2].buffers for sid in ids]
    if any(b is not None for b in recorded):
        fields = np.array([0 if b is None else len(b) for b in recorded], dtype="<i8")
        meta[_META_INDEX_BUFFERS] = b"".join([fields.tobytes()] + [b.astype("<i8").tobytes() for b in recorded
                                                                   if b is not None])
    # the column checksums are taken from the bytes as written (the writer may leave out an all-valid
    # bitmap or trim a buffer), then stored in the schema metadata: the body's bytes do not depend on it
    # (were they to, readers would find the columns damaged, warn and use the sidecars)
    draft = pa.ipc.open_file(encode_ipc(batch.replace_schema_metadata(meta))).get_batch(0)
    meta[_META_INDEX_CRCS] = " ".join(str(_column_crc(c)) for c in draft.columns).encode()
    data = encode_ipc(batch.replace_schema_metadata(meta))
    body = batch_body(pa.ipc.open_file(data).get_batch(0), data)
    return data, (body[0], body[1], frame_crc(data, body))


class IndexedPages:
    """The page checksums a persisted group index carries, looked up by segment (each segment's
    :class:`PageChecksums` is made when that segment is first opened, not on load).

    ``load`` gives ``(table, crcs)`` on the first lookup (a layout-2 index checks those columns then),
    or None when they cannot be used: then every lookup misses and the sidecars serve instead.
    """

    def __init__(self, load: Callable[[], Optional[Tuple[np.ndarray, np.ndarray]]],
                 buffers: Optional[bytes] = None) -> None:
        self._load: Optional[Callable[[], Optional[Tuple[np.ndarray, np.ndarray]]]] = load
        self._at: Dict[int, int] = {}
        self._buffers_raw = buffers  # diskreplay.index.buffers, split on the first lookup
        self._fields: Optional[np.ndarray] = None

    def get(self, seg_id: int, nbytes: int, crc: int) -> Optional[PageChecksums]:
        """The page checksums of segment ``seg_id`` if the index holds them for exactly this file."""
        if self._load is not None:
            loaded, self._load = self._load(), None
            self._table, self._crcs = loaded if loaded is not None else (
                np.zeros((0, _SEGMENT_FIELDS), dtype=np.int64), np.zeros(0, dtype=np.uint32))
            self._start = np.zeros(len(self._table) + 1, dtype=np.int64)
            np.cumsum(self._table[:, 6], out=self._start[1:])
            self._at = dict(zip(self._table[:, 0].tolist(), range(len(self._table))))
            self._split_buffers()
        i = self._at.get(seg_id)
        if i is None:
            return None
        _, seg_bytes, seg_crc, page_bytes, start, end, count = self._table[i].tolist()
        if (seg_bytes, seg_crc) != (nbytes, crc):
            return None
        buffers = None
        if self._fields is not None and self._fields[i + 1] > self._fields[i]:
            ranges = self._ranges[self._fields[i]:self._fields[i + 1]]
            buffers = buffer_ranges(ranges.tobytes(), start, end)  # (None if not inside this body)
        return PageChecksums(self._crcs[self._start[i]:self._start[i] + count], page_bytes, (start, end), buffers)

    def _split_buffers(self) -> None:
        """Where each segment's field ranges lie in ``diskreplay.index.buffers``; none are used
        when it does not fit the ``segments`` column (written for other segments, damaged)."""
        raw, self._buffers_raw = self._buffers_raw, None
        n = len(self._table)
        if not raw or len(raw) % 8 or len(raw) < 8 * n:
            return
        words = np.frombuffer(raw, dtype="<i8").astype(np.int64)
        fields = words[:n]
        if np.any(fields < 0) or 2 * int(fields.sum()) != len(words) - n:
            return
        self._fields = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(fields, out=self._fields[1:])
        self._ranges = words[n:].reshape(-1, 2)


def read_group_index(path: str, nbytes: int, crc: int, frame: Optional[Tuple[int, int, int]],
                     key_type: pa.DataType, first_row: int,
                     end_row: int) -> Tuple[pa.Array, np.ndarray, np.ndarray, IndexedPages]:
    """``(keys, offsets, rows, page checksums)`` of a persisted group index: group ``g`` has key
    ``keys[g]`` and rows ``rows[offsets[g]:offsets[g + 1]]``, zero-copy views of the mapped file.

    Layout 2 (``frame`` given): the bytes outside the body are checked against the frame's CRC-32C
    before Arrow parses a byte, then the key and row columns against their own CRC-32C (from the
    schema metadata); the page checksums' columns on the first lookup. The cost is the checksum of
    the bytes the index needs, not of the whole file, and no per-segment metadata to parse (layout 1
    keeps the page checksums in the schema metadata, parsed whole on open).
    Layout 1 (``frame`` None): the whole file is checked against ``crc``.

    Then the layout is checked in O(groups); that each row is there exactly once is the writer's
    promise, which the checksums keep (a reader does not pay O(rows) to check it again). Raises
    ``CorruptStoreError`` naming the file.
    """
    if frame is None:
        keys, counts, rows, pages = _read_group_index_v1(path, nbytes, crc, key_type, first_row, end_row)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return keys, offsets, rows, pages
    batch = ArrowFile(path, nbytes, frame=frame, whole=True).batch
    want = _index_schema(key_type)
    got = {fl.name: fl.type for fl in batch.schema}
    if got != want or batch.num_rows != 1:
        raise CorruptStoreError(f"{path} has columns {got} and {batch.num_rows} rows; a group index has {want} "
                                "and 1 row")
    meta = batch.schema.metadata or {}
    bad = CorruptStoreError(f"{path} does not index rows [{first_row}, {end_row})")
    try:
        lo, hi = (int(x) for x in meta[_META_INDEX_ROWS].split())
        expect = dict(zip(_INDEX_COLUMNS, (int(x) for x in meta[_META_INDEX_CRCS].split())))
        layout = meta[_META_INDEX_LAYOUT]
    except (KeyError, ValueError):
        raise bad from None
    if layout != b"2" or len(expect) != len(_INDEX_COLUMNS):
        raise bad
    cols = dict(zip(_INDEX_COLUMNS, batch.columns))
    for name in ("key", "rows"):
        if _column_crc(cols[name]) != expect[name]:
            raise CorruptStoreError(f"{path} fails its checksum (crc32c) in column {name!r}; the file is damaged "
                                    "and is not served; run `diskreplay verify`")

    def whole(col: pa.Array) -> Optional[pa.Array]:  # the values of a list column's one row
        offs = numpy_view(col.offsets)
        ok = not col.null_count and len(offs) == 2 and offs[0] == 0 and offs[1] == len(col.values)
        return col.values if ok else None

    keys, groups = whole(cols["key"]), whole(cols["rows"])
    if keys is None or groups is None:
        raise bad
    offsets, rows = numpy_view(groups.offsets), numpy_view(groups.values)
    n = end_row - first_row
    if ((lo, hi) != (first_row, end_row) or keys.null_count or groups.null_count or groups.values.null_count
            or len(keys) != len(groups) or offsets[0] != 0 or offsets[-1] != n or len(rows) != n
            or (len(groups) and np.any(offsets[1:] <= offsets[:-1]))):
        raise bad

    def page_checksums() -> Optional[Tuple[np.ndarray, np.ndarray]]:
        for name in ("segments", "page_crc32c"):
            if _column_crc(cols[name]) != expect[name]:
                warnings.warn(f"{path} fails its checksum (crc32c) in column {name!r}; the page checksums of "
                              "segments are read from their group sidecars instead (run `diskreplay verify`)",
                              RuntimeWarning, stacklevel=2)
                return None
        table, crcs = whole(cols["segments"]), whole(cols["page_crc32c"])
        if table is None or crcs is None or len(table) % _SEGMENT_FIELDS:
            return None
        table = numpy_view(table).reshape(-1, _SEGMENT_FIELDS)
        if int(table[:, 6].sum()) != len(crcs) or np.any(table[:, 3] < 512) or np.any(table[:, 6] < 0):
            return None
        return table, numpy_view(crcs)

    return keys, offsets, rows, IndexedPages(page_checksums, meta.get(_META_INDEX_BUFFERS))


def _read_group_index_v1(path: str, nbytes: int, crc: int, key_type: pa.DataType, first_row: int,
                         end_row: int) -> Tuple[pa.Array, np.ndarray, np.ndarray, IndexedPages]:
    """``(keys, counts, rows, page checksums)`` of a layout-1 group index (written before layout 2: the
    sidecar's layout, page checksums in the schema metadata), the whole file checked against ``crc``."""
    batch = ArrowFile(path, nbytes, crc, whole=True).batch
    want = {"key": key_type, "count": pa.int64(), "rows": pa.large_list(pa.int64())}
    got = {fl.name: fl.type for fl in batch.schema}
    if got != want:
        raise CorruptStoreError(f"{path} has columns {got}; a group index has {want}")
    meta = batch.schema.metadata or {}
    bad = CorruptStoreError(f"{path} does not index rows [{first_row}, {end_row})")
    try:
        lo, hi = (int(x) for x in meta[_META_INDEX_ROWS].split())
        table = np.frombuffer(meta[_META_INDEX_SEGMENTS], dtype="<i8").reshape(-1, _SEGMENT_FIELDS)
        all_crcs = np.frombuffer(meta[META_PAGE_CRCS], dtype="<u4")
    except (KeyError, ValueError):
        raise bad from None
    keys, rows_col = batch.column("key"), batch.column("rows")
    counts, rows = numpy_view(batch.column("count")), numpy_view(rows_col.values)
    offsets = numpy_view(rows_col.offsets)
    n = end_row - first_row
    if ((lo, hi) != (first_row, end_row) or keys.null_count or batch.column("count").null_count
            or rows_col.null_count or np.any(counts <= 0) or int(counts.sum()) != n or len(rows) != n
            or offsets[0] != 0 or not np.array_equal(np.diff(offsets), counts)
            or (n and (int(rows.min()) < first_row or int(rows.max()) >= end_row))
            or np.any(np.diff(rows[offsets[:-1]]) <= 0) or int(table[:, 6].sum()) != len(all_crcs)
            or np.any(table[:, 3] < 512) or np.any(table[:, 6] < 0)):
        raise bad
    return keys, counts, rows, IndexedPages(lambda: (table, all_crcs))
