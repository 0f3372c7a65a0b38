"""The storage interface a store does all its file I/O through, in two parts.

:class:`Storage` moves bytes: reads, ranges, listings, writes of files no
manifest names yet, replaces, deletes, and what a place can do besides
(locks, memory maps, moves, its root). :class:`Publisher` adds the commit
protocol's primitives on top of those bytes: names reserved or created only
if absent, publishing a manifest, staging one before the race, the
collection floor's read-modify-write, leases and the removals a clean-up
makes. Readers, the format code and ``verify`` need a ``Storage``; the
committer and the collector need a ``Publisher``.

A backend implements a small abstract core; every other member has a
default built on that core, which a backend overrides only where it can do
better (fewer requests, a rename, a lock):

==========================================  ==================================
the core (abstract)
==========================================  ==================================
``url``                                     names the store in messages
``read_bytes(rel, limit=None)``             the whole file; ``FileNotFoundError``
                                            if absent
``read_range(rel, start, end)``             bytes ``[start, end)``, short at the
                                            end of the file (like ``pread``)
``stat(rel)``                               ``(kind, size)``, kind one of
                                            ``file``, ``dir``, ``link``,
                                            ``other`` (a symlink at ``rel`` is
                                            not followed); ``None`` if absent
``list_kinds(reldir)``                      names directly in ``reldir`` with
                                            each one's kind (temporary names
                                            included, so a clean-up sees them)
``list_ages(reldir)``                       the same names with each one's age
                                            in seconds
``replace(rel, data, step=, sync=)``        durably and atomically replace
                                            ``rel``
``put_if_absent(rel, data, step=)``         atomically create ``rel`` only if
                                            absent; ``True`` if this call
                                            created it (the existing file is
                                            untouched otherwise)
``delete(rel)``                             remove ``rel``; absent is no error
==========================================  ==================================

Defaulted on the core: ``size``, ``age``, ``exists``, ``list``,
``read_ranges`` (many ranges of one file), ``move`` (a copy, then a delete;
``if_absent=True``: only onto a free name), ``write_new`` (a file whose
name no one else writes: a segment), ``write_files(files, dirs)`` (files no
manifest names yet, made durable with ``dirs``), ``some_names`` (paths
below the root, any depth, up to a limit), ``sync_dir`` / ``ensure_dir`` /
``make_root`` (no-ops where there are no directories), ``lock`` (``None``:
no lock), ``map`` (``None``: nothing is mapped where it lies),
``fetch_ranges`` / ``local_path`` (byte ranges of an immutable file brought
into a bounded local page cache, :mod:`.cache`, and its path, for
``mmap``), ``trim_cache``, ``cache_stats``, ``check``, ``writer``,
``close``.

Publisher (the commit protocol; also a Storage), every member defaulted on
the core's ``put_if_absent`` (the way an object store commits: one
conditional PUT per manifest); a directory overrides them with links,
reserved names and ``flock`` leases:

==========================================  ==================================
``link_candidates(rel_of, data, first)``    create ``rel_of(i)`` for the first
                                            free ``i >= first``; ``(i, rel)``
``reserve(rel_of, first)``                  take the first free name
                                            ``rel_of(i)``, empty, for this
                                            writer to fill; ``(i, rel)``
                                            (``ahead``/``max_age``: names taken
                                            several at a time, where that helps)
``name_durable(rel)``                       whether ``rel``'s name is durable
                                            already (reserved ahead: its
                                            directory need no fsync)
``publish(rel, data, files, dirs,           ``write_files``, then create the
exclusive=)``                               manifest ``rel``: only if absent
                                            when ``exclusive`` (False if taken),
                                            or where there is no lock
                                            (``CommitConflictError`` if taken)
``stage(reldir, data, files, dirs)``        ``write_files`` and a manifest-to-be
                                            whose name is not known yet, before
                                            the race: ``publish`` of the same
                                            ``data`` then only creates the name
``discard_staged()``                        drop what ``stage`` (or a lost
                                            ``publish``) kept
``update_small(rel, update)``               read-modify-write a small file
                                            (the collection floor) with no
                                            concurrent update lost: returns
                                            the bytes it holds after (the
                                            default only creates it)
``delete_own(rel)``                         remove a file this writer made for
                                            a commit that did not happen, only
                                            while it is still that file
``hold(rels)`` / ``remove_held(rel, h)``    a clean-up's removal: of ``rels``,
/ ``unhold(held)``                          those no live writer leases, held
                                            so that the removal takes exactly
                                            the file judged (local: an
                                            exclusive flock; S3: ``If-Match``)
``hold_run(rels)``                          a clean-up's collection of
                                            manifests (oldest first): the run
                                            up to the first one whose writer
                                            has not read the floor after its
                                            link (local: its flock lease),
                                            held as by ``hold``; and whether
                                            that run is all of ``rels``
``settle_publish(rel, data)``               after a ``publish`` that raised:
                                            True if ``rel`` holds ``data`` for
                                            good, False if it never will, None
                                            if not known
``published``                               the name the last ``publish``
                                            created
``link_attempted``                          whether the last ``publish`` got
                                            as far as its link (or PUT): an
                                            error then leaves it in doubt
``release_leases()`` / ``holds_leases``     end the leases of this writer's
                                            files (after its commit) / whether
                                            it takes any
``release_ahead()``                         give up names reserved ahead
``probe_create_if_absent(reldir)``          raise unless ``put_if_absent`` is
                                            atomic here (many writers need it)
==========================================  ==================================

A store's files are addressed by *relative paths*: ``/``-separated, below the
store's root, never absolute, never with ``..`` or empty parts (so no path
from a manifest can escape the store). ``diskreplay.testing`` holds the
contract every backend passes.

A store branches on what its storage can do, never on its type (the device's
characteristics, as SQLite's VFS states them):

==========================================  ==================================
``can_map``                                 ``map``/``local_path`` give the
                                            file itself, mapped where it lies
                                            (else ``fetch_ranges`` brings pages
                                            to a cache first)
``exclusive_lock``                          ``lock`` gives a lock (``flock``)
                                            one writer can hold to keep others
                                            out (else every commit is create-
                                            if-absent and a floor guards
                                            clean-up)
``reliable_listing``                        ``list`` shows every file present
                                            (else the newest manifest is found
                                            by probing, never by listing)
``cached``                                  reads go through a bounded local
                                            cache (``trim_cache``,
                                            ``cache_stats``); each request is a
                                            round trip, so reads batch them
``symlinks``                                a name can be a symbolic link (a
                                            store checks that its directories
                                            are its own)
==========================================  ==================================

``remote`` (``not can_map``) is kept for callers of earlier versions.
"""

