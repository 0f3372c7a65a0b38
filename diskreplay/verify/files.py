"""The files of a store as ``verify`` and ``repair`` see them, through its storage.

:class:`StoreFiles` asks the store's :class:`~diskreplay.storage.base.Storage` only: on a
directory a symlink or a non-regular file is damage too (the storage's ``stat`` reports kinds
without following links), an object store has files and prefixes only; a quarantine is the
storage's ``move`` (a rename, or a copy then a delete).

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> where_in(d, "FORMAT.json") == os.path.join(d, "FORMAT.json")
True
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import format as fmt
from .._fileio import file_crc32c, sized_progress_bar
from ..errors import CorruptStoreError, FormatError, StoreNotFoundError
from ..storage import open_storage

QUARANTINE_DIR = fmt.QUARANTINE_DIR


ROOT_NAMES = {fmt.FORMAT_FILE, fmt.SCHEMA_FILE, fmt.FLOOR_FILE, fmt.LOCK_FILE, QUARANTINE_DIR, *fmt.DATA_DIRS}


def where_in(root: Any, rel: str) -> str:
    """How messages name ``rel`` of the store (a path, or an object's URL)."""
    if isinstance(root, StoreFiles):
        return root.where(rel)
    if not isinstance(root, str):
        return f"{root.url}/{rel}"
    return os.path.join(root, rel)


class StoreFiles:
    """The files of a store as verify and repair see them: its storage's listings, kinds and
    sizes, where a symlink or a non-regular file is damage too.

    >>> import tempfile
    >>> files = StoreFiles.open(tempfile.mkdtemp(), None)
    >>> files.is_store_dir(), files.entries()
    (True, [])
    """

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.root = storage  # what the format functions read from
        self.url = storage.url

    @staticmethod
    def open(path: Any, storage_options: Optional[Dict[str, Any]]) -> "StoreFiles":
        return StoreFiles(open_storage(path, storage_options))

    def close(self) -> None:
        self.storage.close()

    def where(self, rel: str) -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def kind(self, rel: str) -> Optional[str]:
        got = self.storage.stat(rel)
        return None if got is None else got[0]

    def age(self, rel: str) -> float:
        """Seconds since ``rel`` was last written (infinite for a file gone meanwhile)."""
        try:
            return self.storage.age(rel)
        except FileNotFoundError:
            return float("inf")

    def is_store_dir(self) -> bool:
        self.storage.check()  # a missing bucket or refused credentials: one clear error
        return self.kind("") == "dir"

    def exists(self, rel: str) -> bool:
        return self.storage.stat(rel) is not None

    def in_linked_dir(self, rel: str) -> bool:
        """True when ``rel`` lies in a data directory that is a symlink (never followed)."""
        return "/" in rel and self.kind(rel.split("/", 1)[0]) == "link"

    def format_file(self) -> Optional[int]:
        """The size of FORMAT.json (None: missing); CorruptStoreError if it is no plain file."""
        got = self.storage.stat(fmt.FORMAT_FILE)
        if got is None:
            return None
        if got[0] != "file":
            raise CorruptStoreError(f"{self.where(fmt.FORMAT_FILE)} is not a regular file (a symlink is not allowed)")
        return got[1]

    def size_problem(self, rel: str, size: int) -> Optional[str]:
        path = self.where(rel)
        if self.in_linked_dir(rel):
            return f"{path} lies in a symlinked directory, which is not allowed"
        got = self.storage.stat(rel)
        if got is None:
            return f"{path} is missing"
        if got[0] != "file":
            return f"{path} is not a regular file (a symlink is not allowed)"
        if got[1] != size:
            return f"{path} has {got[1]} bytes but the manifest records {size}"
        return None

    def local(self, rel: str, size: int) -> str:
        """A local file with ``rel``'s bytes (to map, parse and checksum)."""
        return self.storage.local_path(rel, size=size)

    def crc(self, rel: str, size: int) -> int:
        return file_crc32c(self.local(rel, size))

    def manifest(self, gen: int) -> fmt.Manifest:
        rel = fmt.manifest_file(gen)
        if self.in_linked_dir(rel):
            raise CorruptStoreError(f"{self.where(rel)} lies in a symlinked directory, which is not allowed")
        got = self.storage.stat(rel)
        if got is None:
            raise StoreNotFoundError(f"{self.where(rel)} is missing")
        if got[0] != "file":
            raise CorruptStoreError(f"{self.where(rel)} is not a regular file (a symlink is not allowed)")
        return fmt.read_manifest(self.storage, gen)

    def entries(self) -> List[Tuple[str, bool]]:
        """``(relative path, is_dir)`` of everything in the store outside ``quarantine/``."""
        out = []
        for name, kind in sorted(self.storage.list_kinds("").items()):
            out.append((name, kind == "dir"))
            if kind == "dir" and name in fmt.DATA_DIRS:
                out += [(f"{name}/{sub}", sub_kind == "dir")
                        for sub, sub_kind in sorted(self.storage.list_kinds(name).items())]
        return out

    def is_link(self, rel: str) -> bool:
        return self.kind(rel) == "link"

    def size(self, rel: str) -> int:
        return self.storage.size(rel)

    def quarantined(self, reldir: str = QUARANTINE_DIR) -> int:
        """How many files lie in ``quarantine/`` (its bookkeeping file aside)."""
        n = 0
        for name, kind in self.storage.list_kinds(reldir).items():
            if kind == "dir":
                n += self.quarantined(f"{reldir}/{name}")
            elif kind != "link" and name != fmt.QUARANTINE_PENDING:
                n += 1
        return n

    def youngest_activity(self) -> float:
        """Seconds since anything in the data directories was written: a manifest, a temporary file,
        or a data file (a commit in flight writes its segments long before its manifest). Where
        listings may lag, the newest manifest (found without one) counts too."""
        ages = [age for d in fmt.DATA_DIRS for age in self.storage.list_ages(d).values()]
        youngest = min(ages, default=float("inf"))
        if self.storage.reliable_listing:
            return youngest
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

    def check_dirs(self, quarantine: Callable[[str, str], bool]) -> None:
        """Set aside a data directory that is a symlink or no directory (``quarantine(rel, why)``
        says whether it moved) and make it again."""
        if self.is_link(fmt.FORMAT_FILE):
            raise CorruptStoreError(f"{self.where(fmt.FORMAT_FILE)} is a symlink; repair will not follow it")
        for d in fmt.DATA_DIRS:
            if self.kind(d) not in (None, "dir") and quarantine(d, "it is not a directory (a symlink is not allowed)"):
                self.storage.ensure_dir(d)

    def free_name(self, dest_rel: str) -> str:
        n, dest = 0, dest_rel
        while self.exists(dest):
            n += 1
            dest = f"{dest_rel}.{n}"
        return dest

    def move(self, rel: str, dest_rel: str) -> None:
        self.storage.move(rel, dest_rel)

    def write(self, rel: str, data: Any) -> None:
        self.storage.replace(rel, data)

    def sync(self) -> None:
        for d in ("",) + fmt.DATA_DIRS:
            if self.kind(d) == "dir":
                self.storage.sync_dir(d)


def progress_bar(progress: bool, total: int, desc: str) -> Any:
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return sized_progress_bar(tqdm, sys.stderr, total=total, unit="B", unit_scale=True, desc=desc, leave=False)
