"""A store's files in this process's memory: ``memory://NAME``.

Every :class:`MemoryStorage` of one name in one process sees the same files, so two ``ReplayStore``
objects of ``memory://run`` are two writers (or a writer and a reader) of one store, as two
processes are of a directory or a bucket. The files live until :meth:`MemoryStorage.destroy` (or the
process's end); another process sees none of them.

It behaves like an object store whose every request is answered at once and in order: no lock
(``exclusive_lock`` is False, so every commit is a create-if-absent and a floor guards clean-up, as
on S3), a listing that shows every file (``reliable_listing``), no file to map in place
(``can_map`` is False): a reader maps local copies from the same bounded cache the S3 backend
uses (:mod:`.cache`), filled on demand. A create-if-absent, a move and a read-modify-write each
happen under one lock, so racing handles (threads) get exactly one winner per name, and a removal
held by a clean-up removes only the version of the file it judged.

>>> s = MemoryStorage("memory://doc-example")
>>> s.put_if_absent("manifests/1.json", b"one"), MemoryStorage("memory://doc-example").read_bytes("manifests/1.json")
(True, b'one')
>>> s.destroy()
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import ArgumentError, CommitConflictError, CorruptStoreError
from .base import Buffer, Publisher, check_range, check_rel
from .cache import ObjectCache

SCHEME = "memory://"
DEFAULT_CACHE_BYTES = 1 << 30
_MANIFEST_PREFIX = "manifests/"


class _File:
    """One file's bytes, when it was written, and its version (unique in the process: what a held
    removal and ``delete_own`` compare, as S3's ``If-Match`` compares ETags)."""

    __slots__ = ("data", "mtime", "version")

    def __init__(self, data: bytes, version: int) -> None:
        self.data = data
        self.mtime = time.time()
        self.version = version


