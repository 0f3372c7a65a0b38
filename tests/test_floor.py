"""The collection floor against schedules forced from outside the library (docs/FORMAT.md, "The collection
floor"): a writer process stopped by strace right after its manifest's link, for longer than
``retain_seconds`` or while a collector whose wall clock runs an hour ahead (libfaketime) sweeps; two
collectors raising the floor at once; a collector stopped between raising the floor and deleting; a
reader pinned at a generation and stopped past retention. Each ends with every acknowledged batch in the
store exactly once, bit-exact, at the rows its ``extend`` returned, and ``verify`` ok."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from diskreplay import ReplayStore
from diskreplay.store.compaction import MergePolicy
from diskreplay import format as fmt
from diskreplay.testing.workload import batch_for, check_rows, token_for
from diskreplay.verify import verify_store

from .test_schedules import RETAIN, _exactly_once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "DISKREPLAY_SERIAL_IO": "1"}

# no merges of small segments: a merge would copy writer 1's rows into a segment of another writer's,
# and the files its commit named would no longer matter
NO_MERGES = MergePolicy(max_bytes=1)
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
needs_faketime = pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (libfaketime)")

# a writer that commits once (so that everything a commit probes is probed), says READY, and commits its
# next batch when told: the test has attached strace by then, which stops it right after that commit's link
STOPPED_WRITER = textwrap.dedent("""
    import sys
    from diskreplay import ReplayStore
    from diskreplay.store.compaction import MergePolicy
    from diskreplay.testing.workload import batch_for, token_for
    path, tokened = sys.argv[1], sys.argv[2] == "1"
    store = ReplayStore(path, merge_policy=MergePolicy(max_bytes=1))
    store.extend(batch_for(1, 0), token=token_for(1, 0))
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        rows = store.extend(batch_for(1, 1), token=token_for(1, 1) if tokened else None)
        print("ACK", int(rows[0]), len(rows), flush=True)
    except Exception as exc:
        print("ERR", type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
    store.close()
""")

SWEEPER = textwrap.dedent("""
    import sys
    from diskreplay import ReplayStore
    with ReplayStore(sys.argv[1]) as store:  # a writer's open sweeps the store
        store._committer.collect(full=True)
""")


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _wait_stopped(proc, timeout=60):
    """Until ``proc`` is stopped for good (its injected SIGSTOP): a traced process passes through
    brief tracing stops at every traced call, so the stop must hold, with no CPU time spent, for a while."""
    deadline = time.monotonic() + timeout
    still = 0
    ticks = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the process exited before it was stopped: {proc.communicate()}")
        now = _cpu_ticks(proc.pid)
        still = still + 1 if _state(proc.pid) in "tT" and now == ticks else 0
        ticks = now
        if still >= 8:
            return
        time.sleep(0.05)
    raise AssertionError("the process never stopped")


def _attach(pid, inject, calls):
    """strace attached to ``pid`` (every thread), injecting ``inject`` into ``calls``."""
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={calls}",
                               "-e", f"inject={inject}", "-p", str(pid)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            if "TracerPid:\t0" not in f.read():
                return tracer
        time.sleep(0.01)
    tracer.kill()
    raise AssertionError("strace could not attach")


def _stopped_after_link(path, tokened):
    """Start the writer; return it (and its tracer) stopped right after its manifest's link."""
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_WRITER, path, "1" if tokened else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    assert proc.stdout.readline().strip() == "READY", proc.communicate()
    # the next link(at) of the writer is its manifest's (segment names are created O_EXCL): strace runs
    # it and then stops the process (signal= is delivered on the call's exit)
    tracer = _attach(proc.pid, "link,linkat:signal=SIGSTOP:when=1", "link,linkat")
    proc.stdin.write("go\n")
    proc.stdin.flush()
    _wait_stopped(proc)
    assert os.path.exists(os.path.join(path, fmt.manifest_file(2))), "stopped, but not after its link"
    return proc, tracer


def _resume(proc, tracer):
    """Let the writer go on; its outcome: ``("ACK", rows)`` or ``("ERR", type, message)``."""
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    tracer.terminate()
    tracer.wait(timeout=30)
    assert proc.returncode == 0, err
    line = [x for x in out.splitlines() if x.startswith(("ACK", "ERR"))][-1]
    if line.startswith("ACK"):
        _, first, n = line.split()
        return ("ACK", list(range(int(first), int(first) + int(n))))
    _, kind, message = line.split(" ", 2)
    return ("ERR", kind, message)


def _commit(store, acked, w, steps):
    for step in steps:
        acked[(w, step)] = store.extend(batch_for(w, step), token=token_for(w, step))


def _check(path, acked, outcome, tokened, settled=True):
    """The stopped writer's batch: acknowledged and there once, or (without a token, where the commit
    cannot be ``settled``: no locks) in doubt, said so honestly, and then there at most once, whole;
    never called refused while committed."""
    assert outcome[0] == "ACK" or not settled, outcome
    if outcome[0] == "ACK":
        acked[(1, 1)] = outcome[1]
        _exactly_once(path, acked)
        return
    _, kind, message = outcome
    assert not tokened, outcome
    assert kind == "StoreIOError" and "not known" in message, outcome
    with ReplayStore(path, readonly=True) as r:
        tags = r.read(r.row_ids(), ["tag"])["tag"]
        rows = [r.head + i for i, t in enumerate(tags) if t.startswith("w1s1n")]
    if rows:
        acked[(1, 1)] = rows
    _exactly_once(path, acked)


# --------------------------------------------------------------------------- a writer stopped after its link


@needs_strace
@pytest.mark.parametrize("tokened", [True, False], ids=["token", "no-token"])
def test_a_writer_stopped_right_after_its_link_past_retention_keeps_its_commit(tmp_path, tokened):
    """Writer 1 links generation G+1 (a real commit, the newest) and is stopped there for longer than
    retain_seconds while writer 2 commits on top of it, waits out the retention and sweeps. The sweep
    raised the floor past G+1 and deleted it; writer 1 then took the floor for "my link was stale": with
    a token its rebase found its own token and removed the files its commit names (a fresh reader:
    FileNotFoundError); without one the extend said the commit was refused. Now a sweep never raises the
    floor past a manifest whose writer has not read the floor after its link (it holds a lease on it)."""
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True, retain_seconds=RETAIN).close()
    acked = {(1, 0): None}
    proc, tracer = _stopped_after_link(path, tokened)
    try:
        with ReplayStore(path, merge_policy=NO_MERGES) as b:
            _commit(b, acked, 2, range(20))
            time.sleep(RETAIN + 0.3)
            _commit(b, acked, 2, range(20, 26))
            b._committer.collect(full=True)
        outcome = _resume(proc, tracer)
    finally:
        if proc.poll() is None:
            proc.kill()
        tracer.kill()
    acked.pop((1, 0))
    _check_with_first(path, acked, outcome, tokened)


