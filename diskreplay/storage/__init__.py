"""Where a store's files live: the storage interface and the object-store backend.

:class:`Storage` is the one interface a store does its I/O through (module
:mod:`diskreplay.storage.base` spells out its contract). The local directory
implementation is :class:`diskreplay.store.storage.LocalStorage`;
:class:`S3Storage` implements it over ``s3://bucket/prefix`` (needs
``pip install 'diskreplay[s3]'``; obstore is imported only when one is made).
``diskreplay.store.storage.open_storage`` picks one from a path or URL.

>>> is_remote("s3://bucket/store")
True
"""

from __future__ import annotations

from typing import Any

from ._cache import CacheStats
from ._s3 import S3Storage, parse_s3_url
from .base import Storage, check_rel

__all__ = ["CacheStats", "S3Storage", "Storage", "check_rel", "is_remote", "parse_s3_url"]


def is_remote(path: Any) -> bool:
    """True when ``path`` is an object-store URL rather than a local path.

    >>> is_remote("s3://bucket/store"), is_remote("/data/store")
    (True, False)
    """
    return isinstance(path, str) and path.startswith("s3://")
