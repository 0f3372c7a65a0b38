"""Media blobs in the format (docs/FORMAT.md, "Media"): a manifest's entries as an append and
eviction change them, their JSON parsed, and a blob's bytes checked against its entry (size,
CRC-32C and, where asked, the content hash)."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np
import pyarrow as pa

from .._fileio import crc32c
from ..errors import ArgumentError, CommitConflictError, CorruptStoreError, FormatError
from ..schema import ARRAY_MIME, MEDIA_WIDTH, media_hash
from .entries import MediaEntry
from .jsondoc import entry_list, evolve
from .names import MEDIA_MANIFEST_VERSION


def check_blob(buf: Any, entry: MediaEntry, where: str, content: bool = False) -> None:
    """Raise ``CorruptStoreError`` naming ``where`` unless ``buf`` (the blob file's bytes) has the
    entry's size and CRC-32C (and, with ``content``, its SHA-256 content hash).

    >>> from diskreplay.schema import media_hash
    >>> data = b"abc"
    >>> e = MediaEntry(media_hash({"mime": "image/png"}, data).hex(), 1, 3, crc32c(data), 0, "image/png")
    >>> check_blob(data, e, "b", content=True)
    """
    damaged = ("; the media blob is damaged: its rows' other columns are intact, but its bytes are not served "
               "(`diskreplay repair` drops it; an append of the same content then stores it again)")
    size = len(buf)
    if size != entry.bytes:
        raise CorruptStoreError(f"{where} holds {size} bytes but its manifest says {entry.bytes}{damaged}")
    if crc32c(buf) != entry.crc32c:
        raise CorruptStoreError(f"{where} fails its checksum{damaged}")
    if content and media_hash(entry.descriptor, buf).hex() != entry.hash:
        raise CorruptStoreError(f"{where} does not hash to {entry.hash[:16]}...{damaged}")


def blob_value(buf: Any, entry: MediaEntry) -> Any:
    """The value a blob holds: its bytes (a zero-copy ``memoryview`` of ``buf``), or for an array
    (``application/x-array``) a read-only numpy view of them with the entry's dtype and shape."""
    view = memoryview(buf)
    if entry.mime != ARRAY_MIME or entry.dtype is None:
        return view
    arr = np.frombuffer(view, dtype=np.dtype(entry.dtype)) if entry.bytes else np.zeros(0, np.dtype(entry.dtype))
    return arr.reshape(entry.shape or ())


def live_media(media: Tuple[MediaEntry, ...], head: int) -> Tuple[MediaEntry, ...]:
    """The media blobs a live row still names: an entry goes exactly when its ``last_row`` (the
    newest row naming it) is evicted.

    >>> [e.id for e in live_media((MediaEntry("a" * 64, 1, 1, 0, 4, "image/png"),
    ...                            MediaEntry("b" * 64, 2, 1, 0, 5, "image/png")), 5)]
    [2]
    """
    if not media or all(e.last_row >= head for e in media):
        return media
    return tuple(e for e in media if e.last_row >= head)


def add_media(media: Tuple[MediaEntry, ...], new: Sequence[MediaEntry], last: Sequence[Tuple[str, int]],
              first_row: int) -> Tuple[MediaEntry, ...]:
    """``media`` after an append at ``first_row`` whose rows name the hashes of ``last`` (each with
    the last of its rows naming it, counted from ``first_row``) and that wrote the blobs ``new``:
    a hash the base names keeps its entry (``last_row`` moved up; a blob written for it anyway is
    left unnamed), one it does not is added from ``new``. Raises ``CommitConflictError`` when
    neither holds (the entry the writer saw was evicted since: it must write the blob).

    >>> e = MediaEntry("a" * 64, 1, 1, 0, 0, "image/png")
    >>> [(x.id, x.last_row) for x in add_media((e,), (evolve(e, {"id": 9}),), (("a" * 64, 2),), 10)]
    [(1, 12)]
    """
    if not last:
        return media
    index = {e.hash: i for i, e in enumerate(media)}
    own = {e.hash: e for e in new}
    out = list(media)
    for h, local in last:
        row = first_row + local
        i = index.get(h)
        if i is not None:
            if out[i].last_row < row:
                out[i] = evolve(out[i], {"last_row": row})
        elif h in own:
            index[h] = len(out)
            out.append(evolve(own[h], {"last_row": row}))
        else:
            raise CommitConflictError(f"the media blob {h[:16]}... this append names was evicted by another commit "
                                      "after the append was planned (its writer writes the blob again)")
    return tuple(out)


def manifest_media(doc: Mapping[str, Any], where: str) -> Tuple[MediaEntry, ...]:
    """A manifest's ``media``: in version 5 only, a non-empty list of entries, oldest first."""
    return entry_list(doc, "media", (MEDIA_MANIFEST_VERSION,), limit=1 << 24, what="media blobs",
                      parse=MediaEntry.from_dict, where=where)


def delta_media(doc: Mapping[str, Any], num_rows: int, where: str) -> Dict[str, Any]:
    """An append delta's ``media`` (the blobs it wrote) and ``media_last`` (per hash its rows name,
    the last of those rows, from 0): version 3 only."""
    raw, last = doc.get("media", []), doc.get("media_last")
    if not isinstance(raw, list) or not isinstance(last, list) or not last:
        raise FormatError(f"Unsupported media/media_last in {where}; expected a list and a non-empty list")
    pairs = []
    for p in last:
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int
                and 0 <= p[1] < num_rows):
            raise FormatError(f"Unsupported media_last {p!r:.100} in {where}; expected [hash, row of the append]")
        pairs.append((p[0], p[1]))
    media = tuple(MediaEntry.from_dict(e, where) for e in raw)
    if not {e.hash for e in media} <= {h for h, _ in pairs}:
        raise FormatError(f"Unsupported media in {where}: a blob no row of the append names")
    return {"media": media, "media_last": tuple(pairs)}


def hash_rows(col: Any) -> np.ndarray:
    """A media column's rows (Arrow ``fixed_size_list<int64, 4>`` or a ``[n, 4]`` array) as
    ``[n, 4]`` int64."""
    if isinstance(col, (pa.Array, pa.ChunkedArray)):
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        return np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=np.int64).reshape(-1, MEDIA_WIDTH)
    arr = np.asarray(col)
    if arr.ndim != 2 or arr.shape[1] != MEDIA_WIDTH or arr.dtype.kind not in "iu":
        raise ArgumentError(f"media references must be [n, {MEDIA_WIDTH}] int64 (a media column as read), got "
                            f"{arr.dtype}{list(arr.shape)}")
    return arr.astype(np.int64, copy=False)


def hex_of(words: np.ndarray) -> str:
    """The content hash (64 hex digits) of one media row (four int64)."""
    return np.ascontiguousarray(words, dtype="<i8").tobytes().hex()
