"""The commit path: the writer's open, garbage collection and its ordering, errors after the commit point."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest

from diskreplay import ReplayStore
from diskreplay import format as fmt

from .test_durability import check_live_rows, expected_rows


def _batch(store, n=4):
    return expected_rows(np.arange(store.next_row, store.next_row + n))


# --------------------------------------------------------------------------- the writer lock (issue 12.1)


@pytest.mark.parametrize("call", ["ftruncate", "write"])
def test_lock_is_released_when_writing_the_pid_fails(tmp_path, monkeypatch, call):
    path = str(tmp_path / "store")
    ReplayStore(path).close()
    real = getattr(os, call)
    lock = os.path.join(path, fmt.LOCK_FILE)

    def failing(fd, *args):
        if os.readlink(f"/proc/self/fd/{fd}") == lock:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, *args)

    monkeypatch.setattr(os, call, failing)
    with pytest.raises(OSError, match="LOCK") as info:
        ReplayStore(path)
    assert info.value.errno == errno.EIO and info.value.filename == lock
    monkeypatch.undo()
    with ReplayStore(path) as store:  # the failed open left no flock behind in this process
        store.extend(_batch(store))


# --------------------------------------------------------------------------- unreadable manifests (issue 12.2)


def test_an_unreadable_manifest_and_its_files_are_not_collected(tmp_path, monkeypatch):
    path = str(tmp_path / "store")
    with ReplayStore(path, capacity=4) as store:
        for _ in range(6):  # each append evicts the previous segment
            store.extend(_batch(store))
        retained = fmt.list_generations(path)
        oldest = fmt.load_manifest(os.path.join(path, fmt.manifest_file(retained[-1])))
    only_its = [f for f in oldest.files() if all(
        f not in fmt.load_manifest(os.path.join(path, fmt.manifest_file(g))).files() for g in retained[:-1])]
    assert only_its
    import diskreplay.storage.local as local

    real = local.read_file
    target = os.path.join(path, oldest.file)

    def eio(p, *args):
        if p == target:
            raise OSError(errno.EIO, "Input/output error", p)
        return real(p, *args)

    monkeypatch.setattr(local, "read_file", eio)
    with pytest.warns(RuntimeWarning, match="cannot read manifest"):
        ReplayStore(path).close()
    monkeypatch.undo()
    assert os.path.exists(target)
    for f in only_its:
        assert os.path.exists(os.path.join(path, f)), f
    with ReplayStore(path) as store:  # once it reads again, normal clean-up resumes
        check_live_rows(store, 4)


# --------------------------------------------------------------------------- ordered, durable deletions (issue 12.3)


class _Trace:
    """Unlinks and fsyncs of a store, in order, by path relative to the store."""

    def __init__(self, root, monkeypatch):
        self.root, self.events = root, []
        real_unlink, real_fsync = os.unlink, os.fsync

        def unlink(p, *a, **k):
            real_unlink(p, *a, **k)
            self.events.append(("unlink", os.path.relpath(os.path.abspath(p), root)))

        def fsync(fd):
            real_fsync(fd)
            self.events.append(("fsync", os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), root)))

        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(os, "fsync", fsync)


def _naming(root):
    """data file -> manifests naming it, for every manifest on disk."""
    out = {}
    for g in fmt.list_generations(root):
        m = fmt.load_manifest(os.path.join(root, fmt.manifest_file(g)))
        for f in m.files():
            out.setdefault(f, set()).add(m.file)
    return out


def _check_power_cut_safe(trace, naming):
    """At every unlink of a data file, each manifest naming it is already unlinked *and* that unlink
    made durable by an fsync of manifests/; every unlink is made durable before the call returns."""
    gone_durably, gone = set(), set()
    pending = {}
    for kind, rel in trace.events:
        if kind == "unlink":
            if rel.startswith(fmt.MANIFEST_DIR + "/"):
                gone.add(rel)
            else:
                assert naming.get(rel, set()) <= gone_durably, \
                    f"{rel} unlinked while {naming[rel] - gone_durably} may come back after a power cut"
            pending.setdefault(os.path.dirname(rel), set()).add(rel)
        else:
            pending.pop(rel, None)
            if rel == fmt.MANIFEST_DIR:
                gone_durably |= gone
    assert not pending, f"unlinks never made durable: {pending}"


def test_deletions_are_ordered_and_durable(tmp_path, monkeypatch):
    path = str(tmp_path / "store")
    store = ReplayStore(path, capacity=4)
    for _ in range(fmt.KEEP_MANIFESTS + 1):
        store.extend(_batch(store))
    for _ in range(3):  # incremental clean-up after each commit
        naming = _naming(path)
        with monkeypatch.context() as mp:
            trace = _Trace(path, mp)
            store.extend(_batch(store))
        assert any(k == "unlink" and not r.startswith("manifests") for k, r in trace.events)
        _check_power_cut_safe(trace, naming)
    store.close()
    # the open's full sweep, with a stale manifest and an unreferenced segment left by "a crash"
    with open(os.path.join(path, fmt.manifest_file(1)), "wb") as f:
        f.write(fmt.signed_bytes(fmt.Manifest(generation=1, next_segment=1).body()))
    with open(os.path.join(path, fmt.segment_file(10 ** 9)), "wb") as f:
        f.write(b"garbage")
    naming = _naming(path)
    with monkeypatch.context() as mp:
        trace = _Trace(path, mp)
        ReplayStore(path).close()
    assert ("unlink", fmt.segment_file(10 ** 9)) in trace.events
    _check_power_cut_safe(trace, naming)


# --------------------------------------------------------------------------- exactly-once tokens (issue 9.2)


@pytest.fixture(params=[False, True], ids=["single", "multi"])
def multi(request):
    return request.param


def test_token_must_be_a_non_empty_str(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        for bad in (5, "", b"x", ["a"]):
            with pytest.raises(TypeError, match="token"):
                store.extend(_batch(store), token=bad)
        assert store.generation == 0


def test_a_committed_token_returns_its_rows_and_writes_nothing(tmp_path, multi):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=multi) as store:
        first = store.extend(expected_rows(np.arange(0, 4)), token="w0:0")
        store.extend(expected_rows(np.arange(4, 8)), token="w0:1")
        gen, files = store.generation, sorted(os.listdir(os.path.join(path, fmt.SEGMENT_DIR)))
        again = store.extend(expected_rows(np.arange(0, 4)), token="w0:0")
        assert again.tolist() == first.tolist() == [0, 1, 2, 3]
        assert store.generation == gen and sorted(os.listdir(os.path.join(path, fmt.SEGMENT_DIR))) == files
    with ReplayStore(path) as store:  # across a restart
        assert store.extend(expected_rows(np.arange(4, 8)), token="w0:1").tolist() == [4, 5, 6, 7]
        assert len(store) == 8
        check_live_rows(store)


def test_a_read_only_store_looks_tokens_up(tmp_path, monkeypatch, multi):
    """Auditing tokens needed a writer: committed_rows on a readonly=True store raised ReadOnlyError
    ("open it without readonly=True to write"). It is a lookup: it answers from the generation the
    reader sees (inline records and sealed logs alike), writes nothing, and refresh() shows newer ones."""
    from diskreplay.store import tokens as tok

    def files():
        return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)

    monkeypatch.setattr(tok, "INLINE_TOKENS", 2)  # most records are sealed into token logs
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=multi) as writer:
        for i in range(6):
            writer.extend(expected_rows(np.arange(4 * i, 4 * i + 4)), token=f"w0:{i}")
            if i == 0:
                pinned = writer.snapshot()
        assert writer.manifest.token_logs or multi  # (many writers' appends are deltas until a checkpoint)
        before = files()
        with ReplayStore(path, readonly=True) as reader:
            assert reader.committed_rows("w0:0").tolist() == [0, 1, 2, 3]
            assert reader.committed_rows("w0:5").tolist() == [20, 21, 22, 23]
            assert reader.committed_rows("w0:6") is None
            with pytest.raises(ValueError, match="token must be"):
                reader.committed_rows("")
            assert files() == before
            writer.extend(expected_rows(np.arange(24, 28)), token="w0:6")
            assert reader.committed_rows("w0:6") is None  # the generation it reads
            reader.refresh()
            assert reader.committed_rows("w0:6").tolist() == [24, 25, 26, 27]
            with pinned:  # a snapshot answers for its own generation
                assert pinned.committed_rows("w0:0").tolist() == [0, 1, 2, 3]
                assert pinned.committed_rows("w0:1") is None


def test_a_token_reused_for_another_batch_is_refused(tmp_path, multi):
    with ReplayStore(tmp_path / "s", multi_writer=multi) as store:
        store.extend(expected_rows(np.arange(0, 4)), token="step-7")
        with pytest.raises(ValueError, match="step-7"):
            store.extend(expected_rows(np.arange(0, 5)), token="step-7")  # another row count
        other = expected_rows(np.arange(0, 4))
        other["rewards"] = other["rewards"] + 1  # same rows, other content
        with pytest.raises(ValueError, match="step-7"):
            store.extend(other, token="step-7")
        assert len(store) == 4


def test_tokens_survive_sealing_merging_and_are_forgotten_only_when_allowed(tmp_path, monkeypatch):
    from diskreplay.store import tokens as tok

    monkeypatch.setattr(tok, "INLINE_TOKENS", 4)
    monkeypatch.setattr(tok, "MAX_TOKEN_LOGS", 3)
    monkeypatch.setattr(tok, "RETAIN_TOKEN_COMMITS", 30)
    path = str(tmp_path / "s")
    with ReplayStore(path, capacity=40) as store:
        for i in range(60):
            store.extend(expected_rows([i]), token=f"t{i}")
        m = store.manifest
        assert len(m.tokens) <= 4 and 1 <= len(m.token_logs) <= 3
    assert verify_ok(path)
    with ReplayStore(path, capacity=40) as store:
        # live rows (20..59) and the newest 30 commits: found without appending
        for i in (20, 35, 59):
            assert store.extend(expected_rows([i]), token=f"t{i}").tolist() == [i]
        assert store.next_row == 60
        # evicted and older than 30 commits: forgotten, so the batch is new again
        assert store.extend(expected_rows([60]), token="t0").tolist() == [60]


def test_one_writer_finds_every_token_while_its_logs_seal_and_merge(tmp_path, monkeypatch):
    """The merged lookup of a writer that stays open follows its logs as they are sealed, merged
    and dropped: it answers as a scan of the manifest's records and logs does, newest first, and
    against the manifest before a commit it finds none of the newer logs' tokens."""
    from diskreplay.store import tokens as tok

    monkeypatch.setattr(tok, "INLINE_TOKENS", 3)
    monkeypatch.setattr(tok, "MAX_TOKEN_LOGS", 2)
    monkeypatch.setattr(tok, "RETAIN_TOKEN_COMMITS", 25)

    def scan(index, m, token):
        records = list(m.tokens[::-1]) + [r for e in m.token_logs[::-1] for r in index.records(e)]
        return next((r for r in records if r.token == token), None)

    with ReplayStore(str(tmp_path / "s"), capacity=20) as store:
        index = store._committer.tokens
        before, committed_at = store.manifest, []
        for i in range(70):
            store.extend(expected_rows([i]), token=f"t{i}")
            m = store.manifest
            committed_at.append(index.find(m, f"t{i}").generation)
            for j in range(i + 1):
                rec = index.find(m, f"t{j}")
                assert rec == scan(index, m, f"t{j}"), (i, j)
                if committed_at[j] > m.generation - 25 or j >= m.head:  # among the newest 25 commits, or live
                    assert rec is not None and rec.first_row == j, (i, j)
            assert index.find(before, f"t{i}") is None
            if i:
                assert index.find(before, f"t{i - 1}").first_row == i - 1
            before = m
        assert len(store.manifest.token_logs) >= 1


