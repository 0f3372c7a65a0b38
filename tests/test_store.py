import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from diskreplay import (BatchError, CorruptStoreError, ReadOnlyError, ReplayStore, RowsEvictedError,
                        SchemaError, StoreClosedError, StoreLockedError)
from diskreplay.synthetic import make_rollouts

from .conftest import assert_rows_equal


def snapshot(path):
    """Every file under ``path`` with its bytes' hash: a store 'exactly as before'."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            if f == "LOCK":
                continue
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


# --------------------------------------------------------------------------- round trips

ragged_rows = st.lists(st.integers(0, 151935), min_size=0, max_size=12)


@st.composite
def ragged_batches(draw):
    n = draw(st.integers(1, 10))
    comps = [np.array(draw(ragged_rows), dtype=np.int64) for _ in range(n)]
    prompts = [np.array(draw(st.lists(st.integers(0, 1000), min_size=0, max_size=6)), dtype=np.int32)
               for _ in range(n)]
    logps = [None if draw(st.booleans()) and draw(st.booleans()) else
             np.array(draw(st.lists(st.floats(-50, 0, width=32), min_size=len(c), max_size=len(c))),
                      dtype=np.float32) for c in comps]
    if all(x is None for x in logps):  # a column None in every row is "not computed": keep one row
        logps[0] = np.zeros(len(comps[0]), dtype=np.float32)
    keys = draw(st.one_of(st.lists(st.integers(-5, 5), min_size=n, max_size=n),
                          st.lists(st.text(min_size=0, max_size=8), min_size=n, max_size=n)))
    return {"prompt_id": keys, "prompt_ids": prompts, "completion_ids": comps, "old_per_token_logps": logps,
            "rewards": np.array(draw(st.lists(st.floats(-1, 1, width=32), min_size=n, max_size=n)),
                                dtype=np.float32)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(ragged_batches(), min_size=1, max_size=3))
def test_ragged_round_trip(tmp_path_factory, batches):
    kinds = {type(b["prompt_id"][0]) for b in batches}
    if len(kinds) > 1:  # one store holds one key type
        batches = [batches[0]]
    path = tmp_path_factory.mktemp("s")
    expected = []
    with ReplayStore(path) as store:
        for b in batches:
            rows = store.extend(b)
            assert len(rows) == len(b["prompt_id"])
            expected.append((rows, b))
        for rows, b in expected:
            got = store.read(rows)
            assert_rows_equal(got, {k: b[k] for k in ("prompt_ids", "completion_ids", "old_per_token_logps")})
            assert got["prompt_id"].tolist() if not isinstance(got["prompt_id"], list) else got["prompt_id"] == \
                b["prompt_id"]
            np.testing.assert_array_equal(got["rewards"], b["rewards"])
    with ReplayStore(path, readonly=True) as store:
        allkeys = [k for _, b in expected for k in b["prompt_id"]]
        assert len(store) == len(allkeys)
        assert store.num_groups == len(set(allkeys))
        for k in set(allkeys):
            assert store.group_rows(k).tolist() == [i for i, x in enumerate(allkeys) if x == k]


def test_trl_layout_strips_padding(store):
    b = {
        "prompt_ids": torch.tensor([[0, 0, 11, 12], [21, 22, 23, 24], [0, 0, 0, 0]]),
        "prompt_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]),
        "completion_ids": torch.tensor([[5, 6, 7], [8, 0, 0], [0, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.int32),
        "old_per_token_logps": torch.tensor([[-.1, -.2, -.3], [-.4, 9., 9.], [9., 9., 9.]]),
        "ref_per_token_logps": None,
        "sampling_per_token_logps": torch.tensor([[-.5, -.6, -.7], [-.8, 0., 0.], [0., 0., 0.]],
                                                 dtype=torch.bfloat16),
        "advantages": torch.tensor([1.0, -1.0, 0.0]),
        "prompt_id": torch.tensor([4, 4, 9]),
        "policy_version": 3 * torch.ones(3, dtype=torch.long),
        "rewards": torch.tensor([[1.0, 0.5], [0.0, 0.5], [0.0, 0.0]]),
    }
    rows = store.extend(b)
    got = store.read(rows)
    assert got["prompt_ids"].to_list() == [[11, 12], [21, 22, 23, 24], []]
    assert got["completion_ids"].to_list() == [[5, 6, 7], [8], []]
    np.testing.assert_array_equal(got["old_per_token_logps"].values, np.float32([-.1, -.2, -.3, -.4]))
    assert got["sampling_per_token_logps"].values.dtype == np.float32
    assert "ref_per_token_logps" not in store.columns
    assert got["rewards"].shape == (3, 2)
    assert got["prompt_ids"].values.dtype == np.int32 and got["advantages"].dtype == np.float32
    assert store.schema["rewards"].kind == "vector"
    assert store.group_rows(4).tolist() == [0, 1]


def test_per_row_only_batch_and_strings(store):
    rows = store.extend({"prompt_id": ["what is 2+2?", "what is 2+2?", "name a prime"],
                         "rewards": [1.0, 0.0, 1.0], "ok": [True, False, True]})
    got = store.read(rows[::-1])
    assert got["prompt_id"] == ["name a prime", "what is 2+2?", "what is 2+2?"]
    assert got["ok"].tolist() == [True, False, True]
    assert store.group_keys() == ["what is 2+2?", "name a prime"]


def test_read_spanning_segments_in_any_order(store):
    batches = [make_rollouts(3, 4, seed=s, first_group=3 * s) for s in range(4)]
    for b in batches:
        store.extend(b)
    rows = np.array([47, 0, 13, 13, 30, 5, 46])
    got = store.read(rows, columns=["completion_ids", "rewards", "prompt_id"])
    flat = {k: [x for b in batches for x in b[k]] for k in ("completion_ids",)}
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(got["completion_ids"][i], flat["completion_ids"][r])
    assert got["prompt_id"].tolist() == [r // 4 for r in rows]
    with pytest.raises(KeyError, match="nope"):
        store.read([0], columns=["nope"])
    with pytest.raises(RowsEvictedError, match="row 48"):
        store.read([48])


# --------------------------------------------------------------------------- reopen, capacity, groups

@pytest.mark.parametrize("kind", ["writer", "multi-writer", "readonly"])
def test_a_closed_store_refuses_every_use_and_close_stays_idempotent(tmp_path, kind):
    """Like a closed file: reads, refreshes, snapshots, states and appends after ``close()`` raise
    ``StoreClosedError`` (a ``ValueError``; a write's is the ``ReadOnlyError`` it always was)
    rather than quietly reopening the files the close released."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=kind == "multi-writer") as w:
        w.extend(make_rollouts(2, 4, seed=0))
        w.save_state("sampler", {"step": 1})
    store = ReplayStore(path, readonly=kind == "readonly") if kind != "multi-writer" else \
        ReplayStore(path, multi_writer=True)
    assert len(store.read([0, 7])["prompt_id"]) == 2
    store.close()
    uses = {"read": lambda: store.read([0]), "read_ranges": lambda: store.read_ranges([0]),
            "prefetch": lambda: store.prefetch([0]), "refresh": store.refresh, "snapshot": store.snapshot,
            "group_index": store.group_index, "load_state": lambda: store.load_state("sampler"),
            "committed_rows": lambda: store.committed_rows("t"),
            "extend": lambda: store.extend(make_rollouts(1, 4, seed=1))}
    for name, use in uses.items():
        with pytest.raises(StoreClosedError, match="is closed; open it again") as info:
            use()
        assert isinstance(info.value, ValueError) and isinstance(info.value, ReadOnlyError), name
    store.close()  # idempotent
    assert len(store) == 8  # what was held stays readable as plain attributes
    with ReplayStore(path, readonly=True) as again:
        assert len(again) == 8 and again.load_state("sampler") == {"step": 1}


@pytest.mark.parametrize("multi_writer", [False, True])
def test_a_reader_of_a_commit_before_the_first_row_has_no_columns(tmp_path, multi_writer):
    """Generation 0 (pinned, or a follower opened before the first append) lists the columns of no
    commit of its own: not the schema a later first append fixed on storage; a refresh brings them."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=multi_writer) as w:
        follower = ReplayStore(path, readonly=True)
        w.extend({"prompt_id": [1, 2], "rewards": [0.5, 1.0]})
        w.extend({"prompt_id": [3], "rewards": [0.25], "completion_ids": [np.array([4, 5])]})
        assert follower.columns == [] and follower.schema is None and follower.num_groups == 0
        assert follower.refresh() and follower.columns == ["prompt_id", "rewards", "completion_ids"]
        follower.close()
    seen = {}
    for generation in (0, 1, 2):
        with ReplayStore(path, readonly=True, generation=generation) as pinned:
            seen[generation] = (len(pinned), pinned.columns)
    assert seen == {0: (0, []), 1: (2, ["prompt_id", "rewards"]), 2: (3, ["prompt_id", "rewards", "completion_ids"])}


def test_reopen_in_fresh_process(tmp_path):
    path = tmp_path / "s"
    with ReplayStore(path, capacity=1000) as store:
        for s in range(3):
            store.extend(make_rollouts(4, 8, seed=s, first_group=10 * s))
        expected = store.read(store.row_ids(), ["completion_ids", "rewards"])
    code = textwrap.dedent(f"""
        import json, numpy as np
        from diskreplay import ReplayStore
        s = ReplayStore({str(path)!r}, readonly=True)
        r = s.read(s.row_ids(), ["completion_ids", "rewards"])
        print(json.dumps({{"n": len(s), "groups": s.group_keys(), "cap": s.capacity,
                           "ids": r["completion_ids"].values.tolist(), "rewards": r["rewards"].tolist()}}))
    """)
    out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                    text=True).stdout)
    assert out["n"] == 96 and out["cap"] == 1000
    assert out["groups"] == [g + 10 * s for s in range(3) for g in range(4)]
    assert out["ids"] == expected["completion_ids"].values.tolist()
    assert out["rewards"] == expected["rewards"].tolist()


def test_capacity_keeps_newest_rows_and_deletes_files(tmp_path):
    path = tmp_path / "s"
    with ReplayStore(path, capacity=50) as store:
        all_batches = []
        for s in range(40):
            b = make_rollouts(2, 4, seed=s, first_group=2 * s, completion_mean=20)
            store.extend(b)
            all_batches.append(b)
        assert len(store) == 50 and store.head == 320 - 50
        flat = [x for b in all_batches for x in b["completion_ids"]]
        got = store.read(store.row_ids(), ["completion_ids"])["completion_ids"]
        for i, r in enumerate(store.row_ids()):
            np.testing.assert_array_equal(got[i], flat[r])
        # groups are evicted with their rows: group 67 (rows 268..271) lost two
        assert store.group_rows(67).tolist() == [270, 271]
        assert store.group_keys()[0] == 67 and store.num_groups == 13
        with pytest.raises(RowsEvictedError, match="evicted"):
            store.read([0])
        segs = os.listdir(path / "segments")
        # evicted segments go once no retained manifest names them
        assert len(segs) <= len(store.manifest.segments) + 4
        assert len(os.listdir(path / "manifests")) <= 4
    with ReplayStore(path) as store:  # reopen as writer sweeps everything unreferenced
        assert len(os.listdir(path / "segments")) <= len(store.manifest.segments) + 4
        assert store.group_rows(67).tolist() == [270, 271]


def test_byte_capacity(tmp_path):
    with ReplayStore(tmp_path / "s", capacity_bytes=200_000) as store:
        for s in range(30):
            store.extend(make_rollouts(2, 4, seed=s, first_group=2 * s, completion_mean=300))
        live = sum(e.bytes + e.groups_bytes for e in store.manifest.segments)
        assert live <= 200_000 and len(store) > 0
        assert store.head == store.manifest.segments[0].first_row


def test_group_index_by_other_column(store):
    store.extend({"prompt_id": [1, 1, 2, 2], "task": ["a", "b", "a", "b"], "rewards": [0., 1., 0., 1.]})
    gi = store.group_index("task")
    assert gi.keys == ["a", "b"] and gi.group(0).tolist() == [0, 2]


def test_no_group_key_store(tmp_path):
    with ReplayStore(tmp_path / "s", group_key=None) as store:
        store.extend({"completion_ids": [[1, 2]], "rewards": [1.0]})
        assert not os.listdir(tmp_path / "s" / "groups")
        with pytest.raises(SchemaError, match="group_key=None"):
            store.group_keys()


def test_options_must_agree(tmp_path):
    ReplayStore(tmp_path / "s", capacity=10, group_key="prompt").close()
    with pytest.raises(SchemaError, match="capacity=20 disagrees"):
        ReplayStore(tmp_path / "s", capacity=20)
    with pytest.raises(SchemaError, match="group_key"):
        ReplayStore(tmp_path / "s", group_key="prompt_id")
    with ReplayStore(tmp_path / "s") as s:
        assert s.capacity == 10 and s.group_key == "prompt"
    with pytest.raises(ValueError, match="capacity must be a positive integer or None, got 0"):
        ReplayStore(tmp_path / "t", capacity=0)


def test_second_writer_is_refused(tmp_path):
    with ReplayStore(tmp_path / "s"):
        with pytest.raises(StoreLockedError, match="readonly=True"):
            ReplayStore(tmp_path / "s")
        code = f"from diskreplay import ReplayStore; ReplayStore({str(tmp_path / 's')!r})"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode != 0 and "StoreLockedError" in r.stderr
    ReplayStore(tmp_path / "s").close()  # released on close


def test_a_second_writer_in_the_same_process_is_told_so(tmp_path):
    """A second writer in this process was told the store was "already open for writing by another
    process" while this process held LOCK: the message now says which (and how to go on). Another
    process's lock still reads as another process's; a closed writer's lock is forgotten."""
    path = str(tmp_path / "s")
    with ReplayStore(path):
        with pytest.raises(StoreLockedError, match="already open for writing in this process") as info:
            ReplayStore(path)
        assert "another process" not in str(info.value) and "close it first" in str(info.value)
        with pytest.raises(StoreLockedError, match="in this process"):  # the same file under another path
            ReplayStore(os.path.join(str(tmp_path), ".", "s"))
    many = str(tmp_path / "many")
    with ReplayStore(many, multi_writer=True) as a, ReplayStore(many, multi_writer=True) as b:  # shared: both
        assert a.multi_writer and b.multi_writer
    code = (f"import time; from diskreplay import ReplayStore; s = ReplayStore({path!r}); print('open', flush=True); "
            "time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "open"
        with pytest.raises(StoreLockedError, match="by another process"):
            ReplayStore(path)
    finally:
        child.kill()
        child.wait()
    ReplayStore(path).close()


def test_reader_follows_writer(tmp_path):
    with ReplayStore(tmp_path / "s", capacity=16) as w:
        w.extend(make_rollouts(1, 8, seed=0))
        r = ReplayStore(tmp_path / "s", readonly=True)
        assert len(r) == 8 and r.group_keys() == [0]
        w.extend(make_rollouts(1, 8, seed=1, first_group=1))
        assert len(r) == 8 and r.refresh() and len(r) == 16
        assert r.group_keys() == [0, 1]
        w.extend(make_rollouts(1, 8, seed=2, first_group=2))
        assert r.refresh() and r.group_keys() == [1, 2] and r.head == 8
        assert not r.refresh()
        with pytest.raises(ReadOnlyError):
            r.extend(make_rollouts(1, 8))


def test_save_and_load_state(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        assert store.load_state("sampler") is None
        store.save_state("sampler", {"rng": {"state": 2 ** 100 + 7, "inc": 3}, "cursor": 5,
                                     "prio": np.arange(4, dtype=np.float32), "t": torch.ones(2, 2)})
        store.save_state("sampler", {"cursor": 6, "prio": np.zeros(3)})
        store.extend({"prompt_id": [1], "rewards": [0.0]})
    with ReplayStore(tmp_path / "s", readonly=True) as store:
        st_ = store.load_state("sampler")
        assert st_["cursor"] == 6 and st_["prio"].tolist() == [0, 0, 0]
    assert len(os.listdir(tmp_path / "s" / "state")) <= 2
    with ReplayStore(tmp_path / "s") as store:
        with pytest.raises(ValueError, match="state name"):
            store.save_state("../x", {})
        with pytest.raises(TypeError, match="cannot store"):
            store.save_state("x", {"f": object()})


# --------------------------------------------------------------------------- bad input

GOOD = {"prompt_id": [1, 1], "completion_ids": [[1, 2], [3]], "old_per_token_logps": [[-.1, -.2], [-.3]],
        "rewards": [1.0, 0.0]}

BAD_INPUTS = [
    ("logps length mismatch", {**GOOD, "old_per_token_logps": [[-.1], [-.3]]}, "'old_per_token_logps' row 0"),
    ("mask not 0/1", {"prompt_id": [1], "completion_ids": torch.tensor([[1, 2]]),
                      "completion_mask": torch.tensor([[1, 2]])}, "'completion_mask' row 0"),
    ("mask wrong shape", {"prompt_id": [1], "completion_ids": torch.tensor([[1, 2]]),
                          "completion_mask": torch.tensor([[1, 1, 0]])}, "'completion_mask' has shape"),
    ("missing group key", {k: v for k, v in GOOD.items() if k != "prompt_id"}, "group key column 'prompt_id'"),
    ("float token ids", {**GOOD, "completion_ids": [[1.5, 2.0], [3.0]]}, "'completion_ids' holds floats"),
    ("token id overflow", {**GOOD, "completion_ids": [[1, 2 ** 40], [3]]}, "'completion_ids' row 0"),
    ("NaN log-prob", {**GOOD, "old_per_token_logps": [[-.1, float("nan")], [-.3]]},
     "'old_per_token_logps' row 0 position 1 is NaN"),
    ("column count mismatch", {**GOOD, "rewards": [1.0]}, "'rewards' has 1 rows"),
    ("schema drift: new column", {**GOOD, "extra": [1, 2]}, "'extra' is not in the store's schema"),
    ("schema drift: type", {**GOOD, "rewards": ["a", "b"]}, "'rewards' holds strings"),
    ("schema drift: kind", {**GOOD, "rewards": [[1.0, 2.0], [3.0, 4.0]]}, "'rewards' is a ragged column"),
    ("empty batch", {}, "empty"),
    ("zero rows", {"prompt_id": [], "rewards": []}, "0 rows"),
    ("None key", {**GOOD, "prompt_id": [1, None]}, "'prompt_id' row 1 is None"),
    ("missing per-row column", {k: v for k, v in GOOD.items() if k != "rewards"}, "lacks column 'rewards'"),
    ("not a mapping", [1, 2, 3], "mapping"),
    ("ragged row not a sequence", {**GOOD, "completion_ids": [[1, 2], 3]}, "'completion_ids' row 1"),
    ("3-D tensor", {**GOOD, "completion_ids": torch.zeros(2, 2, 2, dtype=torch.long)}, "at most 2 dimensions"),
]


@pytest.mark.parametrize("case,batch,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_rejected_and_store_unchanged(tmp_path, case, batch, message):
    path = tmp_path / "s"
    with ReplayStore(path) as store:
        store.extend(GOOD)
        before = snapshot(path)
        gen = store.generation
        with pytest.raises((ValueError, TypeError)) as exc:
            store.extend(batch)
        assert message in str(exc.value)
        assert snapshot(path) == before and store.generation == gen and len(store) == 2
        store.extend(GOOD)  # and the store still works
        assert len(store) == 4


def test_column_none_in_every_row_is_not_stored(store):
    store.extend({"prompt_id": [1, 1], "completion_ids": [[1], [2]], "ref_per_token_logps": [None, None]})
    assert "ref_per_token_logps" not in store.columns
    # computed later: a late column (tests/test_late_columns.py); the first rows read "not computed"
    store.extend({"prompt_id": [1], "completion_ids": [[1]], "ref_per_token_logps": [[0.5]]})
    col = store.read([0, 1, 2])["ref_per_token_logps"]
    assert col.validity.tolist() == [False, False, True] and col[2].tolist() == [0.5]
    with pytest.raises(SchemaError, match="'version' is not in the store's schema"):
        store.extend({"prompt_id": [1], "completion_ids": [[1]], "version": [3]})


def test_first_batch_errors_leave_no_schema(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        with pytest.raises(BatchError):
            store.extend({"prompt_id": [1], "completion_ids": [[1]], "old_per_token_logps": [[.1, .2]]})
        assert store.schema is None and len(store) == 0


# --------------------------------------------------------------------------- read-only, damage

def test_readonly_open_on_write_protected_copy(tmp_path):
    src = tmp_path / "s"
    with ReplayStore(src) as store:
        rows = store.extend(make_rollouts(2, 4, seed=3))
        expected = store.read(rows)
    ro = tmp_path / "ro"
    shutil.copytree(src, ro)
    os.remove(ro / "LOCK")
    before = snapshot(ro)
    mtimes = {p: os.stat(ro / p).st_mtime_ns for p in before}
    for root, dirs, files in os.walk(ro):
        for x in dirs + files:
            os.chmod(os.path.join(root, x), stat.S_IREAD | stat.S_IEXEC if x in dirs else stat.S_IREAD)
    os.chmod(ro, stat.S_IREAD | stat.S_IEXEC)
    try:
        with ReplayStore(ro, readonly=True) as store:
            got = store.read(rows)
            for k in ("completion_ids", "old_per_token_logps"):
                np.testing.assert_array_equal(got[k].values, expected[k].values)
            assert store.group_keys() == [0, 1]
            with pytest.raises(ReadOnlyError):
                store.save_state("x", {})
        assert not os.path.exists(ro / "LOCK")
        assert snapshot(ro) == before
        assert {p: os.stat(ro / p).st_mtime_ns for p in before} == mtimes
    finally:
        os.chmod(ro, 0o755)
    with pytest.raises(FileNotFoundError, match="no diskreplay store"):
        ReplayStore(tmp_path / "nothing", readonly=True)


def test_corrupt_newest_manifest_falls_back(tmp_path):
    path = tmp_path / "s"
    with ReplayStore(path) as store:
        store.extend(GOOD)
        store.extend(GOOD)
        newest = path / store.manifest.file
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x20
    newest.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="fails its checksum"):
        store = ReplayStore(path, readonly=True)
    assert len(store) == 2 and str(newest) in " ".join(store.recovered_from)


def test_manifest_cannot_escape_store(tmp_path):
    path = tmp_path / "s"
    with ReplayStore(path) as store:
        store.extend(GOOD)
        mpath = path / store.manifest.file
    doc = json.loads(mpath.read_text())
    doc["segments"][0]["file"] = "../../etc/passwd"
    mpath.write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError):
        ReplayStore(path, readonly=True)


def test_truncated_segment_names_the_file(tmp_path):
    path = tmp_path / "s"
    with ReplayStore(path) as store:
        store.extend(GOOD)
        seg = path / store.manifest.segments[0].file
    seg.write_bytes(seg.read_bytes()[:100])
    store = ReplayStore(path, readonly=True)
    with pytest.raises(CorruptStoreError, match=str(seg.name)):
        store.read([0])


# --------------------------------------------------------------------------- crash safety

CHILD = textwrap.dedent("""
    import sys, numpy as np
    from diskreplay import ReplayStore
    from diskreplay.synthetic import make_rollouts
    path, start = sys.argv[1], int(sys.argv[2])
    store = ReplayStore(path, capacity=400)
    i = start
    while True:
        rows = store.extend(make_rollouts(2, 4, seed=i, first_group=i, completion_mean=40))
        sys.stdout.write(f"{i} {rows[0]}\\n")  # one write: a kill cannot split the line
        sys.stdout.flush()
        i += 1
""")


def expected_batch(i):
    return make_rollouts(2, 4, seed=i, first_group=i, completion_mean=40)


def test_sigkill_during_appends_loses_nothing_committed(tmp_path):
    path = str(tmp_path / "s")
    rng = random.Random(1234)
    returned = {}  # batch index -> first row id
    next_batch = 0
    kills = 0
    while kills < 22:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, path, str(next_batch)], stdout=subprocess.PIPE,
                                text=True)
        # wait for the child to be appending, then kill it at a random moment
        first = proc.stdout.readline()
        assert first, "child died before its first append"
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        kills += 1
        text = first + out
        for line in text[: text.rfind("\n") + 1].splitlines():  # a line cut by the kill was never printed
            i, row = map(int, line.split())
            returned[i] = row
        with ReplayStore(path, readonly=True) as store:
            committed = store.next_row // 8
            # every append that returned is committed; the one in flight is all-or-nothing
            assert store.next_row % 8 == 0
            assert committed >= max(returned) + 1
            assert committed <= max(returned) + 2
            head = store.head
            for i in range(committed):
                if (i + 1) * 8 <= head:
                    continue
                b = expected_batch(i)
                got = store.read(np.arange(8 * i, 8 * i + 8), ["completion_ids", "old_per_token_logps",
                                                              "prompt_id"])
                for k in ("completion_ids", "old_per_token_logps"):
                    np.testing.assert_array_equal(got[k].values, np.concatenate(b[k]))
                assert got["prompt_id"].tolist() == b["prompt_id"].tolist()
            assert store.group_keys() == sorted(store.group_keys())
        next_batch = committed
    assert kills >= 20


# --------------------------------------------------------------------------- model-based state machine

class StoreMachine(RuleBasedStateMachine):
    """The store against a plain list of rows."""

    @initialize(capacity=st.sampled_from([13, 40, None]))
    def setup(self, capacity):
        import tempfile

        from diskreplay.store import MergePolicy

        # merges after every other small append: the machine meets them constantly
        self.policy = MergePolicy(fanin=3, ratio=2)
        self.dir = tempfile.mkdtemp()
        self.capacity = capacity
        self.store = ReplayStore(self.dir, capacity=self.capacity, merge_policy=self.policy)
        self.model = []  # (key, tokens, reward)
        self.batch_no = 0

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(n=st.integers(1, 6), keys=st.lists(st.integers(0, 4), min_size=6, max_size=6))
    def extend(self, n, keys):
        rng = np.random.default_rng(self.batch_no)
        self.batch_no += 1
        toks = [rng.integers(0, 100, rng.integers(0, 5)).astype(np.int32) for _ in range(n)]
        rew = rng.random(n).astype(np.float32)
        self.store.extend({"prompt_id": keys[:n], "completion_ids": toks, "rewards": rew})
        self.model += list(zip(keys[:n], toks, rew))

    @rule()
    def reopen(self):
        self.store.close()
        self.store = ReplayStore(self.dir)

    @rule()
    def compact(self):
        self.store.compact()

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def read(self, data):
        live = self.live()
        idx = data.draw(st.lists(st.integers(0, len(live) - 1), min_size=1, max_size=8))
        rows = np.array([self.head() + i for i in idx])
        got = self.store.read(rows)
        for j, i in enumerate(idx):
            key, toks, rew = live[i]
            assert got["prompt_id"][j] == key
            np.testing.assert_array_equal(got["completion_ids"][j], toks)
            assert got["rewards"][j] == rew

    def head(self):
        return max(0, len(self.model) - self.capacity) if self.capacity is not None else 0

    def live(self):
        return self.model[self.head():]

    @invariant()
    def agrees(self):
        if not hasattr(self, "store"):
            return
        live = self.live()
        assert len(self.store) == len(live)
        assert self.store.head == self.head()
        if live:
            groups = {}
            for i, (k, _, _) in enumerate(live):
                groups.setdefault(k, []).append(self.head() + i)
            assert self.store.group_keys() == list(groups)
            for k, rows in groups.items():
                assert self.store.group_rows(k).tolist() == rows


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)
TestStoreMachine = StoreMachine.TestCase


