"""The storage seam's shape: one signature on every backend, a small abstract core with the rest
defaulted on it, and no filesystem call of the store's own outside ``storage/``."""

import ast
import inspect
import pathlib
import time
import warnings

import numpy as np
import pytest

from diskreplay import ReplayStore
from diskreplay.storage import LocalStorage, Publisher, S3Storage, Storage

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "diskreplay"


class DictStorage(Publisher):
    """A backend written against the abstract core alone: files in a dict."""

    def __init__(self, url: str = "dict://test") -> None:
        self.url = url
        self.files = {}  # rel -> (bytes, when written)

    def read_bytes(self, rel, limit=None):
        if rel not in self.files:
            raise FileNotFoundError(rel)
        return self.files[rel][0]

    def read_range(self, rel, start, end):
        return self.read_bytes(rel)[start:end]

    def stat(self, rel):
        if rel in self.files:
            return "file", len(self.files[rel][0])
        return ("dir", 0) if any(k.startswith(f"{rel}/") for k in self.files) or not rel else None

    def _children(self, reldir):
        prefix = f"{reldir}/" if reldir else ""
        out = {}
        for k, (_, when) in self.files.items():
            if k.startswith(prefix):
                name, sep, _ = k[len(prefix):].partition("/")
                out[name] = ("dir" if sep else "file", when)
        return out

    def list_kinds(self, reldir):
        return {n: kind for n, (kind, _) in self._children(reldir).items()}

    def list_ages(self, reldir):
        return {n: time.time() - when for n, (_, when) in self._children(reldir).items()}

    def replace(self, rel, data, *, step=None, sync=True):
        self.files[rel] = (bytes(data), time.time())

    def put_if_absent(self, rel, data, *, step=None):
        if rel in self.files:
            return False
        self.replace(rel, data)
        return True

    def delete(self, rel):
        self.files.pop(rel, None)
        return True


def test_the_core_is_abstract_and_small():
    core = {n for n, v in vars(Storage).items() if getattr(v, "__isabstractmethod__", False)}
    assert core == {"read_bytes", "read_range", "stat", "list_kinds", "list_ages", "replace", "put_if_absent",
                    "delete"}
    assert not {n for n, v in vars(Publisher).items() if getattr(v, "__isabstractmethod__", False)}

    class Incomplete(Storage):
        url = "x://"

        def read_bytes(self, rel, limit=None):
            return b""

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def _shape(fn):
    """A signature without its annotations: the names, kinds and defaults of the parameters."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_one_signature_on_every_backend():
    for name in ("reserve", "fetch_ranges", "local_path", "update_small", "write_files", "move", "link_candidates",
                 "publish", "stage", "lock", "map"):
        want = _shape(getattr(Publisher, name))
        for backend in (LocalStorage, S3Storage):
            assert _shape(getattr(backend, name)) == want, (backend.__name__, name)
    for backend in (LocalStorage, S3Storage):
        assert Publisher in backend.__mro__
        # members one backend had and the other lacked are the protocol's now
        for name in ("some_names", "cache_stats", "release_ahead", "trim_cache", "close", "writer", "make_root"):
            assert callable(getattr(backend, name)), (backend.__name__, name)


def test_a_backend_of_the_core_alone_carries_the_protocol():
    s = DictStorage()
    assert not s.exists("nothing")
    i, rel = s.reserve(lambda i: f"segments/{i:04d}", 1)
    j, other = s.reserve(lambda i: f"segments/{i:04d}", 1)
    assert (i, j, rel) == (1, 2, "segments/0001")
    assert s.publish("manifests/1.json", b"m1", [(rel, b"data", None)], ["segments"], exclusive=True) is True
    assert s.publish("manifests/1.json", b"m2", exclusive=True) is False
    assert s.read_bytes(rel) == b"data" and s.size(rel) == 4 and s.age(rel) >= 0
    assert s.list("manifests") == ["1.json"] and s.list_kinds("") == {"manifests": "dir", "segments": "dir"}
    assert s.some_names() == ["manifests", "segments", "manifests/1.json", "segments/0001", "segments/0002"]
    assert s.update_small("FLOOR", lambda cur: b"3") == b"3"
    assert s.move(rel, "quarantine/x", if_absent=True) and not s.exists(rel)
    s.replace("segments/0003", b"y")
    assert not s.move("segments/0003", "quarantine/x", if_absent=True) and s.read_bytes("quarantine/x") == b"data"
    # reads of a storage that does not map in place go through a page cache of its own
    s.replace("segments/big", bytes(range(256)) * 64)
    with open(s.fetch_ranges("segments/big", [(8192, 8200)]), "rb") as f:
        f.seek(8192)
        assert f.read(8) == bytes(range(8))
    assert s.cache_stats().fetched_bytes == 8192 and s.lock("LOCK") is None and s.map("segments/big") is None
    s.probe_create_if_absent("manifests")
    s.close()


def test_local_storage_locks_maps_and_moves_through_the_seam(tmp_path):
    s = LocalStorage(str(tmp_path / "store"))
    s.make_root(("segments", "quarantine"))
    s.replace("segments/a", b"a" * 100)
    s.replace("quarantine/b", b"b")
    assert not s.move("segments/a", "quarantine/b", if_absent=True)
    assert s.read_bytes("quarantine/b") == b"b"
    m = s.map("segments/a", min_bytes=10, max_bytes=1000)
    assert m is not None and m[:3] == b"aaa"
    m.close()
    assert s.map("segments/a", min_bytes=101) is None
    lock = s.lock("LOCK")
    lock.acquire()
    try:
        from diskreplay.errors import StoreLockedError

        with pytest.raises(StoreLockedError):
            s.lock("LOCK").probe()
    finally:
        lock.release()


def test_replay_store_remote_is_a_deprecated_alias(tmp_path):
    with ReplayStore(str(tmp_path / "s")) as store:
        store.extend({"prompt_id": np.array([1]), "completion_ids": [[1, 2]]})
        with pytest.warns(DeprecationWarning, match="storage.can_map"):
            assert store.remote is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert store.storage.can_map


FILESYSTEM_CALLS = {("os", "makedirs"), ("os", "rename"), ("os", "listdir"), ("os", "open"), ("os", "lstat"),
                    ("os", "fstat"), ("os", "unlink"), ("os", "remove"), ("os", "link"), ("mmap", "mmap")}
FILESYSTEM_NAMES = {"WriterLock", "fsync_dir", "durable_write"}
PATH_TESTS = {"islink", "isdir", "exists", "lexists", "isfile", "getsize"}


def _filesystem_calls(tree):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in FILESYSTEM_NAMES:
            yield f.id
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in FILESYSTEM_CALLS:
            yield f"{f.value.id}.{f.attr}"
        elif isinstance(f, ast.Attribute) and f.attr in PATH_TESTS and isinstance(f.value, ast.Attribute) \
                and f.value.attr == "path":
            yield f"os.path.{f.attr}"


def test_the_store_and_the_format_code_make_no_filesystem_call_of_their_own():
    """Locks, memory maps, moves and the root's creation belong to the storage (a backend that is no
    directory must not meet an ``os`` call on its URL)."""
    found = {}
    for folder in ("store", "format", "verify"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            calls = sorted(set(_filesystem_calls(ast.parse(path.read_text()))))
            if calls:
                found[f"{folder}/{path.name}"] = calls
    assert found == {}