def test_a_token_log_that_does_not_read_leaves_no_lookup_answering_for_it(tmp_path, monkeypatch):
    """Found in review: a lookup whose newer logs failed to read half-way left the records of the
    ones read in the merged lookup, which an older manifest's lookup then found."""
    from diskreplay.store import tokens as tok

    monkeypatch.setattr(tok, "INLINE_TOKENS", 2)
    with ReplayStore(str(tmp_path / "s")) as store:
        index, manifests = store._committer.tokens, []
        for i in range(12):
            store.extend(expected_rows([i]), token=f"t{i}")
            manifests.append(store.manifest)
        older = next(m for m in manifests if len(m.token_logs) == 1)
        newer = next(m for m in manifests if len(m.token_logs) >= 3 and m.token_logs[:1] == older.token_logs)
        in_second = index.records(newer.token_logs[1])[0].token  # committed after `older`
        index._merged_for, index._merged = (), {}
        index.find(older, "nothing")  # holds the older manifest's records
        real, failing = index._log, newer.token_logs[2]
        monkeypatch.setattr(index, "_log", lambda e: (_ for _ in ()).throw(OSError(5, "EIO")) if e == failing
                            else real(e))
        with pytest.raises(OSError):
            index.find(newer, "zzz")  # reads the second log, fails on the third
        monkeypatch.setattr(index, "_log", real)
        assert index.find(older, in_second) is None
        assert index.find(newer, in_second) is not None


