"""The files of a store as ``verify`` and ``repair`` see them.

:class:`StoreFiles` is a directory, where symlinks and non-regular files are
damage too; :class:`ObjectStoreFiles` reads an object store through its
storage (each object fetched once into the local cache, checked, and parsed
from there) and quarantines by copy-then-delete.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> where_in(d, "FORMAT.json") == os.path.join(d, "FORMAT.json")
True
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any, Dict, List, Optional, Tuple

from .. import format as fmt
from .._fileio import durable_write, file_crc32c, fsync_dir
from ..errors import CorruptStoreError, FormatError, StoreNotFoundError
from ..storage import LocalStorage, S3Storage, is_remote

QUARANTINE_DIR = fmt.QUARANTINE_DIR


ROOT_NAMES = {fmt.FORMAT_FILE, fmt.SCHEMA_FILE, fmt.FLOOR_FILE, fmt.LOCK_FILE, QUARANTINE_DIR, *fmt.DATA_DIRS}


def where_in(root: Any, rel: str) -> str:
    """How messages name ``rel`` of the store (a path, or an object's URL)."""
    if isinstance(root, StoreFiles):
        return root.where(rel)
    if not isinstance(root, str):
        return f"{root.url}/{rel}"
    return os.path.join(root, rel)


def linked_dir(root: str, rel: str) -> bool:
    """True when ``rel`` lies in a data directory that is a symlink (never followed)."""
    return "/" in rel and os.path.islink(where_in(root, rel.split("/", 1)[0]))


class StoreFiles:
    """The files of a store as verify and repair see them: a directory, where
    symlinks and non-regular files are damage too, or an object store."""

    def __init__(self, root: str) -> None:
        self.url = root
        self.root: Any = root  # what the format functions read from
        self.storage: Any = LocalStorage(root)

    @staticmethod
    def open(path: Any, storage_options: Optional[Dict[str, Any]]) -> "StoreFiles":
        if is_remote(path):
            return ObjectStoreFiles(S3Storage(path, storage_options))
        if storage_options:
            raise StoreNotFoundError(f"storage_options are for s3:// URLs; {path!r} is a local path")
        return StoreFiles(os.path.abspath(os.fspath(path)))

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
        if linked_dir(self.url, rel):
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
        if linked_dir(self.url, fmt.manifest_file(gen)):
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
            full = where_in(root, name)
            is_dir = os.path.isdir(full) and not os.path.islink(full)
            out.append((name, is_dir))
            if is_dir and name in fmt.DATA_DIRS:
                for sub in sorted(os.listdir(full)):
                    out.append((f"{name}/{sub}",
                                os.path.isdir(where_in(full, sub)) and not os.path.islink(where_in(full, sub))))
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


class ObjectStoreFiles(StoreFiles):
    """A store in an object store: objects have no kinds (no symlinks), and a
    quarantine is a copy then a delete (there is no rename)."""

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


def progress_bar(progress: bool, total: int, desc: str) -> Any:
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False)
