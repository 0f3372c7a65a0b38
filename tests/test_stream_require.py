"""RolloutStream(require=[...]): rows (whole groups) go out only once the named columns have values
for them, in the order they became ready, exactly once across a saved and resumed cursor."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import queue
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from diskreplay import ReplayStore
from diskreplay.errors import ArgumentError
from diskreplay.stream import RolloutStream
try:
    from tests.torchrun import ROOT, child_env, torchrun
except ImportError:  # run by torchrun as a script
    from torchrun import ROOT, child_env, torchrun


def _rows(prompts, rewards=None, ref=None):
    n = len(prompts)
    batch = {"prompt_id": list(prompts), "completion_ids": [[7, 8]] * n}
    if rewards is not None:
        batch["rewards"] = list(rewards)
    if ref is not None:
        batch["ref_per_token_logps"] = ref
    return batch


@pytest.fixture
def store(tmp_path):
    with ReplayStore(str(tmp_path / "s"), multi_writer=True) as s:
        yield s


def test_a_row_without_a_value_in_a_required_column_is_not_handed_out(store):
    store.extend(_rows([1, 2]))                                   # before the column existed: NaN
    stream = RolloutStream(store, "t", group_size=1, require=["rewards"])
    assert stream.next(1, timeout=0) is None                      # the store has no rewards column yet
    store.extend(_rows([3, 4, 5], rewards=[1.0, np.nan, 0.5]))    # row 3 has no value
    assert stream.next(2, timeout=0).tolist() == [2, 4]
    assert stream.next(1, timeout=0) is None
    waiting = stream.incomplete_groups()
    assert sorted(int(g["rows"][0]) for g in waiting) == [0, 1, 3]
    assert all(g["key"] is None and g["missing"]["rewards"].tolist() == g["rows"].tolist() for g in waiting)
    assert stream.stats()["waiting"] == 3 and stream.stats()["handed_out"] == 2


def test_a_group_waits_for_every_row_and_every_required_column(store):
    stream = RolloutStream(store, "t", group_size=2, require=["rewards", "ref_per_token_logps"])
    store.extend(_rows([1, 1, 2, 2, 3], rewards=[1.0, 2.0, 3.0, 4.0, 5.0],
                       ref=[[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], None, [0.1, 0.1]]))
    assert stream.next(2, timeout=0).tolist() == [0, 1]
    assert stream.next(2, timeout=0) is None                      # row 3 has no reference log-probs
    by_key = {g["key"]: g for g in stream.incomplete_groups()}
    assert by_key[2]["rows"].tolist() == [2, 3]
    assert by_key[2]["missing"]["ref_per_token_logps"].tolist() == [3]
    assert by_key[2]["missing"]["rewards"].tolist() == []
    assert by_key[3]["rows"].tolist() == [4]                      # short of rows; its one row is complete
    assert {k: v.tolist() for k, v in by_key[3]["missing"].items()} == {"rewards": [], "ref_per_token_logps": []}
    # "position" (what the writers' back-pressure reads) counts the waiting group like an incomplete one
    assert stream.state_dict()["position"] == 5 and sorted(stream.state_dict()["incomplete"].tolist()) == [2, 3, 4]
    assert stream.drop_incomplete(0) == 3 and stream.stats()["dropped_incomplete"] == 3


def test_a_required_column_only_ever_missing_per_row(store):
    # a per-token column's null rows (validity False), next to rows that carry it
    store.extend(_rows([1, 2, 3], rewards=[1.0, 2.0, 3.0], ref=[None, [0.1, 0.2], None]))
    stream = RolloutStream(store, "t", group_size=1, require="ref_per_token_logps")
    assert stream.require == ("ref_per_token_logps",)
    assert stream.next(1, timeout=0).tolist() == [1]
    assert stream.next(1, timeout=0) is None


@pytest.mark.parametrize("bad", [[""], [3], ["x" * 300], 5, [None]])
def test_a_name_that_cannot_be_a_column_is_refused(store, bad):
    with pytest.raises(ArgumentError, match="require"):
        RolloutStream(store, "t", group_size=1, require=bad)
    assert "stream.t" not in store.manifest.states                # nothing committed


def test_the_cursor_keeps_the_waiting_rows_and_their_order_across_a_resume(store):
    store.extend(_rows([1, 2, 3]))
    stream = RolloutStream(store, "t", group_size=1, require=["rewards"])
    store.extend(_rows([4, 5, 6], rewards=[1.0, 2.0, 3.0]))
    assert stream.next(1, timeout=0).tolist() == [3]
    stream.save()
    again = RolloutStream(store, "t", group_size=1, require=["rewards"])
    assert again.next(2, timeout=0).tolist() == [4, 5]
    assert again.next(1, timeout=0) is None
    assert sorted(int(g["rows"][0]) for g in again.incomplete_groups()) == [0, 1, 2]
    # the same cursor without require: the waiting rows go out (nothing was lost)
    plain = RolloutStream(store, "plain", group_size=1)
    plain.load_state_dict(again.state_dict())
    assert plain.next(3, timeout=0).tolist() == [0, 1, 2]


def test_a_poll_reads_nothing_until_a_commit_and_never_rereads_ready_rows(store):
    reads = []
    read = store.read_ranges

    def counting(rows, columns=None):
        reads.append((np.asarray(rows).tolist(), columns))
        return read(rows, columns=columns)

    store.extend(_rows([1, 2]))
    store.extend(_rows([3, 4], rewards=[1.0, 2.0]))
    stream = RolloutStream(store, "t", group_size=1, require=["rewards"])
    store.read_ranges = counting
    assert stream.next(1, timeout=0).tolist() == [2]
    assert reads == [([0, 1, 2, 3], ["rewards"])]
    reads.clear()
    assert stream.next(1, timeout=0).tolist() == [3]              # known ready: no read
    assert stream.next(1, timeout=0) is None
    assert reads == []                                            # no commit since: no read
    store.extend(_rows([5], rewards=[3.0]))
    assert stream.next(1, timeout=0).tolist() == [4]
    assert reads == [([0, 1, 4], ["rewards"])]                    # only the rows not known ready


def test_rows_go_out_in_the_order_their_values_came_and_a_resume_keeps_it(store):
    rows = store.extend(_rows([1, 2, 3, 4]))                     # scored later, out of order
    stream = RolloutStream(store, "t", group_size=1, require=["rewards"])
    assert stream.next(1, timeout=0) is None                      # no "rewards" column yet
    store.update([2], {"rewards": [1.0]})
    assert stream.next(2, timeout=0) is None                      # row 2 is ready, the batch is not
    store.update([0, 3], {"rewards": [1.0, 1.0]})                # found at one poll: in commit order
    assert stream.next(4, timeout=0) is None
    assert stream.incomplete_groups()[0]["missing"]["rewards"].tolist() == [1]
    stream.save()
    again = RolloutStream(store, "t", group_size=1, require=["rewards"])
    assert again.next(3, timeout=0).tolist() == [2, 0, 3]         # not row order: the order they became ready
    store.update([rows[1]], {"rewards": [np.nan]})               # still no value
    assert again.next(1, timeout=0) is None
    store.update([rows[1]], {"rewards": [0.0]})
    assert again.next(1, timeout=0).tolist() == [1]
    assert again.stats()["handed_out"] == 4 and again.stats()["waiting"] == 0


def test_a_group_goes_out_when_its_last_row_is_scored(store):
    store.extend(_rows([1, 1, 2, 2]))
    stream = RolloutStream(store, "t", group_size=2, require=["rewards", "ref_per_token_logps"])
    store.update([0, 1, 2, 3], {"rewards": [1.0, 0.0, 1.0, 0.0]})
    store.update([3, 2], {"ref_per_token_logps": [[0.1, 0.2], [0.3, 0.4]]})
    assert stream.next(2, timeout=0).tolist() == [2, 3]
    assert stream.incomplete_groups()[0]["missing"]["ref_per_token_logps"].tolist() == [0, 1]
    store.update([0], {"ref_per_token_logps": [[0.5, 0.6]]})
    assert stream.next(2, timeout=0) is None
    store.update([1], {"ref_per_token_logps": [[0.7, 0.8]]})
    assert stream.next(2, timeout=0).tolist() == [0, 1]


def test_the_docs_example_runs(tmp_path, capsys):
    """docs/streams.md's example of require=, run as written (given ``path``)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "streams.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "require=" in b]
    exec(compile(textwrap.dedent(code), "docs/streams.md require block", "exec"), {"path": str(tmp_path / "s")})
    assert capsys.readouterr().out.splitlines()[:2] == ["[0 1]", "{'rewards': array([3])}"]