from __future__ import annotations

import errno
import operator
import secrets
from abc import abstractmethod
from typing import (Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union,
                    runtime_checkable)

from .._fileio import TMP_PREFIX, crash_point
from ..errors import ArgumentError, CommitConflictError, ConditionalWriteError

Buffer = Union[bytes, bytearray, memoryview]
Files = Sequence[Tuple[str, Buffer, Optional[str]]]

#: the bytes of a page cache a storage makes for itself (see :meth:`Storage.fetch_ranges`)
DEFAULT_CACHE_BYTES = 4 << 30


@runtime_checkable
class Lock(Protocol):
    """A lock :meth:`Storage.lock` gives: ``acquire`` (``StoreLockedError`` if another process
    holds it), ``release``, and ``probe`` (raise if someone holds it now, take nothing)."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...

    def probe(self) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """The bytes of a store: what readers, the format code and ``verify`` need from the place its
    files live (see the module docstring). A backend subclasses it and implements the abstract
    core; the rest is defaulted.

    >>> from diskreplay.storage.local import LocalStorage
    >>> import tempfile, shutil
    >>> root = tempfile.mkdtemp()
    >>> isinstance(LocalStorage(root), Storage)
    True
    >>> shutil.rmtree(root)
    """

    # -- what it can do (the device's characteristics) --
    can_map: bool = False
    exclusive_lock: bool = False
    reliable_listing: bool = True
    cached: bool = False
    symlinks: bool = False

    # -- the core --------------------------------------------------------------

    url: str

    @abstractmethod
    def read_bytes(self, rel: str, limit: Optional[int] = None) -> bytes: ...

    @abstractmethod
    def read_range(self, rel: str, start: int, end: int) -> bytes: ...

    @abstractmethod
    def stat(self, rel: str) -> Optional[Tuple[str, int]]: ...

    @abstractmethod
    def list_kinds(self, reldir: str) -> Dict[str, str]: ...

    @abstractmethod
    def list_ages(self, reldir: str) -> Dict[str, float]: ...

    @abstractmethod
    def replace(self, rel: str, data: Buffer, *, step: Optional[str] = None, sync: bool = True) -> None: ...

    @abstractmethod
    def put_if_absent(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> bool: ...

    @abstractmethod
    def delete(self, rel: str) -> bool: ...

    # -- defaulted on the core ---------------------------------------------------

    @property
    def remote(self) -> bool:
        """``not can_map``, for callers of earlier versions."""
        return not self.can_map

    def size(self, rel: str) -> int:
        st = self.stat(rel)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "no such file in the store", f"{self.url}/{rel}")
        return st[1]

    def age(self, rel: str) -> float:
        """Seconds since ``rel`` was written (from its directory's listing)."""
        reldir, _, name = rel.rpartition("/")
        ages = self.list_ages(reldir)
        if name not in ages:
            raise FileNotFoundError(errno.ENOENT, "no such file in the store", f"{self.url}/{rel}")
        return ages[name]

    def exists(self, rel: str) -> bool:
        return self.stat(rel) is not None

    def list(self, reldir: str) -> List[str]:
        return sorted(self.list_kinds(reldir))

    def read_ranges(self, rel: str, ranges: Sequence[Tuple[int, int]]) -> List[bytes]:
        """Bytes of each ``(start, end)`` of ``rel`` (as :meth:`read_range`); a backend with
        concurrent range requests overrides it."""
        return [self.read_range(rel, s, e) for s, e in ranges]

    def move(self, rel: str, dest: str, *, if_absent: bool = False) -> bool:
        """``rel`` under the name ``dest`` (a copy, then a delete: a failure between the two leaves
        the file in both places, never in neither); ``if_absent``: only while ``dest`` is free
        (False, and nothing moved, when it is taken). The caller syncs the directories."""
        data = self.read_bytes(rel)
        if if_absent:
            if not self.put_if_absent(dest, data):
                return False
        else:
            self.write_new(dest, data)
        self.delete(rel)
        return True

    def write_new(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> None:
        """Create ``rel``, a name no one else writes (a segment); no manifest names it until it is
        whole."""
        self.replace(rel, data, step=step, sync=False)

    def write_files(self, files: Files, dirs: Sequence[str] = ()) -> None:
        """Write ``(rel, data, step)`` files no manifest names yet (reserved, or named after a
        reserved id) and make them and ``dirs`` durable."""
        for rel, data, step in files:
            self.replace(rel, data, step=step, sync=False)
        for d in dict.fromkeys(dirs):
            self.sync_dir(d)

    def some_names(self, limit: int = 1000) -> List[str]:
        """Paths below the root, at any depth (directories too, links not followed), up to about
        ``limit`` of them: what a new store's creation checks is not another program's."""
        out: List[str] = []
        todo = [""]
        while todo and len(out) < limit:
            reldir = todo.pop(0)
            for name, kind in sorted(self.list_kinds(reldir).items()):
                rel = f"{reldir}/{name}" if reldir else name
                out.append(rel)
                if kind == "dir":
                    todo.append(rel)
        return out

    def sync_dir(self, reldir: str) -> None:
        """Make creations and deletions in ``reldir`` durable (nothing to do without directories)."""

    def ensure_dir(self, reldir: str) -> None:
        """Make the directory ``reldir`` (nothing to do without directories)."""

    def make_root(self, reldirs: Sequence[str] = ()) -> None:
        """Make the store's root and ``reldirs`` in it, durably (nothing to do without directories)."""
        for d in reldirs:
            self.ensure_dir(d)

    def lock(self, rel: str, *, shared: bool = False) -> Optional[Lock]:
        """A lock on the file ``rel`` that keeps other processes out (``shared``: only out of an
        exclusive hold), not taken yet; ``None`` where there are no locks (``exclusive_lock``)."""
        return None

    def map(self, rel: str, *, min_bytes: int = 0, max_bytes: Optional[int] = None) -> Any:
        """A read-only memory map of ``rel`` where it lies, if its size is within the bounds; ``None``
        otherwise, and always where files are not mapped in place (``can_map``)."""
        return None

    def fetch_ranges(self, rel: str, ranges: Optional[Sequence[Tuple[int, int]]], *,
                     size: Optional[int] = None, evict: bool = True, tag: Optional[str] = None) -> str:
        """A local file of the immutable file ``rel``'s size in which the byte ``ranges`` (all when
        None) are present, for ``mmap``: by default a sparse file in this storage's page cache
        (:mod:`.cache`), filled by :meth:`read_ranges` (``tag`` keeps copies of different contents
        under one name apart; ``evict=False`` leaves the bound to :meth:`trim_cache`)."""
        from .cache import fetch_into

        return fetch_into(self, self.page_cache(), rel, ranges, size=size, evict=evict, tag=tag)

    def local_path(self, rel: str, size: Optional[int] = None, tag: Optional[str] = None) -> str:
        """A local file with all of ``rel``'s bytes, for ``mmap`` (only immutable files; ``size``, if
        known, saves a request); ``""`` gives the store's URL."""
        if rel in ("", "."):
            return self.url
        return self.fetch_ranges(rel, None, size=size, tag=tag)

    def page_cache(self) -> Any:
        """The bounded local cache :meth:`fetch_ranges` fills (:class:`.cache.ObjectCache`), made on
        first use in a private directory."""
        cache = self.__dict__.get("_page_cache")
        if cache is None:
            from .cache import ObjectCache

            cache = self.__dict__["_page_cache"] = ObjectCache(None, DEFAULT_CACHE_BYTES, self.url)
        return cache

    def trim_cache(self) -> List[str]:
        """Evict the page cache down to its bound; the names evicted."""
        cache = self.__dict__.get("_page_cache")
        return [] if cache is None else [key.split("#", 1)[0] for key in cache.trim()]

    def cache_stats(self) -> Any:
        """Byte counters of the page cache (:class:`.cache.CacheStats`; zeros where there is none)."""
        from .cache import CacheStats

        cache = self.__dict__.get("_page_cache")
        return CacheStats() if cache is None else cache.stats

    def check(self) -> None:
        """Raise now, naming the fix, if the place cannot be used (a missing bucket, credentials)."""

    def writer(self, writer_id: str = "", *, fsync: bool = True, leases: bool = False) -> "Publisher":
        """The handle one writer commits through (``writer_id`` in its temporary names; ``fsync``
        and ``leases`` where the storage has them): by default this storage itself."""
        return self  # type: ignore[return-value]

    def close(self) -> None:
        """Release what this handle keeps (descriptors, its page cache's private files)."""
        cache = self.__dict__.pop("_page_cache", None)
        if cache is not None:
            cache.close()


@runtime_checkable
class Publisher(Storage, Protocol):
    """A :class:`Storage` that also carries out the commit protocol (docs/FORMAT.md): reserving
    names, creating only if absent, publishing and staging manifests, the floor's
    read-modify-write, leases and a clean-up's removals. The committer and the collector take one;
    both backends are one (``isinstance(LocalStorage(root), Publisher)``). Every member is
    defaulted on :meth:`Storage.put_if_absent` (conditional PUTs, no leases, no locks).

    >>> sorted(n for n in vars(Publisher) if not n.startswith("_"))[:4]
    ['delete_own', 'discard_staged', 'hold', 'hold_run']
    """

    holds_leases: bool = False
    link_attempted: bool = False
    #: the name the last successful :meth:`publish` of this handle created (where a search for a
    #: newer commit can start)
    published: str = ""

    def link_candidates(self, rel_of: Callable[[int], str], data: Buffer, first: int, *,
                        tries: int = 1 << 16, step: Optional[str] = None) -> Tuple[int, str]:
        for i in range(first, first + tries):
            rel = check_rel(rel_of(i))
            if self.put_if_absent(rel, data, step=step):
                return i, rel
        raise CommitConflictError(f"{self.url}/{rel_of(first)}: no free name after {tries} tries")

    def reserve(self, rel_of: Callable[[int], str], first: int, *, tries: int = 1 << 16, ahead: int = 1,
                max_age: float = 0.0) -> Tuple[int, str]:
        """Take the first free name ``rel_of(i)``, ``i >= first``, by creating it empty;
        :meth:`write_files` fills it (``ahead``, ``max_age``: see the local backend)."""
        return self.link_candidates(rel_of, b"", first, tries=tries)

    def name_durable(self, rel: str) -> bool:
        return True

    def publish(self, rel: str, data: Buffer, files: Files = (), dirs: Sequence[str] = (), *,
                exclusive: bool, step: Optional[str] = None) -> bool:
        self.link_attempted = False
        self.write_files(files, dirs)
        if files:
            crash_point("segments.synced")
        self.link_attempted = True  # from here an error may be a creation still carried out
        if exclusive:
            created = self.put_if_absent(rel, data, step=step)
        elif self.exclusive_lock:
            self.replace(rel, data, step=step)
            created = True
        elif not self.put_if_absent(rel, data, step=step):
            # without a lock one writer cannot keep a second out: a manifest is only ever created, and
            # a second writer of a single-writer store learns of the first at its commit
            raise CommitConflictError(
                f"{self.url}/{rel} was committed by another writer while this single-writer store was open "
                "(this storage has no lock, so a second writer is found at its commit); nothing of this commit "
                "is visible: close the store and reopen it, and give each store one writer, or create it with "
                "multi_writer=True for many")
        else:
            created = True
        if created:
            self.published = rel
            if step:
                crash_point(f"{step}.renamed")
        return created

    def stage(self, reldir: str, data: Buffer, files: Files = (), dirs: Sequence[str] = (), *,
              step: Optional[str] = None) -> None:
        """Write ``files`` before the race for a generation; by default the manifest-to-be ``data``
        is sent whole by :meth:`publish` (one create-if-absent), so nothing is prepared for it here."""
        self.write_files(files, dirs)
        if files:
            crash_point("segments.synced")
        if step:
            crash_point(f"{step}.written")

    def discard_staged(self) -> None:
        """Nothing is staged by default: a publish that lost sends its bytes again."""

    def settle_publish(self, rel: str, data: Buffer) -> Optional[bool]:
        try:
            if self.put_if_absent(rel, data):
                return True
            return True if self.read_bytes(rel) == bytes(data) else None
        except OSError:
            return None

    def update_small(self, rel: str, update: Callable[[Optional[bytes]], Optional[bytes]]) -> Optional[bytes]:
        """By default the small file is only ever created (``put_if_absent``): once it exists, its
        bytes are returned unchanged (the caller then does less); a backend with a lock or a
        compare-and-swap overrides it."""
        try:
            current: Optional[bytes] = self.read_bytes(rel)
        except FileNotFoundError:
            current = None
        new = update(current)
        if new is None or current is not None:
            return current
        if self.put_if_absent(rel, new):
            return bytes(new)
        try:
            return self.read_bytes(rel)
        except FileNotFoundError:
            return None

    def delete_own(self, rel: str) -> bool:
        return self.delete(rel)

    def hold(self, rels: Sequence[str]) -> Mapping[str, Any]:
        return {rel: None for rel in rels if self.exists(rel)}

    def hold_run(self, rels: Sequence[str]) -> Tuple[Mapping[str, Any], bool]:
        return dict.fromkeys(rels), True

    def remove_held(self, rel: str, handle: Any) -> bool:
        return self.delete(rel)

    def unhold(self, held: Mapping[str, Any]) -> None:
        """Nothing is held by default."""

    def release_leases(self) -> None:
        """Nothing is leased by default."""

    def release_ahead(self) -> None:
        """No names are reserved ahead by default."""

    def probe_create_if_absent(self, reldir: str) -> None:
        """Raise :class:`ConditionalWriteError` unless :meth:`put_if_absent` refuses a taken name."""
        name = f"{reldir}/{TMP_PREFIX}probe.{secrets.token_hex(8)}"
        try:
            first = self.put_if_absent(name, b"1")
            second = self.put_if_absent(name, b"2")
            kept = self.read_bytes(name)
        finally:
            self.delete(name)
        if not (first and not second and kept == b"1"):
            raise ConditionalWriteError(f"{self.url}: many writers need an atomic create-if-absent and "
                                        "this storage let a second creation replace the first; use one writer")


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
