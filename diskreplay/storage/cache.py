"""A bounded local cache of immutable remote files, as memory-mappable files.

Segments never change once written, so their bytes can be kept locally and
mapped exactly like a local segment. A cached file is created *sparse* at
the object's full size; the byte ranges a batch needs are written into it as
they arrive, so a reader can map the file once and have more of it filled
later (``pwrite`` goes through the page cache that the mapping shares).
Ranges never fetched read as zeros: the page checksums a store verifies on
first read catch a reader that skipped fetching.

Eviction is least recently used, over the bytes held, and only ever
unlinks a file: a mapping keeps its inode and bytes alive until it is
unmapped, so arrays a reader already holds stay valid and correct (punching
holes instead would turn them into zeros under the reader). A later fetch of
an evicted name makes a new file; the store drops its maps of the names a
:meth:`ObjectCache.trim` evicted, and reads them again. A complete file is also published under a name
derived from the object's URL, so another process using the same
``cache_dir`` (a restarted trainer, a second rank) finds it without a
download; partly fetched files stay private to their process, because only
their owner knows which ranges they hold.

The bound counts the bytes this process holds; files another process
published count once found. A shared directory is also trimmed when a cache
opens it: the published copies that processes which are gone (or still
running) left there are removed, least recently used first, until they fit
the bound (restarted trainers sharing a ``cache_dir`` each added up to it).
Mapped files that were evicted hold their disk space until unmapped.

Without a directory a cache makes a private one, ``diskreplay-cache-*`` in the
temporary directory, and removes it when it closes or is collected. A process
that dies first (SIGKILL, OOM) cannot, so every private directory holds an
exclusive ``flock`` on its ``.owner`` file for as long as its cache lives, and
a new private cache removes the directories of this user whose lock it can
take: their owner is gone (the kernel drops a dead process's flock, whatever
its pid namespace; a pid could be reused or belong to another container). A
directory without ``.owner`` (made by an earlier diskreplay, or being made at
this moment) is left alone. Killed Ray actors each left one behind.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .._fileio import remove_quietly
from .._ranges import Range, merge_ranges, subtract_ranges
from ..errors import ArgumentError, CorruptStoreError


_PARTIAL = ".part-"
_PRIVATE_PREFIX = "diskreplay-cache-"  # a private directory's name in the temporary directory
_OWNER = ".owner"  # the file whose flock a private directory's live owner holds


def covered(ranges: Sequence[Range]) -> int:
    return sum(e - s for s, e in ranges)


@dataclass
class CacheStats:
    """Counters of one cache, in bytes (``hit_rate`` = hit / requested).

    >>> CacheStats(requested_bytes=100, hit_bytes=75).hit_rate
    0.75
    """

    requested_bytes: int = 0
    hit_bytes: int = 0
    fetched_bytes: int = 0
    range_gets: int = 0
    evicted_bytes: int = 0
    evictions: int = 0
    held_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_bytes / self.requested_bytes if self.requested_bytes else 0.0

    def to_dict(self) -> Dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class _Entry:
    __slots__ = ("rel", "path", "canonical", "size", "have", "lock", "complete", "published")

    def __init__(self, rel: str, path: str, canonical: str, size: int, complete: bool) -> None:
        self.rel = rel
        self.path = path
        self.canonical = canonical
        self.size = size
        self.have: List[Range] = [(0, size)] if complete and size else []
        self.lock = threading.Lock()
        self.complete = complete
        self.published = complete

    @property
    def held(self) -> int:
        return covered(self.have)


def _owner_gone(partial_name: str) -> bool:
    """Whether the process that is fetching the partly fetched file ``partial_name`` is gone."""
    m = re.match(re.escape(_PARTIAL) + r"(\d+)-", partial_name)
    if not m:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _make_private_directory() -> Tuple[str, int]:
    """A new private cache directory, and the descriptor of its ``.owner`` file, locked for this cache's life."""
    directory = tempfile.mkdtemp(prefix=_PRIVATE_PREFIX)
    # locked before it is named .owner: a sweeper that found it unlocked would take the directory for a dead one's
    taking = os.path.join(directory, _OWNER + ".new")
    fd = os.open(taking, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return directory, fd  # a filesystem without flock: no .owner, so only its own cache removes it
    os.rename(taking, os.path.join(directory, _OWNER))
    return directory, fd


def remove_abandoned_private_directories(parent: Optional[str] = None, keep: Optional[str] = None) -> List[str]:
    """Remove the private cache directories in ``parent`` (default: the temporary directory) whose
    owner is gone: this user's ``diskreplay-cache-*`` directories whose ``.owner`` lock can be taken.
    Returns the paths removed. ``keep`` is never touched (the caller's own).

    >>> import tempfile
    >>> cache = ObjectCache(None, 1 << 20, "s3://b/p")
    >>> remove_abandoned_private_directories(keep=None)  # its own is held: not abandoned
    []
    >>> cache.close()
    """
    parent = tempfile.gettempdir() if parent is None else parent
    removed: List[str] = []
    try:
        with os.scandir(parent) as it:
            candidates = [d for d in it if d.name.startswith(_PRIVATE_PREFIX) and d.path != keep]
    except OSError:
        return removed
    uid = os.getuid()
    for d in candidates:
        try:
            if not d.is_dir(follow_symlinks=False) or d.stat(follow_symlinks=False).st_uid != uid:
                continue
            fd = os.open(os.path.join(d.path, _OWNER), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone, another user's, or without .owner: not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives (or flock is not supported: then nothing is known)
        finally:
            os.close(fd)  # (drops the lock just taken: a second sweeper may take it too, and rmtree quietly)
        shutil.rmtree(d.path, ignore_errors=True)
        removed.append(d.path)
    return removed


def _close_private(fd: int, directory: str) -> None:
    shutil.rmtree(directory, True)
    try:
        os.close(fd)
    except OSError:
        pass


class ObjectCache:
    """Sparse local copies of remote immutable files, bounded in bytes (LRU).

    ``namespace`` (the storage's URL) keeps two stores' files apart in one
    ``directory``; without a directory a private temporary one is used and
    removed by :meth:`close` (or when the cache is collected); making one also
    removes the private directories that dead processes left (see the module).

    >>> cache = ObjectCache(None, capacity_bytes=1 << 20, namespace="s3://b/p")
    >>> path = cache.fill("x", 10, lambda missing: [b"0123456789"[s:e] for s, e in missing], [(2, 5)])
    >>> open(path, "rb").read()[2:5], cache.stats.fetched_bytes
    (b'234', 10)
    >>> cache.close()
    """

    def __init__(self, directory: Optional[str], capacity_bytes: int, namespace: str,
                 align: int = 8192) -> None:
        if capacity_bytes <= 0:
            raise ArgumentError(f"cache_bytes must be a positive number of bytes, got {capacity_bytes}")
        self._own_dir = directory is None
        if self._own_dir:
            self.directory, owner_fd = _make_private_directory()
            # removed even if close() is never called; the lock goes last, once nothing is left to remove
            self._finalizer = weakref.finalize(self, _close_private, owner_fd, self.directory)
            remove_abandoned_private_directories(os.path.dirname(self.directory), keep=self.directory)
        else:
            self.directory = os.path.abspath(os.fspath(directory))
            os.makedirs(self.directory, exist_ok=True)
        self.capacity_bytes = int(capacity_bytes)
        self.align = align
        self.namespace = namespace
        self._ns = hashlib.sha256(namespace.encode()).hexdigest()[:16]
        self._entries: "OrderedDict[str, _Entry]" = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()
        if not self._own_dir:  # (a private directory is new: nothing in it yet)
            self._tidy_directory()

    def _tidy_directory(self) -> None:
        """One pass over a shared directory: remove the partly fetched files of processes that are
        gone (only their owner knew which ranges they hold), then published copies, least recently
        used first (a copy's mtime is bumped whenever a process takes it up), until they fit
        ``capacity_bytes``. Only unlinks: a process that maps one keeps it, and fetches it again if
        it needs it later."""
        published = []
        with os.scandir(self.directory) as it:
            for d in it:
                if d.name.startswith(_PARTIAL):
                    if _owner_gone(d.name):
                        try:
                            remove_quietly(d.path)
                        except OSError:
                            pass  # (another user's, in a shared directory)
                    continue
                try:
                    if not d.is_file(follow_symlinks=False):
                        continue
                    st = d.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                published.append((st.st_mtime, st.st_blocks * 512, d.path))
        total = sum(b for _, b, _ in published)
        for _, nbytes, path in sorted(published):
            if total <= self.capacity_bytes:
                break
            remove_quietly(path)
            total -= nbytes

    def _canonical(self, rel: str) -> str:
        digest = hashlib.sha256(rel.encode()).hexdigest()[:24]
        tail = re.sub(r"[^A-Za-z0-9._-]", "_", rel.rsplit("/", 1)[-1])[-48:]
        return os.path.join(self.directory, f"{self._ns}-{digest}-{tail}")

    def entry(self, rel: str, size_of: Callable[[], int]) -> _Entry:
        """The entry for ``rel``: cached, published by another process, or a
        new sparse file of ``size_of()`` bytes."""
        with self._lock:
            e = self._entries.get(rel)
            if e is not None and e.complete and not os.path.exists(e.path):
                # another process sharing the directory evicted the published copy
                self._entries.pop(rel)
                self.stats.held_bytes -= e.held
                e = None
            if e is not None:
                self._entries.move_to_end(rel)
                return e
        canonical = self._canonical(rel)
        try:
            size = os.stat(canonical).st_size
            e = _Entry(rel, canonical, canonical, size, complete=True)
            try:
                os.utime(canonical)  # in use: the last a trim of the shared directory removes
            except OSError:
                pass
        except FileNotFoundError:
            size = size_of()
            path = os.path.join(os.path.dirname(canonical),
                                f"{_PARTIAL}{os.getpid()}-{secrets.token_hex(4)}-"
                                f"{os.path.basename(canonical)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            e = _Entry(rel, path, canonical, size, complete=False)
        with self._lock:
            other = self._entries.get(rel)
            if other is not None:  # another thread won; drop ours
                if e.path != e.canonical:
                    os.unlink(e.path)
                return other
            self._entries[rel] = e
            self.stats.held_bytes += e.held
        return e

    def fill(self, rel: str, size: int, fetch: Callable[[List[Range]], Sequence[bytes]],
             ranges: Optional[Sequence[Range]], *, coalesce: int = 0,
             max_get: int = 8 << 20, evict: bool = True) -> str:
        """Make ``ranges`` of ``rel`` (all of it when None) present locally and
        return the file's path. ``fetch(missing)`` downloads the given ranges;
        missing ranges less than ``coalesce`` apart are fetched as one, and
        none is longer than ``max_get`` (so a whole file arrives in parallel parts).
        ``evict=False`` leaves eviction to the next :meth:`trim`."""
        e = self.entry(rel, lambda: size)
        with e.lock:
            if ranges is None:
                want = [(0, e.size)] if e.size else []
            else:
                a = self.align
                want = merge_ranges([(s // a * a, min(-(-t // a) * a, e.size))
                                     for s, t in ranges if t > s])
            missing = subtract_ranges(want, e.have)
            requested = covered(want)
            gets: List[Range] = []
            for s, t in merge_ranges(missing, coalesce):
                gets.extend((p, min(p + max_get, t)) for p in range(s, t, max_get))
            if gets:
                blobs = fetch(gets)
                fd = os.open(e.path, os.O_WRONLY)
                try:
                    for (s, t), blob in zip(gets, blobs):
                        view = memoryview(blob).cast("B")
                        if len(view) != t - s:
                            raise CorruptStoreError(
                                f"{self.namespace.rstrip('/')}/{rel}: asked for bytes [{s}, {t}) and got "
                                f"{len(view)}; the object is shorter than its recorded size {e.size} "
                                "(truncated or replaced)")
                        done = 0
                        while done < len(view):
                            done += os.pwrite(fd, view[done:], s + done)
                finally:
                    os.close(fd)
                before = e.held
                e.have = merge_ranges(e.have + gets)
                with self._lock:
                    self.stats.held_bytes += e.held - before
                    self.stats.fetched_bytes += covered(gets)
                    self.stats.range_gets += len(gets)
            with self._lock:
                self.stats.requested_bytes += requested
                self.stats.hit_bytes += requested - covered(missing)
            if not e.complete and e.held == e.size:
                e.complete = True
                self._publish(e)
        if evict:
            self._evict(keep=e)
        return e.path

    def trim(self) -> List[str]:
        """Evict least recently used files until the bound holds; the names evicted."""
        return self._evict(keep=None)

    def _publish(self, e: _Entry) -> None:
        try:
            os.link(e.path, e.canonical)
        except FileExistsError:
            pass  # another process published the same immutable bytes
        except OSError:
            return
        e.published = True

    def _evict(self, keep: Optional[_Entry]) -> List[str]:
        evicted: List[str] = []
        while True:
            with self._lock:
                if self.stats.held_bytes <= self.capacity_bytes:
                    return evicted
                victim = next((e for e in self._entries.values() if e is not keep and e.held), None)
                if victim is None:
                    return evicted
                if not victim.lock.acquire(blocking=False):
                    self._entries.move_to_end(victim.rel)
                    continue
            try:
                freed = victim.held
                # Readers may have this file mapped, other processes too: unlink
                # only; the inode and its bytes live until the last unmap.
                for path in {victim.path, victim.canonical} if victim.published else {victim.path}:
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
                victim.have = []
                with self._lock:
                    self.stats.held_bytes -= freed
                    self.stats.evicted_bytes += freed
                    self.stats.evictions += 1
                    self._entries.pop(victim.rel, None)
                evicted.append(victim.rel)
            finally:
                victim.lock.release()

    def forget(self, rel: str) -> None:
        """Drop ``rel`` and its tagged copies (``rel#tag``): the object was deleted,
        and its name must not serve old bytes."""
        with self._lock:
            keys = [k for k in self._entries if k == rel or k.startswith(rel + "#")]
            entries = [self._entries.pop(k) for k in keys]
            for e in entries:
                self.stats.held_bytes -= e.held
        paths = {p for e in entries for p in (e.path, e.canonical)} or {self._canonical(rel)}
        for path in paths:
            try:
                os.unlink(path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise

    def close(self) -> None:
        """Remove this process's private files: partly fetched ones, and its own name of each it
    published (and a private directory)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), OrderedDict()
        for e in entries:
            if e.path != e.canonical:  # a published one keeps its shared name only
                try:
                    os.unlink(e.path)
                except OSError:
                    pass
        if self._own_dir:
            self._finalizer()  # the directory, then its lock (once)


def fetch_into(storage: Any, cache: ObjectCache, rel: str, ranges: Optional[Sequence[Range]], *,
               size: Optional[int] = None, evict: bool = True, tag: Optional[str] = None,
               coalesce: int = 0) -> str:
    """The page cache over any storage: make ``ranges`` (all when None) of the immutable file
    ``rel`` present in ``cache``, read by ``storage.read_ranges``, and return the local file's path
    (see :meth:`~diskreplay.storage.base.Storage.fetch_ranges`)."""
    from .base import check_range, check_rel

    rel = check_rel(rel)
    key = rel if tag is None else f"{rel}#{tag}"
    if ranges is not None:
        ranges = [check_range(rel, s, e) for s, e in ranges]

    def size_of() -> int:
        return storage.size(rel) if size is None else int(size)

    entry_size = cache.entry(key, size_of).size
    return cache.fill(key, entry_size, lambda gets: storage.read_ranges(rel, gets), ranges, coalesce=coalesce,
                      evict=evict)
