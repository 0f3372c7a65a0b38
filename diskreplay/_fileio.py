"""Durable file writes, checksums, the writer lock and crash points.

Every byte diskreplay persists goes through :func:`durable_write`: write to a
temporary name in the same directory, flush, fsync, ``os.replace`` onto the
final name, fsync the directory. After it returns the file survives a power
loss with exactly these contents; if it fails or the process dies midway, the
final name either does not exist or still holds its previous contents.
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import signal
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import google_crc32c

from .errors import CorruptStoreError, StoreIOError, StoreLockedError

TMP_PREFIX = ".tmp-"
Buffer = Union[bytes, bytearray, memoryview]

# Test hook, not public API: the durability tests set DISKREPLAY_CRASH_AT to
# the name of a commit step and the writer kills itself right after it.
_CRASH_ENV = "DISKREPLAY_CRASH_AT"


_crash_hits: dict = {}
# a commit passes a dozen crash points: the mapping os.environ keeps (updated by every change
# through it) is read with a pre-encoded key, not through os.environ.get's key encoding
_CRASH_KEY = os.environ.encodekey(_CRASH_ENV) if hasattr(os.environ, "encodekey") else None


def crash_point(step: str) -> None:
    """Die with SIGKILL here if the durability tests asked for it (``step`` or
    ``step#N``: its N-th hit since that value was set)."""
    data = getattr(os.environ, "_data", None)
    if _CRASH_KEY is not None and isinstance(data, dict) and _CRASH_KEY not in data:
        return
    want = os.environ.get(_CRASH_ENV)
    if not want or want.partition("#")[0] != step:
        return
    _crash_hits[want] = _crash_hits.get(want, 0) + 1
    if _crash_hits[want] >= int(want.partition("#")[2] or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def boot_clock() -> float:
    """Seconds on a clock that keeps counting while the host is suspended (``CLOCK_BOOTTIME``;
    ``time.monotonic()`` where there is none). The ages a commit checks against
    ``retain_seconds`` use it: a monotonic clock stops during a suspend, so a writer resumed after
    an hour would take its files for as young as when it was suspended."""
    return time.clock_gettime(_BOOT_CLOCK) if _BOOT_CLOCK is not None else time.monotonic()


_BOOT_CLOCK = getattr(time, "CLOCK_BOOTTIME", None)


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing from ``value``.

    >>> hex(crc32c(b"123456789"))
    '0xe3069283'
    """
    return google_crc32c.extend(value, data)


def first_bad_page(data: Buffer, pages: Sequence[int], crcs: Sequence[int], page_bytes: int) -> Optional[int]:
    """The first of ``pages`` (page numbers of ``data``, a pyarrow buffer) whose CRC-32C differs from
    its entry in ``crcs``, or None when all match (the last page may be short).

    >>> import pyarrow as pa
    >>> data = pa.py_buffer(b"abcdefgh" * 2 + b"abc")
    >>> crcs = [crc32c(b"abcdefgh"), crc32c(b"abcdefgh"), crc32c(b"abc")]
    >>> first_bad_page(data, [0, 2], [crcs[0], crcs[2]], 8) is None
    True
    >>> first_bad_page(data, [0, 1, 2], [crcs[0], crcs[1] ^ 1, crcs[2]], 8)
    1
    """
    value, piece, size = google_crc32c.value, data.slice, data.size
    for i, crc in zip(pages, crcs):
        start = i * page_bytes
        if value(piece(start, min(page_bytes, size - start))) != crc:
            return i
    return None


def file_crc32c(path: str, chunk: int = 1 << 22) -> int:
    """CRC-32C of a whole file, read in chunks."""
    value = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return value
            value = crc32c(block, value)


class naming_errors:
    """An ``OSError`` without a file name (``write``, ``fsync``, ``close``) becomes a
    :class:`StoreIOError` naming ``path`` (the errno is kept).

    (A class, not a ``contextlib`` generator: it wraps every read and write of a commit, and
    a generator-based context manager costs ~2 us a use.)

    >>> try:
    ...     with naming_errors("/store/x", "writing"):
    ...         raise OSError(28, "No space left on device")
    ... except OSError as exc:
    ...     print(exc.errno, exc.filename)
    28 /store/x
    """

    __slots__ = ("path", "doing")

    def __init__(self, path: str, doing: str) -> None:
        self.path = path
        self.doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(exc, OSError) or exc.filename is not None or isinstance(exc, StoreIOError):
            return False
        raise StoreIOError(exc.errno, f"{exc.strerror or exc} {self.doing} {self.path}", self.path) from exc


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and unlinks in it are durable."""
    with naming_errors(path, "syncing the directory"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def durable_write(path: str, data: Buffer, *, step: Optional[str] = None, sync_dir: bool = True,
                  atomic: bool = True, fsync: bool = True) -> None:
    """Atomically and durably replace ``path`` with ``data``.

    ``step`` names the commit step for crash injection (``<step>.written`` is
    hit after the data is on disk under the temporary name, ``<step>.renamed``
    after the rename). On any error the temporary file is removed and the
    error re-raised; ``path`` is untouched.

    ``atomic=False`` writes ``path`` in place (no temporary name, no rename):
    for a new file that nothing references until a later commit, where a torn
    file is harmless garbage, this saves a rename and its journal commit.
    ``fsync=False`` (a store opened with ``fsync=False``) neither fsyncs the file
    nor its directory: atomic all the same, durable only once the kernel writes it.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); durable_write(os.path.join(d, "x"), b"hi")
    >>> open(os.path.join(d, "x"), "rb").read(), sorted(os.listdir(d))
    (b'hi', ['x'])
    """
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{name}.{os.getpid()}") if atomic else path
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        with naming_errors(path, "writing"):
            try:
                view = memoryview(data).cast("B")
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
                # fsync before the rename: otherwise a crash could leave the new
                # name pointing at a file whose blocks never reached the disk.
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        if step:
            crash_point(f"{step}.written")
        if atomic:
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if step:
        crash_point(f"{step}.renamed")
    if sync_dir and fsync:
        fsync_dir(directory or ".")


# Test hook: tools/faults.py injects faults into the N-th call of a syscall with strace,
# whose counts are per thread, so it runs the store's I/O on the calling thread.
_SERIAL_ENV = "DISKREPLAY_SERIAL_IO"
POOL_THREADS = 8
_pool: Optional["_Pool"] = None
_pool_pid = -1
_pool_lock = threading.Lock()


#: forks into this process's ancestry: a holder of descriptors or threads compares it with the value
#: it saw (os.getpid() per check would be a syscall per use)
forks = [0]


def _after_fork_in_child() -> None:
    # a forked child has the pool object but not its threads, and maybe a lock held by one of them
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()
    forks[0] += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Batch:
    """The calls of one :func:`run_concurrently`: the last to finish releases ``done``."""

    __slots__ = ("left", "lock", "done", "errors")

    def __init__(self, n: int) -> None:
        self.left, self.lock, self.done, self.errors = n, threading.Lock(), threading.Lock(), []
        self.done.acquire()

    def finished(self, exc: Optional[BaseException] = None) -> None:
        with self.lock:
            if exc is not None:
                self.errors.append(exc)
            self.left -= 1
            last = not self.left
        if last:
            self.done.release()


class _Pool:
    """Threads that run the calls :func:`run_concurrently` hands off, from one queue.

    Not a ``ThreadPoolExecutor``: a call of a small commit (one ``fsync``) is shorter than
    the executor's future, work item and idle-semaphore bookkeeping, each of which is a lock
    the waiting thread and the pool's threads hand to each other (about 10 ``futex`` calls a
    call); here a call costs one queue put, and a batch one lock its caller waits on.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.threads: List[threading.Thread] = []
        self.idle = 0  # threads not running a call: a call finding none starts one (up to size)
        self.lock = threading.Lock()

    def submit(self, batch: _Batch, calls: Sequence[Callable[[], None]]) -> None:
        with self.lock:
            for _ in calls:
                if self.idle <= 0 and len(self.threads) < self.size:
                    t = threading.Thread(target=self._work, name=f"diskreplay-sync_{len(self.threads)}", daemon=True)
                    self.threads.append(t)
                    self.idle += 1
                    t.start()
                self.idle -= 1
        for call in calls:
            self.jobs.put((batch, call))

    def _work(self) -> None:
        while True:
            batch, call = self.jobs.get()
            try:
                call()
            except BaseException as exc:  # noqa: B902 - the caller raises it
                batch.finished(exc)
            else:
                batch.finished()
            finally:
                del batch, call
            with self.lock:
                self.idle += 1


def run_concurrently(calls: Sequence[Callable[[], None]]) -> None:
    """Run ``calls`` at once (the first on this thread, the others on a small pool of
    threads) and wait for all; re-raise the first error.

    Why: an fsync waits on the disk with the GIL released, and the fsyncs of
    one commit's files and directories share the filesystem's journal commits
    and cache flushes when they are issued together (``tools/bench.py writers``
    measures a commit's fsyncs).
    The first call runs here because this thread would only wait meanwhile: a hand-off
    to a pool thread and back costs more CPU than a small call's own Python.

    >>> out = []; run_concurrently([lambda: out.append(1), lambda: out.append(2)]); sorted(out)
    [1, 2]
    """
    global _pool, _pool_pid
    if len(calls) <= 1 or os.environ.get(_SERIAL_ENV):
        for call in calls:
            call()
        return
    batch = _Batch(len(calls) - 1)
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = _Pool(POOL_THREADS), os.getpid()
        _pool.submit(batch, calls[1:])
    first: Optional[BaseException] = None
    try:
        calls[0]()
    except BaseException as exc:  # noqa: B902 - raised once the others finished with their files
        first = exc
    batch.done.acquire()
    if first is not None:
        raise first
    if batch.errors:
        raise batch.errors[0]


def write_all(fd: int, data: Buffer) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data).cast("B")
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


def read_exactly(fd: int, size: int, path: str) -> bytes:
    """The ``size`` bytes of the open file ``fd`` (``CorruptStoreError`` naming ``path`` if it ends sooner)."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise CorruptStoreError(f"{path} ended after {size - left} of its {size} bytes; the file was truncated")
        chunks.append(chunk)
        left -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def write_and_sync_fd(fd: int, data: Buffer) -> None:
    """Write all of ``data`` to ``fd`` and fsync it (the caller closes ``fd``)."""
    write_all(fd, data)
    os.fsync(fd)


def read_file(path: str, limit: Optional[int] = None) -> bytes:
    """The bytes of ``path``, refusing symlinks (``O_NOFOLLOW``) and files over ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptStoreError(f"{path} is a symlink; a store's files must be plain files") from None
        raise
    try:
        with naming_errors(path, "reading"):
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                raise CorruptStoreError(f"{path} is {size} bytes; at most {limit} are expected here")
            # one read of the size fstat gave (a manifest, a delta): a file object costs more than
            # the read; the loop takes what a concurrent append or a short read left (a read that
            # returned exactly that size is at the end: no second read to find out)
            chunks = [os.read(fd, size + 1)]
            if len(chunks[0]) == size:
                return chunks[0]
            while chunks[-1] and (limit is None or sum(map(len, chunks)) <= limit):
                chunks.append(os.read(fd, 1 << 20))
            data = b"".join(chunks)  # one chunk: that chunk itself, not a copy
            if limit is not None and len(data) > limit:
                raise CorruptStoreError(f"{path} is over {limit} bytes; at most {limit} are expected here")
            return data
    finally:
        try:
            os.close(fd)
        except OSError:
            pass  # everything was read: a failing close of a read-only descriptor loses nothing


def remove_quietly(path: str) -> bool:
    """Unlink ``path``; True when it existed."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


# The LOCK files this process holds, by device and inode (one file under two paths is one lock), each
# holder with its pid and mode: flock refuses a second open of the file in this process exactly as it
# refuses another process, and only this record tells the two apart in the error. The pid keeps a forked
# child, which inherits the record, from taking its parent's locks for its own.
# Reentrant: a dropped lock's finalizer (below) runs inside whatever allocation set off a garbage
# collection, on any thread, also one that holds _HELD_LOCK already.
_HELD: Dict[Tuple[int, int], Dict[int, Tuple[int, bool]]] = {}
_HELD_LOCK = threading.RLock()


def _reset_held_lock() -> None:  # a child forked while another thread held it would wait forever
    global _HELD_LOCK
    _HELD_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_reset_held_lock)


def _held_here(fd: int) -> Optional[bool]:
    """How this process holds the lock file open as ``fd``: True shared, False exclusively (if it
    holds it both ways, exclusively), None not at all."""
    st = os.fstat(fd)
    with _HELD_LOCK:
        holders = tuple(_HELD.get((st.st_dev, st.st_ino), {}).values())  # (a finalizer may change it)
    modes = [shared for pid, shared in holders if pid == os.getpid()]
    return None if not modes else all(modes)


def _unlock(fd: int, pid: int, key: Optional[Tuple[int, int]], holder: int) -> None:
    """Drop the flock a :class:`WriterLock` (``id`` ``holder``) took on ``fd`` in process ``pid``, forget
    its record and close ``fd``."""
    if key is not None:
        with _HELD_LOCK:
            holders = _HELD.get(key, {})
            if holders.get(holder, (None,))[0] == os.getpid():
                del holders[holder]
                if not holders:
                    del _HELD[key]
    try:
        # a forked child shares the parent's open file and so its flock: unlocking there would
        # unlock the parent; closing the child's descriptor leaves the parent's lock alone
        if pid == os.getpid():
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        # closing drops the flock even when the unlock failed; Linux frees the
        # descriptor even when close() itself reports an error, so never keep it
        try:
            os.close(fd)
        except OSError:
            pass


def _unlock_dropped(fd: int, pid: int, key: Optional[Tuple[int, int]], holder: int) -> None:
    try:
        _unlock(fd, pid, key, holder)
    except OSError:
        pass  # (no caller to tell: the descriptor is closed, which drops the flock anyway)


class WriterLock:
    """An exclusive ``flock`` on ``STORE/LOCK`` (``shared=True``: a shared one).

    The kernel drops a flock when its holder dies, so a writer killed with
    SIGKILL never leaves a stale lock behind. The writers of a multi-writer
    store hold it shared, which never blocks one another; converting the
    store to one writer takes it exclusively, so it is refused while another
    writer has the store open.
    """

    def __init__(self, path: str, shared: bool = False) -> None:
        self.path = path
        self.shared = shared
        self._pid = 0  # the process that took it
        self._key: Optional[Tuple[int, int]] = None  # the LOCK file's (device, inode) while held
        # while held: releases it when the lock is collected without release() (a store dropped
        # without close()), as its file would close; a later open in this process was refused, "open
        # for writing by another process", until the process ended. Not at interpreter exit
        # (atexit=False: weakref runs no finalizer after its exit hook): the modules it needs are
        # being torn down then, and the kernel drops the flock with the process anyway.
        self._finalizer: Optional[weakref.finalize] = None

    def probe(self) -> None:
        """Raise ``StoreLockedError`` if a holder has the lock now; take nothing, through a read-only
        descriptor (a store this process may not write, a dry run). No LOCK file: no holder ever."""
        try:
            fd = self._open(os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            if self._flock(fd):
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):  # no flock: nothing to test
                raise
        finally:
            os.close(fd)

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptStoreError(f"{self.path} is a symlink; a store's LOCK must be a plain file") from None
            raise

    def _flock(self, fd: int) -> bool:
        """Take the lock (non-blocking) on ``fd``; False on a filesystem without flock for a shared one."""
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                here = _held_here(fd)
                if here is not None and not (self.shared and here):  # (shared holders never block a shared one)
                    raise StoreLockedError(
                        f"{os.path.dirname(self.path)} is already open for writing in this process (another "
                        "ReplayStore of it, not closed, holds LOCK); use that store, or close it first (open "
                        "with readonly=True to read while it writes)" if not self.shared else
                        f"{os.path.dirname(self.path)} is open for writing alone, or being converted or repaired, in "
                        "this process (it holds LOCK exclusively); close that store first, or open this one "
                        "with readonly=True") from None
                raise StoreLockedError(
                    f"{os.path.dirname(self.path)} is being converted or repaired by another process (it holds "
                    "LOCK); wait for it, or open the store with readonly=True" if self.shared else
                    f"{os.path.dirname(self.path)} is already open for writing by another process "
                    "(it holds LOCK); open it with readonly=True to read while it writes") from None
            if self.shared and exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                return False  # a filesystem without flock (NFS without a lock manager): many writers need none
            raise
        return True

    def acquire(self) -> None:
        fd = self._open(os.O_RDWR | os.O_CREAT)
        try:
            locked = self._flock(fd)
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            os.close(fd)
            return
        self._pid = os.getpid()
        try:
            st = os.fstat(fd)
        except OSError:
            pass  # (only the wording of a later refusal in this process depends on it)
        else:
            self._key = (st.st_dev, st.st_ino)
            with _HELD_LOCK:
                _HELD.setdefault(self._key, {})[id(self)] = (self._pid, self.shared)
        self._finalizer = weakref.finalize(self, _unlock_dropped, fd, self._pid, self._key, id(self))
        self._finalizer.atexit = False
        if self.shared:  # many holders: no pid to record
            return
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            # the pid is informational, but a half-acquired lock must not outlive
            # this call: a leaked flock would refuse every later open in this process
            self.release()
            raise StoreIOError(exc.errno, f"cannot write the writer's pid into {self.path} "
                          f"({exc.strerror}); the store was not opened", self.path) from None

    def release(self) -> None:
        """Drop the lock (in a forked child: only close the descriptor, the parent keeps its lock).
        Idempotent."""
        held, self._finalizer = self._finalizer, None
        taken = held.detach() if held is not None else None
        if taken is not None:
            _unlock(*taken[2])


def sized_progress_bar(tqdm: Any, fp: Any, **kwargs: Any) -> Any:
    """A ``tqdm`` bar on ``fp`` sized to its terminal and following resizes, as tqdm's own
    ``dynamic_ncols`` does, but taking a size the terminal does not report as 80x24: tqdm takes a
    terminal that reports 0x0 (a pty nobody sized: ``docker exec -t``, some CI runners) as -1 rows
    and hides the bar entirely. (Here so that export and verify, layers apart, share it.)"""
    cols, rows = terminal_shape(fp)
    bar = tqdm(file=fp, ncols=cols, nrows=rows, **kwargs)
    bar.dynamic_ncols = terminal_shape
    return bar


def terminal_shape(fp: Any) -> Tuple[int, int]:
    """``(columns, rows)`` for a progress bar on ``fp``, as tqdm counts them (one less than the
    terminal's), with 80x24 for a size the terminal does not report (0, or not a terminal).

    >>> import io
    >>> terminal_shape(io.StringIO())
    (79, 23)
    """
    try:
        cols, rows = os.get_terminal_size(fp.fileno())
    except (AttributeError, ValueError, OSError):  # (io.UnsupportedOperation is both)
        cols = rows = 0
    return (cols if cols > 1 else 80) - 1, (rows if rows > 1 else 24) - 1