def test_compact_keeps_rows_and_readers_working(tmp_path):
    path = tmp_path / "s"
    with ReplayStore(path, capacity=60) as store:
        for s in range(12):
            store.extend(make_rollouts(1, 8, seed=s, first_group=s, completion_mean=30))
        reader = ReplayStore(path, readonly=True)
        before = store.read(store.row_ids())
        keys = store.group_keys()
        info = store.compact(target_bytes=20_000)
        assert info["segments_before"] == 8 and info["segments_after"] < 8
        after = store.read(store.row_ids())
        for k in ("completion_ids", "old_per_token_logps", "prompt_ids"):
            np.testing.assert_array_equal(after[k].values, before[k].values)
            np.testing.assert_array_equal(after[k].offsets - after[k].offsets[0],
                                          before[k].offsets - before[k].offsets[0])
        assert store.group_keys() == keys and store.head == 36
        # the reader still holds the old manifest and reads through it
        got = reader.read(reader.row_ids(), ["completion_ids"])["completion_ids"]
        np.testing.assert_array_equal(got.values, before["completion_ids"].values)
        assert reader.refresh() and len(reader.manifest.segments) == info["segments_after"]
        store.extend(make_rollouts(1, 8, seed=99, first_group=99))
    with ReplayStore(path, readonly=True) as again:
        assert again.group_keys()[-1] == 99 and len(again) == 60


