"""Checking and mending a store: :func:`verify_store` and :func:`repair_store`.

``verify_store`` is read-only and thorough: where opening a store reads
manifests and footers only, it reads every byte the newest intact commit
references and checks it against the manifest's sizes and CRC-32C checksums,
parses every Arrow file, compares each segment's schema with ``FORMAT.json``,
rebuilds each group sidecar from its segment's group-key column and compares,
and checks that row ids are contiguous. Every problem names its file.

``repair_store`` holds the writer lock and brings a damaged store back to its
newest intact commit. It never deletes: damaged, unreferenced and temporary
files move into ``STORE/quarantine/``, where a person can inspect them.

Both work on a directory or on ``s3://bucket/prefix`` (``storage_options=``):
all their file access goes through :class:`_Files`, whose object-store form
reads through the storage (each object fetched once into its local cache,
checked, and parsed from there) and quarantines by copy-then-delete.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import pyarrow as pa

from . import format as fmt
from ._fileio import TMP_PREFIX, WriterLock, crc32c, durable_write, file_crc32c, fsync_dir
from .errors import CorruptStoreError, FormatError, ReadOnlyError, StoreLockedError, StoreNotFoundError
from .store import ops
from .store.committer import Committer
from .storage import LocalStorage, S3Storage, is_remote

from .segment import (META_BUFFERS_KEY, ArrowFile, PageChecksums, Segment, buffer_ranges, decode_state, encode_ipc,
                      field_buffers, group_sidecar, has_page_checksums, inline_group, segment_local_rows)

QUARANTINE_DIR = fmt.QUARANTINE_DIR
_ROOT_NAMES = {fmt.FORMAT_FILE, fmt.SCHEMA_FILE, fmt.FLOOR_FILE, fmt.LOCK_FILE, QUARANTINE_DIR, *fmt.DATA_DIRS}
# times verify starts again on a newer commit when a live writer collected files under it
CATCH_UPS = 20
#: a delta found without the manifest it applies to is looked for again after this long: a clean-up
#: removes a chain oldest first, so one in progress takes the delta next (lost otherwise: damage)
MISSING_BASE_RECHECK_SECONDS = 0.5


def verify_store(path: Any, progress: bool = False, *, storage_options: Optional[Dict[str, Any]] = None
                 ) -> Dict[str, Any]:
    """Check every file of the store at ``path`` without changing anything.

    Returns ``{"ok", "generation", "rows", "problems", "warnings",
    "checked_files", "checked_bytes"}``. ``ok`` is False exactly when there are
    problems: damaged, missing, hostile or inconsistent files, each named in
    its message. Unreferenced and temporary files are warnings (a crashed
    writer leaves them; the next writer removes them), unless they may be a
    live writer's commit in flight: younger than this check (of a commit after
    the manifest it checks) or, in a multi-writer store, than ``retain_seconds``. ``path`` may be
    ``s3://bucket/prefix`` (with ``storage_options``, or the ``AWS_*`` variables).

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(d) as store:
    ...     _ = store.extend({"prompt_id": [1, 1, 2], "completion_ids": [[1], [2, 3], []]})
    >>> report = verify_store(d)
    >>> report["ok"], report["rows"], report["problems"]
    (True, 3, [])
    >>> with open(os.path.join(d, "segments", "000000000000.arrow"), "r+b") as f:
    ...     _ = f.seek(-20, 2); _ = f.write(b"?")
    >>> report = verify_store(d)
    >>> report["ok"], "segments/000000000000.arrow" in report["problems"][0]
    (False, True)
    """
    files = _Files.open(path, storage_options)
    try:
        for _ in range(CATCH_UPS):
            r = _verify_once(files, progress)
            # A live writer may have committed and collected files of the commit being
            # checked (legitimately): those are not damage. Check the newer commit instead.
            if r.generation == 0 or not r.problems or _newest_generation(files) <= r.generation:
                break
        return r.result()
    finally:
        files.close()


def _newest_generation(files: "_Files") -> int:
    gens = fmt.list_generations(files.root)
    return gens[0] if gens else 0


def _verify_once(files: "_Files", progress: bool) -> "_Report":
    r = _Report(files)
    started = time.time()
    if not files.is_store_dir():
        r.problem(f"{files.url} is not a directory")
        return r
    options = _check_format_file(r)
    # files a live writer may still commit (or, with many writers, one its clean-up keeps) are not
    # left-overs: younger than this check (it cannot see the commits made after its manifest), or
    # with many writers younger than retain_seconds (commits in flight, orphans not yet due)
    kept = 0.0
    if options is not None and options.multi_writer:
        kept = float(options.retain_seconds or fmt.DEFAULT_RETAIN_SECONDS)
    try:
        floor = fmt.read_floor(r.root)
    except (CorruptStoreError, FormatError) as exc:
        r.problem(f"{exc} (the collection floor: writers cannot commit until it is mended; `diskreplay "
                  "repair` writes it again)")
        floor = None
    manifests, damaged = _scan_manifests(r, floor=floor)
    newest = manifests[0] if manifests else None
    if floor is not None and floor > (newest.generation if newest is not None else 0):
        r.problem(f"{_rel(r.root, fmt.FLOOR_FILE)}: the collection floor {floor} is above the newest manifest "
                  f"({newest.generation if newest is not None else 'none'}): the manifests at and above it are "
                  "lost (restore them from a backup)")
    for gen, message in damaged:
        r.problem(message)
    if newest is None and damaged:
        r.problem(f"{_rel(r.root, fmt.MANIFEST_DIR)}: no intact manifest; the store cannot open")
    if newest is not None:
        r.generation, r.rows = newest.generation, newest.num_rows
        _check_rows(r, newest, options)
        options = _with_late_columns(r, options, newest)
        files = _sized_files(newest)
        bar = _bar(progress, sum(b for _, b in files), "verify")
        try:
            for seg in newest.segments:
                _check_segment(r, seg, options, bar)
            for st in newest.states.values():
                _check_state(r, st, bar)
            for log in newest.token_logs:
                problem = _check_checksum(r, log.file, log.bytes, log.crc32c, bar)
                if problem:
                    r.problem(problem)
            gi = newest.group_index
            if gi is not None:
                problem = _check_checksum(r, gi.file, gi.bytes, gi.crc32c, bar)
                if problem:  # derived data: readers warn and use the sidecars instead
                    r.warn(f"{problem} (the persisted group index; readers rebuild it from the group sidecars)")
        finally:
            if bar is not None:
                bar.close()
        # Older manifests are what a damaged newest one falls back to, and
        # what a reader that loaded them still opens: their files must exist.
        checked = set(newest.files())
        for m in manifests[1:]:
            for rel, size in _sized_files(m):
                if rel in checked or size == 0:
                    continue
                checked.add(rel)
                problem = _check_size(r.files, rel, size)
                if problem and r.files.exists(m.file):
                    r.warn(f"{problem} (referenced by the older {m.file})")
    _scan_unreferenced(r, manifests, lambda rel: r.files.age(rel) < max(kept, time.time() - started
                                                                         + SNAPSHOT_MARGIN_SECONDS),
                       no_manifest=not manifests and not damaged)
    return r


#: a file written this long before verify began may belong to a commit made after its manifest was read
SNAPSHOT_MARGIN_SECONDS = 1.0


def repair_store(path: Any, dry_run: bool = False, progress: bool = False, force: bool = False, *,
                 storage_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Roll the store at ``path`` back to its newest intact commit and tidy it.

    Holds the writer lock (raises ``StoreLockedError`` while a writer has the
    store open). The newest manifest whose segments and saved states all match
    their recorded sizes and checksums becomes the newest: newer or damaged
    manifests, damaged files and files no retained manifest references move
    into ``quarantine/`` (nothing is deleted). Damaged or missing group
    sidecars are rebuilt from their segment's group-key column, in a new
    commit. When every manifest references a damaged segment, the newest
    intact manifest is kept with its head moved past the newest damaged
    segment: the rows up to it are lost, and the actions say which. When no
    manifest is intact at all, it raises ``CorruptStoreError`` and changes
    nothing. ``dry_run=True`` reports the same actions without changing anything (and
    without taking the lock). Returns ``{"actions", "generation", "rows"}``.

    A store with a live writer is refused (``StoreLockedError``), dry run or
    not: a single-writer store while a process holds its lock; a multi-writer
    store (which has no lock) while any manifest or temporary file is younger
    than ``LIVE_SECONDS``, unless ``force=True`` (you have stopped every writer).
    A store in an object store (``s3://...``, ``storage_options``) has no lock
    and is treated like a multi-writer store; its quarantine is a copy and a delete.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(d) as store:
    ...     _ = store.extend({"prompt_id": [1, 2], "completion_ids": [[1], [2, 3]]})
    >>> os.remove(os.path.join(d, "groups", "000000000000.arrow"))
    >>> repair_store(d)["actions"]
    ['rebuilt groups/000000000000.arrow from the group-key column of segments/000000000000.arrow']
    >>> verify_store(d)["ok"]
    True
    """
    files = _Files.open(path, storage_options)
    try:
        return _repair(files, dry_run, progress, force)
    finally:
        files.close()


