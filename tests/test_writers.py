"""Many writers on one store: options, rebases, conflicts, clean-up, snapshots, repair, and SIGKILLed processes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from diskreplay import ReplayStore, SchemaError, StoreLockedError, UnsupportedFilesystemError
from diskreplay import format as fmt
from diskreplay.storage import LocalStorage
from diskreplay.store import MergePolicy, convert_store
from diskreplay.store.merging import Merger
from diskreplay.testing.workload import batch_for, check_rows, token_for
from diskreplay.verify import repair_store, verify_store

from .conftest import race_before_publish

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ok(path):
    report = verify_store(path)
    assert report["ok"], report["problems"]
    return report


# --------------------------------------------------------------------------- options


def test_mode_mismatch_is_refused_and_changes_nothing(tmp_path):
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    ReplayStore(single).close()
    ReplayStore(multi, multi_writer=True).close()
    for path, flag, hint in ((single, True, "--multi-writer"), (multi, False, "--multi-writer=false")):
        before = open(os.path.join(path, fmt.FORMAT_FILE), "rb").read()
        with pytest.raises(SchemaError, match="multi_writer") as info:
            ReplayStore(path, multi_writer=flag)
        assert hint in str(info.value) and "compact(multi_writer=" in str(info.value)
        assert open(os.path.join(path, fmt.FORMAT_FILE), "rb").read() == before
    # a single-writer store's FORMAT.json is still exactly version 1, without the new keys
    doc = json.load(open(os.path.join(single, fmt.FORMAT_FILE)))
    assert doc["version"] == 1 and "multi_writer" not in doc and "retain_seconds" not in doc
    assert json.load(open(os.path.join(multi, fmt.FORMAT_FILE)))["version"] == fmt.INLINE_GROUPS_VERSION


def test_a_mode_mismatch_while_the_single_writer_is_open_names_the_mode_and_leaves_lock_alone(tmp_path):
    """Adding many-writer workers to a running single-writer job: the error says the store is
    single-writer and how to convert (not "open it read-only"), and the refused open takes no lock."""
    path = str(tmp_path / "s")
    with ReplayStore(path) as writer:
        writer.extend(batch_for(0, 0))
        lock = os.path.join(path, fmt.LOCK_FILE)
        before = (os.stat(lock).st_mtime_ns, open(lock).read())
        with pytest.raises(SchemaError, match="single-writer store.*--multi-writer"):
            ReplayStore(path, multi_writer=True)
        assert (os.stat(lock).st_mtime_ns, open(lock).read()) == before
        writer.extend(batch_for(0, 1))  # the writer's lock is intact


CONVERTING_WRITER = textwrap.dedent("""
    import sys
    from diskreplay import ReplayStore
    from diskreplay.testing.workload import batch_for, token_for
    with ReplayStore(sys.argv[1], multi_writer=True) as store:
        store.extend(batch_for(7, 0), token=token_for(7, 0))
        print("open", flush=True)
        sys.stdin.readline()  # stays open (a live writer) until told to go
        store.extend(batch_for(7, 1), token=token_for(7, 1))
    print("closed", flush=True)