def verify_ok(path):
    from diskreplay.verify import verify_store

    report = verify_store(path)
    assert report["ok"], report["problems"]
    return True


def test_token_manifest_growth(tmp_path):
    """Tokens on every commit add a bounded number of bytes to each manifest (printed with -s)."""
    from diskreplay.store import tokens as tok

    path = str(tmp_path / "s")
    extra = []
    with ReplayStore(path, group_key=None) as store:
        for i in range(tok.INLINE_TOKENS + 20):
            store.extend({"x": [i]}, token=f"worker-{i % 8}:step-{i}")
            m = store.manifest
            size = os.path.getsize(os.path.join(path, m.file))
            extra.append(size - len(fmt.signed_bytes(m.evolve(tokens=(), token_logs=()).body())))
        assert store.manifest.token_logs  # sealed once the inline records filled up
    print(f"token bytes per manifest: max {max(extra)}, after sealing {extra[-1]}")
    assert max(extra) < 60 * tok.INLINE_TOKENS and extra[-1] < 60 * 21 + 200


# --------------------------------------------------------------------------- errors after the commit point (issue 9.2, 12.4)


def _fail_fsync_of(monkeypatch, directory, times=1):
    real = os.fsync
    left = [times]

    def fsync(fd):
        if left[0] and os.readlink(f"/proc/self/fd/{fd}") == directory:
            left[0] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return left


