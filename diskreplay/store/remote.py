"""What a store does differently when its files live in an object store.

:class:`RemoteSegment`: a segment mapped from a sparse local cache file;
each page is fetched just before its checksum is first checked, so a
sample of a few rows downloads about the pages those rows live in, and
every fetched byte is verified before it is served. (What a commit does
without a lock, the committer and the collector decide from the storage's
capabilities.)
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .. import format as fmt
from .._ranges import runs
from ..errors import ArgumentError, CorruptStoreError
from ..schema import Schema
from ..segment import PageChecksums, Segment


class _CacheEvicted(Exception):
    """Internal control flow, never seen by callers: a mapped cache file was evicted while a read
    still needed more of it; the store maps the segment again and repeats the read
    (:func:`remapped`; a second eviction is an ``ArgumentError`` naming ``cache_bytes``)."""


T = TypeVar("T")


def remapped(action: Callable[[], T], remap: Callable[[], None], path: str) -> T:
    """Run a read (``action``); if the cache evicted a file it maps meanwhile (a batch larger than
    ``cache_bytes``), ``remap`` (forget the mapped segments) and repeat once. ``_CacheEvicted``
    never leaves this call."""
    try:
        return action()
    except _CacheEvicted:
        remap()
    try:
        return action()
    except _CacheEvicted:
        raise ArgumentError(f"{path}: the local cache lost files one read still needed twice; raise "
                            "cache_bytes (or give each process its own cache_dir)") from None


def _pages_of(starts: np.ndarray, ends: np.ndarray, page_bytes: int) -> np.ndarray:
    """Page numbers covering the byte spans ``[starts[i], ends[i])`` (empty spans skipped)."""
    keep = ends > starts
    first, last = starts[keep] // page_bytes, (ends[keep] - 1) // page_bytes
    counts = last - first + 1
    return np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _page_runs(pages: np.ndarray, page_bytes: int, size: int) -> List[Tuple[int, int]]:
    """Byte ranges of runs of consecutive page numbers (sorted, unique ``pages``)."""
    firsts, lasts = runs(pages)
    return [(int(a) * page_bytes, min((int(b) + 1) * page_bytes, size)) for a, b in zip(firsts, lasts)]


class RemoteSegment(Segment):
    """A segment read from an object store through the storage's sparse cache.

    With page checksums (any store with a group key) only the pages read are
    fetched, in the same calls that check them; without, the whole object is
    fetched and checked once (``expected_crc``).
    """

    @staticmethod
    def cache_tag(entry: fmt.SegmentEntry) -> str:
        """The segment's tag in the storage's cache: a name written again after a roll-back is another file."""
        return f"{entry.bytes}-{entry.crc32c:08x}"

    def __init__(self, storage: Any, entry: fmt.SegmentEntry, schema: Optional[Schema],
                 pages: Optional[PageChecksums], expected_crc: Optional[int]) -> None:
        self.storage = storage
        self.rel = entry.file
        self.tag = self.cache_tag(entry)
        path = storage.fetch_ranges(entry.file, [] if pages is not None else None, size=entry.bytes, evict=False,
                                    tag=self.tag)
        self.cache_path = path
        self._complete = False
        url = f"{storage.url}/{entry.file}"
        try:
            super().__init__(path, entry.bytes, schema, entry.num_rows, expected_crc, pages)
        except CorruptStoreError as exc:  # named by the object, not by its cache file
            raise CorruptStoreError(str(exc).replace(path, url)) from None
        self.path = url

    def missing_ranges(self, pages: np.ndarray) -> List[Tuple[int, int]]:
        """Byte ranges of the given pages not checked yet (what a read of them must fetch)."""
        if self.complete():
            return []
        pages = np.asarray(pages, dtype=np.int64)
        todo = pages[~self._verified[pages]]
        if not len(todo):
            return []
        mark = np.zeros(len(self._verified), dtype=bool)
        mark[todo] = True
        return _page_runs(np.flatnonzero(mark), self.pages.page_bytes, self.size)

    @staticmethod
    def prefetch_ends(storage: Any, entry: fmt.SegmentEntry, page_bytes: int = 8192) -> None:
        """Fetch a segment's first and last page before its checksums are known: Arrow's
        schema and batch header, and its footer, usually lie there (saves a round trip)."""
        size = entry.bytes
        ranges = [(0, min(page_bytes, size))] + ([(max(page_bytes, size - page_bytes), size)]
                                                  if size > page_bytes else [])
        storage.fetch_ranges(entry.file, ranges, size=size, evict=False, tag=f"{entry.bytes}-{entry.crc32c:08x}")

    @staticmethod
    def prefetch_frame(storage: Any, entry: fmt.SegmentEntry, pages: PageChecksums,
                       fields: Optional[np.ndarray] = None) -> None:
        """Fetch the pages a segment's open checks (Arrow's schema, batch header and footer), and
        those of the recorded buffer ranges of its ``fields`` (positions), if any."""
        p, size = pages.page_bytes, entry.bytes
        head = -(-pages.body[0] // p) * p
        tail = pages.body[1] // p * p
        ranges = [r for r in ((0, min(head, size)), (tail, size)) if r[1] > r[0]]
        buffers = pages.buffer_pages(fields) if fields is not None else None
        if buffers is not None:
            ranges += zip(buffers[:, 0].tolist(), np.minimum(buffers[:, 1], size).tolist())
        storage.fetch_ranges(entry.file, ranges, size=size, evict=False, tag=f"{entry.bytes}-{entry.crc32c:08x}")

    def complete(self) -> bool:
        """Every page fetched and checked (then a read needs no fetch and no page arithmetic)."""
        if not self._complete:
            self._complete = bool(self._verified.all())
        return self._complete

    def column_ranges(self, names: Sequence[str], ragged: Sequence[str]) -> List[Tuple[int, int]]:
        """Missing byte ranges of the per-row columns ``names`` and of the validity and
        offsets of the ragged ones (what a read needs before it knows where values lie)."""
        if self.complete():
            return []
        base = self._base.address
        spans = [(b.address - base, b.address - base + b.size)
                 for name in names
                 for b in (self.batch.column(name).buffers()[:2] if name in ragged else
                           self.batch.column(name).buffers())
                 if b is not None and b.size]
        if not spans:
            return []
        a = np.array(spans, dtype=np.int64)
        return self.missing_ranges(_pages_of(a[:, 0], a[:, 1], self.pages.page_bytes))

    def value_ranges_of(self, names: Sequence[str], local_rows: np.ndarray) -> List[Tuple[int, int]]:
        """Missing byte ranges of the values of ``local_rows`` in the ragged columns ``names``."""
        if self.complete():
            return []
        parts = [self.value_ranges(name, local_rows)[:-1] for name in names]
        if not parts:
            return []
        r = np.concatenate(parts)
        starts = r[:, 0] - self._base.address
        return self.missing_ranges(_pages_of(starts, starts + r[:, 1], self.pages.page_bytes))

    def fetch(self, ranges: Optional[Sequence[Tuple[int, int]]]) -> None:
        """Make ``ranges`` (None: all) of the mapped file present."""
        if ranges is not None and not ranges:
            return
        path = self.storage.fetch_ranges(self.rel, ranges, size=self.size, evict=False, tag=self.tag)
        if path != self.cache_path:
            raise _CacheEvicted(self.path)

    def _verify_pages(self, pages: np.ndarray) -> None:
        if not self._complete:
            self.fetch(self.missing_ranges(pages))
            super()._verify_pages(pages)

    def verify_whole(self, crc: int) -> None:
        self.fetch(None)
        super().verify_whole(crc)

    def advise_all(self) -> None:
        """A scan reads every page: fetch the whole object in parallel parts first."""
        if not self.advised_all and self.pages is not None:
            self.fetch(self.missing_ranges(np.arange(len(self._verified))))
        super().advise_all()


def fetch_for_read(parts: Sequence[Tuple[Segment, np.ndarray]], names: Sequence[str], ragged: Sequence[str],
                   pool: Any) -> None:
    """Fetch, for every segment a read touches at once, what reading rows ``loc`` of
    columns ``names`` needs: first the per-row columns and the offsets, then the values
    of those rows. Two rounds of concurrent range GETs for a whole batch (each segment's
    missing ranges coalesced into few GETs), instead of two per segment and column."""
    remote = [(seg, loc) for seg, loc in parts if isinstance(seg, RemoteSegment) and seg.pages is not None]
    for plan in (lambda seg, loc: seg.column_ranges(names, ragged),
                 lambda seg, loc: seg.value_ranges_of([n for n in names if n in ragged], loc)):
        jobs = [(seg, plan(seg, loc)) for seg, loc in remote]
        jobs = [(seg, ranges) for seg, ranges in jobs if ranges]
        if len(jobs) == 1:
            jobs[0][0].fetch(jobs[0][1])
        elif jobs:
            list(pool.map(lambda job: job[0].fetch(job[1]), jobs))
