"""Media blobs (docs/FORMAT.md, "Media"): what an append writes for its media columns, and
:class:`MediaReader`, which serves a committed blob's bytes zero-copy.

An ``extend`` hashes each media value (:class:`~diskreplay.schema.Media`); its rows hold the
hashes, and the blobs of the hashes its base does not name are written beside its segments
(:func:`media_writes`) and named by its commit (``ops.Append``'s ``media`` and ``media_last``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import pyarrow as pa

from .. import format as fmt
from .._fileio import crash_point, crc32c
from ..errors import RowsEvictedError
from ..format.media import blob_value, check_blob, hash_rows, hex_of
from ..schema import Media, Schema
from .writing import fresh_id

Blobs = Mapping[bytes, Tuple[dict, Any]]


def pending_media(batch: Any) -> Optional[Dict[bytes, Tuple[dict, Any]]]:
    """The blobs of ``batch``'s media columns, each content once (None: it has none)."""
    if not isinstance(batch, Mapping):
        return None
    out: Dict[bytes, Tuple[dict, Any]] = {}
    for name, v in batch.items():
        if isinstance(v, Media):
            out.update(v.blobs(str(name))[1])  # (hashed once: normalize_batch asked already)
    return out or None


def media_last_rows(record: pa.RecordBatch, schema: Schema) -> Tuple[Tuple[str, int], ...]:
    """Per content hash the rows of ``record`` name (its media columns), the last such row."""
    last: Dict[str, int] = {}
    for spec in schema.columns.values():
        if spec.media and spec.name in record.schema.names:
            for i, w in enumerate(hash_rows(record.column(spec.name))):
                last[hex_of(w)] = i
    return tuple(last.items())


def media_writes(committer: Any, base: fmt.Manifest, blobs: Blobs, last: Sequence[Tuple[str, int]],
                 segments: Sequence[fmt.SegmentEntry], reserves_ids: bool
                 ) -> Tuple[Tuple[fmt.MediaEntry, ...], Tuple[str, ...], Tuple[Any, ...]]:
    """The blobs an append writes, ``(entries, their files, the writes)``: one per hash its rows
    name that ``base`` does not name. Ids after its ``segments``' (one writer), or the first free
    names from the base's ``next_segment`` on, created only if absent (``reserves_ids``); the
    writes are made durable with the commit's segments, before its manifest."""
    named = {e.hash for e in base.media}
    by_hex = {d.hex(): v for d, v in blobs.items()}
    at = max([base.next_segment] + [e.id + 1 for e in segments])
    entries: List[fmt.MediaEntry] = []
    files: List[str] = []
    writes: List[Any] = []
    try:
        for h, row in last:
            if h in named:
                continue  # stored once: the base's blob serves these rows
            desc, payload = by_hex[h]
            if reserves_ids:
                bid, rel = fresh_id(committer, base, lambda i: committer.storage.reserve(fmt.media_file, i), at)
            else:
                bid, rel = at, fmt.media_file(at)
            at = bid + 1
            data = payload if isinstance(payload, bytes) else bytes(payload)
            files.append(rel)
            writes.append((rel, data, "segment"))
            entries.append(fmt.MediaEntry(h, bid, len(data), crc32c(data), row, desc["mime"], desc.get("dtype"),
                                          tuple(desc["shape"]) if "dtype" in desc else None))
    except BaseException:
        committer.remove_files(files)
        raise
    return tuple(entries), tuple(files), tuple(writes)


def mark_media(committer: Any, options: fmt.StoreOptions) -> fmt.StoreOptions:
    """Say in FORMAT.json (version 7), before the first commit that names a blob, that the store may
    have them, so that a diskreplay without media refuses it rather than misreading it."""
    marked = dataclasses.replace(options.with_stored_flags(committer.storage), media=True)
    doc = dataclasses.replace(marked, schema=None) if marked.multi_writer else marked
    committer.storage.replace(fmt.FORMAT_FILE, fmt.signed_bytes(doc.body()), step="format")
    crash_point("format.done")
    return marked


