"""The group index: brought forward commit by commit, and persisted (docs/FORMAT.md, "Group index")."""

import os
import warnings

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diskreplay import ReplayStore
from diskreplay.verify import verify_store
from diskreplay import format as fmt
from diskreplay.groups import GroupIndex
from diskreplay._fileio import crc32c
from diskreplay.segment import encode_ipc
from diskreplay.format.sidecars import group_sidecar
from diskreplay.store import commits, replay_store
from diskreplay.store.compaction import MergePolicy

from .conftest import flip_byte

# their stores hold segments of a few rows, which would otherwise be checked whole
pytestmark = pytest.mark.usefixtures("paged_small_segments")

NO_MERGE = MergePolicy(max_bytes=1)  # one segment per commit, as with commits of a few MB


def _reference(keys, head):
    """Live rows grouped by key, groups by oldest live row: the plain definition."""
    groups = {}
    for row in range(head, len(keys)):
        groups.setdefault(keys[row], []).append(row)
    return list(groups), [np.array(r) for r in groups.values()]


def _assert_index(gi, keys, head):
    want_keys, want_rows = _reference(keys, head)
    assert gi.keys == want_keys
    assert len(gi) == len(want_keys)
    for g, rows in enumerate(want_rows):
        assert gi.group(g).tolist() == rows.tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=1, max_size=12), st.integers(0, 8)),
                min_size=1, max_size=6),
       st.sampled_from([pa.int64(), pa.large_string()]))