# ---------------------------------------------------------------- writers that score later, a killed trainer

GROUP, STEPS = 4, 30

SCORING_WRITER = """
import sys, time
import numpy as np
from diskreplay import ReplayStore
path, me, writers, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
share = {group} // writers
rng = np.random.default_rng(me)
unscored = {{}}
with ReplayStore(path) as store:
    print("started", flush=True)
    while "trainer" not in store.consumers():  # the trainer is at the edge from the first row
        time.sleep(0.02)
    for step in range(steps):
        store.wait_for_consumers(max_ahead_rows=96, timeout=10, poll=0.02)  # above the scoring lag (48 rows)
        # the samples of one prompt come from several writers and commits, their rewards later still,
        # out of order: a step's rows are scored 1 to 3 steps after they were committed
        prompts = np.repeat(np.arange(4) + 4 * step, share)
        rows = store.extend({{"prompt_id": prompts, "completion_ids": [[me, step, i] for i in range(prompts.size)]}},
                            token=f"w{{me}}:{{step}}")
        unscored.setdefault(step + int(rng.integers(1, 4)), []).append((step, np.asarray(rows)))
        for done, rows in unscored.pop(step, []) + (sum(unscored.values(), []) if step == steps - 1 else []):
            store.update(rows, {{"rewards": rows.astype(np.float64) + 0.5}}, token=f"r{{me}}:{{done}}")
        time.sleep(0.004 * (me + 1))
""".format(group=GROUP)

