"""Manifests and deltas as values, and their pure transforms (``evict``, ``append_rows``, ``rewrite_rows``)."""

from __future__ import annotations

import json

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .._fileio import crc32c
from ..errors import CommitConflictError, FormatError
from ..schema import ColumnSpec, late_column_problem
from .names import (DELTA_FORMAT, FORMAT_VERSION, LATE_COLUMNS_MANIFEST_VERSION, MANIFEST_FORMAT, MAX_ID,
                    MEDIA_DELTA_VERSION, MEDIA_MANIFEST_VERSION, PATCHES_MANIFEST_VERSION, REWRITE_DELTA_VERSION,
                    manifest_file)
from .jsondoc import canonical_json, check_header, check_signature, entry_list, evolve, int_field, signed_doc
from .jsondoc import signed_bytes  # noqa: F401  (the doctests below write deltas with it)
from .access import StorageLike, as_storage
from .options import StoreOptions
from .segment_table import SegmentTable, SegmentTableEntry
from .media import add_media, delta_media as _delta_media, live_media, manifest_media as _media
from .entries import (GroupIndexEntry, LateColumn, MediaEntry, PatchEntry, SegmentEntry, StateEntry, TokenLog, TokenRecord, add_late_columns,
                      parse_commit_stats)


#: a manifest that records holes (rows a repair dropped): a diskreplay that does not know them refuses it
HOLES_MANIFEST_VERSION = 3

_ENTRIES_PLACEHOLDER = "\x00entries\x00"
_ENTRIES_MARK = b'"segments":' + json.dumps(_ENTRIES_PLACEHOLDER).encode()


