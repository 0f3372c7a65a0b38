"""Schedules of many writers forced one step at a time: stale writers, collected generations, abandoned
and delayed commits, leftover temporary names, late columns, lagging listings (docs/FORMAT.md, "Many
writers" and "The collection floor"). Each test forces the interleaving with hooks in the storage
calls of one writer and then checks, in a fresh reader, that every acknowledged batch is there exactly
once, bit-exact, at the rows its ``extend`` returned."""

from __future__ import annotations

import errno
import os
import threading
import time
import types

import numpy as np
import pytest

from diskreplay import ReplayStore, StoreLockedError
from diskreplay import format as fmt
from diskreplay.errors import CommitTimeoutError, StoreIOError
from diskreplay.storage import LocalStorage
from diskreplay.store import committer as committer_module
from diskreplay.testing.workload import batch_for, check_rows, token_for
from diskreplay.verify import repair_store, verify_store
from tests.campaign import run_campaign

RETAIN = 2  # seconds: a test's retention, so that generations are collected within its run


def _exactly_once(path, acked):
    """Every ``(writer, step) -> rows`` in ``acked`` is in the store once, whole, at those rows, and
    nothing else is there but what ``extra`` batches (other writers' acknowledged ones) hold."""
    with ReplayStore(path, readonly=True) as store:
        assert check_rows(store, store.row_ids()) is None
        tags = store.read(store.row_ids(), ["tag"])["tag"]
        head = store.head
    where = {}
    for i, tag in enumerate(tags):
        where.setdefault(tag[: tag.index("r")], []).append(head + i)
    for (w, step), rows in acked.items():
        want = batch_for(w, step)["tag"]
        got = where.pop(want[0][: want[0].index("r")], None)
        assert got == [int(r) for r in rows], ((w, step), got, list(rows))
    assert not where, f"rows nobody acknowledged: {sorted(where)}"
    report = verify_store(path)
    assert report["ok"], report["problems"]


def _two_writers(path, **options):
    a = ReplayStore(path, multi_writer=True, retain_seconds=RETAIN, **options)
    b = ReplayStore(path)
    return a, b


def _commit(store, acked, w, steps):
    for step in steps:
        acked[(w, step)] = store.extend(batch_for(w, step), token=token_for(w, step))


def _b_commits_and_collects(b, acked, first):
    """Writer 2 commits, waits out the retention, commits again and sweeps: every generation before
    the second run is collected."""
    _commit(b, acked, 2, range(first, first + 20))  # (past a full manifest: the deltas before it can go)
    time.sleep(RETAIN + 0.3)
    _commit(b, acked, 2, range(first + 20, first + 26))
    b._committer.collect(full=True)


# --------------------------------------------------------------------------- a collected generation


@pytest.mark.parametrize("hooked", [1, 3])
def test_an_idle_writer_never_fills_a_generation_a_clean_up_is_collecting(tmp_path, monkeypatch, hooked):
    """Writer 1 holds generation 1 while writer 2's clean-up deletes generation ``hooked``; writer 1's
    extend runs right then (the old sweep removed the newest first, so 1 was there and 2 was not:
    writer 1 linked generation 2 again, acknowledged rows that later readers found holding writer 2's)."""
    path = str(tmp_path / "s")
    a, b = _two_writers(path)
    acked = {}
    _commit(a, acked, 1, [0])
    _commit(b, acked, 2, range(20))  # (past a full manifest: the deltas before it can go)
    time.sleep(RETAIN + 0.3)
    _commit(b, acked, 2, range(20, 26))
    real = LocalStorage.delete
    ran = []

    def delete(self, rel):
        if self is b._committer.storage and rel == fmt.manifest_file(hooked) and not ran:
            ran.append(1)
            _commit(a, acked, 1, [1])
        return real(self, rel)

    monkeypatch.setattr(LocalStorage, "delete", delete)
    b._committer.collect(full=True)
    monkeypatch.undo()
    assert ran, "the clean-up collected nothing"
    _commit(a, acked, 1, [2])
    _commit(b, acked, 2, [26])
    assert b.committed_rows(token_for(1, 1)).tolist() == acked[(1, 1)].tolist()
    a.close(), b.close()
    _exactly_once(path, acked)