def test_error_after_the_commit_point_is_commit_not_durable(tmp_path, monkeypatch, multi):
    from diskreplay import CommitNotDurableError

    path = str(tmp_path / "s")
    store = ReplayStore(path, multi_writer=multi)
    store.extend(expected_rows(np.arange(0, 4)), token="b0")
    gen = store.generation
    left = _fail_fsync_of(monkeypatch, os.path.join(path, fmt.MANIFEST_DIR))
    with pytest.raises(CommitNotDurableError) as info:
        store.extend(expected_rows(np.arange(4, 8)), token="b1")
    assert left == [0] and isinstance(info.value, OSError) and info.value.errno == errno.EIO
    assert info.value.rows.tolist() == [4, 5, 6, 7]
    assert store.generation == gen + 1
    with ReplayStore(path, readonly=True) as reader:  # visible to everyone
        assert reader.next_row == 8
        check_live_rows(reader)
    # the natural retry, with the same token: same rows, nothing appended
    assert store.extend(expected_rows(np.arange(4, 8)), token="b1").tolist() == [4, 5, 6, 7]
    assert store.next_row == 8 and store.generation == gen + 1
    store.close()  # durability owed is made good here (or by the next commit)
    with ReplayStore(path) as again:
        assert again.extend(expected_rows(np.arange(4, 8)), token="b1").tolist() == [4, 5, 6, 7]
        check_live_rows(again)
        assert again.next_row == 8


