"""Opening, converting and closing a store: the options a caller asks for and their checks, the
refusal of a place that holds something else, the layout a new store gets, a writer's lock (where
the storage has one) and commit loop, and the manifest an open starts from.
:class:`~diskreplay.store.ReplayStore` calls :func:`open_store` once, from its constructor, and
keeps what it returns; :func:`convert` switches a store between one writer and many, and
:func:`close_store` lets go of what an open took.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import warnings
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from .. import format as fmt
from .._fileio import TMP_PREFIX
from ..errors import (ArgumentError, CorruptStoreError, OutputExistsError, SchemaError, StoreLockedError,
                      StoreNotFoundError)
from ..storage.base import Lock, Storage
from .committer import Committer
from .segment_cache import SegmentCache
from .writing import SegmentWriter


class Unset:
    """The default of an option a store keeps: the stored value on a reopen, the documented one on creation."""

    def __repr__(self) -> str:
        return "<stored>"


UNSET: Any = Unset()


def writer_id() -> str:
    """Unique per writer, in the names of its temporary files: 64 random bits, host and pid.

    >>> len(writer_id().split("-")[0])
    16
    """
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c in "-_")[:32] or "host"
    return f"{random.SystemRandom().getrandbits(64):016x}-{host}-{os.getpid()}"


@dataclasses.dataclass(frozen=True)
class Requested:
    """The stored options a caller passed (each :data:`UNSET` when left out).

    >>> Requested(capacity=0).check()
    Traceback (most recent call last):
    ...
    diskreplay.errors.ArgumentError: capacity must be a positive integer or None, got 0
    """

    capacity: Any = UNSET
    group_key: Any = UNSET
    capacity_bytes: Any = UNSET
    multi_writer: Any = UNSET
    retain_seconds: Any = UNSET

    def check(self) -> None:
        """Refuse values no store can have (before anything is read or written)."""
        for name in ("capacity", "capacity_bytes", "retain_seconds"):
            value = getattr(self, name)
            if value is not UNSET and value is not None and (
                    not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0):
                raise ArgumentError(f"{name} must be a positive integer or None, got {value!r}")
        key = self.group_key
        if key is not UNSET and key is not None and (not isinstance(key, str) or not key):
            raise ArgumentError(f"group_key must be a column name or None, got {key!r}")
        if self.multi_writer is not UNSET and not isinstance(self.multi_writer, bool):
            raise ArgumentError(f"multi_writer must be True or False, got {self.multi_writer!r}")

    def agree(self, path: str, stored: fmt.StoreOptions) -> None:
        """Refuse options that disagree with those of the store at ``path``."""
        if self.multi_writer is not UNSET and self.multi_writer != stored.multi_writer:
            kind = "a multi-writer" if stored.multi_writer else "a single-writer"
            raise SchemaError(
                f"multi_writer={self.multi_writer!r} disagrees with the store at {path}, which is {kind} store; "
                f"leave multi_writer out to open it as it is, or convert it (stop its writers first) with "
                f"`diskreplay compact {path} --multi-writer{'' if self.multi_writer else '=false'}` or "
                f"ReplayStore(path).compact(multi_writer={self.multi_writer!r})")
        for name, given, have in (("capacity", self.capacity, stored.capacity_rows),
                                  ("group_key", self.group_key, stored.group_key),
                                  ("capacity_bytes", self.capacity_bytes, stored.capacity_bytes),
                                  ("retain_seconds", self.retain_seconds, stored.retain_seconds)):
            if given is not UNSET and given != have:
                raise SchemaError(f"{name}={given!r} disagrees with the store at {path}, which was created "
                                  f"with {name}={have!r}; leave {name} out to use the stored value")

    def new_options(self) -> fmt.StoreOptions:
        """The options of a store created now: those given, the documented defaults for the rest."""
        many = self.multi_writer is True
        return fmt.StoreOptions(
            group_key="prompt_id" if self.group_key is UNSET else self.group_key,
            capacity_rows=None if self.capacity in (UNSET, None) else int(self.capacity),
            capacity_bytes=None if self.capacity_bytes is UNSET else self.capacity_bytes,
            multi_writer=many,
            retain_seconds=None if self.retain_seconds is UNSET else self.retain_seconds,
            append_deltas=many, inline_groups=many)


@dataclasses.dataclass
class Opened:
    """What an open found: the options, the manifest it starts from, the unusable newer manifests it
    passed over, a writer's lock (``None`` for a reader, or where the storage has no lock) and a
    writer's commit loop (``None`` for a reader)."""

    options: fmt.StoreOptions
    manifest: fmt.Manifest
    recovered_from: List[str]
    writer_lock: Optional[Lock]
    committer: Optional[Committer] = None