def test_a_writer_stopped_between_its_base_and_its_link_does_not_commit_into_a_collected_generation(
        tmp_path, monkeypatch):
    """Writer 1 read its base and then stopped (SIGSTOP, a pause) for longer than retain_seconds, while
    writer 2 committed and collected: its link lands in a collected generation. It counts only if the
    collection floor, read after the link, is not above it; here it is, so the commit is rebased
    (its files, leased, are still there) and lands on the newest commit."""
    path = str(tmp_path / "s")
    a, b = _two_writers(path)
    acked = {}
    _commit(a, acked, 1, [0])
    _commit(b, acked, 2, [0])
    real = LocalStorage.link_new
    ran = []

    def link_new(self, src, rel):
        if self is a._committer.storage and rel.startswith(fmt.MANIFEST_DIR + "/") and not ran:
            ran.append(rel)
            _b_commits_and_collects(b, acked, 1)
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", link_new)
    _commit(a, acked, 1, [1])
    monkeypatch.undo()
    _commit(a, acked, 1, [2])
    slots = a.stats()["collected_slots"]
    a.close(), b.close()
    _exactly_once(path, acked)
    assert ran and slots == 1 and fmt.read_floor(path) > int(os.path.basename(ran[0])[:12])


def test_a_writer_stopped_before_it_reserves_an_id_never_takes_one_a_commit_named(tmp_path, monkeypatch):
    """Writer 1 caught up and then stopped, before it reserved its segment's id, for longer than
    retain_seconds, while writer 2 committed segments, merged them and collected their files: the
    first free id at writer 1's ``next_segment`` was one writer 2 had committed, and writer 1 took it
    again. Ids are never reused (docs/FORMAT.md): the cache of an open segment, a writer's small
    segments kept for merges and a clean-up's bookkeeping all take an id for one file."""
    path = str(tmp_path / "s")
    retain = 2 * RETAIN  # (a sweep slower than half of it removes no file: a loaded machine's are slow)
    a = ReplayStore(path, multi_writer=True, retain_seconds=retain)
    b = ReplayStore(path)
    acked = {}
    _commit(a, acked, 1, [0])
    named = set()
    storage = a._committer.storage
    real = type(storage).reserve
    ran = []

    def reserve(self, *args, **kwargs):
        if self is storage and not ran:
            ran.append(1)
            # writer 2's segments, merged into one, then commits past a full manifest (the deltas
            # before it can go), older than retain_seconds when it collects
            for step in range(60):
                _commit(b, acked, 2, [step])
                named.update(e.id for e in b.manifest.segments)
                if step == 19:
                    b.compact()
                if step == 39:
                    time.sleep(retain + 0.3)
            for _ in range(5):
                b._committer.collect(full=True)
                ran.extend(i for i in named if not os.path.exists(os.path.join(path, fmt.segment_file(i))))
                if len(ran) > 1:
                    break
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(storage), "reserve", reserve)
    _commit(a, acked, 1, [1])
    monkeypatch.undo()
    assert len(ran) > 1, "the clean-up freed no id"
    row = int(acked[(1, 1)][0])
    mine = {e.id for e in a.manifest.segments if e.first_row <= row < e.first_row + e.num_rows}
    assert mine and not mine & named, f"writer 1 took ids {sorted(mine & named)} writer 2 had committed"
    a.close(), b.close()
    _exactly_once(path, acked)


