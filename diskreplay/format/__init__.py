"""On-disk format v1: file names, ``FORMAT.json``, the manifests and the files they name.

``docs/FORMAT.md`` is the specification; this module is its executable form.
Every JSON document carries ``format`` and an integer ``version`` and is
parsed into a frozen dataclass; anything unexpected raises ``FormatError``
("Unsupported …; expected …") or ``CorruptStoreError`` naming the file.
File names are never taken from a manifest: they are derived from integer ids,
so no manifest can point outside the store directory.
"""

# ruff: noqa: F401  (this package answers for its modules: ``from diskreplay import format as fmt``)
from __future__ import annotations

from ..errors import CorruptStoreError, FormatError
from .names import (APPEND_DELTAS_VERSION, CHECKPOINT_EVERY, DATA_DIRS, DEFAULT_RETAIN_SECONDS, DELTA_FORMAT,
                    FLOOR_FILE, FLOOR_FORMAT, FORMAT_FILE, FORMAT_VERSION, FORWARD_READS, GROUPS_DIR,
                    INLINE_GROUPS_VERSION, KEEP_MANIFESTS, MEDIA_DELTA_VERSION, MEDIA_FORMAT_VERSION,
                    MEDIA_MANIFEST_VERSION, LATE_COLUMNS_FORMAT_VERSION, LATE_COLUMNS_MANIFEST_VERSION,
                    LOCK_FILE, MANIFEST_DIR, MANIFEST_FORMAT, MANIFEST_NAME, MAX_DELTA_CHAIN, MAX_ID, MAX_JSON_BYTES,
                    MAX_RELISTS, MULTI_WRITER_VERSION, PATCHES_FORMAT_VERSION,
                    PATCHES_MANIFEST_VERSION, QUARANTINE_DIR, QUARANTINE_PENDING, REWRITE_DELTA_VERSION,
                    SCHEMA_FILE, SCHEMA_FORMAT, SEGMENT_DIR, STATE_DIR, STORE_FORMAT, TOKENS_DIR, TOKENS_FORMAT,
                    check_state_name, group_index_file, groups_file, is_data_file, is_store_entry, manifest_file, media_file, patch_file,
                    segment_file, state_file, token_log_file)
from .jsondoc import (canonical_json, check_header, check_signature, evolve, int_field, parse_json, read_json,
                      read_signed_json, signature_in_bytes, signed_bytes, signed_doc)
from .access import as_storage, file_exists, location, read_signed
from .options import (StoreOptions, read_shared_schema, schema_file, shared_schema_bytes)
from .entries import (COMMIT_STATS, GroupIndexEntry, LateColumn, MAX_TOKEN_CHARS, MediaEntry, PatchEntry, SegmentEntry, StateEntry,
                      TokenLog, TokenRecord, add_late_columns, parse_commit_stats, store_schema, version_problem)
from .tokens import batch_digest, parse_token_log, token_log_bytes
from .patches import PATCH_ROW, parse_patch
from .states import STATE_META, decode_state, encode_state, read_state_file
from .sidecars import (IndexedPages, encode_group_index, encode_group_sidecar, group_sidecar, inline_group,
                       inline_group_sidecar, read_group_index, read_group_sidecar, segment_local_rows)
from .segment_table import SEGMENT_TABLE_MIN, SegmentTable, SegmentTableEntry, segment_table_file, table_bytes
from .manifest import (HOLES_MANIFEST_VERSION, AppendDelta, Delta, Manifest, RewriteDelta, append_rows, delta_from_doc,
                       evict, live_media, live_patches, past_holes, rewrite_rows, with_chains)
from .floor import (FLOOR_BYTES, FLOOR_READS, floor_bytes, lowest_present, parse_floor, raise_floor, read_floor)
from .discovery import (ManifestBaseMissingError, list_generations, load_manifest, load_newest_manifest, manifest_docs,
                        newer_generation, read_forward, read_manifest, read_manifest_doc)