def open_store(storage: Storage, requested: Requested, *, readonly: bool,
               generation: Optional[int], fsync: bool = True) -> Opened:
    """Open the store in ``storage``, creating it when it holds none and ``readonly`` is False.

    A reader needs an existing store; it reads the newest manifest (or generation ``generation``)
    before the options, so the options are at least as new as the commit. A writer takes the
    storage's lock where it has one (exclusive for one writer, shared for many) after checking the
    options, so an open refused for them changes nothing; then it starts its commit loop
    (:func:`start_committer`, committing with ``fsync``) and sweeps what no commit names. A new
    store is created only where nothing but a store's own entries is found. Unusable newer
    manifests passed over warn. On any error what this call took (the lock, the commit loop) is
    let go again.
    """
    if not isinstance(fsync, bool):
        raise ArgumentError(f"fsync must be True or False, got {fsync!r}")
    path = storage.url
    requested.check()
    if generation is not None and (not readonly or not isinstance(generation, (int, np.integer))
                                   or isinstance(generation, bool) or generation < 0):
        raise ArgumentError(f"generation must be a non-negative int and needs readonly=True, got {generation!r}"
                            f"{'' if readonly else ' without readonly=True'}")
    exists = storage.exists(fmt.FORMAT_FILE)
    if not exists:
        storage.check()  # a missing bucket gives its one clear error here
    lock: Optional[Lock] = None
    if readonly:
        if not exists:
            raise StoreNotFoundError(f"no diskreplay store at {path} (no {fmt.FORMAT_FILE}); "
                                     "a read-only open needs an existing store")
    else:
        many = requested.multi_writer is True
        if not exists:
            refuse_foreign(storage)
        elif storage.exclusive_lock:  # the lock's kind depends on the stored options: checked before it
            stored = fmt.StoreOptions.read(storage)
            requested.agree(path, stored)
            many = stored.multi_writer
        storage.make_root()
        # one writer: exclusive; many: shared, which only a conversion to one writer conflicts with
        lock = storage.lock(fmt.LOCK_FILE, shared=many)
        if lock is not None:
            lock.acquire()
    committer: Optional[Committer] = None
    try:
        opened = _open_under_lock(storage, requested, exists, readonly, generation, lock)
        if opened.recovered_from:
            warnings.warn(f"{path}: newest manifest(s) unusable, opened generation {opened.manifest.generation}: "
                          f"{'; '.join(opened.recovered_from)}", RuntimeWarning, stacklevel=3)
        if not readonly:
            committer = start_committer(storage, opened.options, opened.manifest, fsync)
            committer.collect(full=True)
            opened.committer = committer
        return opened
    except BaseException:
        close_store(committer, lock)
        raise


def start_committer(storage: Storage, options: fmt.StoreOptions, manifest: fmt.Manifest,
                    fsync: bool) -> Committer:
    """A writer's commit loop from ``manifest`` on, through its own handle of ``storage`` (with many
    writers: a writer id of its own, and leases), its collection floor ensured."""
    many = options.multi_writer
    committer = Committer(storage.writer(writer_id() if many else "", fsync=fsync, leases=many), options, manifest)
    committer.ensure_floor()
    return committer


