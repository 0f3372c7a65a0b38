"""A trainer consuming a rollout stream is killed (SIGKILL) at random points while 2-4 writer
processes keep committing; after each resume the rows it consumed, as its committed checkpoint
records them, are the committed rows below its cursor: none twice, none missing."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from diskreplay import ReplayStore
from tests.torchrun import ROOT, child_env

GROUP = 4
STEPS = 40

WRITER = """
import sys, time
import numpy as np
from diskreplay import ReplayStore
path, me, writers, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
share = {group} // writers
with ReplayStore(path) as store:
    for step in range(steps):
        store.wait_for_consumers(max_ahead_rows=96, timeout=10, poll=0.02)
        # the samples of one prompt come from several writers and commits
        prompts = np.repeat(np.arange(4) + 4 * step, share)
        n = prompts.size
        store.extend({{"prompt_id": prompts, "completion_ids": [[me, step, i] for i in range(n)],
                      "policy_version": np.full(n, step)}}, token=f"w{{me}}:{{step}}")
        time.sleep(0.005 * (me + 1))
""".format(group=GROUP)

TRAINER = """
import sys, time
import numpy as np
from diskreplay import ReplayStore
from diskreplay.stream import RolloutStream
path, drain = sys.argv[1], sys.argv[2] == "drain"
with ReplayStore(path) as store:
    stream = RolloutStream(store, "trainer", group_size={group})
    consumed = np.asarray((stream.extra or {{}}).get("consumed", np.zeros(0, np.int64)), np.int64)
    print("resumed", stream.position, consumed.size, flush=True)
    while True:
        rows = stream.next(2 * {group}, timeout=2.0 if drain else 30.0)
        if rows is None:
            break
        consumed = np.concatenate([consumed, rows])          # the "training step"
        stream.save(extra={{"consumed": consumed}})           # checkpoint: the step and the cursor, one commit
print("done", flush=True)
""".format(group=GROUP)


def _start(code, *args):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-4000:]
    return out.decode()


@pytest.mark.parametrize("writers", [2, 4])
def test_a_killed_trainer_resumes_with_every_row_consumed_once(tmp_path, writers):
    rng = random.Random(writers)
    path = str(tmp_path / "store")
    ReplayStore(path, multi_writer=True).close()
    procs = [_start(WRITER, path, w, writers, STEPS) for w in range(writers)]
    kills, resumed_at = 0, []
    try:
        for _ in range(3):
            trainer = _start(TRAINER, path, "live")
            resumed_at.append(int(trainer.stdout.readline().split()[1]))  # it is consuming now
            time.sleep(rng.uniform(0.05, 0.5))
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(timeout=60)
            kills += trainer.returncode == -signal.SIGKILL
        for p in procs:
            _finish(p)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert kills == 3
    last = _finish(_start(TRAINER, path, "drain"))
    resumed_at.append(int(last.split()[1]))
    assert resumed_at[-1] > 0 and resumed_at == sorted(resumed_at), resumed_at  # each life went on from the last

    with ReplayStore(path, readonly=True) as store:
        state = store.load_state("stream.trainer")
        consumed = np.asarray(state["extra"]["consumed"], np.int64)
        waiting = np.asarray(state["pending"], np.int64)
        assert store.next_row == STEPS * 4 * GROUP  # every writer's every step, once
        assert consumed.size == np.unique(consumed).size, "a row consumed twice"
        assert sorted(consumed.tolist() + waiting.tolist()) == list(range(state["next_row"])), "a gap"
        assert state["next_row"] == store.next_row
        assert waiting.size == 0, "every group completes once the writers are done"
        keys = store.read(consumed, columns=["prompt_id"])["prompt_id"].reshape(-1, GROUP)
        assert (keys == keys[:, :1]).all(), "a consumed group mixes prompts"
        assert state["counts"]["handed_out"] == consumed.size
        print(json.dumps({"rows": int(store.next_row), "kills": kills, "resumed_at": resumed_at}))


def test_the_async_grpo_example_runs_and_checks_itself():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "async_grpo.py"), "--steps", "10", "--kills", "1",
                          "--gen-seconds", "0.05"], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.count("  ok   ") == 4 and "FAIL" not in out.stdout