@pytest.mark.parametrize("multi", [False, True], ids=["single", "multi"])
def test_store_is_readable_with_plain_pyarrow_as_documented(tmp_path, multi):
    """The recipe of docs/FORMAT.md, run verbatim on a store with evictions; on a multi-writer store
    (no capacity: the recipe does not apply it per delta), through append and rewrite deltas."""
    import pyarrow as pa
    from diskreplay import format as fmt
    from diskreplay.store import MergePolicy

    path = tmp_path / "STORE"
    options = dict(multi_writer=True, merge_policy=MergePolicy(fanin=3, ratio=2)) if multi else dict(capacity=20)
    with ReplayStore(path, **options) as store:
        store._committer._checkpoint_at = 2 * fmt.CHECKPOINT_EVERY - 1  # (each writer draws its own)
        def deltas_since_a_full_manifest():
            m = store.manifest
            return [json.load(open(os.path.join(path, fmt.manifest_file(g))))
                    for g in range(m.generation - m.depth + 1, m.generation + 1)]

        for s in range(5 if not multi else 40):
            store.extend(make_rollouts(1, 8, seed=s, first_group=s, completion_mean=10))
            docs = deltas_since_a_full_manifest() if multi else []
            if s >= 11 and any("replaced" in d for d in docs) and any("num_rows" in d for d in docs):
                break  # the recipe resolves the newest commit through append and rewrite deltas
        else:
            assert not multi, "no commit followed a full manifest with both kinds of delta"
        expected = store.read(store.row_ids()[-20:], ["completion_ids", "prompt_id"])
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "FORMAT.md")).read()
    recipe = doc.split("```python\n", 1)[1].split("```", 1)[0]
    recipe = textwrap.dedent(recipe).replace('"STORE/', f'"{path}/').replace("f\"STORE/", f"f\"{path}/")
    scope = {}
    exec(recipe, scope)
    table = scope["table"][-20:]
    assert table.num_rows == 20
    assert table.column("prompt_id").to_pylist() == expected["prompt_id"].tolist()
    flat = pa.concat_arrays([c.flatten() for c in table.column("completion_ids").chunks])
    assert flat.to_pylist() == expected["completion_ids"].values.tolist()


