"""Values for committed rows (``ReplayStore.update``; docs/FORMAT.md, "Patches").

Every read path returns the newest value of a patched row; merges and ``compact`` fold patches
into segments; eviction drops them; ``verify`` checks them; an update commits exactly once
with a token, survives SIGKILL at any point, and two writers patching one cell leave the value
of the later commit; a diskreplay without patches refuses a patched store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diskreplay import (ArgumentError, BatchError, Collator, ReplayStore, RowsEvictedError, SchemaError, collate,
                        collate_packed)
from diskreplay import format as fmt
from diskreplay.export import export_parquet
from diskreplay.verify import verify_store
from .conftest import package_at
from .torchrun import ROOT, child_env

#: a diskreplay that knows no patches
PREVIOUS_VERSION = "5ef3bcc"


def tokens(i):
    return np.arange(i % 4 + 1, dtype=np.int32) + i


def batch(first, n):
    ids = np.arange(first, first + n)
    return {"prompt_id": ids // 4, "completion_ids": [tokens(i) for i in ids],
            "rewards": (ids * 0.5).astype(np.float32), "policy_version": ids // 8,
            "sampling_logps": [-tokens(i).astype(np.float32) / 10 for i in ids]}


def fill(store, rows=64, per=8):
    for first in range(0, rows, per):
        store.extend(batch(first, per))


class Model:
    """What every read must return: the newest value written for each (row, column)."""

    def __init__(self, n):
        ids = np.arange(n)
        self.rewards = {int(i): float(i * 0.5) for i in ids}
        self.ref = {}  # row -> per-token values (a column the updates add)

    def check(self, store, rows):
        got = store.read(rows, ["rewards", "ref_logps"] if "ref_logps" in store.columns else ["rewards"])
        assert got["rewards"].tolist() == [pytest.approx(self.rewards[r]) for r in rows]
        if "ref_logps" in got:
            col = got["ref_logps"]
            for k, r in enumerate(rows):
                want = self.ref.get(r)
                if want is None:
                    assert col is None or (col.validity is not None and not col.validity[k])
                else:
                    assert col[k].tolist() == pytest.approx(want)


def ok(path):
    report = verify_store(path)
    assert report["ok"], report["problems"]
    return report


# ------------------------------------------------------------------ round trips


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(updates=st.lists(st.tuples(st.sets(st.integers(0, 47), min_size=1, max_size=12), st.booleans()),
                        min_size=1, max_size=6),
       reads=st.lists(st.integers(0, 47), min_size=1, max_size=20))
def test_reads_see_the_newest_value_of_each_row(tmp_path_factory, updates, reads):
    path = str(tmp_path_factory.mktemp("s"))
    model = Model(48)
    with ReplayStore(path) as store:
        fill(store, 48)
        for k, (rows, per_token) in enumerate(updates):
            rows = sorted(rows)
            if per_token:
                vals = [(np.arange(len(tokens(r)), dtype=np.float32) - r - k) for r in rows]
                store.update(rows, {"ref_logps": vals})
                model.ref.update({r: v.tolist() for r, v in zip(rows, vals)})
            else:
                vals = [float(r * 10 + k) for r in rows]
                store.update(rows[::-1], {"rewards": vals[::-1]})  # any order
                model.rewards.update(dict(zip(rows, vals)))
            model.check(store, reads)
        # every layout a trainer reads
        rows = np.array(reads)
        padded = Collator(pad_token_id=0).read(store, rows)
        assert padded["rewards"].tolist() == pytest.approx([model.rewards[r] for r in reads])
        if "ref_logps" in store.columns:
            got = store.read_ranges(rows, ["ref_logps"])["ref_logps"]
            for k, r in enumerate(reads):
                if r in model.ref:
                    assert got[k].tolist() == pytest.approx(model.ref[r])
            packed = collate_packed(store.read(rows))
            assert packed is not None
        # reopened, compacted (patches folded), and verified
    with ReplayStore(path) as store:
        model.check(store, reads)
        store.compact()
        assert store.manifest.patches == ()
        model.check(store, reads)
        model.check(store, list(range(48)))
    ok(path)


def test_exports_and_collate_carry_patched_values(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        fill(store, 16)
        store.update([3, 9], {"rewards": [100.0, -1.0], "score": [0.25, 0.75]})
        out = collate(store.read([3, 9, 2]), pad_token_id=0)
        assert out["rewards"].tolist() == [100.0, -1.0, 1.0]
        assert np.isnan(store.read([2], ["score"])["score"][0])
    info = export_parquet(path, str(tmp_path / "out.parquet"))
    assert info["rows"] == 16
    table = pq.read_table(str(tmp_path / "out.parquet")).to_pydict()
    at = {r: k for k, r in enumerate(range(16))}
    assert table["rewards"][at[3]] == 100.0 and table["rewards"][at[9]] == -1.0
    assert table["score"][at[3]] == 0.25 and table["score"][at[2]] is None


def test_samplers_see_rescored_rewards(tmp_path):
    from diskreplay.samplers.base import live_column

    with ReplayStore(str(tmp_path / "s")) as store:
        fill(store, 16)
        seen = live_column("rewards")
        assert seen.live(store)[5] == 2.5
        store.update([5], {"rewards": [42.0]})
        assert seen.live(store)[5] == 42.0


# ------------------------------------------------------------------ refusals


def test_bad_updates_are_refused_naming_what_is_wrong_and_change_nothing(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, capacity=40) as store:
        fill(store, 48)  # rows 0-7 evicted
        before = (store.generation, sorted(os.listdir(os.path.join(path, "segments"))))
        cases = [
            ([8, 9], {"ref_logps": [np.zeros(1, np.float32), np.zeros(3, np.float32)]}, BatchError, "row 9"),
            ([8], {"prompt_id": [3]}, ArgumentError, "group key"),
            ([8], {"completion_ids": [[1]]}, ArgumentError, "token ids"),
            ([8, 8], {"rewards": [1.0, 2.0]}, ArgumentError, "row 8 twice"),
            ([3], {"rewards": [1.0]}, RowsEvictedError, "row 3"),
            ([8, 9], {"rewards": [1.0]}, BatchError, "1 rows but rows names 2"),
            ([8], {"policy_version": [1.5]}, BatchError, "policy_version"),
            ([8], {"flag": [True]}, SchemaError, "flag"),
            ([], {"rewards": []}, ArgumentError, "empty"),
            ([8], {}, ArgumentError, "non-empty"),
        ]
        for rows, values, error, says in cases:
            with pytest.raises(error, match=says):
                store.update(rows, values)
        assert (store.generation, sorted(os.listdir(os.path.join(path, "segments")))) == before
    ok(path)


def test_a_column_keeps_its_type(tmp_path):
    with ReplayStore(str(tmp_path / "s")) as store:
        fill(store, 8)
        store.update([1], {"judge": [0.5]})
        with pytest.raises(SchemaError, match="judge"):
            store.update([2], {"judge": [[0.5, 1.0]]})


# ------------------------------------------------------------------ eviction, merges, verify


def test_eviction_drops_patches_whose_rows_are_gone(tmp_path):
    with ReplayStore(str(tmp_path / "s"), capacity=32) as store:
        fill(store, 32)
        store.update([1, 2], {"rewards": [7.0, 8.0]})
        store.update([30], {"rewards": [9.0]})
        assert len(store.manifest.patches) == 2
        store.extend(batch(32, 8))  # rows 0-7 evicted
        assert [p.first_row for p in store.manifest.patches] == [30]
        assert store.read([30], ["rewards"])["rewards"].tolist() == [9.0]


def test_a_merge_folds_only_patches_wholly_inside_its_rows(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        fill(store, 64)
        store.compact()
        store.extend(batch(64, 4))
        store.extend(batch(68, 4))
        store.update([1, 66], {"rewards": [1.5, 2.5]})   # spans the big segment and the tail
        store.update([66], {"rewards": [3.5]})
        merger = store._writer.merger
        m = store.manifest
        # a merge of the two small tail segments cannot fold the first patch: it keeps every patch
        merger.rewrite(store._writer_context(), len(m.segments) - 2, len(m.segments), 1 << 20)
        assert len(store.manifest.patches) == 2
        assert store.read([1, 66, 70], ["rewards"])["rewards"].tolist() == [1.5, 3.5, 35.0]
        store.compact()
        assert store.manifest.patches == ()
        assert store.read([1, 66, 70], ["rewards"])["rewards"].tolist() == [1.5, 3.5, 35.0]
    ok(path)


def test_verify_finds_a_damaged_patch(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        fill(store, 8)
        store.update([1], {"rewards": [5.0]})
        rel = store.manifest.patches[0].file
    ok(path)
    with open(os.path.join(path, rel), "r+b") as f:
        f.seek(-20, os.SEEK_END)
        b = f.read(1)
        f.seek(-20, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    report = verify_store(path)
    assert not report["ok"] and any("patch" in p and "checksum" in p for p in report["problems"])


def test_format_json_says_patches_and_an_old_diskreplay_refuses_the_store(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        fill(store, 8)
        store.update([1], {"rewards": [5.0]})
    doc = json.load(open(os.path.join(path, "FORMAT.json")))
    assert doc["version"] == fmt.PATCHES_FORMAT_VERSION and doc["patches"] is True
    previous = package_at(PREVIOUS_VERSION, tmp_path / "previous")
    code = "import sys\nfrom diskreplay import ReplayStore\nReplayStore(sys.argv[1])\n"
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=previous), cwd=previous)
    assert proc.returncode != 0 and "Unsupported version 6" in proc.stderr, proc.stderr[-800:]
    with ReplayStore(path) as store:  # and nothing was collected
        assert store.read([1], ["rewards"])["rewards"].tolist() == [5.0]


def test_memory_storage_and_many_writers(tmp_path):
    for path in ("memory://patches-test", str(tmp_path / "mw")):
        with ReplayStore(path, multi_writer=True) as store:
            fill(store, 16)
            store.update([2, 3], {"rewards": [4.0, 5.0]}, token="score:0")
            assert store.update([2, 3], {"rewards": [4.0, 5.0]}, token="score:0") == 2
            with ReplayStore(path, multi_writer=True) as other:
                other.update([3], {"rewards": [6.0]})
            store.update([3, 4], {"rewards": [7.0, 8.0]})  # rebased on the other's commit: still newest
            assert store.read([2, 3, 4], ["rewards"])["rewards"].tolist() == [4.0, 7.0, 8.0]


# ------------------------------------------------------------------ exactly once


def test_a_token_commits_an_update_once(tmp_path):
    with ReplayStore(str(tmp_path / "s")) as store:
        fill(store, 8)
        assert store.update([1, 2], {"rewards": [5.0, 6.0]}, token="judge:1") == 2
        gen = store.generation
        assert store.update([2, 1], {"rewards": [6.0, 5.0]}, token="judge:1") == 2  # a retry, any order
        assert store.generation == gen
        with pytest.raises(BatchError, match="judge:1"):
            store.update([1, 2], {"rewards": [5.0, 7.0]}, token="judge:1")


_UPDATER = textwrap.dedent("""
    import sys
    import numpy as np
    from diskreplay import ReplayStore
    path, acks, multi = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    store = ReplayStore(path, multi_writer=multi)
    with open(acks, "a") as out:
        for step in range(40):
            rows = [(step * 7 + k * 5) % 64 for k in range(6)]
            store.update(rows, {"rewards": [float(step * 100 + r) for r in rows],
                                "ref_logps": [np.full(r % 4 + 1, step, np.float32) for r in rows]},
                         token=f"judge:{step}")
            out.write(f"{step}\\n"); out.flush()