def _repair(files: "_Files", dry_run: bool, progress: bool, force: bool) -> Dict[str, Any]:
    root = files.url
    if not files.exists(fmt.FORMAT_FILE):
        raise StoreNotFoundError(f"no diskreplay store at {root} (no {fmt.FORMAT_FILE})")
    try:
        multi = fmt.StoreOptions.read(files.root).multi_writer
    except (CorruptStoreError, FormatError):
        multi = False  # run() reports the damaged FORMAT.json
    # a local store's writers hold LOCK (one exclusively; many shared): any of them still open, idle or
    # not, is certain, and holding LOCK exclusively keeps new ones out while repair runs
    lock = None if files.remote else _repair_lock(
        files, f"{root} is a multi-writer store that writers have open (they hold LOCK); repair refuses a store "
               "with live writers: stop them all and run repair again" if multi else
               f"{root} is open for writing by another process (it holds LOCK); repair refuses a store with a "
               "live writer: close it (stop the run) and repair again", dry_run)
    if multi or files.remote:  # an object store has no lock: a live writer is told by its recent commits
        age = files.youngest_activity()
        if age < LIVE_SECONDS and not force:
            if lock is not None:
                lock.release()
            kind = "a multi-writer store" if multi else "a store on object storage (which has no lock)"
            raise StoreLockedError(f"{root} is {kind} that was written {age:.0f} s ago; repair "
                                   f"refuses a store with live writers: stop them all and run repair again, or pass "
                                   f"--force (force=True) if none is running")
    if dry_run and lock is not None:
        lock.release()
        lock = None
    keep_young = 0.0
    if (multi or files.remote) and not force:
        try:
            keep_young = float(fmt.StoreOptions.read(files.root).retain_seconds or fmt.DEFAULT_RETAIN_SECONDS)
        except (CorruptStoreError, FormatError):
            keep_young = float(fmt.DEFAULT_RETAIN_SECONDS)
    try:
        return _Repair(files, dry_run, progress, keep_young).run()
    finally:
        if lock is not None:
            lock.release()


def _repair_lock(files: "_Files", refusal: str, dry_run: bool = False) -> Optional[WriterLock]:
    """LOCK of the local store ``files``, held exclusively; ``StoreLockedError(refusal)`` while a writer holds it.

    A dry run only tests it (None), through a read-only descriptor: it needs no write access to the store.
    """
    lock = WriterLock(os.path.join(files.url, fmt.LOCK_FILE))
    if dry_run:
        try:
            lock.probe()
        except StoreLockedError:
            raise StoreLockedError(refusal) from None
        return None
    try:
        lock.acquire()
    except StoreLockedError:
        raise StoreLockedError(refusal) from None
    except PermissionError as exc:
        raise ReadOnlyError(f"repair needs write access to {files.url} (it takes {fmt.LOCK_FILE} and moves files "
                            f"into {fmt.QUARANTINE_DIR}/): {exc.strerror}; --dry-run (dry_run=True) reports "
                            "what it would do without it") from None
    return lock