def test_durability_owed_is_retried_by_the_next_commit(tmp_path, monkeypatch):
    from diskreplay import CommitNotDurableError

    path = str(tmp_path / "s")
    store = ReplayStore(path)
    left = _fail_fsync_of(monkeypatch, os.path.join(path, fmt.MANIFEST_DIR))
    with pytest.raises(CommitNotDurableError):
        store.extend(expected_rows(np.arange(0, 4)))
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    store.extend(expected_rows(np.arange(4, 8)))
    # the owed fsync of manifests/ comes before the new commit's manifest is even written
    mdir = os.path.join(path, fmt.MANIFEST_DIR)
    first_manifest_write = min(i for i, p in enumerate(synced) if p.startswith(mdir + "/"))
    assert mdir in synced[:first_manifest_write] and left == [0]
    store.close()


def test_a_commit_stops_at_a_newer_manifest_that_cannot_be_read(tmp_path):
    """Many writers: the next generation exists but is damaged. Every create of it loses, and the
    newest readable commit never passes it: the commit names the file instead of retrying for hours."""
    from diskreplay import CorruptStoreError
    from diskreplay.testing.workload import batch_for

    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True) as store:
        store.extend(batch_for(0, 0))
        damaged = os.path.join(path, fmt.manifest_file(store.generation + 1))
        with open(damaged, "w") as f:
            f.write("{not json")
        t = time.monotonic()
        with pytest.raises(CorruptStoreError, match=r"cannot be read as a manifest.*diskreplay repair"):
            store.extend(batch_for(0, 1))
        assert time.monotonic() - t < 30
        assert len(store) == len(batch_for(0, 0)["tag"])


# --------------------------------------------------------------------------- fsync=False


@pytest.mark.parametrize("multi,named_temps", [(False, False), (True, False), (True, True)])
def test_a_writer_without_fsync_commits_everything_and_never_fsyncs(tmp_path, monkeypatch, multi, named_temps):
    """``fsync=False``: appends (with tokens, sealed into logs), merges, saved states, compact
    and clean-up make no fsync call (``compact`` writes FORMAT.json durably, as creating a store
    does), and another process's view (a fresh reader) has every row; also where manifests-to-be
    are named files (no ``O_TMPFILE``: NFS), which are closed before they are linked."""
    from diskreplay.storage.local import LocalStorage

    if named_temps:
        monkeypatch.setattr(LocalStorage, "_probe_tmpfile", lambda self, reldir: False)
    path = str(tmp_path / "store")
    ReplayStore(path, capacity=300, multi_writer=multi).close()  # creating a store fsyncs (once)
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    with ReplayStore(path, fsync=False) as store:
        assert store.fsync is False
        for i in range(60):
            store.extend(_batch(store, 1 + i % 5), token=f"t{i}")
            if i % 20 == 7:
                store.save_state("sampler", {"step": np.array([i])})
        store.compact()
        end = store.next_row
    assert [c for c in calls if not c.endswith(".tmp-FORMAT.json." + str(os.getpid())) and not c == path] == []
    monkeypatch.setattr(os, "fsync", real)
    with ReplayStore(path, readonly=True) as ro:
        assert ro.next_row == end
        check_live_rows(ro, 300)
        assert int(ro.load_state("sampler")["step"][0]) == 47
    with ReplayStore(path) as store:  # the default fsyncs again
        monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real(fd))
        store.extend(_batch(store))
    assert calls


