"""The read side of a store: its open segments, their page checksums and group sidecars, and reads.

:class:`SegmentCache` keeps the segments a store has mapped (least recently used
first, at most ``MAX_OPEN_SEGMENTS``), the page checksums of each (and which pages
passed their check), and the page checksums a persisted group index carries. It
reads rows through them: local segments are mapped where they lie; on a storage
with a cache (an object store) the pages a read needs are fetched for all its
segments at once, and checked as they arrive. Every call takes a
:class:`ReadView`, the commit (manifest and schema) the store reads at.

>>> import tempfile
>>> from diskreplay import ReplayStore
>>> store = ReplayStore(tempfile.mkdtemp(), group_key=None)
>>> _ = store.extend({"completion_ids": [[1], [2, 3]]})
>>> view = ReadView(store.manifest, store.schema, None)
>>> store._cache.read(view, [1], ["completion_ids"])["completion_ids"][0].tolist()
[2, 3]
>>> store.close()
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import numpy as np
import pyarrow as pa

from .. import _jit, format as fmt
from .._ranges import coalesce
from ..errors import ArgumentError, CorruptStoreError, RowsEvictedError
from ..groups import arrow_indices
from ..ragged import RaggedColumn
from ..schema import RAGGED, Schema
from ..segment import PageChecksums, Segment, check_rows_of_parts, has_page_checksums, prefetch_files
from ..format.sidecars import IndexedPages, inline_group_sidecar, read_group_sidecar
from .reading import RangePlan, gather_ragged, hint_reads, ragged_ranges, ragged_run
from .remote import RemoteSegment, fetch_for_read, remapped
from .patching import PatchReader

__all__ = ["Column", "ReadView", "SegmentCache", "row_ids"]

# Segments a store keeps mapped at once (each map holds a file descriptor, and
# 1024 is a common per-process limit); older ones are unmapped and reopened on demand.
MAX_OPEN_SEGMENTS = 256
IO_THREADS = 16  # object store: segments fetched at once by one read
# buffers of a cold segment closer than this are asked for with one posix_fadvise
HINT_GAP = 64 << 10
T = TypeVar("T")

Column = Union[RaggedColumn, np.ndarray, List[str], None]


@dataclass(frozen=True)
class ReadView:
    """The commit a read sees: its manifest, the schema of its columns, and the store's group key."""

    manifest: fmt.Manifest
    schema: Optional[Schema]
    group_key: Optional[str]

    @property
    def key_type(self) -> pa.DataType:
        """The Arrow type of the group key's values (what the sidecars hold)."""
        return self.schema[self.group_key].arrow_type


def row_ids(rows: Any) -> np.ndarray:
    """``rows`` as a flat int64 array of row ids, refusing what would silently read other rows: a
    boolean mask (cast, it would read rows 0 and 1) and fractional ids (truncated).

    >>> row_ids([3, 1]).tolist()
    [3, 1]
    """
    ids = np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows).reshape(-1)
    if ids.dtype.kind in "iu" or not ids.size:
        return ids.astype(np.int64, copy=False)
    if ids.dtype.kind == "b":
        raise ArgumentError(f"rows is a boolean mask of {ids.size} entries; pass row ids: for a mask over the "
                            "live rows (as a sampler's eligible() returns) that is store.row_ids()[mask]")
    at = next((i for i, x in enumerate(ids) if not isinstance(x, (int, np.integer)) or isinstance(x, (bool, np.bool_))),
              None)
    if at is None:  # Python ints of an object array (too large for int64: an error here, as it should be)
        return ids.astype(np.int64)
    bad = ids[at].item() if isinstance(ids[at], np.generic) else ids[at]
    raise ArgumentError(f"rows must be integer row ids, got {ids.dtype} values (e.g. {bad!r:.40}); ids are never "
                        "rounded")


