"""The storage contract (``diskreplay.testing.StorageTests``) on every backend in the tree, and what
only one backend does.

Each backend is a subclass giving the contract's two fixtures: LocalStorage (a directory),
S3Storage on seaweedfs and on moto (both started on 127.0.0.1 by the session fixtures in
``tests/s3servers.py``) and MemoryStorage. Another implementation joins by adding a subclass.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from diskreplay import ConditionalWriteError, MissingDependencyError, ObjectStoreError
from diskreplay.storage import MemoryStorage, S3Storage
from diskreplay.storage import LocalStorage, open_storage
from diskreplay.testing import StorageTests

from .s3servers import ConditionProxy, free_port

DIRS = ("manifests", "segments", "a", "nope")
_HANDLES = itertools.count()


def local_storage(tmp_path):
    st = LocalStorage(str(tmp_path / "store"))
    os.makedirs(st.root)
    for d in DIRS:  # a store's directories exist before anything is written into them
        st.ensure_dir(d)
    return st


class TestLocalStorage(StorageTests):
    @pytest.fixture
    def storage(self, tmp_path):
        st = local_storage(tmp_path)
        yield st
        st.close()

    @pytest.fixture
    def reopen(self, storage):
        made = []

        def another():
            # another writer: its temporary names are its own, as a store sets them
            made.append(LocalStorage(storage.root, f"handle{next(_HANDLES)}"))
            return made[-1]

        yield another
        for st in made:
            st.close()

    def test_links_and_special_files_are_reported_never_followed(self, storage):
        os.symlink("/etc/passwd", os.path.join(storage.url, "segments", "2.arrow"))
        os.mkfifo(os.path.join(storage.url, "segments", "3.arrow"))
        assert storage.stat("segments/2.arrow")[0] == "link"
        assert storage.list_kinds("segments") == {"2.arrow": "link", "3.arrow": "other"}
        storage.move("segments/2.arrow", "quarantine/2.arrow")  # the link itself moves
        assert os.readlink(os.path.join(storage.url, "quarantine", "2.arrow")) == "/etc/passwd"

    def test_the_local_path_is_the_file_itself(self, storage):
        storage.write_new("segments/00000003.arrow", b"abc")
        assert os.path.samefile(storage.local_path("segments/00000003.arrow"),
                                os.path.join(storage.url, "segments/00000003.arrow"))


class _S3Tests(StorageTests):
    SERVER = ""

    @pytest.fixture
    def storage(self, tmp_path, s3_servers):
        server = s3_servers(self.SERVER)
        st = S3Storage(f"s3://{server.new_bucket()}/store", server.storage_options, cache_dir=str(tmp_path / "cache"))
        st.server = server
        yield st
        st.close()

    @pytest.fixture
    def reopen(self, storage, tmp_path):
        made = []

        def another():
            n = next(_HANDLES)
            made.append(S3Storage(storage.url, storage.server.storage_options, cache_dir=str(tmp_path / f"cache{n}")))
            return made[-1]

        yield another
        for st in made:
            st.close()

    @pytest.mark.xfail(strict=True, raises=ValueError,
                       reason="S3Storage.read_ranges passes an empty range to obstore's get_ranges, which refuses "
                              "it (ValueError: Invalid range requested); read_range answers b''")
    def test_an_empty_range_is_no_bytes(self, storage):
        super().test_an_empty_range_is_no_bytes(storage)

    def test_a_retried_create_of_the_same_bytes_is_its_own(self, storage):
        """S3 clients retry a PUT whose answer was lost, and then hear "exists": the same bytes
        again count as this writer's own create."""
        assert storage.put_if_absent("manifests/1.json", b"first") is True
        assert storage.put_if_absent("manifests/1.json", b"first") is True
        assert storage.put_if_absent("manifests/1.json", b"second") is False


class TestSeaweedfsStorage(_S3Tests):
    SERVER = "seaweedfs"


_MOTO_RACES = ("moto's conditional PUTs are not atomic under concurrency (docs/FORMAT.md, assumption (2): its "
               "server checks If-None-Match or If-Match, then writes, in two steps; racing writers win one name "
               "twice, or lose an update, now and then)")


