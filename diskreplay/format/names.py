"""File and directory names of a store, the format names and versions its documents carry, and its limits."""

from __future__ import annotations

import re

from .._fileio import TMP_PREFIX
from ..errors import ArgumentError


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
_STORE_FILE_NAME = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\.|index-)?\d{12}\.(?:arrow|json)$"
                              r"|^media\.\d{12}\.bin$")


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
# FORMAT.json of a store that may hold patches (values written for committed rows, see
# PatchEntry) says version 6 and "patches": true, with every other feature as an explicit
# flag, written before the first commit that names a patch: a diskreplay without patches
# would take that commit's manifest (v4) for a damaged one, fall back to an older commit
# and, as a writer, collect the newer ones. With version 6 it refuses the store instead.
PATCHES_FORMAT_VERSION = 6
# A manifest that names patches says version 4 (holes and late columns may ride with it).
PATCHES_MANIFEST_VERSION = 4
# FORMAT.json of a store that may hold media blobs (MediaEntry, docs/FORMAT.md "Media") says
# version 7 and "media": true, with every other feature (patches included) as an explicit flag,
# written before the first commit that names a blob: a diskreplay without media refuses the
# store instead of taking that commit's manifest (v5) for a damaged one.
MEDIA_FORMAT_VERSION = 7
# A manifest that names media blobs says version 5 (holes, late columns and patches may ride with it).
MEDIA_MANIFEST_VERSION = 5
# An append delta that names or adds media blobs says version 3.
MEDIA_DELTA_VERSION = 3
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
MANIFEST_NAME = re.compile(r"^(\d{12})\.json$")
_STATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
MAX_ID = 10 ** 12 - 1


def segment_file(seg_id: int) -> str:
    return f"{SEGMENT_DIR}/{seg_id:012d}.arrow"


def patch_file(patch_id: int) -> str:
    """A patch's file: values for committed rows (docs/FORMAT.md, "Patches"), beside the segments."""
    return f"{SEGMENT_DIR}/patch.{patch_id:012d}.arrow"


def media_file(media_id: int) -> str:
    """A media blob's file (docs/FORMAT.md, "Media"), beside the segments.

    >>> media_file(7)
    'segments/media.000000000007.bin'
    """
    return f"{SEGMENT_DIR}/media.{media_id:012d}.bin"


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
