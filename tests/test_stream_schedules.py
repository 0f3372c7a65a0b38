"""Schedules of the rollout stream forced from outside the library (issue 47): a writer and a
restarted trainer whose wall clocks run 700 s ahead (libfaketime); the writer of half of every
prompt's samples stopped (SIGSTOP) while the other writes; trainers stopped past
``retain_seconds`` while writers commit and their older cursors are collected; two live trainers of
one stream name. Every committed row is consumed once by the committed checkpoints, and ``verify``
is ok."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from diskreplay import ReplayStore
from diskreplay.stream import RolloutStream
from diskreplay.verify import verify_store
from tests.torchrun import ROOT, child_env

pytestmark = pytest.mark.slow
needs_faketime = pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (libfaketime)")


def _start(code, *args, ahead_s=None):
    cmd = [sys.executable, "-c", code, *map(str, args)]
    if ahead_s is not None:  # this process's wall clock (and its other clocks) run ahead by ahead_s
        cmd = ["faketime", "-f", f"+{ahead_s}s", *cmd]
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.splitlines()[-1])


# --------------------------------------------------------------------------- clocks (finding 6)

WAITING_WRITER = """
import json, sys, time
import numpy as np
from diskreplay import ReplayStore
with ReplayStore(sys.argv[1]) as store:
    store.extend({"rewards": np.zeros(16)})
    t0 = time.monotonic()
    within = store.wait_for_consumers(4, timeout=1.0, poll=0.05)
    print(json.dumps({"within": within, "waited_s": time.monotonic() - t0}))
"""


@needs_faketime
def test_a_writer_whose_clock_runs_ahead_still_waits_for_a_live_trainer(tmp_path):
    path = str(tmp_path / "s")
    store = ReplayStore(path, group_key=None, multi_writer=True)
    RolloutStream(store, "trainer").save()       # a live trainer: it committed its cursor just now
    out = _finish(_start(WAITING_WRITER, path, ahead_s=700))
    assert out["within"] is False and out["waited_s"] >= 1.0, out   # it waited its timeout for the trainer


RESTARTED_TRAINER = """
import json, sys
from diskreplay import ReplayStore
from diskreplay.stream import RolloutStream
with ReplayStore(sys.argv[1]) as store:
    stream = RolloutStream(store, "trainer", group_size=2)
    assert stream.next(2, timeout=0) is None
    waiting = [g["waiting_s"] for g in stream.incomplete_groups()]
    print(json.dumps({"waiting_s": waiting, "dropped": stream.drop_incomplete(600)}))
"""


@needs_faketime
def test_a_trainer_restarted_on_a_host_ahead_does_not_age_a_group_that_just_arrived(tmp_path):
    path = str(tmp_path / "s")
    store = ReplayStore(path, multi_writer=True)
    stream = RolloutStream(store, "trainer", group_size=2)
    store.extend({"prompt_id": [7], "rewards": [1.0]})    # one sample of two: the group waits
    assert stream.next(2, timeout=0) is None
    stream.save()
    out = _finish(_start(RESTARTED_TRAINER, path, ahead_s=700))
    assert len(out["waiting_s"]) == 1 and out["waiting_s"][0] < 60, out
    assert out["dropped"] == 0


# --------------------------------------------------------------------------- back-pressure (finding 4)

HALF_WRITER = """
import sys, time
import numpy as np
from diskreplay import ReplayStore
path, me = sys.argv[1], int(sys.argv[2])
with ReplayStore(path) as store:
    for step in range(100_000):
        store.wait_for_consumers(8, timeout=30, poll=0.01, incomplete_after=0.5)
        # two of the four samples of prompt `step`; the other writer commits the other two
        store.extend({"prompt_id": np.full(2, step), "rewards": np.zeros(2)}, token=f"w{me}:{step}")
        print(step, flush=True)
        time.sleep(0.005)
"""

HEARTBEAT_TRAINER = """
import sys, time
from diskreplay import ReplayStore
from diskreplay.stream import RolloutStream
with ReplayStore(sys.argv[1]) as store:
    stream = RolloutStream(store, "trainer", group_size=4)
    stream.save()
    print("ready", flush=True)
    while True:  # consumes what completes, and commits its cursor every round (it is alive)
        stream.next(4, timeout=0.05)
        stream.save()
"""


def test_the_bound_holds_for_rows_of_groups_whose_other_writer_stopped(tmp_path):
    """Writer B of half of every prompt's samples is stopped (SIGSTOP); writer A, writing the other
    halves, must be held once B's groups have waited incomplete_after, not run ahead without bound."""
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True).close()
    trainer = _start(HEARTBEAT_TRAINER, path)
    procs = [trainer]
    try:
        assert trainer.stdout.readline().strip() == "ready"
        a, b = _start(HALF_WRITER, path, 0), _start(HALF_WRITER, path, 1)
        procs += [a, b]
        while int(b.stdout.readline()) < 5:
            pass
        b.send_signal(signal.SIGSTOP)
        time.sleep(2.0)                           # A's groups wait past incomplete_after: A is held
        with ReplayStore(path, readonly=True) as store:
            held_at = store.next_row
            time.sleep(1.5)
            store.refresh()
            grown = store.next_row - held_at
            consumed = store.load_state("stream.trainer")["counts"]["handed_out"]
        assert grown <= 2, f"writer A committed {grown} more rows while held"
        # A's rows ahead of the trainer: the bound, one commit, and what it wrote within incomplete_after
        # (a commit every ~10 ms at most)
        assert held_at - consumed <= 8 + 2 + 100, (held_at, consumed)
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- campaigns (finding 2)