class TestMotoStorage(_S3Tests):
    SERVER = "moto"

    @pytest.mark.skip(reason=_MOTO_RACES)
    def test_racing_creates_have_one_winner(self):
        pass

    @pytest.mark.skip(reason=_MOTO_RACES)
    def test_update_small_loses_no_update(self):
        pass


class TestMemoryStorage(StorageTests):
    @pytest.fixture
    def storage(self, tmp_path):
        st = MemoryStorage(f"memory://test-storage-{next(_HANDLES)}", cache_dir=str(tmp_path / "cache"))
        yield st
        st.destroy()

    @pytest.fixture
    def reopen(self, storage):
        return lambda: MemoryStorage(storage.url)

    def test_names_keep_their_files_apart_until_destroyed(self, storage):
        storage.write_new("a/x", b"1")
        other = MemoryStorage(storage.url + "-other")
        assert other.list("a") == [] and MemoryStorage(storage.url + "/").read_bytes("a/x") == b"1"
        clone = pickle.loads(pickle.dumps(storage))  # travels as its name: the same files
        assert clone.url == storage.url and clone.read_bytes("a/x") == b"1"
        storage.destroy()
        assert clone.list("a") == [] and clone.stat("a") is None

    @pytest.mark.parametrize("url", ["memory://", "memory:///", "mem://x", "/data/x"])
    def test_bad_urls(self, url):
        with pytest.raises(ValueError, match="memory://NAME"):
            MemoryStorage(url)

    def test_open_storage(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        st = open_storage("memory://opened", cache_dir=None, cache_bytes=1 << 20)
        assert type(st) is MemoryStorage and st.url == "memory://opened"
        with pytest.raises(ValueError, match="storage_options are for s3:// URLs"):
            open_storage("memory://opened", {"endpoint": "http://x"})
        assert not os.listdir(tmp_path)  # (not a directory named "memory:")


class TestMemoryStores:
    """A ``ReplayStore`` of ``memory://NAME``: its handles are the writers and readers of one store."""

    @pytest.fixture
    def url(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)  # a memory store makes no file here
        url = f"memory://store-{next(_HANDLES)}"
        yield url
        MemoryStorage(url).destroy()
        assert not os.listdir(tmp_path)

    def test_a_second_handle_sees_the_first_ones_commits(self, url):
        from diskreplay import ReplayStore
        from diskreplay.testing.workload import batch_for, check_rows

        with ReplayStore(url, capacity=10) as store:
            assert type(store.storage) is MemoryStorage
            store.extend(batch_for(0, 0, 4))
            with ReplayStore(url, readonly=True) as reader:
                assert reader.next_row == 4 and check_rows(reader, reader.row_ids()) is None
                store.extend(batch_for(0, 1, 8))
                assert reader.refresh() and (reader.head, reader.next_row) == (2, 12)
                assert check_rows(reader, reader.row_ids()) is None

    def test_a_second_writer_of_a_single_writer_store_fails_at_its_commit(self, url):
        """No lock keeps it out (as on S3): its commit finds the generation taken and commits nothing."""
        from diskreplay import CommitConflictError, ReplayStore
        from diskreplay.testing.workload import batch_for

        with ReplayStore(url) as first, ReplayStore(url) as second:
            first.extend(batch_for(0, 0, 2))
            with pytest.raises(CommitConflictError, match="another writer"):
                second.extend(batch_for(1, 0, 3))
        with ReplayStore(url, readonly=True) as reader:
            assert reader.read(reader.row_ids(), ["tag"])["tag"] == batch_for(0, 0, 2)["tag"]

    def test_many_writers_race_through_create_if_absent(self, url):
        """Writers in threads, each its own handle of a multi-writer store: every batch is committed
        exactly once, whatever generation each one's first try lost."""
        from diskreplay import ReplayStore
        from diskreplay.testing.workload import batch_for, check_rows, token_for

        ReplayStore(url, multi_writer=True).close()
        writers = [ReplayStore(url) for _ in range(3)]
        start = threading.Barrier(len(writers))
        errors = []

        def write(w):
            try:
                start.wait()
                for step in range(6):
                    writers[w].extend(batch_for(w, step, 2), token=token_for(w, step))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(w,)) for w in range(len(writers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for w in writers:
            w.close()
        assert not errors, errors
        with ReplayStore(url, readonly=True) as reader:
            tags = reader.read(reader.row_ids(), ["tag"])["tag"]
            assert sorted(tags) == sorted(t for w in range(3) for step in range(6) for t in batch_for(w, step, 2)["tag"])
            assert check_rows(reader, reader.row_ids()) is None
        from diskreplay.verify import verify_store

        report = verify_store(url)
        assert report["ok"], report["problems"]


def test_the_contract_without_pytest_names_it():
    """``import diskreplay.testing`` needs neither pytest nor hypothesis; the contract class and the
    state machines say what they need when they are used without them."""
    code = textwrap.dedent("""
        import sys
        sys.modules["pytest"] = sys.modules["hypothesis"] = None  # import pytest -> ImportError
        import diskreplay.testing
        from diskreplay.testing.workload import batch_for
        from diskreplay import MissingDependencyError
        for name, needs in (("StorageTests", "pip install pytest"), ("WritersMachine", "pip install hypothesis")):
            try:
                getattr(diskreplay.testing, name)
            except MissingDependencyError as exc:
                assert needs in str(exc), exc
            else:
                raise AssertionError(name)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


# -- conditional-PUT race: many processes, one winner per name ------------------
# (the contract's race is between threads; this one is between processes, where a backend's files
# are shared by more than one process: not moto's, whose conditional PUT is not atomic under
# concurrency, nor memory's, which no other process sees)

@pytest.fixture(params=("local", "s3-seaweedfs"))
def process_shared_storage(request, tmp_path, s3_servers):
    if request.param == "local":
        yield local_storage(tmp_path)
        return
    server = s3_servers("seaweedfs")
    st = S3Storage(f"s3://{server.new_bucket()}/store", server.storage_options, cache_dir=str(tmp_path / "cache"))
    yield st
    st.close()


# seaweedfs 4.48 makes each losing conditional PUT wait in ~1 s steps when 8
# arrive at once (a server-side lock; measured: median 60 ms, max 4 s), so
# each name costs up to a few seconds there.
_RACE_KEYS = 8
_RACE_WRITERS = 8


def _race_bytes(writer, k):
    return f"writer={writer} generation={k} ".encode() * (200 + 37 * writer)


def _race_worker(writer, barrier, tasks, results):
    """One racing process: for each storage it is sent, create the same names
    as every other worker, all released together at each name."""
    while True:
        st = tasks.get()
        if st is None:
            return
        if isinstance(st, LocalStorage):  # its temporary names are unique per writer id, as a store sets it
            st.writer_id = f"racer{writer}"
        wins = []
        try:
            for k in range(_RACE_KEYS):
                barrier.wait()
                if st.put_if_absent(f"manifests/{k:08d}.json", _race_bytes(writer, k)):
                    wins.append(k)
                # everyone done before the next name: a winner (it writes more) would otherwise arrive
                # last at the next release, run first on 2 cores, and win every name after the first
                barrier.wait()
            results.put((writer, wins, None))
        except Exception as exc:  # reported to the test, which fails on it
            barrier.abort()
            results.put((writer, wins, repr(exc)))


@pytest.fixture(scope="module")
def race_workers():
    """8 spawned worker processes, started once for the module (each import
    of diskreplay costs about a second on 2 cores)."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(_RACE_WRITERS, timeout=120)
    results = ctx.Queue()
    queues = [ctx.Queue() for _ in range(_RACE_WRITERS)]
    procs = [ctx.Process(target=_race_worker, args=(w, barrier, queues[w], results), daemon=True)
             for w in range(_RACE_WRITERS)]
    for p in procs:
        p.start()

    def race(storage):
        for q in queues:
            q.put(storage)
        return [results.get(timeout=300) for _ in procs]

    yield race
    for q in queues:
        q.put(None)
    for p in procs:
        p.join(timeout=30)


def test_put_if_absent_race(process_shared_storage, race_workers):
    """8 processes create the same 8 names, released together at each name:
    exactly one winner per name, and the name holds the winner's bytes, intact."""
    storage = process_shared_storage
    results = race_workers(storage)
    errors = [err for _, _, err in results if err]
    assert not errors, errors
    winners = {}
    for writer, wins, _ in results:
        for k in wins:
            winners.setdefault(k, []).append(writer)
    assert sorted(winners) == list(range(_RACE_KEYS)), "a name that nobody created"
    doubles = {k: w for k, w in winners.items() if len(w) > 1}
    assert not doubles, f"names created by more than one writer: {doubles}"
    for k, (w,) in winners.items():
        assert storage.read_bytes(f"manifests/{k:08d}.json") == _race_bytes(w, k)
    # The race was real: names were won by different writers.
    assert len({w for ws in winners.values() for w in ws}) >= 2


# -- S3 only: cache, ranges, errors, faults --------------------------------------

def _s3(server, tmp_path, **kwargs):
    return S3Storage(f"s3://{server.new_bucket()}/p", server.storage_options,
                     cache_dir=str(tmp_path / "cache"), **kwargs)


def test_private_cache_directories_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """Without cache_dir every process made its own diskreplay-cache-* directory, and one killed before
    closing left it behind (7 after a run with killed Ray actors). A new private cache removes those
    whose owner is gone; a live process's, one without .owner (an earlier diskreplay's) and anything
    else in the temporary directory stay; a cache removes its own when it closes."""
    import tempfile

    from diskreplay.storage.cache import ObjectCache

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = textwrap.dedent("""
        import os, sys, time
        from diskreplay.storage.cache import ObjectCache
        cache = ObjectCache(None, 1 << 20, "s3://b/p")
        cache.fill("x", 10, lambda missing: [b"0123456789"[s:e] for s, e in missing], None)
        print(cache.directory, flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), 9)
        time.sleep(120)
    """)
    env = {**os.environ, "TMPDIR": str(tmp)}

    def child(how):
        p = subprocess.Popen([sys.executable, "-c", code, how], stdout=subprocess.PIPE, text=True, env=env)
        return p, p.stdout.readline().strip()

    killed, dead_dir = child("kill")
    assert killed.wait(30) == -signal.SIGKILL and os.path.isdir(dead_dir) and os.listdir(dead_dir)
    live, live_dir = child("live")
    try:
        old = tmp / "diskreplay-cache-earlier"
        old.mkdir()
        (old / "copy").write_bytes(b"x")
        (tmp / "diskreplay-cache-file").write_bytes(b"not a directory")
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        cache = ObjectCache(None, 1 << 20, "s3://b/q")
        assert os.path.dirname(cache.directory) == str(tmp)
        assert not os.path.exists(dead_dir)
        assert os.path.isdir(live_dir) and os.path.isdir(old) and (tmp / "diskreplay-cache-file").exists()
        cache.close()
        assert not os.path.exists(cache.directory)
    finally:
        live.kill()
        live.wait()
    cache = ObjectCache(None, 1 << 20, "s3://b/q")  # its owner killed since: removed now
    assert not os.path.exists(live_dir) and os.path.isdir(old)
    cache.close()


def test_fetch_ranges_coalesces_and_counts(s3_server, tmp_path):
    st = _s3(s3_server, tmp_path, coalesce_bytes=32 << 10)
    data = os.urandom(1 << 20)
    st.write_new("segments/1.arrow", data)
    page = 8192
    ranges = [(100, 200), (page + 5, page + 10), (5 * page, 5 * page + 1), (64 * page, 70 * page + 3)]
    path = st.fetch_ranges("segments/1.arrow", ranges, size=len(data))
    assert os.path.getsize(path) == len(data)
    with open(path, "rb") as f:
        local = f.read()
    for s, e in ranges:
        assert local[s:e] == data[s:e]
    stats = st.cache_stats()
    # pages 0-1 and 5 lie within 32 KiB of each other: one GET; pages 64-70 another.
    assert stats.range_gets == 2
    needed = (2 + 1 + 7) * page
    assert stats.requested_bytes == needed
    assert stats.fetched_bytes == 6 * page + 7 * page  # [0, 6 pages) coalesced, [64, 71)
    assert stats.hit_bytes == 0
    assert st.fetch_ranges("segments/1.arrow", [(150, 160), (64 * page, 65 * page)]) == path
    assert st.cache_stats().hit_bytes == 2 * page and st.cache_stats().range_gets == 2
    whole = st.local_path("segments/1.arrow")
    with open(whole, "rb") as f:
        assert f.read() == data
    assert st.cache_stats().fetched_bytes == len(data)  # nothing fetched twice
    st.close()


def test_cache_bound_eviction_and_reuse(s3_server, tmp_path):
    st = _s3(s3_server, tmp_path, cache_bytes=600 << 10)
    blobs = {f"segments/{i}.arrow": os.urandom(256 << 10) for i in range(6)}
    for rel, data in blobs.items():
        st.write_new(rel, data)
    for rel in blobs:
        path = st.local_path(rel)
        with open(path, "rb") as f:
            assert f.read() == blobs[rel]
        assert st.cache_stats().held_bytes <= 600 << 10
    stats = st.cache_stats()
    assert stats.evictions == 4 and stats.evicted_bytes == 4 * (256 << 10)
    # An evicted complete file is fetched again, whole, on demand.
    with open(st.local_path("segments/0.arrow"), "rb") as f:
        assert f.read() == blobs["segments/0.arrow"]
    assert st.cache_stats().fetched_bytes == 7 * (256 << 10)
    # A second process-like reader with the same cache_dir finds the published
    # complete copies without fetching.
    last = list(blobs)[-1]
    again = S3Storage(st.url, s3_server.storage_options, cache_dir=str(tmp_path / "cache"))
    with open(again.local_path(last), "rb") as f:
        assert f.read() == blobs[last]
    assert again.cache_stats().fetched_bytes == 0 and again.cache_stats().hit_rate == 1.0
    # Deleting an object drops its cached copy: the name never serves old bytes.
    again.delete(last)
    with pytest.raises(FileNotFoundError):
        again.local_path(last)
    again.close()
    st.close()


def test_evicted_file_stays_valid_under_its_mapping(s3_server, tmp_path):
    """An evicted file is unlinked, never rewritten: a mapping of it keeps
    serving the bytes it had; a later fetch makes a new file. With
    ``evict=False`` the bound waits for ``trim_cache``, which names what went."""
    import mmap

    st = _s3(s3_server, tmp_path, cache_bytes=300 << 10)
    blobs = {name: os.urandom(256 << 10) for name in ("a", "b", "c")}
    for rel, data in blobs.items():
        st.write_new(rel, data)
    path = st.fetch_ranges("a", [(8192, 8200)])
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    assert mapped[8192:8200] == blobs["a"][8192:8200]
    st.local_path("b")
    st.local_path("c")  # over the bound: "a" (least recently used) goes
    assert not os.path.exists(path) and st.cache_stats().evictions >= 1
    assert mapped[8192:8200] == blobs["a"][8192:8200]
    again = st.fetch_ranges("a", [(8192, 8200)])
    assert again != path
    mapped.close()
    st.fetch_ranges("b", None, evict=False)
    st.fetch_ranges("a", None, evict=False)
    assert st.cache_stats().held_bytes > 300 << 10  # over the bound until trimmed
    assert st.trim_cache() and st.cache_stats().held_bytes <= 300 << 10
    st.close()


def test_truncated_object_is_named(s3_server, tmp_path):
    st = _s3(s3_server, tmp_path)
    st.write_new("segments/1.arrow", b"x" * 1000)
    from diskreplay import CorruptStoreError
    with pytest.raises(CorruptStoreError, match=r"segments/1.arrow.*shorter than its recorded size 5000"):
        st.local_path("segments/1.arrow", size=5000)
    st.close()


def test_environment_variables(s3_server, tmp_path, monkeypatch):
    bucket = s3_server.new_bucket()
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in s3_server.env.items():
        if key != "AWS_ALLOW_HTTP":  # http:// endpoints are allowed without it
            monkeypatch.setenv(key, value)
    st = open_storage(f"s3://{bucket}/env", cache_dir=str(tmp_path / "c"))
    st.write_new("a", b"from env")
    assert st.read_bytes("a") == b"from env"
    assert [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]] == ["env/a"]
    st.close()


def test_probe_conditional_put_passes(s3_server, tmp_path):
    st = _s3(s3_server, tmp_path)
    st.probe_conditional_put()
    # The probe leaves nothing behind (seaweedfs may keep an empty "p/" folder marker).
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=st.bucket).get("Contents", [])]
    assert st.list("") == [] and not [k for k in keys if "probe" in k], keys


