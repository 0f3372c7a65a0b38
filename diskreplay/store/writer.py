"""The writing side of an open store: what each of ``ReplayStore``'s writing methods commits.

:class:`Writer` holds one writer's parts (its segment files: :class:`SegmentWriter`; an extend's
commit: :class:`Appender`; merges and ``compact``: :class:`Merger`). Each writing call builds a
commit as a value (:class:`~.commits.Commit`) and hands it to the one commit loop
(:meth:`Committer.commit`), whose result the store installs. The store's state reaches it as a
:class:`WriterContext` (the commit it is based on, how to install a new one); it never imports
the facade.

>>> import tempfile
>>> from diskreplay import ReplayStore
>>> store = ReplayStore(tempfile.mkdtemp())
>>> _ = store.extend({"prompt_id": [1]})
>>> store._writer.segments is store._segments, store.stats()["commits"]
(True, 1)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa

from .. import format as fmt
from ..errors import ArgumentError
from ..groups import GroupIndex
from ..schema import Schema
from ..segment import PageChecksums
from ..storage import Storage
from .appending import Appender, WriterContext
from .commits import Commit, group_index_commit, index_due
from .committer import Committer
from .compaction import MergePolicy
from .merging import Merger
from .segment_cache import SegmentCache
from .tokens import check_token
from .writing import SegmentWriter


class Writer:
    """The commits of one writer of the store at ``path`` (see the module docstring)."""

    def __init__(self, path: str, storage: Storage, cache: SegmentCache, merge_policy: MergePolicy) -> None:
        self.path, self.storage = path, storage
        #: this writer's segment files: the ids it reserved, the bytes of its newest small segments
        self.segments = SegmentWriter(path, merge_policy)
        #: the merges of small segments after an append, and compact's rewrite
        self.merger = Merger(storage, self.segments, cache)
        #: an extend's segments written and committed
        self.appender = Appender(path, storage, self.segments, cache)

    def append(self, context: Callable[[], WriterContext], record: pa.RecordBatch, schema: Schema,
               token: Optional[str], persist_index: Callable[[], None]) -> np.ndarray:
        """Commit an extend's validated ``record``; then the merges of small segments it made due
        and the persisted group index (``persist_index``), each an optimisation: a failure of one
        warns, and the append stands."""
        rows, appended = self.appender.commit(context(), record, schema, token)
        if not appended:
            return rows
        try:
            self.merger.merge_small_tail(context)
        except Exception as exc:
            # the append is committed: the merge is an optimisation, retried after the next one
            warnings.warn(f"{self.path}: merging small segments failed ({type(exc).__name__}: {exc}); the "
                          "store is intact and the merge is retried later", RuntimeWarning, stacklevel=5)
        try:
            persist_index()
        except Exception as exc:
            warnings.warn(f"{self.path}: writing the group index failed ({type(exc).__name__}: {exc}); the "
                          "store is intact (readers use the group sidecars) and it is retried after the next "
                          "append", RuntimeWarning, stacklevel=5)
        return rows

    def publish(self, at: WriterContext, commit: Commit) -> fmt.Manifest:
        """Hand ``commit`` to the commit loop, install what it published, then clean up."""
        result = at.committer.commit(commit, install=lambda new: at.install(new, at.options))
        at.collect()
        return result.manifest

    def persist_group_index(self, at: WriterContext, groups: Callable[[], GroupIndex],
                            page_checksums: Callable[[fmt.SegmentEntry], Optional[PageChecksums]],
                            key_type: Callable[[], pa.DataType], force: bool = False) -> None:
        """Write the group index of the live rows (``groups()``) to a file and name it in a commit,
        once ``INDEX_TAIL_SEGMENTS`` segments lie past the rows the current one covers (single
        writer; ``force``: whatever the tail)."""
        m = at.manifest
        # not on an object store: a second writer there (no lock) could write the same index name
        if at.group_key is None or at.multi_writer or not self.storage.exclusive_lock or not index_due(m, force):
            return
        gi = groups()
        pages = {}
        for s in m.segments:
            p = page_checksums(s)
            if p is not None:
                pages[s.id] = (s.bytes, s.crc32c, p)
        self.publish(at, group_index_commit(at.committer.storage, at.committer, m, gi.arrow_keys(key_type()),
                                            gi.offsets, gi.rows, pages))

    def collect(self, committer: Committer, generation: int) -> None:
        """Remove what no retained commit names; a failure warns (the commit stands: raising would
        invite a retry that appends the rows twice)."""
        try:
            committer.collect()
        except OSError as exc:
            warnings.warn(f"{self.path}: generation {generation} is committed, but removing files it no "
                          f"longer needs failed ({exc}); the next writer open removes them", RuntimeWarning,
                          stacklevel=5)


def checked_token(token: Any) -> str:
    """``committed_rows``' token: the str an ``extend(..., token=...)`` was given."""
    if token is None:
        raise ArgumentError("token must be the str an extend(..., token=...) was given, got None")
    return check_token(token)


def token_rows(rec: Optional[fmt.TokenRecord]) -> Optional[np.ndarray]:
    """The rows of a token's commit (None: no remembered commit has it)."""
    return None if rec is None else np.arange(rec.first_row, rec.end_row, dtype=np.int64)


def committed_rows(committer: Committer, token: str) -> Optional[np.ndarray]:
    """A writer's answer to ``committed_rows``: the token's rows, made durable first (a producer
    skips the batch on this answer: it must hold)."""
    rows = token_rows(committer.find_token(token))
    if rows is not None:
        committer.durable_replay(rows)
    return rows
