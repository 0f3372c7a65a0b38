"""The files a writer's commits add: segments and their group sidecars, the ids they take, and
the schema a store's first append fixes.

:class:`SegmentWriter` holds what one writer knows of its own files (the ids it reserved, the
bytes of its newest small segments); the store hands it the commit's committer, options and
manifest with each call. ``fix_schema`` writes the schema of a first append (``FORMAT.json``,
or ``SCHEMA.json`` where many writers race for it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import pyarrow as pa

from .. import format as fmt
from .._fileio import crash_point, crc32c
from ..errors import CommitConflictError
from ..schema import Schema
from ..segment import PageChecksums, encode_ipc, has_page_checksums
from ..format.sidecars import encode_group_sidecar, inline_group
from ..storage import Storage
from .compaction import MergePolicy

if TYPE_CHECKING:  # (the committer takes commits that hold these files: it imports this module)
    from .committer import Committer
from ..format.tokens import digest

OWN_IDS = 4096  # segment ids a writer of a multi-writer store remembers reserving (see SegmentWriter.is_own)
# many writers, local files: segment names each writer reserves at once, with one fsync of segments/
# for all of them, so that a small commit does not fsync the directory (docs/FORMAT.md, "Many writers");
# a segment of MERGE_MAX_BYTES or more takes a name of its own (the directory's fsync, issued with its
# own, costs it nothing)
RESERVE_AHEAD = 16
# ... while they are younger than a quarter of retain_seconds, if that is at least this long (a
# store that retains less, a test's, reserves each name with its commit: else each slow commit
# would find its names too old, give them up and reserve 16 more)
RESERVE_AHEAD_MIN_AGE = 60.0

#: a file a commit writes: its name, its bytes, the crash step of its kind (``"segment"``, ``"groups"``)
FileToWrite = Tuple[str, Any, Optional[str]]


@dataclass(frozen=True)
class Written:
    """What :meth:`SegmentWriter.write` wrote: the segments' ``entries``, the ``files`` it created
    (in creation order), and, deferred, the ``writes`` and ``dirs`` the commit's publish still
    makes durable with its manifest (empty when written already); each segment's page
    ``checksums`` (None: small) and ``encoded`` bytes."""

    entries: Tuple[fmt.SegmentEntry, ...]
    files: Tuple[str, ...]
    writes: Tuple[FileToWrite, ...]
    dirs: Tuple[str, ...]
    checksums: Tuple[Optional[PageChecksums], ...]
    encoded: Tuple[Any, ...]


class _SchemaRace(Exception):
    """Internal: another writer fixed a multi-writer store's schema first. ``ReplayStore.extend``
    catches it (:func:`after_schema_race`) and validates the batch against that schema; it never
    reaches a caller."""


T = TypeVar("T")


def after_schema_race(append: Callable[[], T], again: Callable[[], T]) -> T:
    """Run ``append``; if another writer of a multi-writer store fixed the schema first, run
    ``again`` (which validates the batch against that schema). ``_SchemaRace`` never leaves this call."""
    try:
        return append()
    except _SchemaRace:
        return again()


class SegmentWriter:
    """Writes one writer's segments and group sidecars, and remembers what it wrote.

    ``next_id`` is the next segment id this writer tries to reserve (many writers), ``own_ids``
    the ids of the newest segments it reserved (a due merge whose newest segment is one of them
    is this writer's to do), ``small`` the file bytes of its newest small segments by id (a merge
    of them copies them from here instead of reading the files back).

    >>> import pyarrow as pa
    >>> from diskreplay.store.compaction import MergePolicy
    >>> writer = SegmentWriter("/tmp/store", MergePolicy())
    >>> writer.is_own(3), writer.take_small(fmt.SegmentEntry(3, 0, 1, 10, 0, 0, 0, None))
    (False, None)
    """

    def __init__(self, path: str, merge_policy: MergePolicy) -> None:
        self.path = path
        self.merge_policy = merge_policy
        self.next_id = 0
        self.own_ids: Dict[int, None] = {}
        self.small: Dict[int, Any] = {}

    def write(self, committer: "Committer", options: fmt.StoreOptions, manifest: fmt.Manifest,
              records: Sequence[pa.RecordBatch], seg_id: Optional[int], first_row: int, sync_dirs: bool = True,
              defer: bool = False) -> Written:
        """Write segments and their group sidecars durably, all files' fsyncs at once
        (``Storage.write_files``); with ``sync_dirs`` their directory entries too. ``defer``: leave
        the writes to the commit's publish, which makes them durable with the manifest's file
        (returned in :attr:`Written.writes`). A failure removes the files this call created.

        ``seg_id=None`` (many writers): reserve a fresh id per segment by creating its
        file only if absent, so no two writers ever write the same name. Each segment's page
        checksums (a rebase rewrites the sidecars with them; None for a small segment, checked
        whole: ``has_page_checksums``) and bytes come back with its entry.
        """
        storage = committer.storage
        files: List[FileToWrite] = []
        names: List[str] = []
        entries, pages, encoded = [], [], []
        try:
            for record in records:
                data = encode_ipc(record)
                if seg_id is None:
                    # a small segment's name reserved ahead (a large one's fsync hides its directory's)
                    ahead = self._reserve_ahead(committer, options) if data.size < self.merge_policy.max_bytes else {}
                    sid, rel = fresh_id(committer, manifest,
                                        lambda first: storage.reserve(fmt.segment_file, first, **ahead), self.next_id)
                    self.next_id = sid + 1
                    self.own_ids[sid] = None
                    if len(self.own_ids) > OWN_IDS:
                        del self.own_ids[next(iter(self.own_ids))]
                else:
                    sid, rel, seg_id = seg_id, fmt.segment_file(seg_id), seg_id + 1
                names.append(rel)
                files.append((rel, data, "segment"))
                checksums = PageChecksums.of(data) if has_page_checksums(data.size) else None
                pages.append(checksums)
                encoded.append(data)
                g_bytes, g_crc, group, sidecar = sidecar_file(options, record, checksums, sid, first_row)
                if sidecar is not None:
                    names.append(sidecar[0])
                    files.append(sidecar)
                entries.append(fmt.SegmentEntry(sid, first_row, record.num_rows, data.size, crc32c(data), g_bytes,
                                                g_crc, group))
                first_row += record.num_rows
            # the new names must be durable before a manifest names the files
            dirs = dirs_of(entries, storage) if sync_dirs else []
            if not defer:
                storage.write_files(files, dirs)
                files, dirs = [], []
        except BaseException:
            committer.remove_files(names)
            raise
        return Written(tuple(entries), tuple(names), tuple(files), tuple(dirs), tuple(pages), tuple(encoded))

    @staticmethod
    def _reserve_ahead(committer: "Committer", options: fmt.StoreOptions) -> Dict[str, Any]:
        """How ``reserve`` takes a segment name: many writers of local files take it from names
        reserved ahead, used while younger than a quarter of ``retain_seconds`` (clean-up takes
        unnamed files past it; a commit's own files must stay younger than half of it), where that
        is at least ``RESERVE_AHEAD_MIN_AGE``."""
        if not committer.storage.can_map or not options.multi_writer \
                or committer.retain_seconds < 4 * RESERVE_AHEAD_MIN_AGE:
            return {}
        return {"ahead": RESERVE_AHEAD, "max_age": committer.retain_seconds / 4}

    def keep_small(self, entries: Sequence[fmt.SegmentEntry], encoded: Sequence[Any]) -> None:
        """Remember the bytes of committed segments small enough to be merged (see :meth:`take_small`):
        the newest ``fanin * ratio`` of them, the most a merge takes."""
        kept = self.small
        for e, data in zip(entries, encoded):
            if e.bytes < self.merge_policy.max_bytes:
                kept[e.id] = data
        for sid in list(kept)[: max(0, len(kept) - self.merge_policy.fanin * self.merge_policy.ratio)]:
            del kept[sid]

    def take_small(self, entry: fmt.SegmentEntry) -> Optional[pa.RecordBatch]:
        """The rows of a segment this writer committed lately, parsed from the bytes it wrote once
        they match the manifest's size and CRC-32C (None: not remembered, or not these bytes)."""
        data = self.small.pop(entry.id, None)
        if data is not None and data.size == entry.bytes and crc32c(data) == entry.crc32c:
            batch = pa.ipc.open_file(data).get_batch(0)
            if batch.num_rows == entry.num_rows:
                return batch
        return None

    def is_own(self, segment_id: int) -> bool:
        """Whether this writer reserved the segment id lately (a merge it completed is its to do)."""
        return segment_id in self.own_ids

    def clear(self) -> None:
        """Forget the bytes held (the store is closed)."""
        self.small.clear()


def fresh_id(committer: "Committer", manifest: fmt.Manifest, reserve: Callable[[int], Tuple[int, str]],
             first: int = 0) -> Tuple[int, str]:
    """``reserve(first)`` (which creates the first free name of an id ``>= first``, as
    ``Storage.reserve`` does) from ``manifest.next_segment`` on, for a writer of many: an id no
    commit ever named (docs/FORMAT.md, "Names no other writer produces").

    A free name is not enough: a commit may have named the id since ``manifest`` (a writer
    stopped between its catch-up and this call), a merge dropped it and a clean-up removed its
    file. That clean-up raised the collection floor past the generation that dropped it, above
    ``manifest``'s successor; so a floor read after the name was created that is at most that
    successor proves the id new. Otherwise the name is given back, with the names reserved
    ahead (made on a base as old), and the newest commit's ``next_segment`` taken instead."""
    storage = committer.storage
    base, first = manifest.generation, max(first, manifest.next_segment)
    while True:
        i, rel = reserve(first)
        floor = fmt.read_floor(storage)
        if floor is None or floor <= base + 1:
            return i, rel
        committer.remove_files([rel])
        storage.release_ahead()
        newest = committer.newest()
        base, first = newest.generation, max(i + 1, newest.next_segment)


def sidecar_file(options: fmt.StoreOptions, record: pa.RecordBatch, checksums: Optional[PageChecksums],
                 seg_id: int, first_row: int) -> Tuple[int, int, Optional[int], Optional[FileToWrite]]:
    """The group sidecar of a segment: ``(its bytes, its CRC-32C, None, the file to write)``;
    ``(0, 0, key, None)`` for a small segment of one integer group in a store with inline groups
    (no file: its manifest entry names the key), ``(0, 0, None, None)`` without a group key."""
    if options.group_key is None:
        return 0, 0, None, None
    keys = record.column(options.group_key)
    if options.inline_groups and checksums is None:
        key = inline_group(keys)
        if key is not None:
            return 0, 0, key, None
    local = options.append_deltas  # rows counted from the segment's: the file fits any base
    gdata = encode_group_sidecar(keys, None if local else first_row, checksums)
    return gdata.size, crc32c(gdata), None, (fmt.groups_file(seg_id), gdata, "groups")


def sidecars_on(options: fmt.StoreOptions, entries: Sequence[fmt.SegmentEntry], pieces: Sequence[pa.RecordBatch],
                pages: Sequence[Optional[PageChecksums]], first: int
                ) -> Tuple[Tuple[fmt.SegmentEntry, ...], Tuple[FileToWrite, ...]]:
    """The entries of an append moved to rows ``first, ...``, and their sidecars (which record
    global row ids) encoded again from the checksums in hand, to be rewritten in place by the
    retry's publish (with its manifest's file). Their names were made durable by the lost attempt
    and no manifest names them, so a torn rewrite is garbage."""
    out, files = [], []
    for e, piece, checksums in zip(entries, pieces, pages):
        g_bytes, g_crc, group, sidecar = sidecar_file(options, piece, checksums, e.id, first)
        if sidecar is not None:
            files.append(sidecar)
        out.append(fmt.SegmentEntry(e.id, first, e.num_rows, e.bytes, e.crc32c, g_bytes, g_crc, group))
        first += e.num_rows
    return tuple(out), tuple(files)


def dirs_of(entries: Sequence[fmt.SegmentEntry], storage: Storage) -> List[str]:
    """The directories to fsync for the new names of ``entries``' files: ``segments/`` unless every
    segment's name is durable already (reserved ahead), and ``groups/`` unless none of them has a
    sidecar (an inline group, or no group key)."""
    dirs = [] if all(storage.name_durable(e.file) for e in entries) else [fmt.SEGMENT_DIR]
    return dirs + [fmt.GROUPS_DIR] if any(e.groups_bytes for e in entries) else dirs


def encoded_digest(pieces: Sequence[pa.RecordBatch]) -> int:
    """The digest a token record written before ``tokens.batch_digest`` holds: of the batch's encoded segments."""
    datas = [encode_ipc(p) for p in pieces]
    return digest(sum(p.num_rows for p in pieces), [(d.size, crc32c(d)) for d in datas])


def fix_schema(path: str, storage: Storage, committer: "Committer", options: fmt.StoreOptions, schema: Schema,
               reserves_ids: bool) -> fmt.StoreOptions:
    """The options with ``schema``, writing it if this is the store's first append (``storage`` the
    store's own, ``committer.storage`` the one this writer commits through). Raises
    ``_SchemaRace`` when another writer of a multi-writer store fixed it first."""
    if schema.pending() and not options.late_columns:
        return mark_late_columns(storage, committer, options)
    schema = schema.initial()  # late columns are committed in the manifest, not here
    if options.schema is not None and options.schema == schema:
        return options
    fixed = dataclasses.replace(options, schema=schema)
    shared = committer.storage
    if not reserves_ids:
        fixed.write(shared)
        crash_point("format.done")
        return fixed
    # many writers: the first to create SCHEMA.json fixes the schema for all
    if not shared.put_if_absent(fmt.SCHEMA_FILE, fmt.shared_schema_bytes(schema), step="format"):
        if options.multi_writer:
            raise _SchemaRace()
        if fmt.read_shared_schema(shared) != schema:
            raise CommitConflictError(
                f"{path}/{fmt.SCHEMA_FILE} holds another schema than this first append's: another "
                "writer's first append fixed it (an object store has no lock; give a single-writer store "
                "one writer), or a crashed first append of another schema did (delete that file if no "
                "row was ever committed)")
    shared.sync_dir("")
    if not options.multi_writer:
        # object store, one writer: the winner of SCHEMA.json records it where v1 readers look
        fixed.write(shared)
    return fixed


def mark_late_columns(storage: Storage, committer: "Committer", options: fmt.StoreOptions) -> fmt.StoreOptions:
    """Say in FORMAT.json, before the first commit that adds a late column, that the store may have
    some, so that a diskreplay without them refuses the store rather than misreading it (every
    writer writes the same document: concurrent ones agree)."""
    # (the flags another writer turned on since these options were read stay on)
    marked = dataclasses.replace(options.with_stored_flags(committer.storage), late_columns=True)
    if options.multi_writer:  # its schema stays in SCHEMA.json
        doc = dataclasses.replace(marked, schema=None).body()
        committer.storage.replace(fmt.FORMAT_FILE, fmt.signed_bytes(doc), step="format")
    else:
        marked.write(storage)
    crash_point("format.done")
    return marked