SCORED_TRAINER = """
import sys
import numpy as np
from diskreplay import ReplayStore
from diskreplay.stream import RolloutStream
path, drain = sys.argv[1], sys.argv[2] == "drain"
with ReplayStore(path) as store:
    stream = RolloutStream(store, "trainer", group_size={group}, require=["rewards"])
    extra = stream.extra or {{}}
    consumed = np.asarray(extra.get("consumed", np.zeros(0, np.int64)), np.int64)
    unscored = np.asarray(extra.get("unscored", np.zeros(0, np.int64)), np.int64)
    print("resumed", stream.position, consumed.size, flush=True)
    while True:
        rows = stream.next(2 * {group}, timeout=2.0 if drain else 30.0)
        if rows is None:
            break
        scored = "rewards" in store.columns                                 # the "training step"
        rewards = store.read(rows, columns=["rewards"])["rewards"] if scored else np.full(rows.size, np.nan)
        unscored = np.concatenate([unscored, rows[np.isnan(rewards)]])
        consumed = np.concatenate([consumed, rows])
        stream.save(extra={{"consumed": consumed, "unscored": unscored}})   # the step and the cursor, one commit
        print("saved", consumed.size, flush=True)
print("done", flush=True)
""".format(group=GROUP)


def _start(code, *args):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _lines(proc):
    """The lines ``proc`` prints, as they come (a queue a test can wait on with a timeout)."""
    out: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [out.put(line) for line in iter(proc.stdout.readline, b"")], daemon=True).start()
    return out


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-4000:]
    return out.decode()


