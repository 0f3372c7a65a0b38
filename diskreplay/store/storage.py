"""Where a store's files live: the few file operations the commit and read paths need.

The commit protocol (``committer.py``) and the store's reads are written
against :class:`~diskreplay.storage.base.Storage` only (its contract is in
that module; ``Storage`` here is that class), so the object-store backend
(:class:`~diskreplay.storage.S3Storage`, where "create if absent" is a
conditional PUT) plugs in without touching them. :class:`LocalStorage` is
the POSIX implementation; its writes keep the fast paths the single-writer
store always had (a fresh file written in place, one rename for a replaced
one).

Paths are relative to the store (``segments/000000000007.arrow``), built from
integer ids by ``diskreplay.format``, never taken from a file's contents.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from .._fileio import (TMP_PREFIX, Buffer, crash_point, durable_write, fsync_dir, naming_errors, read_file,
                       remove_quietly, run_concurrently, write_and_sync_fd)
from ..errors import ArgumentError, StoreIOError, UnsupportedFilesystemError
from ..storage.base import Storage, check_range, check_rel  # the one interface; its local implementation here

__all__ = ["LocalStorage", "Storage", "open_storage"]


class LocalStorage(Storage):
    """A store directory on a POSIX filesystem (local disk, NFS, Lustre).

    >>> import tempfile
    >>> s = LocalStorage(tempfile.mkdtemp())
    >>> s.put_if_absent("a", b"1"), s.put_if_absent("a", b"2"), s.read_bytes("a")
    (True, False, b'1')
    >>> import shutil; shutil.rmtree(s.root)
    """

    def __init__(self, root: str, writer_id: str = "") -> None:
        self.root = root
        #: unique per writer: temporary names of concurrent writers never collide
        self.writer_id = writer_id or str(os.getpid())
        #: (data, temporary name, whether a link of it lost) of a staged or lost publish
        self._staged: Optional[Tuple[Buffer, str, bool]] = None

    def local_path(self, rel: str) -> str:
        check_rel(rel, allow_root=True)  # no name from anywhere may leave the store
        # os.path.join's generality costs more than the check (a commit asks for ~20 paths)
        return (self.root + rel if self.root.endswith("/") else f"{self.root}/{rel}") if rel else self.root

    def read_bytes(self, rel: str, limit: Optional[int] = None) -> bytes:
        return read_file(self.local_path(rel), limit)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        start, end = check_range(rel, start, end)
        fd = os.open(self.local_path(rel), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

    def size(self, rel: str) -> int:
        return os.lstat(self.local_path(rel)).st_size

    def age(self, rel: str) -> float:
        return time.time() - os.lstat(self.local_path(rel)).st_mtime

    def list(self, reldir: str) -> List[str]:
        try:
            return os.listdir(self.local_path(reldir))
        except FileNotFoundError:
            return []

    def write_new(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> None:
        # in place: no manifest names this file yet, so a torn one is garbage (saves a rename)
        durable_write(self.local_path(rel), data, step=step, sync_dir=False, atomic=False)

    def _temp(self, rel: str) -> str:
        directory, name = os.path.split(rel)
        return os.path.join(directory, f"{TMP_PREFIX}{name}.{self.writer_id}")

    def put_if_absent(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> bool:
        """Create ``rel`` with ``data`` unless it exists; False if it does. Atomic and
        never partial: the bytes are written and fsynced under a temporary name, then
        ``link()``ed, which (unlike ``rename``) fails with EEXIST instead of replacing."""
        tmp = self._temp(rel)
        try:
            durable_write(self.local_path(tmp), data, sync_dir=False, atomic=False)
            if step:
                crash_point(f"{step}.written")
            if not self.link_new(tmp, rel):
                return False
            if step:
                crash_point(f"{step}.renamed")
            return True
        finally:
            self._drop_temp(tmp)

    def _drop_temp(self, tmp: str) -> None:
        # after a link the commit stands whatever happens here: a temporary file left
        # behind is garbage that clean-up removes, never a reason to fail the commit
        try:
            remove_quietly(self.local_path(tmp))
        except OSError:
            pass

    def link_new(self, src: str, rel: str) -> bool:
        """Give the file ``src`` the name ``rel`` unless ``rel`` exists (False then): the atomic
        create-if-absent of a multi-writer commit, ``link()``, which fails with EEXIST where
        ``rename`` would replace."""
        try:
            os.link(self.local_path(src), self.local_path(rel))
        except FileExistsError:
            return False
        return True

    def link_candidates(self, rel_of, data: Buffer, first: int, *, tries: int = 1 << 16,
                        step: Optional[str] = None) -> Tuple[int, str]:
        """Create ``data`` durably under the first free name ``rel_of(i)``, ``i = first, first + 1,
        ...``; returns ``(i, name)`` (the directory entry is the caller's to sync). How a writer of
        a multi-writer store gets a name no other writer can have."""
        i, rel = self.reserve(rel_of, first, tries=tries)
        try:
            self.write_files([(rel, data, step)])
        except BaseException:
            remove_quietly(self.local_path(rel))
            raise
        return i, rel

    def _naming(self, rel: str, doing: str):
        """An ``OSError`` without a file name (``write``, ``fsync``) becomes a ``StoreIOError`` naming it."""
        return naming_errors(self.local_path(rel), doing)

    def _create_exclusive(self, rel: str) -> int:
        return os.open(self.local_path(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)

    def reserve(self, rel_of: Callable[[int], str], first: int, *, tries: int = 1 << 16) -> Tuple[int, str]:
        """``O_EXCL`` creates the name itself (no temporary file, no link): the file is written in
        place later, which is safe because no manifest names it until its commit."""
        for i in range(first, first + tries):
            try:
                fd = self._create_exclusive(rel_of(i))
                with self._naming(rel_of(i), "closing"):
                    os.close(fd)
                return i, rel_of(i)
            except FileExistsError:
                continue
        raise StoreIOError(errno.EEXIST, f"no free name after {tries} tries", rel_of(first))

    def write_files(self, files: Sequence[Tuple[str, Buffer, Optional[str]]], dirs: Sequence[str] = ()) -> None:
        """Every file is opened (created) first, so the directory fsyncs cover their entries; then all
        writes+fsyncs and directory fsyncs run at once (they share the journal commits and cache
        flushes: see :func:`run_concurrently`). On an error every descriptor is closed and the
        error raised; the caller removes the files."""
        fds: List[int] = []
        try:
            for rel, _, _ in files:
                fds.append(os.open(self.local_path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                                   0o644))
            for d in dirs:
                fds.append(os.open(self.local_path(d), os.O_RDONLY | os.O_DIRECTORY))

            def write(fd: int, rel: str, data: Buffer, step: Optional[str]) -> Callable[[], None]:
                def run() -> None:
                    with self._naming(rel, "writing"):
                        write_and_sync_fd(fd, data)
                    if step:  # no rename: ".renamed" is hit too, where a temporary name's rename would be
                        crash_point(f"{step}.written")
                        crash_point(f"{step}.renamed")
                return run

            def sync(fd: int, rel: str) -> Callable[[], None]:
                def run() -> None:
                    with self._naming(rel, "syncing the directory"):
                        os.fsync(fd)
                return run

            calls = [write(fd, rel, data, step) for fd, (rel, data, step) in zip(fds, files)]
            calls += [sync(fd, d) for fd, d in zip(fds[len(files):], dirs)]
            run_concurrently(calls)
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def replace(self, rel: str, data: Buffer, *, step: Optional[str] = None, sync: bool = True) -> None:
        durable_write(self.local_path(rel), data, step=step, sync_dir=sync)

    def stage(self, reldir: str, data: Buffer, files: Sequence[Tuple[str, Buffer, Optional[str]]] = (),
              dirs: Sequence[str] = (), *, step: Optional[str] = None) -> None:
        """Write ``files`` and, under a temporary name in ``reldir``, a manifest-to-be ``data``
        whose generation is not known yet (an append delta), and make them and ``dirs`` durable
        in one wait: the next :meth:`publish` of the same ``data`` object only links it, so the
        race for a generation is over the link alone."""
        self.discard_staged()
        tmp = f"{reldir}/{TMP_PREFIX}staged.{self.writer_id}"
        try:
            self.write_files(list(files) + [(tmp, data, None)], dirs)
        except BaseException:
            self._drop_temp(tmp)
            raise
        self._staged = (data, tmp, False)
        if files:
            crash_point("segments.synced")
        if step:
            crash_point(f"{step}.written")

    def publish(self, rel: str, data: Buffer, files: Sequence[Tuple[str, Buffer, Optional[str]]] = (),
                dirs: Sequence[str] = (), *, exclusive: bool, step: Optional[str] = None) -> bool:
        """The manifest's temporary file is written and fsynced together with ``files`` and ``dirs``
        (one wait on the disk for all of them, see :meth:`write_files`); only then is it linked
        (``exclusive``) or renamed onto ``rel``. A file :meth:`stage` wrote for this ``data``, or
        kept by a publish of it whose link lost, is linked as it is (:meth:`discard_staged`
        drops it)."""
        staged = self._staged is not None and self._staged[0] is data and not files
        tmp = self._staged[1] if staged else self._temp(rel)
        if staged:
            if self._staged[2] and step:
                crash_point(f"{step}.written")  # linking again after a lost race
            self._staged = None
        # else a staged delta stays for a retry: this is a full manifest (its base was a checkpoint's)
        outcome = ""  # "lost": keep the temporary file for the next try; "renamed": it is gone
        try:
            if not staged:
                self.write_files(list(files) + [(tmp, data, None)], dirs)
                if files:
                    crash_point("segments.synced")
                if step:
                    crash_point(f"{step}.written")
            if exclusive:
                if not self.link_new(tmp, rel):
                    outcome = "lost"
                    return False
            else:
                os.replace(self.local_path(tmp), self.local_path(rel))
                outcome = "renamed"
            if step:
                crash_point(f"{step}.renamed")
            return True
        finally:
            if outcome == "lost" and staged:
                self._staged = (data, tmp, True)
            elif outcome != "renamed":
                self._drop_temp(tmp)
            if outcome != "lost":
                self.discard_staged()  # committed (or failed): a staged delta is not needed any more

    def discard_staged(self) -> None:
        """Remove the temporary file a lost publish kept (see :meth:`publish`)."""
        if self._staged is not None:
            self._drop_temp(self._staged[1])
            self._staged = None

    def delete(self, rel: str) -> bool:
        return remove_quietly(self.local_path(rel))

    def sync_dir(self, reldir: str) -> None:
        fsync_dir(self.local_path(reldir))

    def ensure_dir(self, reldir: str) -> None:
        if not os.path.isdir(self.local_path(reldir)):
            os.makedirs(self.local_path(reldir), exist_ok=True)
            fsync_dir(self.root)

    def probe_create_if_absent(self, reldir: str) -> None:
        """Refuse a filesystem where ``link()`` does not fail with EEXIST on an existing
        name (a multi-writer commit would silently replace a concurrent one)."""
        name = f"{reldir}/{TMP_PREFIX}probe.{self.writer_id}"
        try:
            first = self.put_if_absent(name, b"1")
            second = self.put_if_absent(name, b"2")
            kept = self.read_bytes(name)
        except OSError as exc:
            raise UnsupportedFilesystemError(
                exc.errno, f"multi_writer=True needs an atomic create-if-absent (link() failing with EEXIST) "
                f"and {self.local_path(reldir)} does not provide one ({exc.strerror}); use a single-writer store",
                self.local_path(reldir)) from None
        finally:
            self.delete(name)
        if not (first and not second and kept == b"1"):
            raise UnsupportedFilesystemError(
                errno.ENOTSUP, f"multi_writer=True needs an atomic create-if-absent and {self.local_path(reldir)} "
                "let link() replace an existing file; use a single-writer store", self.local_path(reldir))

    # -- the rest of the storage interface (local files need nothing more) --

    #: a local directory: every file is already present, listing is consistent
    remote = False

    @property
    def url(self) -> str:
        return self.root

    def fetch_ranges(self, rel: str, ranges, *, size: Optional[int] = None) -> str:
        """The file itself: every range of a local file is present (the call readers
        make on any storage, so they need no branch for local stores)."""
        return self.local_path(rel)


def open_storage(path: Any, storage_options: Optional[Mapping[str, Any]] = None, *,
                 writer_id: str = "", **cache_options: Any) -> Storage:
    """The storage behind a store path: :class:`~diskreplay.storage.S3Storage` for an
    ``s3://bucket/prefix`` URL, :class:`LocalStorage` for a directory.

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
    from ..storage import S3Storage, is_remote

    if is_remote(path):
        return S3Storage(path, storage_options, **{k: v for k, v in cache_options.items() if v is not None})
    if storage_options:
        raise ArgumentError(f"storage_options are for s3:// URLs; {os.fspath(path)!r} is a local path (leave "
                            "storage_options out)")
    return LocalStorage(os.path.abspath(os.fspath(path)), writer_id)