""")


def test_converting_to_one_writer_is_refused_while_another_writer_is_open(tmp_path):
    """Writers of a multi-writer store hold LOCK shared; converting to one writer takes it exclusively.
    Under a live writer a conversion would let its commits and the converter's replace each other
    (a rename over a linked generation) and reuse the names it reserved ahead: refused, nothing changed."""
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True).close()
    other = subprocess.Popen([sys.executable, "-c", CONVERTING_WRITER, path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert other.stdout.readline().strip() == "open"
        with ReplayStore(path) as store:
            store.extend(batch_for(0, 0))
            before = open(os.path.join(path, fmt.FORMAT_FILE), "rb").read()
            with pytest.raises(StoreLockedError, match="other processes.*every other writer stopped"):
                store.compact(multi_writer=False)
            assert open(os.path.join(path, fmt.FORMAT_FILE), "rb").read() == before
            store.extend(batch_for(0, 1))  # still a writer of many, its lock kept
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "closed" and other.wait(60) == 0
    finally:
        other.kill()
    with ReplayStore(path) as store:  # every other writer stopped: converts
        store.compact(multi_writer=False)
        assert not store.multi_writer and check_rows(store, store.row_ids()) is None and len(store) == \
            sum(len(batch_for(w, i)["tag"]) for w, i in ((7, 0), (7, 1), (0, 0), (0, 1)))
        with pytest.raises(StoreLockedError):
            ReplayStore(path)  # now the one writer's store
    _ok(path)


def test_conversion_both_ways_keeps_rows(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        rows = [store.extend(batch_for(0, s)) for s in range(5)]
    convert_store(path, True)
    a, b = ReplayStore(path), ReplayStore(path)  # two writers at once, no lock
    assert a.multi_writer and b.multi_writer
    a.extend(batch_for(1, 0))
    b.extend(batch_for(2, 0))
    assert check_rows(b, b.row_ids()) is None and len(b) == sum(map(len, rows)) + len(batch_for(1, 0)["tag"]) \
        + len(batch_for(2, 0)["tag"])
    a.close()
    b.close()
    convert_store(path, False)
    with ReplayStore(path) as store:
        assert not store.multi_writer
        with pytest.raises(StoreLockedError):
            ReplayStore(path)
        assert check_rows(store, store.row_ids()) is None
    _ok(path)


def test_filesystem_without_create_if_absent_is_refused(tmp_path, monkeypatch):
    def no_links(src, dst, *a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(UnsupportedFilesystemError, match="multi_writer"):
        ReplayStore(tmp_path / "a", multi_writer=True)

    def replacing_link(src, dst, *a, **k):  # a filesystem whose "link" replaces, like rename
        import shutil
        shutil.copyfile(src, dst)

    monkeypatch.setattr(os, "link", replacing_link)
    with pytest.raises(UnsupportedFilesystemError, match="create-if-absent"):
        ReplayStore(tmp_path / "b", multi_writer=True)


# --------------------------------------------------------------------------- rebases and conflicts


def test_a_deferred_append_rebased_before_its_first_publish_writes_each_sidecar_once(tmp_path, monkeypatch):
    """An uncontended writer leaves its data to the manifest's publish; when another writer
    commits before that publish, the rebased sidecars replace the pending ones (writing both
    versions of one file at once left either on disk: a checksum failure under 4 S3 writers)."""
    from diskreplay.store.committer import QUIET_COMMITS, Committer
    from diskreplay.store.writing import SegmentWriter

    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True)
    b = ReplayStore(path)
    b.extend(batch_for(1, 0))
    b._committer._since_conflict = QUIET_COMMITS  # uncontended: the data waits for the publish
    real = Committer.newest
    real_segments = SegmentWriter.write
    raced, armed = [], []

    def write_segments(self, *args, **kwargs):
        out = real_segments(self, *args, **kwargs)
        armed.append(self is b._segments)  # b's data is prepared (and pending): the commit's newest() comes next
        return out

    def newest(self):
        if self is b._committer and any(armed) and not raced:
            raced.append(a.extend(batch_for(0, 0)))
        return real(self)

    real_write = LocalStorage._write_files  # (the one place a directory's commit writes its files)
    batches = []

    def write_files(self, files, dirs=(), **kw):
        batches.append([rel for rel, _, _ in files])
        return real_write(self, files, dirs, **kw)

    monkeypatch.setattr(Committer, "newest", newest)
    monkeypatch.setattr(SegmentWriter, "write", write_segments)
    monkeypatch.setattr(LocalStorage, "_write_files", write_files)
    rows = b.extend(batch_for(1, 1))
    monkeypatch.undo()
    assert raced and rows[0] == raced[0][-1] + 1
    assert batches and all(len(set(rels)) == len(rels) for rels in batches), batches
    a.close()
    b.close()
    report = verify_store(path)
    assert report["ok"], report["problems"]
    with ReplayStore(path, readonly=True) as store:
        assert not check_rows(store, store.row_ids())
        assert sorted(np.concatenate([store.group_rows(k) for k in store.group_keys()]).tolist()) == \
            store.row_ids().tolist()


@pytest.mark.parametrize("conflicts", [1, 3])
def test_a_lost_race_rebases_the_append(tmp_path, monkeypatch, conflicts):
    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True, capacity=40)
    b = ReplayStore(path)
    a.extend(batch_for(0, 0))
    race_before_publish(monkeypatch, a, b, conflicts)  # 3: rivals commit again in the middle of each rebase
    want = batch_for(0, 1)
    rows = a.extend(want, token=token_for(0, 1))
    monkeypatch.undo()
    stats = a.stats()
    assert stats["conflicts"] == conflicts and stats["rebases"] == 1
    assert rows[-1] == a.next_row - 1  # landed after the rival's commits, contiguous
    assert a.read(rows)["tag"] == want["tag"]
    assert check_rows(a, a.row_ids()) is None
    gi = a.group_index()  # the rebased sidecar names the rows the append finally got
    assert sorted(gi.group(gi.position(int(want["prompt_id"][0]))).tolist())[-len(rows):] == rows.tolist()
    assert a.extend(want, token=token_for(0, 1)).tolist() == rows.tolist()
    a.close()
    b.close()
    _ok(path)


def test_a_rival_that_commits_the_same_token_wins_and_nothing_is_appended_twice(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True)
    b = ReplayStore(path)
    real = LocalStorage.link_new
    done = []

    def put(self, src, rel):
        if self is a._committer.storage and rel.startswith(fmt.MANIFEST_DIR) and not done:
            done.append(b.extend(batch_for(0, 0), token=token_for(0, 0)))  # a restarted twin
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", put)
    rows = a.extend(batch_for(0, 0), token=token_for(0, 0))
    monkeypatch.undo()
    assert rows.tolist() == done[0].tolist() and a.next_row == len(rows)
    a.close()
    b.close()
    with ReplayStore(path) as again:
        assert len(again) == len(rows)
    _ok(path)


def test_a_merge_that_loses_to_another_merge_is_dropped(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    never = MergePolicy(fanin=1 << 30)
    a = ReplayStore(path, multi_writer=True, merge_policy=never)
    b = ReplayStore(path, merge_policy=never)
    b.extend(batch_for(1, 0, rows=2))
    for s in range(3):
        a.extend(batch_for(0, s, rows=2))  # the newest of the four: the merge is a's
    b._catch_up()
    a.merge_policy = b.merge_policy = MergePolicy(fanin=4, ratio=3)
    real = LocalStorage.link_new

    def put(self, src, rel):
        if self is a._committer.storage and rel.startswith(fmt.MANIFEST_DIR) and not b.stats()["commits"] > 1:
            b._writer.merger.rewrite(b._writer_context(), 0, 4, 1 << 20)  # b merges the same 4 segments first (as an overdue merge would)
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", put)
    a._writer.merger.merge_small_tail(a._writer_context)
    monkeypatch.undo()
    assert a.stats()["dropped_rewrites"] == 1 and a.stats()["conflicts"] == 1
    assert len(a.manifest.segments) == 1 and a.manifest == b.manifest
    assert check_rows(a, a.row_ids()) is None
    a.close()
    b.close()
    _ok(path)


def _segment_rows(path):
    with ReplayStore(path, readonly=True) as ro:
        assert check_rows(ro, ro.row_ids()) is None
        return [s.num_rows for s in ro.manifest.segments]


@pytest.mark.parametrize("left", [3, 6, 13])
def test_small_segments_another_writer_left_are_merged_not_stranded(tmp_path, left):
    """A merge is the writer's that reserved its newest segment, and the oldest due merge goes
    first. Small segments another writer left unmerged (it stopped before its merge, or more were
    appended while its merge was in flight) used to be stranded behind the merges of newer ones
    for good: 4 writer processes of 8-row commits left ~85 8-row segments between 128-row ones
    (167 segments where one writer has 5; every full manifest 32 KB instead of 1)."""
    policy = MergePolicy(fanin=4, ratio=3)  # a merged segment (4x) is never its inputs' peer
    never = MergePolicy(fanin=1 << 30)
    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True, merge_policy=never)
    b = ReplayStore(path, merge_policy=policy)
    for step in range(left):  # a stops without merging its small segments
        a.extend(batch_for(0, step, rows=2))
    a.close()
    for step in range(64 - left):
        b.extend(batch_for(1, step, rows=2))
    b.close()
    one = str(tmp_path / "one")
    with ReplayStore(one, merge_policy=policy) as single:
        for step in range(64):
            single.extend(batch_for(0, step, rows=2))
    rows, alone = _segment_rows(path), _segment_rows(one)
    assert alone == [128]
    # what a fanin * ratio lag leaves at most: a's last window (overdue only once 16 more follow) merged late
    assert len(rows) <= policy.fanin and sum(rows) == 128 and all(n >= 8 for n in rows[:-1]), rows
    _ok(path)


def test_merges_of_interleaved_writers_match_one_writer(tmp_path):
    """Three writers appending in turn merge the store down as one writer does: each merges the
    windows it completed, no merge is dropped and none is done twice."""
    policy = MergePolicy(fanin=4, ratio=3)  # a merged segment (4x) is never its inputs' peer
    path = str(tmp_path / "s")
    writers = [ReplayStore(path, multi_writer=True, merge_policy=policy) for _ in range(3)]
    for step in range(96):
        writers[step % 3].extend(batch_for(step % 3, step, rows=2))
    stats = [w.stats() for w in writers]
    for w in writers:
        w.close()
    assert sum(s["dropped_rewrites"] for s in stats) == 0 and sum(s["conflicts"] for s in stats) == 0
    assert _segment_rows(path) == [128, 32, 32]
    _ok(path)


def test_capacity_is_exact_fifo_across_writers(tmp_path):
    path = str(tmp_path / "s")
    writers = [ReplayStore(path, multi_writer=True, capacity=30, merge_policy=MergePolicy(fanin=3, ratio=2))] + \
        [ReplayStore(path) for _ in range(2)]
    for step in range(12):
        for w, store in enumerate(writers):
            store.extend(batch_for(w, step))
            assert len(store) == min(store.next_row, 30) and store.head == max(0, store.next_row - 30)
    assert check_rows(writers[0], writers[0].row_ids()) is None
    for s in writers:
        s.close()
    _ok(path)


# --------------------------------------------------------------------------- clean-up and retention


def _age(path, rel, seconds):
    t = time.time() - seconds
    os.utime(os.path.join(path, rel), (t, t))


def test_shared_clean_up_respects_retention(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, retain_seconds=100, capacity=8) as store:
        store._committer._checkpoint_at = fmt.CHECKPOINT_EVERY  # generation 9 is a full manifest
        for s in range(12):
            store.extend(batch_for(0, s, rows=4))
        old = [g for g in fmt.list_generations(path)][fmt.KEEP_MANIFESTS:]
        assert old  # superseded less than 100 s ago: still there
        snap_gen = old[-1]
        with ReplayStore(path, readonly=True, generation=snap_gen) as snap:
            assert check_rows(snap, snap.row_ids()) is None  # its evicted segments are still on disk
        # a dead writer's orphans: a segment and a temp file, young and old
        for name in ("segments/000000099998.arrow", "segments/000000099999.arrow", "manifests/.tmp-x.json.dead"):
            open(os.path.join(path, name), "wb").write(b"orphan")
        _age(path, "segments/000000099999.arrow", 200)
        _age(path, "manifests/.tmp-x.json.dead", 200)
        for g in fmt.list_generations(path):  # time passes: every superseded manifest is now old
            _age(path, fmt.manifest_file(g), 200)
        store._committer.gc.sweep_shared()
        left = fmt.list_generations(path)
        assert len(left) == fmt.KEEP_MANIFESTS  # 9 (full) to 12: no older manifest is needed
        assert os.path.exists(os.path.join(path, "segments/000000099998.arrow"))  # young: maybe in flight
        assert not os.path.exists(os.path.join(path, "segments/000000099999.arrow"))
        assert not os.path.exists(os.path.join(path, "manifests/.tmp-x.json.dead"))
        with pytest.raises(FileNotFoundError, match="not retained"):
            ReplayStore(path, readonly=True, generation=snap_gen)
        assert check_rows(store, store.row_ids()) is None


def test_the_sweep_finds_the_old_manifests_by_bisection(tmp_path, monkeypatch):
    """Ages fall with the generation, so the sweep stats O(log n) manifests, not every one, and
    drops exactly those the one-by-one rule drops (a newer one has existed for retain_seconds),
    back to the full manifest the oldest kept delta needs."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, retain_seconds=100) as store:
        for s in range(120):
            store.extend(batch_for(0, s, rows=2))
        gens = sorted(fmt.list_generations(path))
        for g in gens[:70]:  # time passes for the older ones, oldest oldest
            _age(path, fmt.manifest_file(g), 1000 - g)
        # the one-by-one rule: g goes iff the next present generation has existed for 100 s
        expected_kept = {g for g, newer in zip(gens, gens[1:]) if g >= 70} | set(gens[-fmt.KEEP_MANIFESTS:])
        oldest_kept = min(expected_kept)
        chain = fmt.read_manifest(LocalStorage(path), oldest_kept).depth
        expected_kept |= set(range(oldest_kept - chain, oldest_kept))
        stats = []
        real = store._committer.gc._age
        monkeypatch.setattr(store._committer.gc, "_age", lambda rel: stats.append(rel) or real(rel))
        store._committer.gc.sweep_shared()
        assert set(fmt.list_generations(path)) == expected_kept
        manifest_stats = [r for r in stats if r.startswith(fmt.MANIFEST_DIR + "/0")]
        assert len(manifest_stats) <= 2 + len(gens).bit_length(), manifest_stats
        assert check_rows(store, store.row_ids()) is None