def test_consecutive_rows_read_as_views_equal_copies(store):
    store.extend(make_rollouts(2, 8, seed=5))
    run = store.read(np.arange(3, 12), ["completion_ids", "old_per_token_logps"])
    scattered = store.read(np.array([3, 4, 5, 6, 7, 8, 9, 10, 11])[::-1], ["completion_ids"])
    col = run["completion_ids"]
    assert col.offsets[0] == 0 and col.offsets[-1] == len(col.values)
    assert not col.values.flags.writeable or col.values.base is not None  # a view of the map
    for i in range(9):
        np.testing.assert_array_equal(col[i], scattered["completion_ids"][8 - i])


def test_open_segments_are_bounded(store, monkeypatch):
    import diskreplay.store.segment_cache as store_module

    monkeypatch.setattr(store_module, "MAX_OPEN_SEGMENTS", 2)
    batches = [make_rollouts(1, 4, seed=s, first_group=s, completion_mean=20) for s in range(6)]
    for b in batches:
        store.extend(b)
    rows = np.array([23, 0, 9, 17, 4, 12])
    got = store.read(rows, ["completion_ids"])["completion_ids"]
    flat = [x for b in batches for x in b["completion_ids"]]
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(got[i], flat[r])
    assert len(store._cache.segments) <= 2


