"""``FORMAT.json``: a store's options (``StoreOptions``), its format features, and the shared schema file."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Tuple

from ..errors import FormatError
from ..schema import Schema
from .names import (APPEND_DELTAS_VERSION, FORMAT_FILE, FORMAT_VERSION, INLINE_GROUPS_VERSION, MEDIA_FORMAT_VERSION, PATCHES_FORMAT_VERSION,
                    LATE_COLUMNS_FORMAT_VERSION, MULTI_WRITER_VERSION, SCHEMA_FILE, SCHEMA_FORMAT, STORE_FORMAT)
from .jsondoc import check_header, check_signature, int_field, signed_bytes, signed_doc
from .access import StorageLike, as_storage, location, read_signed


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
    #: the manifests may name patches (values written for committed rows)
    patches: bool = False
    #: the manifests may name media blobs (docs/FORMAT.md, "Media")
    media: bool = False

    def to_dict(self) -> dict:
        return signed_doc(self.body())

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
        if self.patches:  # every feature named, as a diskreplay that reads version 6 checks them
            doc.update(version=PATCHES_FORMAT_VERSION, patches=True, multi_writer=self.multi_writer,
                       late_columns=self.late_columns, append_deltas=self.append_deltas,
                       inline_groups=self.inline_groups)
        if self.media:  # every feature named, patches included
            doc.update(version=MEDIA_FORMAT_VERSION, media=True, patches=self.patches, multi_writer=self.multi_writer,
                       late_columns=self.late_columns, append_deltas=self.append_deltas,
                       inline_groups=self.inline_groups)
        return doc

    @classmethod
    def from_dict(cls, doc: Any, where: str = FORMAT_FILE, verified: bool = False) -> "StoreOptions":
        doc = check_header(doc, STORE_FORMAT, where, (FORMAT_VERSION, MULTI_WRITER_VERSION,
                                                        LATE_COLUMNS_FORMAT_VERSION, APPEND_DELTAS_VERSION,
                                                        INLINE_GROUPS_VERSION, PATCHES_FORMAT_VERSION,
                                                        MEDIA_FORMAT_VERSION))
        if not verified:
            check_signature(doc, where)
        media = doc["version"] == MEDIA_FORMAT_VERSION
        if (doc.get("media", False) is True) is not media:
            raise FormatError(f"Unsupported media={doc.get('media')!r} with version {doc['version']} in {where}; "
                              f"expected true exactly in version {MEDIA_FORMAT_VERSION}")
        multi, late, deltas, inline, patches = _media_features(doc, where) if media else _format_features(doc, where)
        gk = doc.get("group_key")
        if gk is not None and (not isinstance(gk, str) or not gk):
            raise FormatError(f"Unsupported group_key {gk!r} in {where}; expected a column name or null")
        schema = doc.get("schema")
        return cls(
            group_key=gk,
            capacity_rows=int_field(doc, "capacity_rows", where, lo=1, optional=True),
            capacity_bytes=int_field(doc, "capacity_bytes", where, lo=1, optional=True),
            schema=None if schema is None else Schema.from_list(schema),
            multi_writer=multi,
            retain_seconds=int_field(doc, "retain_seconds", where, optional=True, hi=10 ** 9),
            late_columns=late,
            append_deltas=deltas,
            inline_groups=inline,
            patches=patches,
            media=media,
        )

    def with_stored_flags(self, root: StorageLike) -> "StoreOptions":
        """These options with every feature flag the stored FORMAT.json has turned on as well: what a
        writer that marks a feature (patches, media) writes, so that a writer whose options were read
        before another marked its feature does not turn that flag off again (flags only go on).

        >>> StoreOptions().with_stored_flags("/nonexistent").media
        False
        """
        try:
            stored = StoreOptions.read(root)
        except (OSError, FormatError):
            return self  # (nothing readable to keep: what this writer knows is all there is)
        return replace(self, late_columns=self.late_columns or stored.late_columns,
                       patches=self.patches or stored.patches, media=self.media or stored.media)

    def write(self, root: StorageLike) -> None:
        """Write ``FORMAT.json`` into ``root``: a directory or a :class:`~diskreplay.storage.Storage`."""
        as_storage(root).replace(FORMAT_FILE, signed_bytes(self.body()), step="format")

    @classmethod
    def read(cls, root: StorageLike) -> "StoreOptions":
        root = as_storage(root)
        path = location(root, FORMAT_FILE)
        try:
            doc, verified = read_signed(root, FORMAT_FILE)
            options = cls.from_dict(doc, path, verified)
        except FormatError as exc:
            raise (exc if path in str(exc) else FormatError(f"{exc} ({path})")) from None
        if options.multi_writer and options.schema is None:
            schema = read_shared_schema(root)
            if schema is not None:
                options = replace(options, schema=schema)
        return options


def _media_features(doc: Mapping[str, Any], where: str) -> Tuple[bool, bool, bool, bool, bool]:
    """The features of a version-7 FORMAT.json (media): every one an explicit flag."""
    keys = ("multi_writer", "late_columns", "append_deltas", "inline_groups", "patches")
    flags = tuple(doc.get(k) for k in keys)
    if not all(isinstance(f, bool) for f in flags) or (flags[2] and not flags[0]):
        raise FormatError(f"Unsupported features {dict(zip(keys, flags))} in {where}; expected each true or false "
                          "(append_deltas only with multi_writer)")
    return flags  # type: ignore[return-value]


def _format_features(doc: Mapping[str, Any], where: str) -> Tuple[bool, bool, bool, bool, bool]:
    """``(multi_writer, late_columns, append_deltas, inline_groups, patches)`` of a FORMAT.json
    document, checked against its version."""
    multi, late = doc.get("multi_writer", False), doc.get("late_columns", False)
    version = doc["version"]
    if (doc.get("patches", False) is True) is not (version == PATCHES_FORMAT_VERSION):
        raise FormatError(f"Unsupported patches={doc.get('patches')!r} with version {version} in {where}; expected "
                          f"true exactly in version {PATCHES_FORMAT_VERSION}")
    if version == PATCHES_FORMAT_VERSION:
        flags = tuple(doc.get(k) for k in ("multi_writer", "late_columns", "append_deltas", "inline_groups"))
        if not all(isinstance(f, bool) for f in flags) or (flags[2] and not flags[0]):
            named = dict(zip(("multi_writer", "late_columns", "append_deltas", "inline_groups"), flags))
            raise FormatError(f"Unsupported features {named} in {where}; expected each true or false (append_deltas "
                              "only with multi_writer)")
        return (*flags, True)  # type: ignore[return-value]
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
        return multi, late, deltas, True, False
    if version == APPEND_DELTAS_VERSION:
        if doc.get("append_deltas") is not True or multi is not True or not isinstance(late, bool):
            raise FormatError(f"Unsupported append_deltas={doc.get('append_deltas')!r} / multi_writer={multi!r} / "
                              f"late_columns={late!r} with version {version} in {where}; expected append_deltas "
                              "and multi_writer true and late_columns true or false")
        return True, late, True, False, False
    if doc.get("append_deltas", False) is not False:
        raise FormatError(f"Unsupported append_deltas={doc.get('append_deltas')!r} with version {version} in "
                          f"{where}; expected it only in version {APPEND_DELTAS_VERSION}")
    if version == LATE_COLUMNS_FORMAT_VERSION:
        if late is not True or not isinstance(multi, bool):
            raise FormatError(f"Unsupported late_columns={late!r} / multi_writer={multi!r} with version {version} "
                              f"in {where}; expected late_columns true and multi_writer true or false")
        return multi, True, False, False, False
    if late is not False:
        raise FormatError(f"Unsupported late_columns={late!r} with version {version} in {where}; expected it only "
                          f"in version {LATE_COLUMNS_FORMAT_VERSION}")
    if multi is not (version == MULTI_WRITER_VERSION):
        raise FormatError(f"Unsupported multi_writer={multi!r} with version {version} in {where}; "
                          f"expected true exactly in version {MULTI_WRITER_VERSION}")
    return multi, False, False, False, False


def shared_schema_bytes(schema: Schema) -> bytes:
    """The file form of a multi-writer store's ``SCHEMA.json``."""
    return signed_bytes({"format": SCHEMA_FORMAT, "version": FORMAT_VERSION, "schema": schema.to_list()})


def read_shared_schema(root: StorageLike) -> Optional[Schema]:
    """The schema a multi-writer store's first extend fixed, or None before it."""
    root = as_storage(root)
    path = location(root, SCHEMA_FILE)
    try:
        doc, verified = read_signed(root, SCHEMA_FILE)
    except FileNotFoundError:
        return None
    doc = check_header(doc, SCHEMA_FORMAT, path)
    if not verified:
        check_signature(doc, path)
    return Schema.from_list(doc.get("schema"))


def schema_file(options: "StoreOptions", unlocked: bool) -> str:
    """The file that holds a store's schema: SCHEMA.json for many writers and for storage without an
    exclusive lock, object storage (fixed by the first append of any writer), else FORMAT.json.

    >>> schema_file(StoreOptions(multi_writer=True), False), schema_file(StoreOptions(), False)
    ('SCHEMA.json', 'FORMAT.json')
    """
    return SCHEMA_FILE if options.multi_writer or unlocked else FORMAT_FILE