def test_a_suspended_host_does_not_take_a_collected_generation_for_the_newest(tmp_path, monkeypatch):
    """A clock that stops while the host is suspended (``time.monotonic``) told writer 1 that the
    generation it held was the newest moments ago, so it read on from it without probing and took
    the first absent generation, long collected, for the next one."""
    path = str(tmp_path / "s")
    a, b = _two_writers(path)
    acked = {}
    _commit(a, acked, 1, [0])
    t0 = committer_module.time.monotonic()
    frozen = types.SimpleNamespace(monotonic=lambda: t0, perf_counter=time.perf_counter, time=time.time,
                                   sleep=time.sleep)
    _b_commits_and_collects(b, acked, 0)
    monkeypatch.setattr(committer_module, "time", frozen)  # writer 1's host "was suspended" meanwhile
    if hasattr(committer_module, "boot_clock"):
        monkeypatch.setattr(committer_module, "boot_clock", lambda: t0)
    _commit(a, acked, 1, [1])
    monkeypatch.undo()
    a.close(), b.close()
    _exactly_once(path, acked)


# --------------------------------------------------------------------------- abandoned and delayed commits


def test_an_abandoned_commit_never_deletes_another_writers_segment(tmp_path, monkeypatch):
    """Writer 1 wrote its segment X and stopped past retain_seconds; writer 2's clean-up found X old
    and unnamed; a new writer 3 reserved X again and committed; writer 1 resumed, lost its race, found
    its commit too old and removed "its" files: writer 3's segment (readers: FileNotFoundError). Now a
    stopped writer's files are leased (the clean-up leaves them), and a failed commit removes only
    files that are still its own."""
    path = str(tmp_path / "s")
    a, b = _two_writers(path)
    acked = {}
    _commit(a, acked, 1, [0])
    real = LocalStorage.link_new
    ran = []

    def link_new(self, src, rel):
        if self is a._committer.storage and rel.startswith(fmt.MANIFEST_DIR + "/") and not ran:
            ran.append(1)
            old = time.time() - 3600  # writer 1 "stopped for an hour": its files look that old
            for d in (fmt.SEGMENT_DIR, fmt.GROUPS_DIR):
                for name in os.listdir(os.path.join(path, d)):
                    os.utime(os.path.join(path, d, name), (old, old))
            b._committer.collect(full=True)
            with ReplayStore(path) as c:
                _commit(c, acked, 3, [0])  # takes generation 2: writer 1's link loses
            time.sleep(RETAIN / 2 + 0.2)  # and writer 1's commit is now older than half of retain_seconds
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", link_new)
    try:
        _commit(a, acked, 1, [1])
    except CommitTimeoutError:
        pass  # abandoned, nothing committed: allowed, as long as it removed nothing of anyone else's
    monkeypatch.undo()
    assert ran
    _commit(b, acked, 2, [0])
    a.close(), b.close()
    _exactly_once(path, acked)


def test_a_clean_up_never_removes_a_file_a_live_writer_leases(tmp_path):
    path = str(tmp_path / "s")
    a, b = _two_writers(path)
    a.extend(batch_for(1, 0))
    storage = a._committer.storage
    sid, rel = storage.reserve(fmt.segment_file, 1000)
    storage.write_files([(rel, b"in flight", None)])
    old = time.time() - 3600
    os.utime(os.path.join(path, rel), (old, old))
    b._committer.collect(full=True)
    assert os.path.exists(os.path.join(path, rel)), "a leased file was collected"
    storage.release_leases()  # its commit gave up: from now on it is an orphan like any other
    b._committer.collect(full=True)
    assert not os.path.exists(os.path.join(path, rel))
    a.close(), b.close()