WRITER = """
import sys, time
import numpy as np
from diskreplay import ReplayStore
path, me, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with ReplayStore(path) as store:
    for step in range(steps):
        store.wait_for_consumers(max_ahead_rows=64, timeout=5, poll=0.02)
        prompts = np.repeat(np.arange(2) + 2 * step, 2)     # two of each prompt's four samples
        store.extend({"prompt_id": prompts, "tag": [f"w{me}s{step}n{i}" for i in range(4)],
                      "rewards": np.zeros(4)}, token=f"w{me}:{step}")
        time.sleep(0.02)
"""

TRAINER = """
import sys
import numpy as np
from diskreplay import ReplayStore
from diskreplay.errors import StreamFencedError
from diskreplay.stream import RolloutStream
path, drain = sys.argv[1], sys.argv[2] == "drain"
with ReplayStore(path) as store:
    stream = RolloutStream(store, "trainer", group_size=4)
    consumed = np.asarray((stream.extra or {}).get("consumed", np.zeros(0, np.int64)), np.int64)
    print("resumed", stream.epoch, stream.position, flush=True)
    try:
        while True:
            rows = stream.next(8, timeout=2.0 if drain else 60.0)
            if rows is None:
                break
            consumed = np.concatenate([consumed, rows])
            stream.save(extra={"consumed": consumed})
    except StreamFencedError as exc:
        print("fenced", exc, flush=True)
        sys.exit(3)
print("done", flush=True)
"""


def _check_consumed_once(path, rows):
    with ReplayStore(path, readonly=True) as store:
        state = store.load_state("stream.trainer")
        consumed = np.asarray(state["extra"]["consumed"], np.int64)
        assert store.next_row == rows, "every writer's every step, once"
        assert consumed.size == np.unique(consumed).size, "a row consumed twice"
        assert sorted(consumed.tolist() + state["pending"].tolist()) == list(range(state["next_row"])), "a gap"
        assert state["pending"].size == 0 and state["next_row"] == rows
        keys = store.read(consumed, columns=["prompt_id"])["prompt_id"].reshape(-1, 4)
        assert (keys == keys[:, :1]).all(), "a consumed group mixes prompts"
        tags = store.read(store.row_ids(), columns=["tag"])["tag"]
        assert len(set(tags)) == len(tags) == rows, "a batch appended twice"
    report = verify_store(path)
    assert report["ok"], report["problems"]


def test_trainers_stopped_past_retention_and_a_second_trainer_of_one_name(tmp_path):
    """Two writers commit halves of every prompt's samples. Trainer 1 is stopped (SIGSTOP) for longer
    than retain_seconds while the writers commit and collect (its older cursors go), and goes on;
    trainer 2 of the same name starts while trainer 1 still runs: trainer 1 is fenced (its next
    save or next() refused) and exits; trainer 2 is stopped past retention too, then drains."""
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True, retain_seconds=1).close()
    steps = 150
    writers = [_start(WRITER, path, w, steps) for w in range(2)]
    procs = list(writers)
    try:
        first = _start(TRAINER, path, "live")
        procs.append(first)
        assert first.stdout.readline().split()[:2] == ["resumed", "1"]
        time.sleep(0.5)
        first.send_signal(signal.SIGSTOP)
        time.sleep(2.5)                                   # past retain_seconds: the writers collect
        first.send_signal(signal.SIGCONT)
        time.sleep(0.5)
        assert first.poll() is None, first.stderr.read()[-3000:]
        second = _start(TRAINER, path, "live")            # while the first still runs
        procs.append(second)
        epoch = int(second.stdout.readline().split()[1])
        assert epoch == 2
        out, err = first.communicate(timeout=60)
        assert first.returncode == 3 and "took over at epoch 2" in out, (out, err[-3000:])
        time.sleep(0.3)
        second.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        second.send_signal(signal.SIGCONT)
        for w in writers:
            out, err = w.communicate(timeout=180)
            assert w.returncode == 0, err[-3000:]
        second.kill()                                     # (it waits for more; a drain finishes the stream)
        second.wait()
        last = _start(TRAINER, path, "drain")
        procs.append(last)
        out, err = last.communicate(timeout=120)
        assert last.returncode == 0 and out.split()[1] == "3", (out, err[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    _check_consumed_once(path, steps * 2 * 4)
