"""Merges: the small segments a writer folds after its appends (:class:`MergePolicy`), and ``compact``.

A merge rewrites a run of segments into fewer, larger ones and publishes them
in one ``ops.Rewrite`` commit; readers keep reading the old files until no
retained manifest names them. :class:`Merger` does the I/O; which runs are due
is the pure :meth:`MergePolicy.windows`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import pyarrow as pa

from .. import format as fmt
from .._fileio import boot_clock, crash_point
from ..segment import Segment
from ..storage import Storage
from . import ops
from .segment_cache import ReadView, SegmentCache
from .appending import WriterContext
from .commits import Commit
from .patching import foldable
from .writing import FileToWrite, SegmentWriter, dirs_of

# a merge's (or compact's) input file this small is read into memory rather than mapped: mapping,
# advising and faulting in a small segment costs more than the copy (merged inputs are < MERGE_MAX_BYTES)
COPY_SOURCE_BYTES = 4 << 20
MAX_MERGES_PER_APPEND = 64


class Merger:
    """Rewrites runs of a writer's segments (see the module docstring).

    >>> from diskreplay.store.compaction import MergePolicy
    >>> Merger.__name__, MergePolicy().fanin
    ('Merger', 16)
    """

    def __init__(self, storage: Storage, segments: SegmentWriter, cache: SegmentCache) -> None:
        self.storage, self.segments, self.cache = storage, segments, cache

    def rewrite(self, at: WriterContext, start: int, stop: int, target_bytes: int,
                defer: bool = False) -> fmt.Manifest:
        """Merge segments ``start:stop`` of ``at.manifest`` into segments of about ``target_bytes``, in
        one commit; returns the commit.

        ``defer`` (a merge of small segments, a few MiB): the new files are written and made durable
        with the commit's manifest file, in one wait on the disk instead of three (``compact``
        writes each segment as it goes: it may rewrite the whole store)."""
        m, committer = at.manifest, at.committer
        started = boot_clock()
        # (many writers racing with full manifests: the data goes first, so that a race is the manifest's alone)
        defer = defer and (not at.multi_writer or at.options.inline_groups or committer.uncontended())
        files: List[str] = []  # the files this merge created (removed if it fails before its commit)
        writes: List[FileToWrite] = []  # deferred: written and made durable with its manifest
        dirs: List[str] = []
        entries: List[fmt.SegmentEntry] = []
        pending: List[pa.RecordBatch] = []
        pending_bytes = 0
        seg_id, first = m.next_segment, max(m.head, m.segments[start].first_row if m.segments else m.head)
        # the patches holding these rows, folded into the new segments (None: one of them also holds
        # rows outside, so none is: the segments' own values are copied and the patches stay)
        folded = foldable(m, m.segments[start].first_row, m.segments[stop - 1].end_row) if m.patches else ()
        at_row = first

        def flush() -> None:
            nonlocal pending, pending_bytes, seg_id, first
            if not pending:
                return
            record = concat_batches(pending) if len(pending) > 1 else pending[0]
            written = self.segments.write(committer, at.options, m, [record], None if at.reserves_ids else seg_id,
                                          first, sync_dirs=defer, defer=defer)
            entries.extend(written.entries)
            files.extend(written.files)
            writes.extend(written.writes)
            dirs.extend(written.dirs)
            first += record.num_rows
            seg_id += 1
            pending, pending_bytes = [], 0

        try:
            for e in m.segments[start:stop]:
                batch = at.schema.conform(self.copy_source(at, e))  # older than a late column: it gets nulls
                if e.first_row < m.head:
                    batch = batch.slice(m.head - e.first_row)
                if folded:
                    batch = self.cache.patches.fold(m, at.schema, batch, at_row)
                at_row += batch.num_rows
                nbytes = batch.nbytes  # walks every list's offsets: once
                if pending_bytes and pending_bytes + nbytes > target_bytes:
                    flush()
                pending.append(batch)
                pending_bytes += nbytes
            flush()
            if not defer:
                committer.storage.write_files([], dirs_of(entries, committer.storage))
                crash_point("segments.synced")
        except BaseException:
            committer.remove_files(files)
            raise
        commit = Commit(ops.Rewrite(tuple(m.segments[start:stop]), tuple(entries), folded or ()), tuple(files),
                        tuple(writes),
                        tuple(dirs), started, at.reserves_ids)
        result = committer.commit(commit, install=lambda new: at.install(new, at.options))
        at.collect()
        return result.manifest

    def compact(self, context: Callable[[], WriterContext], target_bytes: int) -> Dict[str, int]:
        """``compact``'s rewrite of the live rows into segments of about ``target_bytes``, a commit per
        run of consecutive rows; ``context`` gives the writer's state before each. Returns the segment
        counts and bytes before and after."""
        m = context().manifest
        before = {"segments_before": len(m.segments), "bytes_before": m.nbytes}
        new = m
        # a rewrite holds consecutive rows: a store with holes (repair) is rewritten run by run between them
        for run in runs(m.segments):
            at = context()
            segs = at.manifest.segments
            ids = [s.id for s in segs]
            if run[0] not in ids:
                continue  # another writer merged it meanwhile
            start = ids.index(run[0])
            stop = start + len(run)
            # one segment without evicted rows is as compact as it gets: rewriting it is a copy for nothing
            if stop - start == 1 and segs[start].first_row >= at.manifest.head:
                continue
            new = self.rewrite(at, start, stop, target_bytes)
        return {**before, "segments_after": len(new.segments), "bytes_after": new.nbytes}

    def copy_source(self, at: WriterContext, entry: fmt.SegmentEntry) -> pa.RecordBatch:
        """The rows of a segment that a merge or ``compact`` copies, every byte checked against the
        manifest's CRC-32C first: the new files get fresh checksums, which would otherwise vouch for
        damaged data. A local file is checked whole before Arrow parses it, without its sidecar's
        page checksums and without entering the segment cache (a cached segment's sidecar and page
        checks would be read and done for nothing).
        A segment this writer committed lately is parsed from the bytes it wrote (and checked
        against the same CRC-32C), without opening, mapping and reading its file; another small
        one is read into memory with one ``read`` (``COPY_SOURCE_BYTES``), not mapped."""
        batch = self.segments.take_small(entry)
        if batch is not None:
            return batch
        if not self.storage.can_map or entry.id in self.cache.segments:
            def checked() -> pa.RecordBatch:
                seg = self.cache.segment(entry, ReadView(at.manifest, at.schema, at.group_key))
                seg.verify_whole(entry.crc32c)
                return seg.batch
            return self.cache.remapping(checked)  # a cache file trimmed meanwhile is fetched and mapped again
        return Segment(self.storage.local_path(entry.file), entry.bytes, at.schema, entry.num_rows,
                       entry.crc32c, copy=entry.bytes <= COPY_SOURCE_BYTES).batch

    def merge_small_tail(self, context: Callable[[], WriterContext]) -> None:
        """Keep the number of segments small when every commit is small (a training loop's):
        see :class:`MergePolicy`. ``context`` gives the writer's state before each merge. With
        many writers a merge that loses to another commit touching its segments is dropped (the
        writer whose it is plans it again after its next append).

        With many writers every writer sees the same due merges, and all but one would lose
        each after doing its work. A merge is therefore the writer's that reserved its newest
        segment (the append that completed it, or the merge that made its input); should that
        writer die or stop first, anyone takes a merge overdue by ``fanin * ratio`` segments' rows.
        """
        policy = self.segments.merge_policy
        for _ in range(MAX_MERGES_PER_APPEND):  # each merge leaves fewer segments: a few at most
            at = context()
            segs = at.manifest.segments
            window = next((w for w in policy.windows(segs, at.options) if self.merge_is_mine(at, segs, w)), None)
            if window is None:
                return
            try:
                self.rewrite(at, window[0], window[1], policy.max_bytes << 4, defer=True)
            except ops.Conflict:
                at.committer.stats.dropped_rewrites += 1
                at.install(at.committer.manifest, at.options)  # the newer commit it lost to
                return

    def merge_is_mine(self, at: WriterContext, segs: Sequence[fmt.SegmentEntry], window: Tuple[int, int]) -> bool:
        """The merge of ``segs[start:stop]`` is this writer's: it reserved the segment that made it due
        (the window's newest, or the large one that closed a run), or the merge is overdue (anyone's):
        ``fanin * ratio`` times its newest segment's rows were appended after that segment (rows, not
        segments: the writers merge the newer ones meanwhile)."""
        start, stop = window
        policy = self.segments.merge_policy
        owner = segs[stop] if stop < len(segs) and segs[stop].bytes >= policy.max_bytes else segs[stop - 1]
        if not at.multi_writer or self.segments.is_own(owner.id):
            return True
        return segs[-1].end_row - owner.end_row > policy.fanin * policy.ratio * segs[stop - 1].num_rows


def runs(segments: Sequence[fmt.SegmentEntry]) -> List[List[int]]:
    """The ids of ``segments`` in runs of consecutive rows (one run unless the store has holes).

    >>> runs([fmt.SegmentEntry(i, first, 2, 10, 0, 0, 0, None) for i, first in ((0, 0), (1, 2), (2, 6))])
    [[0, 1], [2]]
    """
    out: List[List[int]] = []
    end = None
    for s in segments:
        if end is None or s.first_row != end:
            out.append([])
        out[-1].append(s.id)
        end = s.end_row
    return out


def concat_batches(batches: Sequence[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch of ``batches``' rows (a merge's): ``pa.concat_batches`` where pyarrow has
    it (19+: no table in between, a quarter less time for 16 small segments)."""
    concat = getattr(pa, "concat_batches", None)
    if concat is not None:
        return concat(batches)
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