def convert(storage: Storage, options: fmt.StoreOptions, multi_writer: bool, fsync: bool,
            relock: Callable[[bool], None]) -> fmt.StoreOptions:
    """Switch the store between one writer (exclusive lock) and many (create-if-absent commits): the
    options it has now, written. ``relock(shared)`` takes LOCK (see :func:`relock`): exclusively
    before the options say one writer, shared after they say many."""
    publisher = storage.writer(writer_id() if multi_writer else "", fsync=fsync)
    if multi_writer:
        publisher.probe_create_if_absent(fmt.MANIFEST_DIR)
    else:
        relock(False)
    # inline groups stay once a store has them (its manifests may name some); converting to many
    # writers turns them on, as for a store created multi-writer
    converted = dataclasses.replace(options, multi_writer=multi_writer, append_deltas=multi_writer,
                                    inline_groups=options.inline_groups or multi_writer)
    converted.write(publisher)
    if multi_writer:
        relock(True)
    return converted


def switch_writers(store: Any, multi_writer: bool) -> None:
    """``compact(multi_writer=...)``'s conversion of ``store`` (handed in, never imported here):
    :func:`convert` under its lock, then a commit loop for the new options."""
    def lock(shared: bool) -> None:
        store._writer_lock = relock(store.storage, store._writer_lock, shared)

    store.options = convert(store.storage, store.options, multi_writer, store.fsync, lock)
    store._committer = start_committer(store.storage, store.options, store.manifest, store.fsync)


def relock(storage: Storage, held: Optional[Lock], shared: bool) -> Optional[Lock]:
    """Hold LOCK shared (a writer of many) or exclusively (the one writer) instead of ``held``: the
    lock now held. Going exclusive is refused while any other writer holds it: converting a store
    under live writers would let their commits and this one's replace each other, and their
    reserved names collide (``held`` is taken again first). ``held`` where the storage has no
    lock (every commit is create-if-absent there)."""
    lock = storage.lock(fmt.LOCK_FILE, shared=shared)
    if lock is None:
        return held
    if held is not None:
        held.release()
    try:
        lock.acquire()
    except StoreLockedError:
        if held is not None:  # keep what this writer had
            held.acquire()
        if shared:
            raise
        raise StoreLockedError(f"{storage.url} is open for writing by other processes (they hold LOCK); "
                               "converting it needs every other writer stopped (and closed)") from None
    return lock


def close_store(committer: Optional[Committer], writer_lock: Optional[Lock], cache: Optional[SegmentCache] = None,
                segments: Optional[SegmentWriter] = None, storage: Optional[Storage] = None) -> None:
    """Let go of what an open took: the commit loop first (it makes owed durability good), then the
    writer's lock, the segments' memory maps, and ``storage`` where it is the store's own (a cache)."""
    try:
        if committer is not None:
            committer.close()
    finally:
        if writer_lock is not None:
            writer_lock.release()
        if cache is not None:
            cache.close()
        if segments is not None:
            segments.clear()
        if storage is not None and storage.cached:
            storage.close()


def _open_under_lock(storage: Storage, requested: Requested, exists: bool, readonly: bool,
                     generation: Optional[int], lock: Optional[Lock]) -> Opened:
    path = storage.url
    for d in fmt.DATA_DIRS if storage.symlinks else ():
        if (storage.stat(d) or ("",))[0] == "link":
            raise CorruptStoreError(f"{fmt.location(storage, d)} is a symlink; a store's directories "
                                    "must be its own (nothing outside it is ever read or deleted)")
    manifest: Optional[fmt.Manifest] = None
    recovered: List[str] = []
    if exists:
        if readonly:
            if generation is None:
                manifest, recovered = fmt.load_newest_manifest(storage)
            else:
                manifest = load_generation(storage, int(generation))
        options = fmt.StoreOptions.read(storage)
        requested.agree(path, options)
    else:
        options = requested.new_options()
        create_layout(storage, options)
    if manifest is None:
        manifest, recovered = fmt.load_newest_manifest(storage)
    if manifest.next_row and options.schema is None:
        # the schema is fixed before the first commit: a store with rows and none lost it, and a
        # writer fixing another now would make every committed segment unreadable
        holder = fmt.schema_file(options, not storage.exclusive_lock)
        raise CorruptStoreError(f"{path} has committed rows but its schema is gone ({holder} "
                                f"{'is missing' if holder == fmt.SCHEMA_FILE else 'records none'}); "
                                "restore it from a backup or a copy of the store (nothing was changed)")
    return Opened(options, manifest, recovered, lock)