""")


def _acked(acks):
    return [int(x) for x in open(acks).read().split()] if os.path.exists(acks) else []


@pytest.mark.slow
@pytest.mark.parametrize("multi", [False, True])
def test_an_updater_killed_anywhere_and_retried_commits_every_update_once(tmp_path, multi):
    """SIGKILL at the worst moments of 40 tokened updates (after FORMAT.json says patches, after a
    patch file is durable, right after a commit is visible and before the caller hears of it),
    then at random moments; each time the updater starts again from step 0 (its tokens); every
    acknowledged update stays committed, none is committed twice, the values are the model's."""
    path, acks = str(tmp_path / "s"), str(tmp_path / "acks")
    with ReplayStore(path, multi_writer=multi) as store:
        fill(store, 64)
    args = [sys.executable, "-c", _UPDATER, path, acks, str(int(multi))]
    interrupted = 0
    for at in ("format.done#1", "segments.synced#3", "manifest.committed#4", "segments.synced#9",
               "manifest.committed#17"):
        proc = subprocess.run(args, env=dict(child_env(), DISKREPLAY_CRASH_AT=at), cwd=ROOT, capture_output=True,
                              timeout=300)
        assert proc.returncode == -signal.SIGKILL, (at, proc.stderr[-2000:])
        interrupted += 1
    rng = np.random.default_rng(7)
    for _ in range(3):  # and at random moments, once some updates are acknowledged
        proc = subprocess.Popen(args, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        want = len(_acked(acks)) + int(rng.integers(1, 4))
        deadline = time.monotonic() + 120
        while len(_acked(acks)) < want and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(float(rng.uniform(0, 0.02)))
        proc.send_signal(signal.SIGKILL)
        interrupted += proc.wait() == -signal.SIGKILL
        with ReplayStore(path, multi_writer=multi, readonly=True) as reader:
            for step in _acked(acks):  # an acknowledged update is committed
                assert reader.committed_rows(f"judge:{step}") is not None, step
    assert interrupted >= 6
    proc = subprocess.run(args, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = {r: r * 0.5 for r in range(64)}
    ref = {}
    for step in range(40):
        for r in [(step * 7 + k * 5) % 64 for k in range(6)]:
            want[r], ref[r] = float(step * 100 + r), step
    with ReplayStore(path, multi_writer=multi) as store:
        assert len(store.manifest.patches) == 40  # each update once
        got = store.read(np.arange(64), ["rewards", "ref_logps"])
        assert got["rewards"].tolist() == [want[r] for r in range(64)]
        for r in range(64):
            if r in ref:
                assert got["ref_logps"][r].tolist() == [ref[r]] * (r % 4 + 1)
    ok(path)


_RACER = textwrap.dedent("""
    import sys
    from diskreplay import ReplayStore
    path, me = sys.argv[1], int(sys.argv[2])
    store = ReplayStore(path, multi_writer=True)
    for step in range(30):
        store.update([0, 1, 2, 3], {"rewards": [float(me * 1000 + step)] * 4}, token=f"w{me}:{step}")
        if step % 5 == 0:
            store.extend({"prompt_id": [99], "completion_ids": [[1]], "rewards": [0.0], "policy_version": [0],
                          "sampling_logps": [[0.0]]})
""")


@pytest.mark.slow
def test_two_writers_patching_one_cell_leave_the_later_commit(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True) as store:
        fill(store, 8)
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, path, str(me)], env=child_env(), cwd=ROOT,
                              stderr=subprocess.PIPE) for me in (1, 2)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    with ReplayStore(path, multi_writer=True) as store:
        patches = store.manifest.patches
        assert len(patches) == 60
        # the value read is the newest commit's: the last patch holds it
        last = store._cache.patches.record(patches[-1]).column("rewards").to_pylist()[0]
        assert store.read([0, 1, 2, 3], ["rewards"])["rewards"].tolist() == [last] * 4
        assert last in (1029.0, 2029.0)  # a writer's last update, never an older one
        store.compact()
        assert store.read([0, 1, 2, 3], ["rewards"])["rewards"].tolist() == [last] * 4
    ok(path)


