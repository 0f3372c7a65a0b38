"""Reading a store's documents from a directory or through a Storage (an object store has no paths)."""

from __future__ import annotations

import os
from typing import Any, Tuple

from .names import MAX_JSON_BYTES
from .jsondoc import parse_json, read_signed_json, signature_in_bytes


# ---------------------------------------------------------------------------
# Reading through a Storage (an object store has no paths to open)


def is_object_storage(root: Any) -> bool:
    """True for a storage whose files cannot be mapped in place (an object store); a local Storage
    is read as its directory (one code path for local stores)."""
    return not getattr(root, "can_map", True)


def as_dir(root: Any) -> Any:
    """``root`` itself, or a local Storage's directory."""
    return root if isinstance(root, (str, os.PathLike)) or is_object_storage(root) else root.url


def location(root: Any, rel: str) -> str:
    """How messages name ``rel`` of ``root`` (a path, or the object's URL)."""
    return f"{root.url.rstrip('/')}/{rel}" if is_object_storage(root) else os.path.join(root, rel)


def read_signed(root: Any, rel: str) -> Tuple[Any, bool]:
    if not is_object_storage(root):
        return read_signed_json(os.path.join(root, rel))
    raw = root.read_bytes(rel, MAX_JSON_BYTES)
    return parse_json(raw, location(root, rel)), signature_in_bytes(raw)


def file_exists(storage: Any, rel: str) -> bool:
    if not is_object_storage(storage):
        return os.path.exists(os.path.join(storage, rel))
    try:
        storage.size(rel)
        return True
    except FileNotFoundError:
        return False