def test_a_sweep_stats_an_unnamed_file_again_only_once_it_may_be_old_enough(tmp_path, monkeypatch):
    """Merged-away segments stay for retain_seconds: the sweeps in between remember when each
    one will be old enough instead of statting them all every time; then it goes."""
    from diskreplay.store import collector as cm

    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, retain_seconds=100) as store:
        for s in range(40):
            store.extend(batch_for(0, s, rows=2))
        committer = store._committer.gc
        for g in fmt.list_generations(path)[1:]:  # superseded long ago: only the newest few stay
            _age(path, fmt.manifest_file(g), 1000)
        stats = []
        real = committer._age
        monkeypatch.setattr(committer, "_age", lambda rel: stats.append(rel) or real(rel))
        committer._ripe = {}  # as a writer that just opened the store
        committer.sweep_shared()
        named = {f for g in fmt.list_generations(path) for f in fmt.read_manifest(LocalStorage(path), g).files()}
        unnamed = {f"{fmt.SEGMENT_DIR}/{n}" for n in os.listdir(os.path.join(path, fmt.SEGMENT_DIR))} - named
        assert len(unnamed) >= 16  # a merge's inputs, young
        assert unnamed <= set(stats)  # seen for the first time: statted
        stats.clear()
        committer.sweep_shared()
        assert not unnamed & set(stats)  # known to be young still: not statted
        now = time.time()
        monkeypatch.setattr(cm.time, "time", lambda: now + 101)  # retain_seconds later
        for rel in unnamed:
            _age(path, rel, 101)
        committer.sweep_shared()
        assert unnamed <= set(stats)
        assert not any(os.path.exists(os.path.join(path, rel)) for rel in unnamed)
        assert check_rows(store, store.row_ids()) is None