@dataclass(frozen=True)
class Manifest:
    """One committed snapshot of the store.

    ``head`` is the first live row id (rows below it are evicted);
    ``next_row`` the id the next appended row gets. Live rows are
    ``[head, next_row)`` less ``holes`` (row ranges ``repair`` dropped with
    their damaged segment: no segment holds them and no read serves them), and
    lie in ``segments``, which are ordered by row.

    >>> m = Manifest()
    >>> m.generation, m.num_rows
    (0, 0)
    """

    generation: int = 0
    head: int = 0
    next_row: int = 0
    next_segment: int = 0
    segments: Tuple[SegmentEntry, ...] = ()
    states: Mapping[str, StateEntry] = field(default_factory=dict)
    #: exactly-once tokens of the newest commits (older ones are sealed into ``token_logs``)
    tokens: Tuple[TokenRecord, ...] = ()
    token_logs: Tuple[TokenLog, ...] = ()
    #: columns added after the first commit, oldest first (the schema's history)
    late_columns: Tuple[LateColumn, ...] = ()
    #: a persisted group index of a prefix of the rows (optional: readers fall back to the sidecars)
    group_index: Optional[GroupIndexEntry] = None
    #: multi-writer stores: counters summed over every writer's commits (``COMMIT_STATS`` keys)
    commit_stats: Mapping[str, int] = field(default_factory=dict)
    #: not stored: how many append deltas this commit is past the newest full manifest (0: it is one)
    depth: int = field(default=0, compare=False)
    #: a full manifest of many segments: where the same entries lie as a table (docs/FORMAT.md,
    #: "Segment tables"); dropped by :meth:`evolve`, as the entries change with every commit
    segment_table: Optional[SegmentTableEntry] = field(default=None, compare=False)
    #: ``[start, stop)`` row ranges above ``head`` that hold no rows (docs/FORMAT.md, "Manifests"):
    #: sorted, each exactly a gap between the segments or after the last one
    holes: Tuple[Tuple[int, int], ...] = ()
    #: values written for committed rows, oldest first: a row's value of a column is the one in the
    #: newest patch holding it, else its segment's (docs/FORMAT.md, "Patches")
    patches: Tuple[PatchEntry, ...] = ()
    #: media blobs named by live rows, oldest first, each hash once (docs/FORMAT.md, "Media")
    media: Tuple[MediaEntry, ...] = ()

    @property
    def num_rows(self) -> int:
        return self.next_row - self.head - sum(b - a for a, b in self.holes)

    @property
    def file(self) -> str:
        return manifest_file(self.generation)

    def files(self) -> List[str]:
        """Every data file this manifest references (relative paths)."""
        out = []
        for s in self.segments:  # (a store without a group key, or an inline group: no sidecar file)
            out += s.files()
        return out + self.files_besides_segments()

    def files_besides_segments(self) -> List[str]:
        """The data files this manifest references other than its segments and their sidecars."""
        out = [st.file for st in self.states.values()]
        out += [t.file for t in self.token_logs]
        out += [p.file for p in self.patches]
        out += [e.file for e in self.media]
        if self.group_index is not None:
            out.append(self.group_index.file)
        if self.segment_table is not None:
            out.append(self.segment_table.file)
        return out

    @property
    def nbytes(self) -> int:
        segs = self.segments
        data = (int(segs.column("bytes").sum() + segs.column("groups_bytes").sum()) if isinstance(segs, SegmentTable)
                else sum(s.bytes + s.groups_bytes for s in segs))
        return (data + sum(st.bytes for st in self.states.values()) + sum(p.bytes for p in self.patches)
                + sum(e.bytes for e in self.media)
                + (self.group_index.bytes if self.group_index is not None else 0))

    def evolve(self, **changes: Any) -> "Manifest":
        changes.setdefault("segment_table", None)
        return evolve(self, changes)

    def to_dict(self) -> dict:
        return signed_doc(self.body())

    def file_bytes(self) -> bytes:
        """The manifest's file, ``signed_bytes(self.body())``, with each segment entry's JSON made
        once per entry and joined (the same bytes; a commit to a store of thousands of segments
        would otherwise serialise every entry again)."""
        text = canonical_json(self.body(entries=False))
        at = text.index(_ENTRIES_MARK)  # unique: a key's quotes are escaped inside any string value
        text = b"".join([text[:at], b'"segments":[', b",".join([s.json_bytes() for s in self.segments]), b"]",
                         text[at + len(_ENTRIES_MARK):]])
        return text[:-1] + b',"checksum":%d}' % crc32c(text)

    def body(self, entries: bool = True) -> dict:
        """The manifest as its JSON document (``entries`` False: a placeholder for the segments'
        list, which :meth:`file_bytes` fills in)."""
        doc = {
            "format": MANIFEST_FORMAT,
            "version": FORMAT_VERSION,
            "generation": self.generation,
            "head": self.head,
            "next_row": self.next_row,
            "next_segment": self.next_segment,
            "segments": [s.to_dict() for s in self.segments] if entries else _ENTRIES_PLACEHOLDER,
            "states": {k: v.to_dict() for k, v in sorted(self.states.items())},
        }
        # only when used: a store without tokens writes exactly the manifests it always did
        if self.tokens:
            doc["tokens"] = [t.to_list() for t in self.tokens]
        if self.token_logs:
            doc["token_logs"] = [t.to_dict() for t in self.token_logs]
        if self.late_columns:
            doc.update(version=LATE_COLUMNS_MANIFEST_VERSION, late_columns=[c.to_dict() for c in self.late_columns])
        if self.group_index is not None:
            doc["group_index"] = self.group_index.to_dict()
        if self.commit_stats:
            doc["commit_stats"] = dict(sorted(self.commit_stats.items()))
        if self.segment_table is not None:
            doc["segment_table"] = self.segment_table.to_dict()
        if self.holes:
            doc.update(version=HOLES_MANIFEST_VERSION, holes=[[a, b] for a, b in self.holes])
        if self.patches:
            doc.update(version=PATCHES_MANIFEST_VERSION, patches=[p.to_dict() for p in self.patches])
        if self.media:
            doc.update(version=MEDIA_MANIFEST_VERSION, media=[e.to_dict() for e in self.media])
        return doc

    @classmethod
    def from_dict(cls, doc: Any, where: str, verified: bool = False) -> "Manifest":
        """The manifest a checked document holds; its ``segments`` may be a :class:`SegmentTable`
        already (a reader that read the segment table instead of the JSON entries)."""
        doc = check_header(doc, MANIFEST_FORMAT, where,
                           (FORMAT_VERSION, LATE_COLUMNS_MANIFEST_VERSION, HOLES_MANIFEST_VERSION,
                            PATCHES_MANIFEST_VERSION, MEDIA_MANIFEST_VERSION))
        if not verified:
            check_signature(doc, where)
        segs = doc.get("segments")
        states = doc.get("states", {})
        tokens, logs = doc.get("tokens", []), doc.get("token_logs", [])
        if not isinstance(segs, (list, SegmentTable)) or not isinstance(states, dict) or not isinstance(tokens, list) \
                or not isinstance(logs, list):
            raise FormatError(f"Unsupported segments/states/tokens in {where}; expected lists and an object")
        m = cls(
            generation=int_field(doc, "generation", where, lo=1, hi=MAX_ID),
            head=int_field(doc, "head", where),
            next_row=int_field(doc, "next_row", where),
            next_segment=int_field(doc, "next_segment", where, hi=MAX_ID + 1),
            segments=segs if isinstance(segs, SegmentTable) else tuple(SegmentEntry.from_dict(s, where) for s in segs),
            states={k: StateEntry.from_dict(k, v, where) for k, v in states.items()},
            tokens=tuple(TokenRecord.from_list(t, where) for t in tokens),
            token_logs=tuple(TokenLog.from_dict(t, where) for t in logs),
            late_columns=_late_columns(doc, where),
            group_index=(None if doc.get("group_index") is None
                         else GroupIndexEntry.from_dict(doc["group_index"], where)),
            commit_stats=parse_commit_stats(doc.get("commit_stats", {}), where),
            segment_table=(None if doc.get("segment_table") is None
                           else SegmentTableEntry.from_dict(doc["segment_table"], where)),
            holes=_holes(doc, where),
            patches=_patches(doc, where),
            media=_media(doc, where),
        )
        m.validate(where)
        return m

    def validate(self, where: str) -> None:
        for c in self.late_columns:
            if c.since_row > self.next_row or c.since_generation > self.generation:
                raise FormatError(f"Unsupported late column {c.spec.name!r} in {where}: added at row {c.since_row}, "
                                  f"generation {c.since_generation}, after this commit")
        if self.head > self.next_row:
            raise FormatError(f"Unsupported head {self.head} > next_row {self.next_row} in {where}")
        if self.holes and not (self.head < self.holes[0][0] and self.holes[-1][1] <= self.next_row):
            raise FormatError(f"Unsupported holes {[list(h) for h in self.holes]} in {where}; expected them "
                              f"within the live rows ({self.head}, {self.next_row}]")
        if isinstance(self.segments, SegmentTable):
            self._validate_table(where)
        else:
            self._validate_entries(where)
        if self.segments:
            first, last = self.segments[0], self.segments[-1]
            end = self.holes[-1][1] if self.holes and self.holes[-1][0] == last.end_row else last.end_row
            if end != self.next_row or first.first_row > self.head or first.end_row <= self.head:
                raise FormatError(f"segments in {where} cover rows [{first.first_row}, {last.end_row}) but live rows "
                                  f"are [{self.head}, {self.next_row})")
        elif self.head != self.next_row:
            raise FormatError(f"{where} has live rows [{self.head}, {self.next_row}) but no segments")
        for p in self.patches:
            if p.id >= self.next_segment or p.end_row > self.next_row:
                raise FormatError(f"patch {p.id} in {where} (rows up to {p.end_row}) is out of order: the manifest "
                                  f"ends at row {self.next_row}, segment id {self.next_segment}")
        if len({p.id for p in self.patches}) != len(self.patches):
            raise FormatError(f"a patch id appears twice in {where}")
        for e in self.media:
            if e.id >= self.next_segment or e.last_row >= self.next_row:
                raise FormatError(f"media blob {e.id} in {where} (named up to row {e.last_row}) is out of order: the "
                                  f"manifest ends at row {self.next_row}, segment id {self.next_segment}")
        if len({e.id for e in self.media}) != len(self.media) or len({e.hash for e in self.media}) != len(self.media):
            raise FormatError(f"a media blob id or hash appears twice in {where}")
        if self.group_index is not None and self.group_index.end_row > self.next_row:
            raise FormatError(f"the group_index of {where} covers rows up to {self.group_index.end_row}, beyond "
                              f"next_row {self.next_row}")

    def _validate_entries(self, where: str) -> None:
        """:meth:`validate`'s checks of the order of the segments: contiguous rows, ids below
        ``next_segment``, each id once."""
        prev_end, prev_id, ordered = None, -1, True
        holes = dict(self.holes)
        gaps = 0
        for s in self.segments:
            if prev_end is not None and s.first_row != prev_end:
                if holes.get(prev_end) != s.first_row:
                    raise FormatError(f"segment {s.id} in {where} starts at row {s.first_row}; expected "
                                      f"{prev_end} (segments must be contiguous but for the holes)")
                gaps += 1
            if s.id >= self.next_segment:
                raise FormatError(f"segment id {s.id} in {where} is out of order")
            # many writers reserve ids independently, so row order need not be id order
            ordered &= s.id > prev_id
            prev_end, prev_id = s.end_row, s.id
        if not ordered and len({s.id for s in self.segments}) != len(self.segments):
            raise FormatError(f"a segment id appears twice in {where}")
        self._check_holes_are_gaps(gaps, where)

    def _check_holes_are_gaps(self, gaps: int, where: str) -> None:
        """Each hole is a gap between two segments (``gaps`` of them were found) or the rows after
        the last one: no hole covers a segment's rows."""
        tail = bool(self.holes) and bool(self.segments) and self.holes[-1][0] == self.segments[-1].end_row
        if gaps + tail != len(self.holes):
            raise FormatError(f"Unsupported holes {[list(h) for h in self.holes]} in {where}; expected exactly the "
                              "row ranges between its segments and after the last one that no segment holds")

    def _validate_table(self, where: str) -> None:
        """The same checks as :meth:`_validate_entries`, over a table's columns."""
        t = self.segments
        ids, first, end = t.column("id"), t.column("first_row"), t.column("first_row") + t.column("num_rows")
        gap = np.flatnonzero(first[1:] != end[:-1])
        holes = dict(self.holes)
        for g in gap.tolist():
            i = g + 1
            if holes.get(int(end[i - 1])) != int(first[i]):
                raise FormatError(f"segment {int(ids[i])} in {where} starts at row {int(first[i])}; expected "
                                  f"{int(end[i - 1])} (segments must be contiguous but for the holes)")
        self._check_holes_are_gaps(int(gap.size), where)
        if len(t) and int(ids.max()) >= self.next_segment:
            raise FormatError(f"segment id {int(ids.max())} in {where} is out of order")
        if not t.ids_unique():
            raise FormatError(f"a segment id appears twice in {where}")

    def write(self, root: StorageLike) -> None:
        """Write this manifest whole into ``root`` (a directory or a Storage), atomically."""
        as_storage(root).replace(self.file, self.file_bytes(), step="manifest")


