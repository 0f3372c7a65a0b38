"""Late columns: nullable columns added after a store's first commit (docs/FORMAT.md, "Late columns").

Rows committed before a late column read as "not computed" (a null ragged row,
NaN in a float per-row column); the column's type never changes afterwards;
the schema change is committed atomically with the rows that bring it (a
SIGKILL at any step of that commit leaves the store at its previous commit or
at the new one, never between); readers, ``verify``, exports, import and the
plain-pyarrow recipe all handle it; two writers adding the same column agree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diskreplay import BatchError, CorruptStoreError, FormatError, ReplayStore, SchemaError, collate, collate_packed
from diskreplay import format as fmt
from diskreplay.verify import verify_store
from .conftest import format_md_table, package_at

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATE = "sampling_per_token_logps"
#: the commit this feature was built on: a diskreplay that knows no late columns
PREVIOUS_VERSION = "6ba2f69"


def base_batch(first, n=2):
    """Rows ``first, first + 1, ...`` without late columns; contents are functions of the row id."""
    ids = np.arange(first, first + n)
    return {"prompt_id": ids // 2, "completion_ids": [np.arange(i % 3 + 1, dtype=np.int32) + i for i in ids],
            "rewards": (ids * 0.5).astype(np.float32)}


def logps(i):
    return -(np.arange(i % 3 + 1, dtype=np.float32) + i) / 100


def late_batch(first, n=2, score=True):
    b = base_batch(first, n)
    b[LATE] = [logps(i) for i in range(first, first + n)]
    if score:
        b["score"] = np.arange(first, first + n, dtype=np.float64) + 0.25
        b["judge"] = np.stack([np.arange(first, first + n), -np.arange(first, first + n)], 1).astype(np.float32)
    return b


def ok(path):
    report = verify_store(path)
    assert report["ok"], report["problems"]


# --------------------------------------------------------------------------- the basics


def test_late_columns_round_trip_through_reopen(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(base_batch(0))
        format_before = open(os.path.join(path, fmt.FORMAT_FILE), "rb").read()
        store.extend(late_batch(2))
        store.extend(base_batch(4))  # a batch may leave late columns out: its rows read "not computed"
        assert store.columns == ["prompt_id", "completion_ids", "rewards", LATE, "score", "judge"]
        assert store.schema.late == {LATE: (2, 2), "score": (2, 2), "judge": (2, 2)}
    # FORMAT.json keeps the columns of the first commit; it only says that late columns may exist
    doc = json.load(open(os.path.join(path, fmt.FORMAT_FILE)))
    assert doc["version"] == fmt.LATE_COLUMNS_FORMAT_VERSION and doc["late_columns"] is True
    assert doc["schema"] == json.loads(format_before)["schema"]
    newest = fmt.list_generations(path)[0]
    manifest = json.load(open(os.path.join(path, fmt.manifest_file(newest))))
    assert manifest["version"] == fmt.LATE_COLUMNS_MANIFEST_VERSION
    assert [c["name"] for c in manifest["late_columns"]] == [LATE, "score", "judge"]
    assert manifest["late_columns"][0] == {"name": LATE, "kind": "ragged", "dtype": "float32",
                                           "align": "completion", "since_row": 2, "since_generation": 2}
    for readonly in (True, False):
        with ReplayStore(path, readonly=readonly) as store:
            got = store.read([5, 0, 3, 2, 4])
            assert got[LATE].validity.tolist() == [False, False, True, True, False]
            assert got[LATE][2].tolist() == logps(3).tolist() and got[LATE][3].tolist() == logps(2).tolist()
            np.testing.assert_array_equal(got["score"], [np.nan, np.nan, 3.25, 2.25, np.nan])
            assert got["judge"].shape == (5, 2) and np.isnan(got["judge"][[0, 1, 4]]).all()
            assert got["judge"][2].tolist() == [3, -3]
            assert store.read([0, 1])[LATE] is None  # no row of this read has it
            np.testing.assert_array_equal(store.read([0, 1, 4])["score"], [np.nan] * 3)
    ok(path)


def test_a_store_without_late_columns_writes_what_it_always_did(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(late_batch(0, score=False))
        store.extend(base_batch(2))  # a ragged column of the first commit may be left out: nothing late
    assert json.load(open(os.path.join(path, fmt.FORMAT_FILE)))["version"] == fmt.FORMAT_VERSION
    for gen in fmt.list_generations(path):
        doc = json.load(open(os.path.join(path, fmt.manifest_file(gen))))
        assert doc["version"] == fmt.FORMAT_VERSION and "late_columns" not in doc


def test_batches_that_leave_late_columns_out_and_rows_without_values(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        store.extend(base_batch(0))
        b = late_batch(2, n=3)
        b[LATE][1] = None  # a row whose sampling log-probs were not computed
        b["score"][2] = np.nan  # NaN in a late float column is "not computed" too
        b["judge"][0] = np.nan
        store.extend(b)
        store.extend({k: v for k, v in late_batch(5).items() if k != "score"})
        got = store.read(store.row_ids())
        assert got[LATE].validity.tolist() == [False, False, True, False, True, True, True]
        np.testing.assert_array_equal(got["score"], [np.nan, np.nan, 2.25, 3.25, np.nan, np.nan, np.nan])
        assert np.isnan(got["judge"][[0, 1, 2]]).all() and got["judge"][3].tolist() == [3, -3]
        # the older rows still need the columns of the first commit
        with pytest.raises(BatchError, match="lacks column 'rewards'"):
            store.extend({k: v for k, v in late_batch(7).items() if k != "rewards"})


def test_types_never_change_and_late_columns_must_be_nullable(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(base_batch(0))
        before = store.generation
        for bad, match in (({"policy_version": np.array([1, 2])}, "'policy_version' .* no \"not computed\" value"),
                           ({"flag": np.array([True, False])}, "'flag' .* no \"not computed\" value"),
                           ({"tag": ["a", "b"]}, "'tag' .* no \"not computed\" value")):
            with pytest.raises(SchemaError, match=match):
                store.extend({**base_batch(2), **bad})
        store.extend(late_batch(2))
        with pytest.raises(SchemaError, match="'score' is a vector\\[2\\] column in this batch but a scalar"):
            store.extend({**base_batch(4), "score": np.ones((2, 2))})
        with pytest.raises(SchemaError, match=f"'{LATE}' is a scalar column in this batch but a ragged"):
            store.extend({**base_batch(4), LATE: np.ones(2, dtype=np.float32)})
        with pytest.raises(SchemaError, match="'rewards' is a ragged column in this batch but a scalar"):
            store.extend({**base_batch(4), "rewards": [np.ones(1), np.ones(2)]})
        assert store.generation == before + 1 and len(store) == 4  # every refused batch wrote nothing
    ok(path)
    assert not [f for d in fmt.DATA_DIRS for f in os.listdir(os.path.join(path, d)) if f.startswith(".tmp")]


def test_compaction_and_merges_keep_late_columns(tmp_path):
    from diskreplay.store import MERGE_FANIN

    path = str(tmp_path / "s")
    with ReplayStore(path, capacity=30) as store:
        store.extend(base_batch(0))
        for b in range(MERGE_FANIN + 3):  # enough small appends to merge segments of both kinds
            first = store.next_row
            store.extend(base_batch(first) if b % 3 else late_batch(first, score=b % 2 == 0))
        want = store.read(store.row_ids())
        store.compact()
        assert len(store.manifest.segments) == 1
        got = store.read(store.row_ids())
        assert got[LATE].validity.tolist() == want[LATE].validity.tolist()
        np.testing.assert_array_equal(got["score"], want["score"])
        np.testing.assert_array_equal(got[LATE].values, want[LATE].values)
    ok(path)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.integers(1, 4), st.booleans(), st.booleans(), st.booleans()),
                     min_size=1, max_size=8))
def test_reads_agree_with_a_model(tmp_path_factory, plan):
    """Random batches with or without each late column (and rows without values), reopened, read at random."""
    path = str(tmp_path_factory.mktemp("s"))
    model = {LATE: [], "score": []}
    with ReplayStore(path) as store:
        for i, (n, with_logps, with_score, missing_row) in enumerate(plan):
            first = store.next_row
            b = base_batch(first, n)
            if i and with_logps:
                b[LATE] = [None if missing_row and j == 0 else logps(first + j) for j in range(n)]
            if i and with_score:
                b["score"] = np.arange(first, first + n) + 0.5
            store.extend(b)
            model[LATE] += b.get(LATE, [None] * n)
            model["score"] += list(b.get("score", [np.nan] * n))
    rng = np.random.default_rng(len(plan))
    with ReplayStore(path, readonly=True) as store:
        for _ in range(3):
            rows = rng.integers(0, len(store), size=5)
            got = store.read(rows, [c for c in (LATE, "score") if c in store.columns])
            for c in got:
                for k, r in enumerate(rows.tolist()):
                    want = model[c][r]
                    if c == LATE:
                        have = None if got[c] is None else got[c][k]
                        assert (have is None) == (want is None)
                        if want is not None:
                            assert have.tolist() == want.tolist()
                    else:
                        assert (np.isnan(got[c][k]) and np.isnan(want)) or got[c][k] == want
    ok(path)


# --------------------------------------------------------------------------- the commit


CRASH_CHILD = """
import os, sys
import numpy as np
from diskreplay import ReplayStore
path, step = sys.argv[1:3]
with ReplayStore(path) as store:
    store.extend(base_batch(0, 4))
    print("committed", store.generation, flush=True)
    os.environ["DISKREPLAY_CRASH_AT"] = step
    store.extend(late_batch(4))