def _check_with_first(path, acked, outcome, tokened, settled=True):
    # writer 1's first batch (before the stop) is there once too, at whatever rows it got: first in the store
    with ReplayStore(path, readonly=True) as r:
        tags = r.read(r.row_ids(), ["tag"])["tag"]
        acked[(1, 0)] = [r.head + i for i, t in enumerate(tags) if t.startswith("w1s0n")]
    assert len(acked[(1, 0)]) == len(batch_for(1, 0)["tag"])
    _check(path, acked, outcome, tokened, settled)


@needs_strace
@needs_faketime
@pytest.mark.parametrize("tokened", [True, False], ids=["token", "no-token"])
def test_a_collector_an_hour_ahead_never_collects_a_commit_its_writer_has_not_confirmed(tmp_path, tokened):
    """No long pause: writer 1 is stopped right after its link for a moment (far less than
    retain_seconds=60), writer 2 commits 20 batches on top, and a third writer whose wall clock runs an
    hour ahead (libfaketime) opens the store and sweeps: to it every manifest is an hour old, so it
    collected writer 1's generation before writer 1 read the floor."""
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True, retain_seconds=60).close()
    acked = {}
    proc, tracer = _stopped_after_link(path, tokened)
    try:
        with ReplayStore(path, merge_policy=NO_MERGES) as b:
            _commit(b, acked, 2, range(20))  # (past a full manifest: the deltas before it can go)
        sweep = subprocess.run(["faketime", "-f", "+1h", sys.executable, "-c", SWEEPER, path],
                               capture_output=True, text=True, env=ENV, timeout=120)
        assert sweep.returncode == 0, sweep.stderr
        outcome = _resume(proc, tracer)
    finally:
        if proc.poll() is None:
            proc.kill()
        tracer.kill()
    _check_with_first(path, acked, outcome, tokened)


