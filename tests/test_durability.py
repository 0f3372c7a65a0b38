"""The durability campaign: crash points, SIGKILL, I/O errors, torn files, concurrency.

Every test here checks the store against rows whose content is a pure
function of their row id (:func:`expected_rows`), so after any fault the test
can tell, for every row the store serves, whether it is bit-exact. Crashes are
real: child processes (``sys.executable -c``) are killed with SIGKILL, by the
store's own crash points (``DISKREPLAY_CRASH_AT``) or by the test at random
moments. Damaged stores are probed in a forked child, because a damaged Arrow
file can crash the reading process outright.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from diskreplay import CorruptStoreError, FormatError, ReplayStore, RowsEvictedError, StoreLockedError
from diskreplay import format as fmt
from diskreplay.testing.workload import expected_rows, rows_mismatch
from diskreplay._fileio import TMP_PREFIX
from diskreplay.verify import repair_store, verify_store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRASH_ENV = "DISKREPLAY_CRASH_AT"


# --------------------------------------------------------------------------- deterministic content
# These functions are also the prelude of every child script (by their source),
# so they may use only numpy and builtins.


def groups_mismatch(store):
    """None when the store's group index is exactly its live rows grouped by ``id // 3``."""
    gi = store.group_index()  # a reader that fell behind the writer's clean-up catches up here
    ids = store.row_ids()
    want_keys = sorted(set((ids // 3).tolist()))
    if sorted(gi.keys) != want_keys:
        return f"group keys {sorted(gi.keys)[:5]}... differ from {want_keys[:5]}..."
    for g, key in enumerate(gi.keys):
        want = ids[ids // 3 == key]
        if not np.array_equal(gi.group(g), want):
            return f"group {key} holds rows {gi.group(g).tolist()}, expected {want.tolist()}"
    return None


def batch_size(b):
    """Rows in the ``b``-th append of a crash-point child."""
    return 3 + b % 4


def state_for(k):
    """The ``k``-th sampler state a child saves."""
    return {"k": k, "weights": (np.arange(k % 7 + 1, dtype=np.float32) * np.float32(0.5) + k),
            "rng": {"seed": k, "pos": [k, k + 1]}}


def state_mismatch(state, k):
    want = state_for(k)
    if state is None:
        return "no state"
    if state.get("k") != k or state.get("rng") != want["rng"]:
        return f"state {state.get('k')!r} is not state {k}"
    w = np.asarray(state.get("weights"))
    if w.dtype != want["weights"].dtype or w.tobytes() != want["weights"].tobytes():
        return f"state {k}: weights differ"
    return None


# Children import the store without running diskreplay/__init__.py, which pulls
# in torch (2 s a process); that keeps two dozen killed children within budget.
LIGHT_IMPORT = f"""
import os, sys, json, time, types
import numpy as np
_pkg = types.ModuleType("diskreplay")
_pkg.__path__ = [{os.path.join(ROOT, "diskreplay")!r}]
sys.modules["diskreplay"] = _pkg
from diskreplay.errors import *
from diskreplay.store import ReplayStore
_pkg.__dict__.update({{k: v for k, v in globals().items() if k.endswith("Error")}}, ReplayStore=ReplayStore)
"""

PRELUDE = LIGHT_IMPORT + "\n\n".join(
    inspect.getsource(f) for f in (expected_rows, rows_mismatch, groups_mismatch, batch_size, state_for,
                                   state_mismatch))


def run_child(body, *args, timeout=60, env=None):
    """Run ``PRELUDE + body`` in a fresh interpreter; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=child_env(env))


class Child:
    """A child process whose stdout and stderr go to files (readable after a SIGKILL, never lost in a pipe)."""

    _n = 0

    def __init__(self, body, *args, env=None):
        Child._n += 1
        fd, self.out_path = tempfile.mkstemp(prefix=f"child{Child._n}-", suffix=".out")
        os.close(fd)
        self.err_path = self.out_path[:-4] + ".err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body), *map(str, args)],
                                         stdout=out, stderr=err, env=child_env(env))

    def output(self):
        with open(self.out_path) as f:
            text = f.read()
        return text[: text.rfind("\n") + 1]  # a line cut by a kill was never printed

    def errors(self):
        with open(self.err_path) as f:
            return f.read()

    def wait_for(self, prefix, timeout=60.0):
        """Wait until the child has printed a line starting with ``prefix``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.startswith(prefix) for line in self.output().splitlines()):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.005)
        self.proc.kill()
        raise AssertionError(f"child never printed {prefix!r}: {self.errors()}")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        assert self.proc.returncode == -signal.SIGKILL, self.errors()

    def finish(self, timeout=60):
        """Wait for a normal exit; its last stdout line parsed as JSON."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        if self.proc.returncode != 0:
            pytest.fail(f"a child failed (exit {self.proc.returncode}):\n{self.output()}\n{self.errors()}",
                        pytrace=False)
        return json.loads(self.output().strip().splitlines()[-1])

    def cleanup(self):
        for p in (self.out_path, self.err_path):
            if os.path.exists(p):
                os.remove(p)


def child_env(extra=None):
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def parse_lines(out):
    """``(returned appends [(first, n)], states saved [k], begun [(first, n)])`` from a child's stdout."""
    returned, states, begun = [], [], []
    for line in out.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "rows":
            returned.append((int(parts[1]), int(parts[2])))
        elif parts[0] == "state":
            states.append(int(parts[1]))
        elif parts[0] == "begin":
            begun.append((int(parts[1]), int(parts[2])))
    return returned, states, begun


def check_live_rows(store, capacity=None):
    """Every live row bit-exact, the group index exact and the FIFO head where capacity puts it."""
    if capacity is not None:
        assert store.head == max(0, store.next_row - capacity), (store.head, store.next_row, capacity)
    ids = store.row_ids()
    bad = rows_mismatch(store.read(ids), ids)
    assert bad is None, bad
    if len(ids):
        bad = groups_mismatch(store)
        assert bad is None, bad


def assert_verifies(path, allow_warnings=True):
    report = verify_store(path)
    assert report["ok"], report["problems"]
    if not allow_warnings:
        assert report["warnings"] == [], report["warnings"]
    return report


# --------------------------------------------------------------------------- crash points

CRASH_CHILD = """
from diskreplay import ReplayStore
from diskreplay.storage import LocalStorage
path, step, crash_batch, n_appends, capacity, mode, multi = sys.argv[1:8]
crash_batch, n_appends, capacity = int(crash_batch), int(n_appends), int(capacity)
# many writers: a short retain_seconds, so that the test's reopen collects what the crash left;
# "ahead": one long enough for segment names reserved ahead (the test ages the files past it)
kw = {"multi_writer": True, "retain_seconds": 240 if multi == "ahead" else 5} if multi != "single" else {}
if multi == "nofsync":  # a multi-writer store's writer without fsync: the same steps, the same outcomes
    kw["fsync"] = False
if mode == "create":
    os.environ["DISKREPLAY_CRASH_AT"] = step
if mode == "race-v2":  # a multi-writer store of the format before append deltas (full manifests)
    import dataclasses
    from diskreplay import format as fmt
    ReplayStore(path, capacity=capacity, **kw).close()
    dataclasses.replace(fmt.StoreOptions.read(path), append_deltas=False, inline_groups=False).write(path)
    mode = "race"
store = ReplayStore(path, capacity=capacity, **kw)
print("open", flush=True)
for b in range(n_appends):
    if b == crash_batch and mode == "race":
        # another writer (a second store object: its own writer id) commits first, between this
        # commit's read of the newest manifest and its create-if-absent: the append loses the race
        # and rebases; the crash point is counted over this writer's steps only
        rival, real_put, raced = ReplayStore(path), LocalStorage.link_new, []

        def put(self, src, rel):
            if rel.startswith("manifests/") and not raced:
                raced.append(1)
                crash_at = os.environ.pop("DISKREPLAY_CRASH_AT")
                r = rival.extend(expected_rows(np.arange(rival.next_row, rival.next_row + 2)))
                print("rival", int(r[0]), len(r), flush=True)
                os.environ["DISKREPLAY_CRASH_AT"] = crash_at
            return real_put(self, src, rel)

        LocalStorage.link_new = put
    if b == crash_batch and mode not in ("state", "compact"):
        os.environ["DISKREPLAY_CRASH_AT"] = step
    first = store.next_row
    rows = store.extend(expected_rows(np.arange(first, first + batch_size(b))))
    assert rows.tolist() == list(range(first, first + batch_size(b))), (rows, first)
    print("rows", int(rows[0]), len(rows), flush=True)
if mode == "state":
    store.save_state("sampler", state_for(1))
    print("state", 1, flush=True)
    os.environ["DISKREPLAY_CRASH_AT"] = step
    store.save_state("sampler", state_for(2))
    print("state", 2, flush=True)
if mode == "compact":
    assert len(store.manifest.segments) > 1
    os.environ["DISKREPLAY_CRASH_AT"] = step
    store.compact()
    print("compacted", flush=True)
print("done", flush=True)
"""

CAPACITY = 12  # rows: with 3-6 rows per append, every commit evicts and deletes files
N_APPENDS = 9
CRASH_BATCH = 6  # by the 7th commit old manifests and evicted segments are being deleted

DATA_STEPS = ["segment.written", "segment.renamed", "groups.written", "groups.renamed", "segments.synced",
              "manifest.written", "manifest.renamed", "manifest.committed", "gc.manifest", "gc.file"]
STATE_STEPS = ("state.written", "state.renamed", "manifest.written", "manifest.renamed", "gc.manifest", "gc.file")
COMPACT_STEPS = ("segment.written", "segment.renamed", "groups.written", "groups.renamed", "manifest.written",
                 "manifest.renamed", "gc.manifest", "gc.file")
# many writers: the schema is fixed by creating SCHEMA.json ("format.*", no "format.done"), and clean-up
# waits retain_seconds, so no commit of the child deletes anything (no "gc.*")
MULTI_FIRST = ("format.written", "format.renamed")
# a lost race in the middle of the append (the rival commits right before its link): "#2" is the
# retry. An append delta links the same file again ("manifest.written#2": its file is in place). In a
# store of format v2 ("race-v2") the retry's publish rewrites the sidecars for the rows after the
# rival's ("groups.renamed#2"), makes them durable with the new manifest's file ("segments.synced#2",
# "manifest.written#2") and links it.
RACE_STEPS = ("manifest.written#2", "manifest.renamed", "manifest.committed")
RACE_V2_STEPS = ("groups.renamed#2", "segments.synced#2", "manifest.written#2", "manifest.renamed",
                 "manifest.committed")


def _crash_cases():
    cases = []
    for multi in ("single", "multi"):
        keep = (lambda step: not step.startswith("gc.")) if multi == "multi" else (lambda step: True)
        cases += [("format.written", "create", multi), ("format.renamed", "create", multi)]
        cases += [(step, "first", multi) for step in (MULTI_FIRST if multi == "multi" else
                                                       ("format.written", "format.renamed", "format.done"))]
        cases += [(step, "append", multi) for step in DATA_STEPS if keep(step)]
        cases += [(step, "state", multi) for step in STATE_STEPS if keep(step)]
        cases += [(step, "compact", multi) for step in COMPACT_STEPS if keep(step)]
    # a writer without fsync (fsync=False) crashes at the same steps of an append, with and without a race
    cases += [(step, "append", "nofsync") for step in DATA_STEPS if not step.startswith("gc.")]
    # ... and a writer taking its segment names from names reserved ahead
    cases += [(step, "append", "ahead") for step in DATA_STEPS if not step.startswith("gc.")]
    return (cases + [(step, "race", multi) for step in RACE_STEPS for multi in ("multi", "nofsync", "ahead")]
            + [(step, "race-v2", "multi") for step in RACE_V2_STEPS])


CRASH_CASES = _crash_cases()


@pytest.fixture(scope="module")
def crash_runs(request, tmp_path_factory):
    """Run the children of every selected crash case at once (they mostly wait on fsync)."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = [item.callspec.params for item in request.session.items
              if getattr(item, "originalname", None) == "test_crash_point" and hasattr(item, "callspec")]
    root = tmp_path_factory.mktemp("crash")

    def run(case):
        step, mode, multi = case
        path = str(root / f"{multi}-{mode}-{step.replace('#', '-')}")
        crash_batch = 0 if mode == "first" else CRASH_BATCH
        return case, (path, run_child(CRASH_CHILD, path, step, crash_batch, N_APPENDS, CAPACITY, mode, multi))

    with ThreadPoolExecutor(max_workers=6) as pool:
        return dict(pool.map(run, [(p["step"], p["mode"], p["multi"]) for p in wanted]))


def _rows_landed(out, end):
    """Race mode: ``(rival rows, where the in-flight append would land)`` from the child's output."""
    rival = [line.split() for line in out.splitlines() if line.startswith("rival ")]
    if not rival:
        return 0, end
    first, n = int(rival[0][1]), int(rival[0][2])
    assert first == end, (first, end)
    return n, end + n


def check_live_rows_moved(store, capacity, moved_from, moved_to, n):
    """Like :func:`check_live_rows`, where the append of rows ``moved_from..+n`` was rebased to ``moved_to``."""
    assert store.head == max(0, store.next_row - capacity), (store.head, store.next_row, capacity)
    ids = store.row_ids()
    want = np.where((ids >= moved_to) & (ids < moved_to + n), ids - moved_to + moved_from, ids)
    bad = rows_mismatch(store.read(ids), want)
    assert bad is None, bad
    gi = store.group_index()  # the rebased sidecars index the rows the append finally got
    assert sorted(gi.keys) == sorted(set((want // 3).tolist()))
    for g, key in enumerate(gi.keys):
        assert gi.group(g).tolist() == ids[want // 3 == key].tolist(), key


@pytest.mark.parametrize("step,mode,multi", CRASH_CASES, ids=[f"{w}-{m}-{s}" for s, m, w in CRASH_CASES])
def test_crash_point(crash_runs, step, mode, multi):
    """Killed at ``step``: returned appends intact, the in-flight one all-or-nothing, store usable.

    ``multi``: the same on a multi-writer store (``nofsync``: by a writer with ``fsync=False``;
    ``ahead``: by one taking segment names reserved ahead);
    ``race``: the in-flight append also lost a race to another writer in the middle of its commit
    and was rebased after that writer's rows."""
    path, proc = crash_runs[(step, mode, multi)]
    # the child must have died at the crash point, not finished or failed
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    returned, states, _ = parse_lines(proc.stdout)
    end = 0
    for first, n in returned:
        assert first == end
        end += n
    inflight = 0 if mode in ("state", "compact") else batch_size(len(returned))
    rival, landing = _rows_landed(proc.stdout, end)
    assert mode.startswith("race") == (rival > 0), proc.stdout

    landed = []  # race mode: the in-flight batch committed (after the rival's rows)

    def check(store):
        if landed:  # the rival's rows are at their ids, the in-flight batch's after them
            check_live_rows_moved(store, CAPACITY, end, landing, inflight)
        else:
            check_live_rows(store, CAPACITY)

    if not os.path.exists(os.path.join(path, fmt.FORMAT_FILE)):
        # died creating the store: nothing was ever committed
        assert (step, mode) == ("format.written", "create")
        with pytest.raises(FileNotFoundError):
            ReplayStore(path, readonly=True)
    else:
        assert_verifies(path)
        with ReplayStore(path, readonly=True) as ro:
            assert ro.next_row in (landing, landing + inflight), (ro.next_row, end, rival, inflight)
            if rival and inflight and ro.next_row == landing + inflight:
                landed.append(True)
            check(ro)
            if mode == "state":
                assert states == [1]
                st_now = ro.load_state("sampler")
                # the previous state intact, or the new one complete
                assert state_mismatch(st_now, 1) is None or state_mismatch(st_now, 2) is None, st_now
    if multi == "ahead":  # the names it reserved ahead and did not take are left, empty and unnamed
        seg_dir = os.path.join(path, fmt.SEGMENT_DIR)
        assert any(os.path.getsize(os.path.join(seg_dir, n)) == 0 for n in os.listdir(seg_dir))
    if multi != "single":  # time passes, past retain_seconds: the reopen's clean-up takes what the crash left
        old = time.time() - (300 if multi == "ahead" else 10)
        for d, _, names in os.walk(path):
            for name in names:
                os.utime(os.path.join(d, name), (old, old))
    with ReplayStore(path, capacity=CAPACITY) as store:
        before = store.next_row
        check(store)
        rows = store.extend(expected_rows(np.arange(before, before + 4)))
        assert rows.tolist() == list(range(before, before + 4))
        check(store)
        if mode == "state":
            store.save_state("sampler", state_for(3))
    # the writer's reopen removed every temp and orphan file the crash left
    assert_verifies(path, allow_warnings=False)
    with ReplayStore(path, readonly=True) as ro:
        check(ro)
        if mode == "state":
            assert state_mismatch(ro.load_state("sampler"), 3) is None


MERGE_CHILD = """
from diskreplay import ReplayStore
from diskreplay.store import MERGE_FANIN
path, step, multi = sys.argv[1:4]
store = ReplayStore(path, multi_writer=multi == "multi")
if multi == "multi":  # every commit a delta: a checkpoint's full manifest would be a second "manifest.written"
    store._committer._checkpoint_at = 1 << 30  # in the append itself, at a depth each writer draws at random
for b in range(MERGE_FANIN):
    if b == MERGE_FANIN - 1:
        os.environ["DISKREPLAY_CRASH_AT"] = step + "#2"  # the 1st hit is the append's own, the 2nd the merge's
    first = store.next_row
    rows = store.extend(expected_rows(np.arange(first, first + batch_size(b))))
    print("rows", int(rows[0]), len(rows), flush=True)
print("done", flush=True)
"""


@pytest.mark.parametrize("step", ["segment.written", "groups.written", "segments.synced", "manifest.written",
                                  "manifest.renamed", "manifest.committed", "gc.manifest",
                                  "multi:segment.written", "multi:groups.written", "multi:segments.synced",
                                  "multi:manifest.written", "multi:manifest.renamed", "multi:manifest.committed"])
def test_crash_point_in_merge_of_small_segments(tmp_path, step):
    """The merge that follows a small append is its own commit: a crash in it keeps the append. The
    merge's files are written and made durable in the same wait as its manifest's (or, with many
    writers, its rewrite delta's) file, so every step of that wait is a crash point of the merge."""
    from diskreplay.store import MERGE_FANIN

    path = str(tmp_path / "store")
    multi, _, step = step.rpartition(":")
    if multi:  # the shortest retain_seconds that names reserved ahead take (the test ages files past it)
        ReplayStore(path, multi_writer=True, retain_seconds=240).close()
    proc = run_child(MERGE_CHILD, path, step, multi or "single")
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    returned, _, _ = parse_lines(proc.stdout)
    assert len(returned) == MERGE_FANIN - 1
    total = sum(batch_size(b) for b in range(MERGE_FANIN))
    assert_verifies(path)
    with ReplayStore(path, readonly=True) as ro:
        assert ro.next_row == total  # the last append committed before its merge began
        assert len(ro.manifest.segments) in (1, MERGE_FANIN)
        check_live_rows(ro)
    if multi:  # time passes, past retain_seconds: the reopen's clean-up takes what the crash left
        old = time.time() - 300
        for d, _, names in os.walk(path):
            for name in names:
                os.utime(os.path.join(d, name), (old, old))
    with ReplayStore(path) as store:
        store.extend(expected_rows(np.arange(total, total + 3)))
        check_live_rows(store)
    assert_verifies(path, allow_warnings=False)


@pytest.mark.parametrize("sizes", [(1, 2, 3), (1, 40)], ids=["similar", "alternating"])
def test_small_appends_are_merged(tmp_path, sizes):
    from diskreplay.store import MERGE_FANIN, MERGE_RATIO

    path = str(tmp_path / "store")
    most = 0
    with ReplayStore(path) as store:
        for b in range(MERGE_FANIN ** 2 + 3):
            store.extend(expected_rows(np.arange(store.next_row, store.next_row + sizes[b % len(sizes)])))
            most = max(most, len(store.manifest.segments))
        counts = [s.num_rows for s in store.manifest.segments]
        check_live_rows(store)
    # 259 small appends became a few segments, oldest rows in the largest
    assert most <= MERGE_FANIN * MERGE_RATIO and len(counts) < MERGE_FANIN * MERGE_RATIO // 2, counts
    assert counts[0] >= MERGE_FANIN * min(sizes)
    assert_verifies(path, allow_warnings=False)
    with ReplayStore(path, readonly=True) as ro:
        check_live_rows(ro)


def test_merges_stay_small_against_the_capacity(tmp_path):
    """A file goes only when all its rows are evicted: merging must not make one hold a
    large share of the capacity (disk use would then overshoot it)."""
    from diskreplay.store import MERGE_CAPACITY_SHARE, MERGE_FANIN

    for capacity, merged in ((64, False), (40 * MERGE_FANIN * MERGE_CAPACITY_SHARE, True)):
        path = str(tmp_path / f"store{capacity}")
        with ReplayStore(path, capacity=capacity) as store:
            for _ in range(3 * MERGE_FANIN):
                store.extend(expected_rows(np.arange(store.next_row, store.next_row + 2)))
            biggest = max(s.num_rows for s in store.manifest.segments)
            check_live_rows(store, capacity)
        assert (biggest > 2) == merged and biggest * MERGE_CAPACITY_SHARE <= capacity, biggest


def test_merges_keep_up_with_random_small_appends_under_a_capacity(tmp_path):
    """A run of mergeable segments longer than MERGE_FANIN (the capacity rule blocked it, or
    the ratio rule let it grow) is merged window by window, not left to grow past merging."""
    from diskreplay.store import MERGE_FANIN, MERGE_RATIO

    rng = np.random.default_rng(0)
    path = str(tmp_path / "store")
    with ReplayStore(path, capacity=1000) as store:
        for _ in range(600):
            store.extend(expected_rows(np.arange(store.next_row, store.next_row + int(rng.integers(1, 13)))))
        segments = len(store.manifest.segments)
        check_live_rows(store, 1000)
    assert segments < MERGE_FANIN * MERGE_RATIO // 2, segments
    assert_verifies(path, allow_warnings=False)


def test_small_segments_before_a_large_append_are_merged(tmp_path):
    """An append of max_bytes or more closes the run of small segments before it (no window takes
    them any more): they were left as they were, ~13 more per large append for good; now merged."""
    from diskreplay.store import MergePolicy

    policy = MergePolicy(max_bytes=20_000)
    path = str(tmp_path / "store")
    with ReplayStore(path, merge_policy=policy) as store:
        for small, large in ((5, 400), (7, 400), (3, 0)):
            for _ in range(small):
                store.extend(expected_rows(np.arange(store.next_row, store.next_row + 2)))
            if large:
                store.extend(expected_rows(np.arange(store.next_row, store.next_row + large)))
        sizes = [(s.num_rows, s.bytes >= policy.max_bytes) for s in store.manifest.segments]
        check_live_rows(store)
    assert sizes == [(10, False), (400, True), (14, False), (400, True), (2, False), (2, False), (2, False)], sizes
    assert_verifies(path, allow_warnings=False)


def test_merge_policies_that_cannot_work_are_refused():
    """fanin=1 made every extend merge one segment into one, for ever; at ratio >= fanin a merged segment
    is its inputs' peer again (every append merged once more)."""
    from diskreplay import ArgumentError
    from diskreplay.store import MergePolicy

    for kw, says in ((dict(fanin=1), "fanin must be an integer >= 3"), (dict(ratio=0), "ratio must be"),
                     (dict(fanin=4, ratio=4), "ratio < fanin"), (dict(max_bytes=0), "max_bytes"),
                     (dict(fanin=2.5), "fanin must be an integer")):
        with pytest.raises(ArgumentError, match=says):
            MergePolicy(**kw)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=300), st.sampled_from([(16, 4), (4, 3), (8, 2), (3, 2)]),
       st.sampled_from([None, 400, 5000]))
def test_merge_windows_keep_the_small_segments_few(sizes, shape, capacity):
    """The merge policy alone, on any sequence of append sizes: each planned merge is ``fanin`` (or,
    when no window forms, ``fanin * ratio``) consecutive small segments, and once every due merge
    is done fewer than ``fanin * ratio`` small segments are left; with a capacity, no merge makes
    a segment hold more than its share."""
    from diskreplay.store import MergePolicy

    fanin, ratio = shape
    policy = MergePolicy(fanin=fanin, ratio=ratio, max_bytes=20_000)
    options = fmt.StoreOptions(capacity_rows=capacity)
    segs, next_id, next_row = [], 0, 0
    for n in sizes:
        segs.append(fmt.SegmentEntry(next_id, next_row, n, 100 * n, 0))
        next_id, next_row = next_id + 1, next_row + n
        head, kept, _ = fmt.evict(0, next_row, tuple(segs), options)
        segs = list(kept)
        while True:
            windows = list(policy.windows(segs, options))
            if not windows:
                break
            assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:]))  # oldest first, apart
            start, stop = windows[0]
            closed = stop < len(segs) and segs[stop].bytes >= 20_000  # a run a large segment closed
            assert stop - start in (fanin, fanin * ratio) or closed and stop - start >= 2, (start, stop)
            assert all(s.bytes < 20_000 for s in segs[start:stop])
            run = segs[start:stop]
            merged = fmt.SegmentEntry(next_id, run[0].first_row, sum(s.num_rows for s in run),
                                      sum(s.bytes for s in run), 0)
            assert capacity is None or merged.num_rows * policy.capacity_share <= capacity
            segs[start:stop] = [merged]
            next_id += 1
        assert all(a.end_row == b.first_row for a, b in zip(segs, segs[1:]))
        small = 0
        while small < len(segs) and segs[-1 - small].bytes < 20_000:
            small += 1
        mergeable = capacity is None or fanin * ratio * 40 * policy.capacity_share <= capacity
        assert small < fanin * ratio or not mergeable, [s.num_rows for s in segs]
        big = len(segs) - small - 1  # the small segments before the newest large one: one at most
        assert big < 0 or not mergeable or big == 0 or segs[big - 1].bytes >= 20_000 or \
            (big < 2 or segs[big - 2].bytes >= 20_000), [s.bytes for s in segs]


# --------------------------------------------------------------------------- random SIGKILL

KILL_CHILD = """
from diskreplay import ReplayStore
path, seed, capacity, fsync = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "True"
rng = np.random.default_rng(seed)
store = ReplayStore(path, capacity=capacity, fsync=fsync)
saved = store.load_state("sampler")
k = saved["k"] if saved else 0
print("open", flush=True)
while True:
    if rng.random() < 0.15:
        k += 1
        print("savestate", k, flush=True)
        store.save_state("sampler", state_for(k))
        print("state", k, flush=True)
    else:
        first, n = store.next_row, int(rng.integers(1, 13))
        print("begin", first, n, flush=True)
        rows = store.extend(expected_rows(np.arange(first, first + n)))
        print("rows", int(rows[0]), len(rows), flush=True)
"""


@pytest.mark.parametrize("fsync", [True, False])
def test_random_sigkill_with_eviction(tmp_path, fsync):
    """>= 20 SIGKILLs at random moments of appends, evictions, GC and state saves lose nothing,
    with fsync and without (``fsync=False`` gives up only power-loss safety: the kernel holds the
    bytes of a killed process)."""
    path = str(tmp_path / "store")
    capacity = 40
    rng = random.Random(20240611)
    end, k_saved = 0, 0
    stats = {"kills": 0, "inflight_committed": 0, "inflight_lost": 0, "state_inflight": 0}
    while stats["kills"] < 22:
        child = Child(KILL_CHILD, path, stats["kills"], capacity, fsync)
        child.wait_for("open")
        time.sleep(rng.uniform(0.0, 0.1))
        child.kill()
        stats["kills"] += 1
        text = child.output()
        child.cleanup()
        returned, states, begun = parse_lines(text)
        for first, n in returned:
            assert first == end, (first, end)
            end += n
        # an append that began but never printed its rows was in flight at the kill
        pending = begun[-1][1] if begun and begun[-1][0] == end else 0
        saving = [int(line.split()[1]) for line in text.splitlines() if line.startswith("savestate")]
        k_saved = states[-1] if states else k_saved
        state_pending = saving[-1] if saving and saving[-1] > k_saved else None

        assert_verifies(path)
        with ReplayStore(path, readonly=True) as ro:
            assert ro.next_row in (end, end + pending), (ro.next_row, end, pending)
            if pending:
                stats["inflight_committed" if ro.next_row > end else "inflight_lost"] += 1
            end = ro.next_row
            check_live_rows(ro, capacity)
            st_now = ro.load_state("sampler")
            if state_pending is not None:
                stats["state_inflight"] += 1
                if state_mismatch(st_now, state_pending) is None:
                    k_saved = state_pending
            if k_saved:
                assert state_mismatch(st_now, k_saved) is None, st_now
            else:
                assert st_now is None
    # a final writer open (cleans up after the last kill) and an append
    with ReplayStore(path, capacity=capacity) as store:
        store.extend(expected_rows(np.arange(store.next_row, store.next_row + 5)))
        check_live_rows(store, capacity)
    assert_verifies(path, allow_warnings=False)
    assert stats["kills"] >= 20
    # most kills land inside an append: the loop does little else
    assert stats["inflight_committed"] + stats["inflight_lost"] >= 5, stats


def test_killed_writer_leaves_no_lock(tmp_path):
    path = str(tmp_path / "store")
    child = Child(KILL_CHILD, path, 7, 30, True)
    child.wait_for("rows")
    with pytest.raises(StoreLockedError):
        ReplayStore(path)
    child.kill()
    child.cleanup()
    with ReplayStore(path) as store:  # immediately: the kernel dropped the flock with the process
        check_live_rows(store, 30)
        store.extend(expected_rows(np.arange(store.next_row, store.next_row + 2)))


# --------------------------------------------------------------------------- I/O errors


def snapshot(path):
    """Every file of the store but LOCK, with its bytes."""
    out = {}
    for d, _, names in os.walk(path):
        for name in names:
            full = os.path.join(d, name)
            rel = os.path.relpath(full, path)
            if rel != fmt.LOCK_FILE:
                with open(full, "rb") as f:
                    out[rel] = f.read()
    return out


RLIMIT_CHILD = """
import errno, resource, signal
from diskreplay import ReplayStore
path = sys.argv[1]

def files():
    out = {}
    for d, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(d, name), path)
            if rel != "LOCK":
                out[rel] = open(os.path.join(d, name), "rb").read().hex()
    return out

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
store = ReplayStore(path, capacity=1000)
store.extend(expected_rows(np.arange(0, 5)))
before, gen = files(), store.generation
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
result = {}
try:
    store.extend(expected_rows(np.arange(5, 205)))
    result["error"] = None
except OSError as exc:
    result["error"] = exc.errno
result["unchanged"] = files() == before and store.generation == gen
result["rows_ok"] = rows_mismatch(store.read(store.row_ids()), store.row_ids()) is None and len(store) == 5
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # "space returns": raise the soft limit back
rows = store.extend(expected_rows(np.arange(5, 205)))
result["after"] = [int(rows[0]), len(rows)]
result["after_ok"] = rows_mismatch(store.read(store.row_ids()), store.row_ids()) is None
print(json.dumps(result), flush=True)
"""


def test_file_size_limit_fails_cleanly(tmp_path):
    """RLIMIT_FSIZE (EFBIG, like a full disk): extend raises, store unchanged, next extend works."""
    path = str(tmp_path / "store")
    proc = run_child(RLIMIT_CHILD, path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"error": errno.EFBIG, "unchanged": True, "rows_ok": True, "after": [5, 200],
                      "after_ok": True}
    assert_verifies(path, allow_warnings=False)
    with ReplayStore(path, readonly=True) as ro:
        assert len(ro) == 205
        check_live_rows(ro)


class Faults:
    """Make the k-th call of ``os.write`` or ``os.fsync`` raise ``OSError(code)``.

    Records whether the commit's manifest had already been renamed into place
    when the fault hit (then the commit is visible and the case differs).
    """

    def __init__(self, monkeypatch, call, k, code, manifest_path):
        self.calls, self.hit, self.after_rename = 0, False, None
        self.commit_calls = None  # calls up to the first one after the manifest appeared
        real = getattr(os, call)
        lock = threading.Lock()  # a commit fsyncs its files from several threads at once

        def faulty(*args):
            with lock:
                self.calls += 1
                n = self.calls
                if self.commit_calls is None and manifest_path and os.path.exists(manifest_path):
                    self.commit_calls = n
            if n == k:
                self.hit = True
                self.after_rename = os.path.exists(manifest_path)
                raise OSError(code, f"{os.strerror(code)} (injected into os.{call} call {k})")
            return real(*args)

        monkeypatch.setattr(os, call, faulty)


def _base_store(root):
    path = os.path.join(root, "store")
    with ReplayStore(path, capacity=10) as store:
        for b in range(3):
            store.extend(expected_rows(np.arange(store.next_row, store.next_row + 4)))
        store.save_state("sampler", state_for(1))
    return path


def _append(store):
    n = store.next_row
    return store.extend(expected_rows(np.arange(n, n + 4)))


def _save(store):
    store.save_state("sampler", state_for(2))


def _count_calls(tmp_path, monkeypatch, op=_append):
    """How many os.write / os.fsync calls one ``op(store)`` makes up to its commit point and the
    first call after it (the clean-up's later calls only warn: the commit stands)."""
    counts = {}
    for call in ("write", "fsync"):
        path = _base_store(str(tmp_path / f"count-{op.__name__}-{call}"))
        with ReplayStore(path) as store, monkeypatch.context() as mp:
            f = Faults(mp, call, 10 ** 9, errno.EIO, os.path.join(path, fmt.manifest_file(store.generation + 1)))
            op(store)
            counts[call] = f.commit_calls or f.calls
    return counts


def _inject(tmp_path, monkeypatch, call, k, code, case, op=_append):
    path = _base_store(str(tmp_path / case))
    store = ReplayStore(path)
    before, gen, n = snapshot(path), store.generation, store.next_row
    new_manifest = os.path.join(path, fmt.manifest_file(gen + 1))
    with monkeypatch.context() as mp:
        f = Faults(mp, call, k, code, new_manifest)
        with pytest.raises(OSError) as info:
            op(store)
    assert f.hit and info.value.errno == code
    return path, store, before, gen, n, f.after_rename


def test_io_errors_before_commit_leave_previous_commit(tmp_path, monkeypatch):
    """ENOSPC/EIO from any os.write or os.fsync before the commit point: clean error, nothing changed."""
    counts = _count_calls(tmp_path, monkeypatch)
    assert counts["write"] >= 3 and counts["fsync"] >= 5, counts
    cases = 0
    for call in ("write", "fsync"):
        for k in range(1, counts[call] + 1):
            for code in (errno.ENOSPC, errno.EIO):
                path, store, before, gen, n, after_rename = _inject(tmp_path, monkeypatch, call, k, code,
                                                                    f"{call}{k}-{code}")
                if after_rename:
                    store.close()
                    continue  # the commit is already visible: test_io_error_after_commit_point
                cases += 1
                # same files, same bytes, same generation, same rows
                assert snapshot(path) == before, (call, k)
                assert store.generation == gen and store.next_row == n
                check_live_rows(store, 10)
                with ReplayStore(path, readonly=True) as ro:
                    assert ro.generation == gen
                    check_live_rows(ro, 10)
                # space returns: the same writer appends again
                rows = store.extend(expected_rows(np.arange(n, n + 4)))
                assert rows.tolist() == list(range(n, n + 4))
                assert state_mismatch(store.load_state("sampler"), 1) is None
                store.close()
                assert_verifies(path, allow_warnings=False)
                with ReplayStore(path, readonly=True) as ro:
                    assert ro.next_row == n + 4
                    check_live_rows(ro, 10)
    assert cases >= 2 * (counts["write"] + counts["fsync"] - 1)


def test_io_error_after_commit_point(tmp_path, monkeypatch):
    """A fault after the manifest rename: the commit may stand or not, but row ids never go back."""
    counts = _count_calls(tmp_path, monkeypatch)
    path, store, before, gen, n, after_rename = _inject(tmp_path, monkeypatch, "fsync", counts["fsync"],
                                                        errno.EIO, "last-fsync")
    assert after_rename  # the last fsync of a commit is the manifest directory's
    reader = ReplayStore(path, readonly=True)
    seen = reader.next_row  # a reader may already see the commit whose extend raised
    assert seen in (n, n + 4)
    check_live_rows(reader, 10)
    try:
        rows = store.extend(expected_rows(np.arange(store.next_row, store.next_row + 2)))
    except CorruptStoreError:
        # refusing to write until reopened is a fine answer too
        store.close()
        store = ReplayStore(path)
        rows = store.extend(expected_rows(np.arange(store.next_row, store.next_row + 2)))
    store.close()
    assert rows[0] >= seen, f"the retry got row ids {rows.tolist()} although rows up to {seen - 1} were visible"
    reader.refresh()
    assert reader.next_row == rows[-1] + 1
    check_live_rows(reader, 10)
    assert_verifies(path)


def test_io_errors_in_save_state_before_commit(tmp_path, monkeypatch):
    """ENOSPC/EIO while saving a sampler state: the previous state and rows stay, the next save works."""
    counts = _count_calls(tmp_path, monkeypatch, _save)
    cases = 0
    for call in ("write", "fsync"):
        for k in range(1, counts[call] + 1):
            path, store, before, gen, n, after_rename = _inject(tmp_path, monkeypatch, call, k, errno.ENOSPC,
                                                                f"state-{call}{k}", _save)
            if after_rename:
                store.close()
                continue  # test_io_error_in_save_state_after_commit_point
            cases += 1
            after = snapshot(path)
            orphan = fmt.state_file("sampler", gen + 1)
            if orphan in after and orphan not in before:
                # the fault hit the state directory's fsync after the rename; the
                # file is garbage (see test_failed_save_state_leaves_no_orphan)
                del after[orphan]
            assert after == before, (call, k)
            assert store.generation == gen
            assert state_mismatch(store.load_state("sampler"), 1) is None
            _save(store)
            assert state_mismatch(store.load_state("sampler"), 2) is None
            store.close()
            assert_verifies(path, allow_warnings=False)
            with ReplayStore(path, readonly=True) as ro:
                assert state_mismatch(ro.load_state("sampler"), 2) is None
                check_live_rows(ro, 10)
    assert cases >= counts["write"] + counts["fsync"] - 1


def test_failed_save_state_leaves_no_orphan(tmp_path, monkeypatch):
    path, store, before, gen, n, after_rename = _inject(tmp_path, monkeypatch, "fsync", 2, errno.EIO,
                                                        "state-orphan", _save)
    assert not after_rename
    assert snapshot(path) == before


def test_io_error_in_save_state_after_commit_point(tmp_path, monkeypatch):
    counts = _count_calls(tmp_path, monkeypatch, _save)
    path, store, before, gen, n, after_rename = _inject(tmp_path, monkeypatch, "fsync", counts["fsync"],
                                                        errno.EIO, "state-last-fsync", _save)
    assert after_rename
    store.close()
    with ReplayStore(path, readonly=True) as ro:
        st_now = ro.load_state("sampler")
        assert state_mismatch(st_now, 1) is None or state_mismatch(st_now, 2) is None
    assert_verifies(path)


# --------------------------------------------------------------------------- torn and flipped files


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A store of 4 commits of rows and one saved state: generations 2..5 on disk."""
    path = str(tmp_path_factory.mktemp("template") / "store")
    with ReplayStore(path, capacity=1000) as store:
        for b in range(4):
            store.extend(expected_rows(np.arange(store.next_row, store.next_row + 12 + b)))
        store.save_state("sampler", state_for(1))
        assert store.generation == 5
        files = {
            "segment": [s.file for s in store.manifest.segments],
            "groups": [s.groups_file for s in store.manifest.segments],
            "manifest": [fmt.manifest_file(5)],
            "old-manifest": [fmt.manifest_file(g) for g in (2, 3, 4)],
            "FORMAT": [fmt.FORMAT_FILE],
            "state": [st.file for st in store.manifest.states.values()],
        }
    return path, files


def in_fork(fn, *args, timeout=60):
    """Run ``fn(*args)`` in a forked child; its JSON result, or ``{"outcome": "crash"}`` if it died."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            signal.alarm(timeout)
            res = fn(*args)
        except BaseException as exc:
            res = {"outcome": "other", "error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(res).encode()[:60000])
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        return {"outcome": "crash", "error": f"the reading process died (signal {sig})"}
    return json.loads(b"".join(chunks))


def probe(path):
    """Open read-only and read everything; classify what the store served."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store = ReplayStore(path, readonly=True)
        gen, ids = store.generation, store.row_ids()
        bad = rows_mismatch(store.read(ids), ids) or groups_mismatch(store)
        if bad is None:
            st_now = store.load_state("sampler")
            if gen >= 5 or st_now is not None:
                bad = state_mismatch(st_now, 1)
        if bad is not None:
            return {"outcome": "wrong", "error": bad, "generation": gen}
        return {"outcome": "ok", "generation": gen}
    except (CorruptStoreError, FormatError) as exc:
        return {"outcome": "error", "error": str(exc)}


def damage(template, kind, data, mode):
    """Copy the template and truncate or bit-flip one file of ``kind``; (path, rel, offset)."""
    src, files = template
    rel = data.draw(st.sampled_from(files[kind]), label="file")
    dst = tempfile.mkdtemp(prefix="damaged-")
    path = os.path.join(dst, "store")
    shutil.copytree(src, path)
    full = os.path.join(path, rel)
    with open(full, "rb") as f:
        raw = bytearray(f.read())
    offset = data.draw(st.integers(0, len(raw) - 1), label="offset")
    if mode == "truncate":
        raw = raw[:offset]
    else:
        raw[offset] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    with open(full, "wb") as f:
        f.write(raw)
    return path, rel


def check_damaged(path, rel, kind):
    try:
        res = in_fork(probe, path)
        # never data different from what was written, never a crash or a foreign exception
        assert res["outcome"] in ("ok", "error"), (rel, res)
        if res["outcome"] == "error":
            assert os.path.basename(rel) in res["error"], (rel, res)
        elif kind == "manifest":
            assert res["generation"] == 4  # fell back to the previous intact manifest
        else:
            assert res["generation"] == 5
        report = verify_store(path)
        assert not report["ok"] and any(rel in p for p in report["problems"]), (rel, report)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


DAMAGE_SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                           phases=[Phase.explicit, Phase.generate],
                           suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow])


@pytest.mark.parametrize("kind", ["segment", "groups", "manifest", "old-manifest", "FORMAT", "state"])
@DAMAGE_SETTINGS
@given(data=st.data())
def test_truncated_file_is_detected(template, kind, data):
    path, rel = damage(template, kind, data, "truncate")
    check_damaged(path, rel, kind)


FLIP_BUG = ("store bug: {} crc32c is not checked when the store opens it, so bit flips are served as data "
            "or crash the reading process (SIGSEGV/SIGBUS) or raise foreign exceptions")


@pytest.mark.parametrize("kind", [
    "segment",
    "groups",
    "manifest", "old-manifest", "state"])
@DAMAGE_SETTINGS
@given(data=st.data())
def test_flipped_bit_is_detected(template, kind, data):
    path, rel = damage(template, kind, data, "flip")
    check_damaged(path, rel, kind)


def test_flipped_format_json_is_detected(template, tmp_path):
    path = str(tmp_path / "store")
    shutil.copytree(template[0], path)
    full = os.path.join(path, fmt.FORMAT_FILE)
    raw = open(full, "rb").read()
    assert b'"capacity_rows":1000' in raw
    with open(full, "wb") as f:
        f.write(raw.replace(b'"capacity_rows":1000', b'"capacity_rows":1001'))  # one bit: '0' ^ 1 == '1'
    report = verify_store(path)
    assert not report["ok"] and any(fmt.FORMAT_FILE in p for p in report["problems"]), report


# --------------------------------------------------------------------------- concurrency

WRITER_CHILD = """
from diskreplay import ReplayStore
path, min_commits, capacity, readers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(1)
store = ReplayStore(path, capacity=capacity)
print("open", flush=True)
commits = 0
# Counted, not timed: commit until every reader has done its share of reads (on a loaded
# machine the readers may start long after the writer, or run slowly), and at least min_commits.
while commits < min_commits or not all(os.path.exists(f"{path}.reader-{k}.done") for k in range(readers)):
    first = store.next_row
    store.extend(expected_rows(np.arange(first, first + int(rng.integers(1, 11)))))
    commits += 1
    if commits % 10 == 0:
        store.compact()  # rewrite the live rows under the readers' feet
        commits += 1
print(json.dumps({"commits": commits, "rows": int(store.next_row)}), flush=True)
"""

READER_CHILD = """
import diskreplay
from diskreplay import ReplayStore, RowsEvictedError
path, reads, refreshes, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(seed)
while True:  # the writer creates the store; wait for its first commit
    try:
        store = ReplayStore(path, readonly=True)
        if len(store):
            break
        store.close()
    except FileNotFoundError:
        pass
    time.sleep(0.01)
stats = {"reads": 0, "rows": 0, "evicted": 0, "refreshes": 0, "group_checks": 0}

# Counted, not timed: the writer keeps committing until this reader has done `reads` reads
# and followed it through `refreshes` new commits, however slowly either of them runs.
while stats["reads"] < reads or stats["refreshes"] < refreshes:
    try:
        stats["refreshes"] += bool(store.refresh())
        head, nxt = store.head, store.next_row
        rows = rng.integers(head, nxt, size=int(rng.integers(1, 24)))
        got = store.read(rows)
    except RowsEvictedError:
        stats["evicted"] += 1  # evicted between refresh and read: allowed
        continue
    bad = rows_mismatch(got, rows)
    if bad:
        print("WRONG", rows.tolist(), bad, flush=True)
        sys.exit(3)
    stats["reads"] += 1
    stats["rows"] += len(rows)
    if stats["reads"] % 10 == 0:
        try:
            bad = groups_mismatch(store)
        except RowsEvictedError:
            continue
        if bad:
            print("WRONG groups", bad, flush=True)
            sys.exit(3)
        stats["group_checks"] += 1
open(f"{path}.reader-{seed}.done", "w").close()
print(json.dumps(stats), flush=True)
"""

READS, REFRESHES = 100, 10


def test_readers_during_writes_and_eviction(tmp_path):
    """One writer evicting constantly, four readers: every row served is the row written.

    Counted, not timed, so a loaded machine makes it slower, never failing: each reader does
    READS reads across at least REFRESHES commits, and the writer commits until they are done.
    """
    path = str(tmp_path / "store")
    writer = Child(WRITER_CHILD, path, 30, 25, 4)
    readers = [Child(READER_CHILD, path, READS, REFRESHES, seed) for seed in range(4)]
    writer.wait_for("open", timeout=600)
    # while the writer runs, a second writer is refused
    with pytest.raises(StoreLockedError):
        ReplayStore(path)
    # the timeouts only stop a hung child; no count above depends on speed
    results = [child.finish(timeout=600) for child in readers + [writer]]
    for child in readers + [writer]:
        child.cleanup()
    w = results[-1]
    assert w["commits"] >= 30
    for r in results[:-1]:
        assert r["reads"] >= READS and r["refreshes"] >= REFRESHES, r
    assert_verifies(path)
    with ReplayStore(path, readonly=True) as ro:
        assert ro.next_row == w["rows"]
        check_live_rows(ro, 25)


def test_reader_refresh_survives_gc(tmp_path, monkeypatch):
    """A reader descheduled between reading a manifest and its sidecars (made deterministic)."""
    path = str(tmp_path / "store")
    writer = ReplayStore(path, capacity=8)
    writer.extend(expected_rows(np.arange(0, 4)))
    reader = ReplayStore(path, readonly=True)
    reader.group_index()  # the reader now follows the group index
    writer.extend(expected_rows(np.arange(4, 8)))
    real = fmt.load_newest_manifest

    def slow_load(root, **kw):
        result = real(root, **kw)
        for _ in range(fmt.KEEP_MANIFESTS + 1):  # the writer runs on while the reader sleeps
            writer.extend(expected_rows(np.arange(writer.next_row, writer.next_row + 4)))
        return result

    monkeypatch.setattr(fmt, "load_newest_manifest", slow_load)
    try:
        reader.refresh()
    except RowsEvictedError:
        pass
    monkeypatch.setattr(fmt, "load_newest_manifest", real)
    reader.refresh()
    check_live_rows(reader, 8)


def test_stale_listing_is_not_an_empty_store(tmp_path, monkeypatch):
    """A reader whose listing of manifests/ names only manifests the writer has since
    deleted lists again; it never takes the store for an empty one or goes back."""
    path = str(tmp_path / "store")
    writer = ReplayStore(path, capacity=8)
    writer.extend(expected_rows(np.arange(0, 4)))
    reader = ReplayStore(path, readonly=True)
    stale = fmt.list_generations(path)
    for _ in range(fmt.KEEP_MANIFESTS + 1):
        writer.extend(expected_rows(np.arange(writer.next_row, writer.next_row + 4)))
    assert not set(stale) & set(fmt.list_generations(path))
    real, calls = fmt.list_generations, []

    def listing(root):
        calls.append(root)
        return real(root) if len(calls) > 2 else [g + 10 for g in real(root)] + stale

    monkeypatch.setattr(fmt, "list_generations", listing)
    assert reader.refresh()
    monkeypatch.setattr(fmt, "list_generations", real)
    assert reader.generation == writer.generation and len(reader) == 8
    check_live_rows(reader, 8)
    m, _ = fmt.load_newest_manifest(path)
    assert m.generation == writer.generation
    # a commit older than the one held is never installed
    monkeypatch.setattr(fmt, "load_newest_manifest", lambda root, **kw: (fmt.Manifest(), []))
    monkeypatch.setattr(fmt, "list_generations", lambda root: [writer.generation + 1])
    assert not reader.refresh() and len(reader) == 8



def _fall_behind(writer, commits=fmt.KEEP_MANIFESTS + 1):
    """Let the writer run far enough ahead (compaction renumbers every segment) that the
    files of a reader's commit are collected."""
    for _ in range(2):
        writer.extend(expected_rows(np.arange(writer.next_row, writer.next_row + 4)))
    writer.compact()
    for k in range(commits):
        writer.save_state("s", state_for(k + 1))


def test_stale_reader_group_index_by_another_column(tmp_path):
    path = str(tmp_path / "store")
    writer = ReplayStore(path)
    writer.extend(expected_rows(np.arange(0, 4)))
    reader = ReplayStore(path, readonly=True)  # holds generation 1, has mapped nothing
    _fall_behind(writer)
    gi = reader.group_index("rewards")  # another per-row column: built from the segments
    assert reader.generation == writer.generation
    want = writer.group_index("rewards")
    assert gi.keys == want.keys and [gi.group(g).tolist() for g in range(len(gi))] == \
        [want.group(g).tolist() for g in range(len(want))]
    assert int(gi.counts.sum()) == len(writer)


def test_stale_reader_load_state(tmp_path):
    path = str(tmp_path / "store")
    writer = ReplayStore(path)
    writer.extend(expected_rows(np.arange(0, 4)))
    writer.save_state("sampler", state_for(1))
    reader = ReplayStore(path, readonly=True)
    for k in range(2, 3 + fmt.KEEP_MANIFESTS):
        writer.save_state("sampler", state_for(k))
    assert state_mismatch(reader.load_state("sampler"), 2 + fmt.KEEP_MANIFESTS) is None


def test_reader_opening_during_the_first_commit_has_the_schema(tmp_path, monkeypatch):
    path = str(tmp_path / "store")
    writer = ReplayStore(path)  # FORMAT.json without a schema, no manifest yet
    real = fmt.load_newest_manifest

    def racing(root, **kw):
        if not getattr(racing, "done", False):
            racing.done = True
            writer.extend(expected_rows(np.arange(0, 4)))  # the first commit lands mid-open
        return real(root, **kw)

    monkeypatch.setattr(fmt, "load_newest_manifest", racing)
    reader = ReplayStore(path, readonly=True)
    monkeypatch.setattr(fmt, "load_newest_manifest", real)
    assert reader.schema is not None
    check_live_rows(reader)


def test_reader_takes_the_schema_of_the_first_commit(tmp_path, monkeypatch):
    """A first extend that failed after writing FORMAT.json fixed nothing: a reader that
    opened then takes the schema of the first commit that lands."""
    import diskreplay.store as store_mod

    path = str(tmp_path / "store")
    writer = ReplayStore(path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.writing.SegmentWriter, "write", full)
    first = expected_rows(np.arange(0, 4))
    first["extra"] = np.arange(4, dtype=np.int64)
    with pytest.raises(OSError):
        writer.extend(first)
    monkeypatch.undo()
    reader = ReplayStore(path, readonly=True)
    assert reader.columns == [] and len(reader) == 0  # FORMAT.json's schema is no commit's
    writer.extend(expected_rows(np.arange(0, 4)))  # another schema: allowed, no row was committed
    assert reader.refresh()
    assert "extra" not in reader.columns
    check_live_rows(reader)


def test_compact_does_not_launder_damaged_data(tmp_path):
    path = str(tmp_path / "store")
    with ReplayStore(path) as store:
        for k in range(3):
            store.extend(expected_rows(np.arange(600 * k, 600 * k + 600)))  # segments of many 8 KiB pages
        seg = store.manifest.segments[1]
    _flip(path, seg.file, offset=seg.bytes // 2)  # a data page, checked only when a read touches it
    with ReplayStore(path) as store:
        before = sorted(os.listdir(os.path.join(path, fmt.SEGMENT_DIR)))
        with pytest.raises(CorruptStoreError, match=os.path.basename(seg.file)):
            store.compact()
        assert len(store.manifest.segments) == 3
        assert sorted(os.listdir(os.path.join(path, fmt.SEGMENT_DIR))) == before
    assert not verify_store(path)["ok"]


def test_garbage_collection_failure_does_not_fail_a_commit(tmp_path, monkeypatch):
    import diskreplay.storage.local as store_mod

    path = str(tmp_path / "store")
    store = ReplayStore(path, capacity=4)
    for k in range(fmt.KEEP_MANIFESTS):
        store.extend(expected_rows(np.arange(4 * k, 4 * k + 4)))

    def denied(p):
        raise PermissionError(errno.EACCES, "Permission denied", p)

    monkeypatch.setattr(store_mod, "remove_quietly", denied)
    with pytest.warns(RuntimeWarning, match="is committed"):
        rows = store.extend(expected_rows(np.arange(16, 20)))
    assert rows.tolist() == [16, 17, 18, 19]
    monkeypatch.undo()
    store.close()
    with ReplayStore(path) as again:  # the next writer open collects what was left
        check_live_rows(again, 4)
    assert_verifies(path, allow_warnings=False)


def test_new_store_directory_entry_is_synced(tmp_path, monkeypatch):
    import diskreplay.storage.local as store_mod  # (the storage makes a new store's root and syncs it)

    synced = []
    real = store_mod.fsync_dir
    monkeypatch.setattr(store_mod, "fsync_dir", lambda p: (synced.append(os.path.abspath(p)), real(p)))
    ReplayStore(str(tmp_path / "new")).close()
    assert str(tmp_path) in synced and str(tmp_path / "new") in synced


def test_stale_reader_group_index(tmp_path):
    path = str(tmp_path / "store")
    writer = ReplayStore(path, capacity=8)
    writer.extend(expected_rows(np.arange(0, 4)))
    reader = ReplayStore(path, readonly=True)
    for _ in range(fmt.KEEP_MANIFESTS + 1):
        writer.extend(expected_rows(np.arange(writer.next_row, writer.next_row + 4)))
    try:
        gi = reader.group_index()
    except RowsEvictedError:
        return  # a clear "your snapshot is gone" is an acceptable answer
    assert all(np.all(gi.group(g) // 3 == k) for g, k in enumerate(gi.keys))


# --------------------------------------------------------------------------- verify and repair


def _flip(path, rel, offset=-40):
    full = os.path.join(path, rel)
    with open(full, "r+b") as f:
        f.seek(offset, 2 if offset < 0 else 0)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def _repair_store(tmp_path):
    """Three commits of 6 rows each (segments 0-2), no capacity."""
    path = str(tmp_path / "store")
    with ReplayStore(path) as store:
        for b in range(3):
            store.extend(expected_rows(np.arange(store.next_row, store.next_row + 6)))
    return path


def _quarantined(path):
    q = os.path.join(path, "quarantine")
    return sorted(os.path.relpath(os.path.join(d, n), q) for d, _, names in os.walk(q) for n in names)


def test_repair_drops_a_damaged_newest_segment_as_a_hole(tmp_path):
    path = _repair_store(tmp_path)
    _flip(path, fmt.segment_file(2))
    before = snapshot(path)
    dry = repair_store(path, dry_run=True)
    assert snapshot(path) == before  # a dry run changes nothing
    res = repair_store(path)
    assert res["actions"] == dry["actions"]
    # generation 3 without segment 2, committed as generation 4, its rows a hole: a reader that held 3
    # (or cached segment 2 by id) never meets generation 3, segment id 2 or rows 12-17 again naming other rows
    assert res["generation"] == 4 and res["rows"] == 12
    assert fmt.manifest_file(3) in _quarantined(path) and fmt.segment_file(2) in _quarantined(path)
    assert_verifies(path)
    with ReplayStore(path) as store:
        assert store.generation == 4 and store.holes == ((12, 18),)
        check_live_rows(store)
        store.extend(expected_rows(np.arange(18, 21)))
        check_live_rows(store)
        assert store.generation == 5 and store.manifest.segments[-1].id >= 3
    assert_verifies(path)


def test_small_segments_are_checked_whole_and_large_ones_page_by_page(tmp_path):
    """A segment below 64 KiB (a commit of a few rows) gets a sidecar without page checksums and is
    checked against its manifest CRC-32C as a whole when first opened; a larger one keeps its page
    checksums. Damage in either is refused, named, and found by verify."""
    import pyarrow as pa

    from diskreplay.segment import PAGED_SEGMENT_BYTES
    from diskreplay.store.compaction import MergePolicy
    from diskreplay.synthetic import make_rollouts

    path = str(tmp_path / "s")
    with ReplayStore(path, merge_policy=MergePolicy(max_bytes=1)) as store:
        store.extend(make_rollouts(1, 4, seed=0, first_group=0, completion_mean=20))
        store.extend(make_rollouts(8, 8, seed=1, first_group=1, completion_mean=400))
        small, large = store.manifest.segments
        want = store.read(store.row_ids())
    assert small.bytes < PAGED_SEGMENT_BYTES <= large.bytes
    meta = {s.id: pa.ipc.open_file(os.path.join(path, s.groups_file)).schema.metadata or {} for s in (small, large)}
    assert b"diskreplay.page_crc32c" not in meta[small.id] and b"diskreplay.page_crc32c" in meta[large.id]
    with ReplayStore(path, readonly=True) as reader:  # intact: both read back exactly
        got = reader.read(reader.row_ids())
        for name in ("completion_ids", "old_per_token_logps"):
            assert np.array_equal(got[name].values, want[name].values), name
    for seg, match in ((small, "fails its checksum \\(crc32c\\)"), (large, "fails its checksum at bytes")):
        _flip(path, seg.file, seg.bytes // 2)  # a byte in the middle of the data
        with ReplayStore(path, readonly=True) as reader:
            with pytest.raises(CorruptStoreError, match=f"{seg.file}.*{match}"):
                reader.read(np.arange(seg.first_row, seg.end_row))
        assert seg.file in " ".join(verify_store(path)["problems"])


def test_repair_rebuilds_group_sidecars(tmp_path):
    path = _repair_store(tmp_path)
    _flip(path, fmt.groups_file(1))
    os.remove(os.path.join(path, fmt.groups_file(2)))
    problems = " ".join(verify_store(path)["problems"])
    assert fmt.groups_file(1) in problems and fmt.groups_file(2) in problems and fmt.groups_file(0) not in problems
    res = repair_store(path)
    assert sum("rebuilt" in a for a in res["actions"]) == 2, res
    assert res["generation"] == 3 and res["rows"] == 18  # the rebuilt bytes equal the originals
    assert_verifies(path)
    with ReplayStore(path, readonly=True) as store:
        check_live_rows(store)


def test_repair_drops_rows_when_every_commit_has_a_damaged_segment(tmp_path):
    path = _repair_store(tmp_path)
    _flip(path, fmt.segment_file(0))  # every manifest references segment 0
    res = repair_store(path)
    assert any("dropping rows [0, 6)" in a for a in res["actions"]), res
    assert res["rows"] == 12
    assert_verifies(path)
    with ReplayStore(path, readonly=True) as store:
        assert store.head == 6
        check_live_rows(store)


def test_repair_quarantines_leftovers_and_damaged_manifests(tmp_path):
    path = _repair_store(tmp_path)
    leftovers = [f"{fmt.SEGMENT_DIR}/{TMP_PREFIX}x.arrow.1",
                 fmt.segment_file(99), fmt.groups_file(99)]
    for rel in leftovers:
        with open(os.path.join(path, rel), "wb") as f:
            f.write(b"orphan")
    _flip(path, fmt.manifest_file(3), 10)
    report = verify_store(path)  # as fresh as a commit in flight: not reported yet
    assert not report["ok"] and not any(rel in w for w in report["warnings"] for rel in leftovers), report
    for rel in leftovers:  # left by a crash a while ago
        os.utime(os.path.join(path, rel), (time.time() - 60, time.time() - 60))
    report = verify_store(path)
    assert not report["ok"] and all(any(rel in w for w in report["warnings"]) for rel in leftovers), report
    res = repair_store(path)
    assert set(leftovers) | {fmt.manifest_file(3)} <= set(_quarantined(path)), res
    assert res["generation"] == 4  # generation 2's rows, past the generation moved to quarantine
    report = assert_verifies(path)
    assert all("quarantine" in w for w in report["warnings"]), report["warnings"]


def test_repair_needs_the_writer_lock(tmp_path):
    path = _repair_store(tmp_path)
    with ReplayStore(path):
        with pytest.raises(StoreLockedError):
            repair_store(path)
        with pytest.raises(StoreLockedError, match="live writer"):  # a dry run too (issue 12, item 12)
            repair_store(path, dry_run=True)
    assert repair_store(path, dry_run=True)["actions"] == []


def test_verify_and_repair_progress_bars(tmp_path, monkeypatch, capsys):
    path = _repair_store(tmp_path)
    assert verify_store(path, progress=True)["ok"]
    assert repair_store(path, progress=True)["actions"] == []
    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm missing: no bar, same answer
    assert verify_store(path, progress=True)["ok"]


def test_repair_refuses_when_no_manifest_is_intact(tmp_path):
    path = _repair_store(tmp_path)
    for gen in fmt.list_generations(path):
        _flip(path, fmt.manifest_file(gen), 5)
    before = snapshot(path)
    with pytest.raises(CorruptStoreError, match="no intact manifest"):
        repair_store(path)
    assert snapshot(path) == before


def test_a_crash_point_set_after_import_kills_at_its_step():
    """The crash points read the variable on every hit (the tests set it between commits), through
    the environment mapping that os.environ updates."""
    code = ("import os\nfrom diskreplay._fileio import crash_point\ncrash_point('manifest.renamed')\n"
            "os.environ['DISKREPLAY_CRASH_AT'] = 'manifest.renamed#2'\ncrash_point('manifest.written')\n"
            "crash_point('manifest.renamed')\nprint('survived the first hit', flush=True)\n"
            "crash_point('manifest.renamed')\nprint('survived the second hit')\n")
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout == "survived the first hit\n"