@pytest.mark.slow
def test_a_killed_trainer_gets_every_row_once_and_only_once_it_is_scored(tmp_path):
    rng = random.Random(49)
    path = str(tmp_path / "store")
    ReplayStore(path, multi_writer=True).close()  # "rewards" comes with the first update
    writers = [_start(SCORING_WRITER, path, w, 2, STEPS) for w in range(2)]
    kills, consumed_at = 0, []
    try:
        assert [w.stdout.readline() for w in writers] == [b"started\n"] * 2
        for _ in range(3):
            trainer = _start(SCORED_TRAINER, path, "live")
            lines = _lines(trainer)
            consumed_at.append(int(lines.get(timeout=120).split()[2]))
            for _ in range(rng.randint(1, 4)):  # killed after a few steps, somewhere in the next one
                assert lines.get(timeout=120).startswith(b"saved")
            time.sleep(rng.uniform(0, 0.05))
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(timeout=60)
            kills += trainer.returncode == -signal.SIGKILL
        for w in writers:
            _finish(w)
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    assert kills == 3
    consumed_at.append(int(_finish(_start(SCORED_TRAINER, path, "drain")).split()[2]))
    assert consumed_at[-1] > 0 and consumed_at == sorted(consumed_at), consumed_at  # each life went on from the last

    with ReplayStore(path, readonly=True) as store:
        state = store.load_state("stream.trainer")
        consumed = np.asarray(state["extra"]["consumed"], np.int64)
        assert np.asarray(state["extra"]["unscored"]).size == 0, "a row handed out before its reward"
        assert store.next_row == STEPS * 4 * GROUP
        assert consumed.size == np.unique(consumed).size, "a row handed out twice"
        assert np.asarray(state["pending"]).size == 0, "every group completes and is scored once the writers are done"
        assert sorted(consumed.tolist()) == list(range(store.next_row)), "a row lost"
        data = store.read(consumed, columns=["prompt_id", "rewards"])
        assert (data["rewards"] == consumed + 0.5).all()
        keys = data["prompt_id"].reshape(-1, GROUP)
        assert (keys == keys[:, :1]).all(), "a handed-out group mixes prompts"


# ---------------------------------------------------------------- ranks: rank 0 decides what is ready


def _rank_worker(out_dir: str, path: str) -> None:
    import json
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = ReplayStore(path) if rank == 0 else ReplayStore(path, readonly=True)  # only rank 0 commits
    stream = RolloutStream(store, "trainer", group_size=GROUP, require=["rewards"], rank=rank,
                           world_size=dist.get_world_size())
    groups = np.arange(4 * GROUP).reshape(4, GROUP)   # committed unscored before the ranks started
    handed = []

    def score(*which):
        if rank == 0:  # (a scorer elsewhere: rank 1 has not seen the commit)
            for g in which:
                store.update(groups[g], {"rewards": np.ones(GROUP)})
        dist.barrier()

    def take():
        rows = stream.next(GROUP, timeout=0)
        if rows is not None:  # the rows a rank is handed have their values in its own view
            assert not np.isnan(store.read(rows, columns=["rewards"])["rewards"]).any(), (rank, rows)
        handed.append(None if rows is None else rows.tolist())

    score(3, 2)
    take()                # [groups 2, 3]: rank 1 reads a commit it had not loaded
    score(1)
    if rank == 1:
        store.refresh()   # rank 1 has seen group 1 scored too
    take()                # one ready group for two ranks: nothing
    score(0)
    take()                # [groups 1, 0]: 1 was ready a poll earlier
    stream.save()
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
        json.dump(handed, fh)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_hand_out_what_rank_0_saw_ready(tmp_path):
    import json

    path = str(tmp_path / "store")
    with ReplayStore(path, multi_writer=True) as store:
        store.extend({"prompt_id": np.repeat([3, 2, 1, 0], GROUP), "completion_ids": [[1]] * (4 * GROUP)})
    torchrun(__file__, [str(tmp_path), path], nproc=2, timeout=120)
    ranks = [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(2)]
    groups = np.arange(4 * GROUP).reshape(4, GROUP).tolist()
    assert ranks[0] == [groups[2], None, groups[1]]
    assert ranks[1] == [groups[3], None, groups[0]]
    with ReplayStore(path, readonly=True) as store:
        state = store.load_state("stream.trainer")
        assert state["counts"]["handed_out"] == 4 * GROUP and state["pending"].size == 0


if __name__ == "__main__":
    _rank_worker(sys.argv[1], sys.argv[2])