# --------------------------------------------------------------------------- one writer, a rename in doubt

RENAME_EIO_WRITER = textwrap.dedent("""
    import sys
    from diskreplay import ReplayStore
    from diskreplay.testing.workload import batch_for, token_for
    store = ReplayStore(sys.argv[1])
    store.extend(batch_for(1, 0), token=token_for(1, 0))  # FORMAT.json written: the next rename is a manifest's
    print("READY", flush=True)
    sys.stdin.readline()
    for step in (1, 1, 2):  # step 1's publish fails; the same process retries it and goes on
        try:
            rows = store.extend(batch_for(1, step), token=token_for(1, step))
            print("ACK", step, int(rows[0]), len(rows), flush=True)
        except Exception as exc:
            print("ERR", step, type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
    store.close()
""")


@needs_strace
def test_a_single_writer_goes_on_after_a_failed_manifest_rename(tmp_path):
    """EIO on the rename of a single writer's manifest (strace -e inject): reading back found nothing, so
    the store refused every later extend until it was closed and reopened, which a trainer using the TRL
    integration cannot do. The writer holds the lock, so removing the temporary name settles it (no late
    rename can land): the extend says nothing was committed, and the next one in the same process works."""
    path = str(tmp_path / "s")
    proc = subprocess.Popen([sys.executable, "-c", RENAME_EIO_WRITER, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout.readline().strip() == "READY", proc.communicate()
    tracer = _attach(proc.pid, "rename,renameat,renameat2:error=EIO:when=1", "rename,renameat,renameat2")
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        tracer.terminate()
        tracer.wait(timeout=30)
    lines = [x.split(" ", 3) for x in out.splitlines() if x.startswith(("ACK", "ERR"))]
    assert [x[:2] for x in lines] == [["ERR", "1"], ["ACK", "1"], ["ACK", "2"]], (out, err)
    assert lines[0][2] == "StoreIOError" and "nothing of it was committed" in lines[0][3], lines[0]
    acked = {(1, int(s)): list(range(int(a), int(a) + int(n))) for _, s, a, n in
             (x for x in lines if x[0] == "ACK")}
    with ReplayStore(path, readonly=True) as r:
        acked[(1, 0)] = [r.head + i for i, t in enumerate(r.read(r.row_ids(), ["tag"])["tag"]) if t.startswith("w1s0n")]
    _exactly_once(path, acked)


def test_an_object_stores_ages_are_the_servers_not_the_hosts(s3_server, s3_url, tmp_path, monkeypatch):
    """The clean-up aged objects by this host's wall clock against the server's Last-Modified: a host an
    hour ahead took a manifest written a moment ago for an hour old (and collected it)."""
    if s3_server.name != "seaweedfs":
        pytest.skip("moto's server runs in this process: a clock patched here is its clock too")
    from diskreplay.storage import S3Storage
    storage = S3Storage(s3_url, s3_server.storage_options, cache_dir=str(tmp_path / "cache"))
    storage.write_new("segments/000000000001.arrow", b"young")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    assert storage.age("segments/000000000001.arrow") < 60
    assert storage.list_ages("segments")["000000000001.arrow"] < 60


# --------------------------------------------------------------------------- object storage: no leases


@pytest.mark.parametrize("tokened", [True, False], ids=["token", "no-token"])
def test_an_object_store_writer_whose_commit_was_collected_before_it_read_the_floor(
        s3_server, s3_url, tmp_path, monkeypatch, tokened):
    """The object-store variant: writer 1's manifest PUT lands, and before it reads the floor writer 2
    commits on top, waits out the retention and sweeps it (no locks here, so nothing stops the sweep).
    With a token, the rebase found writer 1's own token and the duplicate path deleted the objects its
    commit names; without one, the extend must say the outcome is not known, never that it was refused."""
    if s3_server.name != "seaweedfs":
        pytest.skip("moto's conditional PUT is not atomic (docs/FORMAT.md, Object storage)")
    from diskreplay.storage import S3Storage

    def open_store(**kw):
        return ReplayStore(s3_url, storage_options=s3_server.storage_options, cache_dir=str(tmp_path / "c"),
                           merge_policy=NO_MERGES, **kw)

    a = open_store(multi_writer=True, retain_seconds=RETAIN)
    b = open_store()
    acked = {}
    _commit(a, acked, 1, [0])
    real = S3Storage.put_if_absent
    ran = []

    def put_if_absent(self, rel, data, **kw):
        created = real(self, rel, data, **kw)
        if self is a._committer.storage and rel.startswith(fmt.MANIFEST_DIR + "/") and created and not ran:
            ran.append(rel)  # writer 1 "stopped" right after its PUT, before it reads the floor
            _commit(b, acked, 2, range(20))
            time.sleep(RETAIN + 0.5)
            _commit(b, acked, 2, range(20, 26))
            b._committer.collect(full=True)
        return created

    monkeypatch.setattr(S3Storage, "put_if_absent", put_if_absent)
    try:
        acked[(1, 1)] = a.extend(batch_for(1, 1), token=token_for(1, 1) if tokened else None)
        outcome = ("ACK",)
    except Exception as exc:  # noqa: BLE001 - judged below
        outcome = ("ERR", type(exc).__name__, str(exc))
    monkeypatch.undo()
    assert ran and fmt.read_floor(b.storage) > int(ran[0].rsplit("/", 1)[1][:12])
    a.close(), b.close()
    if outcome[0] == "ERR":
        assert not tokened and outcome[1] == "StoreIOError" and "not known" in outcome[2], outcome
    with open_store(readonly=True) as r:
        tags = r.read(r.row_ids(), ["tag"])["tag"]
        assert check_rows(r, r.row_ids()) is None
        mine = [r.head + i for i, t in enumerate(tags) if t.startswith("w1s1n")]
        got = {k: [r.head + i for i, t in enumerate(tags) if t.startswith(f"w{k[0]}s{k[1]}n")] for k in acked}
    assert mine == (list(acked[(1, 1)]) if (1, 1) in acked else mine) and len(mine) == len(batch_for(1, 1)["tag"])
    for k, rows in acked.items():
        assert got[k] == list(rows), k
    assert len(tags) == sum(len(v) for v in acked.values()) + (0 if (1, 1) in acked else len(mine))


# --------------------------------------------------------------------------- campaigns of processes

LOOP_WRITER = textwrap.dedent("""
    import os, sys, time
    path, w, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from diskreplay import ReplayStore
    from diskreplay.testing.workload import batch_for, token_for
    store = ReplayStore(path)
    step = 0
    while not os.path.exists(stop):
        while True:
            try:
                rows = store.extend(batch_for(w, step), token=token_for(w, step))
                break
            except OSError as exc:  # in doubt or abandoned: the token finds out
                print("RETRY", step, type(exc).__name__, flush=True)
        print("ACK", step, int(rows[0]), len(rows), flush=True)
        step += 1
        time.sleep(0.01)
    store.close()
""")

LOOP_SWEEPER = textwrap.dedent("""
    import os, sys, time
    path, stop = sys.argv[1], sys.argv[2]
    from diskreplay import ReplayStore
    store = ReplayStore(path)
    print("READY", flush=True)
    while not os.path.exists(stop):
        store._committer.collect(full=True)
        time.sleep(0.02)
    store.close()
""")


def _start(args):
    return subprocess.Popen([sys.executable, "-c", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def _acks(w, out):
    acked = {}
    for line in out.splitlines():
        if line.startswith("ACK"):
            _, step, first, n = line.split()
            acked[(w, int(step))] = list(range(int(first), int(first) + int(n)))
    return acked


def _wait_for(what, cond, timeout=120):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@needs_strace
@pytest.mark.slow
def test_two_collectors_at_once_and_one_stopped_between_raising_the_floor_and_deleting(tmp_path):
    """Two writer processes commit with tokens while two sweeper processes raise the floor and collect at
    once, and a third sweeper is stopped (strace, SIGSTOP on its first pwrite: the floor's new bytes,
    written under the floor's lock) between raising the floor and deleting what it planned, for longer
    than the retention, then goes on with its stale plan. Every acknowledged batch is there once, bit-exact, and verify is ok."""
    path, stop = str(tmp_path / "s"), str(tmp_path / "stop")
    ReplayStore(path, multi_writer=True, retain_seconds=RETAIN).close()
    writers = {w: _start([LOOP_WRITER, path, str(w), stop]) for w in (1, 2)}
    sweepers = [_start([LOOP_SWEEPER, path, stop]) for _ in range(2)]
    stopped = _start([LOOP_SWEEPER, path, stop])
    tracer = None
    try:
        assert stopped.stdout.readline().startswith("READY")  # (its open raised nothing: the floor was 0)
        # a sweeper's first pwrite is the floor's new bytes (its open raised nothing: the floor was 0): it
        # stops there, before the fsync, holding the floor's lock, its plan made and its manifests held
        tracer = _attach(stopped.pid, "pwrite64:signal=SIGSTOP:when=1", "pwrite64")
        _wait_stopped(stopped, timeout=240)
        floor = fmt.read_floor(path)
        made = len(os.listdir(os.path.join(path, fmt.MANIFEST_DIR)))
        # the writers go on (the others' sweeps cannot raise the floor meanwhile: they delete nothing)
        _wait_for("the writers to commit", lambda: len(os.listdir(os.path.join(path, fmt.MANIFEST_DIR))) > made + 20)
        time.sleep(RETAIN + 0.5)  # stopped past the retention
        os.kill(stopped.pid, signal.SIGCONT)
        time.sleep(1.0)  # it deletes what it planned, and sweeps on
    finally:
        open(stop, "w").close()
        for p in list(writers.values()) + sweepers + [stopped, tracer]:
            if p is not None and p.poll() is None:
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
    acked = {}
    for w, p in writers.items():
        out, err = p.communicate()
        assert p.returncode == 0, ("writer", w, err)
        acked.update(_acks(w, out))
    for name, p in [("sweeper", q) for q in sweepers] + [("stopped sweeper", stopped)]:
        err = p.communicate()[1]
        assert p.returncode == 0, (name, err)
    assert len(acked) >= 10 and floor and fmt.read_floor(path) > floor, (len(acked), floor)
    _exactly_once(path, acked)


PINNED_READER = textwrap.dedent("""
    import sys
    from diskreplay import ReplayStore, DiskReplayError
    from diskreplay.testing.workload import check_rows
    with ReplayStore(sys.argv[1], readonly=True) as store, store.snapshot() as snap:
        rows = snap.row_ids()
        assert check_rows(snap, rows[:1]) is None  # one segment opened; the others lazily, later
        print("READY", len(rows), flush=True)
        sys.stdin.readline()
        try:
            problem = check_rows(snap, rows)
            print("READ", len(rows), problem, flush=True)
        except DiskReplayError as exc:
            print("GONE", type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
""")


def test_a_reader_pinned_at_a_generation_and_stopped_past_retention(tmp_path):
    """A reader pins a generation, reads one row and is stopped (SIGSTOP) past the retention while a
    writer commits, merges its small segments and sweeps: resumed, it either reads its rows bit-exact or
    is told with a DiskReplayError that the generation is no longer retained; never other rows, never a
    bare FileNotFoundError. The writer's rows are all there and verify is ok."""
    path = str(tmp_path / "s")
    acked = {}
    with ReplayStore(path, multi_writer=True, retain_seconds=RETAIN) as w:
        _commit(w, acked, 1, range(8))
        reader = _start([PINNED_READER, path])
        assert reader.stdout.readline().startswith("READY"), reader.communicate()
        os.kill(reader.pid, signal.SIGSTOP)
        try:
            _commit(w, acked, 1, range(8, 30))  # merges the first small segments into one
            time.sleep(RETAIN + 0.3)
            _commit(w, acked, 1, range(30, 36))
            w._committer.collect(full=True)
        finally:
            os.kill(reader.pid, signal.SIGCONT)
        out, err = reader.communicate("go\n", timeout=120)
    assert reader.returncode == 0, err
    line = out.splitlines()[-1]
    assert line.startswith("READ") and line.endswith("None") or (
        line.startswith("GONE StoreNotFoundError") and "no longer retained" in line), (line, err)
    _exactly_once(path, acked)


# --------------------------------------------------------------------------- a link that raised but landed


@pytest.mark.parametrize("tokened", [True, False], ids=["token", "no-token"])
def test_a_link_that_raised_but_landed_is_confirmed_against_the_floor(tmp_path, monkeypatch, tokened):
    """Writer 1 read its base and stopped while writer 2 committed past the retention and swept; its link
    then lands in a collected generation (a stale link) and raises EIO (its reply lost, as an NFS link
    retransmitted). Reading the manifest back found it, and the commit was accepted without the floor
    check: CommitNotDurableError said its rows were committed and visible, but every reader ignores a
    generation below the floor, so they were lost. A link that raised but landed is now confirmed
    against the floor exactly as a clean one (its lease held until then): here the link was stale, so
    the commit is rebased and lands on the newest commit."""
    from diskreplay.errors import CommitNotDurableError
    from diskreplay.storage import LocalStorage

    from .test_schedules import _b_commits_and_collects
    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True, retain_seconds=RETAIN, merge_policy=NO_MERGES)
    b = ReplayStore(path, merge_policy=NO_MERGES)
    acked = {}
    _commit(a, acked, 1, [0])
    _commit(b, acked, 2, [0])
    real = LocalStorage.link_new
    ran = []

    def link_new(self, src, rel):
        if self is a._committer.storage and rel.startswith(fmt.MANIFEST_DIR + "/") and not ran:
            ran.append(rel)
            _b_commits_and_collects(b, acked, 1)
            assert real(self, src, rel)  # lands in the collected slot
            raise OSError(errno.EIO, "Input/output error", self.local_path(rel))
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", link_new)
    try:
        acked[(1, 1)] = a.extend(batch_for(1, 1), token=token_for(1, 1) if tokened else None)
    except CommitNotDurableError as exc:
        acked[(1, 1)] = exc.rows  # "committed and visible": then it must be there
    monkeypatch.undo()
    assert ran and fmt.read_floor(path) > int(os.path.basename(ran[0])[:12])
    _commit(a, acked, 1, [2])
    a.close(), b.close()
    _exactly_once(path, acked)


# --------------------------------------------------------------------------- a cursor's save stopped past retention

STOPPED_SAVER = textwrap.dedent("""
    import os, sys
    from diskreplay import ReplayStore
    store = ReplayStore(sys.argv[1])
    store.save_state("trainer", {"cursor": 1})
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        store.save_state("trainer", {"cursor": 2})
        print("SAVED", flush=True)
    except Exception as exc:
        print("ERR", type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
    os._exit(0)  # no close: unlocking the writer's lock fails under the injected ENOLCK (the lock goes with it)
""")


@needs_strace
def test_a_cursor_save_stopped_past_retention_never_names_a_collected_state_file(tmp_path):
    """A stream's cursor commit (``save_state``) passed no start time to the commit, so the age check that
    abandons a commit whose files may be collected did not apply. Without leases (strace makes flock fail
    with ENOLCK, as on a filesystem without a lock manager) the saver, stopped (SIGSTOP) right after
    creating its state file for longer than retain_seconds, had that file collected by another writer's
    sweep, and then committed a cursor naming it: the store's newest cursor could not be loaded. Now the
    too-old commit is abandoned (CommitTimeoutError, its file removed) and the saved cursor stays loadable."""
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True, retain_seconds=RETAIN).close()
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_SAVER, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    tracer = None
    try:
        assert proc.stdout.readline().strip() == "READY", proc.communicate()
        # no flock from here on (no leases); the first fsync (of the new state file, or its directory
        # entry) stops it: its state file is created, its commit not yet checked
        tracer = subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=flock,fsync",
                                   "-e", "inject=flock:error=ENOLCK", "-e", "inject=fsync:signal=SIGSTOP:when=1",
                                   "-p", str(proc.pid)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
        _wait_for("strace to attach", lambda: "TracerPid:\t0" not in open(f"/proc/{proc.pid}/status").read())
        proc.stdin.write("go\n")
        proc.stdin.flush()
        _wait_stopped(proc)
        assert len(os.listdir(os.path.join(path, fmt.STATE_DIR))) == 2, "stopped before its state file"
        time.sleep(RETAIN + 0.5)
        with ReplayStore(path) as b:  # another writer's sweep: the stopped saver's file is old and unleased
            b.extend(batch_for(2, 0), token=token_for(2, 0))
            b._committer.collect(full=True)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if tracer is not None:
            tracer.terminate()
            tracer.wait(timeout=30)
    assert proc.returncode == 0, err
    line = [x for x in out.splitlines() if x.startswith(("SAVED", "ERR"))][-1]
    with ReplayStore(path, readonly=True) as r:
        state = r.load_state("trainer")  # the newest committed cursor loads
    if line == "SAVED":
        assert state == {"cursor": 2}
    else:
        assert line.startswith("ERR CommitTimeoutError") and "nothing was committed" in line, line
        assert state == {"cursor": 1}
        entries = os.listdir(os.path.join(path, fmt.STATE_DIR))
        assert len(entries) == 1, entries  # the abandoned commit's file is gone
    assert verify_store(path)["ok"]


def test_a_link_that_raised_but_landed_keeps_its_lease_until_the_floor_is_read(tmp_path, monkeypatch):
    """The same error on a real commit (its base the newest): writer 1 reads its manifest back, and before
    it reads the floor writer 2 commits on top, waits out the retention and sweeps. Writer 1's manifest
    stays leased from before the link until its floor read, even though the link raised, so the sweep
    cannot raise the floor past it: the commit stands (CommitNotDurableError with its rows, there once).
    Unleased, the sweep raised the floor past it, writer 1 took its commit for a stale link, found its
    token in writer 2's newer commits and removed the files they name."""
    from diskreplay.errors import CommitNotDurableError
    from diskreplay.storage import LocalStorage

    from .test_schedules import _b_commits_and_collects
    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True, retain_seconds=RETAIN, merge_policy=NO_MERGES)
    b = ReplayStore(path, merge_policy=NO_MERGES)
    acked = {}
    _commit(a, acked, 1, [0])
    real_link, real_read = LocalStorage.link_new, LocalStorage.read_bytes
    ran, swept = [], []

    def link_new(self, src, rel):
        if self is a._committer.storage and rel.startswith(fmt.MANIFEST_DIR + "/") and not ran:
            assert real_link(self, src, rel)  # the next generation: a real commit
            ran.append(rel)
            raise OSError(errno.EIO, "Input/output error", self.local_path(rel))
        return real_link(self, src, rel)

    def read_bytes(self, rel, *args, **kw):
        data = real_read(self, rel, *args, **kw)
        if self is a._committer.storage and ran and rel == ran[0] and not swept:
            swept.append(rel)  # read back after the error; the floor is not read yet
            _b_commits_and_collects(b, acked, 0)
        return data

    monkeypatch.setattr(LocalStorage, "link_new", link_new)
    monkeypatch.setattr(LocalStorage, "read_bytes", read_bytes)
    try:
        acked[(1, 1)] = a.extend(batch_for(1, 1), token=token_for(1, 1))
    except CommitNotDurableError as exc:  # committed and visible: its rows
        acked[(1, 1)] = exc.rows
    monkeypatch.undo()
    assert swept
    _commit(a, acked, 1, [2])
    a.close(), b.close()
    _exactly_once(path, acked)