def test_sweeps_space_out_as_the_store_grows(tmp_path, monkeypatch):
    """A sweep lists every retained file: the commits between sweeps grow with what the last one
    listed, so the sweeps' cost per commit stays bounded however much the store retains."""
    from diskreplay.store import collector as cm

    path = str(tmp_path / "s")
    monkeypatch.setattr(cm, "SWEEP_ENTRIES_PER_COMMIT", 3)  # every three entries listed: a commit more between
    with ReplayStore(path, multi_writer=True) as store:
        sweeps, step = [], [0]
        real = store._committer.gc.sweep_shared
        monkeypatch.setattr(store._committer.gc, "sweep_shared", lambda: sweeps.append(step[0]) or real())
        for step[0] in range(500):
            store.extend(batch_for(0, step[0], rows=2))
        listed = sum(len(os.listdir(os.path.join(path, d))) for d in
                     (fmt.MANIFEST_DIR, fmt.SEGMENT_DIR, fmt.GROUPS_DIR, ".")) + len(fmt.list_generations(path))
        assert cm.SHARED_GC_EVERY < store._committer.gc._sweep_every <= listed // 3
        gaps = np.diff(sweeps)
        # (the merges of these small commits are commits too: SHARED_GC_EVERY commits are fewer extends)
        merges = cm.SHARED_GC_EVERY // store.merge_policy.fanin + 1
        assert len(gaps) >= 2 and gaps[0] >= cm.SHARED_GC_EVERY - merges and all(np.diff(gaps) > 0), sweeps


def test_a_sweep_names_the_files_of_the_manifests_a_writer_made_or_applied_without_reading_them(tmp_path, monkeypatch):
    """The sweep takes the manifests a writer holds from its own commits and the deltas it applied
    (merges, checkpoints, another writer's appends and evictions among them); what it finds
    referenced must be exactly what every retained manifest on disk names."""
    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True, capacity=60, merge_policy=MergePolicy(fanin=4, ratio=3))
    b = ReplayStore(path, multi_writer=True, merge_policy=MergePolicy(fanin=4, ratio=3))
    for s in range(30):
        (a if s % 3 else b).extend(batch_for(s % 2, s, rows=3), token=f"t{s}")
        a.save_state("sampler", {"step": s}) if s % 7 == 0 else None
    a._catch_up()
    gens = set(fmt.list_generations(path))
    reads = []
    real = fmt.read_manifest
    monkeypatch.setattr(fmt, "read_manifest", lambda *args, **kw: reads.append(args[1]) or real(*args, **kw))
    keep = set(gens)
    referenced, unreadable = a._committer.gc._named_by(keep)
    monkeypatch.undo()
    docs, _ = fmt.manifest_docs(path)
    assert not unreadable and keep >= gens  # and the chain of the oldest delta (generation 0: the empty store)
    named = {f for g in keep if g for f in docs[g].files()}
    # (a segment is kept by its id, which names its sidecar too: a segment of one inline group has none)
    assert referenced >= named and all(f.startswith(fmt.GROUPS_DIR) and not os.path.exists(os.path.join(path, f))
                                       for f in referenced - named)
    assert len(reads) < len(gens) / 4, reads  # a's commits and the deltas it applied were not read again
    a.close()
    b.close()
    _ok(path)


# --------------------------------------------------------------------------- snapshots


@pytest.mark.parametrize("multi", [False, True], ids=["single", "multi"])
def test_snapshot_is_pinned_and_picklable(tmp_path, multi):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=multi) as store:
        store.extend(batch_for(0, 0, rows=3))
        with store.snapshot() as snap:
            gen = snap.generation
            store.extend(batch_for(0, 1, rows=2))
            assert not snap.refresh() and snap.generation == gen and len(snap) == 3
            again = pickle.loads(pickle.dumps(snap))
            assert again.generation == gen and again.read([0, 1, 2])["tag"] == snap.read([0, 1, 2])["tag"]
            follower = pickle.loads(pickle.dumps(ReplayStore(path, readonly=True)))
            assert follower.generation == store.generation and follower.refresh() is False
        with pytest.raises(TypeError, match="snapshot"):
            pickle.dumps(store)
    with pytest.raises(ValueError, match="readonly"):
        ReplayStore(path, generation=1)