def test_damaged_page_is_never_served_by_any_read_path(tmp_path):
    """A flipped byte in token data is caught by scans (zero-copy runs) and by scattered reads alike."""
    path = tmp_path / "s"
    with ReplayStore(path) as store:
        store.extend(make_rollouts(4, 8, seed=1, completion_mean=200))
        seg = path / store.manifest.segments[0].file
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x01
    seg.write_bytes(bytes(data))
    for rows in (np.arange(0, 32), np.arange(0, 32)[::-1]):
        reader = ReplayStore(path, readonly=True)
        with pytest.raises(CorruptStoreError, match="fails its checksum"):
            reader.read(rows)


@pytest.fixture(scope="module")
def paged_store(tmp_path_factory):
    """A store of one segment with page checksums, an undamaged copy of it, its bytes and data region."""
    path = tmp_path_factory.mktemp("paged") / "s"
    with ReplayStore(path) as store:
        store.extend(make_rollouts(8, 8, seed=3, prompt_mean=40, completion_mean=300, layout="trl"))
        entry = store.manifest.segments[0]
        body = store._page_checksums(entry).body
    shutil.copytree(path, path.with_name("clean"))
    clean = ReplayStore(path.with_name("clean"), readonly=True)
    yield _Paged(path, path / entry.file, body, clean)
    clean.close()


