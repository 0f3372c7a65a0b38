"""What a store does differently when its files live in an object store.

Two things, both consequences of having no lock and no local file:

- :class:`RemoteCommitter`: a single-writer store on an object store cannot
  keep a second writer out, so its manifests are conditional PUTs
  (:meth:`~diskreplay.storage.S3Storage.replace`: the second writer fails at
  its commit) and its clean-up at open leaves files younger than a grace
  period alone (they may be that other writer's commit in flight).
- :class:`RemoteSegment`: a segment mapped from a sparse local cache file;
  each page is fetched just before its checksum is first checked, so a
  sample of a few rows downloads about the pages those rows live in, and
  every fetched byte is verified before it is served.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .. import format as fmt
from .._fileio import TMP_PREFIX
from ..errors import CorruptStoreError
from ..schema import Schema
from ..segment import PageChecksums, Segment
from .committer import DATA_SWEEP_DIRS, Committer


class CacheEvictedError(CorruptStoreError):
    """A mapped cache file was evicted while a read still needed more of it (internal: the
    store maps the segment again and repeats the read)."""


class RemoteCommitter(Committer):
    """The commit path of a single-writer store on an object store (see the module docstring)."""

    def _sweep_exclusive(self) -> None:
        current = self.manifest.generation
        docs, unreadable = fmt.manifest_docs(self.storage)
        keep = sorted((g for g in docs if g <= current), reverse=True)[: fmt.KEEP_MANIFESTS]
        self.retained = {g: docs[g] for g in keep}
        self.retained[current] = self.manifest
        referenced = {f for m in self.retained.values() for f in m.files()}
        # never a manifest newer than ours: it is another writer's (ours will then fail at commit)
        manifests = [fmt.manifest_file(g) for g in fmt.list_generations(self.storage)
                     if g < current and g not in self.retained and g not in unreadable]
        grace = self.options.retain_seconds or fmt.DEFAULT_RETAIN_SECONDS
        files = []
        for d in DATA_SWEEP_DIRS:
            for name in self.storage.list(d):
                rel = f"{d}/{name}"
                garbage = name.startswith(TMP_PREFIX) or (not unreadable and rel not in referenced)
                if garbage and self._age(rel) >= grace:
                    files.append(rel)
        self.delete(manifests, files)

    def _write_token_log(self, data: bytes, first_id: int) -> int:
        # the first free id, created only if absent: never another writer's (or a crashed one's) log
        log_id, _ = self.storage.link_candidates(fmt.token_log_file, data, first_id)
        return log_id


def _page_runs(pages: np.ndarray, page_bytes: int, size: int) -> List[Tuple[int, int]]:
    """Byte ranges of runs of consecutive page numbers (sorted, unique ``pages``)."""
    if not len(pages):
        return []
    cut = np.flatnonzero(np.diff(pages) != 1) + 1
    firsts = pages[np.concatenate([[0], cut])]
    lasts = pages[np.concatenate([cut - 1, [len(pages) - 1]])]
    return [(int(a) * page_bytes, min((int(b) + 1) * page_bytes, size)) for a, b in zip(firsts, lasts)]


class RemoteSegment(Segment):
    """A segment read from an object store through the storage's sparse cache.

    With page checksums (any store with a group key) only the pages read are
    fetched, in the same calls that check them; without, the whole object is
    fetched and checked once (``expected_crc``).
    """

    def __init__(self, storage: Any, entry: fmt.SegmentEntry, schema: Optional[Schema],
                 pages: Optional[PageChecksums], expected_crc: Optional[int]) -> None:
        self.storage = storage
        self.rel = entry.file
        self.tag = f"{entry.bytes}-{entry.crc32c:08x}"  # a name written again after a roll-back is another file
        path = storage.fetch_ranges(entry.file, [] if pages is not None else None, size=entry.bytes, evict=False,
                                    tag=self.tag)
        super().__init__(path, entry.bytes, schema, entry.num_rows, expected_crc, pages)

    def missing_ranges(self, pages: np.ndarray) -> List[Tuple[int, int]]:
        """Byte ranges of the given pages not checked yet (what a read of them must fetch)."""
        pages = np.asarray(pages, dtype=np.int64)
        todo = pages[~self._verified[pages]]
        if not len(todo):
            return []
        mark = np.zeros(len(self._verified), dtype=bool)
        mark[todo] = True
        return _page_runs(np.flatnonzero(mark), self.pages.page_bytes, self.size)

    def fetch(self, ranges: Optional[Sequence[Tuple[int, int]]]) -> None:
        """Make ``ranges`` (None: all) of the mapped file present."""
        if ranges is not None and not ranges:
            return
        path = self.storage.fetch_ranges(self.rel, ranges, size=self.size, evict=False, tag=self.tag)
        if path != self.path:
            raise CacheEvictedError(f"{self.path}: the cache file of {self.rel} was evicted while mapped")

    def _verify_pages(self, pages: np.ndarray) -> None:
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