def test_single_writer_snapshot_is_kept_for_retain_seconds(tmp_path):
    """``retain_seconds`` applies to a single-writer store's clean-up too: a pinned snapshot outlives
    more than ``KEEP_MANIFESTS`` commits that evict every row it names, and a writer reopen; once
    the retention is over the files go, so capacity still bounds the disk. Without the option a
    single-writer store keeps ``KEEP_MANIFESTS`` commits (docs/FORMAT.md, "Snapshots", says why)."""
    path = str(tmp_path / "s")
    store = ReplayStore(path, capacity=8, retain_seconds=60)
    for s in range(3):
        store.extend(batch_for(0, s, rows=4))
    snap = store.snapshot()
    want = snap.read(snap.row_ids(), ["tag"])["tag"]
    for s in range(3, 3 + fmt.KEEP_MANIFESTS + 3):
        store.extend(batch_for(0, s, rows=4))
    assert snap.next_row <= store.head  # every row the snapshot names is evicted
    store.close()
    store = ReplayStore(path)  # the exclusive open's sweep keeps them too
    with ReplayStore(path, readonly=True, generation=snap.generation) as again:
        assert again.read(again.row_ids(), ["tag"])["tag"] == want
        assert check_rows(again, again.row_ids()) is None
    assert snap.read(snap.row_ids(), ["tag"])["tag"] == want
    snap.close()
    for g in fmt.list_generations(path):  # time passes: the retention of every superseded commit is over
        _age(path, fmt.manifest_file(g), 120)
    store.extend(batch_for(0, 99, rows=4))
    store.close()
    with ReplayStore(path) as store:  # the open's sweep: only the newest KEEP_MANIFESTS stay
        assert len(fmt.list_generations(path)) == fmt.KEEP_MANIFESTS
        live = {f for g in fmt.list_generations(path) for f in fmt.load_manifest(
            os.path.join(path, fmt.manifest_file(g)), g).files()}
        assert sorted(os.listdir(os.path.join(path, fmt.SEGMENT_DIR))) == sorted(
            os.path.basename(f) for f in live if f.startswith(fmt.SEGMENT_DIR))
    with pytest.raises(FileNotFoundError, match="not retained"):
        ReplayStore(path, readonly=True, generation=snap.generation)
    _ok(path)


def test_single_writer_without_retain_seconds_keeps_keep_manifests_commits(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, capacity=8) as store:
        store.extend(batch_for(0, 0, rows=4))
        gen = store.generation
        for s in range(1, 2 + fmt.KEEP_MANIFESTS):
            store.extend(batch_for(0, s, rows=4))
        with pytest.raises(FileNotFoundError, match="not retained"):
            ReplayStore(path, readonly=True, generation=gen)


# --------------------------------------------------------------------------- verify and repair next to live writers


def test_verify_catches_up_instead_of_reporting_collected_files(tmp_path, monkeypatch):
    import diskreplay.verify.check as verify_mod

    path = str(tmp_path / "s")
    writer = ReplayStore(path, capacity=8)
    for s in range(3):
        writer.extend(batch_for(0, s, rows=4))
    real = verify_mod._check_segment
    moved = []

    def racing(r, seg, options, bar):
        if not moved:  # the writer commits and collects under the first pass
            moved.append(1)
            for s in range(3, 3 + fmt.KEEP_MANIFESTS + 2):
                writer.extend(batch_for(0, s, rows=4))
        return real(r, seg, options, bar)

    monkeypatch.setattr(verify_mod, "_check_segment", racing)
    report = verify_store(path)
    assert report["ok"], report["problems"]
    assert report["generation"] == writer.generation
    writer.close()


