"""Where a store's files live: the storage interface and its backends, as peers.

* :mod:`.base`: the interface a store does its I/O through, and its contract: :class:`Storage`
  (bytes) and :class:`Publisher` (the commit protocol's primitives, on top of the bytes);
* :mod:`.local`: :class:`LocalStorage`, a directory on a POSIX filesystem;
* :mod:`.s3`: :class:`S3Storage`, ``s3://bucket/prefix`` (needs ``pip install 'diskreplay[s3]'``;
  obstore is imported only when one is made), with :mod:`.cache`, its local page cache;
* :mod:`.memory`: :class:`MemoryStorage`, ``memory://name``, files in this process's memory, shared
  by every store of that name in the process (tests, examples).

:func:`open_storage` picks one from a path or URL.

>>> is_remote("s3://bucket/store")
True
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, Mapping, Optional

from ..errors import ArgumentError
from .base import Publisher, Storage, check_rel
from .cache import CacheStats
from .local import LocalStorage
from .memory import MemoryStorage
from .s3 import S3Storage, parse_s3_url

__all__ = ["CacheStats", "LocalStorage", "MemoryStorage", "Publisher", "S3Storage", "Storage", "check_rel", "is_remote",
           "is_url", "open_storage", "parse_s3_url"]


def _s3(url: str, storage_options: Optional[Mapping[str, Any]], **cache_options: Any) -> Storage:
    return S3Storage(url, storage_options, **cache_options)


def _memory(url: str, storage_options: Optional[Mapping[str, Any]], **cache_options: Any) -> Storage:
    if storage_options:
        raise ArgumentError(f"storage_options are for s3:// URLs; {url!r} is a memory store (leave "
                            "storage_options out)")
    return MemoryStorage(url, **cache_options)


#: the URL schemes :func:`open_storage` knows, each with the function that opens one (a new backend
#: adds its line); anything else is a directory's path
BACKENDS: Dict[str, Callable[..., Storage]] = {"s3": _s3, "memory": _memory}


def is_url(path: Any) -> bool:
    """True when ``path`` is a URL of a backend :func:`open_storage` knows (else a directory's path).

    >>> is_url("s3://bucket/store"), is_url("memory://run"), is_url("/data/store"), is_url("gs://b/s")
    (True, True, False, False)
    """
    return _scheme(path) is not None


def _scheme(path: Any) -> Optional[str]:
    m = re.match(r"([a-z][a-z0-9+.-]*)://", path) if isinstance(path, str) else None
    return m.group(1) if m is not None and m.group(1) in BACKENDS else None


def is_remote(path: Any) -> bool:
    """True when ``path`` is an object-store URL rather than a local path.

    >>> is_remote("s3://bucket/store"), is_remote("/data/store")
    (True, False)
    """
    return isinstance(path, str) and path.startswith("s3://")


def open_storage(path: Any, storage_options: Optional[Mapping[str, Any]] = None, *,
                 writer_id: str = "", **cache_options: Any) -> Storage:
    """The storage behind a store path: :class:`~diskreplay.storage.S3Storage` for an
    ``s3://bucket/prefix`` URL, :class:`MemoryStorage` for ``memory://name``, :class:`LocalStorage`
    for a directory.

    ``cache_options`` (``cache_dir``, ``cache_bytes``) configure the object store's
    local cache; ``storage_options`` its client (``endpoint``, credentials, ...).

    >>> import tempfile, shutil
    >>> root = tempfile.mkdtemp()
    >>> open_storage(root).url == root
    True
    >>> type(open_storage("s3://bucket/run", {"endpoint": "http://127.0.0.1:9"})).__name__
    'S3Storage'
    >>> shutil.rmtree(root)
    """
    scheme = _scheme(path)
    if scheme is not None:
        return BACKENDS[scheme](path, storage_options, **{k: v for k, v in cache_options.items() if v is not None})
    if storage_options:
        raise ArgumentError(f"storage_options are for s3:// URLs; {os.fspath(path)!r} is a local path (leave "
                            "storage_options out)")
    return LocalStorage(os.path.abspath(os.fspath(path)), writer_id)
