"""Appending: an ``extend``'s rows written as segments and committed, exactly once with a token.

:class:`Appender` writes the segments (:meth:`SegmentWriter.write` returns them) and builds the
commit as a value (:class:`~.commits.Commit`: its files and the ``ops.Append`` that commits
them, which the commit loop rebases on whichever manifest it is finally based on), hands it to
the one commit loop (:meth:`Committer.commit`) and keeps what the published commit says.
:class:`WriterContext` is what the store hands an append or a merge: the writer's state when it
starts. :func:`append_batch` is an ``extend`` from its batch on: catching up with other writers,
validating the batch, and validating it again where another writer fixed the schema first.
"""

from __future__ import annotations

import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np
import pyarrow as pa

from .. import format as fmt
from .._fileio import boot_clock, crash_point
from ..errors import BatchError, CommitConflictError
from ..ingest import normalize_batch
from ..schema import Schema
from ..storage import Storage
from . import ops
from .commits import Commit, Relocation
from .committer import Committer
from .compaction import split
from .segment_cache import SegmentCache
from ..format.tokens import batch_digest
from .writing import SegmentWriter, after_schema_race, encoded_digest, fix_schema
from .media import media_last_rows, media_writes, mark_media, pending_media

# the media blobs of the ``extend`` being committed ({hash: (descriptor, payload)}): set by
# append_batch around the append it hands to the store's writer, read by Appender.commit (the
# writer's append takes the record and schema only; the blobs' bytes are not part of the record)
_BLOBS: contextvars.ContextVar[Optional[Dict[bytes, Tuple[dict, Any]]]] = contextvars.ContextVar(
    "diskreplay_media_blobs", default=None)
# plans of one append on newer bases after a media blob it named was evicted meanwhile
MEDIA_REPLANS = 8


@dataclass(frozen=True)
class WriterContext:
    """A writer's state when an append or a merge starts: the commit it is based on, and how to
    publish (``install`` adopts a new commit with its options, ``collect`` removes what no
    retained commit names). ``reserves_ids``: new files take the first free id (created only if
    absent) rather than the next one in the manifest: with many writers, and where the storage
    has no exclusive lock (an object store), since a second writer of a single-writer store is
    not kept out there and must not overwrite a file."""

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