def test_missing_bucket(s3_server, tmp_path):
    st = S3Storage("s3://no-such-bucket-dr/p", s3_server.storage_options, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ObjectStoreError, match=r"^s3://no-such-bucket-dr/p.*bucket 'no-such-bucket-dr' "
                                               r"does not exist"):
        st.probe_conditional_put()
    with pytest.raises(ObjectStoreError, match="does not exist"):
        st.read_bytes("FORMAT.json")


def test_wrong_credentials(s3_server, tmp_path):
    if s3_server.name == "moto":
        pytest.skip("moto's server accepts any credentials")
    bucket = s3_server.new_bucket()
    for change in ({"secret_access_key": "wrong"}, {"access_key_id": "nobody"}):
        opts = {**s3_server.storage_options, **change}
        st = S3Storage(f"s3://{bucket}/p", opts, cache_dir=str(tmp_path / "c"))
        with pytest.raises(ObjectStoreError, match=r"refused the credentials.*AWS_ACCESS_KEY_ID") as info:
            st.probe_conditional_put()
        assert "\n" not in str(info.value) and f"s3://{bucket}/p" in str(info.value)
        with pytest.raises(ObjectStoreError, match="refused the credentials"):
            st.write_new("x", b"1")


def test_refused_endpoint(tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"
    st = S3Storage("s3://bucket/p", {"endpoint": endpoint, "access_key_id": "k", "secret_access_key": "s",
                                     "region": "us-east-1"}, cache_dir=str(tmp_path / "c"))
    t = time.monotonic()
    with pytest.raises(ObjectStoreError, match=rf"^s3://bucket/p.*cannot reach the object store at "
                                               rf"{endpoint} \(connection refused") as info:
        st.write_new("x", b"1")
    assert time.monotonic() - t < 5 and "\n" not in str(info.value)  # (tests/test_s3_connect.py: the rest)
    with pytest.raises(ObjectStoreError, match="cannot reach"):
        st.probe_conditional_put()


def test_server_without_conditional_writes(s3_servers, tmp_path):
    """A server that ignores If-None-Match (emulated by a proxy dropping the
    header in front of moto, which does not check signatures), one that checks
    it before writing instead of atomically (seaweedfs issue #8800: sequential
    creates are refused, concurrent ones all succeed), and one that rejects it
    (a proxy answering 501, in front of seaweedfs)."""
    for name, mode, what in (("moto", "strip", "ignores If-None-Match"),
                             ("moto", "toctou", r"let [2-4] of 4 concurrent create-if-absent PUTs"),
                             ("seaweedfs", "reject", "rejects conditional writes")):
        server = s3_servers(name)
        bucket = server.new_bucket()
        proxy = ConditionProxy(server.endpoint, mode)
        try:
            # 501 is a server error, which is retried until retry_timeout.
            st = S3Storage(f"s3://{bucket}/p", {**server.storage_options, "endpoint": proxy.endpoint,
                                                "retry_timeout": 1}, cache_dir=str(tmp_path / mode))
            st.replace("plain", b"ordinary writes still work")
            with pytest.raises(ConditionalWriteError, match=what):
                st.probe_conditional_put()
            if mode == "reject":
                with pytest.raises(ConditionalWriteError):
                    st.put_if_absent("manifests/1.json", b"x")
            assert st.list("") == ["plain"]
        finally:
            proxy.close()


def test_server_restart_mid_run(s3_server, tmp_path):
    """The server dies: with a short retry bound a request fails with a clear
    error; then it comes back while requests are being retried, and they
    succeed with nothing lost."""
    st = _s3(s3_server, tmp_path)
    st.write_new("before", b"1" * 1000)
    short = S3Storage(st.url, {**s3_server.storage_options, "retry_timeout": 1},
                      cache_dir=str(tmp_path / "c2"))
    s3_server.stop()
    try:
        with pytest.raises(ObjectStoreError, match="cannot reach the object store"):
            short.read_bytes("before")
    except BaseException:
        s3_server.restart()
        raise
    restarter = threading.Timer(1.5, s3_server.restart)
    restarter.start()
    try:
        st.write_new("during", b"2" * 1000)
        assert st.put_if_absent("manifests/1.json", b"m") is True
    finally:
        restarter.join()
    assert st.read_bytes("before") == b"1" * 1000
    assert short.read_bytes("during") == b"2" * 1000
    assert st.read_bytes("manifests/1.json") == b"m"


_UPLOADER = textwrap.dedent("""
    import os, sys
    from diskreplay.storage import S3Storage
    st = S3Storage(sys.argv[1], {"endpoint": sys.argv[2], "access_key_id": sys.argv[3],
                                 "secret_access_key": sys.argv[4], "region": "us-east-1"},
                   cache_dir=sys.argv[6])
    data = bytes([int(sys.argv[5])]) * (32 << 20)
    print("go", flush=True)
    st.write_new("segments/big.arrow", data)
    print("done", flush=True)
""")


def test_killed_upload_is_never_visible(s3_server, tmp_path):
    """SIGKILL a writer in the middle of a 32 MiB PUT: the object is absent
    or complete, never partial."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/p"
    seen = set()
    for attempt, delay in enumerate((0.05, 0.2)):
        proc = subprocess.Popen([sys.executable, "-c", _UPLOADER, url, s3_server.endpoint,
                                 s3_server.access_key, s3_server.secret_key, str(attempt + 1),
                                 str(tmp_path / "uploader-cache")],
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert proc.stdout.readline().strip() == b"go"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        st = S3Storage(url, s3_server.storage_options, cache_dir=str(tmp_path / f"c{attempt}"))
        try:
            body = st.read_bytes("segments/big.arrow")
        except FileNotFoundError:
            seen.add("absent")
            continue
        assert len(body) == 32 << 20, f"a partial object of {len(body)} bytes is visible"
        assert body.count(body[:1]) == len(body)
        seen.add("complete")
    assert seen


def test_pickle_round_trip(s3_server, tmp_path):
    st = _s3(s3_server, tmp_path)
    st.write_new("x", b"payload")
    clone = pickle.loads(pickle.dumps(st))
    assert clone.url == st.url and clone.read_bytes("x") == b"payload"


def test_bad_url_and_options(tmp_path):
    with pytest.raises(ObjectStoreError, match="names no bucket"):
        S3Storage("s3:///x")
    with pytest.raises(ObjectStoreError, match="storage_options are not usable"):
        S3Storage("s3://b/p", {"no_such_setting": 1})
    with pytest.raises(ValueError, match="cache_bytes must be a positive"):
        S3Storage("s3://b/p", cache_bytes=0)
    with pytest.raises(ValueError, match="storage_options are for s3:// URLs"):
        open_storage(str(tmp_path), {"endpoint": "http://x"})


def test_missing_client_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore -> ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'diskreplay\[s3\]'"):
        S3Storage("s3://bucket/p")


# -- range arithmetic of the cache, against a bitmap model ----------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

from diskreplay._ranges import merge_ranges, subtract_ranges  # noqa: E402

_ranges = hst.lists(hst.tuples(hst.integers(0, 200), hst.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])),
                    max_size=12)


def _bits(ranges, n=260):
    out = [False] * n
    for s, e in ranges:
        for i in range(s, e):
            out[i] = True
    return out


@settings(max_examples=300, deadline=None)
@given(_ranges, _ranges, hst.integers(0, 10))
def test_range_arithmetic_matches_a_bitmap(want, have, gap):
    merged = merge_ranges(want)
    assert _bits(merged) == _bits(want)
    assert all(a[1] < b[0] for a, b in zip(merged, merged[1:]))  # sorted, disjoint, not touching
    coalesced = merge_ranges(want, gap)
    assert all(b[0] - a[1] > gap for a, b in zip(coalesced, coalesced[1:]))
    assert all(x <= y for x, y in zip(_bits(want), _bits(coalesced)))
    missing = subtract_ranges(merged, merge_ranges(have))
    assert _bits(missing) == [w and not h for w, h in zip(_bits(want), _bits(have))]
