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

One module: the whole Storage and Publisher contract over a POSIX directory (durable
writes, create-if-absent links, reserved names, leases, held removals), each method a few
system calls that share its descriptors.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import stat
import time
import weakref
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .._fileio import (TMP_PREFIX, Buffer, WriterLock, boot_clock, crash_point, durable_write, forks, fsync_dir,
                       naming_errors, read_file, remove_quietly, run_concurrently, write_all, write_and_sync_fd)
from ..errors import OutputExistsError, StoreIOError, UnsupportedFilesystemError
from .base import Publisher, check_range, check_rel

__all__ = ["LocalStorage"]

INLINE_WRITE_BYTES = 1 << 20  # a file this small is written by the committing thread, then fsynced on the pool
PATHS_KEPT = 256  # local paths a storage remembers (a commit's names, the manifests' and directories')


class LocalStorage(Publisher):
    """A store directory on a POSIX filesystem (local disk, NFS, Lustre).

    >>> import tempfile
    >>> s = LocalStorage(tempfile.mkdtemp())
    >>> s.put_if_absent("a", b"1"), s.put_if_absent("a", b"2"), s.read_bytes("a")
    (True, False, b'1')
    >>> import shutil; shutil.rmtree(s.root)

    ``fsync=False`` never calls ``fsync`` (files or directories): writes stay atomic (a file
    is complete before it is named) and survive the writer process's death, but not a power
    loss or a kernel crash (see ``ReplayStore``'s ``fsync``).
    """

    def __init__(self, root: str, writer_id: str = "", *, fsync: bool = True, leases: bool = False) -> None:
        self.root = root
        self.fsync = fsync
        #: many writers: hold a shared ``flock`` on every file this writer creates until its commit
        #: is published or the file removed (see :meth:`hold`): another writer's clean-up never
        #: removes it, however long this writer is stopped, and it never removes another's file
        self.leases = leases
        #: whether the last publish got as far as its link (or rename): an error from it may be a
        #: link the server carries out later (NFS), so its outcome is not known
        self.link_attempted = False
        #: after a publish that raised: the temporary name that could not be removed (see _undo)
        self._unlanded: Optional[str] = None
        #: unique per writer: temporary names of concurrent writers never collide
        self.writer_id = writer_id or str(os.getpid())
        #: (data, its temporary file, whether a link of it lost) of a staged or lost publish
        self._staged: Optional[Tuple[Buffer, "_Temp", bool]] = None
        # descriptors a writer keeps for its lifetime (closed by close()): each directory it fsyncs
        # (not an open per fsync), and each file reserve() created
        # until write_files fills it (no second open of the same name)
        self._fds = _Descriptors()
        self._finalizer = weakref.finalize(self, self._fds.close)
        #: whether O_TMPFILE + linkat works in the manifests directory (probed on first use)
        self._tmpfile: Optional[bool] = None
        self._paths: Dict[str, str] = {}  # checked relative path -> its local path (see local_path)

    def close(self) -> None:
        """Close the descriptors this writer kept open (directories, reserved files) and remove the
        names it reserved ahead and did not use. Idempotent; the object stays usable (a later call
        opens what it needs again)."""
        self.release_ahead()
        self._fds.close()

    def local_path(self, rel: str, size: Optional[int] = None, tag: Optional[str] = None) -> str:
        path = self._paths.get(rel) if type(rel) is str else None  # a commit asks for ~15, most several times
        if path is None:
            check_rel(rel, allow_root=True)  # no name from anywhere may leave the store
            # os.path.join's generality costs more than the check
            path = (self.root + rel if self.root.endswith("/") else f"{self.root}/{rel}") if rel else self.root
            if len(self._paths) >= PATHS_KEPT:
                self._paths.clear()
            self._paths[rel] = path
        return path

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

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.local_path(rel))

    def list(self, reldir: str) -> List[str]:
        try:
            return os.listdir(self.local_path(reldir))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def stat(self, rel: str) -> Optional[Tuple[str, int]]:
        """``(kind, size)`` of ``rel`` without following a symlink at ``rel`` (a store reached
        through a symlinked root is followed there); ``None`` if absent."""
        path = self.local_path(rel)
        try:
            st = os.stat(path) if not rel else os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):  # (a file where a directory of the path should be)
            return None
        return kind_of_mode(st.st_mode), st.st_size

    def list_kinds(self, reldir: str) -> Dict[str, str]:
        folder = self.local_path(reldir)
        out = {}
        for name in self.list(reldir):
            try:
                out[name] = kind_of_mode(os.lstat(os.path.join(folder, name)).st_mode)
            except FileNotFoundError:
                pass  # removed since the listing
        return out

    def list_ages(self, reldir: str) -> Dict[str, float]:
        """Like :meth:`list`, with each file's age in seconds; a name removed or renamed between the
        listing and its ``lstat`` is a change this moment (age 0)."""
        folder, now = self.local_path(reldir), time.time()
        out = {}
        for name in self.list(reldir):
            try:
                out[name] = now - os.lstat(os.path.join(folder, name)).st_mtime
            except FileNotFoundError:
                out[name] = 0.0
        return out

    def move(self, rel: str, dest: str, *, if_absent: bool = False) -> bool:
        """Rename ``rel`` (a symlink itself, never its target) to ``dest``, making ``dest``'s
        directories; ``if_absent``: only where no ``dest`` is (False otherwise). The caller syncs
        the directories."""
        path = self.local_path(dest)
        if if_absent and os.path.lexists(path):
            return False
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.rename(self.local_path(rel), path)
        return True

    def lock(self, rel: str, *, shared: bool = False) -> WriterLock:
        """An ``flock`` of the file ``rel`` (made if absent), not taken yet (:class:`WriterLock`)."""
        return WriterLock(self.local_path(rel), shared=shared)

    def map(self, rel: str, *, min_bytes: int = 0, max_bytes: Optional[int] = None) -> Optional[mmap.mmap]:
        """``rel`` mapped read-only where it lies, if its size is within the bounds (else None, as
        for a file that cannot be opened: its read says what is wrong)."""
        try:
            fd = os.open(self.local_path(rel), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < max(min_bytes, 1) or (max_bytes is not None and size > max_bytes):
                return None
            return mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def make_root(self, reldirs: Sequence[str] = ()) -> None:
        """Make the directory and ``reldirs`` in it; with ``reldirs`` (a store's creation), make
        them, the directory and its own entry in its parent durable."""
        path = self.root
        if not os.path.lexists(path):
            above = os.path.dirname(os.path.abspath(path))
            while not os.path.lexists(above):
                above = os.path.dirname(above)
            if not os.path.isdir(above):  # (os.makedirs would raise a bare NotADirectoryError)
                raise OutputExistsError(f"{above} is a file, so the store {path} cannot be created under it; "
                                        "choose a path whose parent is a directory")
        os.makedirs(path, exist_ok=True)
        for d in reldirs:
            os.makedirs(self.local_path(d), exist_ok=True)
        if reldirs:
            fsync_dir(path)
            fsync_dir(os.path.dirname(path) or ".")  # the store's own directory entry

    def writer(self, writer_id: str = "", *, fsync: bool = True, leases: bool = False) -> "LocalStorage":
        """A handle of this directory for one writer: its id in temporary names, its descriptors and
        leases (``leases``: many writers), ``fsync`` or not."""
        return LocalStorage(self.root, writer_id, fsync=fsync, leases=leases)

    def write_new(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> None:
        # in place: no manifest names this file yet, so a torn one is garbage (saves a rename)
        durable_write(self.local_path(rel), data, step=step, sync_dir=False, atomic=False, fsync=self.fsync)

    def _create_temp(self, reldir: str, name: str) -> Tuple[str, int]:
        """A temporary file of this writer, created (``O_EXCL``) under a name never used before:
        ``.tmp-<name>.<writer id>.<pid>.<n>``. A temporary name is never opened again to be
        rewritten: after a ``link`` whose ``unlink`` failed it is a second name of a committed
        file (and a forked child keeps its parent's writer id), so truncating it would rewrite
        that file."""
        while True:
            base = f"{TMP_PREFIX}{name}.{self.writer_id}.{os.getpid()}.{next(_TEMP_NAMES)}"
            rel = f"{reldir}/{base}" if reldir else base
            try:
                return rel, os.open(self.local_path(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                continue  # a leftover of an earlier process with this pid

    def put_if_absent(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> bool:
        """Create ``rel`` with ``data`` unless it exists; False if it does. Atomic and
        never partial: the bytes are written and fsynced under a temporary name, then
        ``link()``ed, which (unlike ``rename``) fails with EEXIST instead of replacing."""
        directory, name = os.path.split(rel)
        tmp, fd = self._create_temp(directory, name)
        try:
            try:
                with self._naming(tmp, "writing"):
                    write_all(fd, data)
                    if self.fsync:
                        os.fsync(fd)
            finally:
                os.close(fd)
            if step:
                crash_point(f"{step}.written")
            if not self.link_new(tmp, rel):
                return False
            if step:
                crash_point(f"{step}.renamed")
            return True
        finally:
            self._drop_temp(tmp)

    def link_new(self, src: "str | _Temp", rel: str) -> bool:
        """Give the file ``src`` (a name, or a manifest-to-be's open file) the name ``rel`` unless
        ``rel`` exists (False then): the atomic create-if-absent of a multi-writer commit,
        ``link()``/``linkat()``, which fail with EEXIST where ``rename`` would replace."""
        try:
            if isinstance(src, _Temp) and not src.named:
                self._link_fd(src.fd, rel)
            else:
                os.link(self.local_path(src.rel if isinstance(src, _Temp) else src), self.local_path(rel))
        except FileExistsError:
            # a link that landed can still answer EEXIST: on NFS, a retransmitted link whose first
            # reply was lost. The name is then our own file (the same inode), not a lost race: taken
            # for one, the writer would rebase on its own commit and remove the files it names
            return self._is_same_file(src, rel)
        return True

    def _is_same_file(self, src: "str | _Temp", rel: str) -> bool:
        try:
            mine = os.fstat(src.fd) if isinstance(src, _Temp) else os.stat(self.local_path(src))
            there = os.stat(self.local_path(rel))
        except OSError:
            return False
        return (mine.st_ino, mine.st_dev) == (there.st_ino, there.st_dev)

    def link_candidates(self, rel_of, data: Buffer, first: int, *, tries: int = 1 << 16,
                        step: Optional[str] = None) -> Tuple[int, str]:
        """Create ``data`` durably under the first free name ``rel_of(i)``, ``i = first, first + 1,
        ...``; returns ``(i, name)`` (the directory entry is the caller's to sync). How a writer of
        a multi-writer store gets a name no other writer can have."""
        i, rel = self.reserve(rel_of, first, tries=tries)
        try:
            self._write_files([(rel, data, step)])
        except BaseException:
            remove_quietly(self.local_path(rel))
            raise
        return i, rel

    def _naming(self, rel: str, doing: str):
        """An ``OSError`` without a file name (``write``, ``fsync``) becomes a ``StoreIOError`` naming it."""
        return naming_errors(self.local_path(rel), doing)

    def _create_exclusive(self, rel: str) -> Optional[int]:
        """Create ``rel``, leased: its descriptor, or None where a clean-up holds the new name (it
        listed it unnamed, and may remove it: the name is not this writer's to use, and is left to
        the clean-up). ``FileExistsError`` where the name is taken."""
        fd = os.open(self.local_path(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        if not self._lease(fd, wait=False):
            _close(fd)
            return None
        return fd

    def _lease(self, fd: int, wait: bool = True) -> bool:
        """Take this writer's lease (a shared ``flock``) on a file it just created or opened to
        write: False when a clean-up holds the file (it judges it, and may remove it: the caller
        must not use it), True otherwise. Only a filesystem that refuses ``flock`` turns leases off
        (files are then judged by their age): a clean-up's hold is not a refusal, and taking it
        for one left every later file of this writer unleased, to a clean-up whose clock ran ahead."""
        if not self.leases or self._fds.no_leases:
            return True
        try:  # (a clean-up's hold is brief unless it is stopped)
            taken = _flock_briefly(fd, fcntl.LOCK_SH, LOCK_TRIES if wait else 1)
        except OSError:
            taken = None
        if taken is None:  # this filesystem has no flock
            self._fds.no_leases = True
            return True
        return taken

    def _open_leased(self, rel: str) -> int:
        """Open ``rel`` to write it whole (a group sidecar: the name of a segment id this writer
        reserved), leased. A clean-up holding a file left under that name (an abandoned commit's)
        may remove it: the name is opened again once it lets go, and a hold that lasts (a clean-up
        stopped) fails the commit before anything is published."""
        for _ in range(LEASE_OPENS):
            fd = os.open(self.local_path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                # leased once the hold ended; the clean-up may have removed the file meanwhile
                if self._lease(fd) and (not self.holds_leases or self._still_mine(rel, fd)):
                    return fd
            except OSError:
                pass
            _close(fd)
        raise StoreIOError(errno.EAGAIN, f"a clean-up kept {rel} held while this commit was writing it; nothing "
                           "was committed: try the call again", self.local_path(rel))

    @property
    def holds_leases(self) -> bool:
        """Whether this writer's files are leased (:meth:`hold`): a filesystem without ``flock``
        (an NFS mount without a lock manager) falls back to the age rules alone."""
        return self.leases and not self._fds.no_leases

    def release_leases(self) -> None:
        """End the leases of this writer's files (its commit is published, or it failed and its
        files were removed): a clean-up may judge them from now on."""
        self._fds.release_leases()

    def delete_own(self, rel: str) -> bool:
        """Remove ``rel``, a file this writer created for a commit that did not happen, only while it
        is still that file: it holds the lease, so no clean-up removed it and no one made the name
        again (without leases: while the name leads to the file it created, where it knows it)."""
        fd = self._fds.take_lease(rel)
        if fd is None:
            fd = self._fds.take_reserved(rel)
        self._fds.durable.discard(rel)
        if fd is None:
            return remove_quietly(self.local_path(rel))
        try:
            return self._still_mine(rel, fd) and remove_quietly(self.local_path(rel))
        except OSError:
            return False
        finally:
            _close(fd)

    def hold(self, rels: Sequence[str]) -> Dict[str, Optional[int]]:
        """Of ``rels`` (unnamed files a clean-up would remove), those no live writer leases, each
        held (an exclusive ``flock``) until :meth:`unhold`: while held, no writer can have it as
        its own (its lease would conflict) and the name keeps leading to that file (everyone
        removes a file only while holding it, or leasing it), so :meth:`remove_held` removes
        exactly the file judged. The caller checks again, while holding them, that no commit
        names them (one may have been published, and its lease released, since they were listed).
        On a filesystem without ``flock`` every file is returned, unheld (None)."""
        out: Dict[str, Optional[int]] = {}
        for rel in rels:
            path = self.local_path(rel)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue  # gone already (another writer's clean-up), or not a plain file
            try:
                taken = _exclusive(fd)
            except OSError:
                continue
            if not taken:
                if taken is None:
                    out[rel] = None
                continue  # leased: a live writer's commit in flight (or one stopped, not dead)
            try:
                st = os.fstat(fd)
                same = st.st_nlink > 0 and os.lstat(path).st_ino == st.st_ino
            except OSError:
                same = False
            if same:
                out[rel] = fd
            else:
                _close(fd)
        return out

    def hold_run(self, rels: Sequence[str]) -> Tuple[Dict[str, Optional[int]], bool]:
        """Of ``rels`` (manifests a clean-up would collect, oldest first), the run up to the first one a
        live writer leases (its link not confirmed yet: see :meth:`publish`), each held (an exclusive
        ``flock``) until :meth:`unhold`, and whether the run is all of them; absent ones are left out
        (collected already). Unheld (None) on a filesystem without ``flock``."""
        out: Dict[str, Optional[int]] = {}
        for rel in rels:
            try:
                fd = os.open(self.local_path(rel), os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue
            try:
                taken = _exclusive(fd)
            except OSError:
                self.unhold(out)
                raise
            if taken is None:
                out[rel] = None
            elif not taken:
                return out, False  # leased: the run stops here
            else:
                out[rel] = fd
        return out, True

    def remove_held(self, rel: str, handle: Optional[int]) -> bool:
        """Remove ``rel``, held by :meth:`hold`."""
        return remove_quietly(self.local_path(rel))

    def unhold(self, held: Mapping[str, Optional[int]]) -> None:
        for fd in held.values():
            _close(fd)

    def reserve(self, rel_of: Callable[[int], str], first: int, *, tries: int = 1 << 16, ahead: int = 1,
                max_age: float = 0.0) -> Tuple[int, str]:
        """``O_EXCL`` creates the name itself (no temporary file, no link): the file is written in
        place later, which is safe because no manifest names it until its commit.

        ``ahead > 1`` (with fsync): take the name from this writer's names reserved together,
        ``ahead`` at a time, whose directory entries one directory fsync made durable (see
        :meth:`name_durable`); one reserved more than ``max_age`` seconds ago is not used (an
        unnamed file that old may be another writer's clean-up's soon: ``retain_seconds``)."""
        if ahead > 1 and max_age > 0 and self.fsync:
            return self._reserve_ahead(rel_of, first, tries, ahead, max_age)
        i, rel, fd = self._create_first_free(rel_of, first, tries)
        self._fds.reserved(rel, fd)  # write_files writes through it
        return i, rel

    def _create_first_free(self, rel_of: Callable[[int], str], first: int, tries: int) -> Tuple[int, str, int]:
        for i in range(first, first + tries):
            try:
                fd = self._create_exclusive(rel_of(i))
            except FileExistsError:
                continue
            if fd is not None:  # (None: a clean-up holds it; the next id is tried)
                return i, rel_of(i), fd
        raise StoreIOError(errno.EEXIST, f"no free name after {tries} tries", rel_of(first))

    def _reserve_ahead(self, rel_of: Callable[[int], str], first: int, tries: int, ahead: int,
                       max_age: float) -> Tuple[int, str]:
        fds = self._fds
        fds._mine()
        if fds.ahead and self._ahead_age() > max_age:
            self.release_ahead()
        taken = self._take_ahead()
        if taken is not None:
            return taken
        made: List[Tuple[int, str, int]] = []
        first = max(first, fds.ahead_next)  # never a name given up again (nor its id)
        try:
            for _ in range(ahead):
                made.append(self._create_first_free(rel_of, first, tries))
                first = made[-1][0] + 1
            self.sync_dir(os.path.dirname(made[0][1]))
        except BaseException:
            for _, rel, fd in made:
                _close(fd)
                remove_quietly(self.local_path(rel))
            raise
        fds.keep_ahead(made, max_age)
        taken = self._take_ahead()
        if taken is None:
            raise StoreIOError(errno.ENOENT, "the segment names just reserved were all removed at once",
                               self.local_path(os.path.dirname(made[0][1])))
        return taken

    def _take_ahead(self) -> Optional[Tuple[int, str]]:
        """The lowest name reserved ahead that is still this writer's file, or None."""
        fds = self._fds
        while fds.ahead:
            i, rel, fd = fds.ahead.pop(0)
            try:
                # its age to clean-up starts now, as a name reserved by this commit's would: so a
                # commit's unnamed files stay younger than half of retain_seconds (Committer._check_age);
                # waiting here kept it younger than max_age by this host's clock and its mtime
                os.utime(fd)
                still_mine = self._still_mine(rel, fd)
            except OSError:
                still_mine = False
            if still_mine:
                fds.reserved(rel, fd)
                fds.durable.add(rel)
                return i, rel
            _close(fd)  # removed meanwhile (a clean-up misled by a clock that jumped): never written
        return None

    def _ahead_age(self) -> float:
        """How old the names reserved ahead are, by this process's clock and by their mtime against
        the wall clock (what clean-up judges): the older of the two (a suspended host stops the
        first, a wall clock that jumps moves the second)."""
        fds = self._fds
        age = boot_clock() - fds.ahead_at
        try:
            return max(age, time.time() - os.fstat(fds.ahead[0][2]).st_mtime)
        except (OSError, IndexError):
            return float("inf")

    def _still_mine(self, rel: str, fd: int) -> bool:
        """``rel`` is still the file this writer created as ``fd``: not removed (on NFS, renamed to a
        ``.nfs`` name), and not made again by another writer since."""
        st = os.fstat(fd)
        try:
            return st.st_nlink > 0 and os.lstat(self.local_path(rel)).st_ino == st.st_ino
        except FileNotFoundError:
            return False

    def name_durable(self, rel: str) -> bool:
        """Whether the directory entry of ``rel``, a name :meth:`reserve` took ahead, is durable
        already (its directory was fsynced after it was created): a commit need not fsync the
        directory for it."""
        self._fds._mine()
        return rel in self._fds.durable

    def release_ahead(self) -> None:
        """Remove the names reserved ahead and not taken (a writer's ``close``; or too old to use)."""
        fds = self._fds
        fds._mine()
        if not fds.ahead:
            return
        # removing one is safe while no clean-up can have taken it (and another writer made the
        # name again): a clean-up takes unnamed files only past retain_seconds, twice max_age at least;
        # and only the file this writer created (a host suspended for longer escapes the age)
        young = self._ahead_age() < 2 * fds.ahead_max_age
        made, fds.ahead = fds.ahead, []
        removed = False
        for _, rel, fd in made:
            try:
                if young and self._still_mine(rel, fd):
                    removed |= remove_quietly(self.local_path(rel))
            except OSError:
                pass  # an unnamed file: clean-up takes it after retain_seconds
            finally:
                _close(fd)
        if removed:
            try:
                self.sync_dir(os.path.dirname(made[0][1]))  # as every deletion is
            except OSError:
                pass

    def write_files(self, files: Sequence[Tuple[str, Buffer, Optional[str]]], dirs: Sequence[str] = ()) -> None:
        self._write_files(files, dirs)

    def _write_files(self, files: Sequence[Tuple[str, Buffer, Optional[str]]], dirs: Sequence[str] = (),
                     temp: Optional[Tuple["_Temp", Buffer]] = None) -> None:
        """Every file is opened (created) first, so the directory fsyncs cover their entries; then all
        writes+fsyncs and directory fsyncs run at once (they share the journal commits and cache
        flushes: see :func:`run_concurrently`). A file :meth:`reserve` created is written through
        the descriptor its creation opened. ``temp``: a manifest-to-be's open file and its bytes,
        written and fsynced with the rest (left open: it is linked later). On an error every
        descriptor is closed and the error raised; the caller removes the files."""
        fds: List[int] = []
        try:
            for rel, _, _ in files:
                fd = self._fds.take_reserved(rel)
                if fd is None:
                    fd = self._fds.take_lease(rel)  # a sidecar rewritten after a rebase: its lease goes on
                if fd is None:
                    fd = self._open_leased(rel)
                else:
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                fds.append(fd)
            items = [(fd, rel, data, step) for fd, (rel, data, step) in zip(fds, files)]
            if temp is not None:
                items.append((temp[0].fd, temp[0].rel, temp[1], None))
            dir_fds = [(self._dir_fd(d), d) for d in dict.fromkeys(dirs)] if self.fsync else []  # each once

            def write(fd: int, rel: str, data: Buffer) -> Callable[[], None]:
                def run() -> None:
                    with self._naming(rel, "writing"):
                        write_and_sync_fd(fd, data)
                return run

            def sync(fd: int, rel: str, doing: str) -> Callable[[], None]:
                def run() -> None:
                    with self._naming(rel, doing):
                        os.fsync(fd)
                return run

            # small files are written here and only their fsyncs go to the pool: a thread that
            # only fsyncs takes the GIL once, not three times (fewer futex calls, less CPU);
            # a large one is written on the pool
            # (without fsync everything is written here: nothing to wait for)
            calls = []
            for fd, rel, data, _ in items:
                if not self.fsync or memoryview(data).nbytes <= INLINE_WRITE_BYTES:
                    with self._naming(rel, "writing"):
                        write_all(fd, data)
                    if self.fsync:
                        calls.append(sync(fd, rel, "writing"))
                else:
                    calls.append(write(fd, rel, data))
            run_concurrently(calls + [sync(fd, d, "syncing the directory") for fd, d in dir_fds])
            if not self.fsync and temp is not None and temp[0].named:
                # linked by its name: closed first, which on NFS sends its bytes to the server (as
                # the fsync would), so that no other host sees the name before the bytes
                temp[0].close()
            for _, _, _, step in items:
                if step:  # no rename: ".renamed" is hit too, where a temporary name's rename would be
                    crash_point(f"{step}.written")
                    crash_point(f"{step}.renamed")
        finally:
            if self.leases and not self._fds.no_leases:
                # the files stay leased until the commit is published (Committer.commit releases them)
                for (rel, _, _), fd in zip(files, fds):
                    self._fds.lease(rel, fd)
            else:
                for fd in fds:
                    _close(fd)

    def _dir_fd(self, reldir: str) -> int:
        fd = self._fds.directory(reldir)
        if fd is None:
            fd = os.open(self.local_path(reldir), os.O_RDONLY | os.O_DIRECTORY)
            self._fds.keep_directory(reldir, fd)
        return fd

    def replace(self, rel: str, data: Buffer, *, step: Optional[str] = None, sync: bool = True) -> None:
        durable_write(self.local_path(rel), data, step=step, sync_dir=sync, fsync=self.fsync)

    def stage(self, reldir: str, data: Buffer, files: Sequence[Tuple[str, Buffer, Optional[str]]] = (),
              dirs: Sequence[str] = (), *, step: Optional[str] = None) -> None:
        """Write ``files`` and, in an unnamed file in ``reldir`` (see :meth:`_new_temp`), a
        manifest-to-be ``data`` whose generation is not known yet (an append delta), and make
        them and ``dirs`` durable in one wait: the next :meth:`publish` of the same ``data``
        object only links it, so the race for a generation is over the link alone."""
        self.discard_staged()
        temp = self._new_temp(reldir, "staged")
        try:
            self._write_files(files, dirs, temp=(temp, data))
        except BaseException:
            self._drop_temp(temp)
            raise
        self._staged = (data, temp, False)
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
        self.link_attempted = False
        self._unlanded = None
        staged = self._staged is not None and self._staged[0] is data and not files
        if staged:
            temp = self._staged[1]
            if self._staged[2] and step:
                crash_point(f"{step}.written")  # linking again after a lost race
            self._staged = None
        else:
            # a staged delta stays for a retry: this is a full manifest (its base was a checkpoint's);
            # a rename needs a name to rename
            temp = self._new_temp(os.path.dirname(rel), os.path.basename(rel), unnamed=exclusive)
        outcome = ""  # "lost": keep the temporary file for the next try; "renamed": it is gone
        try:
            if not staged:
                self._write_files(files, dirs, temp=(temp, data))
                if files:
                    crash_point("segments.synced")
                if step:
                    crash_point(f"{step}.written")
            self.link_attempted = True
            if exclusive:
                # the manifest is leased from before it has its name until the committer has read the
                # collection floor after the link (release_leases): no clean-up raises the floor past
                # a generation whose writer has not confirmed it (docs/FORMAT.md, "The collection floor")
                lease = self._lease_temp(temp)
                try:
                    linked = self.link_new(temp, rel)
                except BaseException:
                    linked = None
                    raise
                finally:
                    if linked is None and lease is not None:
                        # not known whether it landed: if it did, it stays leased until the committer
                        # has read the floor, as a clean link's (release_leases)
                        self._fds.lease(rel, lease)
                        if lease == temp.fd:
                            temp.fd = -1
                    elif not linked and lease is not None and lease != temp.fd:
                        _close(lease)
                if not linked:
                    outcome = "lost"
                    return False
                if lease is not None:
                    self._fds.lease(rel, lease)  # kept open: the descriptor is the lease
                    if lease == temp.fd:
                        temp.fd = -1
            else:
                os.replace(self.local_path(temp.rel), self.local_path(rel))
                outcome = "renamed"
            if step:
                crash_point(f"{step}.renamed")
            self.published = rel
            return True
        finally:
            if outcome == "lost" and staged:
                self._staged = (data, temp, True)
            elif outcome == "renamed":
                temp.close()
            elif self.link_attempted and outcome == "":
                self._unlanded = self._undo(temp)
            else:
                self._drop_temp(temp)
            if outcome != "lost":
                self.discard_staged()  # committed (or failed): a staged delta is not needed any more

    def _undo(self, temp: "_Temp") -> Optional[str]:
        """After a link or rename of ``temp`` that raised: make sure it can never land later (an NFS
        request the server carries out after the client's error). A named temporary file is unlinked:
        once that returned, no link or rename of that name can happen any more; an unnamed one
        (``O_TMPFILE``, local filesystems only, whose calls never land late) is closed. Returns None
        when that is settled, else the temporary name still to remove (see :meth:`settle_publish`)."""
        temp.close()
        if not temp.named:
            return None
        try:
            os.unlink(self.local_path(temp.rel))
        except FileNotFoundError:
            return None  # renamed into place (the read-back tells), or never there
        except OSError:
            return temp.rel
        return None

    def settle_publish(self, rel: str, data: Buffer) -> Optional[bool]:
        """After a :meth:`publish` that raised: whether the manifest ``rel`` holds ``data`` for good
        (True: it landed), certainly not and never will (False), or not known (None: its temporary
        name could not be removed, or ``rel`` cannot be read)."""
        if self._unlanded is not None:
            try:
                os.unlink(self.local_path(self._unlanded))
            except FileNotFoundError:
                pass
            except OSError:
                return None
            self._unlanded = None
        try:
            return self.read_bytes(rel) == data or None if os.path.lexists(self.local_path(rel)) else False
        except FileNotFoundError:
            return False
        except OSError:
            return None

    def _lease_temp(self, temp: "_Temp") -> Optional[int]:
        """A lease (a descriptor holding a shared ``flock``) on a manifest-to-be: its own descriptor, or
        one opened on its temporary name where that was closed (no fsync); None without leases."""
        if not self.holds_leases:
            return None
        fd = temp.fd
        if fd < 0:
            try:
                fd = os.open(self.local_path(temp.rel), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return None  # the link below fails on it too
        if not self._lease(fd) or not self.holds_leases:
            if fd != temp.fd:
                _close(fd)
            return None
        return fd

    def discard_staged(self) -> None:
        """Remove the temporary file a lost publish kept (see :meth:`publish`)."""
        if self._staged is not None:
            self._drop_temp(self._staged[1])
            self._staged = None

    def _new_temp(self, reldir: str, name: str, unnamed: bool = True) -> "_Temp":
        """A file for a manifest-to-be, open for writing: with ``O_TMPFILE`` (where this filesystem
        has it and ``linkat`` can name such a file: probed once) an unnamed one, which a crash
        leaves nothing of and a publish only links (no temporary name to unlink after); else a
        temporary name never used before (:meth:`_create_temp`)."""
        if unnamed and self._tmpfile is None:
            self._tmpfile = self._probe_tmpfile(reldir)
        if unnamed and self._tmpfile:
            fd = os.open(self.local_path(reldir), os.O_WRONLY | os.O_TMPFILE, 0o644)
            return _Temp(f"{reldir}/{name}", fd, named=False)
        rel, fd = self._create_temp(reldir, name)
        return _Temp(rel, fd, named=True)

    def _probe_tmpfile(self, reldir: str) -> bool:
        flag = getattr(os, "O_TMPFILE", None)
        if flag is None or not os.path.isdir("/proc/self/fd"):
            return False
        try:
            fd = os.open(self.local_path(reldir), os.O_WRONLY | flag, 0o644)
        except OSError:
            return False  # EOPNOTSUPP (NFS, older filesystems), EISDIR (kernels before 3.11), ...
        probe = f"{reldir}/{TMP_PREFIX}probe-tmpfile.{self.writer_id}"
        try:
            remove_quietly(self.local_path(probe))
            self._link_fd(fd, probe)
            remove_quietly(self.local_path(probe))
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def _link_fd(self, fd: int, rel: str) -> None:
        # linkat(AT_SYMLINK_FOLLOW) of the descriptor's /proc link names the open (unnamed) file; a
        # dst_dir_fd makes os.link call linkat (plain link() would not follow the /proc link); the
        # destination is absolute, so that fault injection and strace -y see the store's path
        os.link(f"/proc/self/fd/{fd}", self.local_path(rel), dst_dir_fd=self._dir_fd(os.path.dirname(rel)))

    def _drop_temp(self, temp) -> None:
        # after a link the commit stands whatever happens here: a temporary file left
        # behind is garbage that clean-up removes, never a reason to fail the commit
        if isinstance(temp, _Temp):
            temp.close()
            if not temp.named:
                return
            temp = temp.rel
        try:
            remove_quietly(self.local_path(temp))
        except OSError:
            pass

    def delete(self, rel: str) -> bool:
        self._fds.drop_reserved(rel)  # reserved and never written (a failed commit removes its files)
        _close(self._fds.take_lease(rel))
        self._fds.durable.discard(rel)  # a name made again later is not durable
        return remove_quietly(self.local_path(rel))

    def sync_dir(self, reldir: str) -> None:
        if not self.fsync:
            return
        with naming_errors(self.local_path(reldir), "syncing the directory"):
            try:
                os.fsync(self._dir_fd(reldir))
            except OSError as exc:
                # NFS: the directory was replaced behind the kept descriptor; open it again once
                if exc.errno not in (errno.ESTALE, errno.EBADF):
                    raise
                self._fds.forget_directory(reldir)
                os.fsync(self._dir_fd(reldir))

    def update_small(self, rel: str, update: Callable[[Optional[bytes]], Optional[bytes]]) -> Optional[bytes]:
        """Read-modify-write the small file ``rel`` (the collection floor) so that no concurrent
        update is lost: under an exclusive ``flock`` of the file itself, ``update(current bytes or
        None)`` gives the new bytes (None: keep them), written in place, then fsynced. Returns the
        bytes the file holds now. Where the lock is held by another process for long (a writer
        stopped while it held it) or the filesystem has no locks, nothing is written and the
        current bytes are returned: the caller then does less (the floor stays lower)."""
        path = self.local_path(rel)
        created = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                created = True  # its name is made durable below, with its first bytes
            except FileExistsError:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            locked = _flock_briefly(fd, fcntl.LOCK_EX)
            try:
                current = _pread_all(fd) or None
                new = update(current) if locked else None
                if new is None:
                    return current
                with naming_errors(path, "writing"):
                    os.pwrite(fd, new, 0)  # readers that meet it half-way read again (fmt.read_floor)
                    if current is not None and len(current) > len(new):
                        os.ftruncate(fd, len(new))
                    if self.fsync:
                        os.fsync(fd)
                if created and self.fsync:
                    fsync_dir(os.path.dirname(path))
                return bytes(new)
            finally:
                if locked:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def ensure_dir(self, reldir: str) -> None:
        if not os.path.isdir(self.local_path(reldir)):
            self._fds.forget_directory(reldir)  # a kept descriptor of a removed directory syncs nothing
            os.makedirs(self.local_path(reldir), exist_ok=True)
            if self.fsync:
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

    #: what a directory can do (see :class:`~diskreplay.storage.base.Storage`): files are mapped where
    #: they lie, one writer can hold an exclusive lock, a listing shows every file, nothing is cached
    can_map = True
    exclusive_lock = True
    reliable_listing = True
    cached = False
    symlinks = True

    def check(self) -> None:
        """Nothing to check: a missing directory is found by the calls that need it (the object
        store's version gives its one clear error for a missing bucket or bad credentials)."""

    @property
    def url(self) -> str:
        return self.root

    def fetch_ranges(self, rel: str, ranges, *, size: Optional[int] = None, evict: bool = True,
                     tag: Optional[str] = None) -> str:
        """The file itself: every range of a local file is present (the call readers
        make on any storage, so they need no branch for local stores)."""
        return self.local_path(rel)


def kind_of_mode(mode: int) -> str:
    """The contract's name for a file's kind: ``file``, ``dir``, ``link`` or ``other``.

    >>> import stat
    >>> kind_of_mode(stat.S_IFLNK | 0o777)
    'link'
    """
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "link" if stat.S_ISLNK(mode) else "other"


class _Temp:
    """A manifest-to-be open for writing: unnamed (``O_TMPFILE``) or under the temporary name ``rel``."""

    __slots__ = ("rel", "fd", "named")

    def __init__(self, rel: str, fd: int, named: bool) -> None:
        self.rel, self.fd, self.named = rel, fd, named

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        _close(fd if fd >= 0 else None)


class _Descriptors:
    """The descriptors a :class:`LocalStorage` keeps: directories by relative path, and files
    :meth:`LocalStorage.reserve` created. A forked child does not use its parent's (it may have
    closed them, and their numbers may name other files now): it opens its own."""

    #: names taken ahead a writer remembers as durable (past this, it forgets them all: each one
    #: then costs its commit a directory fsync, as any other new name)
    DURABLE_KEPT = 4096

    def __init__(self) -> None:
        self.forks = forks[0]
        self.dirs: Dict[str, int] = {}
        self.files: Dict[str, int] = {}
        #: names reserved ahead and not taken yet: (id, name, descriptor), when, and for how long
        self.ahead: List[Tuple[int, str, int]] = []
        self.ahead_at = self.ahead_max_age = 0.0
        self.ahead_next = 0  # the id after the last one reserved ahead
        #: names taken ahead: their directory entries are durable
        self.durable: set = set()
        #: files written for a commit not published yet, each with its lease (a shared flock)
        self.leases: Dict[str, int] = {}
        self.no_leases = False  # the filesystem refused flock: files are judged by their age alone

    def _mine(self) -> None:
        if self.forks != forks[0]:  # the parent's names reserved ahead are the parent's to use
            self.forks, self.dirs, self.files, self.ahead, self.durable = forks[0], {}, {}, [], set()
            self.ahead_next, self.leases = 0, {}

    def lease(self, rel: str, fd: int) -> None:
        self._mine()
        _close(self.leases.pop(rel, None))
        self.leases[rel] = fd

    def take_lease(self, rel: str) -> Optional[int]:
        self._mine()
        return self.leases.pop(rel, None) if self.leases else None

    def release_leases(self) -> None:
        self._mine()
        fds, self.leases = list(self.leases.values()), {}
        for fd in fds:
            _close(fd)

    def keep_ahead(self, made: List[Tuple[int, str, int]], max_age: float) -> None:
        self._mine()
        self.ahead, self.ahead_at, self.ahead_max_age = made, boot_clock(), max_age
        self.ahead_next = made[-1][0] + 1
        if len(self.durable) > self.DURABLE_KEPT:
            self.durable.clear()

    def directory(self, reldir: str) -> Optional[int]:
        self._mine()
        return self.dirs.get(reldir)

    def keep_directory(self, reldir: str, fd: int) -> None:
        self._mine()
        old = self.dirs.pop(reldir, None)
        self.dirs[reldir] = fd
        _close(old)

    def forget_directory(self, reldir: str) -> None:
        self._mine()
        _close(self.dirs.pop(reldir, None))

    def reserved(self, rel: str, fd: int) -> None:
        self._mine()
        _close(self.files.pop(rel, None))
        self.files[rel] = fd

    def take_reserved(self, rel: str) -> Optional[int]:
        self._mine()
        return self.files.pop(rel, None) if self.files else None

    def drop_reserved(self, rel: str) -> None:
        if self.files:
            _close(self.take_reserved(rel))

    def close(self) -> None:
        if self.forks != forks[0]:
            return  # a forked child's copy: the parent's to close
        fds = (list(self.dirs.values()) + list(self.files.values()) + [fd for _, _, fd in self.ahead]
               + list(self.leases.values()))
        self.dirs, self.files, self.ahead, self.leases = {}, {}, [], {}
        for fd in fds:
            _close(fd)


_TEMP_NAMES = itertools.count()  # the <n> of this process's temporary names (see LocalStorage._create_temp)
LOCK_TRIES = 200  # a brief exclusive lock (the floor's) is tried this many times, 1 ms apart
LEASE_OPENS = 5  # a name a clean-up holds is opened again this many times (LOCK_TRIES each)


def _flock_briefly(fd: int, how: int, tries: int = LOCK_TRIES) -> Optional[bool]:
    """Take ``flock(how)`` on ``fd`` within about ``tries`` ms: True; False when another holder keeps
    it that long; None when the filesystem has no locks."""
    for attempt in range(tries):
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    return None
                raise
        if attempt + 1 < tries:
            time.sleep(0.001)
    return False


def _pread_all(fd: int) -> bytes:
    out, offset = [], 0
    while True:
        chunk = os.pread(fd, 1 << 16, offset)
        if not chunk:
            return b"".join(out)
        out.append(chunk)
        offset += len(chunk)



def _exclusive(fd: int) -> Optional[bool]:
    """An exclusive ``flock`` of ``fd`` taken without waiting: True (held), False (another process
    holds it: a writer's lease), None (this filesystem has no ``flock``); other errors raise. ``fd``
    is closed unless the lock is held."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        _close(fd)
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return None
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise

def _close(fd: Optional[int]) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
