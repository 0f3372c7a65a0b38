"""Reading a store's documents: always through its :class:`~diskreplay.storage.base.Storage`.

A directory given as a path is read through a :class:`~diskreplay.storage.local.LocalStorage`
of it, so a local store and an object store are read by one code path; where they differ
(whether a listing can be trusted) the storage says so by its capabilities.
"""

from __future__ import annotations

import os
from typing import Any, Tuple, Union

from ..storage.base import Storage
from ..storage.local import LocalStorage
from .names import MAX_JSON_BYTES
from .jsondoc import parse_json, signature_in_bytes

#: what the format code reads and writes through: a :class:`Storage`, or a directory's path, which
#: is read through a :class:`LocalStorage` of it
StorageLike = Union[Storage, str, "os.PathLike[str]"]


def as_storage(root: StorageLike) -> Storage:
    """``root`` itself when it is a storage, else the directory it names read through a LocalStorage.

    >>> as_storage("/tmp/store").url
    '/tmp/store'
    """
    return LocalStorage(os.fspath(root)) if isinstance(root, (str, os.PathLike)) else root


def location(root: StorageLike, rel: str) -> str:
    """How messages name ``rel`` of ``root`` (a directory path, or the storage's URL and the name)."""
    url = os.fspath(root) if isinstance(root, (str, os.PathLike)) else root.url
    return f"{url.rstrip('/')}/{rel}"


def read_signed(root: StorageLike, rel: str) -> Tuple[Any, bool]:
    """A signed JSON document of the store and whether its bytes already proved its checksum."""
    raw = as_storage(root).read_bytes(rel, MAX_JSON_BYTES)
    return parse_json(raw, location(root, rel)), signature_in_bytes(raw)


def file_exists(root: StorageLike, rel: str) -> bool:
    return as_storage(root).exists(rel)