print("finished", flush=True)
"""

CRASH_STEPS = ["format.written", "format.renamed", "format.done", "segment.written", "groups.written",
               "segments.synced", "manifest.written", "manifest.renamed", "manifest.committed"]


@pytest.fixture(scope="module")
def crash_runs(tmp_path_factory):
    """Every crash child at once (each one is a process that imports torch: run them side by side)."""
    import inspect
    from concurrent.futures import ThreadPoolExecutor

    prelude = f"import numpy as np\nLATE = {LATE!r}\n" + "".join(
        inspect.getsource(f) for f in (base_batch, logps, late_batch))
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DISKREPLAY_CRASH_AT", None)
    root = tmp_path_factory.mktemp("crash")

    def run(step):
        path = str(root / step)
        return step, (path, subprocess.run([sys.executable, "-c", prelude + CRASH_CHILD, path, step],
                                           capture_output=True, text=True, timeout=300, env=env))

    with ThreadPoolExecutor(max_workers=5) as pool:
        return dict(pool.map(run, CRASH_STEPS))


@pytest.mark.parametrize("step", CRASH_STEPS)
def test_sigkill_in_the_commit_that_adds_a_column(crash_runs, step):
    """Killed at each step of the commit that adds late columns: the store is at its previous commit
    (no late column) or at the new one (the column and its rows), opens, verifies, and takes appends."""
    path, proc = crash_runs[step]
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    assert "committed 1" in proc.stdout and "finished" not in proc.stdout
    ok(path)
    with ReplayStore(path, readonly=True) as ro:
        if ro.next_row == 4:  # before the commit point: exactly the previous commit
            assert ro.generation == 1 and not ro.schema.late and LATE not in ro.columns
            assert step not in ("manifest.renamed", "manifest.committed")
        else:
            assert ro.next_row == 6 and ro.schema.late[LATE] == (4, 2)
            assert ro.read([4])[LATE][0].tolist() == logps(4).tolist()
    with ReplayStore(path) as store:  # the writer's open cleans up; the column can be added (again)
        store.extend(late_batch(store.next_row))
        got = store.read(store.row_ids())
        assert got[LATE].validity.tolist()[:4] == [False] * 4 and got[LATE].validity[-1]
    report = verify_store(path)
    assert report["ok"] and not report["warnings"], report


# --------------------------------------------------------------------------- many writers


def test_two_writers_adding_the_same_column(tmp_path, monkeypatch):
    from diskreplay.storage.local import LocalStorage

    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True)
    b = ReplayStore(path)
    a.extend(base_batch(0))
    b.extend(base_batch(2))
    real = LocalStorage.link_new  # the create-if-absent of a local multi-writer commit
    raced = []

    def put(self, src, rel):
        # b's commit of the new column loses the race to a's commit of the same column: it rebases
        if self is b._committer.storage and rel.startswith(fmt.MANIFEST_DIR) and not raced:
            raced.append(a.extend(late_batch(100)))
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", put)
    rows_b = b.extend(late_batch(200))
    monkeypatch.undo()
    assert raced and b.stats()["conflicts"] == 1 and b.stats()["rebases"] == 1
    assert rows_b.tolist() == [6, 7] and raced[0].tolist() == [4, 5]
    for s in (a, b):
        s.refresh()
        assert s.schema.late[LATE] == (4, 3)  # added once, by the commit that won
        got = s.read(s.row_ids())
        assert got[LATE].validity.tolist() == [False] * 4 + [True] * 4
        assert got[LATE][7].tolist() == logps(201).tolist()
    # a different type for the same new column: the later writer gets a SchemaError and commits nothing
    raced.clear()

    def put_other(self, src, rel):
        if self is b._committer.storage and rel.startswith(fmt.MANIFEST_DIR) and not raced:
            raced.append(a.extend({**base_batch(300), "extra": np.ones(2)}))
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", put_other)
    with pytest.raises(SchemaError, match="'extra' was added to the store as"):
        bb = base_batch(400)
        b.extend({**bb, "extra": [np.ones(len(c), dtype=np.float32) for c in bb["completion_ids"]]})
    monkeypatch.undo()
    b.refresh()
    assert b.schema["extra"].kind == "scalar" and len(b) == 10
    a.close()
    b.close()
    ok(path)
    with ReplayStore(path, readonly=True) as ro:
        np.testing.assert_array_equal(ro.read(ro.row_ids())["extra"], [np.nan] * 8 + [1, 1])


def test_a_writer_that_does_not_know_a_column_yet(tmp_path):
    """A segment committed without a late column another writer added meanwhile reads "not computed"."""
    path = str(tmp_path / "s")
    a = ReplayStore(path, multi_writer=True)
    b = ReplayStore(path)
    a.extend(base_batch(0))
    b.extend(base_batch(2))
    a.extend(late_batch(4))
    b.extend(base_batch(6))  # b catches up first: its batch simply leaves the column out
    assert b.read([6, 7])[LATE] is None
    np.testing.assert_array_equal(b.read([4, 5, 6])["score"], [4.25, 5.25, np.nan])
    a.close()
    b.close()
    ok(path)


# --------------------------------------------------------------------------- older diskreplay


def _previous_version(tmp_path):
    return package_at(PREVIOUS_VERSION, tmp_path / "previous")


def _run_previous(previous, body, *args):
    code = "import sys, numpy as np\nfrom diskreplay import ReplayStore\n" + textwrap.dedent(body)
    # run from the old package's directory: ``-c`` puts the working directory first on sys.path
    code += "\nprint(sys.modules['diskreplay'].__file__)"
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=previous), cwd=previous)
    assert previous in proc.stdout, (proc.stdout, proc.stderr)  # the old package ran, not this one
    return proc


def open_with_previous(previous, path, mode):
    """Open ``path`` with the older package (``mode``: ``"readonly=True"`` or ``""``); its error is printed."""
    return _run_previous(previous, f"""
        try:
            ReplayStore(sys.argv[1], {mode})
        except Exception as exc:
            print(type(exc).__name__, exc)
        """, path)


def test_a_store_of_the_previous_version_opens_and_an_older_diskreplay_refuses_late_columns(tmp_path):
    previous = _previous_version(tmp_path)
    path = str(tmp_path / "s")
    proc = _run_previous(previous, """
        with ReplayStore(sys.argv[1]) as s:
            for first in (0, 2):
                ids = np.arange(first, first + 2)
                s.extend({"prompt_id": ids // 2, "completion_ids": [np.arange(i % 3 + 1, dtype=np.int32) + i
                                                                    for i in ids],
                          "rewards": (ids * 0.5).astype(np.float32)})
        """, path)
    assert proc.returncode == 0, proc.stderr
    files = {f: open(os.path.join(path, f), "rb").read() for f in (fmt.FORMAT_FILE,)}
    with ReplayStore(path) as store:  # opens unchanged
        assert open(os.path.join(path, fmt.FORMAT_FILE), "rb").read() == files[fmt.FORMAT_FILE]
        assert store.read([2])["completion_ids"][0].tolist() == [2, 3, 4]
        store.extend(late_batch(4))
    ok(path)
    for mode in ("readonly=True", ""):
        proc = open_with_previous(previous, path, mode)
        assert "Unsupported version 3" in proc.stdout, (proc.stdout, proc.stderr)
    with ReplayStore(path, readonly=True) as store:  # the refusals changed nothing
        assert len(store) == 6 and store.schema.late[LATE] == (4, 3)
    ok(path)


# --------------------------------------------------------------------------- verify, hostile manifests


def test_verify_checks_late_columns_in_segments(tmp_path):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(base_batch(0))
        store.extend(late_batch(2))
    ok(path)
    # a manifest that says the column has another type: the segment disagrees, by name
    gen = fmt.list_generations(path)[0]
    mpath = os.path.join(path, fmt.manifest_file(gen))
    doc = json.load(open(mpath))
    doc.pop("checksum")
    doc["late_columns"][1]["dtype"] = "float32"  # score is float64 in the segment
    open(mpath, "wb").write(fmt.signed_bytes(doc))
    report = verify_store(path)
    assert not report["ok"] and any("'score'" in p for p in report["problems"]), report["problems"]
    with ReplayStore(path, readonly=True) as store, pytest.raises(CorruptStoreError, match="'score'"):
        store.read([3])


@pytest.mark.parametrize("forge,match", [
    (lambda d: d.update(version=1), "Unsupported late_columns"),
    (lambda d: d["late_columns"].append(dict(d["late_columns"][0])), "appears twice"),
    (lambda d: d["late_columns"][0].update(kind="scalar", dtype="int64"), "no \"not computed\" value"),
    (lambda d: d["late_columns"][0].update(since_row=10 ** 6), "after this commit"),
    (lambda d: d["late_columns"][0].update(name="rewards"), "the store's first commit has it"),
])
def test_forged_late_columns_are_refused(tmp_path, forge, match):
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        store.extend(base_batch(0))
        store.extend(late_batch(2))
    for gen in fmt.list_generations(path):
        mpath = os.path.join(path, fmt.manifest_file(gen))
        doc = json.load(open(mpath))
        if "late_columns" in doc:
            doc.pop("checksum")
            forge(doc)
            open(mpath, "wb").write(fmt.signed_bytes(doc))
    with pytest.raises((FormatError, CorruptStoreError), match=match):
        with ReplayStore(path, readonly=True, generation=fmt.list_generations(path)[0]) as store:
            store.read(store.row_ids())


def test_late_columns_in_fuzzed_manifests_never_crash():
    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.dictionaries(st.sampled_from(["name", "kind", "dtype", "align", "width", "since_row",
                                                     "since_generation"]),
                                    st.one_of(st.none(), st.integers(-2, 5), st.text(max_size=8),
                                              st.sampled_from(["ragged", "scalar", "float32", "int32"]))),
                    max_size=3))
    def check(late):
        doc = fmt.Manifest(generation=3).body()
        doc.update(version=2, late_columns=late)
        try:
            fmt.Manifest.from_dict(fmt.signed_doc(doc), "m")
        except FormatError:
            pass

    check()


# --------------------------------------------------------------------------- batches out


def test_collate_flags_rows_without_a_late_column(tmp_path):
    with ReplayStore(tmp_path / "s") as store:
        store.extend(base_batch(0))
        store.extend(late_batch(2))
        got = store.read([3, 0])
        t = collate(got, pad_token_id=0)
        assert t[f"{LATE}_present"].tolist() == [True, False]
        assert t[LATE][1].abs().sum() == 0 and t[LATE][0][:len(logps(3))].tolist() == logps(3).tolist()
        p = collate_packed(got)
        assert p[f"{LATE}_present"].tolist() == [True, False]
        t = collate(store.read([2, 3]), pad_token_id=0)  # every row has it: no flag
        assert f"{LATE}_present" not in t and t[LATE].shape == t["completion_ids"].shape
        t = collate(store.read([0, 1]), pad_token_id=0)  # no row has it: None, as for any column not computed
        assert t[LATE] is None and f"{LATE}_present" not in t
        assert np.isnan(t["score"].numpy()).all()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_loader_hands_the_flag_through(tmp_path, layout):
    from diskreplay import RandomSampler, ReplayLoader

    with ReplayStore(tmp_path / "s") as store:
        store.extend(base_batch(0, 4))
        store.extend(late_batch(4, 4))
        loader = ReplayLoader(store, RandomSampler(seed=0), batch_size=8, pad_token_id=0, layout=layout)
        try:
            batch = next(iter(loader))
        finally:
            loader.close()
        present = batch[f"{LATE}_present"]
        assert sorted(present.tolist()) == [False] * 4 + [True] * 4
        assert np.isnan(batch["score"].numpy()).sum() == 4


# --------------------------------------------------------------------------- exports, import, plain pyarrow


@pytest.fixture
def late_store(tmp_path):
    path = str(tmp_path / "store")
    with ReplayStore(path) as store:
        store.extend(base_batch(0))
        b = late_batch(2)
        b[LATE][1] = None
        store.extend(b)
        store.extend(base_batch(4))
    return path


def _expected_late_values():
    return [None, None, logps(2).tolist(), None, None, None], [None, None, 2.25, 3.25, None, None]


def test_exports_write_null_for_rows_without_a_late_column(late_store, tmp_path):
    from diskreplay.export import export_hf, export_jsonl, export_parquet

    want_logps, want_score = _expected_late_values()
    export_parquet(late_store, str(tmp_path / "a.parquet"))
    t = pq.read_table(tmp_path / "a.parquet")
    got = t.column(LATE).to_pylist()
    assert [None if g is None else pytest.approx(g) for g in got] == want_logps
    assert t.column("score").to_pylist() == want_score
    assert t.column("judge").to_pylist()[:2] == [None, None] and t.column("judge").to_pylist()[2] == [2, -2]
    export_jsonl(late_store, str(tmp_path / "a.jsonl"))
    lines = [json.loads(x) for x in open(tmp_path / "a.jsonl")]
    assert [x["score"] for x in lines] == want_score and lines[0][LATE] is None
    pytest.importorskip("datasets")
    export_hf(late_store, str(tmp_path / "hf"))
    import datasets

    ds = datasets.load_from_disk(str(tmp_path / "hf"))
    assert ds["score"] == want_score and ds[3][LATE] is None


@pytest.mark.parametrize("kind", ["parquet", "zarr", "hf", "store"])
def test_import_of_an_export_keeps_what_was_not_computed(late_store, tmp_path, kind):
    from diskreplay.export import export_hf, export_parquet, import_rollouts

    src = {"parquet": str(tmp_path / "a.parquet"), "zarr": str(tmp_path / "a.zarr"), "hf": str(tmp_path / "hf"),
           "store": late_store}[kind]
    if kind == "parquet":
        export_parquet(late_store, src)
    elif kind == "zarr":
        pytest.importorskip("zarr")
        from diskreplay.export.zarr_archive import export_zarr

        export_zarr(late_store, src)
    elif kind == "hf":
        pytest.importorskip("datasets")
        export_hf(late_store, src)
    import_rollouts(src, str(tmp_path / "copy"))
    with ReplayStore(late_store, readonly=True) as a, ReplayStore(tmp_path / "copy", readonly=True) as b:
        x, y = a.read(a.row_ids()), b.read(b.row_ids())
        assert y[LATE].validity.tolist() == x[LATE].validity.tolist()
        np.testing.assert_array_equal(y["score"], x["score"])
        np.testing.assert_array_equal(y["judge"], x["judge"])


def test_info_says_from_which_row_a_late_column_exists(late_store):
    from diskreplay.export import format_info, store_info

    info = store_info(late_store)
    by_name = {c["name"]: c for c in info["columns"]}
    assert by_name[LATE]["since_row"] == 2 and "since_row" not in by_name["rewards"]
    assert f"{LATE}  ragged  float32  aligned with completion  from row 2" in format_info(info)


def test_the_plain_pyarrow_recipe_of_format_md(late_store):
    """docs/FORMAT.md's reader, verbatim, on a store with late columns."""
    table = format_md_table(late_store)
    want_logps, want_score = _expected_late_values()
    assert table.num_rows == 6 and table.column("score").to_pylist() == want_score
    got = table.column(LATE).to_pylist()
    assert [None if g is None else pytest.approx(g) for g in got] == want_logps


def test_a_writer_with_stale_options_adding_a_late_column_keeps_the_patches_flag(tmp_path):
    """Writer b read the store's options before writer a's first update marked patches in FORMAT.json;
    b's first late column marks late columns from those options: FORMAT.json must keep saying patches
    (a diskreplay without patches would otherwise take the manifests naming them for damaged ones)."""
    path = str(tmp_path / "mw")
    a = ReplayStore(path, multi_writer=True)
    a.extend({"prompt_id": [1, 1], "rewards": np.zeros(2, np.float32)})
    b = ReplayStore(path)
    a.update([0], {"rewards": [1.0]})
    b.extend({"prompt_id": [2, 2], "rewards": np.zeros(2, np.float32), "advantages": np.ones(2, np.float32)})
    a.close(), b.close()
    with open(os.path.join(path, "FORMAT.json")) as f:
        doc = json.load(f)
    assert doc["patches"] is True and doc["late_columns"] is True, doc
    with ReplayStore(path, readonly=True) as r:
        assert r.read([0], ["rewards"])["rewards"].tolist() == [1.0]
