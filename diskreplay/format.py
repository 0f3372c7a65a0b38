"""On-disk format v1: file names, ``FORMAT.json`` and the manifests.

``docs/FORMAT.md`` is the specification; this module is its executable form.
Every JSON document carries ``format`` and an integer ``version`` and is
parsed into a frozen dataclass; anything unexpected raises ``FormatError``
("Unsupported …; expected …") or ``CorruptStoreError`` naming the file.
File names are never taken from a manifest: they are derived from integer ids,
so no manifest can point outside the store directory.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ._fileio import TMP_PREFIX, crc32c, durable_write, read_file
from .errors import ArgumentError, CommitConflictError, CorruptStoreError, FormatError, SchemaError
from .schema import ColumnSpec, Schema, late_column_problem

FORMAT_FILE = "FORMAT.json"
# A multi-writer store's schema: created once, if absent, by the first extend
# of any writer, so that concurrent first appends cannot disagree on it.
SCHEMA_FILE = "SCHEMA.json"
SCHEMA_FORMAT = "diskreplay.schema"
# The collection floor of a store whose manifests are created only if absent (many writers, object
# storage): every generation below it may have been collected, none at or above it ever was
# (docs/FORMAT.md, "The collection floor").
FLOOR_FILE = "FLOOR.json"
FLOOR_FORMAT = "diskreplay.floor"
LOCK_FILE = "LOCK"
MANIFEST_DIR = "manifests"
SEGMENT_DIR = "segments"
GROUPS_DIR = "groups"
STATE_DIR = "state"
TOKENS_DIR = "tokens"
DATA_DIRS = (MANIFEST_DIR, SEGMENT_DIR, GROUPS_DIR, STATE_DIR, TOKENS_DIR)
#: where repair (and a writer opening a store without any manifest) moves files instead of deleting them
QUARANTINE_DIR = "quarantine"
#: in QUARANTINE_DIR: files a sweep of a store without manifests could not judge yet (not quarantined)
QUARANTINE_PENDING = "pending.json"


def is_data_file(rel: str) -> bool:
    """A file of a data directory other than ``manifests/``, not a temporary one: what may hold rows
    (or their index, a state) that only a manifest says are committed.

    >>> is_data_file("segments/000000000001.arrow"), is_data_file("manifests/000000000001.json")
    (True, False)
    >>> is_data_file("groups/.tmp-x"), is_data_file("FORMAT.json")
    (False, False)
    """
    d, _, name = rel.partition("/")
    return bool(name) and d in DATA_DIRS and d != MANIFEST_DIR and not name.startswith(TMP_PREFIX)

#: the names a store gives its files in its data directories (and their temporary names)
_STORE_FILE_NAME = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\.|index-)?\d{12}\.(?:arrow|json)$")


def is_store_entry(rel: str) -> bool:
    """Whether ``rel`` (a path in a store's directory or prefix) may be one of a store's own entries:
    its directories, FORMAT.json, SCHEMA.json, LOCK, a file its data directories name as a store
    does, a temporary file; anything in ``quarantine/``. Creating a store refuses a place holding
    anything else (a mistyped path to a run's directory or bucket prefix).

    >>> is_store_entry("segments/000000000001.arrow"), is_store_entry("segments/checkpoint-1.bin")
    (True, False)
    >>> is_store_entry("notes.txt"), is_store_entry("state/sampler.000000000003.arrow")
    (False, True)
    """
    d, sep, name = rel.partition("/")
    if not sep:
        return (d in (*DATA_DIRS, QUARANTINE_DIR, FORMAT_FILE, SCHEMA_FILE, FLOOR_FILE, LOCK_FILE)
                or d.startswith((TMP_PREFIX, ".probe-")))  # (an object store's probes of its server)
    if d == QUARANTINE_DIR:
        return True
    return d in DATA_DIRS and "/" not in name and (name.startswith(".") or bool(_STORE_FILE_NAME.match(name)))


STORE_FORMAT = "diskreplay"
MANIFEST_FORMAT = "diskreplay.manifest"
TOKENS_FORMAT = "diskreplay.tokens"
FORMAT_VERSION = 1
# FORMAT.json of a store that may hold late columns says version 3 and
# "late_columns": true, written before the first commit that adds one: a
# diskreplay without late columns would take that commit's manifest (v2) for a
# damaged one, fall back to an older commit and, as a writer, collect the newer
# ones. With version 3 it refuses the store instead ("Unsupported version 3").
LATE_COLUMNS_FORMAT_VERSION = 3
# A manifest that records late columns says version 2, so that a diskreplay
# that does not know them refuses the commit ("Unsupported version 2") instead
# of taking its segments for damaged ones; manifests without them stay v1.
LATE_COLUMNS_MANIFEST_VERSION = 2
# FORMAT.json of a multi-writer store says version 2, so that a diskreplay that
# knows only single-writer stores refuses it instead of taking a lock the other
# writers never see and sweeping their in-flight files as garbage.
MULTI_WRITER_VERSION = 2
# FORMAT.json of a multi-writer store whose appends commit as deltas (see
# AppendDelta) says version 4 and "append_deltas": true: a diskreplay without
# them would take a delta for a damaged manifest, fall back to an older commit
# and, as a writer, collect the newer ones. Stores created multi-writer get it.
APPEND_DELTAS_VERSION = 4
# FORMAT.json of a multi-writer store whose small one-group segments may have
# no sidecar file (the manifest's segment entry carries the group's key, see
# SegmentEntry.group) says version 5 and "inline_groups": true: a diskreplay
# without them would find no sidecar for such a segment. Stores created
# multi-writer get it; stores of version 4 keep writing sidecars.
INLINE_GROUPS_VERSION = 5
DELTA_FORMAT = "diskreplay.delta"
# A delta that rewrites segments (a merge, compact) says version 2 (format v5
# stores): a diskreplay that knows only append deltas refuses it by its version.
REWRITE_DELTA_VERSION = 2
# A writer commits a full manifest instead of a delta once its base is
# CHECKPOINT_EVERY to 2 CHECKPOINT_EVERY - 1 deltas (its own depth, drawn at
# random) past a full one, so a reader applies at most 2 CHECKPOINT_EVERY - 1.
CHECKPOINT_EVERY = 8
MAX_DELTA_CHAIN = 1024  # a reader refuses a longer chain (a writer never makes one)
# A multi-writer store keeps the files of a superseded manifest this long, so
# that a pinned reader (snapshot, verify, export) and a slow writer finish.
DEFAULT_RETAIN_SECONDS = 3600
# Manifests kept besides the newest: a damaged newest manifest falls back to
# one of these, and a reader that loaded one of them can still open its files.
KEEP_MANIFESTS = 4
MAX_RELISTS = 1000  # listings of manifests/ a reader tries before giving up
FORWARD_READS = 64  # new generations read one after the other (read_forward) before probing for the newest
MAX_JSON_BYTES = 64 << 20
_MANIFEST_NAME = re.compile(r"^(\d{12})\.json$")
_STATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_MAX_ID = 10 ** 12 - 1


def segment_file(seg_id: int) -> str:
    return f"{SEGMENT_DIR}/{seg_id:012d}.arrow"


def groups_file(seg_id: int) -> str:
    return f"{GROUPS_DIR}/{seg_id:012d}.arrow"


def group_index_file(generation: int) -> str:
    return f"{GROUPS_DIR}/index-{generation:012d}.arrow"


def manifest_file(generation: int) -> str:
    return f"{MANIFEST_DIR}/{generation:012d}.json"


def token_log_file(log_id: int) -> str:
    return f"{TOKENS_DIR}/{log_id:012d}.json"


def state_file(name: str, generation: int) -> str:
    return f"{STATE_DIR}/{name}.{generation:012d}.arrow"


def check_state_name(name: str) -> str:
    if not isinstance(name, str) or not _STATE_NAME.match(name):
        raise ArgumentError(f"state name must be 1-64 letters, digits, '_', '.' or '-' (not starting with "
                         f"'.' or '-'), got {name!r}")
    return name


def _int(doc: Mapping[str, Any], key: str, where: str, *, lo: int = 0, hi: int = 1 << 62,
         optional: bool = False) -> Optional[int]:
    v = doc.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FormatError(f"Unsupported {key}={v!r} in {where}; expected an integer in [{lo}, {hi}]")
    return v


def _evolve(obj: Any, changes: Mapping[str, Any]) -> Any:
    """``dataclasses.replace`` for the frozen records of this module (no ``__post_init__``, no
    ``InitVar``): a copy of the instance dict. ``replace`` re-runs ``__init__`` and costs ~10x
    more; a multi-writer commit makes a dozen such copies (each delta it applies shifts its
    segment entries and evolves the manifest), measured at 5% of a small commit's CPU."""
    names = _FIELDS.get(type(obj))
    if names is None:
        names = _FIELDS[type(obj)] = frozenset(f.name for f in fields(obj))
    if not names.issuperset(changes):
        raise ArgumentError(f"{type(obj).__name__} has no field(s) {sorted(set(changes) - names)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


_FIELDS: Dict[type, frozenset] = {}


def _check_header(doc: Any, fmt: str, where: str, versions: Tuple[int, ...] = (FORMAT_VERSION,)
                  ) -> Mapping[str, Any]:
    if not isinstance(doc, dict):
        raise FormatError(f"Unsupported {where}: a JSON {type(doc).__name__}; expected an object")
    if doc.get("format") != fmt:
        raise FormatError(f"Unsupported format {doc.get('format')!r} in {where}; expected {fmt!r}")
    if doc.get("version") not in versions:
        if len(versions) == 1:
            known = str(versions[0])
        elif list(versions) == list(range(min(versions), max(versions) + 1)):
            known = f"{min(versions)} to {max(versions)}"
        else:
            known = ", ".join(map(str, versions[:-1])) + f" or {versions[-1]}"
        raise FormatError(f"Unsupported version {doc.get('version')!r} in {where}; this diskreplay reads "
                          f"version {known} only (a newer diskreplay wrote it? upgrade to read it)")
    return doc


def _parse_json(raw: bytes, path: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also 4300+ digit ints
        raise CorruptStoreError(f"{path} is not valid JSON ({type(exc).__name__}: {exc})") from None


def read_json(path: str) -> Any:
    """Parse a small JSON file, turning every failure into CorruptStoreError."""
    return _parse_json(read_file(path, MAX_JSON_BYTES), path)


def read_signed_json(path: str) -> Tuple[Any, bool]:
    """A signed JSON file and whether its bytes already proved its checksum (see ``signed_bytes``)."""
    raw = read_file(path, MAX_JSON_BYTES)
    return _parse_json(raw, path), _signature_in_bytes(raw)


def _signed(body: dict) -> dict:
    """``body`` plus a ``checksum``: CRC-32C of its canonical JSON."""
    return {**body, "checksum": crc32c(_dumps(body))}


def signed_bytes(body: dict) -> bytes:
    """The file form of a signed document: its canonical JSON with ``"checksum"`` appended last.

    The checksum is the CRC-32C of the canonical JSON of ``body`` (sorted keys,
    no spaces), which is exactly the file's bytes before ``,"checksum":`` plus
    the closing brace, so a reader verifies it without serialising again.
    """
    text = _dumps(body)
    return text[:-1] + b',"checksum":%d}' % crc32c(text)


def _signature_in_bytes(raw: bytes) -> bool:
    i = raw.rfind(b',"checksum":')
    if i < 0 or not raw.endswith(b"}"):
        return False
    try:
        value = int(raw[i + 12:-1])
    except ValueError:
        return False
    return crc32c(raw[:i] + b"}") == value


def _check_signature(doc: Mapping[str, Any], where: str) -> None:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    if doc.get("checksum") != crc32c(_dumps(body)):
        raise CorruptStoreError(f"{where} fails its checksum; the file is damaged")


@dataclass(frozen=True)
class StoreOptions:
    """The contents of ``FORMAT.json``: what a store is, fixed at creation.

    >>> StoreOptions(group_key="prompt_id", capacity_rows=1000).to_dict()["format"]
    'diskreplay'
    """

    group_key: Optional[str] = "prompt_id"
    capacity_rows: Optional[int] = None
    capacity_bytes: Optional[int] = None
    schema: Optional[Schema] = None
    multi_writer: bool = False
    retain_seconds: Optional[int] = None
    #: the store may hold columns added after its first commit (the manifests record them)
    late_columns: bool = False
    #: multi-writer: appends commit as deltas (:class:`AppendDelta`), group sidecars hold segment-local rows
    append_deltas: bool = False
    #: a small segment of one integer group may have no sidecar: its entry names the key (``SegmentEntry.group``)
    inline_groups: bool = False

    def to_dict(self) -> dict:
        return _signed(self.body())

    def body(self) -> dict:
        doc = {
            "format": STORE_FORMAT,
            "version": FORMAT_VERSION,
            "group_key": self.group_key,
            "capacity_rows": self.capacity_rows,
            "capacity_bytes": self.capacity_bytes,
            "schema": None if self.schema is None else self.schema.to_list(),
        }
        # single-writer stores keep writing exactly the v1 document they always did
        if self.multi_writer:
            doc.update(version=MULTI_WRITER_VERSION, multi_writer=True)
        elif self.inline_groups:  # converted from many writers: its entries may still name inline groups
            doc.update(multi_writer=False, append_deltas=False)
        if self.retain_seconds is not None:
            doc["retain_seconds"] = self.retain_seconds
        if self.late_columns:
            doc.update(version=LATE_COLUMNS_FORMAT_VERSION, late_columns=True)
        if self.append_deltas:
            doc.update(version=APPEND_DELTAS_VERSION, append_deltas=True)
        if self.inline_groups:
            doc.update(version=INLINE_GROUPS_VERSION, inline_groups=True)
        return doc

    @classmethod
    def from_dict(cls, doc: Any, where: str = FORMAT_FILE, verified: bool = False) -> "StoreOptions":
        doc = _check_header(doc, STORE_FORMAT, where, (FORMAT_VERSION, MULTI_WRITER_VERSION,
                                                        LATE_COLUMNS_FORMAT_VERSION, APPEND_DELTAS_VERSION,
                                                        INLINE_GROUPS_VERSION))
        if not verified:
            _check_signature(doc, where)
        multi, late, deltas, inline = _format_features(doc, where)
        gk = doc.get("group_key")
        if gk is not None and (not isinstance(gk, str) or not gk):
            raise FormatError(f"Unsupported group_key {gk!r} in {where}; expected a column name or null")
        schema = doc.get("schema")
        return cls(
            group_key=gk,
            capacity_rows=_int(doc, "capacity_rows", where, lo=1, optional=True),
            capacity_bytes=_int(doc, "capacity_bytes", where, lo=1, optional=True),
            schema=None if schema is None else Schema.from_list(schema),
            multi_writer=multi,
            retain_seconds=_int(doc, "retain_seconds", where, optional=True, hi=10 ** 9),
            late_columns=late,
            append_deltas=deltas,
            inline_groups=inline,
        )

    def write(self, root: Any) -> None:
        """Write ``FORMAT.json`` into ``root``: a directory or a :class:`~diskreplay.storage.Storage`."""
        root = _dir(root)
        if _is_storage(root):
            root.replace(FORMAT_FILE, signed_bytes(self.body()), step="format")
            return
        durable_write(os.path.join(root, FORMAT_FILE), signed_bytes(self.body()), step="format")

    @classmethod
    def read(cls, root: Any) -> "StoreOptions":
        root = _dir(root)
        path = _where(root, FORMAT_FILE)
        try:
            doc, verified = _read_signed(root, FORMAT_FILE)
            options = cls.from_dict(doc, path, verified)
        except FormatError as exc:
            raise (exc if path in str(exc) else FormatError(f"{exc} ({path})")) from None
        if options.multi_writer and options.schema is None:
            schema = read_shared_schema(root)
            if schema is not None:
                options = replace(options, schema=schema)
        return options


def _format_features(doc: Mapping[str, Any], where: str) -> Tuple[bool, bool, bool, bool]:
    """``(multi_writer, late_columns, append_deltas, inline_groups)`` of a FORMAT.json document,
    checked against its version."""
    multi, late = doc.get("multi_writer", False), doc.get("late_columns", False)
    version = doc["version"]
    inline = version == INLINE_GROUPS_VERSION
    if doc.get("inline_groups", False) is not inline:
        raise FormatError(f"Unsupported inline_groups={doc.get('inline_groups')!r} with version {version} in "
                          f"{where}; expected true exactly in version {INLINE_GROUPS_VERSION}")
    if inline:  # a multi-writer store (with deltas), or one converted to a single writer
        deltas = doc.get("append_deltas", False)
        if not isinstance(late, bool) or not isinstance(multi, bool) or deltas is not multi:
            raise FormatError(f"Unsupported append_deltas={deltas!r} / multi_writer={multi!r} / late_columns={late!r} "
                              f"with version {version} in {where}; expected append_deltas and multi_writer both "
                              "true or both false, and late_columns true or false")
        return multi, late, deltas, True
    if version == APPEND_DELTAS_VERSION:
        if doc.get("append_deltas") is not True or multi is not True or not isinstance(late, bool):
            raise FormatError(f"Unsupported append_deltas={doc.get('append_deltas')!r} / multi_writer={multi!r} / "
                              f"late_columns={late!r} with version {version} in {where}; expected append_deltas "
                              "and multi_writer true and late_columns true or false")
        return True, late, True, False
    if doc.get("append_deltas", False) is not False:
        raise FormatError(f"Unsupported append_deltas={doc.get('append_deltas')!r} with version {version} in "
                          f"{where}; expected it only in version {APPEND_DELTAS_VERSION}")
    if version == LATE_COLUMNS_FORMAT_VERSION:
        if late is not True or not isinstance(multi, bool):
            raise FormatError(f"Unsupported late_columns={late!r} / multi_writer={multi!r} with version {version} "
                              f"in {where}; expected late_columns true and multi_writer true or false")
        return multi, True, False, False
    if late is not False:
        raise FormatError(f"Unsupported late_columns={late!r} with version {version} in {where}; expected it only "
                          f"in version {LATE_COLUMNS_FORMAT_VERSION}")
    if multi is not (version == MULTI_WRITER_VERSION):
        raise FormatError(f"Unsupported multi_writer={multi!r} with version {version} in {where}; "
                          f"expected true exactly in version {MULTI_WRITER_VERSION}")
    return multi, False, False, False


def shared_schema_bytes(schema: Schema) -> bytes:
    """The file form of a multi-writer store's ``SCHEMA.json``."""
    return signed_bytes({"format": SCHEMA_FORMAT, "version": FORMAT_VERSION, "schema": schema.to_list()})


def read_shared_schema(root: Any) -> Optional[Schema]:
    """The schema a multi-writer store's first extend fixed, or None before it."""
    root = _dir(root)
    path = _where(root, SCHEMA_FILE)
    try:
        doc, verified = _read_signed(root, SCHEMA_FILE)
    except FileNotFoundError:
        return None
    doc = _check_header(doc, SCHEMA_FORMAT, path)
    if not verified:
        _check_signature(doc, path)
    return Schema.from_list(doc.get("schema"))


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
        return _evolve(self, {"first_row": self.first_row + by})

    def to_dict(self) -> dict:
        if self.group is not None:  # no sidecar file to name
            return {"id": self.id, "file": self.file, "first_row": self.first_row, "num_rows": self.num_rows,
                    "bytes": self.bytes, "crc32c": self.crc32c, "groups_bytes": 0, "groups_crc32c": 0,
                    "group": self.group}
        return {"id": self.id, "file": self.file, "first_row": self.first_row, "num_rows": self.num_rows,
                "bytes": self.bytes, "crc32c": self.crc32c, "groups_file": self.groups_file,
                "groups_bytes": self.groups_bytes, "groups_crc32c": self.groups_crc32c}

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
                _int(d, key, where, lo=lo, hi=hi)  # raises, naming the field
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
        e = cls(name, _int(d, "generation", where, lo=1), _int(d, "bytes", where, lo=1),
                _int(d, "crc32c", where, hi=0xFFFFFFFF))
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
            if not ok or not 0 <= frame[0] <= frame[1] <= _int(d, "bytes", where) or not 0 <= frame[2] <= 0xFFFFFFFF:
                raise FormatError(f"Unsupported group_index frame {frame!r} in {where}; expected [body_start, "
                                  "body_end, crc32c] within the file")
            frame = tuple(frame)
        e = cls(_int(d, "generation", where, lo=1, hi=_MAX_ID), _int(d, "first_row", where),
                _int(d, "end_row", where), _int(d, "bytes", where, lo=1), _int(d, "crc32c", where, hi=0xFFFFFFFF),
                frame)
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
                and 0 <= first <= 1 << 62 and 1 <= n <= 1 << 62 and 0 <= dig < 1 << 63 and 1 <= gen <= _MAX_ID):
            return cls(d[0], first, n, dig, gen)
        doc = dict(zip(("first_row", "num_rows", "digest", "generation"), d[1:]))
        return cls(d[0], _int(doc, "first_row", where), _int(doc, "num_rows", where, lo=1),
                   _int(doc, "digest", where, hi=(1 << 63) - 1), _int(doc, "generation", where, lo=1, hi=_MAX_ID))


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
                and type(last) is int and type(end) is int and 0 <= i <= _MAX_ID and 1 <= nbytes <= 1 << 62
                and 0 <= crc <= 0xFFFFFFFF and 1 <= count <= 1 << 62 and 1 <= last <= _MAX_ID
                and 0 <= end <= 1 << 62):
            e = object.__new__(cls)
            e.__dict__.update(zip(_TOKEN_LOG_FIELDS, values))
        else:
            e = cls(_int(d, "id", where, hi=_MAX_ID), _int(d, "bytes", where, lo=1),
                    _int(d, "crc32c", where, hi=0xFFFFFFFF), _int(d, "count", where, lo=1),
                    _int(d, "last_generation", where, lo=1, hi=_MAX_ID), _int(d, "end_row", where))
        if d.get("file", e.file) != e.file:
            raise FormatError(f"Unsupported token log file {d.get('file')!r} in {where}; expected {e.file!r}")
        return e


_TOKEN_LOG_FIELDS = ("id", "bytes", "crc32c", "count", "last_generation", "end_row")


def token_log_bytes(records: Sequence[TokenRecord]) -> bytes:
    """The file form of a token log: a signed JSON document of its records."""
    return signed_bytes({"format": TOKENS_FORMAT, "version": FORMAT_VERSION,
                         "records": [r.to_list() for r in records]})


def parse_token_log(raw: bytes, where: str) -> List[TokenRecord]:
    doc = _parse_json(raw, where)
    doc = _check_header(doc, TOKENS_FORMAT, where)
    if not _signature_in_bytes(raw):
        _check_signature(doc, where)
    records = doc.get("records")
    if not isinstance(records, list):
        raise FormatError(f"Unsupported records in {where}; expected a list")
    return [TokenRecord.from_list(r, where) for r in records]


#: what ``commit_stats`` counts: commits, lost races (each one retried), and milliseconds from
#: a commit's start to its publishing, of which spent on lost races (back-off, re-read, re-plan)
COMMIT_STATS = ("commits", "conflicts", "commit_ms", "retry_ms")


_COMMIT_STATS = frozenset(COMMIT_STATS)


def _commit_stats(d: Any, where: str) -> Dict[str, int]:
    if type(d) is dict:  # the common case in one pass (every delta holds a few counters)
        for k, v in d.items():
            if k not in _COMMIT_STATS or type(v) is not int or not 0 <= v <= 1 << 62:
                break
        else:
            return dict(d)
    if not isinstance(d, dict) or set(d) - set(COMMIT_STATS):
        raise FormatError(f"Unsupported commit_stats {d!r} in {where}; expected an object with keys {COMMIT_STATS}")
    return {k: _int(d, k, where) for k in COMMIT_STATS if k in d}


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
        return cls(spec, _int(d, "since_row", where), _int(d, "since_generation", where, lo=1, hi=_MAX_ID))


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


@dataclass(frozen=True)
class Manifest:
    """One committed snapshot of the store.

    ``head`` is the first live row id (rows below it are evicted);
    ``next_row`` the id the next appended row gets. Live rows are exactly
    ``[head, next_row)`` and lie in ``segments``, which are ordered by row.

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

    @property
    def num_rows(self) -> int:
        return self.next_row - self.head

    @property
    def file(self) -> str:
        return manifest_file(self.generation)

    def files(self) -> List[str]:
        """Every data file this manifest references (relative paths)."""
        out = []
        for s in self.segments:
            out.append(s.file)
            if s.groups_bytes:  # (a store without a group key, or an inline group: no sidecar file)
                out.append(s.groups_file)
        return out + self.files_besides_segments()

    def files_besides_segments(self) -> List[str]:
        """The data files this manifest references other than its segments and their sidecars."""
        out = [st.file for st in self.states.values()]
        out += [t.file for t in self.token_logs]
        if self.group_index is not None:
            out.append(self.group_index.file)
        return out

    @property
    def nbytes(self) -> int:
        return (sum(s.bytes + s.groups_bytes for s in self.segments) + sum(st.bytes for st in self.states.values())
                + (self.group_index.bytes if self.group_index is not None else 0))

    def evolve(self, **changes: Any) -> "Manifest":
        return _evolve(self, changes)

    def to_dict(self) -> dict:
        return _signed(self.body())

    def body(self) -> dict:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": FORMAT_VERSION,
            "generation": self.generation,
            "head": self.head,
            "next_row": self.next_row,
            "next_segment": self.next_segment,
            "segments": [s.to_dict() for s in self.segments],
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
        return doc

    @classmethod
    def from_dict(cls, doc: Any, where: str, verified: bool = False) -> "Manifest":
        doc = _check_header(doc, MANIFEST_FORMAT, where, (FORMAT_VERSION, LATE_COLUMNS_MANIFEST_VERSION))
        if not verified:
            _check_signature(doc, where)
        segs = doc.get("segments")
        states = doc.get("states", {})
        tokens, logs = doc.get("tokens", []), doc.get("token_logs", [])
        if not isinstance(segs, list) or not isinstance(states, dict) or not isinstance(tokens, list) \
                or not isinstance(logs, list):
            raise FormatError(f"Unsupported segments/states/tokens in {where}; expected lists and an object")
        m = cls(
            generation=_int(doc, "generation", where, lo=1, hi=_MAX_ID),
            head=_int(doc, "head", where),
            next_row=_int(doc, "next_row", where),
            next_segment=_int(doc, "next_segment", where, hi=_MAX_ID + 1),
            segments=tuple(SegmentEntry.from_dict(s, where) for s in segs),
            states={k: StateEntry.from_dict(k, v, where) for k, v in states.items()},
            tokens=tuple(TokenRecord.from_list(t, where) for t in tokens),
            token_logs=tuple(TokenLog.from_dict(t, where) for t in logs),
            late_columns=_late_columns(doc, where),
            group_index=(None if doc.get("group_index") is None
                         else GroupIndexEntry.from_dict(doc["group_index"], where)),
            commit_stats=_commit_stats(doc.get("commit_stats", {}), where),
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
        prev_end, prev_id, ordered = None, -1, True
        for s in self.segments:
            if prev_end is not None and s.first_row != prev_end:
                raise FormatError(f"segment {s.id} in {where} starts at row {s.first_row}; expected "
                                  f"{prev_end} (segments must be contiguous)")
            if s.id >= self.next_segment:
                raise FormatError(f"segment id {s.id} in {where} is out of order")
            # many writers reserve ids independently, so row order need not be id order
            ordered &= s.id > prev_id
            prev_end, prev_id = s.end_row, s.id
        if not ordered and len({s.id for s in self.segments}) != len(self.segments):
            raise FormatError(f"a segment id appears twice in {where}")
        if self.segments:
            if self.segments[-1].end_row != self.next_row or self.segments[0].first_row > self.head \
                    or self.segments[0].end_row <= self.head:
                raise FormatError(f"segments in {where} cover rows [{self.segments[0].first_row}, "
                                  f"{self.segments[-1].end_row}) but live rows are [{self.head}, {self.next_row})")
        elif self.head != self.next_row:
            raise FormatError(f"{where} has live rows [{self.head}, {self.next_row}) but no segments")
        if self.group_index is not None and self.group_index.end_row > self.next_row:
            raise FormatError(f"the group_index of {where} covers rows up to {self.group_index.end_row}, beyond "
                              f"next_row {self.next_row}")

    def write(self, root: Any) -> None:
        root = _dir(root)
        if _is_storage(root):
            root.replace(self.file, signed_bytes(self.body()), step="manifest")
            return
        durable_write(os.path.join(root, self.file), signed_bytes(self.body()), step="manifest")


def evict(head: int, next_row: int, segments: Tuple[SegmentEntry, ...],
          options: StoreOptions) -> Tuple[int, Tuple[SegmentEntry, ...]]:
    """New head and live segments after applying the row and byte capacities."""
    if options.capacity_rows is not None:
        head = max(head, next_row - options.capacity_rows)
    if options.capacity_bytes is not None:
        total = sum(s.bytes + s.groups_bytes for s in segments)
        i = 0
        while i < len(segments) - 1 and total > options.capacity_bytes:
            total -= segments[i].bytes + segments[i].groups_bytes
            i += 1
        if i:
            head = max(head, segments[i].first_row)
    if segments and segments[0].end_row <= head:  # ordered by row: drop the evicted prefix
        segments = tuple(s for s in segments if s.end_row > head)
    return head, segments


def append_rows(base: Manifest, entries: Sequence[SegmentEntry], num_rows: int, token: Optional[TokenRecord],
                columns: Sequence[ColumnSpec], options: StoreOptions, **changes: Any) -> Manifest:
    """``base`` plus an append of ``num_rows`` rows in ``entries`` (whose ``first_row`` must be
    ``base.next_row`` onwards), its token and the late columns it adds; capacities applied;
    ``changes`` of other fields made in the same copy.
    The one definition of what an append does, for a writer's commit and a reader's delta."""
    generation = base.generation + 1
    next_row = base.next_row + num_rows
    head, segments = evict(base.head, next_row, base.segments + tuple(entries), options)
    tokens = base.tokens
    if token is not None:
        tokens = tokens + (_evolve(token, {"first_row": base.next_row, "generation": generation}),)
    late = base.late_columns
    if columns:  # the schema changes in the same commit as the rows that need it
        late = add_late_columns(late, columns, base.next_row, generation)
    return base.evolve(generation=generation, head=head, next_row=next_row,
                       next_segment=max([base.next_segment] + [e.id + 1 for e in entries]),
                       segments=segments, tokens=tokens, late_columns=late, **changes)


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
    >>> AppendDelta.from_doc(json.loads(signed_bytes(d.body())), "x") == d
    True
    """

    entries: Tuple[SegmentEntry, ...]  # ``first_row`` counts from the append's first row (0)
    num_rows: int
    token: Optional[TokenRecord] = None  # ``first_row`` and ``generation`` are filled in by ``apply``
    columns: Tuple[ColumnSpec, ...] = ()
    #: the writer's commit counters not yet in the store's (``COMMIT_STATS`` keys)
    commit_stats: Mapping[str, int] = field(default_factory=dict)

    def body(self) -> dict:
        doc = {"format": DELTA_FORMAT, "version": FORMAT_VERSION, "num_rows": self.num_rows,
               "segments": [e.to_dict() for e in self.entries]}
        if self.token is not None:
            doc["token"] = self.token.to_list()
        if self.columns:
            doc["late_columns"] = [c.to_dict() for c in self.columns]
        if self.commit_stats:
            doc["commit_stats"] = dict(sorted(self.commit_stats.items()))
        return doc

    @classmethod
    def from_doc(cls, doc: Any, where: str, verified: bool = False) -> "AppendDelta":
        doc = _check_header(doc, DELTA_FORMAT, where)
        if not verified:
            _check_signature(doc, where)
        segs, cols = doc.get("segments"), doc.get("late_columns", [])
        if not isinstance(segs, list) or not segs or not isinstance(cols, list):
            raise FormatError(f"Unsupported segments/late_columns in {where}; expected non-empty lists")
        # the fields straight into a new instance (a frozen dataclass's __init__ sets each through
        # object.__setattr__): every writer of a multi-writer store reads every other writer's deltas
        d = object.__new__(cls)
        d.__dict__.update(entries=tuple([SegmentEntry.from_dict(e, where) for e in segs]),
                          num_rows=_int(doc, "num_rows", where, lo=1),
                          token=None if doc.get("token") is None else TokenRecord.from_list(doc["token"], where),
                          columns=tuple([ColumnSpec.from_dict(c) for c in cols]) if cols else (),
                          commit_stats=_commit_stats(doc.get("commit_stats", {}), where))
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
        return append_rows(base, entries, self.num_rows, self.token, self.columns, options, depth=base.depth + 1,
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
    first = entries[0].first_row
    # the same rows: back to back, ending where the run ends, starting where it starts (the oldest
    # segment: anywhere from there up to head, the rows below it being evicted)
    contiguous = all(a.end_row == b.first_row for a, b in zip(entries, entries[1:]))
    starts = first == run[0].first_row or (start == 0 and run[0].first_row <= first <= base.head)
    if not (contiguous and starts and entries[-1].end_row == run[-1].end_row):
        raise CommitConflictError(f"the rewrite of rows [{first}, {entries[-1].end_row}) does not hold the rows "
                                  f"[{run[0].first_row}, {run[-1].end_row}) of the segments it replaces")
    segments = base.segments[:start] + tuple(entries) + base.segments[stop:]
    head, segments = evict(base.head, base.next_row, segments, options)
    return base.evolve(generation=base.generation + 1, head=head, segments=segments,
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
        doc = _check_header(doc, DELTA_FORMAT, where, (REWRITE_DELTA_VERSION,))
        if not verified:
            _check_signature(doc, where)
        replaced, segs = doc.get("replaced"), doc.get("segments")
        if (not isinstance(replaced, list) or not replaced
                or not all(type(i) is int and 0 <= i <= _MAX_ID for i in replaced)
                or len(set(replaced)) != len(replaced) or not isinstance(segs, list) or not segs):
            raise FormatError(f"Unsupported replaced/segments in the rewrite delta {where}; expected non-empty "
                              "lists of distinct segment ids and of segments")
        return cls(tuple(replaced), tuple(SegmentEntry.from_dict(e, where) for e in segs),
                   _commit_stats(doc.get("commit_stats", {}), where))

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


def schema_file(options: "StoreOptions", unlocked: bool) -> str:
    """The file that holds a store's schema: SCHEMA.json for many writers and for storage without an
    exclusive lock, object storage (fixed by the first append of any writer), else FORMAT.json.

    >>> schema_file(StoreOptions(multi_writer=True), False), schema_file(StoreOptions(), False)
    ('SCHEMA.json', 'FORMAT.json')
    """
    return SCHEMA_FILE if options.multi_writer or unlocked else FORMAT_FILE


class _MissingBase(FileNotFoundError):
    """A delta's file is there but a manifest it applies to is not (``filename``): collected with it
    by a clean-up in progress (the delta goes next), or lost."""


def with_chains(manifests: Mapping[int, Manifest]) -> set:
    """The generations whose files reading each of ``manifests`` needs: each one and, for a
    delta, the generations back to the full manifest it applies to (clean-up keeps them all).

    >>> sorted(with_chains({9: Manifest(generation=9, depth=2), 4: Manifest(generation=4)}))
    [4, 7, 8, 9]
    """
    return {g for gen, m in manifests.items() for g in range(gen - m.depth, gen + 1)}


def _late_columns(doc: Mapping[str, Any], where: str) -> Tuple[LateColumn, ...]:
    late = doc.get("late_columns")
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


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def load_manifest(path: str, generation: Optional[int] = None, *, known: Optional[Manifest] = None,
                  options: Optional[StoreOptions] = None, seen: Optional[Dict[int, Manifest]] = None) -> Manifest:
    """Read, verify and parse one manifest file (which must say it is ``generation``, if given).

    A delta (:class:`AppendDelta`) is applied to the manifests before it, read
    from the same directory back to a full one, or to ``known`` (a manifest of
    this store already held) when the chain reaches its generation. ``seen``,
    if given, receives every generation a chain of deltas made on the way.
    """
    doc, verified = read_signed_json(path)
    if isinstance(doc, dict) and doc.get("format") == DELTA_FORMAT:
        m = _MANIFEST_NAME.match(os.path.basename(path))
        if m is None:
            raise CorruptStoreError(f"{path} is an append delta outside a store's manifests directory")
        root = os.path.dirname(os.path.dirname(path))
        return _resolve(root, int(m.group(1)), doc, verified, path, known, options, seen)
    m = Manifest.from_dict(doc, path, verified)
    if generation is not None and m.generation != generation:
        raise CorruptStoreError(f"{path} says it is generation {m.generation}")
    return m


def _resolve(root: Any, generation: int, doc: Any, verified: bool, where: str, known: Optional[Manifest],
             options: Optional[StoreOptions], seen: Optional[Dict[int, Manifest]] = None) -> Manifest:
    """Manifest ``generation`` of ``root`` from its document: a full manifest, or a delta applied
    to the manifest of the generation before (recursively, back to a full one or ``known``)."""
    chain: List[Tuple[str, Delta]] = []
    base = None
    g, g_where = generation, where
    while isinstance(doc, dict) and doc.get("format") == DELTA_FORMAT:
        chain.append((g_where, delta_from_doc(doc, g_where, verified)))
        g -= 1
        if known is not None and known.generation == g:
            base = known
            break
        if g == 0:  # the store's first commits: they follow the empty store
            base = Manifest()
            break
        if len(chain) > MAX_DELTA_CHAIN:
            raise CorruptStoreError(f"{where} is an append delta whose chain of {len(chain)} deltas ends at "
                                    f"generation {g} without a full manifest")
        g_where = _where(root, manifest_file(g))
        try:
            doc, verified = _read_signed(root, manifest_file(g))
        except FileNotFoundError:  # collected with the delta meanwhile, or lost: _MissingBase says which
            raise _MissingBase(errno.ENOENT, f"{where} is an append delta, but {g_where}, a manifest it "
                                   "applies to, is missing", g_where) from None
    if base is None:
        base = Manifest.from_dict(doc, g_where, verified)
        if base.generation != g:
            raise CorruptStoreError(f"{g_where} says it is generation {base.generation}")
    if not chain:
        return base
    if options is None:  # the capacities (FORMAT.json is fixed at creation but for late_columns)
        raw, ok = _read_signed(root, FORMAT_FILE)
        options = StoreOptions.from_dict(raw, _where(root, FORMAT_FILE), ok)
    made = []
    for d_where, delta in reversed(chain):
        try:
            base = delta.apply(base, options)
        except CommitConflictError as exc:  # its writer applied it to exactly this base: forged or damaged
            raise CorruptStoreError(f"{d_where} is a rewrite delta that does not apply to generation "
                                    f"{base.generation}: {exc}") from None
        made.append(base)
    _check_appended(base, where)
    if seen is not None:
        seen.update((m.generation, m) for m in made)
    return base


def _check_appended(m: Manifest, where: str) -> None:
    """What ``Manifest.validate`` could find wrong in ``m``, a valid manifest with append deltas
    applied: a segment id twice. The rest holds by construction (:meth:`AppendDelta.apply` places
    the entries after the base's rows, raises ``next_segment`` past their ids and applies the
    capacities; :func:`rewrite_rows` checks a rewrite's rows), so a reader catching up does not
    check every segment's rows per delta."""
    if len({s.id for s in m.segments}) != len(m.segments):
        raise FormatError(f"a segment id appears twice in {where}")


def list_generations(root: Any) -> List[int]:
    """Manifest generations present in ``root`` (a directory or a Storage), newest first."""
    root = _dir(root)
    try:
        names = root.list(MANIFEST_DIR) if _is_storage(root) else os.listdir(os.path.join(root, MANIFEST_DIR))
    except FileNotFoundError:
        return []
    gens = [int(m.group(1)) for m in map(_MANIFEST_NAME.match, names) if m]
    return sorted(gens, reverse=True)


def load_newest_manifest(root: Any, *, known: Optional[Manifest] = None, options: Optional[StoreOptions] = None,
                         seen: Optional[Dict[int, Manifest]] = None,
                         known_is_newest: bool = False) -> Tuple[Manifest, List[str]]:
    """The newest manifest that parses and verifies, and the problems met on the way.

    ``seen`` receives the generations a chain of deltas made on the way (:func:`load_manifest`).
    ``known_is_newest``: ``known`` was the newest generation so recently that it cannot have
    been collected since (see :func:`read_forward`); the generations after it are then read
    in order, without probing for them first.
    An empty store gives ``Manifest()``. Raises ``CorruptStoreError`` naming the
    files when manifests exist but none is intact. A reader whose directory
    listing went stale while a writer committed and cleaned up (every listed
    manifest deleted before it could be opened) lists again rather than
    mistaking the store for an empty one. An object store is probed instead
    (:func:`_newest_by_probing`): its listings are not relied on.

    A store with a collection floor (:func:`read_floor`) is held to it: the answer counts only
    if the floor, read after it was found, is not above it. Otherwise the search went through
    a collected generation (it found a run that a clean-up was removing, or a manifest a stale
    writer created in a collected slot) and starts again from the floor.
    """
    start = 0
    for _ in range(MAX_RELISTS):
        m, problems = _newest_unchecked(root, known, options, seen, known_is_newest and not start, start)
        floor = read_floor(root)
        if floor is None or m.generation >= floor:
            return m, problems
        start, known_is_newest = floor, False
    raise CorruptStoreError(f"the collection floor of {_where(_dir(root), FLOOR_FILE)} kept moving past the "
                            f"newest manifest found ({MAX_RELISTS} searches): is something deleting manifests?")


def _newest_unchecked(root: Any, known: Optional[Manifest], options: Optional[StoreOptions],
                      seen: Optional[Dict[int, Manifest]], known_is_newest: bool,
                      start: int) -> Tuple[Manifest, List[str]]:
    """:func:`load_newest_manifest` without the floor's check; ``start``: search from that
    generation up (the floor), not from ``known``."""
    root = _dir(root)
    if _is_storage(root):
        return _newest_by_probing(root, known, options, seen, start)
    if known is not None and known.generation and known_is_newest:
        known, complete = read_forward(root, known, options=options, seen=seen)
        if complete:
            return known, []
    newest: Optional[int] = None
    if start:  # the floor: never collected while it is the floor (gone: it moved on; list)
        if _exists(root, manifest_file(start)):
            newest = _probe_up(root, start)
    elif known is not None and known.generation:  # probe up from it rather than list (see newer_generation)
        newest = newer_generation(root, known.generation)
        if newest is None:
            return known, []
    if newest is not None:
        try:
            return load_manifest(os.path.join(root, manifest_file(newest)), newest, known=known,
                                 options=options, seen=seen), []
        except (FileNotFoundError, CorruptStoreError, FormatError):
            pass  # collected or damaged: the listing below finds the newest intact one
    for _ in range(MAX_RELISTS):
        problems: List[str] = []
        vanished = broken = False
        gens = list_generations(root)
        for gen in gens:
            path = os.path.join(root, manifest_file(gen))
            try:
                return load_manifest(path, gen, known=known, options=options), problems
            except _MissingBase as exc:
                # a clean-up removes a chain oldest first: its delta goes next, and the listing changes
                problems.append(exc.strerror)
                broken = True
            except FileNotFoundError:
                vanished = True  # deleted by the writer's clean-up between listdir and open
            except (CorruptStoreError, FormatError) as exc:
                problems.append(str(exc))
        if not vanished and not (broken and list_generations(root) != gens):
            break
    else:
        raise CorruptStoreError(f"the manifests of {root} kept vanishing while being read "
                                f"({MAX_RELISTS} listings): is something deleting them?")
    if problems:
        raise CorruptStoreError("no intact manifest in " + root + ": " + "; ".join(problems))
    return Manifest(), problems


def manifest_docs(root: Any) -> Tuple[Dict[int, Manifest], Dict[int, str]]:
    """Intact manifests by generation, and the manifests that could not be read.

    A damaged manifest (bad JSON, checksum, format) is left out of both: it
    names nothing trustworthy. One that could not be *read* (EIO, EACCES, ...)
    is reported with its error: it may be intact and name files, so clean-up
    must not treat it, or the files it may name, as garbage.
    """
    root = _dir(root)
    out: Dict[int, Manifest] = {}
    unreadable: Dict[int, str] = {}
    for gen in reversed(list_generations(root)):  # oldest first: a delta applies to the one before
        path = _where(root, manifest_file(gen))
        try:
            out[gen] = read_manifest(root, gen, known=out.get(gen - 1))
        except (CorruptStoreError, FormatError, FileNotFoundError):
            continue
        except OSError as exc:
            unreadable[gen] = f"{path}: {exc}"
    return dict(sorted(out.items(), reverse=True)), unreadable


# ---------------------------------------------------------------------------
# Reading through a Storage (an object store has no paths to open)


def _is_storage(root: Any) -> bool:
    """True for a storage whose files cannot be mapped in place (an object store); a local Storage
    is read as its directory (one code path for local stores)."""
    return not getattr(root, "can_map", True)


def _dir(root: Any) -> Any:
    """``root`` itself, or a local Storage's directory."""
    return root if isinstance(root, (str, os.PathLike)) or _is_storage(root) else root.url


def _where(root: Any, rel: str) -> str:
    """How messages name ``rel`` of ``root`` (a path, or the object's URL)."""
    return f"{root.url.rstrip('/')}/{rel}" if _is_storage(root) else os.path.join(root, rel)


def _read_signed(root: Any, rel: str) -> Tuple[Any, bool]:
    if not _is_storage(root):
        return read_signed_json(os.path.join(root, rel))
    raw = root.read_bytes(rel, MAX_JSON_BYTES)
    return _parse_json(raw, _where(root, rel)), _signature_in_bytes(raw)


def read_manifest(root: Any, generation: int, *, known: Optional[Manifest] = None,
                  options: Optional[StoreOptions] = None, seen: Optional[Dict[int, Manifest]] = None) -> Manifest:
    """Read, verify and parse manifest ``generation`` of ``root`` (a directory or a Storage);
    a delta is resolved as :func:`load_manifest` says."""
    root = _dir(root)
    rel = manifest_file(generation)
    doc, verified = _read_signed(root, rel)
    return _resolve(root, generation, doc, verified, _where(root, rel), known, options, seen)


def _exists(storage: Any, rel: str) -> bool:
    if not _is_storage(storage):
        return os.path.exists(os.path.join(storage, rel))
    try:
        storage.size(rel)
        return True
    except FileNotFoundError:
        return False


def read_forward(root: str, known: Manifest, *, options: Optional[StoreOptions] = None,
                 seen: Optional[Dict[int, Manifest]] = None, limit: int = FORWARD_READS) -> Tuple[Manifest, bool]:
    """The manifests after ``known`` in a local store, read in order until one is absent:
    ``(newest read, True)``; ``(newest read, False)`` when more than ``limit`` follow or one does
    not read (the caller probes and lists, as :func:`load_newest_manifest` does).

    Only for a ``known`` that was the newest generation less than ``retain_seconds / 2`` ago:
    a manifest is collected only after a newer one has existed for ``retain_seconds``, and
    every generation above ``known`` was created after it was the newest, so none of them,
    and not ``known``, can have been collected, and the first absent generation ends the
    contiguous run of present ones (the margin covers clocks of other hosts, as a commit's
    own files do). So the open of the next generation replaces the ``stat`` of the held one
    and of the next (:func:`newer_generation`): nothing new costs one failed open, each new
    commit the read of its file that catching up needs anyway.

    >>> import shutil, tempfile; root = tempfile.mkdtemp(); m = Manifest(generation=3)
    >>> read_forward(root, m) == (m, True)
    True
    >>> shutil.rmtree(root)
    """
    m = known
    for _ in range(limit):
        g = m.generation + 1
        try:
            m = read_manifest(root, g, known=m, options=options)
        except FileNotFoundError:
            return m, True
        except (OSError, CorruptStoreError, FormatError):
            return m, False
        if seen is not None:  # every one, full manifests too: a writer's clean-up need not read them again
            seen[g] = m
    return m, False


def newer_generation(root: Any, held: int) -> Optional[int]:
    """The newest generation of ``root`` if it is above ``held``, else None, without listing
    ``manifests/`` (a multi-writer store keeps ``retain_seconds`` of them): the generations
    present above a present one are contiguous, so one or two probes tell that nothing is
    newer, and +1, +2, +4, ... then a binary search find the newest. A listing is the fallback
    when ``held`` itself is gone (collected).

    >>> import tempfile; newer_generation(tempfile.mkdtemp(), 0) is None
    True
    """
    root = _dir(root)
    if held and _exists(root, manifest_file(held)):
        newest = _probe_up(root, held)
    else:
        gens = list_generations(root)
        newest = _probe_up(root, gens[0]) if gens else 0
    return newest if newest > held else None


def _newest_by_probing(storage: Any, known: Optional[Manifest] = None, options: Optional[StoreOptions] = None,
                       seen: Optional[Dict[int, Manifest]] = None, start: int = 0) -> Tuple[Manifest, List[str]]:
    """The newest intact manifest of an object store, found with HEAD requests.

    Commits create generations N, N+1, ... in order and clean-up removes only
    old ones, so the generations present above any present one are
    contiguous: from a hint (the newest this storage saw before, else a
    listing, which may be stale) probe +1, +2, +4, ... until one is missing,
    then binary-search the gap. About 2 log2(commits since the hint) HEADs.
    Without a hint, or when the hint itself was collected, the search starts
    at the collection floor (``start``, else the one read here), which is never
    collected while it is the floor; only a store without a floor (written by
    an older diskreplay) is listed, and an empty listing of such a store is
    checked against generation 1 before it is taken for an empty store.
    """
    problems: List[str] = []
    for _ in range(MAX_RELISTS):
        hint = max(getattr(storage, "generation_hint", 0), start)
        newest = _probe_up(storage, hint) if hint else 0
        if newest == hint and (hint == 0 or not _exists(storage, manifest_file(hint))):
            floor = read_floor(storage)
            low = max(floor or 0, 1)
            if floor is not None and _exists(storage, manifest_file(low)):
                newest = _probe_up(storage, low)
            elif floor is not None and read_floor(storage) != floor:
                start = 0
                storage.generation_hint = 0
                continue  # the floor moved past the generation it named: read it again
            else:
                # no floor (an older diskreplay's store), or its generation is lost (damage, or no
                # commit yet): a listing, which may lag, is all there is
                gens = list_generations(storage)
                low = gens[0] if gens else (1 if _exists(storage, manifest_file(1)) else 0)
                newest = _probe_up(storage, low) if low else 0
        if newest == 0:
            return Manifest(), problems
        problems = []
        vanished = False
        for gen in range(newest, 0, -1):
            try:
                m = read_manifest(storage, gen, known=known, options=options, seen=seen)
            except _MissingBase as exc:
                # a generation found by probing keeps its chain for retain_seconds after it is superseded
                problems.append(exc.strerror)
                continue
            except FileNotFoundError:
                vanished = gen == newest  # collected between the probe and the read: probe again
                break
            except (CorruptStoreError, FormatError) as exc:
                problems.append(str(exc))
                continue
            storage.generation_hint = gen
            return m, problems
        if not vanished:
            break
        storage.generation_hint = 0
    if problems:
        raise CorruptStoreError("no intact manifest in " + storage.url + ": " + "; ".join(problems))
    raise CorruptStoreError(f"the manifests of {storage.url} kept vanishing while being read: is something "
                            "deleting them?")


def _probe_up(storage: Any, low: int) -> int:
    """The highest present generation above ``low`` (``low`` itself when none is)."""
    step = 1
    while _exists(storage, manifest_file(low + step)):
        low += step
        step *= 2
    high = low + step
    while high - low > 1:
        mid = (low + high) // 2
        if _exists(storage, manifest_file(mid)):
            low = mid
        else:
            high = mid
    return low


# ---------------------------------------------------------------------------
# The collection floor (docs/FORMAT.md, "The collection floor")

#: ``FLOOR.json`` is always written as this many bytes (padded with spaces): a local store
#: rewrites it in place under a lock, and a reader that meets a torn write reads again
FLOOR_BYTES = 128
FLOOR_READS = 8  # reads of a FLOOR.json that does not parse before it counts as damaged


def floor_bytes(floor: int) -> bytes:
    """The file form of ``FLOOR.json`` holding ``floor``.

    >>> raw = floor_bytes(17); len(raw), parse_floor(raw, "FLOOR.json")
    (128, 17)
    """
    raw = signed_bytes({"format": FLOOR_FORMAT, "version": 1, "floor": int(floor)})
    return raw + b" " * (FLOOR_BYTES - len(raw))


def parse_floor(raw: bytes, where: str) -> int:
    """The floor a ``FLOOR.json``'s bytes hold (``CorruptStoreError``/``FormatError`` if they do not)."""
    doc = _check_header(_parse_json(raw.rstrip(b" "), where), FLOOR_FORMAT, where)
    _check_signature(doc, where)
    return _int(doc, "floor", where, hi=_MAX_ID)


def read_floor(root: Any) -> Optional[int]:
    """The collection floor of ``root`` (a directory or a Storage); None where there is none (a
    single-writer local store, or one an older diskreplay wrote: it is not held to one).

    A manifest generation below the floor may have been collected (or be a manifest a stale
    writer created in a collected slot); none at or above it ever was. The floor only grows.

    >>> import tempfile; read_floor(tempfile.mkdtemp()) is None
    True
    """
    root = _dir(root)
    where = _where(root, FLOOR_FILE)
    for attempt in range(FLOOR_READS):
        try:
            raw = (root.read_bytes(FLOOR_FILE, MAX_JSON_BYTES) if _is_storage(root)
                   else read_file(os.path.join(root, FLOOR_FILE), MAX_JSON_BYTES))
        except FileNotFoundError:
            return None
        if not raw.strip(b" \0"):
            return None  # created, not written yet: a floor being set for the first time
        try:
            return parse_floor(raw, where)
        except CorruptStoreError:
            if attempt == FLOOR_READS - 1:
                raise
            time.sleep(0.001 * (attempt + 1))  # a local rewrite in place, met half-way: read it again
    return None


def raise_floor(storage: Any, floor: int) -> int:
    """Make ``storage``'s collection floor at least ``floor``, durably, before anything below it
    is deleted; returns the floor now (lower than asked when it cannot be raised now: the lock of
    a local store is held by another writer, its filesystem has no locks, or an object store's
    conditional writes kept losing; nothing below the returned value may be deleted then).

    >>> from diskreplay.storage.local import LocalStorage
    >>> import tempfile; s = LocalStorage(tempfile.mkdtemp())
    >>> raise_floor(s, 5), raise_floor(s, 3), read_floor(s)
    (5, 5, 5)
    """
    where = _where(_dir(storage), FLOOR_FILE)

    def update(raw: Optional[bytes]) -> Optional[bytes]:
        if not raw or not raw.strip(b" \0"):
            return floor_bytes(floor)  # the first floor of this store
        return floor_bytes(floor) if floor > parse_floor(raw, where) else None

    raw = storage.update_small(FLOOR_FILE, update)
    return parse_floor(raw, where) if raw and raw.strip(b" \0") else 0


def lowest_present(storage: Any, newest: int) -> int:
    """The lowest generation of the run of present manifests that ends at ``newest`` (0 for an
    empty store), found with O(log n) probes (``stat``s, HEADs) downwards: where a store gets its
    first floor (one an older diskreplay wrote, or converted to many writers), every generation
    below that run is collected or being collected, so it is a true floor."""
    if newest <= 1:
        return newest
    storage = _dir(storage)
    low, step = newest, 1
    while low - step >= 1 and _exists(storage, manifest_file(low - step)):
        low -= step
        step *= 2
    gone = max(low - step, 0)  # absent (or generation 0): the run starts above it
    while low - gone > 1:
        mid = (low + gone) // 2
        if _exists(storage, manifest_file(mid)):
            low = mid
        else:
            gone = mid
    return low
