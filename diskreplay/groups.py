"""The prompt-group index: which live rows belong to which group.

Groups are numbered by first appearance ("codes"). The store keeps one code
per live row; a :class:`GroupIndex` is the sorted view samplers use: row ids
grouped by code, insertion order inside each group, groups without live rows
dropped.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pyarrow as pa


class GroupIndex:
    """Live rows grouped by key, oldest first within each group.

    ``rows[offsets[g]:offsets[g + 1]]`` are the row ids of group ``g``, whose
    key is ``keys[g]``.

    >>> gi = GroupIndex.from_codes(np.array([0, 1, 0]), ["a", "b"], base=10)
    >>> gi.keys, gi.group(0).tolist(), gi.counts.tolist()
    (['a', 'b'], [10, 12], [2, 1])
    """

    def __init__(self, keys: List[Any], rows: np.ndarray, offsets: np.ndarray) -> None:
        self.keys = keys
        self.rows = rows
        self.offsets = offsets
        self._lookup: Optional[Dict[Any, int]] = None

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
        return cls(keys, gather.astype(np.int64) + base, offsets)

    def __len__(self) -> int:
        return len(self.keys)

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
