"""Appending: an ``extend``'s rows written as segments and committed, exactly once with a token.

:class:`PreparedAppend` is the commit as a value: its files, written and durable, and the
``ops.Append`` that commits them, rebased by itself on whichever manifest the commit is finally
based on. :class:`Appender` prepares it and hands it to the one commit loop
(:meth:`Committer.commit`). :class:`WriterContext` is what the store hands an append or a merge:
the writer's state when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from .. import format as fmt
from .._fileio import boot_clock, crash_point
from ..errors import BatchError
from ..schema import ColumnSpec, Schema
from ..segment import PageChecksums
from ..storage import Storage
from . import ops
from .committer import Committer
from .compaction import split
from .segment_cache import SegmentCache
from ..format.tokens import batch_digest
from .writing import SegmentWriter, encoded_digest, fix_schema


@dataclass(frozen=True)
class WriterContext:
    """A writer's state when an append or a merge starts: the commit it is based on, and how to
    publish (``install`` adopts a new commit with its options, ``collect`` removes what no
    retained commit names)."""

    manifest: fmt.Manifest
    options: fmt.StoreOptions
    schema: Optional[Schema]
    group_key: Optional[str]
    committer: Committer
    reserves_ids: bool
    install: Callable[[fmt.Manifest, fmt.StoreOptions], None]
    collect: Callable[[], None]

    @property
    def multi_writer(self) -> bool:
        return self.options.multi_writer


@dataclass
class PreparedAppend:
    """An append's segments (written and durable) and how they commit on any base.

    ``entries`` were prepared for rows from ``first``. A relocatable append (segment-local
    sidecar rows, an append delta) applies to any base as it is; any other has its sidecars
    rewritten for the base's ``next_row`` when a concurrent commit moved it (:meth:`operation`).
    ``written`` are its files, the rewritten sidecars included.

    >>> p = PreparedAppend((), 0, 0, None, (), True, [], [], [])
    >>> p.operation(fmt.Manifest(), None, None, None, False).num_rows
    0
    """

    entries: Tuple[fmt.SegmentEntry, ...]
    first: int
    num_rows: int
    token: Optional[fmt.TokenRecord]
    columns: Tuple[ColumnSpec, ...]
    relocatable: bool
    pieces: Sequence[pa.RecordBatch]
    pages: List[Optional[PageChecksums]]
    written: List[str]

    def operation(self, base: fmt.Manifest, segments: SegmentWriter, committer: Committer,
                  options: fmt.StoreOptions, reserves_ids: bool) -> ops.Append:
        """The ``ops.Append`` that commits these files on ``base``."""
        if reserves_ids:
            segments.check_reserved(base, self.entries, self.written)
        if self.first != base.next_row and not self.relocatable:  # the sidecars record global row ids
            self.entries = tuple(segments.rebase_sidecars(committer, options, self.entries, self.pieces,
                                                          self.pages, base.next_row, self.written))
            self.first = base.next_row
        return ops.Append(self.entries, self.num_rows, self.token, self.columns, self.relocatable)


class Appender:
    """Commits the rows of one ``extend`` (see the module docstring)."""

    def __init__(self, path: str, storage: Storage, segments: SegmentWriter, cache: SegmentCache) -> None:
        self.path, self.storage, self.segments, self.cache = path, storage, segments, cache

    def commit(self, at: WriterContext, record: pa.RecordBatch, schema: Schema,
               token: Optional[str] = None) -> Tuple[np.ndarray, bool]:
        """Write ``record`` (validated against ``schema``) and commit it; ``(row ids, appended)``,
        ``appended`` False when ``token`` was committed before (nothing written: its rows)."""
        m, committer = at.manifest, at.committer
        n = record.num_rows
        pieces = split(record)
        dig = batch_digest(record) if token is not None else 0
        if token is not None:
            rec = committer.find_token(token)
            if rec is not None:
                return self.replayed(committer, rec, n, dig, lambda: encoded_digest(pieces)), False
        written: List[str] = []
        pages: List[Optional[PageChecksums]] = []
        encoded: List[Any] = []
        started = boot_clock()
        try:
            options = fix_schema(self.path, self.storage, committer, at.options, schema, at.reserves_ids)
            # written and fsynced by the commit, together with the manifest's file (an append delta's
            # before the race, see Committer._stage_delta); with many writers of full manifests that
            # raced lately, first, so that a race only redoes the manifest step
            defer = not at.multi_writer or options.append_deltas or committer.uncontended()
            entries = self.segments.write(committer, options, m, pieces,
                                          None if at.reserves_ids else m.next_segment, m.next_row, written, pages,
                                          defer=defer, encoded=encoded)
            if not defer:
                crash_point("segments.synced")
        except BaseException:
            committer.discard_pending()
            committer.remove_files(written)
            raise
        prepared = PreparedAppend(tuple(entries), m.next_row, n,
                                  fmt.TokenRecord(token, 0, n, dig, 1) if token is not None else None,
                                  tuple(schema.pending()), options.append_deltas, pieces, pages, written)
        result = committer.commit(
            lambda base: prepared.operation(base, self.segments, committer, options, at.reserves_ids), written,
            token=token, install=lambda new: at.install(new, options), started=started,
            rows=lambda new: np.arange(new.next_row - n, new.next_row, dtype=np.int64))
        if result.duplicate is not None:
            if result.manifest.generation != m.generation:
                at.install(result.manifest, at.options)
            return self.replayed(committer, result.duplicate, n, dig, lambda: encoded_digest(pieces)), False
        new = result.manifest
        for e, checksums in zip(prepared.entries, pages):  # committed: not read back from its sidecar
            if e.groups_bytes and checksums is not None:
                self.cache.pages.setdefault(e.id, checksums)
        self.segments.keep_small(prepared.entries, encoded)
        at.collect()
        return np.arange(new.next_row - n, new.next_row, dtype=np.int64), True

    @staticmethod
    def replayed(committer: Committer, rec: fmt.TokenRecord, n: int, dig: int,
                 legacy: Optional[Callable[[], int]] = None) -> np.ndarray:
        """The rows of a token's commit, for a retry of that batch; ``legacy``: the digest a record
        written before :func:`batch_digest` holds (of the batch's encoded segments)."""
        if rec.num_rows != n or (rec.digest != dig and (legacy is None or rec.digest != legacy())):
            raise BatchError(f"token {rec.token!r} is committed (generation {rec.generation}, rows "
                             f"[{rec.first_row}, {rec.end_row})) for another batch than this one of {n} rows: its "
                             "rows hold other values. If this batch is meant to be a retry of that one, it is "
                             f"committed already and committed_rows({rec.token!r}) gives its rows; only a batch "
                             "that was never committed takes a token of its own")
        rows = np.arange(rec.first_row, rec.end_row, dtype=np.int64)
        committer.durable_replay(rows)
        return rows