def test_fsync_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="fsync must be True or False"):
        ReplayStore(str(tmp_path / "s"), fsync="no")
    assert not os.path.exists(tmp_path / "s")


# --------------------------------------------------------------------------- names reserved ahead


def _segment_names(path):
    return {f"{fmt.SEGMENT_DIR}/{n}" for n in os.listdir(os.path.join(path, fmt.SEGMENT_DIR))}


def _named(path):
    with ReplayStore(path, readonly=True) as ro:
        return {s.file for s in ro.manifest.segments}


def test_many_writers_fsync_segments_once_per_names_reserved_ahead(tmp_path, monkeypatch):
    """A writer of a multi-writer store reserves ``RESERVE_AHEAD`` segment names at once and makes
    them durable with one fsync of ``segments/``; its small commits then fsync no directory but
    ``manifests/``. ``close`` removes the names it did not use (durably), and every row reads."""
    from diskreplay.store.writing import RESERVE_AHEAD

    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True).close()
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    commits = 2 * RESERVE_AHEAD + 3
    with ReplayStore(path) as store:
        for _ in range(commits):
            store.extend(_batch(store))
        merges = store.stats()["commits"] - commits
        ahead = {rel for _, rel, _ in store._committer.storage._fds.ahead}
        assert len(ahead) == RESERVE_AHEAD - (commits + merges) % RESERVE_AHEAD
        assert ahead <= _segment_names(path) and not ahead & _named(path)
        synced_before_close = len(synced)
    segments_dir = os.path.join(path, fmt.SEGMENT_DIR)
    batches = -(-(commits + merges) // RESERVE_AHEAD)
    assert synced[:synced_before_close].count(segments_dir) == batches
    assert synced[synced_before_close:].count(segments_dir) == 1  # the removals at close
    assert synced.count(os.path.join(path, fmt.MANIFEST_DIR)) >= commits
    assert not ahead & _segment_names(path)  # removed: nothing of them left behind
    monkeypatch.setattr(os, "fsync", real)
    with ReplayStore(path, readonly=True) as ro:
        check_live_rows(ro)
        assert ro.next_row == 4 * commits


def test_a_name_reserved_ahead_is_never_used_once_removed_or_old(tmp_path):
    """A name reserved ahead that was removed meanwhile (a clean-up misled by a clock that jumped),
    or removed and made again by another writer, is skipped, never written, and never removed;
    names older than a quarter of ``retain_seconds`` (by this process's clock, or by their mtimes,
    which clean-up judges: a suspended host) are given up, removed only while surely still this
    writer's (younger than half of it), and fresh ones reserved."""
    from diskreplay.verify import verify_store

    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, retain_seconds=400) as store:
        fds = store._committer.storage._fds
        store.extend(_batch(store))
        gone = fds.ahead[0][1]
        os.remove(os.path.join(path, gone))
        store.extend(_batch(store))
        assert gone not in _named(path) and not os.path.exists(os.path.join(path, gone))

        old = [rel for _, rel, _ in fds.ahead]
        fds.ahead_at -= 101  # older than max_age (100 s), younger than 200 s: removed
        store.extend(_batch(store))
        assert not any(os.path.exists(os.path.join(path, rel)) for rel in old)
        assert not set(old) & _named(path)

        older = [rel for _, rel, _ in fds.ahead]
        fds.ahead_at -= 201  # maybe another writer's by now: left to clean-up, unused
        store.extend(_batch(store))
        assert all(os.path.exists(os.path.join(path, rel)) for rel in older)
        assert not set(older) & _named(path)

        # a host suspended for longer than retain_seconds: this process's clock stood still, but the
        # names' mtimes are old to clean-up's (wall) clock, so they are given up and left alone
        suspended = [rel for _, rel, _ in fds.ahead]
        past = time.time() - 250
        for rel in suspended:
            os.utime(os.path.join(path, rel), (past, past))
        store.extend(_batch(store))
        assert all(os.path.exists(os.path.join(path, rel)) for rel in suspended)
        assert not set(suspended) & _named(path)

        # a name removed by a clean-up and made again by another writer: neither taken nor removed
        theirs = fds.ahead[0][1]
        os.remove(os.path.join(path, theirs))
        with open(os.path.join(path, theirs), "wb") as f:
            f.write(b"another writer's segment")
        store.extend(_batch(store))
        assert theirs not in _named(path)
        rows = store.next_row
        theirs_too = fds.ahead[0][1]  # the same, found by close()
        os.remove(os.path.join(path, theirs_too))
        with open(os.path.join(path, theirs_too), "wb") as f:
            f.write(b"another writer's segment")
    for rel in (theirs, theirs_too):  # close() removed its own names only
        with open(os.path.join(path, rel), "rb") as f:
            assert f.read() == b"another writer's segment"
        os.remove(os.path.join(path, rel))
    assert not {rel for rel in _segment_names(path) if os.path.getsize(os.path.join(path, rel)) == 0} - set(
        older + suspended)  # the rest of its names were removed at close
    report = verify_store(path)
    assert report["ok"], report["problems"]
    with ReplayStore(path, readonly=True) as ro:
        check_live_rows(ro)
        assert ro.next_row == rows == 24


