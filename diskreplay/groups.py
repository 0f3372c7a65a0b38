"""The prompt-group index: which live rows belong to which group.

A :class:`GroupIndex` is the sorted view samplers use: row ids grouped by
key, insertion order inside each group, groups ordered by their oldest live
row and groups without live rows dropped. The store keeps one per commit and
brings it forward without rebuilding it: :meth:`GroupIndex.extended` adds the
rows of new segments (their group sidecars), :meth:`GroupIndex.evicted` drops
rows below a new head, both vectorised, O(rows + groups) memory moves and no
Python loop over rows or groups. A persisted index (docs/FORMAT.md, "Group
index") is one of these, written to a file.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .ragged import arrow_array, gather_ranges, numpy_view


def arrow_indices(a: np.ndarray) -> pa.Array:
    """int64 numpy values as a pyarrow array, zero-copy (``pa.array`` of numpy imports pandas on
    first use: over 100 ms, more than opening a store).

    >>> arrow_indices(np.array([3, 1])).to_pylist()
    [3, 1]
    """
    return arrow_array(np.asarray(a, dtype=np.int64))


class GroupIndex:
    """Live rows grouped by key, oldest first within each group.

    ``rows[offsets[g]:offsets[g + 1]]`` are the row ids of group ``g``, whose
    key is ``keys[g]``.

    >>> gi = GroupIndex.from_codes(np.array([0, 1, 0]), ["a", "b"], base=10)
    >>> gi.keys, gi.group(0).tolist(), gi.counts.tolist()
    (['a', 'b'], [10, 12], [2, 1])
    """

    def __init__(self, keys: Any, rows: np.ndarray, offsets: np.ndarray, min_row: Optional[int] = None) -> None:
        # keys: a list, or a pyarrow array turned into a list only when asked for
        # (41 k Python objects cost more than the rest of a reopened store's index)
        self._keys: Optional[List[Any]] = keys if isinstance(keys, list) else None
        self._arrow: Optional[pa.Array] = None if isinstance(keys, list) else keys
        self.rows = rows
        self.offsets = offsets
        # no row is below min_row (known without looking): evicting below it is free, not O(groups)
        self._min_row = min_row
        self._lookup: Optional[Dict[Any, int]] = None

    @property
    def keys(self) -> List[Any]:
        """Group keys, in group order."""
        if self._keys is None:
            self._keys = self._arrow.to_pylist()
        return self._keys

    def arrow_keys(self, type: Optional[pa.DataType] = None) -> pa.Array:
        """The keys as a pyarrow array (of ``type``, when given)."""
        if self._arrow is None or (type is not None and self._arrow.type != type):
            self._arrow = pa.array(self._keys if self._keys is not None else self._arrow.to_pylist(), type=type)
        return self._arrow

    @classmethod
    def from_codes(cls, codes: np.ndarray, dictionary: Sequence[Any], base: int) -> "GroupIndex":
        """Index rows ``base + i`` whose group code is ``codes[i]`` (``dictionary[code]`` is the key)."""
        order = np.argsort(codes, kind="stable")
        counts = np.bincount(codes, minlength=len(dictionary)) if len(codes) else np.zeros(
            len(dictionary), dtype=np.int64)
        present = np.flatnonzero(counts)
        starts = np.zeros(len(dictionary) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        # groups are listed by their oldest live row, which after eviction need
        # not be the order in which their keys first appeared
        first_row = order[starts[present]]
        present = present[np.argsort(first_row, kind="stable")]
        offsets = np.zeros(len(present) + 1, dtype=np.int64)
        np.cumsum(counts[present], out=offsets[1:])
        rank = np.zeros(len(dictionary), dtype=np.int64)
        rank[present] = np.arange(len(present))
        gather = np.argsort(rank[codes], kind="stable") if len(codes) else order
        keys = [dictionary[i] for i in present.tolist()]
        return cls(keys, gather.astype(np.int64) + base, offsets, min_row=base)

    @classmethod
    def from_groups(cls, keys: pa.Array, counts: np.ndarray, rows: np.ndarray, head: int = 0) -> "GroupIndex":
        """The index of a table of groups (a persisted index: ``keys[g]`` has ``counts[g]`` rows, listed
        in ``rows`` group after group, ascending, groups ordered by their oldest row), without rows
        below ``head``. No copy when no row is below ``head``.

        >>> gi = GroupIndex.from_groups(pa.array([7, 9]), np.array([2, 1]), np.array([0, 2, 1]), head=1)
        >>> gi.keys, gi.rows.tolist(), gi.counts.tolist()
        ([9, 7], [1, 2], [1, 1])
        """
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return cls(keys, rows, offsets).evicted(head)

    def evicted(self, head: int) -> "GroupIndex":
        """This index without the rows below ``head`` (itself when it has none)."""
        G = len(self)
        if G == 0 or (self._min_row is not None and head <= self._min_row):
            return self
        if int(self.rows[self.offsets[:-1]].min()) >= head:
            self._min_row = head
            return self
        # rows ascend inside a group, so a group's live rows are a suffix of it
        live = np.add.reduceat((self.rows >= head).astype(np.int64), self.offsets[:-1])
        keep = np.flatnonzero(live)
        live = live[keep]
        starts = self.offsets[keep + 1] - live
        # a group's oldest live row moved: order the groups again by it
        order = np.argsort(self.rows[starts], kind="stable")
        keep, live, starts = keep[order], live[order], starts[order]
        offsets = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(live, out=offsets[1:])
        keys = ([self._keys[i] for i in keep.tolist()] if self._keys is not None
                else self._arrow.take(arrow_indices(keep)))
        return GroupIndex(keys, gather_ranges(self.rows, starts, live), offsets, min_row=head)

    def extended(self, parts: Sequence[Tuple[pa.Array, np.ndarray, np.ndarray]], min_row: int) -> "GroupIndex":
        """This index with the rows of newer segments: ``parts`` are their sidecars' ``(keys, counts,
        rows)`` in row order; rows below ``min_row`` (already indexed) are skipped.

        Each new row goes to the end of its group (new rows are newer than every indexed one); groups
        seen for the first time follow the others in order of first appearance. One ``np.insert``
        moves the rows; keys are matched with one hash lookup (``pyarrow.compute.index_in``).

        >>> gi = GroupIndex.from_groups(pa.array([7, 9]), np.array([2, 1]), np.array([0, 1, 2]))
        >>> gi = gi.extended([(pa.array([9, 5]), np.array([1, 1]), np.array([3, 4]))], min_row=3)
        >>> gi.keys, gi.rows.tolist(), gi.offsets.tolist()
        ([7, 9, 5], [0, 1, 2, 3, 4], [0, 2, 4, 5])
        """
        keys, counts, rows = [], [], []
        for k, c, r in parts:
            c = np.asarray(c, dtype=np.int64)
            if len(r) and int(r.min()) < min_row:
                off = np.zeros(len(c), dtype=np.int64)
                np.cumsum(c[:-1], out=off[1:])
                c = np.add.reduceat((r >= min_row).astype(np.int64), off) if len(c) else c
                r = r[r >= min_row]
                k = k.take(arrow_indices(np.flatnonzero(c > 0)))
                c = c[c > 0]
            if len(c):
                keys.append(k), counts.append(c), rows.append(r)
        if not keys:
            return self
        keys = pa.concat_arrays([k.cast(keys[0].type) for k in keys]) if len(keys) > 1 else keys[0]
        counts, rows = np.concatenate(counts), np.concatenate(rows)
        G = len(self)
        base = self.arrow_keys(keys.type) if G else pa.nulls(0, type=keys.type)
        found = pc.index_in(keys, value_set=base)
        code = numpy_view(found).astype(np.int64)
        if found.null_count:  # not fill_null(found, -1): a Python fill value imports pandas (0.4 s, once)
            code[~numpy_view(found.is_valid())] = -1
        new = code < 0
        if new.any():
            enc = keys.take(arrow_indices(np.flatnonzero(new))).dictionary_encode()
            fresh = numpy_view(enc.indices).astype(np.int64)
            # new groups are ordered by their oldest row (skipping rows below min_row can
            # reorder a sidecar's groups, which are listed by first appearance in the segment)
            entry_first = rows[np.cumsum(counts) - counts][new]
            oldest = np.full(len(enc.dictionary), np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(oldest, fresh, entry_first)
            order = np.argsort(oldest, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(len(order))
            code[new] = G + rank[fresh]
            fresh_keys = enc.dictionary.take(arrow_indices(order))
        else:
            fresh_keys = keys.slice(0, 0)
        # the new rows sorted by group (stable: segment order, then row order inside a sidecar entry)
        order = np.argsort(code, kind="stable")
        entry_start = np.zeros(len(counts), dtype=np.int64)
        np.cumsum(counts[:-1], out=entry_start[1:])
        moved = gather_ranges(rows, entry_start[order], counts[order])
        # a row of an indexed group goes in after that group's last row, a new group's after all
        ends = self.offsets[1:]
        at = np.repeat(np.where(code[order] < G, ends[np.minimum(code[order], max(G - 1, 0))] if G else 0,
                                len(self.rows)), counts[order])
        all_rows = _insert_sorted(self.rows, at, moved)
        G2 = G + len(fresh_keys)
        total = np.zeros(G2, dtype=np.int64)
        total[:G] = np.diff(self.offsets)
        total += np.bincount(code, weights=counts, minlength=G2).astype(np.int64)
        offsets = np.zeros(G2 + 1, dtype=np.int64)
        np.cumsum(total, out=offsets[1:])
        if self._keys is not None and self._arrow is None:
            all_keys: Any = self._keys + fresh_keys.to_pylist()
        else:
            all_keys = pa.concat_arrays([base, fresh_keys]) if G else fresh_keys
        floor = None if self._min_row is None else min(self._min_row, min_row)
        return GroupIndex(all_keys, all_rows, offsets, min_row=floor if G else min_row)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def counts(self) -> np.ndarray:
        """Rows per group, in group order."""
        return np.diff(self.offsets)

    def group(self, g: int) -> np.ndarray:
        """Row ids of the ``g``-th group, oldest first."""
        return self.rows[self.offsets[g]:self.offsets[g + 1]]

    def position(self, key: Any) -> Optional[int]:
        """Index of the group with ``key``, or None."""
        if self._lookup is None:
            self._lookup = {k: i for i, k in enumerate(self.keys)}
        if isinstance(key, np.generic):
            key = key.item()
        return self._lookup.get(key)


def _insert_sorted(a: np.ndarray, at: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``np.insert(a, at, values)`` for ``at`` in ascending order, in one pass over ``a``, and a plain
    concatenation when every value goes at the end (new groups only: the usual commit).

    >>> _insert_sorted(np.array([1, 2, 3]), np.array([1, 1, 3]), np.array([7, 8, 9])).tolist()
    [1, 7, 8, 2, 3, 9]
    """
    if not len(at) or at[0] == len(a):
        return np.concatenate([a, values])
    out = np.empty(len(a) + len(values), dtype=np.result_type(a, values))
    dest = at + np.arange(len(at))  # each value lands after the values inserted before it
    old = np.ones(len(out), dtype=bool)
    old[dest] = False
    out[dest] = values
    out[old] = a
    return out


class KeyCoder:
    """Assigns stable integer codes to group keys in order of first appearance.

    A plain dict: encoding n keys costs O(n) however many groups exist (an
    Arrow ``index_in`` against a growing value set rebuilt its hash table on
    every call, which made rebuilding a large store's index quadratic).

    >>> kc = KeyCoder(); kc.encode(pa.array([5, 7, 5])).tolist(), kc.encode(pa.array([9, 7])).tolist()
    ([0, 1, 0], [2, 1])
    >>> kc.keys
    [5, 7, 9]
    """

    def __init__(self) -> None:
        self.keys: List[Any] = []
        self._codes: Dict[Any, int] = {}

    def encode(self, keys: Any) -> np.ndarray:
        """Codes of ``keys`` (a pyarrow array, numpy array or list), new keys numbered next."""
        if isinstance(keys, (pa.Array, pa.ChunkedArray)):
            keys = keys.to_pylist()
        elif isinstance(keys, np.ndarray):
            keys = keys.tolist()
        codes = self._codes
        out = np.empty(len(keys), dtype=np.int64)
        for i, k in enumerate(keys):
            c = codes.get(k)
            if c is None:
                c = codes[k] = len(self.keys)
                self.keys.append(k)
            out[i] = c
        return out