def past_holes(head: int, holes: Sequence[Tuple[int, int]]) -> Tuple[int, Tuple[Tuple[int, int], ...]]:
    """``head`` moved past a hole it lies in, and the holes above it: a hole never starts at or below
    ``head`` (the rows before the first segment are evicted rows, not a hole).

    >>> past_holes(5, ((2, 4), (5, 8), (10, 12)))
    (8, ((10, 12),))
    """
    for a, b in holes:
        if a <= head < b:
            head = b
    return head, tuple((a, b) for a, b in holes if a > head)


def live_patches(patches: Tuple[PatchEntry, ...], head: int) -> Tuple[PatchEntry, ...]:
    """The patches that still hold a live row's value (all rows below ``head`` are evicted).

    >>> [p.id for p in live_patches((PatchEntry(1, 0, 5, 2, 9, 0, ("r",)), PatchEntry(2, 3, 9, 2, 9, 0, ("r",))), 5)]
    [2]
    """
    if not patches or patches[0].end_row > head and all(p.end_row > head for p in patches):
        return patches
    return tuple(p for p in patches if p.end_row > head)


def evict(head: int, next_row: int, segments: Tuple[SegmentEntry, ...],
          options: StoreOptions, holes: Sequence[Tuple[int, int]] = ()
          ) -> Tuple[int, Tuple[SegmentEntry, ...], Tuple[Tuple[int, int], ...]]:
    """New head, live segments and holes after applying the row and byte capacities (a hole's rows
    count towards ``capacity_rows`` as the ids they had: FIFO goes by row id)."""
    if options.capacity_rows is not None:
        head = max(head, next_row - options.capacity_rows)
    table = isinstance(segments, SegmentTable)
    if options.capacity_bytes is not None:
        sizes = (segments.column("bytes") + segments.column("groups_bytes") if table
                 else np.array([s.bytes + s.groups_bytes for s in segments], dtype=np.int64))
        # drop the oldest while the rest exceed the capacity, never the last
        kept_after = sizes.sum() - np.concatenate([[0], np.cumsum(sizes)[:-1]])
        i = min(int(np.count_nonzero(kept_after > options.capacity_bytes)), max(len(segments) - 1, 0))
        if i:
            head = max(head, segments[i].first_row)
    head, holes = past_holes(head, holes)
    if segments and segments[0].end_row <= head:  # ordered by row: drop the evicted prefix
        if table:
            ends = segments.column("first_row") + segments.column("num_rows")
            segments = segments[int(np.searchsorted(ends, head, side="right")):]
        else:
            segments = tuple(s for s in segments if s.end_row > head)
    return head, segments, holes