class _Paged:
    """(a repr hypothesis can print: the file's bytes stay out of it)"""

    def __init__(self, path, seg, body, clean):
        self.path, self.seg, self.original, self.body, self.clean = path, seg, seg.read_bytes(), body, clean

    def __repr__(self):
        return f"_Paged({self.seg})"


def _same(got, ref):
    for name, want in ref.items():
        if isinstance(want, torch.Tensor):
            assert torch.equal(got[name], want), name
        elif hasattr(want, "offsets"):  # a ragged column
            assert np.array_equal(got[name].values, want.values) and np.array_equal(got[name].offsets,
                                                                                    want.offsets), name
        else:
            assert np.array_equal(np.asarray(got[name]), np.asarray(want)), name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.floats(0, 1, exclude_max=True), batches=st.lists(st.lists(st.integers(0, 63), min_size=1, max_size=24),
                                                              min_size=1, max_size=4),
       columns=st.sampled_from([None, ["completion_ids"], ["prompt_ids", "old_per_token_logps"]]),
       via=st.sampled_from(["read", "padded", "packed", "loader"]))
def test_a_flipped_data_byte_is_never_served(paged_store, at, batches, columns, via):
    """Every read path on fresh rows (a column set's per-row page table, one pass over the pages of
    all its columns, the segment's last pages, the loader's worker): a read of a damaged store either
    raises naming the file or returns exactly what the undamaged copy returns (the byte was padding)."""
    from diskreplay import Collator, PromptGroupSampler, ReplayLoader

    path, seg, original, (lo, hi), clean = (paged_store.path, paged_store.seg, paged_store.original,
                                            paged_store.body, paged_store.clean)
    if via == "packed" and columns == ["prompt_ids", "old_per_token_logps"]:
        columns = columns + ["completion_ids"]  # the packed layout lays the log-probs along the completions
    damaged = bytearray(original)
    damaged[lo + int(at * (hi - lo))] ^= 0x10
    seg.write_bytes(bytes(damaged))
    try:
        with ReplayStore(path, readonly=True) as reader:
            for rows in batches:
                rows = np.array(rows)
                try:
                    if via == "read":
                        _same(reader.read(rows, columns), clean.read(rows, columns))
                    elif via in ("padded", "packed"):
                        _same(Collator(0, layout=via).read(reader, rows, columns),
                              Collator(0, layout=via).read(clean, rows, columns))
                    else:
                        with ReplayLoader(reader, PromptGroupSampler(num_groups=2, seed=len(rows)), 16, 0,
                                          columns=columns) as loader:
                            for b, _ in zip(loader, range(2)):
                                _same(b, Collator(0).read(clean, b["rows"].numpy(), columns))
                except CorruptStoreError as exc:
                    assert "fails its checksum" in str(exc) and seg.name in str(exc)
    finally:
        seg.write_bytes(original)