def test_a_clean_ups_hold_on_a_file_a_writer_opens_does_not_end_its_leases(tmp_path):
    """A clean-up held a group sidecar left under the name of a segment id a writer had just
    reserved (an abandoned commit's file) while the writer opened it: the writer took the held
    lock for a filesystem without ``flock`` and wrote every later file unleased, so a clean-up
    whose clock ran ahead removed a segment of a commit in flight, and the manifest named a
    missing file. The writer now waits for the hold to end, fails the commit if it lasts, and
    keeps leasing its files."""
    path = str(tmp_path / "s")
    a, b = _two_writers(path)
    a.extend(batch_for(1, 0))
    mine, theirs = a._committer.storage, b._committer.storage
    sid, rel = mine.reserve(fmt.segment_file, 1000)
    sidecar = fmt.groups_file(sid)
    os.makedirs(os.path.dirname(os.path.join(path, sidecar)), exist_ok=True)
    with open(os.path.join(path, sidecar), "wb") as f:
        f.write(b"an abandoned commit's sidecar")
    held = theirs.hold([sidecar])
    assert list(held) == [sidecar]
    files = [(rel, b"in flight", None), (sidecar, b"its groups", None)]
    with pytest.raises(StoreIOError, match="clean-up kept"):
        mine.write_files(files)
    theirs.unhold(held)
    mine.write_files(files)
    old = time.time() - 3600  # a clean-up whose clock runs an hour ahead finds them old
    for r in (rel, sidecar):
        os.utime(os.path.join(path, r), (old, old))
    b._committer.collect(full=True)
    assert os.path.exists(os.path.join(path, rel)) and os.path.exists(os.path.join(path, sidecar))
    _, later = mine.reserve(fmt.segment_file, 2000)
    assert theirs.hold([later]) == {}, "a file the writer created later is not leased"
    # a hold that ends with the file removed: the writer's data goes to a new file under the name,
    # not to the removed one
    sid, rel = mine.reserve(fmt.segment_file, 3000)
    sidecar = fmt.groups_file(sid)
    with open(os.path.join(path, sidecar), "wb") as f:
        f.write(b"another abandoned commit's sidecar")
    held = theirs.hold([sidecar])

    def clean_up():
        time.sleep(0.05)
        theirs.remove_held(sidecar, held[sidecar])
        theirs.unhold(held)

    gone = threading.Thread(target=clean_up)
    gone.start()
    mine.write_files([(rel, b"in flight", None), (sidecar, b"its groups", None)])
    gone.join()
    with open(os.path.join(path, sidecar), "rb") as f:
        assert f.read() == b"its groups"
    mine.release_leases()
    a.close(), b.close()


def test_a_publish_the_server_carries_out_late_is_in_doubt_and_keeps_its_files(tmp_path, monkeypatch):
    """The link answered ETIMEDOUT and landed 0.3 s later (an NFS server that was slow): reading it back
    at once found nothing, the commit was taken for one that never happened and its files were
    removed, so the generation that appeared named deleted segments."""
    path = str(tmp_path / "s")
    a, b = _two_writers(path)
    acked = {}
    _commit(a, acked, 1, [0])
    real = LocalStorage.link_new
    late = []

    def link_new(self, src, rel):
        if self is a._committer.storage and rel.startswith(fmt.MANIFEST_DIR + "/") and not late:
            side = os.path.join(path, fmt.MANIFEST_DIR, ".tmp-late-link")
            if getattr(src, "named", True):
                os.link(self.local_path(src.rel if hasattr(src, "rel") else src), side)
            else:
                os.link(f"/proc/self/fd/{src.fd}", side, dst_dir_fd=self._dir_fd(fmt.MANIFEST_DIR))

            def land():
                time.sleep(0.3)
                os.link(side, self.local_path(rel))
                os.unlink(side)

            late.append(threading.Thread(target=land))
            late[0].start()
            raise OSError(errno.ETIMEDOUT, "Connection timed out", self.local_path(rel))
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", link_new)
    with pytest.raises(StoreIOError, match="not known"):
        a.extend(batch_for(1, 1), token=token_for(1, 1))
    monkeypatch.undo()
    late[0].join()
    # it did land: its files were kept, and the retry with its token finds it
    acked[(1, 1)] = a.extend(batch_for(1, 1), token=token_for(1, 1))
    with ReplayStore(path, readonly=True) as reader:
        assert check_rows(reader, reader.row_ids()) is None
    _commit(b, acked, 2, [0])
    a.close(), b.close()
    _exactly_once(path, acked)