def test_repair_refuses_a_store_with_a_live_writer(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as writer:
        writer.extend(batch_for(0, 0))
        for dry_run in (True, False):
            with pytest.raises(StoreLockedError, match="repair refuses"):
                repair_store(path, dry_run=dry_run)
    assert repair_store(path, dry_run=True)["actions"] == []
    multi = str(tmp_path / "m")
    with ReplayStore(multi, multi_writer=True) as writer:
        writer.extend(batch_for(0, 0))
    with pytest.raises(StoreLockedError, match="--force"):
        repair_store(multi)
    assert repair_store(multi, force=True)["rows"] == len(batch_for(0, 0)["tag"])
    # a writer that is open but idle (no commit for minutes) holds LOCK shared: even --force is refused
    with ReplayStore(multi) as idle:
        old = time.time() - 600
        for d, _, names in os.walk(multi):
            for name in names:
                os.utime(os.path.join(d, name), (old, old))
        for dry_run in (True, False):
            with pytest.raises(StoreLockedError, match="writers have open"):
                repair_store(multi, dry_run=dry_run, force=True)
        idle.extend(batch_for(0, 1))  # untouched, still a writer
    assert repair_store(multi, dry_run=True, force=True)["actions"] == []  # closed: nothing holds LOCK


# --------------------------------------------------------------------------- processes, SIGKILL


WRITER = textwrap.dedent("""
    import sys
    from diskreplay import ReplayStore
    from diskreplay.testing.workload import batch_for, token_for
    path, w, step, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    store = ReplayStore(path, fsync=w % 2 == 0)  # odd writers commit without fsync: a SIGKILL loses nothing
    while step < stop:
        rows = store.extend(batch_for(w, step), token=token_for(w, step))
        print("ACK", step, int(rows[0]), len(rows), flush=True)
        step += 1
    store.close()
""")

READER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from diskreplay import ReplayStore
    from diskreplay.errors import RowsEvictedError
    from diskreplay.testing.workload import check_rows
    path, stop = sys.argv[1], sys.argv[2]
    store = ReplayStore(path, readonly=True)
    rng = np.random.default_rng(os.getpid())
    gens, reads, errors = [], 0, []
    while not os.path.exists(stop) or reads < 5:
        store.refresh()
        gens.append(store.generation)
        if len(store):
            rows = rng.integers(store.head, store.next_row, size=min(16, len(store)))
            try:
                bad = check_rows(store, rows)
            except RowsEvictedError:
                continue
            reads += 1
            if bad:
                errors.append(bad)
    backwards = sum(1 for a, b in zip(gens, gens[1:]) if b < a)
    print(json.dumps({"reads": reads, "backwards": backwards, "errors": errors[:5], "last": gens[-1]}))
""")


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.slow
def test_writers_killed_at_random_commit_every_acknowledged_batch_exactly_once(tmp_path):
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True).close()
    stop_file = str(tmp_path / "stop")
    n_writers, steps, kills_wanted = 4, 25, 30
    rnd = random.Random(7)
    acked = {w: {} for w in range(n_writers)}  # step -> (first_row, n)
    procs = {}

    target = {w: steps for w in range(n_writers)}  # grows while kills are still wanted: counted, not timed

    def start(w):
        nxt = max(acked[w], default=-1) + 1  # re-send the last unacknowledged batch, same token
        procs[w] = subprocess.Popen([sys.executable, "-c", WRITER, path, str(w), str(nxt), str(target[w])],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())

    def drain(w, proc):
        out, err = proc.communicate()
        for line in out.splitlines():
            _, step, first, n = line.split()
            acked[w][int(step)] = (int(first), int(n))
        return err

    readers = [subprocess.Popen([sys.executable, "-c", READER, path, stop_file], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env()) for _ in range(2)]
    try:
        for w in range(n_writers):
            start(w)
        kills = 0
        deadline = time.time() + 600  # a guard against a hang only: the run ends on counts
        while time.time() < deadline:
            time.sleep(rnd.uniform(0.05, 0.4))
            w = rnd.randrange(n_writers)
            proc = procs[w]
            if proc.poll() is None and kills < kills_wanted:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            if proc.poll() is None and kills < kills_wanted:
                continue
            err = drain(w, proc)
            assert proc.returncode in (0, -signal.SIGKILL), err
            if len(acked[w]) < target[w]:
                start(w)
            elif kills < kills_wanted:  # it finished before enough kills landed: give it more to do
                target[w] += 5
                start(w)
            elif all(len(acked[v]) == target[v] for v in acked):
                break
            if kills >= kills_wanted:  # let the rest finish
                for v, p in list(procs.items()):
                    if p.poll() is None:
                        p.wait()
                    if p.returncode is not None and p.stdout is not None and not p.stdout.closed:
                        err = drain(v, p)
                        assert p.returncode in (0, -signal.SIGKILL), err
                        if len(acked[v]) < target[v]:
                            start(v)
        assert kills >= kills_wanted and all(len(acked[w]) == target[w] for w in acked), (kills, {
            w: len(a) for w, a in acked.items()})
    finally:
        open(stop_file, "w").close()  # the readers stop on it, whatever happened
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for r in readers:
        out, err = r.communicate(timeout=120)
        assert r.returncode == 0, err
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["backwards"] == 0 and not summary["errors"] and summary["reads"] >= 5, summary

    with ReplayStore(path, readonly=True) as store:
        tags = store.read(store.row_ids(), ["tag"])["tag"]
        assert check_rows(store, store.row_ids()) is None  # bit-exact
    where = {}
    for row, tag in enumerate(tags):
        batch = tag[: tag.index("r")]
        where.setdefault(batch, []).append((row, tag))
    for w in range(n_writers):
        for step, (first, n) in acked[w].items():
            want = batch_for(w, step)["tag"]
            got = where.pop(want[0][: want[0].index("r")])
            # exactly once, whole, contiguous, at the rows its extend returned
            assert [r for r, _ in got] == list(range(first, first + n)), (w, step)
            assert [t for _, t in got] == want
    assert not where, f"batches nobody acknowledged: {sorted(where)}"
    _ok(path)


# --------------------------------------------------------------------------- crash points, with a lost race


CRASH_WRITER = textwrap.dedent("""
    import os, subprocess, sys
    from diskreplay import ReplayStore
    from diskreplay import format as fmt
    from diskreplay.storage import LocalStorage
    from diskreplay.testing.workload import batch_for, token_for
    path, step, rival = sys.argv[1], sys.argv[2], sys.argv[3]
    store = ReplayStore(path)
    for s in range(4):
        rows = store.extend(batch_for(0, s), token=token_for(0, s))
        print("ACK", 0, s, int(rows[0]), len(rows), flush=True)
    real = LocalStorage.link_new
    raced = []

    def put(self, src, rel):
        if rel.startswith(fmt.MANIFEST_DIR) and not raced:
            raced.append(1)  # another writer (a process of its own) commits first: this attempt loses
            env = {k: v for k, v in os.environ.items() if k != "DISKREPLAY_CRASH_AT"}
            out = subprocess.run([sys.executable, "-c", rival, path], capture_output=True, text=True, env=env)
            print(out.stdout.strip(), flush=True)
        return real(self, src, rel)

    LocalStorage.link_new = put
    os.environ["DISKREPLAY_CRASH_AT"] = step
    rows = store.extend(batch_for(0, 4), token=token_for(0, 4))
    print("ACK", 0, 4, int(rows[0]), len(rows), flush=True)
""")

CRASH_RIVAL = textwrap.dedent("""
    import sys
    from diskreplay import ReplayStore
    from diskreplay.testing.workload import batch_for, token_for
    with ReplayStore(sys.argv[1]) as store:
        rows = store.extend(batch_for(1, 0), token=token_for(1, 0))
    print("ACK", 1, 0, int(rows[0]), len(rows))
""")

# "#2": the second attempt, after the lost race. An append delta links the same file again; a store
# of format v2 (full manifests, global rows in its sidecars) rebases: its sidecars are rewritten for
# the new rows and made durable with its manifest's file. "v2:" runs a store of that format (a batch
# of one group has no sidecar in a store of the newer format, so "groups.renamed" is a v2 step).
MULTI_CRASH_STEPS = ["segment.written", "v2:groups.renamed", "segments.synced", "manifest.written",
                     "manifest.written#2", "manifest.renamed", "manifest.committed",
                     "v2:segments.synced", "v2:groups.renamed#2", "v2:manifest.written#2", "v2:manifest.committed"]


def _multi_writer_store(path, kind="delta"):
    """A new multi-writer store; ``kind="v2"``: of the format before append deltas."""
    ReplayStore(path, multi_writer=True).close()
    if kind == "v2":
        options = fmt.StoreOptions.read(path)
        dataclasses.replace(options, append_deltas=False, inline_groups=False).write(path)


@pytest.fixture(scope="module")
def multi_crash_runs(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("multi-crash")

    def run(step):
        path = str(root / step.replace("#", "-").replace(":", "-"))
        kind, _, at = step.rpartition(":")
        _multi_writer_store(path, kind or "delta")
        proc = subprocess.run([sys.executable, "-c", CRASH_WRITER, path, at, CRASH_RIVAL], capture_output=True,
                              text=True, env=_env(), timeout=300)
        return step, (path, proc)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(run, MULTI_CRASH_STEPS))


@pytest.mark.parametrize("step", MULTI_CRASH_STEPS)
def test_crash_point_multi_writer_with_a_lost_race(multi_crash_runs, step):
    """Killed at ``step`` of a commit that lost a race to another writer: acknowledged batches exactly
    once, the in-flight one all or nothing, and a restart re-sending it with its token makes it exactly once."""
    path, proc = multi_crash_runs[step]
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    acked = {}
    for line in proc.stdout.splitlines():
        _, w, s, first, n = line.split()
        acked[(int(w), int(s))] = (int(first), int(n))
    # killed before the link the rival's commit comes right before
    raced = step.rpartition(":")[2] not in ("segment.written", "groups.renamed", "segments.synced",
                                            "manifest.written")
    assert ((1, 0) in acked) == raced and (0, 4) not in acked and len(acked) == 4 + raced, acked

    def batches(store):
        tags = store.read(store.row_ids(), ["tag"])["tag"]
        out = {}
        for row, tag in enumerate(tags):
            out.setdefault(tag[: tag.index("n")], []).append(row)
        assert check_rows(store, store.row_ids()) is None
        return out

    with ReplayStore(path, readonly=True) as ro:
        seen = batches(ro)
    for (w, s), (first, n) in acked.items():
        assert seen.pop(f"w{w}s{s}") == list(range(first, first + n))
    assert set(seen) <= {"w0s4"}  # the in-flight batch: all or nothing
    committed = seen.get("w0s4")
    with ReplayStore(path) as store:  # the restarted writer re-sends it with the same token
        rows = store.extend(batch_for(0, 4), token=token_for(0, 4))
        if committed is not None:
            assert rows.tolist() == committed
        assert batches(store)["w0s4"] == rows.tolist()
    _ok(path)


def test_a_merge_is_left_to_the_writer_that_made_its_newest_segment(tmp_path, monkeypatch):
    """Many writers see the same due merges: only the writer that reserved a merge's newest segment
    does it (the others would lose it after doing its work); a merge overdue by ``fanin * ratio``
    of its segments' rows is anyone's."""
    path = str(tmp_path / "s")
    policy = MergePolicy(fanin=4, ratio=3)
    a = ReplayStore(path, multi_writer=True, merge_policy=policy)
    b = ReplayStore(path, merge_policy=policy)
    for step in range(3):
        a.extend(batch_for(0, step, rows=1))
    monkeypatch.setattr(Merger, "merge_small_tail", lambda self, context: None)
    a.extend(batch_for(0, 3, rows=1))  # the 4th small segment: a's merge, but a "dies" before it
    monkeypatch.undo()
    assert len(a.manifest.segments) == 4
    lag = policy.fanin * policy.ratio
    for step in range(lag):  # b leaves a's merge alone until it is overdue, and merges its own
        b.extend(batch_for(1, step, rows=1))
        assert [s.num_rows for s in b.manifest.segments[:4]] == [1] * 4, step
    assert [s.num_rows for s in b.manifest.segments] == [1] * 4 + [4] * 3
    b.extend(batch_for(1, lag, rows=1))
    assert [s.num_rows for s in b.manifest.segments] == [16, 1]  # overdue: b merged a's, then its peers
    assert b.stats()["dropped_rewrites"] == 0
    a.close()
    b.close()
    with ReplayStore(path, readonly=True) as ro:
        assert not check_rows(ro, ro.row_ids()) and len(ro) == 4 + lag + 1


def test_a_merge_reads_another_writer_s_segments_whole_and_refuses_a_damaged_one(tmp_path):
    """A merge copies the other writers' small segments (read into memory, not mapped), each
    checked whole against its CRC-32C first: a damaged one stops the merge with a warning naming
    the file, the append that made it due stays committed, and nothing is merged."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True) as a, ReplayStore(path) as b:
        for step in range(15):
            b.extend(batch_for(1, step))
        seg = b.manifest.segments[3]
        with open(os.path.join(path, seg.file), "r+b") as f:
            f.seek(seg.bytes // 2)
            byte = f.read(1)
            f.seek(seg.bytes // 2)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.warns(RuntimeWarning, match=os.path.basename(seg.file)):
            rows = a.extend(batch_for(0, 0))
        assert len(a.manifest.segments) == 16 and a.next_row == rows[-1] + 1
        assert check_rows(a, np.arange(rows[0], rows[-1] + 1)) is None
    with ReplayStore(path, multi_writer=True) as a:  # intact inputs: copied the same way (compact)
        with open(os.path.join(path, seg.file), "r+b") as f:
            f.seek(seg.bytes // 2)
            f.write(byte)
        a.compact()
        assert len(a.manifest.segments) == 1
        assert check_rows(a, a.row_ids()) is None


def test_verify_does_not_report_the_files_of_commits_in_flight(tmp_path):
    """On a live store verify sees files of commits made after the manifest it checks, and (many
    writers) files of commits in flight: not left-overs. Older than retain_seconds they are."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, retain_seconds=240) as store:
        store.extend(batch_for(0, 0))
    fresh = [fmt.segment_file(900), f"{fmt.SEGMENT_DIR}/.tmp-staged.x", f"{fmt.MANIFEST_DIR}/.tmp-staged.y"]
    for rel in fresh:
        with open(os.path.join(path, rel), "wb") as f:
            f.write(b"in flight")
    report = _ok(path)
    assert report["warnings"] == [], report["warnings"]
    for rel in fresh:  # past retain_seconds: an orphan of a dead writer, which clean-up takes
        os.utime(os.path.join(path, rel), (time.time() - 300, time.time() - 300))
    report = _ok(path)
    assert all(any(os.path.basename(rel) in w for w in report["warnings"]) for rel in fresh), report["warnings"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_closing_the_store_keeps_the_parent_s_lock(tmp_path):
    """A child forked from a writer shares its LOCK's open file, so unlocking there would unlock the
    parent: the child's close only closes its descriptor, and the parent stays the locked writer."""
    for multi in (False, True):
        path = str(tmp_path / f"s{int(multi)}")
        with ReplayStore(path, multi_writer=multi) as store:
            store.extend(batch_for(0, 0))
            pid = os.fork()
            if pid == 0:  # the child: close the inherited store and leave at once
                try:
                    store.close()
                finally:
                    os._exit(0)
            assert os.waitpid(pid, 0)[1] == 0
            if multi:  # another writer may not convert the store under this one
                with ReplayStore(path) as other, pytest.raises(StoreLockedError, match="other processes"):
                    other.compact(multi_writer=False)
            else:  # nor may a second single writer open it
                with pytest.raises(StoreLockedError, match="already open for writing"):
                    ReplayStore(path)
            store.extend(batch_for(0, 1))


@pytest.mark.parametrize("token", ["w1:1", None])
def test_a_link_that_landed_but_answered_eexist_is_this_writers_commit(tmp_path, monkeypatch, token):
    """On NFS a retransmitted link whose first reply was lost answers EEXIST although it landed: the
    writer took its own commit for another's, rebased on it and (with a token, finding its own record)
    removed the files the commit names; without one it raised although the rows were committed."""
    path = str(tmp_path / "s")
    store = ReplayStore(path, multi_writer=True)
    store.extend(batch_for(1, 0))
    real, armed = os.link, [True]

    def link(src, dst, **kw):
        real(src, dst, **kw)
        if armed[0] and os.sep + fmt.MANIFEST_DIR + os.sep in str(dst):
            armed[0] = False
            raise FileExistsError(errno.EEXIST, "File exists (a retransmitted link)", dst)

    monkeypatch.setattr(os, "link", link)
    rows = store.extend(batch_for(1, 1), token=token)
    monkeypatch.setattr(os, "link", real)
    assert not armed[0] and store.generation == 2 and rows.tolist() == list(range(len(batch_for(1, 0)["prompt_id"]),
                                                                                   len(store)))
    store.close()
    with ReplayStore(path, readonly=True) as reader:
        assert reader.generation == 2
        assert check_rows(reader, reader.row_ids()) is None
    assert verify_store(path)["ok"]


@pytest.mark.parametrize("multi_writer", [True, False])
def test_a_commit_whose_outcome_is_not_known_keeps_its_files(tmp_path, monkeypatch, multi_writer):
    """The link (rename) lands but answers EIO, and reading the manifest back fails too: the writer took
    the commit for one that never happened and removed the files the committed generation names."""
    from diskreplay.errors import CommitNotDurableError, StoreIOError
    from diskreplay.storage import local

    path = str(tmp_path / "s")
    store = ReplayStore(path, multi_writer=multi_writer)
    store.extend(batch_for(1, 0))
    name = "link" if multi_writer else "replace"
    real, real_read = getattr(os, name), local.read_file
    armed = {"publish": True, "read": False}

    def publish(src, dst, **kw):
        real(src, dst, **kw)
        if armed["publish"] and os.sep + fmt.MANIFEST_DIR + os.sep + "0" in str(dst):
            armed["publish"], armed["read"] = False, True
            raise OSError(errno.EIO, "Input/output error", dst)

    def read_file(p, limit=None):
        if armed["read"] and os.sep + fmt.MANIFEST_DIR + os.sep in p:
            armed["read"] = False
            raise OSError(errno.EIO, "Input/output error", p)
        return real_read(p, limit)

    monkeypatch.setattr(os, name, publish)
    monkeypatch.setattr(local, "read_file", read_file)
    # one writer settles it at once from what storage holds (the manifest is there, its own): committed
    with pytest.raises(StoreIOError if multi_writer else CommitNotDurableError,
                       match="was committed is not known" if multi_writer else "committed and visible"):
        store.extend(batch_for(1, 1), token="t1")
    monkeypatch.setattr(os, name, real)
    monkeypatch.setattr(local, "read_file", real_read)
    assert verify_store(path)["ok"]  # generation 2 landed, and every file it names is there
    first = store.extend(batch_for(1, 1), token="t1")  # the retry finds it: the same rows, nothing added
    assert store.generation == 2 and first.tolist() == list(range(len(batch_for(1, 0)["prompt_id"]), len(store)))
    assert check_rows(store, store.row_ids()) is None
    store.close()
    assert verify_store(path)["ok"]


def _age_files(path, seconds):
    for d in (fmt.SEGMENT_DIR, fmt.GROUPS_DIR, fmt.MANIFEST_DIR):
        for name in os.listdir(os.path.join(path, d)):
            os.utime(os.path.join(path, d, name), (time.time() - seconds,) * 2)


def test_a_sweep_never_removes_a_file_whose_id_was_reserved_again_since_it_looked(tmp_path, monkeypatch):
    """Writer B's sweep finds an old orphan segment; before B removes it, writer A's sweep removes it,
    and A's commit reserves the freed id (the lowest free one at next_segment) and names it. B then
    removed A's committed segment: its sweep decided on one stat, long before the unlink."""
    from diskreplay.store import collector as C

    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, retain_seconds=2) as s:
        s.extend(batch_for(1, 0))
        orphan = fmt.segment_file(s.manifest.next_segment)
    with open(os.path.join(path, orphan), "wb") as f:
        f.write(b"x" * 100)  # a killed writer's segment, never committed
    _age_files(path, 20)
    real, state = C.Collector.delete, {}

    def delete(self, manifests, files, *rest):
        if not state and orphan in files:
            state["busy"] = True
            state["A"] = a = ReplayStore(path, multi_writer=True)  # A's open sweep removes the orphan ...
            a.extend(batch_for(2, 0))  # ... and its commit takes the id
            assert orphan in [s.file for s in a.manifest.segments]
        return real(self, manifests, files, *rest)

    monkeypatch.setattr(C.Collector, "delete", delete)
    b = ReplayStore(path, multi_writer=True)  # B's open sweep
    monkeypatch.setattr(C.Collector, "delete", real)
    a = state["A"]
    assert check_rows(a, a.row_ids()) is None  # A's committed segment is still there
    a.close(), b.close()
    assert verify_store(path)["ok"]


def test_a_sweep_that_took_longer_than_half_the_retention_removes_no_data_file(tmp_path, monkeypatch):
    """A sweep descheduled between its listing of manifests/ and its stats of the data files took a
    file that a generation committed meanwhile names for an old unnamed one."""
    from diskreplay.store import collector as C

    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, retain_seconds=2) as s:
        for i in range(6):
            s.extend(batch_for(1, i))
    real, other = C.Collector._named_by, []

    def slow(self, keep):
        out = real(self, keep)
        if not other:
            other.append(None)
            other[0] = ReplayStore(path, multi_writer=True)
            other[0].extend(batch_for(2, 0))  # committed after this sweep listed manifests/
            time.sleep(2.5)  # ... and this sweep goes on past retain_seconds
        return out

    monkeypatch.setattr(C.Collector, "_named_by", slow)
    b = ReplayStore(path, multi_writer=True)
    monkeypatch.setattr(C.Collector, "_named_by", real)
    with ReplayStore(path, readonly=True) as reader:
        assert check_rows(reader, reader.row_ids()) is None
    other[0].close(), b.close()
    assert verify_store(path)["ok"]