def append_rows(base: Manifest, entries: Sequence[SegmentEntry], num_rows: int, token: Optional[TokenRecord],
                columns: Sequence[ColumnSpec], options: StoreOptions, media: Sequence[MediaEntry] = (),
                media_last: Sequence[Tuple[str, int]] = (), **changes: Any) -> Manifest:
    """``base`` plus an append of ``num_rows`` rows in ``entries`` (whose ``first_row`` must be
    ``base.next_row`` onwards), its token and the late columns it adds; capacities applied;
    ``changes`` of other fields made in the same copy.
    The one definition of what an append does, for a writer's commit and a reader's delta."""
    generation = base.generation + 1
    next_row = base.next_row + num_rows
    head, segments, holes = evict(base.head, next_row, base.segments + tuple(entries), options, base.holes)
    tokens = base.tokens
    if token is not None:
        tokens = tokens + (evolve(token, {"first_row": base.next_row, "generation": generation}),)
    late = base.late_columns
    if columns:  # the schema changes in the same commit as the rows that need it
        late = add_late_columns(late, columns, base.next_row, generation)
    named = add_media(base.media, media, media_last, base.next_row)
    return base.evolve(generation=generation, head=head, next_row=next_row,
                       next_segment=max([base.next_segment] + [e.id + 1 for e in entries] + [e.id + 1 for e in media]),
                       segments=segments, tokens=tokens, late_columns=late, holes=holes,
                       patches=live_patches(base.patches, head), media=live_media(named, head), **changes)