def test_read_refuses_a_boolean_mask_and_fractional_ids(tmp_path):
    """A mask (as ``sampler.eligible()`` returns) cast to ids would read rows 0 and 1; a float id
    truncated would read another row: both are refused, naming what to pass instead."""
    from diskreplay import ArgumentError, PromptGroupSampler

    store = ReplayStore(str(tmp_path / "s"))
    store.extend(make_rollouts(4, 2, seed=0))
    mask = PromptGroupSampler(num_groups=1).eligible(store, exclude=[(0, 2)])
    assert mask.dtype == bool and mask.tolist() == [False] * 2 + [True] * 6
    with pytest.raises(ArgumentError, match=r"boolean mask .*store.row_ids\(\)\[mask\]"):
        store.read(mask, ["rewards"])
    for bad in ([1.9], np.array([1.0]), torch.tensor([0.5])):
        with pytest.raises(ArgumentError, match="integer row ids, got float"):
            store.read(bad, ["rewards"])
    for bad, shown in (([0, None], "None"), (["0"], "'0'")):
        with pytest.raises(ArgumentError, match=f"integer row ids, got .* values \\(e.g. {shown}\\)"):
            store.read(bad, ["rewards"])
    rows = store.row_ids()[mask]
    assert np.array_equal(store.read(rows, ["rewards"])["rewards"], store.read(rows.tolist(), ["rewards"])["rewards"])
    by_tensor = store.read(torch.tensor([3]), ["rewards"])["rewards"]
    assert by_tensor.tolist() == store.read([3], ["rewards"])["rewards"].tolist()
    assert len(store.read([], ["rewards"])["rewards"]) == 0


