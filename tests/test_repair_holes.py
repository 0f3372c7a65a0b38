"""Repair of a damaged segment in the middle of a store keeps every other row, recording a hole
(docs/FORMAT.md, "Manifests" and "`diskreplay verify` and `diskreplay repair`"), and
``export --skip-damaged`` exports the healthy rows of a damaged store without repairing it."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from diskreplay import (PrioritizedSampler, PromptGroupSampler, RandomSampler, ReplayStore, RowsEvictedError,
                        format as fmt)
from diskreplay.store import MergePolicy
from diskreplay.synthetic import make_rollouts
from diskreplay.verify import repair_store, verify_store

from .conftest import flip_byte

SIZES = (3, 1, 2)  # groups of 8 rows per commit: segments of 24, 8 and 16 rows


def _three_segments(path, **options):
    """Three commits, one segment each; the rows of each, read back before any damage."""
    with ReplayStore(path, merge_policy=MergePolicy(max_bytes=1), **options) as store:
        for i, n in enumerate(SIZES):
            store.extend(make_rollouts(n, 8, seed=i, first_group=10 * i, completion_mean=300))
        segs = store.manifest.segments
        assert [s.num_rows for s in segs] == [8 * n for n in SIZES]
        rows = {s.id: store.read(np.arange(s.first_row, s.end_row)) for s in segs}
    return segs, rows


def _same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        if hasattr(b, "values"):
            assert np.array_equal(a.values, b.values) and np.array_equal(a.offsets, b.offsets), name
        else:
            assert np.array_equal(np.asarray(a), np.asarray(b)), name


@pytest.mark.parametrize("multi", [False, True], ids=["single", "multi"])
def test_repair_keeps_the_rows_on_both_sides_of_a_damaged_segment(tmp_path, multi):
    path = str(tmp_path / "s")
    segs, rows = _three_segments(path, **({"multi_writer": True} if multi else {}))
    first, bad, last = segs
    flip_byte(path, bad.file, bad.bytes // 2)
    assert not verify_store(path)["ok"]
    res = repair_store(path, force=multi)
    assert any(f"dropping rows [{bad.first_row}, {bad.end_row}) ({bad.num_rows} rows) of the damaged {bad.file}"
               in a for a in res["actions"]), res["actions"]
    assert res["rows"] == first.num_rows + last.num_rows
    report = verify_store(path)
    assert report["ok"], report["problems"]
    with ReplayStore(path, readonly=True) as store:
        assert store.holes == ((bad.first_row, bad.end_row),)
        assert (store.head, store.next_row, len(store)) == (0, last.end_row, first.num_rows + last.num_rows)
        live = store.row_ids()
        assert live.tolist() == list(range(first.first_row, first.end_row)) + list(range(last.first_row,
                                                                                         last.end_row))
        _same(store.read(np.arange(first.first_row, first.end_row)), rows[first.id])  # bit-exact
        _same(store.read(np.arange(last.first_row, last.end_row)), rows[last.id])
        with pytest.raises(RowsEvictedError, match=rf"repair dropped rows \[{bad.first_row}, {bad.end_row}\)"):
            store.read([bad.first_row])
        # the group index, every sampler and the whole-store read skip the hole
        gi = store.group_index()
        assert sorted(gi.keys) == [0, 1, 2, 20, 21]
        by_column = store.group_index(key="policy_version")  # an index built on demand from a column
        assert sorted(by_column.rows.tolist()) == live.tolist()
        for sampler in (RandomSampler(seed=0), RandomSampler(replacement=True, seed=0),
                        PromptGroupSampler(num_groups=2, seed=0), PrioritizedSampler(seed=0)):
            drawn = np.concatenate([sampler.sample(store, 8) for _ in range(10)])
            assert np.isin(drawn, live).all(), type(sampler).__name__
        assert len(store.read(live)["prompt_id"]) == len(live)
    with ReplayStore(path, **({"multi_writer": True} if multi else {})) as store:  # writers go on past the hole
        new = store.extend(make_rollouts(1, 8, seed=9, first_group=90, completion_mean=30))
        assert new.tolist() == list(range(last.end_row, last.end_row + 8))
        assert store.holes == ((bad.first_row, bad.end_row),)
        store.compact()  # merges never join the segments on both sides of the hole
        assert store.holes == ((bad.first_row, bad.end_row),)
        _same(store.read(np.arange(first.first_row, first.end_row)), rows[first.id])
        _same(store.read(np.arange(last.first_row, last.end_row)), rows[last.id])
    assert verify_store(path)["ok"]


def test_a_hole_goes_when_capacity_evicts_past_it(tmp_path):
    path = str(tmp_path / "s")
    segs, rows = _three_segments(path, capacity=60)
    flip_byte(path, segs[1].file, segs[1].bytes // 2)
    repair_store(path)
    with ReplayStore(path, capacity=60, merge_policy=MergePolicy(max_bytes=1)) as store:
        store.extend(make_rollouts(1, 8, seed=9, first_group=90, completion_mean=30))  # next_row 56: head 0
        assert store.holes == ((24, 32),) and len(store) == 48
        store.extend(make_rollouts(1, 8, seed=8, first_group=80, completion_mean=30))  # head 4: still before
        assert (store.head, store.holes) == (4, ((24, 32),))
        store.extend(make_rollouts(3, 8, seed=7, first_group=70, completion_mean=30))  # head 28: in the hole
        assert (store.head, store.holes, len(store)) == (32, (), 56)
        assert store.manifest.to_dict()["version"] == fmt.FORMAT_VERSION  # no holes left: version 1 again
    assert verify_store(path)["ok"]


def test_a_damaged_newest_segment_leaves_a_hole_at_the_end_and_row_ids_are_not_reused(tmp_path):
    path = str(tmp_path / "s")
    segs, rows = _three_segments(path)
    flip_byte(path, segs[2].file, segs[2].bytes // 2)
    res = repair_store(path)
    assert res["rows"] == 32
    with ReplayStore(path) as store:
        assert store.holes == ((32, 48),) and store.next_row == 48
        assert store.extend(make_rollouts(1, 8, seed=9, first_group=90)).tolist() == list(range(48, 56))
        _same(store.read(np.arange(0, 24)), rows[segs[0].id])
    assert verify_store(path)["ok"]


def test_a_manifest_with_holes_is_refused_by_a_reader_that_does_not_know_them(tmp_path):
    """Version 3: a diskreplay without holes says "Unsupported version 3" rather than serving the rows
    after a hole as the rows of other ids; the manifests from before the repair are quarantined, so
    it cannot fall back to one of them either."""
    path = str(tmp_path / "s")
    segs, _ = _three_segments(path)
    flip_byte(path, segs[1].file, segs[1].bytes // 2)
    res = repair_store(path)
    assert os.listdir(os.path.join(path, fmt.MANIFEST_DIR)) == [os.path.basename(fmt.manifest_file(res["generation"]))]
    doc = json.load(open(os.path.join(path, fmt.manifest_file(res["generation"]))))
    assert doc["version"] == fmt.HOLES_MANIFEST_VERSION and doc["holes"] == [[24, 32]]
    doc["holes"] = [[24, 30]]  # a hole that is not exactly the gap is refused
    with pytest.raises(fmt.FormatError, match="but for the holes"):
        fmt.Manifest.from_dict(doc, "x", verified=True)


def test_a_stream_hands_out_every_row_but_the_holes(tmp_path):
    from diskreplay import RolloutStream

    path = str(tmp_path / "s")
    segs, _ = _three_segments(path)
    flip_byte(path, segs[1].file, segs[1].bytes // 2)
    repair_store(path)
    with ReplayStore(path, readonly=True) as store:
        stream = RolloutStream(store, "train", group_size=8)
        got = []
        while True:
            batch = stream.next(8, timeout=0)
            if batch is None:
                break
            got += np.asarray(batch).reshape(-1).tolist()
    assert sorted(got) == store.row_ids().tolist()


# --------------------------------------------------------------------------- export --skip-damaged


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "diskreplay.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_export_skip_damaged_exports_the_healthy_rows_and_names_what_it_skipped(tmp_path):
    path = str(tmp_path / "s")
    segs, rows = _three_segments(path)
    first, bad, last = segs
    flip_byte(path, bad.file, bad.bytes // 2)
    before = {rel: open(os.path.join(path, d, rel), "rb").read() for d in (fmt.MANIFEST_DIR, fmt.SEGMENT_DIR)
              for rel in os.listdir(os.path.join(path, d))}
    out = str(tmp_path / "x.parquet")
    refused = _cli("export", path, out)
    assert refused.returncode == 1 and bad.file in refused.stderr and "--skip-damaged" in refused.stderr
    assert not os.path.exists(out)
    done = _cli("export", path, out, "--skip-damaged")
    assert done.returncode == 0, done.stderr
    assert f"skipped {bad.num_rows} rows of 1 damaged segment" in done.stderr, done.stderr
    assert f"{bad.file} (rows {bad.first_row}-{bad.end_row - 1})" in done.stderr, done.stderr
    table = pq.read_table(out)
    want = np.concatenate([rows[first.id]["prompt_id"], rows[last.id]["prompt_id"]])
    assert table.column("prompt_id").to_pylist() == want.tolist()
    flat = np.concatenate([np.asarray(v, np.int32) for v in table.column("completion_ids").to_pylist()])
    assert np.array_equal(flat, np.concatenate([rows[first.id]["completion_ids"].values,
                                                rows[last.id]["completion_ids"].values]))
    after = {rel: open(os.path.join(path, d, rel), "rb").read() for d in (fmt.MANIFEST_DIR, fmt.SEGMENT_DIR)
             for rel in os.listdir(os.path.join(path, d))}
    assert after == before  # nothing repaired, nothing moved


def test_pairs_best_of_n_and_info_of_a_repaired_store(tmp_path):
    """The curated exports kept per-row arrays of len(store) indexed by row id - head: a hole shifted
    every row after it out of them."""
    from diskreplay.export import best_of_n, preference_pairs, store_info

    path = str(tmp_path / "s")
    segs, _ = _three_segments(path)
    flip_byte(path, segs[1].file, segs[1].bytes // 2)
    repair_store(path)
    with ReplayStore(path, readonly=True) as store:
        live = set(store.row_ids().tolist())
    preference_pairs(path, str(tmp_path / "p.parquet"), format="parquet")
    table = pq.read_table(tmp_path / "p.parquet")
    assert table.num_rows > 0
    assert set(table.column("chosen_row").to_pylist() + table.column("rejected_row").to_pylist()) <= live
    best_of_n(path, str(tmp_path / "b.parquet"), k=1, format="parquet")
    assert set(pq.read_table(tmp_path / "b.parquet").column("row").to_pylist()) <= live
    assert store_info(path)["rows"] == len(live)


# --------------------------------------------------------------------------- the manifest transforms


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(1, 5), min_size=2, max_size=8), data=st.data())
def test_appends_and_evictions_keep_holes_exactly_the_gaps(sizes, data):
    """Any store with holes, any appends under a row capacity: the manifest stays valid (holes exactly
    the gaps, above head), and its live rows are the rows its segments hold from head on."""
    entries, first = [], 0
    for i, n in enumerate(sizes):
        entries.append(fmt.SegmentEntry(i, first, n, 100, 0))
        first += n
    lost = data.draw(st.sets(st.integers(1, len(sizes) - 1), max_size=len(sizes) - 2))  # never the first
    kept = tuple(e for e in entries if e.id not in lost)
    gaps = []
    for e in entries:
        if e.id in lost:
            if gaps and gaps[-1][1] == e.first_row:
                gaps[-1] = (gaps[-1][0], e.end_row)
            else:
                gaps.append((e.first_row, e.end_row))
    m = fmt.Manifest(generation=1, head=0, next_row=first, next_segment=len(sizes), segments=kept,
                     holes=tuple(gaps))
    m.validate("m")
    capacity = data.draw(st.integers(1, 40))
    options = fmt.StoreOptions(capacity_rows=capacity)
    for k in range(data.draw(st.integers(0, 6))):
        n = data.draw(st.integers(1, 6))
        new = fmt.SegmentEntry(m.next_segment, m.next_row, n, 100, 0)
        m = fmt.append_rows(m, [new], n, None, (), options)
        m.validate("m")
        assert all(a > m.head for a, _ in m.holes) and m.head >= m.next_row - capacity
        held = {r for s in m.segments for r in range(max(s.first_row, m.head), s.end_row)}
        assert m.num_rows == len(held)
        assert fmt.Manifest.from_dict(m.to_dict(), "m") == m
