"""What a commit does to the segments around it: splitting, eviction and merging small ones.

Pure functions of manifests and options (no I/O), so the committer can apply
them to whichever manifest a commit is finally based on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa

from .. import format as fmt
from ..errors import ArgumentError

# A single extend larger than this is split into several segments (still one
# commit), so no segment file grows without bound.
MAX_SEGMENT_BYTES = 256 << 20
# Small commits (a training loop appends one generation batch at a time) are
# merged, size-tiered, so that segment count, manifest size and open maps stay
# small (see MergePolicy.windows).
MERGE_FANIN = 16
MERGE_RATIO = 4
MERGE_MAX_BYTES = 1 << 20
MERGE_CAPACITY_SHARE = 8


@dataclass(frozen=True)
class MergePolicy:
    """When small segments are merged (a value; pass your own to ``ReplayStore``).

    Size-tiered, over windows of ``fanin`` consecutive segments below
    ``max_bytes`` that follow the newest larger one: a window is due when none
    of its segments holds more than ``ratio`` times the rows of its newest one,
    and the oldest due windows are merged first (each into one segment), so no
    small segment is left behind a merged one. A merged segment has about
    ``fanin`` times the rows of its inputs, so it meets its peers again only
    (hence ``2 <= ratio < fanin``): a byte is rewritten about log16(1 MiB /
    commit size) times (measured: 1.0 for 64-rollout steps, 1.9 for commits of
    1-12 rows). Should commits of very different sizes alternate so that no
    window is due, the newest ``fanin * ratio`` small segments are merged. The
    small segments just before the newest larger one (an append of
    ``max_bytes`` or more, or a merge that made one, closed their run: it can
    no longer grow) are merged into one. Segments of ``max_bytes`` or more are
    never touched, and no merge makes a segment hold more than
    ``1 / capacity_share`` of a capacity (a file goes only when all its rows are
    evicted, so eviction stays fine-grained).

    >>> rows = [128, 8, 8, 8] + [8] * 16  # the 8-row segments after the 128-row one
    >>> segs = [fmt.SegmentEntry(i, 8 * i, n, 1000, 0) for i, n in enumerate(rows)]
    >>> MergePolicy().plan(segs, fmt.StoreOptions())
    (1, 17)
    """

    fanin: int = MERGE_FANIN
    ratio: int = MERGE_RATIO
    max_bytes: int = MERGE_MAX_BYTES
    capacity_share: int = MERGE_CAPACITY_SHARE

    def __post_init__(self) -> None:
        for name, low in (("fanin", 3), ("ratio", 2), ("max_bytes", 1), ("capacity_share", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ArgumentError(f"MergePolicy {name} must be an integer >= {low}, got {value!r}")
        if self.ratio >= self.fanin:
            raise ArgumentError(f"MergePolicy needs ratio < fanin, got ratio={self.ratio}, fanin={self.fanin}: a "
                                "merged segment holds about fanin times its inputs' rows, and at ratio >= fanin "
                                "it is their peer again, so small appends would be merged over and over")

    def plan(self, segs: Sequence[fmt.SegmentEntry], options: fmt.StoreOptions) -> Optional[Tuple[int, int]]:
        """The merge to do now, the oldest due: ``(start, stop)`` of ``segs``, or None."""
        return next(self.windows(segs, options), None)

    def windows(self, segs: Sequence[fmt.SegmentEntry], options: fmt.StoreOptions) -> Iterator[Tuple[int, int]]:
        """Every merge due now, oldest first and not overlapping: ``(start, stop)`` of ``segs``.

        Many writers each take the ones that are theirs (see ``Merger.merge_small_tail``):
        the windows do not depend on which writer looks, so two of them never plan overlapping
        merges from the same manifest."""
        n = len(segs)
        small = 0
        while small < n and segs[-1 - small].bytes < self.max_bytes:
            small += 1
        closed = self.closed_run(segs, n - small - 1, options)
        if closed is not None:
            yield closed
        if small < self.fanin:
            return
        rows = [s.num_rows for s in segs[n - small:]]
        fanin, ratio, base = self.fanin, self.ratio, n - small
        found = False
        end = fanin  # exclusive end of the next candidate window, in ``rows``
        while end <= small:
            if max(rows[end - fanin:end]) <= ratio * rows[end - 1]:
                window = (base + end - fanin, base + end)
                if self.mergeable(segs[window[0]:window[1]], options):
                    found = True
                    yield window
                    end += fanin
                    continue
            end += 1
        # no window forms (commit sizes alternate wildly): the newest fanin * ratio small ones
        if not found and small >= fanin * ratio and self.mergeable(segs[n - fanin * ratio:], options):
            yield n - fanin * ratio, n

    def closed_run(self, segs: Sequence[fmt.SegmentEntry], big: int,
                   options: fmt.StoreOptions) -> Optional[Tuple[int, int]]:
        """The small segments right before ``segs[big]``, the newest of ``max_bytes`` or more, when at
        least two and mergeable: their run can no longer grow, so no window would ever take them."""
        if big <= 0 or big >= len(segs):
            return None
        start = big
        while start > 0 and segs[start - 1].bytes < self.max_bytes:
            start -= 1
        if big - start < 2 or not self.mergeable(segs[start:big], options):
            return None
        return start, big

    def mergeable(self, segs: Sequence[fmt.SegmentEntry], options: fmt.StoreOptions) -> bool:
        if any(a.end_row != b.first_row for a, b in zip(segs, segs[1:])):
            return False  # a hole between them (repair): a merge holds consecutive rows
        rows = sum(s.num_rows for s in segs)
        nbytes = sum(s.bytes + s.groups_bytes for s in segs)
        return ((options.capacity_rows is None or rows * self.capacity_share <= options.capacity_rows)
                and (options.capacity_bytes is None or nbytes * self.capacity_share <= options.capacity_bytes))


def split(record: pa.RecordBatch) -> List[pa.RecordBatch]:
    """``record`` cut into pieces of at most about ``MAX_SEGMENT_BYTES``."""
    # the buffers' total first: at least the rows' bytes, and 40x cheaper than record.nbytes (which
    # walks every list's offsets), which a small commit would pay for nothing
    if record.num_rows <= 1 or record.get_total_buffer_size() <= MAX_SEGMENT_BYTES:
        return [record]
    nbytes = record.nbytes
    if nbytes <= MAX_SEGMENT_BYTES:
        return [record]
    k = min(record.num_rows, -(-nbytes // MAX_SEGMENT_BYTES))
    step = -(-record.num_rows // k)
    return [record.slice(i, step) for i in range(0, record.num_rows, step)]


evict = fmt.evict  # pure, and what a reader applying an append delta needs too