class Appender:
    """Commits the rows of one ``extend`` (see the module docstring)."""

    def __init__(self, path: str, storage: Storage, segments: SegmentWriter, cache: SegmentCache) -> None:
        self.path, self.storage, self.segments, self.cache = path, storage, segments, cache

    def commit(self, at: WriterContext, record: pa.RecordBatch, schema: Schema,
               token: Optional[str] = None) -> Tuple[np.ndarray, bool]:
        """Write ``record`` (validated against ``schema``) and commit it; ``(row ids, appended)``,
        ``appended`` False when ``token`` was committed before (nothing written: its rows).

        With media columns, the blobs of hashes the base does not name are written with the
        segments; if a blob the base named is evicted before the commit lands (``ops.Append``
        conflicts), the append is planned again on the newest commit, writing that blob."""
        blobs = _BLOBS.get()
        last = media_last_rows(record, schema) if blobs else ()
        attempt = 0
        while True:
            try:
                return self._commit(at, record, schema, token, blobs or {}, last)
            except CommitConflictError:
                if not last or attempt == MEDIA_REPLANS:
                    raise
                attempt += 1
                planned = {e.hash: e.id for e in at.manifest.media}
                newest = at.committer.newest()
                named = {e.hash: e.id for e in newest.media}
                # a blob the plan took from its base that is gone since, or stored again under another id
                # (evicted, then appended by another writer: ids are never used twice); else another conflict
                if all(h not in planned or named.get(h) == planned[h] for h, _ in last):
                    raise
                at.install(newest, at.options)
                at = dataclasses.replace(at, manifest=newest)

    def _commit(self, at: WriterContext, record: pa.RecordBatch, schema: Schema, token: Optional[str],
                blobs: Mapping[bytes, Tuple[dict, Any]], last: Tuple[Tuple[str, int], ...]) -> Tuple[np.ndarray, bool]:
        m, committer = at.manifest, at.committer
        n = record.num_rows
        pieces = split(record)
        dig = batch_digest(record) if token is not None else 0
        if token is not None:
            rec = committer.find_token(token)
            if rec is not None:
                return self.replayed(committer, rec, n, dig, lambda: encoded_digest(pieces)), False
        started = boot_clock()
        options = fix_schema(self.path, self.storage, committer, at.options, schema, at.reserves_ids)
        if last and not options.media:
            options = mark_media(committer, options)
        # written and fsynced by the commit, together with the manifest's file (an append delta's
        # before the race, see Committer._stage_delta); with many writers of full manifests that
        # raced lately, first, so that a race only redoes the manifest step
        defer = not at.multi_writer or options.append_deltas or committer.uncontended()
        written = self.segments.write(committer, options, m, pieces, None if at.reserves_ids else m.next_segment,
                                      m.next_row, defer=defer)
        if not defer:
            crash_point("segments.synced")
        relocatable = options.append_deltas  # segment-local sidecar rows: it applies to any base as it is
        new_media: Tuple[fmt.MediaEntry, ...] = ()
        files, writes, dirs = written.files, written.writes, written.dirs
        if last:
            try:
                new_media, m_files, m_writes = media_writes(committer, m, blobs, last, written.entries,
                                                            at.reserves_ids)
            except BaseException:
                committer.remove_files(written.files)
                raise
            files, writes = files + m_files, writes + m_writes
            if m_writes and fmt.SEGMENT_DIR not in dirs:
                dirs = dirs + (fmt.SEGMENT_DIR,)
        op = ops.Append(written.entries, n, fmt.TokenRecord(token, 0, n, dig, 1) if token is not None else None,
                        tuple(schema.pending()), relocatable, new_media, last)
        result = committer.commit(Commit(
            op, files, writes, dirs, started, at.reserves_ids,
            None if relocatable else Relocation(options, tuple(pieces), written.checksums, m.next_row)),
            install=lambda new: at.install(new, options))
        if result.duplicate is not None:
            if result.manifest.generation != m.generation:
                at.install(result.manifest, at.options)
            return self.replayed(committer, result.duplicate, n, dig, lambda: encoded_digest(pieces)), False
        new, entries = result.manifest, result.commit.entries
        for e, checksums in zip(entries, written.checksums):  # committed: not read back from its sidecar
            if e.groups_bytes and checksums is not None:
                self.cache.pages.setdefault(e.id, checksums)
        self.segments.keep_small(entries, written.encoded)
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


def catch_up(at: WriterContext, storage: Storage) -> None:
    """Multi-writer: install the newest commit of any writer before planning a new one (and the
    stored options, while those held have no schema: another writer's first append may fix it)."""
    m = at.committer.newest()
    options = at.options if at.options.schema is not None else fmt.StoreOptions.read(storage)
    if m.generation != at.manifest.generation or options is not at.options:
        at.install(m, options)


def append_batch(context: Callable[[], WriterContext], storage: Storage, batch: Mapping[str, Any],
                 token: Optional[str], append: Callable[[pa.RecordBatch, Schema, Optional[str]], np.ndarray]
                 ) -> np.ndarray:
    """An ``extend`` of ``batch`` (``token`` checked): ``append`` of the batch validated against the
    store's schema, as of the newest commit where many write; the row ids."""
    at = context()
    if at.multi_writer:
        catch_up(at, storage)
        at = context()
    # until a row is committed the schema is not fixed: FORMAT.json may hold one from a first
    # append that crashed before its manifest
    record, schema = normalize_batch(batch, at.schema if at.multi_writer or at.manifest.next_row else None,
                                     at.group_key)
    blobs = pending_media(batch)

    def again() -> np.ndarray:
        # another writer's first append fixed the schema first: this batch must fit it
        at = context()
        at.install(at.manifest, fmt.StoreOptions.read(storage))
        at = context()
        return append(*normalize_batch(batch, at.schema, at.group_key), token)

    held = _BLOBS.set(blobs)
    try:
        return after_schema_race(lambda: append(record, schema, token), again)
    finally:
        _BLOBS.reset(held)