class MediaReader:
    """Serves the media blobs a store's rows name, zero-copy (docs/media.md).

    A media column reads as content hashes (``[n, 4]`` int64); :meth:`get` gives one row's
    value: its bytes as a ``memoryview`` of the blob file mapped in place (local stores; one read
    of the object on object storage), or a read-only numpy array for an array blob. A blob is
    checked against its manifest entry's size and CRC-32C the first time this reader serves it;
    a damaged one raises ``CorruptStoreError`` naming its hash and file, and is never served.
    :meth:`batch` serves many rows, calling ``decode(value, entry)`` once per distinct hash of
    the batch (a group's samples share one image: it is decoded once) and handing the same
    decoded object to every row that names it.

    >>> import tempfile, diskreplay as dr
    >>> store = dr.ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [1, 1], "completion_ids": [[5], [6]],
    ...                   "image": dr.Media([b"PNG 1", b"PNG 1"], mime="image/png")})
    >>> refs = store.read([0, 1])["image"]
    >>> reader = dr.MediaReader(store)
    >>> bytes(reader.get(refs[0])), reader.entry(refs[1]).mime
    (b'PNG 1', 'image/png')
    >>> calls = []
    >>> decoded = reader.batch(refs, decode=lambda v, e: calls.append(1) or bytes(v).lower())
    >>> decoded, len(calls)
    ([b'png 1', b'png 1'], 1)
    """

    def __init__(self, store: Any, max_open: int = 4096) -> None:
        self.store = store
        self.max_open = max_open
        self._index: Tuple[int, Dict[str, fmt.MediaEntry]] = (-1, {})
        self._open: Dict[Tuple[int, int], Any] = {}  # (id, crc32c) -> checked buffer

    def _entries(self) -> Dict[str, fmt.MediaEntry]:
        m = self.store.manifest
        if self._index[0] != m.generation:
            self._index = (m.generation, {e.hash: e for e in m.media})
        return self._index[1]

    def entry(self, ref: Any) -> fmt.MediaEntry:
        """The manifest entry of the blob a media row (four int64, or 32 bytes, or 64 hex digits) names."""
        h = ref if isinstance(ref, str) else bytes(ref).hex() if isinstance(ref, (bytes, bytearray)) else hex_of(ref)
        e = self._entries().get(h)
        if e is None:
            raise RowsEvictedError(f"media blob {h[:16]}... is not named by generation {self.store.generation} of "
                                   f"{self.store.path}: every row naming it was evicted, or `diskreplay repair` "
                                   "dropped it as damaged (an append of the same content stores it again), or the "
                                   "reference is not from this store")
        return e

    def _buffer(self, e: fmt.MediaEntry) -> Any:
        key = (e.id, e.crc32c)
        buf = self._open.get(key)
        if buf is None:
            storage = self.store.storage
            where = f"{self.store.path}/{e.file} (media blob {e.hash[:16]}...)"
            mapped = storage.map(e.file) if e.bytes else None
            buf = pa.py_buffer(mapped) if mapped is not None else None  # (zero-copy; what the checksum takes)
            if buf is None:
                try:
                    buf = storage.read_bytes(e.file) if e.bytes else b""
                except FileNotFoundError:
                    from ..errors import CorruptStoreError

                    raise CorruptStoreError(f"{where} is missing; the media blob is damaged: its rows' other "
                                            "columns are intact, but its bytes are not served") from None
            check_blob(buf, e, where)
            if len(self._open) >= self.max_open:
                self._open.pop(next(iter(self._open)))
            self._open[key] = buf
        return buf

    def get(self, ref: Any) -> Any:
        """One media row's value: its bytes (``memoryview``) or, for an array, a read-only numpy array."""
        e = self.entry(ref)
        return blob_value(self._buffer(e), e)

    def batch(self, refs: Any, decode: Optional[Callable[[Any, fmt.MediaEntry], Any]] = None) -> List[Any]:
        """The values of the media rows ``refs`` (``[n, 4]``, a media column as read), in order;
        ``decode(value, entry)`` is applied once per distinct hash, its result shared by the rows
        that name it (a cache that lives for this call only)."""
        words = hash_rows(refs)
        seen: Dict[Hashable, Any] = {}
        out = []
        for w in words:
            h = hex_of(w)
            if h not in seen:
                e = self.entry(h)
                v = blob_value(self._buffer(e), e)
                seen[h] = decode(v, e) if decode is not None else v
            out.append(seen[h])
        return out

    def close(self) -> None:
        """Drop the mapped blobs (views handed out keep theirs alive)."""
        self._open.clear()
