"""Interval arithmetic on half-open ``[start, stop)`` integer ranges: rows, bytes, pages.

One home for the range helpers the samplers (row-id sets), the object cache
(byte ranges held and fetched), the page checks (runs of pages) and the read
hints (byte spans to advise) share.

>>> merge_ranges([(10, 20), (0, 5), (18, 30), (33, 40)], gap=3)
[(0, 5), (10, 40)]
"""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

import numpy as np

__all__ = ["Range", "coalesce", "merge_ranges", "runs", "subtract_ranges"]

Range = Tuple[int, int]


def merge_ranges(ranges: Iterable[Sequence[int]], gap: int = 0) -> List[Range]:
    """Sort ``ranges`` and merge those that overlap, touch or lie at most ``gap`` apart; empty
    ranges are dropped.

    >>> merge_ranges([(8, 12), (0, 4), (4, 6), (10, 16), (20, 20)])
    [(0, 6), (8, 16)]
    """
    out: List[Range] = []
    for s, e in sorted((int(a), int(b)) for a, b in ranges):
        if e <= s:
            continue
        if out and s <= out[-1][1] + gap:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def subtract_ranges(want: Sequence[Range], have: Sequence[Range]) -> List[Range]:
    """The parts of merged ranges ``want`` not covered by merged ranges ``have``.

    >>> subtract_ranges([(0, 100)], [(10, 20), (50, 60)])
    [(0, 10), (20, 50), (60, 100)]
    """
    out: List[Range] = []
    j = 0
    for s, e in want:
        while j < len(have) and have[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(have) and have[k][0] < e:
            if have[k][0] > cur:
                out.append((cur, have[k][0]))
            cur = max(cur, have[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def coalesce(starts: np.ndarray, ends: np.ndarray, gap: int) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`merge_ranges` for numpy arrays of starts and ends (any order, overlaps allowed):
    sorted, disjoint spans that cover every range, those at most ``gap`` apart merged.

    >>> s, e = coalesce(np.array([100, 0, 10]), np.array([120, 8, 12]), gap=2)
    >>> s.tolist(), e.tolist()
    ([0, 100], [12, 120])
    """
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    lo, hi = starts[order], ends[order]
    reach = np.maximum.accumulate(hi)
    first = np.ones(len(lo), dtype=bool)
    first[1:] = lo[1:] > reach[:-1] + gap
    return lo[first], reach[np.append(np.flatnonzero(first)[1:] - 1, len(lo) - 1)]


def runs(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """First and last value of each run of consecutive integers in sorted, unique ``values``.

    >>> first, last = runs(np.array([2, 3, 4, 9, 11, 12]))
    >>> first.tolist(), last.tolist()
    ([2, 9, 11], [4, 9, 12])
    """
    values = np.asarray(values, dtype=np.int64)
    if not len(values):
        return values, values
    cut = np.flatnonzero(np.diff(values) != 1) + 1
    return values[np.concatenate([[0], cut])], values[np.concatenate([cut - 1, [len(values) - 1]])]