# ------------------------------------------------------------------ versions


def test_named_versions_stay_readable_after_newer_values_and_compact(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        fill(store, 16)
        store.update([1, 2], {"rewards": [10.0, 20.0]}, version="exact-match", meta={"scorer": "em", "at": 1})
        store.update([2, 3], {"rewards": [0.25, 0.5], "judge_logps": [np.zeros(3, np.float32), np.ones(4, np.float32)]},
                     version="judge-v2", token="judge:0")
        assert store.update([3, 2], {"rewards": [0.5, 0.25],
                                     "judge_logps": [np.ones(4, np.float32), np.zeros(3, np.float32)]},
                            version="judge-v2", token="judge:0") == 2
        with pytest.raises(BatchError, match="judge:0"):  # the same token for another version
            store.update([2, 3], {"rewards": [0.25, 0.5], "judge_logps": [np.zeros(3, np.float32),
                                                                           np.ones(4, np.float32)]},
                         version="judge-v3", token="judge:0")
        store.update([1], {"rewards": [-1.0]})  # unnamed: newest, no version
        assert store.versions("rewards") == {"exact-match": {"meta": {"scorer": "em", "at": 1}, "patches": 1, "rows": 2},
                                             "judge-v2": {"meta": {}, "patches": 1, "rows": 2}}

        def check():
            got = store.read([0, 1, 2, 3], ["rewards", "rewards@exact-match", "rewards@judge-v2", "judge_logps@judge-v2"])
            assert got["rewards"].tolist() == [0.0, -1.0, 0.25, 0.5]
            assert np.isnan(got["rewards@exact-match"][[0, 3]]).all()
            assert got["rewards@exact-match"][1:3].tolist() == [10.0, 20.0]
            assert np.isnan(got["rewards@judge-v2"][:2]).all() and got["rewards@judge-v2"][2:].tolist() == [0.25, 0.5]
            col = got["judge_logps@judge-v2"]
            assert col.validity.tolist() == [False, False, True, True] and col[3].tolist() == [1.0] * 4

        check()
        store.compact()
        assert all(p.folded for p in store.manifest.patches) and len(store.manifest.patches) == 2
        check()
    with ReplayStore(path) as store:
        check()
        with pytest.raises(Exception, match="its versions"):
            store.read([0], ["rewards@nope"])
    ok(path)


def test_bad_versions_are_refused(tmp_path):
    with ReplayStore(str(tmp_path / "s")) as store:
        fill(store, 8)
        gen = store.generation
        for kwargs, error, says in (
                (dict(version="a@b"), ArgumentError, "version name"),
                (dict(version="v", meta={"x": object()}), ArgumentError, "JSON"),
                (dict(meta={"x": 1}), ArgumentError, "version="),
                (dict(version="v", meta={"x": "y" * 5000}), ArgumentError, "at most"),
        ):
            with pytest.raises(error, match=says):
                store.update([1], {"rewards": [1.0]}, **kwargs)
        with pytest.raises(ArgumentError, match="policy_version"):  # int: no "not computed" value
            store.update([1], {"policy_version": [3]}, version="v")
        assert store.generation == gen


def test_repair_drops_a_damaged_patch_and_keeps_every_row(tmp_path):
    from diskreplay.verify import repair_store

    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        fill(store, 16)
        store.update([1, 2], {"rewards": [5.0, 6.0]})
        store.update([2, 3], {"rewards": [7.0, 8.0]})
        rel = store.manifest.patches[1].file
    with open(os.path.join(path, rel), "r+b") as f:
        f.seek(-20, os.SEEK_END)
        b = f.read(1)
        f.seek(-20, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    actions = repair_store(path)["actions"]
    assert any("damaged patch" in a and "[2, 4)" in a for a in actions), actions
    ok(path)
    with ReplayStore(path) as store:
        assert len(store) == 16
        assert store.read([1, 2, 3], ["rewards"])["rewards"].tolist() == [5.0, 6.0, 1.5]


_COMPACTOR = textwrap.dedent("""
    import sys, time
    from diskreplay import ReplayStore, CommitConflictError
    path, stop = sys.argv[1], sys.argv[2]
    import os
    store = ReplayStore(path, multi_writer=True)
    n = 0
    print("ready", flush=True)
    while not os.path.exists(stop):
        try:
            store.compact(target_bytes=1 << 20)
            n += 1
            with open(stop + ".count", "w") as f:
                f.write(str(n))
        except CommitConflictError:
            pass
    print(n)
""")


@pytest.mark.slow
def test_compaction_racing_updates_never_brings_back_an_older_value(tmp_path):
    """One process compacts (folding patches) over and over while another appends and updates the
    same rows with ever larger values: after each update, and at the end, every read gives that
    update's values; verify is clean."""
    path, stop = str(tmp_path / "s"), str(tmp_path / "stop")
    with ReplayStore(path, multi_writer=True) as store:
        fill(store, 32)
    compactor = subprocess.Popen([sys.executable, "-c", _COMPACTOR, path, stop], env=child_env(), cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert compactor.stdout.readline().strip() == "ready", compactor.stderr.read()[-2000:]
    try:
        def compactions():
            try:
                return int(open(stop + ".count").read() or 0)
            except (OSError, ValueError):
                return 0

        with ReplayStore(path, multi_writer=True) as store:
            step, deadline = -1, time.monotonic() + 120
            # at least 40 updates, and on until the compactor has committed a few times meanwhile
            while step < 39 or (compactions() < 6 and time.monotonic() < deadline):
                step += 1
                rows = [3, 17, 29] if step % 2 else [3, 5]
                store.update(rows, {"rewards": [float(step)] * len(rows)})
                want = {3: float(step), **{r: float(step) for r in rows}}
                if step % 5 == 0:
                    store.extend(batch(32 + step, 2))
                got = store.read(list(want), ["rewards"])["rewards"].tolist()
                assert got == list(want.values()), (step, got)
    finally:
        open(stop, "w").close()
        out, err = compactor.communicate(timeout=300)
    assert compactor.returncode == 0, err[-2000:]
    assert int(out.split()[-1]) > 5  # compactions ran throughout (each folding the patches it could)
    with ReplayStore(path, multi_writer=True) as store:
        got = store.read([3, 5, 17, 29], ["rewards"])["rewards"].tolist()
        last_odd, last_even = (step, step - 1) if step % 2 else (step - 1, step)
        assert got == [float(step), float(last_even), float(last_odd), float(last_odd)]
    ok(path)


def test_a_per_token_tensor_column_is_updated_per_token(tmp_path):
    from diskreplay import PerTokenTensor

    with ReplayStore(str(tmp_path / "s")) as store:
        b = batch(0, 8)
        b["routed"] = PerTokenTensor([np.zeros((len(c), 2, 2), np.uint8) for c in b["completion_ids"]],
                                     dtype="uint8", align="completion", fill=255)
        store.extend(b)
        lengths = [len(tokens(r)) for r in (1, 2)]
        store.update([1, 2], {"routed": [np.full((n, 2, 2), 7, np.uint8) for n in lengths]})
        got = store.read([1, 2, 3], ["routed"])["routed"]
        assert got[0].tolist() == [7] * 4 * lengths[0] and got[2].tolist() == [0] * 4 * len(tokens(3))
        with pytest.raises(BatchError, match=r"row 1 has 12 values \(3 tensors"):
            store.update([1], {"routed": [np.zeros((lengths[0] + 1, 2, 2), np.uint8)]})


def test_the_reward_spread_filter_sees_updated_rewards(tmp_path):
    from diskreplay import PromptGroupSampler

    with ReplayStore(str(tmp_path / "s"), group_key="prompt_id") as store:
        store.extend({"prompt_id": [0] * 4 + [1] * 4, "completion_ids": [[1]] * 8,
                      "rewards": [1.0, 0, 0, 0, 0, 0, 0, 0]})
        sampler = PromptGroupSampler(num_groups=1, min_reward_std=0.0, seed=0)
        assert {int(r) // 4 for _ in range(10) for r in sampler.sample(store, 4)} == {0}
        store.update([4, 5, 6, 7], {"rewards": [0.0, 0.0, 5.0, 0.0]})
        assert {int(r) // 4 for _ in range(40) for r in sampler.sample(store, 4)} == {0, 1}