def test_a_temporary_name_left_linked_to_a_manifest_is_never_rewritten(tmp_path, monkeypatch):
    """Without O_TMPFILE (NFS) a manifest is written under a temporary name and linked; when removing
    that name failed, it stayed a second name of the committed manifest, and the next commit opened
    it with O_TRUNC and wrote its own delta into the committed generation."""
    path = str(tmp_path / "s")
    a, b = _two_writers(path)
    acked = {}
    storage = a._committer.storage
    storage._tmpfile = False
    from diskreplay.storage import local as storage_module
    real = storage_module.remove_quietly

    def remove_quietly(p):
        if os.path.basename(p).startswith(".tmp-") and os.path.dirname(p).endswith(fmt.MANIFEST_DIR):
            raise OSError(errno.EIO, "Input/output error", p)
        return real(p)

    monkeypatch.setattr(storage_module, "remove_quietly", remove_quietly)
    _commit(a, acked, 1, [0])
    committed = {g: open(os.path.join(path, fmt.manifest_file(g)), "rb").read()
                 for g in fmt.list_generations(path)}
    _commit(a, acked, 1, [1, 2])
    monkeypatch.undo()
    for g, raw in committed.items():
        assert open(os.path.join(path, fmt.manifest_file(g)), "rb").read() == raw, f"generation {g} was rewritten"
    _commit(b, acked, 2, [0])
    a.close(), b.close()
    _exactly_once(path, acked)


# --------------------------------------------------------------------------- tokens across late columns


def test_a_token_retry_after_another_writer_added_a_late_column_returns_its_rows(tmp_path):
    path = str(tmp_path / "s")
    a, b = _two_writers(path)
    first = a.extend(batch_for(1, 0), token=token_for(1, 0))
    late = {**batch_for(2, 0), "score": np.arange(len(batch_for(2, 0)["tag"]), dtype=np.float32)}
    b.extend(late, token=token_for(2, 0))
    again = a.extend(batch_for(1, 0), token=token_for(1, 0))
    assert again.tolist() == first.tolist()
    with pytest.raises(ValueError, match="committed already") as info:
        a.extend(batch_for(1, 1), token=token_for(1, 0))  # another batch under that token
    assert "use a new token" not in str(info.value)
    a.close(), b.close()


# --------------------------------------------------------------------------- object storage


def _s3(url, server, tmp_path, **kwargs):
    return ReplayStore(url, storage_options=server.storage_options, cache_dir=str(tmp_path / "cache"), **kwargs)


def test_an_empty_listing_at_open_is_not_taken_for_an_empty_store(s3_server, s3_url, tmp_path, monkeypatch):
    """A listing of manifests/ that lagged (or came back empty) made the open take the store for an
    empty one: its sweep moved every data file into quarantine/ and its first commit created the
    long-collected generation 1 again (a fork)."""
    acked = {}
    with _s3(s3_url, s3_server, tmp_path, multi_writer=True, retain_seconds=RETAIN) as w:
        _commit(w, acked, 1, range(4))
        time.sleep(RETAIN + 0.3)
        _commit(w, acked, 1, range(4, 10))
        w._committer.collect(full=True)
        newest = w.generation
    from diskreplay.storage import S3Storage
    real = S3Storage.list
    monkeypatch.setattr(S3Storage, "list", lambda self, reldir: [] if reldir == fmt.MANIFEST_DIR else
                        real(self, reldir))
    with _s3(s3_url, s3_server, tmp_path / "2") as w:
        assert w.generation == newest
        _commit(w, acked, 2, [0])
        assert w.generation == newest + 1
    monkeypatch.undo()
    with _s3(s3_url, s3_server, tmp_path / "3", readonly=True) as r:
        assert r.generation == newest + 1 and not r.storage.list(fmt.QUARANTINE_DIR)
        assert check_rows(r, r.row_ids()) is None
        assert sorted(r.read(r.row_ids(), ["tag"])["tag"]) == sorted(
            t for (w_, s) in acked for t in batch_for(w_, s)["tag"])