def test_a_forked_child_never_takes_its_parent_s_names_reserved_ahead(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True) as store:
        store.extend(_batch(store))
        storage = store._committer.storage
        parents = {rel for _, rel, _ in storage._fds.ahead}
        assert parents
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: reserve one name the way a commit does, and report it
            try:
                _, rel = storage.reserve(fmt.segment_file, 0, ahead=4, max_age=60.0)
                os.write(write, rel.encode())
            finally:
                os._exit(0)
        os.close(write)
        taken = os.read(read, 200).decode()
        os.close(read)
        os.waitpid(pid, 0)
        assert taken and taken not in parents and os.path.exists(os.path.join(path, taken))
        assert {rel for _, rel, _ in storage._fds.ahead} == parents  # the parent's, untouched
        store.extend(_batch(store))
        check_live_rows(store)


def test_a_token_retry_after_commit_not_durable_returns_only_once_durable(tmp_path, monkeypatch, multi):
    """The retry with the token returned the rows at once, without the fsync of manifests/ that the
    failed attempt owed, even while that fsync kept failing: a return said durable when it was not
    (committed_rows, which a restarted producer asks before skipping a batch, likewise)."""
    from diskreplay import CommitNotDurableError

    path = str(tmp_path / "s")
    store = ReplayStore(path, multi_writer=multi)
    mdir = os.path.join(path, fmt.MANIFEST_DIR)
    left = _fail_fsync_of(monkeypatch, mdir, times=3)
    with pytest.raises(CommitNotDurableError):
        store.extend(expected_rows(np.arange(0, 4)), token="b0")
    with pytest.raises(CommitNotDurableError, match="failed again") as info:  # still failing: not durable
        store.extend(expected_rows(np.arange(0, 4)), token="b0")
    assert info.value.rows.tolist() == [0, 1, 2, 3]
    with pytest.raises(CommitNotDurableError, match="failed again"):
        store.committed_rows("b0")
    assert left == [0]
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    assert store.extend(expected_rows(np.arange(0, 4)), token="b0").tolist() == [0, 1, 2, 3]
    assert mdir in synced and store.next_row == 4
    store.close()


