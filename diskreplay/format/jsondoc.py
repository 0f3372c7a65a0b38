"""Signed JSON documents: parsing, checksums (``signed_bytes``) and the checks of a header's fields."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, Callable, Collection, Dict, Mapping, Optional, Tuple

import pyarrow as pa

from .._fileio import crc32c, read_file
from ..errors import ArgumentError, CorruptStoreError, FormatError
from .names import FORMAT_VERSION, MAX_JSON_BYTES


def int_field(doc: Mapping[str, Any], key: str, where: str, *, lo: int = 0, hi: int = 1 << 62,
         optional: bool = False) -> Optional[int]:
    v = doc.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FormatError(f"Unsupported {key}={v!r} in {where}; expected an integer in [{lo}, {hi}]")
    return v


def evolve(obj: Any, changes: Mapping[str, Any]) -> Any:
    """``dataclasses.replace`` for the frozen records of this module (no ``__post_init__``, no
    ``InitVar``): a copy of the instance dict. ``replace`` re-runs ``__init__``, and a
    multi-writer commit makes a dozen such copies (each delta it applies shifts its segment
    entries and evolves the manifest)."""
    names = _FIELDS.get(type(obj))
    if names is None:
        names = _FIELDS[type(obj)] = frozenset(f.name for f in fields(obj))
    if not names.issuperset(changes):
        raise ArgumentError(f"{type(obj).__name__} has no field(s) {sorted(set(changes) - names)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    # what a record made once of its fields (SegmentEntry.json_bytes, files) is of the old ones
    new.__dict__.pop("_json", None)
    new.__dict__.pop("_files", None)
    new.__dict__.update(changes)
    return new


_FIELDS: Dict[type, frozenset] = {}


def check_header(doc: Any, fmt: str, where: str, versions: Tuple[int, ...] = (FORMAT_VERSION,)
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


def parse_json(raw: bytes, path: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also 4300+ digit ints
        raise CorruptStoreError(f"{path} is not valid JSON ({type(exc).__name__}: {exc})") from None


def read_json(path: str) -> Any:
    """Parse a small JSON file, turning every failure into CorruptStoreError."""
    return parse_json(read_file(path, MAX_JSON_BYTES), path)


def read_signed_json(path: str) -> Tuple[Any, bool]:
    """A signed JSON file and whether its bytes already proved its checksum (see ``signed_bytes``)."""
    raw = read_file(path, MAX_JSON_BYTES)
    return parse_json(raw, path), signature_in_bytes(raw)


def signed_doc(body: dict) -> dict:
    """``body`` plus a ``checksum``: CRC-32C of its canonical JSON."""
    return {**body, "checksum": crc32c(canonical_json(body))}


def signed_bytes(body: dict) -> bytes:
    """The file form of a signed document: its canonical JSON with ``"checksum"`` appended last.

    The checksum is the CRC-32C of the canonical JSON of ``body`` (sorted keys,
    no spaces), which is exactly the file's bytes before ``,"checksum":`` plus
    the closing brace, so a reader verifies it without serialising again.
    """
    text = canonical_json(body)
    return text[:-1] + b',"checksum":%d}' % crc32c(text)


def signature_in_bytes(raw: bytes) -> bool:
    i = raw.rfind(b',"checksum":')  # (``raw``: bytes, or a map of the file)
    if i < 0 or raw[-1:] != b"}":
        return False
    try:
        value = int(raw[i + 12:-1])
    except ValueError:
        return False
    # the checksum of the bytes before it, then of the closing brace: no copy of a long manifest
    return crc32c(b"}", crc32c(pa.py_buffer(raw).slice(0, i))) == value


def check_signature(doc: Mapping[str, Any], where: str) -> None:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    if doc.get("checksum") != crc32c(canonical_json(body)):
        raise CorruptStoreError(f"{where} fails its checksum; the file is damaged")


def canonical_json(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def entry_list(doc: Mapping[str, Any], key: str, versions: Collection[int], *, optional_in: Collection[int] = (),
               limit: int, what: str, parse: Callable[[Any, str], Any], where: str) -> Tuple[Any, ...]:
    """A document's list ``key`` of entries (``parse(item, where)`` each): a non-empty list in
    ``versions`` (absent where the version is in ``optional_in``: no entries), absent in any other.

    >>> entry_list({"version": 5}, "media", (5,), optional_in=(5,), limit=10, what="media blobs",
    ...            parse=lambda e, w: e, where="m.json")
    ()
    """
    raw, version = doc.get(key), doc["version"]
    if version not in versions or (raw is None and version in optional_in):
        if raw is not None:
            raise FormatError(f"Unsupported {key} in {where} (version {version}); expected them only in "
                              f"version {' or '.join(map(str, sorted(versions)))}")
        return ()
    if not isinstance(raw, list) or not raw or len(raw) > limit:
        raise FormatError(f"Unsupported {key} {raw!r:.200} in {where}; expected a non-empty list of {what}")
    return tuple(parse(e, where) for e in raw)
