"""Read planning: where the bytes of a read come from, and copying them out of the segments.

Pure functions over memory-mapped :class:`~diskreplay.segment.Segment` views;
the segment cache (which maps are open) lives in the facade.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..groups import GroupIndex, KeyCoder
from ..ragged import RaggedColumn
from ..segment import Segment


def index_of_column(values: Any, head: int) -> GroupIndex:
    """The groups of live rows ``head, head + 1, ...`` by their ``values`` of one per-row column."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        # any consistent numbering works: from_codes orders the groups itself
        order = np.argsort(values, kind="stable")
        sorted_values = values[order]
        new_group = np.empty(len(values), dtype=bool)
        new_group[:1] = True
        np.not_equal(sorted_values[1:], sorted_values[:-1], out=new_group[1:])
        codes = np.empty(len(values), dtype=np.int64)
        codes[order] = np.cumsum(new_group) - 1
        return GroupIndex.from_codes(codes, sorted_values[new_group].tolist(), head)
    coder = KeyCoder()
    return GroupIndex.from_codes(coder.encode(values), coder.keys, head)


class RangePlan:
    """Where the rows of one read come from, for columns with equal offsets.

    Columns aligned with the same ids (and holding no nulls) share their
    offsets inside a segment, so the source ranges are computed once per read
    and reused for each of them. The copy is one ``np.concatenate`` of
    per-row slices: measured 6x faster than a fancy-index gather for rows of
    GRPO length, since each row is a single memcpy.
    """

    __slots__ = ("out_offsets", "pieces")

    def __init__(self, parts: List[Tuple[Segment, Any, np.ndarray]], offsets_of, n: int) -> None:
        starts = np.empty(n, dtype=np.int64)
        ends = np.empty(n, dtype=np.int64)
        part_of = np.empty(n, dtype=np.int64)
        for p, ((seg, sel, loc), offs) in enumerate(zip(parts, offsets_of)):
            starts[sel] = offs[loc]
            ends[sel] = offs[loc + 1]
            part_of[sel] = p
        self.out_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(ends - starts, out=self.out_offsets[1:])
        self.pieces = list(zip(part_of.tolist(), starts.tolist(), ends.tolist()))

    def gather(self, sources: List[np.ndarray], dtype: np.dtype, buffers: Optional[Dict[str, np.ndarray]] = None,
               name: str = "") -> np.ndarray:
        """The rows' values, one after another: in ``buffers[name]`` (grown with headroom when
        short) when given, else in a new array."""
        if not self.pieces:
            return np.zeros(0, dtype=dtype)
        pieces = [sources[p][a:b] for p, a, b in self.pieces]
        if buffers is None:
            return np.concatenate(pieces).astype(dtype, copy=False)
        total = int(self.out_offsets[-1])
        buf = buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.size < total:
            buf = buffers[name] = np.empty(total + total // 4 + 1, dtype=dtype)
        return np.concatenate(pieces, out=buf[:total], casting="unsafe")


def hint_reads(parts: List[Tuple[Segment, Any, np.ndarray]], names: List[str], ragged: List[bool]) -> None:
    """Ask for every page a read of ``names`` at these rows needs before touching any, in two
    rounds: the column buffers whatever the rows (offsets, per-row columns) of all segments, then
    the rows' values (finding them needs the offsets, which the first round has in flight).

    Cold, a batch's pages then arrive together instead of one fault after another (a batch of
    512 rows from 64 segments: ~1,700 serial faults without it)."""
    # a late column is absent from segments older than it: nothing to hint there
    held = [[(n, r) for n, r in zip(names, ragged) if seg.has(n)] for seg, _, _ in parts]
    for (seg, _, _), cols in zip(parts, held):
        seg.advise(seg.column_ranges([n for n, _ in cols], [r for _, r in cols]))
    for (seg, _, loc), cols in zip(parts, held):
        ranges = [seg.value_ranges(name, loc) for name, r in cols if r]
        if ranges:
            seg.advise(np.concatenate(ranges))


def ragged_run(name: str, seg: Segment, first: int, n: int) -> Optional[RaggedColumn]:
    """Rows ``[first, first + n)`` of one segment as zero-copy views of its memory map."""
    values, offsets, valid = seg.ragged(name)  # first: it sets up the per-row check record
    seg.check_rows(name, np.arange(first, first + n))
    validity = None if valid is None else valid[first:first + n]
    if validity is not None and not validity.any():
        return None
    offs = offsets[first:first + n + 1]
    return RaggedColumn(values[int(offs[0]):int(offs[-1])], offs - offs[0], validity)


def gather_ragged(name: str, parts: List[Tuple[Segment, Any, np.ndarray]], n: int, dtype: np.dtype,
                  plans: Dict[Any, RangePlan], buffers: Optional[Dict[str, np.ndarray]] = None
                  ) -> Optional[RaggedColumn]:
    columns = [seg.ragged(name) for seg, _, _ in parts]
    for seg, _, loc in parts:
        seg.check_rows(name, loc)
    validity = None
    if any(valid is not None for _, _, valid in columns):
        validity = np.ones(n, dtype=bool)
        for (_, sel, loc), (_, _, valid) in zip(parts, columns):
            if valid is not None:
                validity[sel] = valid[loc]
        if not validity.any():
            return None
    # columns whose offsets are equal in every touched segment share one plan
    key = tuple(seg.offsets_key(name) for seg, _, _ in parts)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = RangePlan(parts, [offs for _, offs, _ in columns], n)
    return RaggedColumn(plan.gather([values for values, _, _ in columns], dtype, buffers, name), plan.out_offsets,
                        validity)

