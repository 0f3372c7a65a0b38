"""What a manifest lists: segment, state and group-index entries, token records and logs, late columns
(a token log's file is :mod:`.tokens`'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ..errors import CorruptStoreError, FormatError, SchemaError
from ..schema import ColumnSpec, Schema, late_column_problem, mime_problem
from .names import (GROUPS_DIR, MAX_ID, SEGMENT_DIR, check_state_name, group_index_file, groups_file, media_file, patch_file,
                    segment_file, state_file, token_log_file)
from .jsondoc import canonical_json, evolve, int_field


_SEGMENT_INT_FIELDS = ("id", "first_row", "num_rows", "bytes", "crc32c", "groups_bytes", "groups_crc32c")
_SEGMENT_INT_RANGES = ((0, 10 ** 12 - 1), (0, 1 << 62), (1, 1 << 62), (1, 1 << 62), (0, 0xFFFFFFFF),
                       (0, 1 << 62), (0, 0xFFFFFFFF))


@dataclass(frozen=True)
class SegmentEntry:
    """One committed segment: rows ``[first_row, first_row + num_rows)``.

    ``group`` (stores with ``inline_groups``): every row of the segment is in the group of this
    int64 key, and the segment has no sidecar file (``groups_bytes`` 0): its index is the key,
    the row count and the rows. A small commit of one prompt's completions is such a segment.

    >>> e = SegmentEntry(3, 10, 8, 4000, 1, group=42)
    >>> e.to_dict()["group"], "groups_file" in e.to_dict(), SegmentEntry.from_dict(e.to_dict(), "x") == e
    (42, False, True)
    """

    id: int
    first_row: int
    num_rows: int
    bytes: int
    crc32c: int
    groups_bytes: int = 0
    groups_crc32c: int = 0
    group: Optional[int] = None

    @property
    def file(self) -> str:
        return segment_file(self.id)

    @property
    def groups_file(self) -> str:
        return groups_file(self.id)

    @property
    def end_row(self) -> int:
        return self.first_row + self.num_rows

    def moved(self, by: int) -> "SegmentEntry":
        """This entry with ``first_row`` shifted by ``by`` rows (an append delta's entries count from 0)."""
        return evolve(self, {"first_row": self.first_row + by})

    def to_dict(self) -> dict:
        if self.group is not None:  # no sidecar file to name
            return {"id": self.id, "file": self.file, "first_row": self.first_row, "num_rows": self.num_rows,
                    "bytes": self.bytes, "crc32c": self.crc32c, "groups_bytes": 0, "groups_crc32c": 0,
                    "group": self.group}
        return {"id": self.id, "file": self.file, "first_row": self.first_row, "num_rows": self.num_rows,
                "bytes": self.bytes, "crc32c": self.crc32c, "groups_file": self.groups_file,
                "groups_bytes": self.groups_bytes, "groups_crc32c": self.groups_crc32c}

    def files(self) -> Tuple[str, ...]:
        """The files this entry names: its segment, and its sidecar if it has one (made once)."""
        got = self.__dict__.get("_files")
        if got is None:
            got = self.__dict__["_files"] = (self.file, self.groups_file) if self.groups_bytes else (self.file,)
        return got

    def json_bytes(self) -> bytes:
        """This entry's canonical JSON, made once (an entry never changes; a long manifest's file
        joins its entries' instead of serialising them all again at every commit)."""
        got = self.__dict__.get("_json")
        if got is None:
            got = self.__dict__["_json"] = canonical_json(self.to_dict())
        return got

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "SegmentEntry":
        if not isinstance(d, dict):
            raise FormatError(f"Unsupported segment entry {d!r} in {where}; expected an object")
        get = d.get
        i, first, n, nbytes, crc, gbytes, gcrc = values = (get("id"), get("first_row"), get("num_rows"),
                                                            get("bytes"), get("crc32c"), get("groups_bytes"),
                                                            get("groups_crc32c"))
        # one plain expression for the common, valid case: a manifest lists every segment, and a
        # generator over the fields cost more than the rest of opening a 640-segment store
        if not (type(i) is int and type(first) is int and type(n) is int and type(nbytes) is int
                and type(crc) is int and type(gbytes) is int and type(gcrc) is int
                and 0 <= i < 10 ** 12 and 0 <= first <= 1 << 62 and 1 <= n <= 1 << 62 and 1 <= nbytes <= 1 << 62
                and 0 <= crc <= 0xFFFFFFFF and 0 <= gbytes <= 1 << 62 and 0 <= gcrc <= 0xFFFFFFFF):
            for key, (lo, hi) in zip(_SEGMENT_INT_FIELDS, _SEGMENT_INT_RANGES):
                int_field(d, key, where, lo=lo, hi=hi)  # raises, naming the field
        # the checked fields straight into a new instance (a frozen dataclass's __init__ sets each
        # through object.__setattr__: half the cost of parsing an entry)
        e = object.__new__(cls)
        e.__dict__.update(zip(_SEGMENT_INT_FIELDS, values))
        group = get("group")
        e.__dict__["group"] = group
        if group is not None and (type(group) is not int or not -(1 << 63) <= group < 1 << 63 or gbytes or gcrc
                                  or "groups_file" in d):
            raise FormatError(f"Unsupported group={group!r} of segment {i} in {where}; expected an int64 key and "
                              "no groups_file, groups_bytes 0 and groups_crc32c 0 (the segment has no sidecar)")
        if n > 8 * nbytes:  # even a single bool column needs a bit per row
            raise FormatError(f"Unsupported num_rows={n} for a {nbytes}-byte segment in {where}")
        # names are written for readers of the JSON; they must be the ones the ids give (the id
        # formatted once for both)
        name = f"/{i:012d}.arrow"
        if d.get("file", SEGMENT_DIR + name) != SEGMENT_DIR + name \
                or d.get("groups_file", GROUPS_DIR + name) != GROUPS_DIR + name:
            for key, expect in (("file", e.file), ("groups_file", e.groups_file)):
                if d.get(key, expect) != expect:
                    raise FormatError(f"Unsupported {key} {d.get(key)!r} in {where}; expected {expect!r} "
                                      "(file names follow from segment ids)")
        return e


@dataclass(frozen=True)
class PatchEntry:
    """A committed patch: values of ``columns`` for ``num_rows`` committed rows, the lowest
    ``first_row`` and the highest ``end_row - 1`` (docs/FORMAT.md, "Patches"). Its file is an
    Arrow IPC file of one record batch: ``row`` (int64, ascending, each once), then one column
    per name in ``columns``, of the store's type for it.

    ``version`` (optional) names the values it holds, with ``meta`` (a small JSON object: which
    scorer, when): they stay readable under that name (``"rewards@judge-v2"``) after newer values
    are written. A rewrite that puts a named patch's values into segments keeps its entry as
    ``folded``: no longer read by default, still read by its version.

    >>> e = PatchEntry(9, 3, 40, 2, 800, 7, ("rewards",))
    >>> e.file, PatchEntry.from_dict(e.to_dict(), "m") == e
    ('segments/patch.000000000009.arrow', True)
    >>> v = PatchEntry(9, 3, 40, 2, 800, 7, ("rewards",), "judge-v2", {"scorer": "m:f"})
    >>> PatchEntry.from_dict(v.to_dict(), "m") == v, v.to_dict()["version"]
    (True, 'judge-v2')
    """

    id: int
    first_row: int
    end_row: int
    num_rows: int
    bytes: int
    crc32c: int
    columns: Tuple[str, ...]
    version: Optional[str] = None
    meta: Optional[Mapping[str, Any]] = None
    folded: bool = False

    def __hash__(self) -> int:  # (meta is a dict: an entry is hashed by what names its file)
        return hash((self.id, self.crc32c, self.bytes, self.folded))

    @property
    def file(self) -> str:
        return patch_file(self.id)

    def to_dict(self) -> dict:
        d = {"id": self.id, "file": self.file, "first_row": self.first_row, "end_row": self.end_row,
             "num_rows": self.num_rows, "bytes": self.bytes, "crc32c": self.crc32c, "columns": list(self.columns)}
        if self.version is not None:
            d["version"] = self.version
            if self.meta:
                d["meta"] = dict(self.meta)
        if self.folded:
            d["folded"] = True
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "PatchEntry":
        if not isinstance(d, dict):
            raise FormatError(f"Unsupported patch entry {d!r:.200} in {where}; expected an object")
        cols = d.get("columns")
        if (not isinstance(cols, list) or not cols or len(cols) > 4096
                or not all(isinstance(c, str) and c for c in cols) or len(set(cols)) != len(cols)):
            raise FormatError(f"Unsupported patch columns {cols!r:.200} in {where}; expected a non-empty list of "
                              "distinct column names")
        e = cls(int_field(d, "id", where, hi=MAX_ID), int_field(d, "first_row", where, hi=1 << 62),
                int_field(d, "end_row", where, lo=1, hi=1 << 62), int_field(d, "num_rows", where, lo=1, hi=1 << 62),
                int_field(d, "bytes", where, lo=1, hi=1 << 62), int_field(d, "crc32c", where, hi=0xFFFFFFFF),
                tuple(cols))
        if not e.first_row < e.end_row or e.num_rows > e.end_row - e.first_row:
            raise FormatError(f"Unsupported patch {e.id} in {where}: {e.num_rows} rows within "
                              f"[{e.first_row}, {e.end_row})")
        if d.get("file", e.file) != e.file:
            raise FormatError(f"Unsupported patch file {d.get('file')!r} in {where}; expected {e.file!r}")
        version, meta, folded = d.get("version"), d.get("meta"), d.get("folded", False)
        if version is not None and version_problem(version) or meta is not None and (
                version is None or not isinstance(meta, dict)) or folded not in (True, False) or (
                folded and version is None):
            raise FormatError(f"Unsupported version={version!r} / meta={meta!r:.80} / folded={folded!r} of patch {e.id} "
                              f"in {where}; expected a version name, an object of meta with it, and folded only "
                              "for a named patch")
        if version is not None:
            e = evolve(e, {"version": version, "meta": meta, "folded": bool(folded)})
        return e


_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class MediaEntry:
    """A committed media blob (docs/FORMAT.md, "Media"): the bytes of content ``hash`` (64 hex
    digits, SHA-256 of its descriptor and bytes) in ``segments/media.<id>.bin``, ``bytes`` long
    with CRC-32C ``crc32c``; ``last_row`` is the newest row that names it (eviction drops the entry
    once it is below ``head``). ``mime`` says what the bytes are; an array (``application/x-array``)
    also has its numpy ``dtype`` string and ``shape``.

    >>> e = MediaEntry("ab" * 32, 4, 10, 7, 99, "image/png")
    >>> e.file, MediaEntry.from_dict(e.to_dict(), "m") == e
    ('segments/media.000000000004.bin', True)
    """

    hash: str
    id: int
    bytes: int
    crc32c: int
    last_row: int
    mime: str
    dtype: Optional[str] = None
    shape: Optional[Tuple[int, ...]] = None

    @property
    def file(self) -> str:
        return media_file(self.id)

    @property
    def descriptor(self) -> dict:
        """What the content hash covers besides the bytes."""
        d: Dict[str, Any] = {"mime": self.mime}
        if self.dtype is not None:
            d.update(dtype=self.dtype, shape=list(self.shape or ()))
        return d

    def to_dict(self) -> dict:
        d = {"hash": self.hash, "id": self.id, "file": self.file, "bytes": self.bytes, "crc32c": self.crc32c,
             "last_row": self.last_row, "mime": self.mime}
        if self.dtype is not None:
            d.update(dtype=self.dtype, shape=list(self.shape or ()))
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "MediaEntry":
        if not isinstance(d, dict):
            raise FormatError(f"Unsupported media entry {d!r:.200} in {where}; expected an object")
        h, mime, dtype, shape = d.get("hash"), d.get("mime"), d.get("dtype"), d.get("shape")
        if not isinstance(h, str) or len(h) != 64 or not set(h) <= _HEX:
            raise FormatError(f"Unsupported media hash {h!r:.80} in {where}; expected 64 lowercase hex digits")
        if mime_problem(mime) is not None:
            raise FormatError(f"Unsupported media type {mime!r:.80} in {where}; expected one like 'image/png'")
        if (dtype is None) is not (shape is None) or dtype is not None and (
                not isinstance(dtype, str) or not 2 <= len(dtype) <= 8 or not isinstance(shape, list)
                or len(shape) > 8 or not all(type(x) is int and 0 <= x < 1 << 40 for x in shape)):
            raise FormatError(f"Unsupported media dtype/shape {dtype!r:.20}/{shape!r:.80} in {where}; expected "
                              "both or neither, a numpy dtype string and a list of at most 8 sizes")
        e = cls(h, int_field(d, "id", where, hi=MAX_ID), int_field(d, "bytes", where, hi=1 << 62),
                int_field(d, "crc32c", where, hi=0xFFFFFFFF), int_field(d, "last_row", where, hi=1 << 62), mime,
                dtype, None if shape is None else tuple(shape))
        if d.get("file", e.file) != e.file:
            raise FormatError(f"Unsupported media file {d.get('file')!r} in {where}; expected {e.file!r}")
        return e


MAX_VERSION_CHARS = 64


def version_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot name a version of a column's values, or None.

    >>> version_problem("judge-v2") is None, version_problem("a@b")
    (True, "a version name has 1 to 64 letters, digits, '_', '.', '-' or ':', got 'a@b'")
    """
    if isinstance(name, str) and 0 < len(name) <= MAX_VERSION_CHARS and all(
            c.isalnum() or c in "_.-:" for c in name):
        return None
    return f"a version name has 1 to {MAX_VERSION_CHARS} letters, digits, '_', '.', '-' or ':', got {name!r:.80}"


@dataclass(frozen=True)
class StateEntry:
    """A saved sampler/loader state file."""

    name: str
    generation: int
    bytes: int
    crc32c: int

    @property
    def file(self) -> str:
        return state_file(self.name, self.generation)

    def to_dict(self) -> dict:
        return {"file": self.file, "generation": self.generation, "bytes": self.bytes, "crc32c": self.crc32c}

    @classmethod
    def from_dict(cls, name: str, d: Any, where: str) -> "StateEntry":
        if not isinstance(d, dict):
            raise FormatError(f"Unsupported state entry {d!r} in {where}; expected an object")
        try:
            check_state_name(name)
        except ValueError as exc:
            raise FormatError(f"Unsupported state in {where}: {exc}") from None
        e = cls(name, int_field(d, "generation", where, lo=1), int_field(d, "bytes", where, lo=1),
                int_field(d, "crc32c", where, hi=0xFFFFFFFF))
        if d.get("file", e.file) != e.file:
            raise FormatError(f"Unsupported state file {d.get('file')!r} in {where}; expected {e.file!r}")
        return e


@dataclass(frozen=True)
class GroupIndexEntry:
    """A persisted group index: the groups of rows ``[first_row, end_row)`` in one file
    (written by the commit of ``generation``; see docs/FORMAT.md, "Group index").

    ``frame`` is ``(body_start, body_end, crc32c)`` of a layout-2 file: the CRC-32C of its bytes outside
    ``[body_start, body_end)`` (Arrow's schema, batch header and footer, which carry each column's own
    CRC-32C), so a reader checks a few KB before parsing and each column before using it, instead of
    the whole file. ``None``: a layout-1 file, checked whole against ``crc32c``.

    >>> e = GroupIndexEntry(7, 0, 64, 900, 1, frame=(640, 840, 2))
    >>> GroupIndexEntry.from_dict(e.to_dict(), "m") == e, e.to_dict()["frame"]
    (True, [640, 840, 2])
    """

    generation: int
    first_row: int
    end_row: int
    bytes: int
    crc32c: int
    frame: Optional[Tuple[int, int, int]] = None

    @property
    def file(self) -> str:
        return group_index_file(self.generation)

    def to_dict(self) -> dict:
        d = {"file": self.file, "generation": self.generation, "first_row": self.first_row,
             "end_row": self.end_row, "bytes": self.bytes, "crc32c": self.crc32c}
        if self.frame is not None:
            d["frame"] = list(self.frame)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "GroupIndexEntry":
        if not isinstance(d, dict):
            raise FormatError(f"Unsupported group_index {d!r} in {where}; expected an object")
        frame = d.get("frame")
        if frame is not None:
            ok = (isinstance(frame, list) and len(frame) == 3
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in frame))
            if (not ok or not 0 <= frame[0] <= frame[1] <= int_field(d, "bytes", where)
                    or not 0 <= frame[2] <= 0xFFFFFFFF):
                raise FormatError(f"Unsupported group_index frame {frame!r} in {where}; expected [body_start, "
                                  "body_end, crc32c] within the file")
            frame = tuple(frame)
        e = cls(int_field(d, "generation", where, lo=1, hi=MAX_ID), int_field(d, "first_row", where),
                int_field(d, "end_row", where), int_field(d, "bytes", where, lo=1),
                int_field(d, "crc32c", where, hi=0xFFFFFFFF), frame)
        if e.end_row < e.first_row:
            raise FormatError(f"Unsupported group_index rows [{e.first_row}, {e.end_row}) in {where}")
        if d.get("file", e.file) != e.file:
            raise FormatError(f"Unsupported group_index file {d.get('file')!r} in {where}; expected {e.file!r}")
        return e


MAX_TOKEN_CHARS = 1024


@dataclass(frozen=True)
class TokenRecord:
    """An exactly-once token of a committed ``extend``: the rows it got and what the batch was.

    ``digest`` fingerprints the batch's encoded rows, so a token reused for a
    different batch is told apart from a retry of the same one.
    """

    token: str
    first_row: int
    num_rows: int
    digest: int
    generation: int

    @property
    def end_row(self) -> int:
        return self.first_row + self.num_rows

    def to_list(self) -> list:
        return [self.token, self.first_row, self.num_rows, self.digest, self.generation]

    @classmethod
    def from_list(cls, d: Any, where: str) -> "TokenRecord":
        if (not isinstance(d, list) or len(d) != 5 or not isinstance(d[0], str) or not d[0]
                or len(d[0]) > MAX_TOKEN_CHARS):
            raise FormatError(f"Unsupported token record {d!r} in {where}; expected [token, first_row, num_rows, "
                              "digest, generation]")
        _, first, n, dig, gen = d
        # the valid case in one expression: a full manifest holds up to 256 records, and the checks
        # field by field were a tenth of reading one
        if (type(first) is int and type(n) is int and type(dig) is int and type(gen) is int
                and 0 <= first <= 1 << 62 and 1 <= n <= 1 << 62 and 0 <= dig < 1 << 63 and 1 <= gen <= MAX_ID):
            return cls(d[0], first, n, dig, gen)
        doc = dict(zip(("first_row", "num_rows", "digest", "generation"), d[1:]))
        return cls(d[0], int_field(doc, "first_row", where), int_field(doc, "num_rows", where, lo=1),
                   int_field(doc, "digest", where, hi=(1 << 63) - 1),
                   int_field(doc, "generation", where, lo=1, hi=MAX_ID))


@dataclass(frozen=True)
class TokenLog:
    """A sealed, immutable file of token records (``tokens/<id>.json``), so that the
    manifest, rewritten by every commit, holds only the newest few records inline."""

    id: int
    bytes: int
    crc32c: int
    count: int
    last_generation: int
    end_row: int

    @property
    def file(self) -> str:
        return token_log_file(self.id)

    def to_dict(self) -> dict:
        return {"id": self.id, "file": self.file, "bytes": self.bytes, "crc32c": self.crc32c, "count": self.count,
                "last_generation": self.last_generation, "end_row": self.end_row}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "TokenLog":
        if not isinstance(d, dict):
            raise FormatError(f"Unsupported token log entry {d!r} in {where}; expected an object")
        get = d.get
        i, nbytes, crc, count, last, end = values = (get("id"), get("bytes"), get("crc32c"), get("count"),
                                                     get("last_generation"), get("end_row"))
        # the valid case in one expression, straight into a new instance (as SegmentEntry.from_dict):
        # a full manifest lists up to 32 logs, and every writer reads every other writer's checkpoints
        if (type(i) is int and type(nbytes) is int and type(crc) is int and type(count) is int
                and type(last) is int and type(end) is int and 0 <= i <= MAX_ID and 1 <= nbytes <= 1 << 62
                and 0 <= crc <= 0xFFFFFFFF and 1 <= count <= 1 << 62 and 1 <= last <= MAX_ID
                and 0 <= end <= 1 << 62):
            e = object.__new__(cls)
            e.__dict__.update(zip(_TOKEN_LOG_FIELDS, values))
        else:
            e = cls(int_field(d, "id", where, hi=MAX_ID), int_field(d, "bytes", where, lo=1),
                    int_field(d, "crc32c", where, hi=0xFFFFFFFF), int_field(d, "count", where, lo=1),
                    int_field(d, "last_generation", where, lo=1, hi=MAX_ID), int_field(d, "end_row", where))
        if d.get("file", e.file) != e.file:
            raise FormatError(f"Unsupported token log file {d.get('file')!r} in {where}; expected {e.file!r}")
        return e


_TOKEN_LOG_FIELDS = ("id", "bytes", "crc32c", "count", "last_generation", "end_row")


#: what ``commit_stats`` counts: commits, lost races (each one retried), and milliseconds from
#: a commit's start to its publishing, of which spent on lost races (back-off, re-read, re-plan)
COMMIT_STATS = ("commits", "conflicts", "commit_ms", "retry_ms")


_COMMIT_STATS = frozenset(COMMIT_STATS)


def parse_commit_stats(d: Any, where: str) -> Dict[str, int]:
    if type(d) is dict:  # the common case in one pass (every delta holds a few counters)
        for k, v in d.items():
            if k not in _COMMIT_STATS or type(v) is not int or not 0 <= v <= 1 << 62:
                break
        else:
            return dict(d)
    if not isinstance(d, dict) or set(d) - set(COMMIT_STATS):
        raise FormatError(f"Unsupported commit_stats {d!r} in {where}; expected an object with keys {COMMIT_STATS}")
    return {k: int_field(d, k, where) for k in COMMIT_STATS if k in d}


@dataclass(frozen=True)
class LateColumn:
    """A column added after the store's first commit: its type, the first row that can
    hold it (``since_row``: the ``next_row`` of the commit's base) and the commit that
    added it (``since_generation``). Rows before it read as "not computed".

    >>> c = LateColumn(ColumnSpec("sampling_per_token_logps", "ragged", "float32"), 64, 3)
    >>> LateColumn.from_dict(c.to_dict(), "m") == c
    True
    """

    spec: ColumnSpec
    since_row: int
    since_generation: int

    def to_dict(self) -> dict:
        return {**self.spec.to_dict(), "since_row": self.since_row, "since_generation": self.since_generation}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "LateColumn":
        if not isinstance(d, dict):
            raise FormatError(f"Unsupported late column {d!r} in {where}; expected an object")
        spec = ColumnSpec.from_dict({k: v for k, v in d.items() if k not in ("since_row", "since_generation")})
        why = late_column_problem(spec)
        if why is not None:
            raise FormatError(f"Unsupported late column {spec.name!r} in {where}: {why}")
        return cls(spec, int_field(d, "since_row", where), int_field(d, "since_generation", where, lo=1, hi=MAX_ID))


def store_schema(initial: Optional[Schema], late: Sequence[LateColumn],
                 where: str = "the manifest") -> Optional[Schema]:
    """The schema a store has at one commit: the columns of its first commit (``FORMAT.json`` /
    ``SCHEMA.json``), then the manifest's late columns in the order they were added.

    >>> first = Schema([ColumnSpec("prompt_id", "scalar", "int64")])
    >>> store_schema(first, [LateColumn(ColumnSpec("x", "scalar", "float32"), 10, 2)]).late
    {'x': (10, 2)}
    """
    if not late:
        return initial
    if initial is None:
        raise CorruptStoreError(f"{where} records late columns but the store has no schema")
    clash = [c.spec.name for c in late if c.spec.name in initial]
    if clash:
        raise FormatError(f"Unsupported late column {clash[0]!r} in {where}: the store's first commit has it")
    return initial.with_late([c.spec for c in late], [(c.since_row, c.since_generation) for c in late])


def add_late_columns(late: Tuple[LateColumn, ...], specs: Sequence[ColumnSpec], since_row: int,
                     generation: int) -> Tuple[LateColumn, ...]:
    """``late`` plus those of ``specs`` it lacks (from ``since_row``, added by ``generation``).

    A column another commit already added with the same type is kept as it
    was; with another type it is a ``SchemaError`` (a column's type never
    changes), which is what the later of two writers adding it gets.

    >>> spec = ColumnSpec("sampling_per_token_logps", "ragged", "float32")
    >>> late = add_late_columns((), [spec], 64, 3)
    >>> add_late_columns(late, [spec], 80, 4) == late
    True
    """
    have = {c.spec.name: c for c in late}
    out = list(late)
    for spec in specs:
        old = have.get(spec.name)
        if old is None:
            have[spec.name] = LateColumn(spec, since_row, generation)
            out.append(have[spec.name])
        elif old.spec != spec:
            raise SchemaError(f"column {spec.name!r} was added to the store as {old.spec.to_dict()} (generation "
                              f"{old.since_generation}) while this commit adds it as {spec.to_dict()}; a column's "
                              "type never changes: give it the stored type or use another name")
    return tuple(out)