def test_a_single_writers_reopen_and_next_commit_keep_what_a_pinned_snapshot_reads(tmp_path):
    """The open kept every manifest superseded less than retain_seconds ago, but the first commit after
    it dropped them (it knew no time they were superseded): a snapshot's generation went with it."""
    path = str(tmp_path / "s")
    with ReplayStore(path, capacity=8, retain_seconds=60) as store:
        for i in range(2):
            store.extend(expected_rows(np.arange(2 * i, 2 * i + 2)))
        pinned = store.generation
        snap = store.snapshot()
        for i in range(2, 10):
            store.extend(expected_rows(np.arange(2 * i, 2 * i + 2)))  # evicts the snapshot's rows
    with ReplayStore(path) as store:
        store.extend(expected_rows(np.arange(20, 22)))
    with ReplayStore(path, readonly=True, generation=pinned) as old:
        check_live_rows(old)
    check_live_rows(snap)
    snap.close()


def test_a_single_writers_clean_up_does_not_rescan_every_retained_manifest(tmp_path, monkeypatch):
    """With retain_seconds, each commit built the file set of every retained manifest (and sorted them):
    at ~4,500 retained manifests a commit took ~300 ms. Now a commit touches only the manifests it adds
    and drops."""
    path = str(tmp_path / "s")
    calls = []
    real = fmt.Manifest.files
    with ReplayStore(path, capacity=64, retain_seconds=1, fsync=False) as store:
        i, t = 0, time.monotonic()
        while time.monotonic() - t < 1.5:  # past retain_seconds: each commit now drops the oldest
            store.extend(expected_rows(np.arange(i, i + 1)))
            i += 1
        retained = len(store._committer.retained)
        monkeypatch.setattr(fmt.Manifest, "files", lambda m: (calls.append(m.generation), real(m))[1])
        for j in range(i, i + 20):
            store.extend(expected_rows(np.arange(j, j + 1)))
        dropped = retained + 20 - len(store._committer.retained)
    # the manifests added and dropped, not every retained one at every commit (~20 x retained; a
    # loaded machine commits fewer in retain_seconds, and 20 x 11 still far exceeds the bound)
    assert retained > 10 and len(calls) <= 2 * (20 + dropped) + 10, (retained, dropped, len(calls))


def test_token_logs_are_merged_by_size_tier(tmp_path):
    """Every merge of token logs rewrote all records kept (up to 100,000, about every 1,000 commits) and
    every writer parsed them again; size-tiered, a record is rewritten about log16(records / 32) times."""
    from diskreplay.store import tokens as tokens_module

    path = str(tmp_path / "s")
    written = []
    with ReplayStore(path, fsync=False) as store:
        real = store._committer._write_token_log
        store._committer._write_token_log = lambda data, first: (written.append(len(data)), real(data, first))[1]
        n = 3000
        for i in range(n):
            store.extend({"prompt_id": [i], "completion_ids": [[i]]}, token=f"w:{i}")
        logs = store.manifest.token_logs
        assert len(logs) <= tokens_module.MAX_TOKEN_LOGS and sum(e.count for e in logs) + len(store.manifest.tokens) == n
        assert store.extend({"prompt_id": [0], "completion_ids": [[0]]}, token="w:0").tolist() == [0]  # oldest kept
        assert store.extend({"prompt_id": [7], "completion_ids": [[7]]}, token="w:7").tolist() == [7]
    assert written  # sealed and merged through the store's own path
    # the merge policy over a long run, by counts: 100,000 records sealed 32 at a time
    logs, rewritten = [], 0
    for _ in range(100_000 // 32):
        logs.append(fmt.TokenLog(0, 1, 0, 32, 1, 1))
        if len(logs) > tokens_module.MAX_TOKEN_LOGS:
            chosen = tokens_module._merge_tier(logs)
            count = sum(logs[i].count for i in chosen)
            rewritten += count
            logs = logs[:chosen[0]] + [fmt.TokenLog(0, 1, 0, count, 1, 1)] + \
                [e for i, e in enumerate(logs) if i > chosen[0] and i not in set(chosen)]
    assert len(logs) <= tokens_module.MAX_TOKEN_LOGS
    assert rewritten <= 4 * 100_000, rewritten  # merging all into one rewrote ~4.9 million records