LIVE_SECONDS = 60


# --------------------------------------------------------------------------- verify


@dataclass
class _Report:
    files: "_Files"
    problems: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    generation: int = 0
    rows: int = 0
    checked_files: int = 0
    checked_bytes: int = 0

    @property
    def root(self) -> Any:
        return self.files.root

    def problem(self, message: str) -> None:
        self.problems.append(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def result(self) -> Dict[str, Any]:
        return {"ok": not self.problems, "generation": self.generation, "rows": self.rows,
                "problems": self.problems, "warnings": self.warnings,
                "checked_files": self.checked_files, "checked_bytes": self.checked_bytes}


def _rel(root: Any, rel: str) -> str:
    """How messages name ``rel`` of the store (a path, or an object's URL)."""
    if isinstance(root, _Files):
        return root.where(rel)
    if not isinstance(root, str):
        return f"{root.url}/{rel}"
    return os.path.join(root, rel)


class _Files:
    """The files of a store as verify and repair see them: a directory, where
    symlinks and non-regular files are damage too, or an object store."""

    remote = False

    def __init__(self, root: str) -> None:
        self.url = root
        self.root: Any = root  # what the format functions read from
        self.storage: Any = LocalStorage(root)

    @staticmethod
    def open(path: Any, storage_options: Optional[Dict[str, Any]]) -> "_Files":
        if is_remote(path):
            return _RemoteFiles(S3Storage(path, storage_options))
        if storage_options:
            raise StoreNotFoundError(f"storage_options are for s3:// URLs; {path!r} is a local path")
        return _Files(os.path.abspath(os.fspath(path)))

    def close(self) -> None:
        pass

    def where(self, rel: str) -> str:
        return os.path.join(self.url, rel)

    def age(self, rel: str) -> float:
        """Seconds since ``rel`` was last written (infinite for a file gone meanwhile)."""
        try:
            return time.time() - os.lstat(self.where(rel)).st_mtime
        except FileNotFoundError:
            return float("inf")

    def is_store_dir(self) -> bool:
        return os.path.isdir(self.url)

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.where(rel))

    def format_file(self) -> Optional[int]:
        """The size of FORMAT.json (None: missing); CorruptStoreError if it is no plain file."""
        try:
            st = os.lstat(self.where(fmt.FORMAT_FILE))
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptStoreError(f"{self.where(fmt.FORMAT_FILE)} is not a regular file (a symlink is not allowed)")
        return st.st_size

    def size_problem(self, rel: str, size: int) -> Optional[str]:
        path = self.where(rel)
        if _linked_dir(self.url, rel):
            return f"{path} lies in a symlinked directory, which is not allowed"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return f"{path} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{path} is not a regular file (a symlink is not allowed)"
        if st.st_size != size:
            return f"{path} has {st.st_size} bytes but the manifest records {size}"
        return None

    def local(self, rel: str, size: int) -> str:
        """A local file with ``rel``'s bytes (to map, parse and checksum)."""
        return self.where(rel)

    def crc(self, rel: str, size: int) -> int:
        return file_crc32c(self.local(rel, size))

    def manifest(self, gen: int) -> fmt.Manifest:
        path = self.where(fmt.manifest_file(gen))
        if _linked_dir(self.url, fmt.manifest_file(gen)):
            raise CorruptStoreError(f"{path} lies in a symlinked directory, which is not allowed")
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptStoreError(f"{path} is not a regular file (a symlink is not allowed)")
        return fmt.load_manifest(path, gen)

    def entries(self) -> List[Tuple[str, bool]]:
        """``(relative path, is_dir)`` of everything in the store outside ``quarantine/``."""
        out = []
        root = self.url
        for name in sorted(os.listdir(root)):
            full = _rel(root, name)
            is_dir = os.path.isdir(full) and not os.path.islink(full)
            out.append((name, is_dir))
            if is_dir and name in fmt.DATA_DIRS:
                for sub in sorted(os.listdir(full)):
                    out.append((f"{name}/{sub}",
                                os.path.isdir(_rel(full, sub)) and not os.path.islink(_rel(full, sub))))
        return out

    def is_link(self, rel: str) -> bool:
        return os.path.islink(self.where(rel))

    def size(self, rel: str) -> int:
        return os.lstat(self.where(rel)).st_size

    def quarantined(self) -> int:
        q = self.where(QUARANTINE_DIR)
        if not os.path.isdir(q) or os.path.islink(q):
            return 0
        return sum(len([f for f in files if f != fmt.QUARANTINE_PENDING]) for _, _, files in os.walk(q))

    def youngest_activity(self) -> float:
        """Seconds since any file of the data directories was written: a manifest, a temporary file,
        or a data file (a commit in flight writes its segments long before its manifest)."""
        now, youngest = time.time(), float("inf")
        for d in fmt.DATA_DIRS:
            for name in os.listdir(self.where(d)) if os.path.isdir(self.where(d)) else ():
                try:
                    youngest = min(youngest, now - os.lstat(self.where(f"{d}/{name}")).st_mtime)
                except FileNotFoundError:
                    youngest = 0.0
        return youngest

    def check_dirs(self, quarantine) -> None:
        if os.path.islink(self.where(fmt.FORMAT_FILE)):
            raise CorruptStoreError(f"{self.where(fmt.FORMAT_FILE)} is a symlink; repair will not follow it")
        for d in fmt.DATA_DIRS:
            p = self.where(d)
            if os.path.islink(p) or (os.path.exists(p) and not os.path.isdir(p)):
                if quarantine(d, "it is not a directory (a symlink is not allowed)"):
                    os.makedirs(p, exist_ok=True)

    def free_name(self, dest_rel: str) -> str:
        n, dest = 0, dest_rel
        while os.path.lexists(self.where(dest)):
            n += 1
            dest = f"{dest_rel}.{n}"
        return dest

    def move(self, rel: str, dest_rel: str) -> None:
        dest = self.where(dest_rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(self.where(rel), dest)

    def write(self, rel: str, data: Any) -> None:
        durable_write(self.where(rel), data)

    def sync(self) -> None:
        for d in ("",) + fmt.DATA_DIRS:
            if os.path.isdir(self.where(d)):
                fsync_dir(self.where(d))


class _RemoteFiles(_Files):
    """A store in an object store: objects have no kinds (no symlinks), and a
    quarantine is a copy then a delete (there is no rename)."""

    remote = True

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.root = storage
        self.url = storage.url

    def close(self) -> None:
        self.storage.close()

    def where(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def age(self, rel: str) -> float:
        try:
            return self.storage.age(rel)
        except FileNotFoundError:
            return float("inf")

    def is_store_dir(self) -> bool:
        self.storage.check()  # a missing bucket or refused credentials: one clear error
        return True

    def exists(self, rel: str) -> bool:
        return self.storage.exists(rel)

    def format_file(self) -> Optional[int]:
        try:
            return self.storage.size(fmt.FORMAT_FILE)
        except FileNotFoundError:
            return None

    def size_problem(self, rel: str, size: int) -> Optional[str]:
        try:
            got = self.storage.size(rel)
        except FileNotFoundError:
            return f"{self.where(rel)} is missing"
        if got != size:
            return f"{self.where(rel)} has {got} bytes but the manifest records {size}"
        return None

    def local(self, rel: str, size: int) -> str:
        return self.storage.local_path(rel, size=size)

    def manifest(self, gen: int) -> fmt.Manifest:
        return fmt.read_manifest(self.storage, gen)

    def entries(self) -> List[Tuple[str, bool]]:
        out = [(d, True) for d in fmt.DATA_DIRS] + [(n, False) for n in self.storage.list("")]
        if self.quarantined():
            out.append((QUARANTINE_DIR, True))
        for d in fmt.DATA_DIRS:
            out += [(f"{d}/{n}", False) for n in self.storage.list(d)]
        return sorted(out)

    def is_link(self, rel: str) -> bool:
        return False

    def size(self, rel: str) -> int:
        return self.storage.size(rel)

    def quarantined(self) -> int:
        return len([n for n in self.storage.list(QUARANTINE_DIR) if n != fmt.QUARANTINE_PENDING]) + sum(
            len(self.storage.list(f"{QUARANTINE_DIR}/{d}")) for d in fmt.DATA_DIRS)

    def youngest_activity(self) -> float:
        """Seconds since anything in the data directories was written (their listings, which may lag,
        and the newest manifest, found without one): a commit in flight writes its data first."""
        youngest = float("inf")
        for d in fmt.DATA_DIRS:
            ages = self.storage.list_ages(d)
            if ages:
                youngest = min(youngest, min(ages.values()))
        try:
            m, _ = fmt.load_newest_manifest(self.storage)
        except (CorruptStoreError, FormatError):
            gens = fmt.list_generations(self.storage)
            m = fmt.Manifest(generation=gens[0]) if gens else fmt.Manifest()
        if m.generation == 0:
            return youngest
        try:
            return min(youngest, self.storage.age(m.file))
        except FileNotFoundError:
            return 0.0

    def check_dirs(self, quarantine) -> None:
        pass

    def free_name(self, dest_rel: str) -> str:
        n, dest = 0, dest_rel
        while self.storage.exists(dest):
            n += 1
            dest = f"{dest_rel}.{n}"
        return dest

    def move(self, rel: str, dest_rel: str) -> None:
        # copy first: a failure between the two leaves the file in both places, never in neither
        self.storage.write_new(dest_rel, self.storage.read_bytes(rel))
        self.storage.delete(rel)

    def write(self, rel: str, data: Any) -> None:
        self.storage.replace(rel, data)

    def sync(self) -> None:
        pass


def _bar(progress: bool, total: int, desc: str) -> Any:
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False)


def _check_format_file(r: _Report) -> Optional[fmt.StoreOptions]:
    path = _rel(r.files, fmt.FORMAT_FILE)
    try:
        size = r.files.format_file()
    except CorruptStoreError as exc:
        r.problem(str(exc))
        return None
    if size is None:
        r.problem(f"{path} is missing; this is not a diskreplay store")
        return None
    r.checked_files += 1
    r.checked_bytes += size
    try:
        return fmt.StoreOptions.read(r.root)
    except (CorruptStoreError, FormatError) as exc:
        r.problem(str(exc) if path in str(exc) else f"{path}: {exc}")
    except Exception as exc:  # verify reports; it never lets a damaged file crash it
        r.problem(f"{path} cannot be read ({type(exc).__name__}: {exc})")
    return None


def _load_manifest(files: _Files, gen: int) -> fmt.Manifest:
    path = files.where(fmt.manifest_file(gen))
    try:
        return files.manifest(gen)
    except (CorruptStoreError, FormatError, FileNotFoundError):
        raise
    except Exception as exc:
        raise CorruptStoreError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None


def _scan_manifests(r: Optional[_Report], files: Optional[_Files] = None, floor: Optional[int] = None
                    ) -> Tuple[List[fmt.Manifest], List[Tuple[int, str]]]:
    """Intact manifests newest first, and ``(generation, message)`` of damaged ones; those below the
    collection ``floor`` are collected ones a clean-up has not removed yet (or that a stale writer
    created in a collected slot), and are left out."""
    files = r.files if r is not None else files
    root = files
    intact, damaged, suspects = [], [], []
    for gen in fmt.list_generations(files.root):
        if floor is not None and gen < floor:
            continue
        try:
            m = _load_manifest(files, gen)
        except fmt._MissingBase as exc:
            suspects.append((gen, exc.strerror))  # lost, or a clean-up in progress removes the delta next
            continue
        except FileNotFoundError:
            continue
        except (CorruptStoreError, FormatError) as exc:
            msg = str(exc)
            path = _rel(root, fmt.manifest_file(gen))
            damaged.append((gen, msg if path in msg else f"{path}: {msg}"))
            continue
        if r is not None:
            r.checked_files += 1
        intact.append(m)
    if suspects:
        time.sleep(MISSING_BASE_RECHECK_SECONDS)
        still = set(fmt.list_generations(files.root))
        damaged += [(gen, msg) for gen, msg in suspects if gen in still]
        damaged.sort(key=lambda d: -d[0])
    return intact, damaged


def _check_rows(r: _Report, m: fmt.Manifest, options: Optional[fmt.StoreOptions]) -> None:
    where = _rel(r.files, m.file)
    prev_end = None
    for s in m.segments:
        if prev_end is not None and s.first_row != prev_end:
            r.problem(f"{where}: segment {s.id} starts at row {s.first_row}, expected {prev_end}")
        if s.id >= m.next_segment:
            r.problem(f"{where}: segment id {s.id} is not below next_segment {m.next_segment}")
        prev_end = s.end_row
    if m.segments:
        if not m.segments[0].first_row <= m.head < m.segments[0].end_row:
            r.problem(f"{where}: head {m.head} is not in the first segment "
                      f"[{m.segments[0].first_row}, {m.segments[0].end_row})")
        if m.segments[-1].end_row != m.next_row:
            r.problem(f"{where}: next_row {m.next_row} but the segments end at {m.segments[-1].end_row}")
    elif m.head != m.next_row:
        r.problem(f"{where}: live rows [{m.head}, {m.next_row}) but no segments")
    if options is not None:
        if options.capacity_rows is not None and m.num_rows > options.capacity_rows:
            r.problem(f"{where}: {m.num_rows} live rows exceed capacity {options.capacity_rows} "
                      f"of {fmt.FORMAT_FILE}")
        if m.segments and options.schema is None:
            holder = fmt.schema_file(options, r.files.remote)
            r.problem(f"{where} has rows but {_rel(r.files, holder)} "
                      f"{'is missing' if holder == fmt.SCHEMA_FILE else 'records no schema'} (it holds the "
                      "store's schema, fixed by its first append; restore it from a backup or a copy)")


def _with_late_columns(r: "_Report", options: Optional[fmt.StoreOptions],
                       m: fmt.Manifest) -> Optional[fmt.StoreOptions]:
    """``options`` whose schema is the store's at commit ``m`` (plus its late columns): segments
    older than a late column lack it, newer ones hold it with the recorded type."""
    if options is None or not m.late_columns:
        return options
    try:
        return replace(options, schema=fmt.store_schema(options.schema, m.late_columns, _rel(r.root, m.file)))
    except (CorruptStoreError, FormatError) as exc:
        r.problem(str(exc))
        return options


def _sized_files(m: fmt.Manifest) -> List[Tuple[str, int]]:
    out = []
    for s in m.segments:
        out.append((s.file, s.bytes))
        out.append((s.groups_file, s.groups_bytes))
    out += [(st.file, st.bytes) for st in m.states.values()]
    out += [(t.file, t.bytes) for t in m.token_logs]
    if m.group_index is not None:
        out.append((m.group_index.file, m.group_index.bytes))
    return out


def _linked_dir(root: str, rel: str) -> bool:
    """True when ``rel`` lies in a data directory that is a symlink (never followed)."""
    return "/" in rel and os.path.islink(_rel(root, rel.split("/", 1)[0]))


def _check_size(files: _Files, rel: str, size: int) -> Optional[str]:
    return files.size_problem(rel, size)


def _check_checksum(r: _Report, rel: str, size: int, crc: int, bar: Any) -> Optional[str]:
    """Size and CRC-32C of one file; the problem, or None."""
    problem = _check_size(r.files, rel, size)
    if problem:
        return problem
    path = _rel(r.files, rel)
    got = r.files.crc(rel, size)
    r.checked_files += 1
    r.checked_bytes += size
    if bar is not None:
        bar.update(size)
    if got != crc:
        return f"{path} fails its checksum (crc32c {got:#010x}, the manifest records {crc:#010x}); the file is damaged"
    return None


def _check_segment(r: _Report, s: fmt.SegmentEntry, options: Optional[fmt.StoreOptions], bar: Any) -> None:
    problem = _check_checksum(r, s.file, s.bytes, s.crc32c, bar)
    if problem:
        r.problem(problem)
        seg = None
    else:
        seg = _open_segment(r, s, options)
    if options is None:
        return  # FORMAT.json is the problem reported: nothing says whether the store has a group key
    group_key = options.group_key
    if group_key is None:
        if s.groups_bytes or s.group is not None:
            r.problem(f"{_rel(r.files, fmt.MANIFEST_DIR)}: segment {s.id} records a group "
                      f"{'sidecar' if s.group is None else 'key'} but {fmt.FORMAT_FILE} has no group key")
        return
    if s.group is not None:
        if seg is not None:
            problem = _compare_inline_group(r.files, s, seg, group_key)
            if problem:
                r.problem(problem)
        return
    problem = _check_checksum(r, s.groups_file, s.groups_bytes, s.groups_crc32c, bar)
    if problem:
        r.problem(problem)
        return
    if seg is not None:
        problem = _compare_sidecar(r.files, s, seg, group_key)
        if problem:
            r.problem(problem)


def _open_segment(r: _Report, s: fmt.SegmentEntry, options: Optional[fmt.StoreOptions]) -> Optional[Segment]:
    path = _rel(r.files, s.file)
    try:
        seg = Segment(r.files.local(s.file, s.bytes), s.bytes, options.schema if options is not None else None,
                      s.num_rows)
        # full validation: offsets inside their buffers, monotone, etc.
        seg.batch.validate(full=True)
        return seg
    except CorruptStoreError as exc:
        r.problem(str(exc))
    except Exception as exc:
        r.problem(f"{path} is not a valid segment ({type(exc).__name__}: {exc})")
    return None


def _compare_inline_group(files: _Files, s: fmt.SegmentEntry, seg: Segment, group_key: str) -> Optional[str]:
    """A segment whose manifest entry names its one group (no sidecar): every row has that key."""
    try:
        ok = inline_group(seg.column(group_key)) == s.group
    except CorruptStoreError as exc:
        return str(exc)
    except Exception as exc:
        return f"{_rel(files, s.file)} cannot be checked ({type(exc).__name__}: {exc})"
    if not ok:
        return (f"{_rel(files, s.file)}: the manifest records that all its rows are group {s.group}, but its "
                f"{group_key!r} column holds other keys")
    return None


def _compare_sidecar(files: _Files, s: fmt.SegmentEntry, seg: Segment, group_key: str) -> Optional[str]:
    path = _rel(files, s.groups_file)
    root = files
    try:
        side = ArrowFile(files.local(s.groups_file, s.groups_bytes), s.groups_bytes).batch
        keys = seg.column(group_key)
        want = group_sidecar(keys, None if segment_local_rows(side) else s.first_row)
    except CorruptStoreError as exc:
        return str(exc)
    except Exception as exc:
        return f"{path} cannot be checked ({type(exc).__name__}: {exc})"
    if not side.schema.equals(want.schema) or not side.equals(want):
        return (f"{path} does not match the {group_key!r} column of {_rel(root, s.file)} "
                "(keys, counts or row ids differ)")
    raw = (side.schema.metadata or {}).get(META_BUFFERS_KEY)
    if raw is not None:  # (sidecars written before the key existed have none)
        recorded = buffer_ranges(raw, 0, s.bytes)
        if recorded is None or recorded.tolist() != field_buffers(seg.batch, seg.base_address).tolist():
            return (f"{path} records buffer ranges (diskreplay.buffers) that are not those of "
                    f"{_rel(root, s.file)}; reads are right but ask the disk for the wrong pages; "
                    "run `diskreplay repair`")
    return None


def _check_state(r: _Report, st: fmt.StateEntry, bar: Any) -> None:
    problem = _check_checksum(r, st.file, st.bytes, st.crc32c, bar)
    if problem:
        r.problem(problem)
        return
    path = _rel(r.files, st.file)
    try:
        with open(r.files.local(st.file, st.bytes), "rb") as f:
            decode_state(f.read(), path)
    except CorruptStoreError as exc:
        r.problem(str(exc))
    except Exception as exc:
        r.problem(f"{path} is not a readable state file ({type(exc).__name__}: {exc})")


def _referenced(manifests: Iterable[fmt.Manifest]) -> Set[str]:
    out: Set[str] = set()
    for m in manifests:
        out.add(m.file)
        out.update(rel for rel, size in _sized_files(m) if size or not rel.startswith(fmt.GROUPS_DIR))
    return out


def _scan_unreferenced(r: _Report, manifests: List[fmt.Manifest], in_flight: Callable[[str], bool], *,
                       no_manifest: bool = False) -> None:
    referenced = _referenced(manifests)
    files = r.files
    orphans = []
    for rel, is_dir in files.entries():
        path = _rel(files, rel)
        name = os.path.basename(rel)
        if "/" not in rel:
            if name in fmt.DATA_DIRS:
                if files.is_link(rel) or not is_dir:
                    r.problem(f"{path} is not a directory (a symlink is not allowed)")
            elif name == QUARANTINE_DIR:
                n = files.quarantined()
                if is_dir and n:
                    r.warn(f"{path} holds {n} quarantined file(s), set aside by a repair or by a writer that found "
                           "no manifest (nothing there is read; look at them, then remove them)")
            elif name.startswith(TMP_PREFIX):
                if not in_flight(rel):
                    r.warn(f"{path} is a temporary file left by an interrupted write")
            elif name not in _ROOT_NAMES:
                r.warn(f"{path} is not part of a diskreplay store")
            continue
        if rel in referenced or not is_dir and not files.is_link(rel) and in_flight(rel):
            continue
        if name.startswith(TMP_PREFIX):
            r.warn(f"{path} is a temporary file left by an interrupted write")
        elif files.is_link(rel):
            r.warn(f"{path} is an unreferenced symlink")
        elif rel.startswith(fmt.MANIFEST_DIR + "/"):
            if not fmt._MANIFEST_NAME.match(name):
                r.warn(f"{path} is not a manifest name")
        elif no_manifest and not is_dir and files.size(rel):
            orphans.append(rel)
        else:
            r.warn(f"{path} is not referenced by any intact manifest")
    if orphans:
        r.problem(_orphans_message(files, orphans))


def _orphans_message(files: "_Files", orphans: List[str]) -> str:
    orphans = sorted(orphans, key=lambda rel: (not rel.startswith(fmt.SEGMENT_DIR + "/"), rel))
    return (f"{_rel(files, fmt.MANIFEST_DIR)}: no manifest at all, yet {len(orphans)} data file(s) "
            f"({', '.join(orphans[:3])}{', ...' if len(orphans) > 3 else ''}): the store's manifests were "
            "deleted or lost (its rows are in these files), or its first commit crashed; a writer that "
            f"opens the store moves them to {fmt.QUARANTINE_DIR}/ (nothing is deleted); restore the "
            "manifests from a backup to get the rows back")


# --------------------------------------------------------------------------- repair


class _Repair:
    def __init__(self, files: _Files, dry_run: bool, progress: bool, keep_young: float = 0.0) -> None:
        self.files, self.dry_run, self.progress = files, dry_run, progress
        #: unreferenced files younger than this stay (many writers, object storage: a writer on another
        #: host, which no lock shows, may have a commit in flight that names them; as clean-up keeps them)
        self.keep_young = keep_young
        self.root = files
        self.actions: List[str] = []
        self._moved: Set[str] = set()
        self._crc_cache: Dict[Tuple[str, int, int], bool] = {}

    # a file is "good" when its size and checksum match what a manifest records
    def _good(self, rel: str, size: int, crc: int, bar: Any = None) -> bool:
        key = (rel, size, crc)
        hit = self._crc_cache.get(key)
        if hit is None:
            hit = _check_size(self.files, rel, size) is None and self.files.crc(rel, size) == crc
            if bar is not None:
                bar.update(size)
            self._crc_cache[key] = hit
        return hit

    def _bad_segments(self, m: fmt.Manifest, bar: Any = None) -> List[fmt.SegmentEntry]:
        return [s for s in m.segments if not self._good(s.file, s.bytes, s.crc32c, bar)]

    def _bad_states(self, m: fmt.Manifest, bar: Any = None) -> List[fmt.StateEntry]:
        return [st for st in m.states.values() if not self._good(st.file, st.bytes, st.crc32c, bar)]

    def run(self) -> Dict[str, Any]:
        try:
            options = self.options = fmt.StoreOptions.read(self.files.root)
        except (CorruptStoreError, FormatError) as exc:
            raise CorruptStoreError(f"repair cannot rebuild {fmt.FORMAT_FILE}, which holds the schema: {exc}") \
                from None
        self.files.check_dirs(lambda d, why: self._quarantine(d, why) or not self.dry_run)
        intact, damaged = _scan_manifests(None, self.files)
        if damaged and not intact:
            # Nothing says which files hold committed rows: quarantining them all
            # would empty the store, so leave it for a person to look at.
            raise CorruptStoreError(f"no intact manifest in {_rel(self.root, fmt.MANIFEST_DIR)}; repair will not "
                                    "guess which files hold committed rows: " + "; ".join(m for _, m in damaged))
        if not intact:
            orphans = [rel for rel, is_dir in self.files.entries()
                       if not is_dir and fmt.is_data_file(rel) and self.files.size(rel)]
            if orphans:
                raise CorruptStoreError(_orphans_message(self.files, orphans) + "; repair changes nothing here")
        for gen, message in damaged:
            self._quarantine(fmt.manifest_file(gen), f"it is damaged: {message}")

        total = sum(s.bytes for m in intact[:1] for s in m.segments)
        bar = _bar(self.progress, total, "repair")
        try:
            chosen, kept = self._choose(intact, bar)
        finally:
            if bar is not None:
                bar.close()
        if chosen is None:
            self.actions.append("no intact manifest: the store is empty")
            generation, rows = 0, 0
        else:
            chosen = self._rebuild_sidecars(chosen, _with_late_columns(_Report(self.root), options, chosen))
            chosen = self._drop_damaged_token_logs(chosen)
            chosen = self._past_rolled_back(chosen, intact, damaged)
            generation, rows = chosen.generation, chosen.num_rows
            kept = [chosen] + [m for m in kept if m.generation < chosen.generation]
        self._quarantine_unreferenced(kept)
        self._floor_past_moved_manifests(generation)
        if not self.dry_run:
            self.files.sync()
        return {"actions": self.actions, "generation": generation, "rows": rows}

    def _floor_past_moved_manifests(self, newest: int) -> None:
        """Raise a floored store's collection floor above every manifest moved to quarantine (never
        above the newest): discovery probes upwards from the floor and stops at the first missing
        generation, so a hole left at or above the floor would hide every commit past it."""
        moved = [int(name[:-5]) for rel in self._moved
                 for d, _, name in [rel.partition("/")]
                 if d == fmt.MANIFEST_DIR and name.endswith(".json") and name[:-5].isdigit()]
        if not moved or fmt.read_floor(self.files.root) is None:
            return
        floor = min(max(moved) + 1, newest)
        if not self.dry_run and floor > fmt.raise_floor(self.files.storage, floor):
            self.actions.append(f"could not raise {fmt.FLOOR_FILE} to generation {floor}: run repair again")
        else:
            self.actions.append(f"raised the collection floor ({fmt.FLOOR_FILE}) to generation {floor}, past the "
                                "manifests moved to quarantine")

    def _choose(self, intact: List[fmt.Manifest], bar: Any) -> Tuple[Optional[fmt.Manifest], List[fmt.Manifest]]:
        """Pick the commit to keep; quarantine manifests whose files are damaged."""
        chosen = None
        for m in intact:
            bad = [s.file for s in self._bad_segments(m, bar)] + [st.file for st in self._bad_states(m, bar)]
            if bad:
                self._quarantine(m.file, f"it references damaged or missing {', '.join(bad)}")
                continue
            chosen = m
            break
        if chosen is None and intact:
            # Every commit references a damaged segment. Keep the newest one with
            # its head moved past the newest damaged segment: rows are lost, but
            # the store opens and every row it serves is intact.
            newest = intact[0]
            bad = self._bad_segments(newest)
            cut = max(i for i, s in enumerate(newest.segments) if s in bad) + 1 if bad else 0
            segments = newest.segments[cut:]
            # the rows of the first kept segment below head stay evicted (a damaged state alone loses no row)
            head = max(newest.head, segments[0].first_row) if segments else newest.next_row
            states = {k: v for k, v in newest.states.items() if v not in self._bad_states(newest)}
            lost = head - newest.head
            if lost:
                self.actions.append(f"every manifest references a damaged segment; dropping rows "
                                    f"[{newest.head}, {head}) ({lost} rows) so that the store opens")
            for st in newest.states.values():
                if st.name not in states:
                    self.actions.append(f"dropping the damaged saved state {st.name!r} ({st.file})")
            chosen = newest.evolve(generation=newest.generation + 1, head=head, segments=segments, states=states)
            self._commit(chosen)
            return chosen, [chosen]
        # older manifests stay only while their files are intact (a reader may hold one), and always
        # when a kept delta applies to them (a delta's manifest is its base's plus what it adds:
        # without the base it cannot be read, whatever its base's own files are)
        kept = [chosen] if chosen is not None else []
        for m in intact:
            if chosen is None or m.generation >= chosen.generation:
                continue
            bad = [s.file for s in m.segments if _check_size(self.files, s.file, s.bytes)]
            if bad and m.generation not in fmt.with_chains({k.generation: k for k in kept}):
                self._quarantine(m.file, f"it references damaged or missing {', '.join(bad)}")
            else:
                kept.append(m)
        if chosen is not None and intact and chosen is not intact[0]:
            self.actions.append(f"rolled back to generation {chosen.generation} (rows [{chosen.head}, "
                                f"{chosen.next_row}))")
        return chosen, kept

    def _rebuild_sidecars(self, m: fmt.Manifest, options: fmt.StoreOptions) -> fmt.Manifest:
        if options.group_key is None:
            return m
        entries, changed = [], False
        for s in m.segments:
            ok = s.group is not None or self._good(s.groups_file, s.groups_bytes, s.groups_crc32c)
            seg = None
            if ok:
                try:
                    seg = Segment(self.files.local(s.file, s.bytes), s.bytes, options.schema, s.num_rows)
                    compare = _compare_sidecar if s.group is None else _compare_inline_group
                    ok = compare(self.files, s, seg, options.group_key) is None
                except CorruptStoreError:
                    ok = True  # the segment itself is unreadable; nothing to rebuild from
            if ok:
                entries.append(s)
                continue
            try:
                if seg is None:
                    seg = Segment(self.files.local(s.file, s.bytes), s.bytes, options.schema, s.num_rows)
                with open(self.files.local(s.file, s.bytes), "rb") as fh:  # as a writer makes them
                    pages = PageChecksums.of(pa.py_buffer(fh.read())) if has_page_checksums(s.bytes) else None
                data = encode_ipc(group_sidecar(seg.column(options.group_key), s.first_row, pages))
            except (CorruptStoreError, KeyError) as exc:
                self.actions.append(f"cannot rebuild {s.groups_file}: {exc}")
                entries.append(s)
                continue
            if self.files.exists(s.groups_file):
                self._quarantine(s.groups_file, "it is damaged")
            self.actions.append(f"rebuilt {s.groups_file} from the group-key column of {s.file}")
            if not self.dry_run:
                self.files.write(s.groups_file, data)
            new = fmt.SegmentEntry(s.id, s.first_row, s.num_rows, s.bytes, s.crc32c, data.size, crc32c(data))
            changed |= new != s
            entries.append(new)
        if not changed:
            return m
        new_m = m.evolve(generation=m.generation + 1, segments=tuple(entries))
        self._commit(new_m)
        return new_m

    def _past_rolled_back(self, m: fmt.Manifest, intact: Sequence[fmt.Manifest],
                          damaged: Sequence[Tuple[int, str]]) -> fmt.Manifest:
        """After a roll-back, ``m``'s contents committed as a generation above every one moved to
        quarantine, with segment ids past every one they (or the segment files) used: a reader that
        held a newer generation, or cached its segments by id, must not meet those generations and
        ids again naming other rows (the next commit reused both)."""
        newest = max([g.generation for g in intact] + [g for g, _ in damaged])
        if m.generation >= newest:
            return m
        ids = [g.next_segment for g in intact]
        for rel, is_dir in self.files.entries():
            d, _, name = rel.partition("/")
            if not is_dir and d in (fmt.SEGMENT_DIR, fmt.GROUPS_DIR) and name[:12].isdigit():
                ids.append(int(name[:12]) + 1)
        new_m = m.evolve(generation=newest + 1, next_segment=max([m.next_segment] + ids))
        self._commit(new_m)
        return new_m

    def _drop_damaged_token_logs(self, m: fmt.Manifest) -> fmt.Manifest:
        """``m`` without its damaged sealed token logs, committed (a tokened ``extend`` reads them and
        raised ``CorruptStoreError`` every time): their tokens are forgotten, as old ones are."""
        bad = [t for t in m.token_logs if not self._good(t.file, t.bytes, t.crc32c)]
        if not bad:
            return m
        for t in bad:
            self.actions.append(f"dropping the damaged token log {t.file}: its {t.count} exactly-once tokens are "
                                "forgotten (a batch re-sent with one of them is appended again)")
        new_m = m.evolve(generation=m.generation + 1, token_logs=tuple(t for t in m.token_logs if t not in bad))
        self._commit(new_m)
        return new_m

    def _commit(self, m: fmt.Manifest) -> None:
        """Commit ``m``'s contents as generation ``m.generation`` through the store's one commit path."""
        self.actions.append(f"wrote manifest generation {m.generation} ({m.file})")
        if self.dry_run:
            return
        base, _ = fmt.load_newest_manifest(self.files.root)
        if base.generation > m.generation - 1:
            raise CorruptStoreError(f"{self.files.url} changed while repair ran (generation {base.generation}); "
                                    "stop every writer and repair again")
        # newer manifests went to quarantine: the commit keeps the generation numbers going up
        base = base.evolve(generation=m.generation - 1)
        Committer(self.files.storage, self.options, base).commit(
            lambda b: ops.RollBack(m, base.generation), [], install=lambda new: None)

    def _quarantine_unreferenced(self, kept: List[fmt.Manifest]) -> None:
        referenced = _referenced(kept)
        young = 0
        for rel, is_dir in self.files.entries():
            if rel in self._moved or "/" not in rel and (rel in _ROOT_NAMES or is_dir):
                continue
            name = os.path.basename(rel)
            if "/" not in rel and not name.startswith(TMP_PREFIX):
                continue  # stray files beside the store are the user's, not ours
            if rel in referenced:
                continue
            if self.keep_young and self.files.age(rel) < self.keep_young:
                young += 1
                continue
            why = "it is a temporary file of an interrupted write" if name.startswith(TMP_PREFIX) \
                else "no retained manifest references it"
            self._quarantine(rel, why)
        if young:
            self.actions.append(f"kept {young} unreferenced file(s) younger than {self.keep_young:.0f} s: a commit "
                                "in flight may name them (clean-up removes them once they are older and unnamed; "
                                "--force if every writer is stopped)")

    def _quarantine(self, rel: str, why: str) -> None:
        if rel in self._moved:
            return
        self._moved.add(rel)
        dest = self.files.free_name(f"{QUARANTINE_DIR}/{rel}")
        self.actions.append(f"moved {rel} to {dest} ({why})")
        if self.dry_run:
            return
        self.files.move(rel, dest)