def _sum_stats(a: Mapping[str, int], b: Mapping[str, int]) -> Dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


@dataclass(frozen=True)
class AppendDelta:
    """A commit that only appends, stored as what it adds rather than as the whole manifest.

    Multi-writer stores (``append_deltas``) publish most appends this way: the
    file does not depend on the generation it lands on (its segments' rows are
    numbered from 0, the group sidecars hold segment-local rows), so a writer
    that loses the race for generation N creates the same file as N+1 (no
    re-planning), and a commit costs the same however large the store. The
    manifest of a delta's generation is ``apply(manifest of generation - 1)``;
    a full manifest follows within ``2 * CHECKPOINT_EVERY`` deltas.

    >>> d = AppendDelta((SegmentEntry(7, 0, 2, 100, 1),), 2)
    >>> m = d.apply(Manifest(generation=3, next_row=5, head=5, next_segment=7), StoreOptions())
    >>> m.generation, m.head, m.next_row, m.segments[0].first_row, m.depth
    (4, 5, 7, 5, 1)
    >>> import json
    >>> AppendDelta.from_doc(json.loads(signed_bytes(d.body())), "x") == d
    True
    """

    entries: Tuple[SegmentEntry, ...]  # ``first_row`` counts from the append's first row (0)
    num_rows: int
    token: Optional[TokenRecord] = None  # ``first_row`` and ``generation`` are filled in by ``apply``
    columns: Tuple[ColumnSpec, ...] = ()
    #: the writer's commit counters not yet in the store's (``COMMIT_STATS`` keys)
    commit_stats: Mapping[str, int] = field(default_factory=dict)
    #: media blobs it wrote, and per hash its rows name the last such row (counted from 0): see :func:`add_media`
    media: Tuple[MediaEntry, ...] = ()
    media_last: Tuple[Tuple[str, int], ...] = ()

    def body(self) -> dict:
        doc = {"format": DELTA_FORMAT, "version": FORMAT_VERSION, "num_rows": self.num_rows,
               "segments": [e.to_dict() for e in self.entries]}
        if self.media_last:
            doc.update(version=MEDIA_DELTA_VERSION, media=[e.to_dict() for e in self.media],
                       media_last=[[h, r] for h, r in self.media_last])
        if self.token is not None:
            doc["token"] = self.token.to_list()
        if self.columns:
            doc["late_columns"] = [c.to_dict() for c in self.columns]
        if self.commit_stats:
            doc["commit_stats"] = dict(sorted(self.commit_stats.items()))
        return doc

    @classmethod
    def from_doc(cls, doc: Any, where: str, verified: bool = False) -> "AppendDelta":
        doc = check_header(doc, DELTA_FORMAT, where, (FORMAT_VERSION, MEDIA_DELTA_VERSION))
        if not verified:
            check_signature(doc, where)
        segs, cols = doc.get("segments"), doc.get("late_columns", [])
        if not isinstance(segs, list) or not segs or not isinstance(cols, list):
            raise FormatError(f"Unsupported segments/late_columns in {where}; expected non-empty lists")
        # the fields straight into a new instance (a frozen dataclass's __init__ sets each through
        # object.__setattr__): every writer of a multi-writer store reads every other writer's deltas
        d = object.__new__(cls)
        d.__dict__.update(entries=tuple([SegmentEntry.from_dict(e, where) for e in segs]),
                          num_rows=int_field(doc, "num_rows", where, lo=1),
                          token=None if doc.get("token") is None else TokenRecord.from_list(doc["token"], where),
                          columns=tuple([ColumnSpec.from_dict(c) for c in cols]) if cols else (),
                          commit_stats=parse_commit_stats(doc.get("commit_stats", {}), where),
                          media=(), media_last=())
        if doc["version"] == MEDIA_DELTA_VERSION:
            d.__dict__.update(_delta_media(doc, d.num_rows, where))
        end = 0
        for e in d.entries:
            if e.first_row != end:
                raise FormatError(f"Unsupported segment {e.id} at row {e.first_row} of the append in {where}; "
                                  f"expected {end}")
            end = e.end_row
        if end != d.num_rows or (d.token is not None and d.token.num_rows != d.num_rows):
            raise FormatError(f"Unsupported append of {d.num_rows} rows in {where}: its segments hold {end}")
        for c in d.columns:
            why = late_column_problem(c)
            if why is not None:
                raise FormatError(f"Unsupported late column {c.name!r} in {where}: {why}")
        return d

    def apply(self, base: Manifest, options: StoreOptions) -> Manifest:
        """The manifest of the generation after ``base`` that this delta makes."""
        at = base.next_row
        entries = tuple([e.moved(at) for e in self.entries])
        return append_rows(base, entries, self.num_rows, self.token, self.columns, options, self.media,
                           self.media_last, depth=base.depth + 1,
                           commit_stats=_sum_stats(base.commit_stats, self.commit_stats))


