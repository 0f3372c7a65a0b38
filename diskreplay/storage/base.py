"""The storage interface a store's committer does all its file I/O through.

A store's files are addressed by *relative paths*: ``/``-separated, below the
store's root, never absolute, never with ``..`` or empty parts (so no path
from a manifest can escape the store). Two implementations exist: a
directory (:class:`~diskreplay.storage.PosixStorage`) and an S3-compatible
bucket prefix (:class:`~diskreplay.storage.S3Storage`). The contract below is
what both honour; ``tests/test_storage.py`` runs it against each.

=================================  ==========================================
``read_bytes(rel)``                the whole file; ``FileNotFoundError`` if absent
``read_range(rel, start, end)``    bytes ``[start, end)``, short at the end of the
                                   file (like ``pread``); ``b""`` past it
``size(rel)``                      its length in bytes
``list(reldir)``                   names of the files directly in ``reldir``,
                                   sorted; ``[]`` when there is none
``write_new(rel, data)``           durably create a file whose name no one else
                                   writes (a segment); readers never see it
                                   partially written
``put_if_absent(rel, data)``       atomically create ``rel`` only if absent;
                                   ``True`` if this call created it, ``False``
                                   if a file with other bytes was already there
                                   (the existing file is untouched)
``replace(rel, data)``             durably and atomically replace ``rel``
``delete(rel)``                    remove ``rel``; absent is not an error
``sync_dir(reldir)``               make creations and deletions in ``reldir``
                                   durable (a no-op where they already are)
``local_path(rel)``                a local file with ``rel``'s bytes, for
                                   ``mmap``; only for immutable files
=================================  ==========================================

Names starting with ``.`` are the storage's own (temporary files, probes) and
never appear in :meth:`Storage.list`.
"""

from __future__ import annotations

import operator
from ..errors import ArgumentError
from typing import List, Protocol, Tuple, Union, runtime_checkable

Buffer = Union[bytes, bytearray, memoryview]


@runtime_checkable
class Storage(Protocol):
    """What a store needs from the place its files live (see the module docstring).

    >>> from diskreplay.storage import PosixStorage, Storage
    >>> import tempfile, shutil
    >>> root = tempfile.mkdtemp()
    >>> isinstance(PosixStorage(root), Storage)
    True
    >>> shutil.rmtree(root)
    """

    url: str

    def read_bytes(self, rel: str) -> bytes: ...

    def read_range(self, rel: str, start: int, end: int) -> bytes: ...

    def size(self, rel: str) -> int: ...

    def list(self, reldir: str) -> List[str]: ...

    def write_new(self, rel: str, data: Buffer) -> None: ...

    def put_if_absent(self, rel: str, data: Buffer) -> bool: ...

    def replace(self, rel: str, data: Buffer) -> None: ...

    def delete(self, rel: str) -> None: ...

    def sync_dir(self, reldir: str) -> None: ...

    def local_path(self, rel: str) -> str: ...


def check_rel(rel: str, *, allow_root: bool = False) -> str:
    """Return ``rel`` if it is a safe store-relative path, else raise ``ValueError``.

    >>> check_rel("segments/00000001.arrow")
    'segments/00000001.arrow'
    >>> check_rel("../etc/passwd")
    Traceback (most recent call last):
    ...
    diskreplay.errors.ArgumentError: path '../etc/passwd' is not a store-relative path: use '/'-separated names below the store root, without '', '.' or '..' parts and without a leading '/'
    """
    if not isinstance(rel, str):
        raise ArgumentError(f"a store-relative path must be a str, got {type(rel).__name__}")
    if allow_root and rel in ("", "."):
        return ""
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise ArgumentError(f"path {rel!r} is not a store-relative path: use '/'-separated names below the "
                         "store root, without '', '.' or '..' parts and without a leading '/'")
    return rel


def check_range(rel: str, start: int, end: int) -> Tuple[int, int]:
    """Return ``(start, end)`` as ints; ``ValueError`` unless ``0 <= start <= end``.

    >>> check_range("x", 0, 3)
    (0, 3)
    """
    try:
        lo, hi = operator.index(start), operator.index(end)
    except TypeError:
        lo = hi = -1
    if not 0 <= lo <= hi:
        raise ArgumentError(f"byte range [{start!r}, {end!r}) of {rel!r} is invalid: need integers with "
                         "0 <= start <= end")
    return lo, hi
