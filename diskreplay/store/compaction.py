"""What a commit does to the segments around it: splitting, eviction and merging small ones.

Pure functions of manifests and options (no I/O), so the committer can apply
them to whichever manifest a commit is finally based on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import pyarrow as pa

from .. import format as fmt

# A single extend larger than this is split into several segments (still one
# commit), so no segment file grows without bound.
MAX_SEGMENT_BYTES = 256 << 20
# Small commits (a training loop appends one generation batch at a time) are
# merged, size-tiered, so that segment count, manifest size and open maps stay
# small (see MergePolicy.plan).
MERGE_FANIN = 16
MERGE_RATIO = 4
MERGE_MAX_BYTES = 1 << 20
MERGE_CAPACITY_SHARE = 8


@dataclass(frozen=True)
class MergePolicy:
    """When the newest small segments are merged into one (a value; pass your own to ``ReplayStore``).

    Size-tiered: the newest segments with at most ``ratio`` times the rows of
    the newest one (and below ``max_bytes``) are merged, ``fanin`` at a time,
    repeated while that completes another run. A merged segment is about
    ``fanin`` times its inputs, so it joins a run again only with its peers: a
    byte is rewritten about log16(1 MiB / commit size) times (measured: 1.0 for
    64-rollout steps, 1.9 for commits of 1-12 rows). Should commits of very
    different sizes alternate so that no run forms, the newest ``fanin *
    ratio`` small segments are merged. Appends of ``max_bytes`` or more are
    never touched, and no merge makes a segment hold more than
    ``1 / capacity_share`` of a capacity (a file goes only when all its rows are
    evicted, so eviction stays fine-grained).

    >>> MergePolicy(fanin=2).plan((), fmt.StoreOptions()) is None
    True
    """

    fanin: int = MERGE_FANIN
    ratio: int = MERGE_RATIO
    max_bytes: int = MERGE_MAX_BYTES
    capacity_share: int = MERGE_CAPACITY_SHARE

    def plan(self, segs: Sequence[fmt.SegmentEntry], options: fmt.StoreOptions) -> Optional[int]:
        """Index of the first segment of the merge to do now, or None."""
        small = 0
        while small < len(segs) and segs[-1 - small].bytes < self.max_bytes:
            small += 1
        if small < self.fanin:
            return None
        limit = self.ratio * segs[-1].num_rows  # rows, not bytes: a tiny file is mostly header
        run = 1
        while run < small and segs[-1 - run].num_rows <= limit:
            run += 1
        # the newest fanin of a run (older ones left for later runs: a run that was
        # blocked, e.g. by the capacity rule, must not grow until it can never merge)
        if run >= self.fanin:
            start = len(segs) - self.fanin
        elif small >= self.fanin * self.ratio:
            start = len(segs) - self.fanin * self.ratio
        else:
            return None
        return start if self.mergeable(segs[start:], options) else None

    def mergeable(self, segs: Sequence[fmt.SegmentEntry], options: fmt.StoreOptions) -> bool:
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