def rewrite_rows(base: Manifest, replaced: Sequence[int], entries: Sequence[SegmentEntry],
                 options: StoreOptions, **changes: Any) -> Manifest:
    """``base`` with the consecutive segments of ids ``replaced`` replaced by ``entries``, which hold
    the same live rows (a merge, ``compact``); capacities applied; ``changes`` of other fields made
    in the same copy (as :func:`append_rows`). The one definition of what a
    rewrite does, for a writer's commit and a reader's rewrite delta. Raises
    ``CommitConflictError`` when ``base`` no longer holds those segments, or holds other rows.

    >>> base = Manifest(generation=4, next_row=6, next_segment=3,
    ...                 segments=(SegmentEntry(1, 0, 2, 99, 0), SegmentEntry(2, 2, 4, 99, 0)))
    >>> m = rewrite_rows(base, [1, 2], [SegmentEntry(3, 0, 6, 99, 0)], StoreOptions())
    >>> m.generation, [s.id for s in m.segments], m.next_segment
    (5, [3], 4)
    """
    if not replaced or not entries:
        raise CommitConflictError("nothing to rewrite")
    ids = [s.id for s in base.segments]
    try:
        start = ids.index(replaced[0])
    except ValueError:
        raise CommitConflictError(f"segment {replaced[0]} was merged or evicted by another commit") from None
    stop = start + len(replaced)
    if ids[start:stop] != list(replaced):
        raise CommitConflictError("the segments to rewrite changed in another commit")
    run = base.segments[start:stop]
    if any(a.end_row != b.first_row for a, b in zip(run, run[1:])):
        raise CommitConflictError(f"the segments {list(replaced)} to rewrite lie on both sides of a hole")
    first = entries[0].first_row
    # the same rows: back to back, ending where the run ends, starting where it starts (the oldest
    # segment: anywhere from there up to head, the rows below it being evicted)
    contiguous = all(a.end_row == b.first_row for a, b in zip(entries, entries[1:]))
    starts = first == run[0].first_row or (start == 0 and run[0].first_row <= first <= base.head)
    if not (contiguous and starts and entries[-1].end_row == run[-1].end_row):
        raise CommitConflictError(f"the rewrite of rows [{first}, {entries[-1].end_row}) does not hold the rows "
                                  f"[{run[0].first_row}, {run[-1].end_row}) of the segments it replaces")
    segments = base.segments[:start] + tuple(entries) + base.segments[stop:]
    head, segments, holes = evict(base.head, base.next_row, segments, options, base.holes)
    changes.setdefault("patches", base.patches)
    changes["patches"] = live_patches(changes["patches"], head)
    changes["media"] = live_media(changes.get("media", base.media), head)
    return base.evolve(generation=base.generation + 1, head=head, segments=segments, holes=holes,
                       next_segment=max([base.next_segment] + [e.id + 1 for e in entries]), **changes)