def test_extended_and_evicted_equal_a_rebuild(segments, key_type):
    """Segment after segment, with the head moving: the index brought forward is the one built afresh."""
    keys = []
    gi = GroupIndex(pa.array([], type=key_type), np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    end = head = 0
    for seg_keys, evict in segments:
        first = len(keys)
        typed = [k if key_type == pa.int64() else f"p{k}" for k in seg_keys]
        keys += typed
        sidecar = group_sidecar(pa.array(typed, type=key_type), first)
        part = (sidecar.column("key"), sidecar.column("count").to_numpy(),
                sidecar.column("rows").values.to_numpy())
        # the head may have moved into the new segment before it is indexed
        head = min(len(keys), head + evict)
        gi = gi.extended([part], min_row=max(end, head)).evicted(head)
        end = len(keys)
        _assert_index(gi, keys, head)
        if key_type == pa.int64():
            table = GroupIndex.from_groups(gi.arrow_keys(key_type), gi.counts, gi.rows, head)
            _assert_index(table, keys, head)


def _fill(path, commits, rows=16, capacity=None, seed=0):
    rng = np.random.default_rng(seed)
    with ReplayStore(path, capacity=capacity, merge_policy=NO_MERGE) as store:
        for c in range(commits):
            # groups span commits (keys repeat across them), as replayed prompts do
            store.extend({"prompt_id": rng.integers(0, 40, rows),
                          "completion_ids": [np.arange(rng.integers(1, 5), dtype=np.int32)] * rows})
    return ReplayStore(path, readonly=True)


def _sidecar_index(store):
    """The index from the sidecars alone (the path every store without a persisted index takes)."""
    m = store.manifest
    gi = GroupIndex(pa.array([], type=pa.int64()), np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    parts = [store._sidecar(s)[:3] for s in m.segments]
    return gi.extended(parts, min_row=m.head)


def test_a_writer_persists_the_index_and_readers_need_no_sidecar_of_it(tmp_path):
    path = str(tmp_path / "s")
    store = _fill(path, replay_store.INDEX_TAIL_SEGMENTS + 3)
    m = store.manifest
    assert m.group_index is not None and m.group_index.first_row == 0
    assert m.group_index.file in m.files()
    covered = [s for s in m.segments if s.end_row <= m.group_index.end_row]
    assert covered
    want = _sidecar_index(store)
    store.close()
    # the covered segments' sidecars are not read at all: group index and page checksums come from the index
    for s in covered:
        os.rename(os.path.join(path, s.groups_file), os.path.join(path, s.groups_file + ".away"))
    try:
        with ReplayStore(path, readonly=True) as reader:
            gi = reader.group_index()
            assert gi.keys == want.keys
            assert np.array_equal(gi.rows, want.rows) and np.array_equal(gi.offsets, want.offsets)
            batch = reader.read(reader.row_ids())
            assert len(batch["completion_ids"]) == len(reader)
    finally:
        for s in covered:
            os.rename(os.path.join(path, s.groups_file + ".away"), os.path.join(path, s.groups_file))
    report = verify_store(path)
    assert report["ok"], report


def test_the_index_follows_eviction_and_new_commits(tmp_path):
    path = str(tmp_path / "s")
    n = replay_store.INDEX_TAIL_SEGMENTS
    _fill(path, n, capacity=16 * (n + 4)).close()
    with ReplayStore(path, merge_policy=NO_MERGE) as writer:
        assert writer.manifest.group_index is not None
        for i in range(8):
            writer.extend({"prompt_id": np.arange(16) % 5 + 30 + i, "completion_ids": [[1]] * 16})
        keys = writer.read(writer.row_ids(), ["prompt_id"])["prompt_id"]
        head = writer.head
        assert head > writer.manifest.group_index.first_row  # rows of the index were evicted since
        with ReplayStore(path, readonly=True) as reader:
            gi = reader.group_index()
            full = [None] * head + keys.tolist()
            _assert_index(gi, full, head)
        gi = writer.group_index()
        _assert_index(gi, full, head)


def test_a_damaged_index_warns_and_the_sidecars_are_used(tmp_path):
    path = str(tmp_path / "s")
    store = _fill(path, replay_store.INDEX_TAIL_SEGMENTS)
    want = _sidecar_index(store)
    e = store.manifest.group_index
    store.close()
    with open(os.path.join(path, e.file), "r+b") as f:
        f.seek(e.bytes // 2)
        byte = f.read(1)
        f.seek(e.bytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with ReplayStore(path, readonly=True) as reader:
        with pytest.warns(RuntimeWarning, match="group index is rebuilt from the group sidecars"):
            gi = reader.group_index()
        assert gi.keys == want.keys and np.array_equal(gi.rows, want.rows)
    report = verify_store(path)
    assert report["ok"] and any("group index" in w for w in report["warnings"]), report


def test_stores_without_an_index_open_and_get_one(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    monkeypatch.setattr(commits, "INDEX_TAIL_SEGMENTS", 10 ** 6)  # what older versions wrote
    store = _fill(path, 20)
    assert store.manifest.group_index is None
    want = _sidecar_index(store)
    assert store.group_index().keys == want.keys
    store.close()
    monkeypatch.setattr(commits, "INDEX_TAIL_SEGMENTS", 16)
    with ReplayStore(path, merge_policy=NO_MERGE) as writer:
        writer.extend({"prompt_id": [1], "completion_ids": [[1]]})
        assert writer.manifest.group_index is not None
        assert writer.manifest.group_index.end_row == len(writer)


def test_manifest_names_the_index_and_refuses_a_foreign_name():
    e = fmt.GroupIndexEntry(3, 0, 10, 100, 7)
    m = fmt.Manifest(generation=3, next_row=10, next_segment=1,
                     segments=(fmt.SegmentEntry(0, 0, 10, 100, 1, 50, 2),), group_index=e)
    back = fmt.Manifest.from_dict(m.to_dict(), "m")
    assert back.group_index == e and e.file in back.files()
    doc = m.body()
    doc["group_index"]["file"] = "../escape.arrow"
    with pytest.raises(fmt.FormatError, match="group_index file"):
        fmt.Manifest.from_dict(fmt.signed_doc(doc), "m")
    doc["group_index"] = dict(e.to_dict(), end_row=11)
    with pytest.raises(fmt.FormatError, match="beyond next_row"):
        fmt.Manifest.from_dict(fmt.signed_doc(doc), "m")
    # a manifest without an index is byte for byte what older versions wrote
    assert "group_index" not in fmt.Manifest(generation=1).body()


def test_writer_failures_writing_the_index_do_not_fail_the_append(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    monkeypatch.setattr(commits, "INDEX_TAIL_SEGMENTS", 2)

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    with ReplayStore(path, merge_policy=NO_MERGE) as store:
        store.extend({"prompt_id": [1], "completion_ids": [[1]]})
        monkeypatch.setattr(commits, "encode_group_index", broken)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = store.extend({"prompt_id": [2], "completion_ids": [[2]]})
        assert rows.tolist() == [1] and store.manifest.group_index is None
        assert any("writing the group index failed" in str(w.message) for w in caught)
        assert not [f for f in os.listdir(os.path.join(path, "groups")) if f.startswith("index-")]
        assert store.group_keys() == [1, 2]


def _column_spans(path, e):
    """Byte range of each column of a persisted index file (its buffers, children's included)."""
    data = pa.py_buffer(open(os.path.join(path, e.file), "rb").read())
    batch = pa.ipc.open_file(data).get_batch(0)
    spans = {}
    for name, col in zip(batch.schema.names, batch.columns):
        bufs = [b for b in col.buffers() if b is not None and b.size]
        spans[name] = (min(b.address for b in bufs) - data.address,
                       max(b.address + b.size for b in bufs) - data.address)
    return spans



@pytest.mark.parametrize("where", ["frame", "key", "rows"])
def test_damage_the_index_needs_is_found_before_use(tmp_path, where):
    """A flipped byte in the schema/footer, the keys or the rows: a warning naming the file, and the
    index from the sidecars (the same index), never a wrong group."""
    path = str(tmp_path / "s")
    store = _fill(path, replay_store.INDEX_TAIL_SEGMENTS)
    want = _sidecar_index(store)
    e = store.manifest.group_index
    store.close()
    assert e.frame is not None
    spans = _column_spans(path, e)
    flip_byte(path, e.file, {"frame": e.bytes - 40, "key": spans["key"][1] - 5,
                         "rows": (spans["rows"][0] + spans["rows"][1]) // 2}[where])
    with ReplayStore(path, readonly=True) as reader:
        with pytest.warns(RuntimeWarning, match=f"{e.file}.*group index is rebuilt from the group sidecars"):
            gi = reader.group_index()
        assert gi.keys == want.keys and np.array_equal(gi.rows, want.rows)
        assert np.array_equal(gi.offsets, want.offsets)


@pytest.mark.parametrize("column", ["segments", "page_crc32c"])
def test_damaged_page_checksums_in_the_index_fall_back_to_the_sidecars(tmp_path, column):
    """The segments' page checksums are checked on the first segment opened: damage there warns, and the
    sidecars' checksums serve (the group index itself is intact and used)."""
    path = str(tmp_path / "s")
    store = _fill(path, replay_store.INDEX_TAIL_SEGMENTS)
    want = store.read(store.row_ids())["completion_ids"]
    e = store.manifest.group_index
    store.close()
    lo, hi = _column_spans(path, e)[column]
    flip_byte(path, e.file, hi - 3)
    with ReplayStore(path, readonly=True) as reader:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            reader.group_index()
        with pytest.warns(RuntimeWarning, match=f"{e.file} fails its checksum.*{column}"):
            got = reader.read(reader.row_ids())["completion_ids"]
        assert np.array_equal(got.values, want.values) and np.array_equal(got.offsets, want.offsets)


def _layout_1(keys, counts, rows, first_row, end_row, pages):
    """A group index file as versions before layout 2 wrote it: the sidecar's layout, with the rows it
    covers and the segments' page checksums in the schema metadata."""
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    col = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(rows, type=pa.int64()))
    batch = pa.RecordBatch.from_arrays([keys, pa.array(counts, type=pa.int64()), col], names=["key", "count", "rows"])
    table = np.array([(sid, nbytes, crc, p.page_bytes, p.body[0], p.body[1], len(p.crcs))
                      for sid, (nbytes, crc, p) in sorted(pages.items())], dtype="<i8").reshape(-1, 7)
    crcs = np.concatenate([pages[k][2].crcs for k in sorted(pages)]).astype("<u4")
    return encode_ipc(batch.replace_schema_metadata({
        b"diskreplay.index.rows": f"{first_row} {end_row}".encode(),
        b"diskreplay.index.segments": table.tobytes(), b"diskreplay.page_crc32c": crcs.tobytes()}))


def test_a_layout_1_index_is_still_read(tmp_path):
    """Stores whose index was written before layout 2 (no ``frame`` in the manifest) open from it, with
    no warning and without the covered segments' sidecars."""
    path = str(tmp_path / "s")
    store = _fill(path, replay_store.INDEX_TAIL_SEGMENTS + 2)
    m = store.manifest
    e = m.group_index
    want = _sidecar_index(store)
    covered = [s for s in m.segments if s.end_row <= e.end_row]
    pages = {s.id: (s.bytes, s.crc32c, store._sidecar(s)[3]) for s in covered}
    store.close()
    # the index of exactly the covered rows, as an older writer made it
    old = _sidecar_index_of(path, covered)
    data = _layout_1(old.arrow_keys(pa.int64()), old.counts, old.rows, e.first_row, e.end_row, pages)
    with open(os.path.join(path, e.file), "wb") as f:
        f.write(data.to_pybytes())
    m.evolve(group_index=fmt.GroupIndexEntry(e.generation, e.first_row, e.end_row, data.size, crc32c(data))).write(path)
    for s in covered:
        os.rename(os.path.join(path, s.groups_file), os.path.join(path, s.groups_file + ".away"))
    try:
        with ReplayStore(path, readonly=True) as reader, warnings.catch_warnings():
            warnings.simplefilter("error")
            assert reader.manifest.group_index.frame is None
            gi = reader.group_index()
            assert gi.keys == want.keys and np.array_equal(gi.rows, want.rows)
            assert len(reader.read(reader.row_ids())["completion_ids"]) == len(reader)
    finally:
        for s in covered:
            os.rename(os.path.join(path, s.groups_file + ".away"), os.path.join(path, s.groups_file))
    assert verify_store(path)["ok"]


def _sidecar_index_of(path, segments):
    with ReplayStore(path, readonly=True) as store:
        gi = GroupIndex(pa.array([], type=pa.int64()), np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
        return gi.extended([store._sidecar(s)[:3] for s in segments], min_row=0)
