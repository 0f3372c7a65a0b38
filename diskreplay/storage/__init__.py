"""Where a store's files live: a local directory or an S3-compatible bucket.

:class:`Storage` is the interface (module :mod:`diskreplay.storage.base`
spells out its contract); :class:`PosixStorage` implements it over a
directory and :class:`S3Storage` over ``s3://bucket/prefix`` (needs
``pip install 'diskreplay[s3]'``; obstore is imported only when one is made).
:func:`open_storage` picks one from a path or URL.

>>> import tempfile, shutil
>>> root = tempfile.mkdtemp()
>>> open_storage(root)
PosixStorage(...)
>>> shutil.rmtree(root)
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from ._cache import CacheStats
from ._posix import PosixStorage
from ._s3 import S3Storage, parse_s3_url
from .base import Storage, check_rel
from ..errors import ArgumentError

__all__ = ["CacheStats", "PosixStorage", "S3Storage", "Storage", "check_rel", "is_remote",
           "open_storage", "parse_s3_url"]


def is_remote(path: Any) -> bool:
    """True when ``path`` is an object-store URL rather than a local path.

    >>> is_remote("s3://bucket/store"), is_remote("/data/store")
    (True, False)
    """
    return isinstance(path, str) and path.startswith("s3://")


def open_storage(path: Any, storage_options: Optional[Mapping[str, Any]] = None,
                 **cache_options: Any) -> Storage:
    """:class:`S3Storage` for an ``s3://`` URL, :class:`PosixStorage` for a local path.

    ``cache_options`` (``cache_dir``, ``cache_bytes``, ...) go to :class:`S3Storage`.

    >>> import tempfile, shutil
    >>> root = tempfile.mkdtemp()
    >>> st = open_storage(root)
    >>> st.write_new("segments/1.arrow", b"rows"); st.list("segments")
    ['1.arrow']
    >>> type(open_storage("s3://bucket/run", {"endpoint": "http://127.0.0.1:9000"})).__name__
    'S3Storage'
    >>> shutil.rmtree(root)
    """
    if is_remote(path):
        return S3Storage(path, storage_options, **cache_options)
    if storage_options:
        raise ArgumentError(f"storage_options are for s3:// URLs; {path!r} is a local path")
    return PosixStorage(os.fspath(path))
