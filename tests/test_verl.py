"""verl 0.9.1's v1 ReplayBuffer over TransferQueue with the DiskReplay backend: a trainer SIGKILLed and resumed.

verl pins tensordict<=0.10 and transformers<5.11, which the main environment's [torchrl] extra cannot share,
so it runs in its own environment, .venv-verl/, that tools/verl_env.sh builds (CI calls it). Where that build
failed, this test skips with the reason the script wrote; where it was never run, it skips saying so.

tests/verl/driver.py runs in that environment (its docstring says which parts are verl's own code). The test
starts a local Ray cluster on 127.0.0.1 with it, then a trainer that checkpoints after every second step, and
SIGKILLs the trainer after a checkpoint, once it has trained (and cleared) one step more and acknowledged a put
after that. A second trainer resumes from the last checkpoint (TransferQueue's ``load_checkpoint``, verl's
re-issue of pending and running prompts) and trains to the end of the dataset. Then:

- every prompt group is trained exactly once on the resumed timeline (the steps up to the checkpoint, then
  the resumed run), with every value as it was put; the groups the killed trainer trained and cleared after
  the checkpoint are read again (a checkpoint that left storage out fails here: the store no longer agrees
  with the restored controller);
- the groups that were finished at the checkpoint are trained by the resumed run from the values the killed
  trainer put (not generated again), and those pending or running are generated again once;
- the store holds no value afterwards (every key TransferQueue used was cleared).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-verl"
DRIVER = ROOT / "tests" / "verl" / "driver.py"
sys.path.insert(0, str(DRIVER.parent))
from driver import N, PROMPTS  # noqa: E402  (constants only: the driver imports verl lazily)

sys.path.remove(str(DRIVER.parent))


def _environment():
    """The environment's python, or skip saying why there is none."""
    if (VENV / "FAILED").exists():
        pytest.skip((VENV / "FAILED").read_text().strip())
    if not (VENV / "READY").exists():
        pytest.skip(f"{VENV} is not built: run tools/verl_env.sh (CI does)")
    return str(VENV / "bin" / "python")


def _spawn(python, log, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    # token authentication, as Ray sets up for a cluster it starts, but known to the trainers before they import
    # Ray (their imports overlap the cluster's start); a missing token is generated in ~/.ray by the cluster
    env["RAY_AUTH_MODE"] = "token"
    return subprocess.Popen([python, str(DRIVER), *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True, env=env, cwd=str(ROOT))


def _events(proc, into, until, timeout, logs):
    """Read the process's events into ``into`` until ``until(into)`` or the process ends; fail after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        into.append(json.loads(line))
        if until(into):
            return
    if not until(into):
        pytest.fail(f"no {until.__doc__} within {timeout} s (exit {proc.poll()}); last events {into[-3:]}:\n"
                    f"{_tail(logs)}")


def _tail(logs):
    return "\n".join(f"--- {p.name}\n" + "".join(p.read_text().splitlines(True)[-20:]) for p in sorted(logs.iterdir()))


@pytest.mark.slow  # a Ray cluster and two trainers importing verl: about a minute on 2 busy cores
def test_verl_replay_buffer_resumes_after_sigkill_with_nothing_lost_or_repeated(tmp_path):
    python = _environment()
    store, ckpt, logs = tmp_path / "tq-store", tmp_path / "ckpt", tmp_path / "logs"
    ckpt.mkdir()
    logs.mkdir()
    procs = []
    try:
        # the trainers import verl while the cluster starts (the second one while the first runs)
        cluster = _spawn(python, logs / "cluster.log", "cluster")
        first = _spawn(python, logs / "trainer-1.log", "train", store, ckpt)
        second = _spawn(python, logs / "trainer-2.log", "train", store, ckpt)
        procs += [cluster, first, second]
        started, one, two = [], [], []

        def up(ev):
            """address of the Ray cluster"""
            return bool(ev)
        _events(cluster, started, up, 180, logs)
        first.stdin.write(started[0]["address"] + "\n")
        first.stdin.flush()

        def killed_after_a_checkpoint(ev):
            """checkpoint, then a trained step and a put after it"""
            ckpts = [i for i, e in enumerate(ev) if "ckpt" in e]
            return bool(ckpts) and any("trained" in e for e in ev[ckpts[-1]:]) and "put" in ev[-1]
        _events(first, one, killed_after_a_checkpoint, 300, logs)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        assert not any("done" in e for e in one), "the first trainer finished before the kill"
        last = [e for e in one if "ckpt" in e][-1]
        k = last["ckpt"]
        assert json.loads((ckpt / "latest.json").read_text())["global_steps"] == k
        trained_before = [key for e in one if "trained" in e and e["trained"] <= k for key in e["keys"]]
        # trained and cleared after the checkpoint: the resumed trainer must find these values again
        trained_since = [key for e in one if "trained" in e and e["trained"] > k for key in e["keys"]]
        assert trained_since
        finished = {uid for uid, status in last["status"].items() if status == "finished"}
        inflight = {uid for uid, status in last["status"].items() if status in ("pending", "running")}
        # the schedule the driver promises: at the checkpoint, groups of all three kinds wait in TransferQueue
        assert finished and {"running", "pending"} <= set(last["status"].values()), last
        assert any(e["put"].split("_")[0] in finished for e in one if "put" in e)

        second.stdin.write(started[0]["address"] + "\n")
        second.stdin.flush()

        def done(ev):
            """end of the resumed run"""
            return bool(ev) and "done" in ev[-1]
        _events(second, two, done, 300, logs)
        assert second.wait(60) == 0, _tail(logs)
        assert two[0] == {"ready": second.pid} and two[1] == {"resumed": k, "reissued": len(inflight)}, two[:2]

        trained_after = [key for e in two if "trained" in e for key in e["keys"]]
        assert not [e for e in one + two if e.get("bad")], "a trained value differs from what was put"
        timeline = trained_before + trained_after
        assert len(timeline) == len(set(timeline)), "a trajectory was trained twice"
        assert sorted(timeline) == sorted(f"p{i}_{s}_0" for i in range(PROMPTS) for s in range(N))
        assert set(trained_since) <= set(trained_after)
        generated_again = [e["gen"] for e in two if "gen" in e]
        assert not finished & set(generated_again), "a group finished at the checkpoint was generated again"
        assert inflight <= set(generated_again) and len(generated_again) == len(set(generated_again))
        assert {key.split("_")[0] for key in trained_after} >= finished | inflight
    finally:
        for proc in procs[1:]:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(30)
        if procs:  # the cluster last
            procs[0].stdin.close()  # the cluster process stops Ray and exits
            try:
                procs[0].wait(60)
            except subprocess.TimeoutExpired:
                procs[0].kill()
                procs[0].wait(30)

    # the store alone: every key TransferQueue used was cleared, nothing is left over
    pytest.importorskip("transfer_queue")
    from diskreplay.integrations.transferqueue import FieldTable
    with FieldTable(str(store)) as table:
        assert list(table.keys()) == []
