"""The group indexes a store serves: its own group key's, brought forward commit by commit, and
those of other per-row columns, built on demand and kept until the next commit.

A reopened store starts its own index from the persisted one (one file, ``groups/index-*.arrow``)
and adds the rows of newer segments from their sidecars; later commits add their own rows the same
way, so no segment is read to group the rows.

>>> import tempfile
>>> from diskreplay import ReplayStore
>>> store = ReplayStore(tempfile.mkdtemp())
>>> _ = store.extend({"prompt_id": [7, 7, 9], "completion_ids": [[1], [2], [3]]})
>>> list(store._groups.bring_forward(store._view()).keys)
[7, 9]
>>> store.close()
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import pyarrow as pa

from ..errors import CorruptStoreError
from ..groups import GroupIndex
from ..segment import prefetch_files
from ..format.sidecars import read_group_index
from .reading import index_of_column
from .segment_cache import ReadView, SegmentCache

__all__ = ["GroupIndexes"]


class GroupIndexes:
    """The group indexes of one store (see the module docstring)."""

    def __init__(self, cache: SegmentCache) -> None:
        self.cache = cache
        # the store-key group index of rows [head, own_end), brought forward commit by commit
        self.own: Optional[GroupIndex] = None
        self.own_end = 0
        #: key -> (generation, index): the indexes served, each valid for its generation
        self.by_key: Dict[Optional[str], Tuple[int, GroupIndex]] = {}

    def served(self, key: Optional[str], generation: Callable[[], int], build: Callable[[], GroupIndex]
               ) -> GroupIndex:
        """The index by ``key`` of the current commit (``generation()``): the one served for it
        already, else ``build()``'s (kept for the generation current once it is built)."""
        hit = self.by_key.get(key)
        if hit is not None and hit[0] == generation():
            return hit[1]
        gi = build()
        self.by_key[key] = (generation(), gi)
        return gi

    def keep_valid(self, next_row: int) -> None:
        """After a commit: the index of rows still live stays valid (new rows are indexed lazily);
        one past ``next_row`` (a roll-back) is rebuilt."""
        if self.own is not None and next_row < self.own_end:
            self.own = None

    def bring_forward(self, view: ReadView) -> GroupIndex:
        """The store key's index over ``view``'s live rows."""
        m, storage = view.manifest, self.cache.storage
        gi, end = self.own, self.own_end
        if gi is None:
            gi, end = self.load(view)
        if end < m.next_row:
            tail = [s for s in m.segments if s.end_row > end]
            if len(tail) > 1 and storage.can_map:  # cold, read them together, not one after another
                prefetch_files([(os.path.join(self.cache.path, s.groups_file), [(0, 0)]) for s in tail
                                if s.groups_bytes])
            parts = [self.cache.sidecar(s, view)[:3] for s in tail]
            gi = gi.extended(parts, min_row=max(end, m.head))
        gi = gi.evicted(m.head)
        self.own, self.own_end = gi, m.next_row
        return gi

    def load(self, view: ReadView) -> Tuple[GroupIndex, int]:
        """The persisted group index of ``view``'s manifest and the row it ends at (an empty index at
        ``head`` when there is none, or it cannot be used: the sidecars hold the same information)."""
        m, storage, where = view.manifest, self.cache.storage, self.cache.path
        keys = [] if view.schema is None else pa.nulls(0, type=view.key_type)  # no row committed yet
        empty = GroupIndex(keys, np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), min_row=m.head)
        e = m.group_index
        if e is None or e.end_row <= m.head or e.first_row > m.head:
            return empty, m.head
        try:
            path = (storage.fetch_ranges(e.file, None, size=e.bytes, evict=False, tag=f"{e.bytes}-{e.crc32c:08x}")
                    if not storage.can_map else storage.local_path(e.file))
            keys, offsets, rows, pages = read_group_index(path, e.bytes, e.crc32c, e.frame, view.key_type,
                                                          e.first_row, e.end_row)
        except FileNotFoundError:
            # collected with its manifest (a reader behind the writer: the caller reads a newer one), or
            # missing while its manifest is there: the sidecars hold the same information
            if not storage.exists(m.file):
                raise
            warnings.warn(f"{where}/{e.file}, the group index {m.file} names, is missing; the group index "
                          "is rebuilt from the group sidecars instead (run `diskreplay verify`)", RuntimeWarning,
                          stacklevel=6)
            return empty, m.head
        except CorruptStoreError as exc:
            warnings.warn(f"{exc}; the group index is rebuilt from the group sidecars instead (run "
                          "`diskreplay verify`)", RuntimeWarning, stacklevel=6)
            return empty, m.head
        self.cache.index_pages = pages
        # every row of the file is at least first_row: with no eviction since, nothing to drop or scan
        return GroupIndex(keys, rows, offsets, min_row=e.first_row).evicted(m.head), e.end_row


def column_index(values: Any, ids: np.ndarray, head: int, holes: bool) -> GroupIndex:
    """The groups of the live rows ``ids`` (from ``head``) by their ``values`` of a per-row column."""
    gi = index_of_column(values, head)
    if not holes:
        return gi
    # the index counts positions from head; the rows after a hole have larger ids
    return GroupIndex(gi.keys, ids[gi.rows - head], gi.offsets, min_row=head)