class SegmentCache:
    """The open segments of one store and the reads through them (see the module docstring)."""

    def __init__(self, storage: Any, path: str, verify_reads: bool) -> None:
        self.storage = storage
        self.path = path
        #: check segment pages against their checksums the first time they are read
        self.verify_reads = verify_reads
        self.segments: "OrderedDict[int, Segment]" = OrderedDict()  # open maps, least recent first
        self.pages: Dict[int, Any] = {}  # page checksums (and which pages passed) per segment id
        self.index_pages: Optional[IndexedPages] = None  # page checksums a persisted group index carries
        self._starts: Tuple[Any, np.ndarray] = (None, np.zeros(0, dtype=np.int64))  # (manifest, first rows)
        self._pool: Any = None  # object store: threads fetching for one read
        #: the patch files of the store and which rows they hold values for
        self.patches = PatchReader(storage, verify_reads)

    def close(self) -> None:
        """Unmap every segment and stop the fetching threads."""
        self.segments.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def segment(self, entry: fmt.SegmentEntry, view: ReadView) -> Segment:
        """The open segment of ``entry`` (opened and mapped on first use; the least recently used
        ones are unmapped past ``MAX_OPEN_SEGMENTS``)."""
        seg = self.segments.get(entry.id)
        if seg is not None:
            self.segments.move_to_end(entry.id)
        else:
            pages, whole_crc = None, None
            # through a cache the page checksums also say which pages to fetch: always used there
            if self.verify_reads or self.storage.cached:
                pages = self.page_checksums(entry, view)  # check what is read, when it is first read
                if pages is None and self.verify_reads:  # no sidecar, or a small segment: check the whole file once
                    whole_crc = entry.crc32c
            if self.storage.cached:
                seg = RemoteSegment(self.storage, entry, view.schema, pages, whole_crc)
            else:
                seg = Segment(self.storage.local_path(entry.file), entry.bytes, view.schema, entry.num_rows,
                              whole_crc, pages)
            self.segments[entry.id] = seg
            # each open map holds a file descriptor: keep the most recently used ones
            while len(self.segments) > MAX_OPEN_SEGMENTS:
                self.segments.popitem(last=False)
        return seg

    def sidecar(self, entry: fmt.SegmentEntry, view: ReadView):
        """``(keys, counts, rows, page checksums)`` of a segment's group sidecar, checked."""
        out = self._read_sidecar(entry, view)
        if out[3] is not None and entry.id not in self.pages:
            self.pages[entry.id] = out[3]  # read once, for the group index and the segment's pages both
        return out

    def _read_sidecar(self, entry: fmt.SegmentEntry, view: ReadView):
        key_type = view.key_type
        if entry.group is not None:  # no file: one group, every row
            return inline_group_sidecar(entry.group, key_type, entry.first_row, entry.num_rows)
        if self.storage.can_map:
            return read_group_sidecar(self.storage.local_path(entry.groups_file), entry.groups_bytes,
                                      entry.groups_crc32c, key_type, entry.first_row, entry.num_rows)
        # a whole local copy (evicted only between reads: see _trim_cache), named by its URL in errors
        path = self.storage.fetch_ranges(entry.groups_file, None, size=entry.groups_bytes, evict=False,
                                         tag=f"{entry.groups_bytes}-{entry.groups_crc32c:08x}")
        try:
            return read_group_sidecar(path, entry.groups_bytes, entry.groups_crc32c, key_type, entry.first_row,
                                      entry.num_rows)
        except CorruptStoreError as exc:
            raise CorruptStoreError(str(exc).replace(path, f"{self.path}/{entry.groups_file}")) from None

    def page_checksums(self, entry: fmt.SegmentEntry, view: ReadView, sidecar: bool = True) -> Optional[PageChecksums]:
        """A segment's page checksums: from the persisted group index when it carries them (no
        sidecar read), else from the sidecar (``sidecar=False``: None instead). None for a segment
        checked whole: without a sidecar, or small (``has_page_checksums``; the sidecar of one written
        by an older version may hold some, which need not be read)."""
        if not entry.groups_bytes or not has_page_checksums(entry.bytes):
            return None
        pages = self.pages.get(entry.id)
        if pages is None:
            if self.index_pages is not None:
                pages = self.index_pages.get(entry.id, entry.bytes, entry.crc32c)
            if pages is not None:
                self.pages[entry.id] = pages
            elif sidecar:
                pages = self.sidecar(entry, view)[3]
        return pages

    def io_pool(self) -> Any:
        """The threads that fetch one read's pages from an object store at once."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="diskreplay-fetch")
        return self._pool

    def open_concurrently(self, view: ReadView, entries: Sequence[fmt.SegmentEntry],
                          cols: Optional[Sequence[str]] = None) -> None:
        """Object store: fetch what opening the segments not yet open needs (group sidecar,
        then Arrow's header and footer pages), all segments at once: a cold batch then
        costs two rounds of requests instead of two per segment. With the header and footer,
        the buffers of ``cols`` a read needs whatever its rows, where the segment's checksums
        record them: the read's own first round (``fetch_for_read``) then has nothing to fetch."""
        todo = [e for e in entries if e.id not in self.segments and e.groups_bytes]
        if not todo:
            return
        pool = self.io_pool()
        # a small segment is fetched whole (and checked whole when opened), in the same round
        whole = [pool.submit(self.storage.fetch_ranges, e.file, None, size=e.bytes, evict=False,
                             tag=RemoteSegment.cache_tag(e)) for e in todo if not has_page_checksums(e.bytes)]
        todo = [e for e in todo if has_page_checksums(e.bytes)]
        fields = _field_positions(view.schema, cols)
        known = {e.id: self.page_checksums(e, view, sidecar=False) for e in todo}
        # one round: the frames of the segments whose checksums are known (the group index's); for the
        # others the sidecars, and each segment's first and last page (where Arrow's header and footer
        # usually lie) before the sidecar's checksums say exactly where
        frames = [pool.submit(RemoteSegment.prefetch_frame, self.storage, e, known[e.id], fields)
                  for e in todo if known[e.id] is not None]
        rest = [e for e in todo if known[e.id] is None]
        ends = [pool.submit(RemoteSegment.prefetch_ends, self.storage, e) for e in rest]
        sidecars = [(e, pool.submit(self.sidecar, e, view)) for e in rest]
        for e, fut in sidecars:
            pages = fut.result()[3]
            if pages is not None:
                self.pages.setdefault(e.id, pages)
        for fut in ends + frames:
            fut.result()
        # a header or footer larger than a page: the rest, exactly (usually nothing to fetch)
        frames = [pool.submit(RemoteSegment.prefetch_frame, self.storage, e, self.pages[e.id], fields)
                  for e in rest if e.id in self.pages]
        for fut in frames + whole:
            fut.result()

    def trim(self) -> None:
        """Object store: bring the local cache within ``cache_bytes`` between reads, and
        forget the maps of evicted files (their pages must be fetched and checked again).
        Arrays already returned stay valid: evicted files are unlinked, never rewritten."""
        if not self.storage.cached:
            return
        evicted = set(self.storage.trim_cache())
        if not evicted:
            return
        for sid, seg in list(self.segments.items()):
            if seg.rel in evicted:
                del self.segments[sid]
                pages = self.pages.get(sid)
                if pages is not None:
                    pages.verified[:] = False

    def remapping(self, action: Callable[[], T]) -> T:
        """Run a read; if the cache evicted a file it maps meanwhile (a batch larger than
        ``cache_bytes``), map it again and repeat once."""
        return remapped(action, self._forget_mapped, self.path)

    def _forget_mapped(self) -> None:
        self.trim()
        self.segments.clear()
        for pages in self.pages.values():
            pages.verified[:] = False

    def locate(self, view: ReadView, rows: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(row ids, segment positions, rows within their segments)`` of ``rows`` (checked live)."""
        rows = row_ids(rows)
        m = view.manifest
        if rows.size:
            lo, hi = rows.min(), rows.max()
            if lo < m.head or hi >= m.next_row:
                bad = int(lo if lo < m.head else hi)
                raise RowsEvictedError(f"row {bad} is not in the store: live rows are [{m.head}, {m.next_row})"
                                       + (" (it was evicted)" if 0 <= bad < m.head else ""))
            for a, b in m.holes:  # (few: repair records one per damaged segment)
                hit = (rows >= a) & (rows < b)
                if hit.any():
                    raise RowsEvictedError(f"row {int(rows[hit][0])} is not in the store: repair dropped rows "
                                           f"[{a}, {b}) with their damaged segment (see store.holes)")
        if self._starts[0] is not m:
            segs = m.segments
            self._starts = (m, segs.column("first_row") if isinstance(segs, fmt.SegmentTable) else
                            np.fromiter((s.first_row for s in segs), dtype=np.int64, count=len(segs)))
        starts = self._starts[1]
        seg_idx = np.searchsorted(starts, rows, side="right") - 1
        return rows, seg_idx, rows - starts[seg_idx] if rows.size else rows

    def open_segments(self, view: ReadView, entries: Sequence[fmt.SegmentEntry],
                      cols: Optional[Sequence[str]] = None, check: bool = False) -> Tuple[Set[Segment], Set[Segment]]:
        """Open the segments of ``entries`` not open yet, asking first, for all of them at once, for
        their header and footer pages and (where their checksums record where they lie) the buffers
        of ``cols`` that a read needs whatever its rows: cold, the pages that parsing and locating
        the rows need then arrive in one round, not one per file and kind (opening 64 segments
        otherwise waits for ~130 reads in turn, then their columns' offsets for as many more).
        ``(the segments opened, those of them whose buffers were asked for)``: the pages of an opened
        segment are likely cold. ``check`` (a read, not a prefetch): those buffers' pages are checked
        as each segment opens, in one pass per segment rather than one per column."""
        todo = [e for e in entries if e.id not in self.segments]
        if not todo:
            return set(), set()
        fields = _field_positions(view.schema, cols)
        wanted, hinted, fixed = [], set(), {}
        for e in todo:
            pages = self.page_checksums(e, view) if self.verify_reads else None
            # with page checksums only the checksum pages outside the body are read on open, else all
            if pages is not None:
                p = pages.page_bytes
                ranges = [(0, -(-pages.body[0] // p) * p), (pages.body[1] // p * p, 0)]
                buffers = pages.buffer_pages(fields) if fields is not None else None
                if buffers is not None:
                    fixed[e.id] = buffers
                    starts, ends = coalesce(buffers[:, 0], buffers[:, 1], HINT_GAP)
                    ranges += zip(starts.tolist(), (ends - starts).tolist())
                    hinted.add(e.id)
            elif len(todo) > 1:
                ranges = [(0, 0)]
            else:  # one file without page checksums: its reads fault in what they touch, not all of it
                continue
            wanted.append((os.path.join(self.path, e.file), ranges))
        if wanted:
            prefetch_files(wanted)
        segments = [self.segment(e, view) for e in todo]
        if check:
            for e, seg in zip(todo, segments):
                if e.id in fixed:
                    seg.verify_ranges(fixed[e.id])
        return set(segments), {seg for e, seg in zip(todo, segments) if e.id in hinted}

    @_jit.deferring
    def read(self, view: ReadView, rows: Any, cols: List[str], buffers: Optional[Dict[str, np.ndarray]] = None,
             ranges: bool = False) -> Dict[str, Column]:
        """The columns ``cols`` of ``rows`` (see ``ReplayStore.read``; ``ranges``: ``read_ranges``;
        ``"column@version"``: the values a named update wrote, docs/FORMAT.md "Patches")."""
        if any(c not in view.schema for c in cols):
            plain = [c for c in cols if c in view.schema]
            out = self.read(view, rows, plain, buffers, ranges) if plain else {}
            ids = self.locate(view, rows)[0]
            for c in cols:
                if c not in out:
                    out[c] = self.patches.version_column(view.manifest, view.schema, c, ids)
            return {c: out[c] for c in cols}
        rows, seg_idx, local = self.locate(view, rows)
        n = rows.size
        m = view.manifest
        # the touched segments (np.unique would import numpy.ma on first use: 80 ms of a cold first batch)
        touched = np.flatnonzero(np.bincount(seg_idx, minlength=len(m.segments))).tolist() if n else []
        if self.storage.cached:
            self.open_concurrently(view, [m.segments[i] for i in touched], cols)
            opened, hinted = set(), set()
        else:
            opened, hinted = self.open_segments(view, [m.segments[i] for i in touched], cols, check=True)
        # Visit each touched segment once, with the output positions of its rows.
        if n and seg_idx[0] == seg_idx[-1] and (n == 1 or not np.any(seg_idx != seg_idx[0])):
            parts = [(self.segment(m.segments[int(seg_idx[0])], view), slice(None), local)]
        else:
            order = np.argsort(seg_idx, kind="stable")
            bounds = [0, *(np.flatnonzero(np.diff(seg_idx[order])) + 1).tolist(), n]
            sels = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])] if n else []
            parts = [(self.segment(m.segments[i], view), sel, local[sel])
                     for i, sel in zip(seg_idx[order[bounds[:-1]]].tolist(), sels)] if n else []
        if self.storage.cached:
            fetch_for_read([(seg, loc) for seg, _, loc in parts], cols,
                           [c for c in cols if view.schema[c].kind == RAGGED], self.io_pool())
        for seg, _, loc in parts:
            if 4 * len(loc) >= seg.num_rows:  # a scan, not a sample: read the segment ahead
                seg.advise_all()
        # (only the segments this read opened: a segment read before had its pages asked for then;
        # of one whose buffers were checked as it opened, only the pages of the rows' values)
        ragged_cols = tuple(c for c in cols if view.schema[c].kind == RAGGED)
        cold = [part for part in parts if part[0] in opened and not (
                part[0].rows_in_page_cache(ragged_cols, part[2]) if part[0] in hinted else part[0].in_page_cache())] \
            if opened and len(parts) > 1 else []
        if cold:
            # segments opened by this read are likely cold (a reopened store's first batches): ask for
            # all their pages first. Later reads skip it: on warm pages a hint costs about a read, and a
            # long-running reader's cold pages are hinted ahead by the loader (prefetch). So do the
            # segments of a restarted process whose files are in the page cache (one mincore each
            # says so; this VM's page cache drops a few files' pages at a time)
            hint_reads(cold, cols, [view.schema[c].kind == RAGGED for c in cols], hinted)
        out: Dict[str, Column] = {}
        plans: Dict[Any, RangePlan] = {}
        # values for committed rows: a ragged column every row of which a patch holds is not read here
        patched = self.patches.read_hits(m, cols, rows) if m.patches else {}
        whole = {name for name, h in patched.items() if len(h.at) == n and view.schema[name].kind == RAGGED}
        # a run of consecutive rows of one segment (a scan) is returned as views, not copied
        run = (len(parts) == 1 and n > 1 and int(parts[0][2][-1]) - int(parts[0][2][0]) == n - 1
               and bool(np.all(np.diff(parts[0][2]) == 1)))
        # every ragged value served is checked here, once per segment for all ragged columns
        check_rows_of_parts([(seg, loc) for seg, _, loc in parts], ragged_cols)
        for name in cols:
            spec = view.schema[name]
            if name in whole:
                out[name] = None
            elif spec.kind == RAGGED and ranges:
                out[name] = ragged_ranges(name, parts, n, np.dtype(spec.dtype), plans)
            elif spec.kind == RAGGED and run:
                out[name] = ragged_run(name, parts[0][0], int(parts[0][2][0]), n)
            elif spec.kind == RAGGED:
                out[name] = gather_ragged(name, parts, n, np.dtype(spec.dtype), plans, buffers)
            elif spec.dtype == "string":
                res: List[Any] = [None] * n
                for seg, sel, loc in parts:
                    vals = seg.scalar(name).take(arrow_indices(loc)).to_pylist()
                    if isinstance(sel, slice):
                        res = vals
                    else:
                        for i, v in zip(sel.tolist(), vals):
                            res[i] = v
                out[name] = res
            else:
                first = parts[0][0].scalar(name, spec) if parts else None
                shape = (n,) + (first.shape[1:] if first is not None else ())
                arr = np.empty(shape, dtype=np.dtype(spec.dtype))
                if len(parts) > 1:  # one gather per segment, one scatter to row order (`order`: above)
                    arr[order] = np.concatenate([seg.scalar(name, spec)[loc] for seg, _, loc in parts])
                else:
                    for seg, sel, loc in parts:
                        arr[sel] = seg.scalar(name, spec)[loc]
                out[name] = arr
        if patched:
            self.patches.overlay(m, view.schema, rows, out, patched)
        for name in cols:  # a per-token tensor column says its shape and fill (collate lays it out)
            if out.get(name) is not None and view.schema[name].shape is not None:
                out[name].token_spec = view.schema[name]
        return out

    def row_lengths(self, view: ReadView, rows: Any, name: str) -> np.ndarray:
        """How many values each of ``rows`` holds in the ragged column ``name`` (0 where null), from
        the segments' offsets alone (their values' pages are neither read nor checked)."""
        rows, seg_idx, local = self.locate(view, rows)
        out = np.zeros(len(rows), dtype=np.int64)
        m = view.manifest
        for i in np.flatnonzero(np.bincount(seg_idx, minlength=len(m.segments))).tolist() if len(rows) else []:
            at = np.flatnonzero(seg_idx == i)
            _, offsets, valid = self.segment(m.segments[i], view).ragged(name)
            loc = local[at]
            got = offsets[loc + 1] - offsets[loc]
            out[at] = got if valid is None else np.where(valid[loc], got, 0)
        return out

    def prefetch(self, view: ReadView, rows: Any, cols: List[str]) -> None:
        """Hint the kernel to read the pages ``rows`` need (``ReplayStore.prefetch``; local files only)."""
        ids, seg_idx, local = self.locate(view, rows)
        m = view.manifest
        touched = np.flatnonzero(np.bincount(seg_idx, minlength=len(m.segments))).tolist() if ids.size else []
        _, hinted = self.open_segments(view, [m.segments[s] for s in touched], cols)
        parts = [(self.segment(m.segments[s], view), None, local[seg_idx == s]) for s in touched]
        # one pass per round: nearby rows and columns share a call
        hint_reads(parts, cols, [view.schema[c].kind == RAGGED for c in cols], hinted)

    def forget_dead(self, manifest: fmt.Manifest) -> None:
        """Unmap the segments ``manifest`` no longer holds and drop their page checksums."""
        live = {s.id for s in manifest.segments}
        for sid in [s for s in self.segments if s not in live]:
            del self.segments[sid]
        for sid in [s for s in self.pages if s not in live]:
            del self.pages[sid]


def _field_positions(schema: Optional[Schema], cols: Optional[Sequence[str]]) -> Optional[np.ndarray]:
    """Positions of ``cols`` among the store's columns, ascending: field ``i`` of a segment is
    column ``i`` of the store (late columns come last, and a segment lacks only late columns
    newer than itself; opening a segment refuses one whose fields disagree). Used to read recorded
    buffer ranges early and check them as a segment opens: a wrong guess would cost reads and
    checks of pages the read does not need, never wrong bytes."""
    if not cols or schema is None:
        return None
    order = {name: i for i, name in enumerate(schema.names)}
    return np.array(sorted(order[c] for c in cols if c in order), dtype=np.int64)