@dataclass(frozen=True)
class RewriteDelta:
    """A commit that only rewrites segments (a merge of small ones, ``compact``), stored as the ids
    it replaces and the entries that replace them (format v5 stores).

    Like an :class:`AppendDelta`, its file does not depend on the generation it
    lands on: a writer writes it with the merged segment, before the race, and a
    lost race costs a check that the replaced segments are still there and a link.
    The manifest of its generation is ``apply(manifest of generation - 1)``
    (:func:`rewrite_rows`); a writer links it only where that applies.

    >>> d = RewriteDelta((1, 2), (SegmentEntry(3, 0, 6, 99, 0),))
    >>> import json
    >>> RewriteDelta.from_doc(json.loads(signed_bytes(d.body())), "x") == d
    True
    """

    replaced: Tuple[int, ...]
    entries: Tuple[SegmentEntry, ...]  # global rows
    commit_stats: Mapping[str, int] = field(default_factory=dict)

    def body(self) -> dict:
        doc = {"format": DELTA_FORMAT, "version": REWRITE_DELTA_VERSION, "replaced": list(self.replaced),
               "segments": [e.to_dict() for e in self.entries]}
        if self.commit_stats:
            doc["commit_stats"] = dict(sorted(self.commit_stats.items()))
        return doc

    @classmethod
    def from_doc(cls, doc: Any, where: str, verified: bool = False) -> "RewriteDelta":
        doc = check_header(doc, DELTA_FORMAT, where, (REWRITE_DELTA_VERSION,))
        if not verified:
            check_signature(doc, where)
        replaced, segs = doc.get("replaced"), doc.get("segments")
        if (not isinstance(replaced, list) or not replaced
                or not all(type(i) is int and 0 <= i <= MAX_ID for i in replaced)
                or len(set(replaced)) != len(replaced) or not isinstance(segs, list) or not segs):
            raise FormatError(f"Unsupported replaced/segments in the rewrite delta {where}; expected non-empty "
                              "lists of distinct segment ids and of segments")
        return cls(tuple(replaced), tuple(SegmentEntry.from_dict(e, where) for e in segs),
                   parse_commit_stats(doc.get("commit_stats", {}), where))

    def apply(self, base: Manifest, options: StoreOptions) -> Manifest:
        """The manifest of the generation after ``base`` that this delta makes (``CommitConflictError``
        if ``base`` no longer holds the replaced segments)."""
        return rewrite_rows(base, self.replaced, self.entries, options, depth=base.depth + 1,
                            commit_stats=_sum_stats(base.commit_stats, self.commit_stats))