class _Files:
    """The files of one name, shared by all its handles."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.files: Dict[str, _File] = {}


_NAMES: Dict[str, _Files] = {}
_NAMES_LOCK = threading.Lock()
_VERSIONS = itertools.count(1)


def parse_memory_url(url: str) -> str:
    """The name in ``memory://NAME``.

    >>> parse_memory_url("memory://run-1")
    'run-1'
    """
    if not isinstance(url, str) or not url.startswith(SCHEME) or not url[len(SCHEME):].strip("/"):
        raise ArgumentError(f"{url!r} is not a memory:// URL; expected memory://NAME (any non-empty name: stores "
                            "of one name in one process share their files)")
    return url[len(SCHEME):].strip("/")


class MemoryStorage(Publisher):
    """The storage interface over files held in this process's memory, shared by name.

    ``cache_dir`` and ``cache_bytes`` bound the local copies readers map (see the module).

    >>> a, b = MemoryStorage("memory://shared-example"), MemoryStorage("memory://shared-example")
    >>> a.put_if_absent("x", b"1"), b.put_if_absent("x", b"2"), b.read_bytes("x")
    (True, False, b'1')
    >>> a.destroy(); b.list("")
    []
    """

    can_map = False
    exclusive_lock = False
    reliable_listing = True
    cached = True
    symlinks = False
    #: nothing is leased: a stopped writer's files are judged by their age alone, as on S3
    holds_leases = False

    def __init__(self, url: str, *, cache_dir: Optional[str] = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.name = parse_memory_url(url)
        self.url = SCHEME + self.name
        if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes <= 0:
            raise ArgumentError(f"cache_bytes must be a positive number of bytes, got {cache_bytes!r}")
        self._cache_args = (cache_dir, cache_bytes)
        with _NAMES_LOCK:
            self._shared = _NAMES.setdefault(self.name, _Files())
        #: whether the last publish got as far as its create (it cannot fail after it here)
        self.link_attempted = False
        #: the versions of the files this writer made for the commit in progress (see delete_own)
        self._own: Dict[str, int] = {}

    # -- bytes ------------------------------------------------------------------

    def _get(self, rel: str) -> _File:
        f = self._shared.files.get(check_rel(rel))
        if f is None:
            raise FileNotFoundError(errno.ENOENT, "No such file in memory", f"{self.url}/{rel}")
        return f

    def _set(self, rel: str, data: Buffer) -> int:
        f = _File(bytes(memoryview(data).cast("B")), next(_VERSIONS))
        with self._shared.lock:
            self._shared.files[rel] = f
        return f.version

    def read_bytes(self, rel: str, limit: Optional[int] = None) -> bytes:
        data = self._get(rel).data
        if limit is not None and len(data) > limit:
            raise CorruptStoreError(f"{self.url}/{rel} is {len(data)} bytes; at most {limit} are expected here")
        return data

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        start, end = check_range(rel, start, end)
        return self._get(rel).data[start:end]

    def size(self, rel: str) -> int:
        return len(self._get(rel).data)

    def age(self, rel: str) -> float:
        return time.time() - self._get(rel).mtime

    def exists(self, rel: str) -> bool:
        return check_rel(rel) in self._shared.files

    def _children(self, reldir: str) -> Dict[str, Tuple[str, Optional[_File]]]:
        """What lies directly in ``reldir``: each name's kind (a file, or ``dir`` for a prefix)."""
        reldir = check_rel(reldir, allow_root=True)
        prefix = f"{reldir}/" if reldir else ""
        out: Dict[str, Tuple[str, Optional[_File]]] = {}
        with self._shared.lock:
            items = list(self._shared.files.items())
        for rel, f in items:
            if rel.startswith(prefix):
                name, sep, _ = rel[len(prefix):].partition("/")
                if sep:
                    out.setdefault(name, ("dir", None))
                else:
                    out[name] = ("file", f)
        return out

    def list(self, reldir: str) -> List[str]:
        return sorted(n for n, (kind, _) in self._children(reldir).items() if kind == "file")

    def list_kinds(self, reldir: str) -> Dict[str, str]:
        return {n: kind for n, (kind, _) in sorted(self._children(reldir).items())}

    def list_ages(self, reldir: str) -> Dict[str, float]:
        now = time.time()
        return {n: now - f.mtime for n, (_, f) in sorted(self._children(reldir).items()) if f is not None}

    def stat(self, rel: str) -> Optional[Tuple[str, int]]:
        """``("file", size)``, ``("dir", 0)`` for a prefix something lies under (the root always),
        ``None`` otherwise: there are no links."""
        rel = check_rel(rel, allow_root=True)
        if not rel:
            return "dir", 0
        f = self._shared.files.get(rel)
        if f is not None:
            return "file", len(f.data)
        with self._shared.lock:
            under = any(r.startswith(rel + "/") for r in self._shared.files)
        return ("dir", 0) if under else None

    def move(self, rel: str, dest: str, *, if_absent: bool = False) -> bool:
        """Rename ``rel`` to ``dest`` at once; ``if_absent``: only while ``dest`` is free (False, and
        nothing moved, when it is taken)."""
        rel, dest = check_rel(rel), check_rel(dest)
        with self._shared.lock:
            f = self._get(rel)
            if if_absent and dest in self._shared.files:
                return False
            self._shared.files[dest] = f
            del self._shared.files[rel]
        self._forget(rel)
        self._forget(dest)
        return True

    def write_new(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> None:
        """Create ``rel``, which must not exist (there is no lock: a second writer never overwrites a
        file another commit names)."""
        if not self.put_if_absent(rel, data):
            raise CommitConflictError(
                f"{self.url}/{rel} already exists: another writer wrote it (a memory store has no lock; give a "
                "single-writer store one writer, or create it with multi_writer=True); nothing was overwritten")

    def replace(self, rel: str, data: Buffer, *, step: Optional[str] = None, sync: bool = True) -> None:
        """Replace ``rel``, except a manifest, which is only ever created (no lock keeps a second
        writer of a single-writer store out: it learns of the first at its commit)."""
        rel = check_rel(rel)
        if rel.startswith(_MANIFEST_PREFIX):
            if not self.put_if_absent(rel, data):
                raise CommitConflictError(
                    f"{self.url}/{rel} was committed by another writer while this single-writer store was open "
                    "(a memory store has no lock, so a second writer is found at its commit); nothing of this "
                    "commit is visible: close the store and reopen it, and give each store one writer, or "
                    "create it with multi_writer=True for many")
            return
        self._set(rel, data)
        self._forget(rel)

    def write_files(self, files: Sequence[Tuple[str, Buffer, Optional[str]]], dirs: Sequence[str] = ()) -> None:
        """Write ``(rel, data, step)`` files whose names are this writer's alone (reserved, or named
        after an id it reserved); ``dirs`` need nothing."""
        for rel, data, _ in files:
            self._own[rel] = self._set(check_rel(rel), data)
            self._forget(rel)

    def delete(self, rel: str) -> bool:
        """Remove ``rel``; True if it was there."""
        rel = check_rel(rel)
        with self._shared.lock:
            gone = self._shared.files.pop(rel, None) is not None
        self._forget(rel)
        return gone

    def some_names(self, limit: int = 1000) -> List[str]:
        """Paths of up to ``limit`` files anywhere in the store."""
        with self._shared.lock:
            return sorted(self._shared.files)[:limit]

    # -- local copies for readers -------------------------------------------------

    def page_cache(self) -> ObjectCache:
        """The bounded local cache readers' copies live in (``cache_dir``, ``cache_bytes``), made on
        first use."""
        cache = self.__dict__.get("_page_cache")
        if cache is None:
            directory, capacity = self._cache_args
            cache = self.__dict__["_page_cache"] = ObjectCache(directory, capacity, self.url)
        return cache

    def _forget(self, rel: str) -> None:
        cache = self.__dict__.get("_page_cache")
        if cache is not None:
            cache.forget(rel)

    def fetch_ranges(self, rel: str, ranges: Optional[Sequence[Tuple[int, int]]], *,
                     size: Optional[int] = None, evict: bool = True, tag: Optional[str] = None) -> str:
        # the file's version keeps a name written again (after a repair) apart from its old bytes
        version = self._get(rel).version
        return super().fetch_ranges(rel, ranges, size=size, evict=evict,
                                    tag=f"v{version}" if tag is None else f"v{version}-{tag}")

    def destroy(self) -> None:
        """Remove every file of this name, for every handle (the name starts empty again)."""
        with self._shared.lock:
            self._shared.files.clear()
        self.close()

    # -- the commit protocol ------------------------------------------------------

    def put_if_absent(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> bool:
        rel = check_rel(rel)
        f = _File(bytes(memoryview(data).cast("B")), next(_VERSIONS))
        with self._shared.lock:
            if rel in self._shared.files:
                return False
            self._shared.files[rel] = f
        self._own[rel] = f.version
        self._forget(rel)
        return True

    def settle_publish(self, rel: str, data: Buffer) -> Optional[bool]:
        """Whether ``rel`` holds ``data`` (nothing is ever in doubt here)."""
        try:
            return self.read_bytes(rel) == bytes(data)
        except FileNotFoundError:
            return False

    def update_small(self, rel: str, update: Callable[[Optional[bytes]], Optional[bytes]]) -> Optional[bytes]:
        """Read-modify-write ``rel`` with no concurrent update lost: ``update`` runs outside the lock
        on the bytes read, and its result is written only if the file is still the version read
        (else it runs again on the newer bytes)."""
        rel = check_rel(rel)
        while True:
            f = self._shared.files.get(rel)
            current = None if f is None else f.data
            new = update(current)
            if new is None:
                return current
            with self._shared.lock:
                if self._shared.files.get(rel) is f:
                    self._shared.files[rel] = _File(bytes(new), next(_VERSIONS))
                    return bytes(new)

    def release_leases(self) -> None:
        """Nothing is leased; the versions of this commit's files are forgotten."""
        self._own.clear()

    def delete_own(self, rel: str) -> bool:
        """Remove ``rel``, a file this writer made for a commit that did not happen, only while it is
        still that file."""
        version = self._own.pop(check_rel(rel), None)
        return self.delete(rel) if version is None else self._delete_if(rel, version)

    def _delete_if(self, rel: str, version: int) -> bool:
        with self._shared.lock:
            f = self._shared.files.get(rel)
            if f is None or f.version != version:
                return False
            del self._shared.files[rel]
        self._forget(rel)
        return True

    def hold(self, rels: Sequence[str]) -> Dict[str, Optional[int]]:
        """Of ``rels``, those that exist, each with its version now: :meth:`remove_held` removes it
        only while it is still that file."""
        with self._shared.lock:
            return {rel: f.version for rel in rels if (f := self._shared.files.get(check_rel(rel))) is not None}

    def hold_run(self, rels: Sequence[str]) -> Tuple[Dict[str, Optional[int]], bool]:
        """All of ``rels`` that exist, held as by :meth:`hold`: there are no leases."""
        return self.hold(rels), True

    def remove_held(self, rel: str, handle: Optional[int]) -> bool:
        return self.delete(rel) if handle is None else self._delete_if(check_rel(rel), handle)

    def __reduce__(self):
        # a handle travels (to a thread's copy, a pickled reader) as its name: the files stay shared
        cache_dir, cache_bytes = self._cache_args
        return (_rebuild, (self.url, cache_dir, cache_bytes))

    def __repr__(self) -> str:
        return f"MemoryStorage({self.url!r})"


def _rebuild(url: str, cache_dir: Optional[str], cache_bytes: int) -> MemoryStorage:
    return MemoryStorage(url, cache_dir=cache_dir, cache_bytes=cache_bytes)


__all__ = ["MemoryStorage", "parse_memory_url"]