def test_a_generation_not_retained_or_not_made_yet_says_which(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        for i in range(8):
            store.extend(make_rollouts(1, 2, seed=i))
        newest = store.generation
    with pytest.raises(FileNotFoundError, match=r"generation 1 .* is not retained \(generations kept: 5\.\.8 "
                                                r"\(4 manifests\)\)"):
        ReplayStore(path, readonly=True, generation=1)
    with pytest.raises(FileNotFoundError, match=f"generation 50 .* does not exist yet \\(the newest is {newest}\\)"):
        ReplayStore(path, readonly=True, generation=50)


def test_a_writer_refuses_a_path_that_is_not_a_store_and_leaves_it_untouched(tmp_path):
    """A mistyped path to a run's directory (or a file) is not filled with store files; a directory
    holding only a store's own entries (a creation killed before FORMAT.json) is a store to create."""
    from diskreplay import OutputExistsError

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("lr: 1e-6\n")
    with pytest.raises(OutputExistsError, match="non-empty directory that holds no diskreplay store.*config.yaml"):
        ReplayStore(str(run))
    assert os.listdir(run) == ["config.yaml"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match="is a file, not a directory"):
        ReplayStore(str(tmp_path / "file"))
    leftover = tmp_path / "half-made"
    for d in ("segments", "manifests", "groups"):
        (leftover / d).mkdir(parents=True)
    (leftover / "LOCK").write_text("")
    with ReplayStore(str(leftover)) as store:
        store.extend(make_rollouts(2, 2, seed=1))
        assert len(store) == 4


def test_creating_a_store_where_a_store_named_folder_holds_other_files_is_refused(tmp_path):
    """Only the top level was checked: a directory whose segments/ held another program's file was
    taken, and the open moved that file into quarantine/."""
    from diskreplay import OutputExistsError

    path = tmp_path / "run"
    (path / "segments").mkdir(parents=True)
    (path / "segments" / "checkpoint-0001.bin").write_bytes(b"weights")
    with pytest.raises(OutputExistsError, match="segments/checkpoint-0001.bin"):
        ReplayStore(str(path))
    assert sorted(p.name for p in path.rglob("*")) == ["checkpoint-0001.bin", "segments"]
    (path / "segments" / "checkpoint-0001.bin").unlink()
    (path / "segments" / "000000000003.arrow").write_bytes(b"a store's segment")
    with pytest.raises(CorruptStoreError, match="no FORMAT.json"):  # a store's own name: its FORMAT.json is lost
        ReplayStore(str(path))
    (path / "segments" / "000000000003.arrow").unlink()
    ReplayStore(str(path)).close()  # its own (empty) directories only: a creation that died early


def test_a_writer_dropped_without_close_releases_its_lock(tmp_path):
    """LOCK stayed held by a store dropped without close() until the process ended: the next open in
    the same process was refused as "open for writing by another process"."""
    import gc

    path = str(tmp_path / "s")
    with ReplayStore(path) as s:
        s.extend({"prompt_id": [1], "completion_ids": [[1]]})
    s = ReplayStore(path)
    del s
    gc.collect()
    with ReplayStore(path) as again:
        assert len(again) == 1


@pytest.mark.parametrize("bad", ["", "x" * 300, 5])
@pytest.mark.parametrize("late", [False, True])
def test_a_column_name_a_reader_refuses_is_refused_by_extend(tmp_path, bad, late):
    """extend accepted the column name "" (and one of 300 characters) that every reader refuses: as the
    first commit the store no longer opened; as a late column the commit was dropped at the next open
    (and replaced by the next writer's), losing acknowledged rows. A non-str name was turned into a str
    and merged with the column of that name, one of them dropped."""
    path = str(tmp_path / "s")
    store = ReplayStore(path)
    if late:
        store.extend({"prompt_id": [0], "completion_ids": [[1]]})
    before = store.generation
    batch = {"prompt_id": [1, 1], "completion_ids": [[1, 2], [3]], bad: [0.5, 1.0]}
    if bad == 5:
        batch["5"] = [2.0, 3.0]
    with pytest.raises(BatchError, match="column name"):
        store.extend(batch)
    assert store.generation == before
    store.close()
    with ReplayStore(path, readonly=True) as r:
        assert r.generation == before
