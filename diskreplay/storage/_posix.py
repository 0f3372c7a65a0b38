"""A directory as storage: the reference implementation of the contract.

It is deliberately small: it exists so that the storage contract is
executable against a plain filesystem next to the object store, and as the
model the store's own local backend is checked against.
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import List

from .._fileio import TMP_PREFIX, durable_write, fsync_dir
from .base import Buffer, check_range, check_rel
from ..errors import StoreIOError, StoreNotFoundError


class PosixStorage:
    """Files below a local directory, written with fsync and atomic renames.

    ``put_if_absent`` is ``link(2)`` of a fully written temporary file onto
    the final name: ``link`` fails with ``EEXIST`` instead of replacing, so of
    racing creators exactly one wins, and the winner's file is complete when
    it appears.

    >>> import tempfile, shutil
    >>> root = tempfile.mkdtemp()
    >>> st = PosixStorage(root)
    >>> st.put_if_absent("manifests/1.json", b"{}"), st.put_if_absent("manifests/1.json", b"[]")
    (True, False)
    >>> st.read_bytes("manifests/1.json"), st.list("manifests")
    (b'{}', ['1.json'])
    >>> shutil.rmtree(root)
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root

    def _path(self, rel: str, *, allow_root: bool = False) -> str:
        rel = check_rel(rel, allow_root=allow_root)
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def _parent(self, path: str) -> str:
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        return parent

    def read_bytes(self, rel: str) -> bytes:
        with open(self._path(rel), "rb") as f:
            return f.read()

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        start, end = check_range(rel, start, end)
        fd = os.open(self._path(rel), os.O_RDONLY)
        try:
            out = bytearray()
            while start + len(out) < end:
                chunk = os.pread(fd, end - start - len(out), start + len(out))
                if not chunk:
                    break
                out += chunk
            return bytes(out)
        finally:
            os.close(fd)

    def size(self, rel: str) -> int:
        return os.stat(self._path(rel)).st_size

    def list(self, reldir: str) -> List[str]:
        path = self._path(reldir, allow_root=True)
        try:
            with os.scandir(path) as it:
                return sorted(e.name for e in it if e.is_file(follow_symlinks=False)
                              and not e.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def write_new(self, rel: str, data: Buffer) -> None:
        path = self._path(rel)
        self._parent(path)
        durable_write(path, data, sync_dir=False)

    def put_if_absent(self, rel: str, data: Buffer) -> bool:
        path = self._path(rel)
        parent = self._parent(path)
        tmp = os.path.join(parent, f"{TMP_PREFIX}{os.path.basename(path)}.{secrets.token_hex(6)}")
        durable_write(tmp, data, sync_dir=False, atomic=False)
        try:
            os.link(tmp, path)
        except FileExistsError:
            # The same bytes already there are this writer's own earlier
            # attempt (as on S3, where a lost response is retried).
            return self.read_bytes(rel) == bytes(memoryview(data).cast("B"))
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise StoreIOError(exc.errno, f"{self.root} is on a filesystem without hard links, so "
                              "create-if-absent cannot be atomic here; use a local disk, NFS or an "
                              "object store", path) from None
            raise
        finally:
            os.unlink(tmp)
        fsync_dir(parent)
        return True

    def replace(self, rel: str, data: Buffer) -> None:
        path = self._path(rel)
        self._parent(path)
        durable_write(path, data)

    def delete(self, rel: str) -> None:
        try:
            os.unlink(self._path(rel))
        except FileNotFoundError:
            pass

    def sync_dir(self, reldir: str) -> None:
        path = self._path(reldir, allow_root=True)
        if os.path.isdir(path):
            fsync_dir(path)

    def local_path(self, rel: str) -> str:
        path = self._path(rel)
        if not os.path.isfile(path):
            raise StoreNotFoundError(errno.ENOENT, "no such file in the store", path)
        return path

    def fetch_ranges(self, rel: str, ranges, *, size=None) -> str:
        """The file itself: every range of a local file is already present
        (the same call as :meth:`S3Storage.fetch_ranges`, so readers need no branch)."""
        return self.local_path(rel)

    def __repr__(self) -> str:
        return f"PosixStorage({self.root!r})"
