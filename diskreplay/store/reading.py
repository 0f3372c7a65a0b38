"""Read planning: where the bytes of a read come from, and copying them out of the segments.

Pure functions over memory-mapped :class:`~diskreplay.segment.Segment` views;
the segment cache (which maps are open) lives in the facade.
"""

from __future__ import annotations

import operator
from typing import Any, Container, Dict, List, Optional, Tuple

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
    and reused for each of them: row ``i`` is ``[starts[i], ends[i])`` of the
    values of part ``part_of[i]`` (one part per touched segment). The copy is
    one ``np.concatenate`` of per-row slices: each row is a single memcpy,
    where a fancy-index gather reads an index per value.
    """

    __slots__ = ("part_of", "starts", "ends", "out_offsets", "_slices", "_parts", "_runs")

    def __init__(self, parts: List[Tuple[Segment, Any, np.ndarray]], offsets_of, n: int) -> None:
        if len(parts) == 1 and isinstance(parts[0][1], slice):
            loc, offs = parts[0][2], offsets_of[0]
            self.starts, self.ends = offs[loc], offs[1:][loc]
            self.part_of = np.zeros(n, dtype=np.int64)
        else:
            # one fancy index per part and array, in part order, then one scatter to row order
            # (a read of 512 rows touches ~40 segments: per-part work is what costs here)
            order = np.concatenate([sel for _, sel, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
            self.starts = np.empty(n, dtype=np.int64)
            self.ends = np.empty(n, dtype=np.int64)
            self.part_of = np.empty(n, dtype=np.int64)
            if parts:
                self.starts[order] = np.concatenate([offs[loc] for (_, _, loc), offs in zip(parts, offsets_of)])
                self.ends[order] = np.concatenate([offs[1:][loc] for (_, _, loc), offs in zip(parts, offsets_of)])
                self.part_of[order] = np.repeat(np.arange(len(parts)), [len(loc) for _, _, loc in parts])
        self.out_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.ends - self.starts, out=self.out_offsets[1:])
        self._slices: Optional[list] = None
        self._parts: Optional[list] = None
        self._runs: Optional[Tuple[list, list]] = None

    def views(self, sources: List[np.ndarray]) -> list:
        """One view per row into ``sources`` (a column's values, one array per part).

        ``map`` over builtins: ~0.3 us a row, against ~0.5 us for a comprehension unpacking
        tuples (a batch of 512 rows makes ~2,000 of them per packed batch)."""
        if self._slices is None:
            self._slices = list(map(slice, self.starts.tolist(), self.ends.tolist()))
        if len(sources) == 1:
            return list(map(sources[0].__getitem__, self._slices))
        if self._parts is None:
            self._parts = self.part_of.tolist()
        return list(map(operator.getitem, map(sources.__getitem__, self._parts), self._slices))

    def run_views(self, sources: List[np.ndarray]) -> list:
        """The rows' values as few views as possible: rows that follow each other in the read and
        in one segment's values make one view (the rows of a prompt group, written by one
        ``extend``, lie side by side, so a batch of 64 groups of 8 copies 64 pieces, not 512).
        Joined, they are the rows' values one after another."""
        if self._runs is None:
            n = len(self.starts)
            follows = np.zeros(n, dtype=bool)  # row i continues row i - 1's run
            follows[1:] = (self.starts[1:] == self.ends[:-1]) & (self.part_of[1:] == self.part_of[:-1])
            first = np.flatnonzero(~follows)
            last = np.append(first[1:] - 1, n - 1) if n else first
            self._runs = (list(map(slice, self.starts[first].tolist(), self.ends[last].tolist())),
                          self.part_of[first].tolist())
        slices, parts = self._runs
        if len(sources) == 1:
            return list(map(sources[0].__getitem__, slices))
        return list(map(operator.getitem, map(sources.__getitem__, parts), slices))

    def gather(self, sources: List[np.ndarray], dtype: np.dtype, buffers: Optional[Dict[str, np.ndarray]] = None,
               name: str = "", out: Optional[np.ndarray] = None) -> np.ndarray:
        """The rows' values, one after another: in ``out`` (exactly as long as the rows' values)
        or ``buffers[name]`` (grown with headroom when short) when given, else in a new array."""
        if not len(self.starts):
            return np.zeros(0, dtype=dtype) if out is None else out
        pieces = self.run_views(sources)
        if out is None and buffers is None:
            return np.concatenate(pieces).astype(dtype, copy=False)
        if out is None:
            total = int(self.out_offsets[-1])
            buf = buffers.get(name)
            if buf is None or buf.dtype != dtype or buf.size < total:
                buf = buffers[name] = np.empty(total + total // 4 + 1, dtype=dtype)
            out = buf[:total]
        return np.concatenate(pieces, out=out, casting="unsafe")


class RowRanges(RaggedColumn):
    """A ragged column of a read whose values are still in the segments' memory maps:
    where each row lies (pages checked), nothing copied yet.

    ``ReplayStore.read_ranges`` returns these so that a consumer with its own
    layout (:func:`~diskreplay.batching.packed.collate_packed`) copies every value
    once, straight from the map into its output, instead of through the
    concatenated batch that ``read`` builds. Anything else may treat it as
    the :class:`~diskreplay.ragged.RaggedColumn` it is: ``values`` and
    ``offsets`` are gathered on first access.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> tmp = tempfile.TemporaryDirectory()
    >>> store = ReplayStore(tmp.name, group_key=None)
    >>> _ = store.extend({"completion_ids": [[1], [2, 3]]})
    >>> col = store.read_ranges([1, 0])["completion_ids"]
    >>> col.lengths.tolist(), [v.tolist() for v in col.row_views()], col.values.tolist()
    ([2, 1], [[2, 3], [1]], [2, 3, 1])
    >>> store.close(); tmp.cleanup()
    """

    __slots__ = ("plan", "sources", "_dtype", "_column", "bases")

    def __init__(self, plan: RangePlan, sources: List[np.ndarray], dtype: np.dtype,
                 validity: Optional[np.ndarray], bases: np.ndarray) -> None:
        self.plan, self.sources, self._dtype, self.validity = plan, sources, np.dtype(dtype), validity
        self._column: Optional[RaggedColumn] = None
        #: where each source's values start in memory (int64, one per source)
        self.bases = bases

    def __len__(self) -> int:
        return len(self.plan.starts)

    @property
    def lengths(self) -> np.ndarray:
        """Number of elements in each row (int64)."""
        return self.plan.ends - self.plan.starts

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def row_views(self) -> list:
        """One read-only view per row (a row without a value gives its stored, usually empty, range)."""
        return self.plan.views(self.sources)

    def addresses(self) -> Optional[np.ndarray]:
        """Where each row's first value lies in this process's memory (int64; what compiled
        kernels read, valid while this object and its segments are alive); None if a source's
        dtype is not the column's."""
        if any(s.dtype != self._dtype for s in self.sources):
            return None
        return self.bases[self.plan.part_of] + self.plan.starts * self._dtype.itemsize

    def gather(self, buffers: Optional[Dict[str, np.ndarray]] = None, name: str = "") -> RaggedColumn:
        """The rows copied one after another (what ``ReplayStore.read`` returns), in
        ``buffers[name]`` when given (see ``read``'s ``out``)."""
        return RaggedColumn(self.plan.gather(self.sources, self._dtype, buffers, name), self.plan.out_offsets,
                            self.validity)

    def _gathered(self) -> RaggedColumn:
        if self._column is None:
            self._column = self.gather()
        return self._column

    # the RaggedColumn view of the same rows, copied on first use
    values = property(lambda self: self._gathered().values)  # type: ignore[assignment]
    offsets = property(lambda self: self.plan.out_offsets)  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RowRanges(rows={len(self)}, elements={int(self.plan.out_offsets[-1])}, dtype={self._dtype})"


def hint_reads(parts: List[Tuple[Segment, Any, np.ndarray]], names: List[str], ragged: List[bool],
               hinted: Container[Segment] = ()) -> None:
    """Ask for every page a read of ``names`` at these rows needs before touching any, in two
    rounds: the column buffers whatever the rows (offsets, per-row columns) of all segments, then
    the rows' values (finding them needs the offsets, which the first round has in flight).
    ``hinted``: segments whose column buffers were asked for when they were opened (from their
    recorded buffer ranges, together with their headers): only their values are left to ask for.

    Cold, a batch's pages then arrive together instead of one fault after another (a batch of
    512 rows from 64 segments: ~1,700 serial faults without it)."""
    # a late column is absent from segments older than it: nothing to hint there
    held = [[(n, r) for n, r in zip(names, ragged) if seg.has(n)] for seg, _, _ in parts]
    for (seg, _, _), cols in zip(parts, held):
        if seg not in hinted:
            seg.advise(seg.column_ranges([n for n, _ in cols], [r for _, r in cols]))
    for (seg, _, loc), cols in zip(parts, held):
        ranges = [seg.value_ranges(name, loc) for name, r in cols if r]
        if ranges:
            seg.advise(np.concatenate(ranges))


def ragged_run(name: str, seg: Segment, first: int, n: int) -> Optional[RaggedColumn]:
    """Rows ``[first, first + n)`` of one segment as zero-copy views of its memory map (their pages
    checked by the caller: ``Segment.check_rows_of``)."""
    values, offsets, valid = seg.ragged(name)
    validity = None if valid is None else valid[first:first + n]
    if validity is not None and not validity.any():
        return None
    offs = offsets[first:first + n + 1]
    return RaggedColumn(values[int(offs[0]):int(offs[-1])], offs - offs[0], validity)


def ragged_ranges(name: str, parts: List[Tuple[Segment, Any, np.ndarray]], n: int, dtype: np.dtype,
                  plans: Dict[Any, RangePlan]) -> Optional[RowRanges]:
    """Where the rows of a ragged column lie in the touched segments (their pages checked by the
    caller: ``Segment.check_rows_of``, once per segment for all ragged columns of a read); None
    when none of the rows has a value."""
    states = [seg.ragged_state(name) for seg, _, _ in parts]
    values, offsets, valids, keys, addresses = zip(*states) if states else ((), (), (), (), ())
    validity = None
    if any(valid is not None for valid in valids):
        validity = np.ones(n, dtype=bool)
        for (_, sel, loc), valid in zip(parts, valids):
            if valid is not None:
                validity[sel] = valid[loc]
        if not validity.any():
            return None
    # columns whose offsets are equal in every touched segment share one plan
    plan = plans.get(keys)
    if plan is None:
        plan = plans[keys] = RangePlan(parts, offsets, n)
    return RowRanges(plan, list(values), dtype, validity, np.array(addresses, dtype=np.int64))


def gather_ragged(name: str, parts: List[Tuple[Segment, Any, np.ndarray]], n: int, dtype: np.dtype,
                  plans: Dict[Any, RangePlan], buffers: Optional[Dict[str, np.ndarray]] = None
                  ) -> Optional[RaggedColumn]:
    ranges = ragged_ranges(name, parts, n, dtype, plans)
    return None if ranges is None else ranges.gather(buffers, name)
