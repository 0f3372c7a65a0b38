"""The storage contract as a pytest test class: subclass :class:`StorageTests` for a backend.

Every backend in the tree runs it (``tests/test_storage.py``: a directory, two S3 servers, memory);
a third party's backend runs the same tests by subclassing it in one of its own test modules and
giving the two fixtures, ``storage`` (a fresh, empty storage) and ``reopen`` (a function giving
another handle on the same files each time it is called, as another writer would hold it)::

    import secrets

    import pytest
    from diskreplay.storage import MemoryStorage
    from diskreplay.testing import StorageTests

    class TestMyStorage(StorageTests):
        @pytest.fixture
        def storage(self):
            st = MemoryStorage(f"memory://{secrets.token_hex(8)}")
            yield st
            st.destroy()

        @pytest.fixture
        def reopen(self, storage):
            return lambda: MemoryStorage(storage.url)

The tests check what the store relies on, through :class:`~diskreplay.storage.Storage` and
:class:`~diskreplay.storage.Publisher` only: bytes, ranges, listings, kinds, moves, paths that could
leave the store refused, the newest manifest found from nothing and from a known one, and the
commit protocol's primitives (create-if-absent with one winner among racing handles, reserved
names, publish and stage, the floor's read-modify-write with no update lost, held removals). What a
backend's capabilities say it does is checked against what it does. A test a backend cannot pass
by design (a server whose conditional writes are not atomic under concurrency) is overridden in its
subclass with ``pytest.mark.skip`` and the reason.

Needs pytest (``pip install pytest``); importing :mod:`diskreplay.testing` does not.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, List

from ..errors import CommitConflictError, MissingDependencyError

try:
    import pytest
except ImportError as exc:  # pragma: no cover - the suite runs with pytest
    raise MissingDependencyError("diskreplay.testing.StorageTests is a pytest test class and needs pytest, which "
                                 f"is not installed ({exc}); install it with pip install pytest") from None

from .. import format as fmt
from ..storage import Publisher, Storage


def _manifest_name(k: int) -> str:
    return f"manifests/{k:08d}.json"


class StorageTests:
    """The storage contract; subclass it with the fixtures ``storage`` and ``reopen`` (see the module).

    ``RACERS`` handles race for each of ``RACE_NAMES`` names in :meth:`test_racing_creates_have_one_winner`
    (threads of this process; a backend whose requests are slow may lower them).
    """

    RACERS = 4
    RACE_NAMES = 3

    @pytest.fixture
    def storage(self) -> Storage:
        """A fresh, empty storage (override it)."""
        raise NotImplementedError("a StorageTests subclass gives a fixture 'storage': a fresh, empty storage of "
                                  "the backend under test")

    @pytest.fixture
    def reopen(self, storage) -> Callable[[], Storage]:
        """A function giving another handle on ``storage``'s files each call (override it)."""
        raise NotImplementedError("a StorageTests subclass gives a fixture 'reopen': a function that returns "
                                  "another handle on the files of the fixture 'storage', as another writer holds it")

    # -- the interface and what the backend says it can do ------------------------------------

    def test_is_a_storage_and_a_publisher(self, storage):
        assert isinstance(storage, Storage) and isinstance(storage, Publisher)
        # the two parts split the interface: no method is in both, and the bytes part has none of the protocol's
        bytes_part = {n for n in vars(Storage) if not n.startswith("_")}
        protocol_part = {n for n in vars(Publisher) if not n.startswith("_")}
        assert not bytes_part & protocol_part and {"publish", "hold", "update_small"} <= protocol_part
        assert "put_if_absent" in bytes_part | protocol_part
        assert isinstance(storage.url, str) and storage.url

    def test_capabilities_say_what_the_backend_does(self, storage):
        """The store branches on these, never on a backend's type: each must be true to its word."""
        for name in ("can_map", "exclusive_lock", "reliable_listing", "cached", "holds_leases", "symlinks"):
            assert isinstance(getattr(storage, name), bool), name
        assert storage.remote is (not storage.can_map)
        storage.write_new("segments/00000003.arrow", b"abc")
        path = storage.local_path("segments/00000003.arrow")
        with open(path, "rb") as f:
            assert f.read() == b"abc"
        if storage.can_map:  # the file itself, where it lies: nothing fetched, no cache to trim
            assert not storage.cached and storage.trim_cache() == []
            storage.delete("segments/00000003.arrow")
            assert not os.path.exists(path)
        else:  # a local copy, counted by the cache it lives in
            assert storage.cached
            assert storage.cache_stats().held_bytes >= 3
        if storage.reliable_listing:
            storage.write_new("segments/00000004.arrow", b"d")
            assert "00000004.arrow" in storage.list("segments")
        storage.check()  # a reachable store: no error

    def test_a_lock_where_the_backend_has_one(self, storage, reopen):
        """``lock`` gives a lock one holder keeps others out with where ``exclusive_lock`` says so,
        else None (every commit is then a create-if-absent)."""
        from ..errors import StoreLockedError
        from ..storage.base import Lock

        held = storage.lock("LOCK")
        if not storage.exclusive_lock:
            assert held is None and reopen().lock("LOCK") is None
            return
        assert isinstance(held, Lock)
        held.acquire()
        try:
            with pytest.raises(StoreLockedError):
                reopen().lock("LOCK").probe()
            with pytest.raises(StoreLockedError):
                reopen().lock("LOCK", shared=True).acquire()
        finally:
            held.release()
        shared = [reopen().lock("LOCK", shared=True) for _ in range(2)]
        for lock in shared:  # shared holders never keep one another out
            lock.acquire()
        for lock in shared:
            lock.release()

    def test_a_map_where_files_are_mapped_in_place(self, storage):
        storage.write_new("manifests/00000001.json", b"x" * 5000)
        mapped = storage.map("manifests/00000001.json", min_bytes=100)
        if not storage.can_map:
            assert mapped is None
            return
        try:
            assert mapped[:] == b"x" * 5000
        finally:
            mapped.close()
        assert storage.map("manifests/00000001.json", min_bytes=5001) is None  # outside the bounds: read it
        assert storage.map("manifests/00000001.json", max_bytes=4999) is None
        assert storage.map("manifests/none.json") is None

    def test_a_writers_handle_sees_the_same_files(self, storage):
        writer = storage.writer("w1", fsync=False, leases=False)
        try:
            assert isinstance(writer, Publisher) and writer.url == storage.url
            assert writer.put_if_absent("manifests/1.json", b"w") is True
            assert storage.read_bytes("manifests/1.json") == b"w"
        finally:
            if writer is not storage:
                writer.close()

    # -- bytes --------------------------------------------------------------------------------

    def test_round_trip_and_ranges(self, storage):
        data = bytes(range(256)) * 40  # 10240 bytes
        storage.write_new("segments/00000001.arrow", data)
        assert storage.read_bytes("segments/00000001.arrow") == data
        assert storage.size("segments/00000001.arrow") == len(data)
        assert storage.exists("segments/00000001.arrow") and not storage.exists("segments/00000002.arrow")
        assert storage.read_range("segments/00000001.arrow", 100, 300) == data[100:300]
        assert storage.read_range("segments/00000001.arrow", 0, len(data)) == data
        assert storage.read_range("segments/00000001.arrow", 10000, 20000) == data[10000:]  # short at the end
        assert storage.read_range("segments/00000001.arrow", 20000, 30000) == b""  # past the end
        assert storage.read_range("segments/00000001.arrow", 5, 5) == b""
        with open(storage.local_path("segments/00000001.arrow"), "rb") as f:
            assert f.read() == data

    def test_fetched_ranges_hold_the_bytes_asked_for(self, storage):
        data = os.urandom(100_000)
        storage.write_new("segments/00000001.arrow", data)
        ranges = [(0, 10), (50_000, 50_100), (99_990, 100_000)]
        path = storage.fetch_ranges("segments/00000001.arrow", ranges, size=len(data))
        with open(path, "rb") as f:
            local = f.read()
        assert len(local) == len(data)
        assert all(local[s:e] == data[s:e] for s, e in ranges)

    def test_many_ranges_of_one_file(self, storage):
        data = bytes(range(256)) * 64
        storage.write_new("segments/00000001.arrow", data)
        ranges = [(0, 3), (100, 4000), (16000, 16384), (16384, 20000)]
        assert storage.read_ranges("segments/00000001.arrow", ranges) == [data[s:e] for s, e in ranges]

    def test_an_empty_range_is_no_bytes(self, storage):
        storage.write_new("segments/00000001.arrow", b"abcdefgh")
        assert storage.read_range("segments/00000001.arrow", 7, 7) == b""
        assert storage.read_ranges("segments/00000001.arrow", [(0, 2), (7, 7)]) == [b"ab", b""]

    def test_buffers_and_sizes(self, storage):
        big = os.urandom(3 << 20)
        storage.write_new("a/big", memoryview(big))
        storage.write_new("a/empty", b"")
        storage.replace("a/ba", bytearray(b"xyz"))
        assert storage.read_bytes("a/big") == big
        assert storage.read_bytes("a/empty") == b"" and storage.size("a/empty") == 0
        assert storage.read_bytes("a/ba") == b"xyz"

    def test_a_read_over_its_limit_is_refused(self, storage):
        storage.write_new("a/doc", b"x" * 100)
        assert storage.read_bytes("a/doc", limit=100) == b"x" * 100
        with pytest.raises(OSError, match="100"):
            storage.read_bytes("a/doc", limit=99)

    def test_missing_files(self, storage):
        for call in (lambda: storage.read_bytes("nope/x"), lambda: storage.size("nope/x"),
                     lambda: storage.age("nope/x"), lambda: storage.read_range("nope/x", 0, 4),
                     lambda: open(storage.local_path("nope/x"), "rb")):  # a directory: raised at the open
            with pytest.raises(FileNotFoundError):
                call()
        storage.delete("nope/x")  # absent is not an error
        assert storage.stat("nope/x") is None

    def test_list(self, storage):
        for rel in ("manifests/2.json", "manifests/10.json", "segments/1.arrow"):
            storage.write_new(rel, b"x")
        assert sorted(storage.list("manifests")) == ["10.json", "2.json"]
        assert storage.list("segments") == ["1.arrow"]
        assert storage.list("nothing") == []
        assert storage.delete("manifests/2.json") is True
        assert storage.list("manifests") == ["10.json"]
        with pytest.raises(FileNotFoundError):
            storage.read_bytes("manifests/2.json")

    def test_replace(self, storage):
        storage.replace("segments/1.json", b"third")
        storage.replace("segments/1.json", b"fourth")
        assert storage.read_bytes("segments/1.json") == b"fourth"
        with open(storage.local_path("segments/1.json"), "rb") as f:  # never the old bytes under the name
            assert f.read() == b"fourth"
        storage.sync_dir("segments")
        storage.sync_dir("")

    def test_kinds_ages_and_moves(self, storage):
        """What verify and repair ask a storage: kinds without following links, ages, a move."""
        storage.write_new("segments/1.arrow", b"abcd")
        assert storage.stat("segments/1.arrow") == ("file", 4)
        assert storage.stat("segments/none") is None and storage.stat("")[0] == "dir"
        assert storage.stat("segments")[0] == "dir"
        assert storage.list_kinds("segments") == {"1.arrow": "file"}
        assert storage.list_kinds("")["segments"] == "dir"
        assert storage.list_kinds("nothing") == {} and storage.list_ages("nothing") == {}
        ages = storage.list_ages("segments")
        assert list(ages) == ["1.arrow"] and -60 < ages["1.arrow"] < 60
        assert -60 < storage.age("segments/1.arrow") < 60  # the backend's clock and this host's agree roughly
        storage.move("segments/1.arrow", "quarantine/segments/1.arrow")
        assert storage.stat("segments/1.arrow") is None
        assert storage.read_bytes("quarantine/segments/1.arrow") == b"abcd"
        assert storage.list_kinds("quarantine") == {"segments": "dir"}
        storage.write_new("segments/2.arrow", b"two")
        # onto a free name only: a taken one keeps its bytes, and nothing moves
        assert storage.move("segments/2.arrow", "quarantine/segments/1.arrow", if_absent=True) is False
        assert storage.read_bytes("quarantine/segments/1.arrow") == b"abcd"
        assert storage.read_bytes("segments/2.arrow") == b"two"
        assert storage.move("segments/2.arrow", "quarantine/segments/2.arrow", if_absent=True) is True
        assert storage.stat("segments/2.arrow") is None
        assert {"quarantine/segments/1.arrow", "quarantine/segments/2.arrow"} <= set(storage.some_names())

    @pytest.mark.parametrize("rel", ["../x", "/abs", "a//b", "a/./b", "a/../b", "a\\b"])
    def test_paths_that_leave_the_store_are_refused(self, storage, rel):
        for call in (lambda: storage.write_new(rel, b"x"), lambda: storage.read_bytes(rel),
                     lambda: storage.put_if_absent(rel, b"x"), lambda: storage.delete(rel)):
            with pytest.raises(ValueError, match="store-relative"):
                call()
        assert storage.stat("x") is None and storage.stat("b") is None

    def test_the_root_is_not_a_file(self, storage):
        with pytest.raises((ValueError, IsADirectoryError)):
            storage.write_new("", b"x")

    def test_bad_ranges(self, storage):
        storage.write_new("x", b"abc")
        for start, end in [(-1, 2), (3, 2), (0.5, 2)]:
            with pytest.raises(ValueError, match="byte range"):
                storage.read_range("x", start, end)

    # -- finding commits ----------------------------------------------------------------------

    def test_manifest_discovery(self, storage, reopen):
        """The newest manifest is found through the storage alone, listed or probed as its
        capabilities say, from nothing, from a known generation, past collected ones, and by
        another handle."""
        assert fmt.load_newest_manifest(storage)[0].generation == 0  # an empty store
        for gen in (1, 2, 3):
            fmt.Manifest(generation=gen, next_row=10 * gen, head=10 * gen).write(storage)
        m, problems = fmt.load_newest_manifest(storage)
        assert (m.generation, m.next_row, problems) == (3, 30, [])
        known = fmt.read_manifest(storage, 1)
        assert fmt.load_newest_manifest(storage, known=known)[0].generation == 3
        storage.delete(fmt.manifest_file(1))  # collected: the oldest goes first
        fmt.Manifest(generation=4, next_row=40, head=40).write(storage)
        assert fmt.load_newest_manifest(storage, known=fmt.read_manifest(storage, 2))[0].generation == 4
        assert fmt.load_newest_manifest(storage)[0].next_row == 40
        assert fmt.load_newest_manifest(reopen())[0].generation == 4
        if storage.reliable_listing:
            assert fmt.list_generations(storage) == [4, 3, 2]

    # -- the commit protocol ------------------------------------------------------------------

    def test_put_if_absent(self, storage):
        assert storage.put_if_absent("manifests/1.json", b"first") is True
        assert storage.put_if_absent("manifests/1.json", b"second") is False
        assert storage.read_bytes("manifests/1.json") == b"first"
        if not storage.exclusive_lock:
            # without a lock a manifest is only ever created: a second writer of a single-writer
            # store (a publish that is not exclusive) must fail at its commit, not replace the first's
            with pytest.raises(CommitConflictError, match="another writer"):
                storage.publish("manifests/1.json", b"third", exclusive=False)
            assert storage.read_bytes("manifests/1.json") == b"first"
        storage.probe_create_if_absent("manifests")

    def test_another_handle_sees_the_same_files(self, storage, reopen):
        other = reopen()
        storage.write_new("segments/1.arrow", b"one")
        assert other.read_bytes("segments/1.arrow") == b"one"
        assert other.put_if_absent("manifests/1.json", b"theirs") is True
        assert storage.put_if_absent("manifests/1.json", b"ours") is False
        assert storage.read_bytes("manifests/1.json") == b"theirs"
        other.delete("segments/1.arrow")
        assert not storage.exists("segments/1.arrow")

    def test_racing_creates_have_one_winner(self, storage, reopen):
        """``RACERS`` handles create the same names, released together at each: exactly one winner
        per name, and the name holds the winner's bytes, intact."""
        handles = [reopen() for _ in range(self.RACERS)]
        barrier = threading.Barrier(len(handles), timeout=120)
        wins: List[List[int]] = [[] for _ in handles]
        errors: List[BaseException] = []

        def body(w: int, k: int) -> bytes:
            return f"writer={w} name={k} ".encode() * (200 + 37 * w)

        def race(w: int) -> None:
            try:
                for k in range(self.RACE_NAMES):
                    barrier.wait()
                    if handles[w].put_if_absent(_manifest_name(k), body(w, k)):
                        wins[w].append(k)
            except BaseException as exc:  # reported below
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=race, args=(w,)) for w in range(len(handles))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for k in range(self.RACE_NAMES):
            winners = [w for w in range(len(handles)) if k in wins[w]]
            assert len(winners) == 1, f"name {k} created by {len(winners)} writers"
            assert storage.read_bytes(_manifest_name(k)) == body(winners[0], k)

    def test_link_candidates_take_the_first_free_name(self, storage, reopen):
        first = storage.link_candidates(lambda i: f"segments/{i:04d}", b"one", 3)
        second = reopen().link_candidates(lambda i: f"segments/{i:04d}", b"two", 3)
        assert (first, second) == ((3, "segments/0003"), (4, "segments/0004"))
        assert storage.read_bytes("segments/0004") == b"two"

    def test_reserved_names_are_filled_by_their_writer(self, storage, reopen):
        storage.ensure_dir("groups")  # a store makes its directories before it writes into them
        i, rel = storage.reserve(lambda i: f"segments/{i:08d}.arrow", 1)
        j, other = reopen().reserve(lambda i: f"segments/{i:08d}.arrow", 1)
        assert (i, rel) == (1, "segments/00000001.arrow") and j == 2 and other != rel
        assert isinstance(storage.name_durable(rel), bool)
        storage.write_files([(rel, b"segment", None), ("groups/00000001.arrow", b"sidecar", None)],
                            ["segments", "groups"])
        assert storage.read_bytes(rel) == b"segment" and storage.read_bytes("groups/00000001.arrow") == b"sidecar"

    def test_publish(self, storage, reopen):
        """A publish writes its files, then creates its manifest only if absent (``exclusive``):
        a lost one answers False and leaves the winner's manifest."""
        other = reopen()
        _, mine = storage.reserve(lambda i: f"segments/{i:08d}.arrow", 1)
        _, theirs = other.reserve(lambda i: f"segments/{i:08d}.arrow", 1)
        assert other.publish("manifests/00000001.json", b"theirs", [(theirs, b"t", None)], ["segments"],
                             exclusive=True) is True
        assert storage.publish("manifests/00000001.json", b"mine", [(mine, b"m", None)], ["segments"],
                               exclusive=True) is False
        assert storage.link_attempted is True
        storage.discard_staged()
        assert storage.read_bytes("manifests/00000001.json") == b"theirs"
        assert storage.read_bytes(theirs) == b"t" and storage.read_bytes(mine) == b"m"
        assert other.settle_publish("manifests/00000001.json", b"theirs") is True
        assert storage.settle_publish("manifests/00000001.json", b"mine") is not True
        # the loser's files are its own to remove
        assert storage.delete_own(mine) is True and not storage.exists(mine)
        storage.release_leases()
        other.release_leases()

    def test_stage_then_publish(self, storage):
        _, rel = storage.reserve(lambda i: f"segments/{i:08d}.arrow", 1)
        storage.stage("manifests", b"staged", [(rel, b"s", None)], ["segments"])
        assert storage.read_bytes(rel) == b"s" and not storage.exists("manifests/00000001.json")
        assert storage.publish("manifests/00000001.json", b"staged", exclusive=True) is True
        assert storage.read_bytes("manifests/00000001.json") == b"staged"
        storage.discard_staged()
        storage.release_leases()

    def test_update_small_loses_no_update(self, storage, reopen):
        """The collection floor's read-modify-write: racing handles each add one, none is lost;
        ``None`` from the update keeps the bytes as they are."""
        assert storage.update_small("FLOOR.json", lambda cur: b"0" if cur is None else None) == b"0"
        assert storage.update_small("FLOOR.json", lambda cur: None) == b"0"
        handles = [reopen() for _ in range(self.RACERS)]
        per_handle = 5
        errors: List[BaseException] = []

        def add(h) -> None:
            try:
                for _ in range(per_handle):
                    h.update_small("FLOOR.json", lambda cur: str(int(cur) + 1).encode())
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=add, args=(h,)) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert storage.read_bytes("FLOOR.json") == str(per_handle * len(handles)).encode()

    def test_held_removals(self, storage):
        """A clean-up holds what it would remove (absent names left out) and removes exactly that."""
        for rel in ("segments/1.arrow", "segments/2.arrow"):
            storage.write_new(rel, b"x")
        held = storage.hold(["segments/1.arrow", "segments/2.arrow", "segments/3.arrow"])
        try:
            assert set(held) == {"segments/1.arrow", "segments/2.arrow"}
            assert storage.remove_held("segments/1.arrow", held["segments/1.arrow"]) is True
        finally:
            storage.unhold(held)
        assert not storage.exists("segments/1.arrow") and storage.exists("segments/2.arrow")
        for gen in (1, 2, 3):
            storage.put_if_absent(_manifest_name(gen), b"m")
        storage.release_leases()  # committed: nothing of this writer's is leased any more
        run, whole = storage.hold_run([_manifest_name(g) for g in (1, 2, 3)])
        try:
            assert whole is True and set(run) == {_manifest_name(g) for g in (1, 2, 3)}
            for rel, handle in run.items():
                storage.remove_held(rel, handle)
        finally:
            storage.unhold(run)
        assert not any(storage.exists(_manifest_name(g)) for g in (1, 2, 3))

    def test_delete_own(self, storage):
        _, rel = storage.reserve(lambda i: f"segments/{i:08d}.arrow", 1)
        storage.write_files([(rel, b"abandoned", None)])
        assert storage.delete_own(rel) is True and not storage.exists(rel)
        storage.release_leases()


__all__ = ["StorageTests"]
