"""The storage interface a store does all its file I/O through, in two parts.

:class:`Storage` moves bytes: reads, ranges, listings, writes of files no
manifest names yet, replaces, deletes. :class:`Publisher` extends it with the
commit protocol's primitives: names reserved or created only if absent,
publishing a manifest, staging one before the race, the collection floor's
read-modify-write, leases and the removals a clean-up makes. Readers, the
format code and ``verify`` need a ``Storage``; the committer and the
collector need a ``Publisher``.

A store's files are addressed by *relative paths*: ``/``-separated, below the
store's root, never absolute, never with ``..`` or empty parts (so no path
from a manifest can escape the store). Two implementations exist, each both
parts: a directory (:class:`~diskreplay.storage.local.LocalStorage`, the
store's own fast path) and an S3-compatible bucket prefix
(:class:`~diskreplay.storage.S3Storage`). The contract below is what both
honour; ``tests/test_storage.py`` runs it against each.

Storage (bytes):

==========================================  ==================================
``read_bytes(rel, limit=None)``             the whole file; ``FileNotFoundError``
                                            if absent
``read_range(rel, start, end)``             bytes ``[start, end)``, short at the
                                            end of the file (like ``pread``)
``size(rel)`` / ``age(rel)``                its length in bytes / seconds since
                                            it was written
``list(reldir)``                            names directly in ``reldir``
                                            (temporary names included, so a
                                            clean-up sees them); ``[]`` if none
``list_kinds(reldir)`` / ``list_ages``      the same names with each one's kind
                                            / age in seconds
``stat(rel)``                               ``(kind, size)``, kind one of
                                            ``file``, ``dir``, ``link``,
                                            ``other`` (a symlink at ``rel`` is
                                            not followed; an object store has
                                            files and prefixes only); ``None``
                                            if absent
``move(rel, dest)``                         ``rel`` under the name ``dest`` (a
                                            rename; on an object store a copy,
                                            then a delete)
``write_new(rel, data, step=)``             create a file whose name no one
                                            else writes (a segment); no
                                            manifest names it until it is whole
``replace(rel, data, step=, sync=)``        durably and atomically replace
                                            ``rel``
``write_files(files, dirs)``                write ``(rel, data, step)`` files
                                            no manifest names yet (reserved or
                                            derived from a reserved id) and
                                            make them and ``dirs`` durable
``delete(rel)``                             remove ``rel``; absent is no error
``sync_dir(reldir)`` / ``ensure_dir``       make creations and deletions
                                            durable / make a directory (no-ops
                                            on an object store)
``local_path(rel, size=)``                  a local file with ``rel``'s bytes,
                                            for ``mmap``; only immutable files
                                            (``size``, if known, saves a request)
``fetch_ranges(rel, ranges, size=)``        like ``local_path`` but only the
                                            byte ranges asked for are sure to
                                            be present (a sparse cache file)
==========================================  ==================================

Publisher (the commit protocol; also a Storage):

==========================================  ==================================
``put_if_absent(rel, data, step=)``         atomically create ``rel`` only if
                                            absent; ``True`` if this call
                                            created it (the existing file is
                                            untouched otherwise)
``link_candidates(rel_of, data, first)``    create ``rel_of(i)`` for the first
                                            free ``i >= first``; ``(i, rel)``
``reserve(rel_of, first)``                  take the first free name
                                            ``rel_of(i)``, empty, for this
                                            writer to fill; ``(i, rel)``
``name_durable(rel)``                       whether ``rel``'s name is durable
                                            already (reserved ahead: its
                                            directory need no fsync)
``publish(rel, data, files, dirs,           ``write_files``, then create the
exclusive=)``                               manifest ``rel``: only if absent
                                            when ``exclusive`` (False if taken)
``stage(reldir, data, files, dirs)``       ``write_files`` and a manifest-to-be
                                            whose name is not known yet, before
                                            the race: ``publish`` of the same
                                            ``data`` then only creates the name
``discard_staged()``                        drop what ``stage`` (or a lost
                                            ``publish``) kept
``update_small(rel, update)``               read-modify-write a small file
                                            (the collection floor) with no
                                            concurrent update lost: returns
                                            the bytes it holds after
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
``link_attempted``                          whether the last ``publish`` got
                                            as far as its link (or PUT): an
                                            error then leaves it in doubt
``release_leases()`` / ``holds_leases``     end the leases of this writer's
                                            files (after its commit) / whether
                                            it takes any (local many-writer
                                            stores with flock)
``probe_create_if_absent(reldir)``          raise unless ``put_if_absent`` is
                                            atomic here (many writers need it)
==========================================  ==================================

``url`` names the store in messages (a directory or ``s3://bucket/prefix``).
A store branches on what its storage can do, never on its type:

==========================================  ==================================
``can_map``                                 ``local_path`` is the file itself,
                                            mapped where it lies (else
                                            ``fetch_ranges`` brings pages to a
                                            cache first)
``exclusive_lock``                          one writer can hold the store's
                                            ``LOCK`` (flock) and keep others out
                                            (else every commit is create-if-
                                            absent and a floor guards clean-up)
``reliable_listing``                        ``list`` shows every file present
                                            (else the newest manifest is found
                                            by probing, never by listing)
``cached``                                  reads go through a bounded local
                                            cache (``trim_cache``,
                                            ``cache_stats``); each request is a
                                            round trip, so reads batch them
==========================================  ==================================

``remote`` (``not can_map``) is kept for callers of earlier versions.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

from ..errors import ArgumentError

Buffer = Union[bytes, bytearray, memoryview]


@runtime_checkable
class Storage(Protocol):
    """The bytes of a store: what readers, the format code and ``verify`` need from the place its
    files live (see the module docstring).

    >>> from diskreplay.storage.local import LocalStorage
    >>> import tempfile, shutil
    >>> root = tempfile.mkdtemp()
    >>> isinstance(LocalStorage(root), Storage)
    True
    >>> shutil.rmtree(root)
    """

    url: str
    can_map: bool
    exclusive_lock: bool
    reliable_listing: bool
    cached: bool
    remote: bool

    def read_bytes(self, rel: str, limit: Optional[int] = None) -> bytes: ...

    def read_range(self, rel: str, start: int, end: int) -> bytes: ...

    def size(self, rel: str) -> int: ...

    def age(self, rel: str) -> float: ...

    def exists(self, rel: str) -> bool: ...

    def list(self, reldir: str) -> List[str]: ...

    def list_kinds(self, reldir: str) -> Dict[str, str]: ...

    def list_ages(self, reldir: str) -> Dict[str, float]: ...

    def stat(self, rel: str) -> Optional[Tuple[str, int]]: ...

    def move(self, rel: str, dest: str) -> None: ...

    def write_new(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> None: ...

    def replace(self, rel: str, data: Buffer, *, step: Optional[str] = None, sync: bool = True) -> None: ...

    def write_files(self, files: Sequence[Tuple[str, Buffer, Optional[str]]], dirs: Sequence[str] = ()) -> None: ...

    def delete(self, rel: str) -> bool: ...

    def sync_dir(self, reldir: str) -> None: ...

    def ensure_dir(self, reldir: str) -> None: ...

    def local_path(self, rel: str, size: Optional[int] = None) -> str: ...

    def fetch_ranges(self, rel: str, ranges: Optional[Sequence[Tuple[int, int]]], *,
                     size: Optional[int] = None) -> str: ...

    def check(self) -> None: ...

    def trim_cache(self) -> List[str]: ...


@runtime_checkable
class Publisher(Storage, Protocol):
    """A :class:`Storage` that also carries out the commit protocol (docs/FORMAT.md): reserving
    names, creating only if absent, publishing and staging manifests, the floor's
    read-modify-write, leases and a clean-up's removals. The committer and the collector take one;
    both backends are one (``isinstance(LocalStorage(root), Publisher)``).

    >>> sorted(n for n in vars(Publisher) if not n.startswith("_"))[:4]
    ['delete_own', 'discard_staged', 'hold', 'hold_run']
    """

    holds_leases: bool
    link_attempted: bool

    def put_if_absent(self, rel: str, data: Buffer, *, step: Optional[str] = None) -> bool: ...

    def link_candidates(self, rel_of: Callable[[int], str], data: Buffer, first: int, *,
                        tries: int = 1 << 16, step: Optional[str] = None) -> Tuple[int, str]: ...

    def reserve(self, rel_of: Callable[[int], str], first: int, *, tries: int = 1 << 16) -> Tuple[int, str]: ...

    def name_durable(self, rel: str) -> bool: ...

    def publish(self, rel: str, data: Buffer, files: Sequence[Tuple[str, Buffer, Optional[str]]] = (),
                dirs: Sequence[str] = (), *, exclusive: bool, step: Optional[str] = None) -> bool: ...

    def stage(self, reldir: str, data: Buffer, files: Sequence[Tuple[str, Buffer, Optional[str]]] = (),
              dirs: Sequence[str] = (), *, step: Optional[str] = None) -> None: ...

    def discard_staged(self) -> None: ...

    def settle_publish(self, rel: str, data: Buffer) -> Optional[bool]: ...

    def update_small(self, rel: str, update: Callable[[Optional[bytes]], Optional[bytes]]) -> Optional[bytes]: ...

    def delete_own(self, rel: str) -> bool: ...

    def hold(self, rels: Sequence[str]) -> Mapping[str, Any]: ...

    def hold_run(self, rels: Sequence[str]) -> Tuple[Mapping[str, Any], bool]: ...

    def remove_held(self, rel: str, handle: Any) -> bool: ...

    def unhold(self, held: Mapping[str, Any]) -> None: ...

    def release_leases(self) -> None: ...

    def probe_create_if_absent(self, reldir: str) -> None: ...


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