def create_layout(storage: Storage, options: fmt.StoreOptions) -> None:
    """Make a new store's directories (durably) and write its ``FORMAT.json`` last.

    Where the storage has no lock every commit is create-if-absent, so a storage that does not
    honour it is refused for any store; with a lock, only a multi-writer store depends on it.
    """
    if not storage.exclusive_lock:
        storage.probe_create_if_absent(fmt.MANIFEST_DIR)
    else:
        storage.make_root(fmt.DATA_DIRS)
        if options.multi_writer:
            storage.writer(writer_id()).probe_create_if_absent(fmt.MANIFEST_DIR)
    options.write(storage)


def load_generation(storage: Storage, generation: int) -> fmt.Manifest:
    """The manifest of commit ``generation`` (0: the empty store), or a clear
    :class:`~diskreplay.errors.StoreNotFoundError` saying which generations are kept."""
    if generation == 0:
        return fmt.Manifest()
    try:
        return fmt.read_manifest(storage, generation)
    except FileNotFoundError:
        have = fmt.list_generations(storage)  # newest first
        if have and generation > have[0]:
            raise StoreNotFoundError(f"generation {generation} of {storage.url} does not exist yet (the newest "
                                     f"is {have[0]})") from None
        kept = "none" if not have else f"{have[-1]}..{have[0]} ({len(have)} manifests)"
        raise StoreNotFoundError(f"generation {generation} of {storage.url} is not retained (generations kept: "
                                 f"{kept}); pin a snapshot while it is current") from None


def refuse_foreign(storage: Storage) -> None:
    """A writer creates a store only in a new or empty directory (or prefix), or in one holding nothing
    but a store's own entries (a creation that died before FORMAT.json, another writer creating it at
    this moment): a mistyped path to a run's directory must not be filled with store files."""
    st = storage.stat("")
    if st is None:
        return
    if st[0] != "dir":
        raise OutputExistsError(f"{storage.url} is a file, not a directory; a store is a directory (pass a new or "
                                "empty one, or the directory of an existing store)")
    refuse_foreign_entries(storage.url, storage.some_names())


def refuse_foreign_entries(where: str, entries: Sequence[str]) -> None:
    """Refuse to create a store where ``entries`` (paths found there) are not all a store's own (see
    :func:`fmt.is_store_entry`): a store's open sweeps its directories and sets aside, or deletes,
    what no manifest names, so another program's files there would be moved or lost."""
    foreign = sorted(e for e in entries if not fmt.is_store_entry(e))
    committed = sorted((e for e in entries if "/" in e and e not in foreign and e.partition("/")[0] in fmt.DATA_DIRS
                        and not e.rpartition("/")[2].startswith((TMP_PREFIX, "."))),
                       key=lambda e: (not e.startswith(fmt.MANIFEST_DIR), e))
    if committed and not foreign:
        # FORMAT.json is written when a store is created, before any of these: it was lost, and a store
        # created here anew (default options, perhaps another schema) would misread or sweep them
        raise CorruptStoreError(f"{where} holds a store's files ({', '.join(committed[:2])}"
                                f"{', ...' if len(committed) > 2 else ''}) but no {fmt.FORMAT_FILE}: it was lost or "
                                f"deleted; restore it (from a backup or a copy of the store) before opening the store "
                                "(nothing was changed)")
    if foreign:
        kind = "directory" if "://" not in where else "prefix"
        raise OutputExistsError(f"{where} is a non-empty {kind} that holds no diskreplay store (it has "
                                f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''} and no "
                                f"{fmt.FORMAT_FILE}); pass a new or empty {kind}, or the {kind} of an existing "
                                "store")
