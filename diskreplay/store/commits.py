"""A commit as a value: its operation, the files it wrote, what its publish still writes.

A :class:`Commit` is built by the part that wrote its files (an append's segments, a merge's,
a saved state's file, a persisted group index: :func:`state_commit`, :func:`group_index_commit`)
and handed to the one commit loop (:meth:`Committer.commit`). When another writer committed
first, the loop rebases it on the newest manifest (:meth:`Commit.on`): a new value, the old one
unchanged, as ``ops.apply`` makes a new manifest of an operation. The loop's
:class:`CommitResult` holds the value it published, and so the files it wrote.

>>> c = Commit(ops.Evict(4))
>>> c.on(fmt.Manifest()) is c, c.files, c.token
(True, (), None)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from .. import format as fmt
from .._fileio import boot_clock, crc32c
from ..errors import ConditionalWriteError
from ..format.sidecars import encode_group_index
from ..segment import PageChecksums
from ..storage import Storage
from . import ops
from .states import write_state_file
from .writing import FileToWrite, sidecars_on

# A single writer persists the group index (docs/FORMAT.md, "Group index") once this many segments
# were committed past the rows it covers: a reopened store then reads one index file and at most
# this many sidecars, whatever its size, while the rewrites cost about one index per 16 commits.
INDEX_TAIL_SEGMENTS = 16


@dataclass(frozen=True)
class Relocation:
    """What an append whose sidecars record global row ids needs to move to other rows: its
    ``options``, its segments' rows (``pieces``) and page checksums, and the row its sidecars
    were written for (``first``)."""

    options: fmt.StoreOptions
    pieces: Tuple[pa.RecordBatch, ...]
    pages: Tuple[Optional[PageChecksums], ...]
    first: int


@dataclass(frozen=True)
class Commit:
    """One commit: ``op`` applied to whichever manifest it is finally based on.

    ``files`` are the files it created, in creation order (removed, newest first, when it does
    not happen); ``writes`` and ``dirs`` what its publish still writes and makes durable with the
    manifest's file (deferred data, rewritten sidecars); ``started`` the ``boot_clock()`` of its
    first file's write (many writers: a commit naming files older than half of ``retain_seconds``
    is abandoned); ``reserved``: its segment ids were created only if absent (checked against
    each base); ``relocation``: an append whose sidecars must be rewritten on a base that ends
    at another row.
    """

    op: ops.Operation
    files: Tuple[str, ...] = ()
    writes: Tuple[FileToWrite, ...] = ()
    dirs: Tuple[str, ...] = ()
    started: Optional[float] = None
    reserved: bool = False
    relocation: Optional[Relocation] = None

    @property
    def token(self) -> Optional[str]:
        """The token an append or a patch commits exactly once (None: none)."""
        op = self.op
        return op.token.token if isinstance(op, (ops.Append, ops.Patch)) and op.token is not None else None

    @property
    def entries(self) -> Tuple[fmt.SegmentEntry, ...]:
        """The new segments it names (an append's, a rewrite's)."""
        return self.op.entries if isinstance(self.op, (ops.Append, ops.Rewrite)) else ()

    def rows(self, new: fmt.Manifest) -> Optional[np.ndarray]:
        """The rows it committed as ``new`` (an append's; None for another operation)."""
        if not isinstance(self.op, ops.Append):
            return None
        return np.arange(new.next_row - self.op.num_rows, new.next_row, dtype=np.int64)

    def taken(self, base: fmt.Manifest) -> Tuple[int, ...]:
        """Ids of its segments that ``base`` names already: created only if absent, so the storage
        broke that promise (an object store whose If-None-Match is checked before the write
        instead of atomically with it). Empty for ids that were not reserved."""
        if not self.reserved:
            return ()
        return tuple(sorted({s.id for s in base.segments} & {e.id for e in self.entries}))

    def removable(self, newest: fmt.Manifest) -> Tuple[str, ...]:
        """The files to remove when it does not happen: all, except those of segments ``newest``
        names (:meth:`taken`: another commit's)."""
        taken = set(self.taken(newest))
        if not taken:
            return self.files
        named = {rel for e in self.entries if e.id in taken for rel in (e.file, e.groups_file)}
        return tuple(rel for rel in self.files if rel not in named)

    def on(self, base: fmt.Manifest) -> "Commit":
        """This commit rebased on ``base``: an append whose sidecars record global row ids, moved
        to ``base.next_row``, gets its sidecars encoded again (rewritten in place by the publish,
        replacing any still pending: both in one write would race); anything else is itself."""
        r = self.relocation
        if r is None or r.first == base.next_row or not isinstance(self.op, ops.Append):
            return self
        entries, sidecars = sidecars_on(r.options, self.op.entries, r.pieces, r.pages, base.next_row)
        rewritten = {rel for rel, _, _ in sidecars}
        return dataclasses.replace(
            self, op=dataclasses.replace(self.op, entries=entries),
            files=self.files + tuple(rel for rel, _, _ in sidecars if rel not in self.files),
            writes=tuple(w for w in self.writes if w[0] not in rewritten) + sidecars,
            relocation=dataclasses.replace(r, first=base.next_row))

    def adding(self, files: Sequence[str] = (), writes: Sequence[FileToWrite] = (),
               dirs: Sequence[str] = ()) -> "Commit":
        """With more files (an attempt's token logs, its segment table) and writes."""
        if not (files or writes or dirs):
            return self
        return dataclasses.replace(self, files=self.files + tuple(files), writes=self.writes + tuple(writes),
                                   dirs=self.dirs + tuple(dirs))

    def without(self, files: Sequence[str]) -> "Commit":
        """Without ``files`` (a lost attempt's, deleted)."""
        gone = set(files)
        return dataclasses.replace(self, files=tuple(rel for rel in self.files if rel not in gone))

    def published(self) -> "Commit":
        """After a publish (or a delta's staging): its writes are written, whatever the outcome."""
        return dataclasses.replace(self, writes=(), dirs=()) if self.writes or self.dirs else self


@dataclass(frozen=True)
class CommitResult:
    """What the commit loop did: the ``manifest`` it published (or the newest, for a duplicate),
    the ``commit`` as published (rebased), or ``duplicate``: the token's earlier commit (nothing
    written)."""

    manifest: fmt.Manifest
    commit: Optional[Commit] = None
    duplicate: Optional[fmt.TokenRecord] = None

    @property
    def files(self) -> Tuple[str, ...]:
        """The files the commit wrote (none for a duplicate)."""
        return self.commit.files if self.commit is not None else ()


def reserved_twice(url: str, segment_id: int) -> ConditionalWriteError:
    """The error for a segment id that two writers created (:meth:`Commit.taken`)."""
    return ConditionalWriteError(
        f"{url}/{fmt.segment_file(segment_id)} was created by two writers although each creates it "
        f"only if absent (If-None-Match: *): this server does not check the condition atomically with the "
        f"write, so concurrent commits can overwrite each other's files; run `diskreplay verify "
        f"{url}`, and use a server with atomic conditional writes or one writer at a time")


def state_commit(committer: Any, name: str, data: pa.Buffer, generation: int, reserves_ids: bool,
                 replaces: Any = ...) -> Commit:
    """Write the state file of ``name`` (encoded: ``data``) for the commit of ``generation`` and
    return its commit; ``replaces``: only over this entry (a compare-and-set), default over any."""
    # its file's write time: a commit naming an unleased file older than the others' retention
    # (a saver stopped mid-save, on object storage) is abandoned, never published over a collected file
    started = boot_clock()
    entry = write_state_file(committer, name, data, generation, reserves_ids)
    conditional = replaces is not ...
    return Commit(ops.SaveState(entry, replaces if conditional else None, conditional), (entry.file,),
                  started=started)


def index_due(manifest: fmt.Manifest, force: bool = False) -> bool:
    """Whether a single writer persists the group index now: ``INDEX_TAIL_SEGMENTS`` segments lie
    past the rows the current one covers (``force``: whatever the tail)."""
    if not manifest.segments:
        return False
    covered = manifest.group_index.end_row if manifest.group_index is not None else manifest.head
    return force or sum(1 for s in manifest.segments if s.end_row > covered) >= INDEX_TAIL_SEGMENTS


def group_index_commit(storage: Storage, committer: Any, manifest: fmt.Manifest, keys: pa.Array,
                       offsets: np.ndarray, rows: np.ndarray, pages: dict) -> Commit:
    """Write the group index of ``manifest``'s live rows (``keys``, ``offsets``, ``rows``; the
    segments' ``pages`` checksums by id) durably and return the commit naming it."""
    data, frame = encode_group_index(keys, offsets, rows, manifest.head, manifest.next_row, pages)
    entry = fmt.GroupIndexEntry(manifest.generation + 1, manifest.head, manifest.next_row, data.size, crc32c(data),
                                frame)
    try:
        storage.write_new(entry.file, data, step="groups")
        storage.sync_dir(fmt.GROUPS_DIR)
    except BaseException:
        committer.remove_files([entry.file])
        raise
    return Commit(ops.IndexGroups(entry), (entry.file,))