Delta = Union[AppendDelta, RewriteDelta]


def delta_from_doc(doc: Any, where: str, verified: bool = False) -> Delta:
    """The delta a ``diskreplay.delta`` document holds: a rewrite (it names what it ``replaced``)
    or an append."""
    if isinstance(doc, dict) and "replaced" in doc:
        return RewriteDelta.from_doc(doc, where, verified)
    return AppendDelta.from_doc(doc, where, verified)


def with_chains(manifests: Mapping[int, Manifest]) -> set:
    """The generations whose files reading each of ``manifests`` needs: each one and, for a
    delta, the generations back to the full manifest it applies to (clean-up keeps them all).

    >>> sorted(with_chains({9: Manifest(generation=9, depth=2), 4: Manifest(generation=4)}))
    [4, 7, 8, 9]
    """
    return {g for gen, m in manifests.items() for g in range(gen - m.depth, gen + 1)}


def _holes(doc: Mapping[str, Any], where: str) -> Tuple[Tuple[int, int], ...]:
    """A manifest's ``holes``: in version 3 only, non-empty, sorted, disjoint ``[start, stop)`` pairs."""
    raw = doc.get("holes")
    if doc["version"] not in (HOLES_MANIFEST_VERSION, PATCHES_MANIFEST_VERSION, MEDIA_MANIFEST_VERSION) or (
            raw is None and doc["version"] in (PATCHES_MANIFEST_VERSION, MEDIA_MANIFEST_VERSION)):
        if raw is not None:
            raise FormatError(f"Unsupported holes in {where} (version {doc['version']}); expected them only in "
                              f"version {HOLES_MANIFEST_VERSION}")
        return ()
    if not isinstance(raw, list) or not raw or len(raw) > 1 << 20 or not all(
            isinstance(p, list) and len(p) == 2 and all(type(v) is int and 0 <= v for v in p) and p[0] < p[1]
            for p in raw) or any(a[1] >= b[0] for a, b in zip(raw, raw[1:])):
        raise FormatError(f"Unsupported holes {raw!r:.200} in {where}; expected a non-empty list of sorted, "
                          "disjoint [start, stop) row ranges")
    return tuple((a, b) for a, b in raw)


def _late_columns(doc: Mapping[str, Any], where: str) -> Tuple[LateColumn, ...]:
    late = doc.get("late_columns")
    if doc["version"] in (HOLES_MANIFEST_VERSION, PATCHES_MANIFEST_VERSION, MEDIA_MANIFEST_VERSION) and late is None:
        return ()
    if doc["version"] == FORMAT_VERSION:
        if late is not None:
            raise FormatError(f"Unsupported late_columns in {where} (version {FORMAT_VERSION}); expected them "
                              f"only in version {LATE_COLUMNS_MANIFEST_VERSION}")
        return ()
    if not isinstance(late, list) or not late or len(late) > 4096:
        raise FormatError(f"Unsupported late_columns {late!r} in {where}; expected a non-empty list of columns")
    out = tuple(LateColumn.from_dict(c, where) for c in late)
    if len({c.spec.name for c in out}) != len(out):
        raise FormatError(f"Unsupported late_columns in {where}: a column appears twice")
    return out


def _patches(doc: Mapping[str, Any], where: str) -> Tuple[PatchEntry, ...]:
    """A manifest's ``patches``: in version 4 (and, where it has any, 5), a non-empty list of entries,
    oldest first."""
    return entry_list(doc, "patches", (PATCHES_MANIFEST_VERSION, MEDIA_MANIFEST_VERSION),
                      optional_in=(MEDIA_MANIFEST_VERSION,), limit=1 << 20, what="patches",
                      parse=PatchEntry.from_dict, where=where)

