"""The collection floor (``FLOOR.json``; docs/FORMAT.md, "The collection floor")."""

from __future__ import annotations

import time
from typing import Optional

from ..errors import CorruptStoreError
from .names import FLOOR_FILE, FLOOR_FORMAT, MAX_ID, MAX_JSON_BYTES, manifest_file
from .jsondoc import check_header, check_signature, int_field, parse_json, signed_bytes
from ..storage.base import Publisher
from .access import StorageLike, as_storage, file_exists, location


# ---------------------------------------------------------------------------
# The collection floor (docs/FORMAT.md, "The collection floor")

#: ``FLOOR.json`` is always written as this many bytes (padded with spaces): a local store
#: rewrites it in place under a lock, and a reader that meets a torn write reads again
FLOOR_BYTES = 128
FLOOR_READS = 8  # reads of a FLOOR.json that does not parse before it counts as damaged


def floor_bytes(floor: int) -> bytes:
    """The file form of ``FLOOR.json`` holding ``floor``.

    >>> raw = floor_bytes(17); len(raw), parse_floor(raw, "FLOOR.json")
    (128, 17)
    """
    raw = signed_bytes({"format": FLOOR_FORMAT, "version": 1, "floor": int(floor)})
    return raw + b" " * (FLOOR_BYTES - len(raw))


def parse_floor(raw: bytes, where: str) -> int:
    """The floor a ``FLOOR.json``'s bytes hold (``CorruptStoreError``/``FormatError`` if they do not)."""
    doc = check_header(parse_json(raw.rstrip(b" "), where), FLOOR_FORMAT, where)
    check_signature(doc, where)
    return int_field(doc, "floor", where, hi=MAX_ID)


def read_floor(root: StorageLike) -> Optional[int]:
    """The collection floor of ``root`` (a directory or a Storage); None where there is none (a
    single-writer local store, or one an older diskreplay wrote: it is not held to one).

    A manifest generation below the floor may have been collected (or be a manifest a stale
    writer created in a collected slot); none at or above it ever was. The floor only grows.

    >>> import tempfile; read_floor(tempfile.mkdtemp()) is None
    True
    """
    root = as_storage(root)
    where = location(root, FLOOR_FILE)
    for attempt in range(FLOOR_READS):
        try:
            raw = root.read_bytes(FLOOR_FILE, MAX_JSON_BYTES)
        except FileNotFoundError:
            return None
        if not raw.strip(b" \0"):
            return None  # created, not written yet: a floor being set for the first time
        try:
            return parse_floor(raw, where)
        except CorruptStoreError:
            if attempt == FLOOR_READS - 1:
                raise
            time.sleep(0.001 * (attempt + 1))  # a local rewrite in place, met half-way: read it again
    return None


def raise_floor(storage: Publisher, floor: int) -> int:
    """Make ``storage``'s collection floor at least ``floor``, durably, before anything below it
    is deleted; returns the floor now (lower than asked when it cannot be raised now: the lock of
    a local store is held by another writer, its filesystem has no locks, or an object store's
    conditional writes kept losing; nothing below the returned value may be deleted then).

    >>> from diskreplay.storage.local import LocalStorage
    >>> import tempfile; s = LocalStorage(tempfile.mkdtemp())
    >>> raise_floor(s, 5), raise_floor(s, 3), read_floor(s)
    (5, 5, 5)
    """
    where = location(storage, FLOOR_FILE)

    def update(raw: Optional[bytes]) -> Optional[bytes]:
        if not raw or not raw.strip(b" \0"):
            return floor_bytes(floor)  # the first floor of this store
        return floor_bytes(floor) if floor > parse_floor(raw, where) else None

    raw = storage.update_small(FLOOR_FILE, update)
    return parse_floor(raw, where) if raw and raw.strip(b" \0") else 0


def lowest_present(storage: StorageLike, newest: int) -> int:
    """The lowest generation of the run of present manifests that ends at ``newest`` (0 for an
    empty store), found with O(log n) probes (``stat``s, HEADs) downwards: where a store gets its
    first floor (one an older diskreplay wrote, or converted to many writers), every generation
    below that run is collected or being collected, so it is a true floor."""
    if newest <= 1:
        return newest
    storage = as_storage(storage)
    low, step = newest, 1
    while low - step >= 1 and file_exists(storage, manifest_file(low - step)):
        low -= step
        step *= 2
    gone = max(low - step, 0)  # absent (or generation 0): the run starts above it
    while low - gone > 1:
        mid = (low + gone) // 2
        if file_exists(storage, manifest_file(mid)):
            low = mid
        else:
            gone = mid
    return low