def test_repair_on_object_storage_leaves_a_commit_in_flight_alone(s3_server, s3_url, tmp_path, monkeypatch):
    """Repair judged a live writer by the age of the newest manifest only, and moved unreferenced objects
    without the sweeps' age rule: the segments of a commit in flight went to quarantine/."""
    from diskreplay.verify import repair as verify_module
    with _s3(s3_url, s3_server, tmp_path, multi_writer=True) as w:
        w.extend(batch_for(1, 0))
        next_id = w.manifest.next_segment
    time.sleep(3.2)
    # the newest manifest is "old"; the file put next stays young for 3 s even on a loaded machine
    monkeypatch.setattr(verify_module, "LIVE_SECONDS", 3.0)
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    in_flight = f"{prefix}/{fmt.segment_file(next_id + 5)}"
    s3_server.client().put_object(Bucket=bucket, Key=in_flight, Body=b"a segment of a commit in flight")
    opts = {"storage_options": s3_server.storage_options}
    with pytest.raises(StoreLockedError, match="written"):
        repair_store(s3_url, **opts)
    monkeypatch.setattr(verify_module, "LIVE_SECONDS", 0)
    report = repair_store(s3_url, **opts)
    assert any("kept 1 unreferenced" in a for a in report["actions"]), report["actions"]
    s3_server.client().head_object(Bucket=bucket, Key=in_flight)  # still there


def test_a_conditional_write_conflict_409_is_retried(s3_server, s3_url, tmp_path):
    """obstore reports 409 ConditionalRequestConflict (another conditional write of the key was in
    progress) as "already exists": three in a row ended the commit with CorruptStoreError."""
    with _s3(s3_url, s3_server, tmp_path, multi_writer=True) as w:
        storage = w.storage
        real = storage._ob
        exc = storage._exc.AlreadyExistsError(
            "Error performing PUT: Server returned non-2xx status code: 409 Conflict: "
            "<Error><Code>ConditionalRequestConflict</Code></Error>")
        left = [3]

        def put(store, rel, data, **kwargs):
            if kwargs.get("mode") == "create" and rel.startswith(fmt.MANIFEST_DIR) and left[0]:
                left[0] -= 1
                raise exc
            return real.put(store, rel, data, **kwargs)

        storage._ob = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("_")})
        storage._ob.put = put
        rows = w.extend(batch_for(1, 0), token=token_for(1, 0))
        storage._ob = real
        assert left[0] == 0 and rows.tolist() == list(range(len(rows)))


# --------------------------------------------------------------------------- stopped writers, a jumped clock



@pytest.mark.slow
def test_writers_stopped_past_retention_and_a_jumped_clock_every_acknowledged_batch_exactly_once(tmp_path):
    """4 writer processes on a store retaining 2 s: writers are stopped (SIGSTOP) for longer than the
    retention at random moments, some killed, and one writer's wall clock runs an hour ahead (its
    clean-up takes every generation and file it may); one writer sends no tokens (it is stopped, never
    killed: a killed one's last batch could not be told), and none of its extends may fail; every
    acknowledged batch is there exactly once.
    Counted, not timed: the run ends once enough stops and kills landed."""
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True, retain_seconds=RETAIN).close()
    acked = run_campaign(path, str(tmp_path / "stop"), seed=11, stops=6, kills=6, retain=RETAIN)
    assert len(acked) >= 40, len(acked)
    _exactly_once(path, acked)
