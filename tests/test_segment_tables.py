"""Segment tables: a long full manifest names its entries as one Arrow table, which readers map
instead of parsing the JSON entries (docs/FORMAT.md, "Segment tables"). The JSON entries stay the
truth: a missing or damaged table is read past, readers without tables read the JSON, verify
checks the two agree, and a writer SIGKILLed mid-commit loses no committed row."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from diskreplay import ReplayStore
from diskreplay import format as fmt
from diskreplay._fileio import crc32c
from diskreplay.format.segment_table import SegmentTable, cut_entries, table_bytes
from diskreplay.store.compaction import MergePolicy
from diskreplay.testing.workload import expected_rows
from diskreplay.verify import verify_store

from .conftest import flip_byte
from .test_durability import Child, check_live_rows

NO_MERGES = MergePolicy(max_bytes=1)


def _build(path, commits, multi_writer=False):
    with ReplayStore(path, merge_policy=NO_MERGES, multi_writer=multi_writer) as store:
        for k in range(commits):
            first = store.next_row
            store.extend(expected_rows(np.arange(first, first + 1 + k % 3)))
        return store.manifest


def _json_entries(path, m):
    with open(os.path.join(path, m.file), "rb") as f:
        return fmt.Manifest.from_dict(json.loads(f.read()), m.file, verified=True).segments


@pytest.fixture
def small_tables(monkeypatch):
    """Tables from 8 segments on (the threshold is a writer's choice; readers take any), and every
    local manifest mapped rather than read (object stores read theirs: both paths run)."""
    from diskreplay.format import discovery

    monkeypatch.setattr(fmt, "SEGMENT_TABLE_MIN", 8)
    monkeypatch.setattr(discovery, "MAPPED_MANIFEST_BYTES", 1)


@pytest.mark.parametrize("multi_writer", [False, True])
def test_readers_map_the_table_and_its_entries_equal_the_json(tmp_path, small_tables, multi_writer):
    path = str(tmp_path / "s")
    m = _build(path, 40, multi_writer)
    with ReplayStore(path, readonly=True) as reader:
        m = fmt.read_manifest(reader.storage, reader.generation)
        assert isinstance(m.segments, SegmentTable)  # (many writers: deltas applied to a checkpoint's table)
        check_live_rows(reader)
    newest = fmt.load_newest_manifest(path)[0]
    checkpoint = next(fmt.read_manifest(path, g) for g in fmt.list_generations(path)
                      if fmt.read_manifest(path, g).segment_table is not None)
    assert isinstance(checkpoint.segments, SegmentTable) and len(checkpoint.segments) >= 8
    assert checkpoint.segments == _json_entries(path, checkpoint)  # a reader without tables reads the same
    assert newest.num_rows == sum(1 + k % 3 for k in range(40))
    report = verify_store(path)
    assert report["ok"] and not [w for w in report["warnings"] if "table" in w], report


def test_a_missing_or_damaged_table_is_read_past(tmp_path, small_tables):
    path = str(tmp_path / "s")
    m = _build(path, 30)
    table_path = os.path.join(path, m.segment_table.file)
    flip_byte(path, m.segment_table.file, m.segment_table.bytes // 2)  # damaged: readers take the JSON entries
    got = fmt.read_manifest(path, m.generation)
    assert not isinstance(got.segments, SegmentTable) and got.segments == m.segments
    with ReplayStore(path, readonly=True) as reader:
        check_live_rows(reader)
    report = verify_store(path)
    assert report["ok"] and any(m.segment_table.file in w for w in report["warnings"]), report
    os.remove(table_path)  # missing (an older writer's clean-up removes what it does not know)
    with ReplayStore(path, readonly=True) as reader:
        check_live_rows(reader)
    with ReplayStore(path, merge_policy=NO_MERGES) as writer:  # the next commit writes a new table
        writer.extend(expected_rows(np.arange(writer.next_row, writer.next_row + 2)))
        assert writer.manifest.segment_table is not None
    assert verify_store(path)["warnings"] == []


def test_verify_finds_a_table_of_other_entries(tmp_path, small_tables):
    path = str(tmp_path / "s")
    m = _build(path, 20)
    forged = list(m.segments)
    forged[3] = fmt.SegmentEntry(forged[3].id, forged[3].first_row, forged[3].num_rows, forged[3].bytes + 1,
                                 forged[3].crc32c, forged[3].groups_bytes, forged[3].groups_crc32c)
    data = table_bytes(SegmentTable.of(forged))
    with open(os.path.join(path, m.segment_table.file), "wb") as f:
        f.write(data)
    entry = fmt.SegmentTableEntry(m.segment_table.id, len(data), crc32c(data), len(forged))
    os.remove(os.path.join(path, m.file))
    fmt.Manifest.evolve(m, segment_table=entry).write(path)
    report = verify_store(path)
    assert not report["ok"] and any("does not hold the segment entries" in p for p in report["problems"]), report


def test_json_entries_stay_for_readers_without_tables(tmp_path, small_tables):
    """The manifest keeps every JSON entry, so a diskreplay that does not know tables reads it."""
    path = str(tmp_path / "s")
    m = _build(path, 12)
    with open(os.path.join(path, m.file)) as f:
        doc = json.load(f)
    assert len(doc["segments"]) == len(m.segments) == doc["segment_table"]["count"]
    assert doc["version"] == fmt.FORMAT_VERSION


@pytest.mark.parametrize("capacity", [{"capacity": 40}, {"capacity_bytes": 60_000}])
def test_capacity_eviction_on_a_table(tmp_path, small_tables, capacity):
    """Evicting from a manifest whose segments are a table drops the same segments as from a tuple."""
    path = str(tmp_path / "s")
    with ReplayStore(path, merge_policy=NO_MERGES, **capacity) as store:
        for k in range(60):
            store.extend(expected_rows(np.arange(store.next_row, store.next_row + 1 + k % 3)))
            m = store.manifest
            if isinstance(m.segments, SegmentTable):  # and tighter capacities, as the next append would
                for o in (store.options, dataclasses.replace(store.options, capacity_rows=20),
                          dataclasses.replace(store.options, capacity_bytes=30_000)):
                    want = fmt.evict(m.head, m.next_row + 5, tuple(m.segments), o)
                    got = fmt.evict(m.head, m.next_row + 5, m.segments, o)
                    assert got[0] == want[0] and tuple(got[1]) == want[1]
        assert store.head > 0 and isinstance(store.manifest.segments, SegmentTable)
    with ReplayStore(path, readonly=True) as reader:
        check_live_rows(reader)


def test_a_store_below_the_threshold_writes_no_table(tmp_path):
    path = str(tmp_path / "s")
    m = _build(path, 5)
    assert m.segment_table is None and not any(n.startswith("table.") for n in os.listdir(os.path.join(path, "groups")))


entry_lists = st.lists(st.tuples(st.integers(1, 50), st.integers(1, 10 ** 6), st.integers(0, 2 ** 32 - 1),
                                 st.one_of(st.none(), st.integers(-(2 ** 63), 2 ** 63 - 1))), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(entry_lists, st.data())
def test_tables_behave_as_tuples_of_entries(rows, data):
    entries, first = [], 0
    for i, (n, nbytes, crc, group) in enumerate(rows):
        gbytes, gcrc = (0, 0) if group is not None else (nbytes // 2, crc ^ 1)
        entries.append(fmt.SegmentEntry(i * 3, first, n, max(nbytes, n), crc, gbytes, gcrc, group))
        first += n
    entries = tuple(entries)
    table = SegmentTable.from_bytes(table_bytes(SegmentTable.of(entries)), "t")
    assert table == entries and tuple(table) == entries and len(table) == len(entries)
    a = data.draw(st.integers(0, len(entries)))
    b = data.draw(st.integers(a, len(entries)))
    assert table[a:b] == entries[a:b] and table[-1] == entries[-1]
    assert table[:a] + entries[a:] == entries and entries[:a] + table[a:] == entries
    assert table[:a] + table[a:] == table


def test_cut_entries_finds_the_entries_in_canonical_json():
    m = fmt.Manifest(generation=3, next_row=8, next_segment=4, segments=(
        fmt.SegmentEntry(1, 0, 4, 100, 1), fmt.SegmentEntry(2, 4, 4, 100, 2, group=7)),
        tokens=(fmt.TokenRecord('a"segments":[x]', 0, 4, 1, 1),),
        segment_table=fmt.SegmentTableEntry(3, 10, 11, 2))
    raw = fmt.signed_bytes(m.body())
    cut, start, end = cut_entries(raw)
    doc = json.loads(cut)
    assert doc["segments"] == [] and doc["tokens"] == json.loads(raw)["tokens"]
    assert json.loads(raw)["segments"] == json.loads(b"[" + raw[start:end] + b"]")


KILLED_WRITER = """
from diskreplay import format as fmt
from diskreplay.store.compaction import MergePolicy
fmt.SEGMENT_TABLE_MIN = 6
path, multi = sys.argv[1], sys.argv[2] == "1"
store = ReplayStore(path, merge_policy=MergePolicy(max_bytes=1), multi_writer=multi)
k = 0
while True:
    first = store.next_row
    got = store.extend(expected_rows(np.arange(first, first + 1 + k % 4)))
    print("rows", int(got[0]), len(got), flush=True)
    k += 1
"""


@pytest.mark.parametrize("multi_writer", [False, True])
def test_sigkill_mid_commit_loses_no_committed_row(tmp_path, multi_writer):
    """A writer killed at random points of its commits (tables written each one): every row it was
    told committed is there and exact, the store verifies, and a new writer goes on."""
    path = str(tmp_path / "s")
    rnd = random.Random(5)
    returned = []
    for round_ in range(3):
        child = Child(KILLED_WRITER, path, int(multi_writer))
        try:
            child.wait_for("rows", timeout=120)
            target = len(child.output().splitlines()) + rnd.randint(5, 25)
            while len(child.output().splitlines()) < target and child.proc.poll() is None:
                time.sleep(0.002)
            child.kill()
            returned += [tuple(map(int, line.split()[1:])) for line in child.output().splitlines()]
        finally:
            child.cleanup()
        with ReplayStore(path, readonly=True) as reader:
            assert reader.next_row >= max(a + n for a, n in returned)
            check_live_rows(reader)
            assert len(reader.manifest.segments) >= 6
        report = verify_store(path)
        assert report["ok"], report["problems"]


def test_tables_on_object_storage(s3_server, s3_url, tmp_path, small_tables):
    """On S3 a table is created only if absent, before its manifest; readers fetch and use it."""
    opts = dict(storage_options=s3_server.storage_options, cache_dir=str(tmp_path / "cache"))
    with ReplayStore(s3_url, merge_policy=NO_MERGES, **opts) as store:
        for k in range(14):
            store.extend(expected_rows(np.arange(store.next_row, store.next_row + 2)))
        assert store.manifest.segment_table is not None
    with ReplayStore(s3_url, readonly=True, **opts) as reader:
        m = fmt.read_manifest(reader.storage, reader.generation)
        assert isinstance(m.segments, SegmentTable) and len(m.segments) == 14
        check_live_rows(reader)
    assert verify_store(s3_url, storage_options=s3_server.storage_options)["ok"]



@settings(max_examples=60, deadline=None)
@given(entry_lists, st.lists(st.text(max_size=30), max_size=3), st.booleans())
def test_a_manifests_file_joins_its_entries_json_into_the_same_bytes(rows, tokens, with_table):
    """``Manifest.file_bytes`` (each entry's JSON made once) writes exactly ``signed_bytes(body())``,
    whatever strings the document holds (tokens naming ``"segments"`` or the placeholder)."""
    entries, first = [], 0
    for i, (n, nbytes, crc, group) in enumerate(rows):
        gbytes, gcrc = (0, 0) if group is not None else (nbytes // 2, crc ^ 1)
        entries.append(fmt.SegmentEntry(i, first, n, max(nbytes, n), crc, gbytes, gcrc, group))
        first += n
    records = tuple(fmt.TokenRecord(t + '"segments":"\x00entries\x00"', 0, 1, 1, 1) for t in tokens)
    m = fmt.Manifest(generation=2, next_row=first, next_segment=len(entries), tokens=records,
                     segments=SegmentTable.of(entries) if with_table else tuple(entries),
                     segment_table=fmt.SegmentTableEntry(9, 10, 11, len(entries)) if with_table else None)
    assert m.file_bytes() == fmt.signed_bytes(m.body())
    moved = m.segments[0].moved(5)  # a moved entry's JSON is its own, not the cached one of the original
    assert moved.json_bytes() == fmt.canonical_json(moved.to_dict())
