"""Cold reads: each segment's buffer ranges, persisted in its sidecar and the group index
(``diskreplay.buffers``, ``diskreplay.index.buffers``; docs/FORMAT.md), so that a cold read asks
for the header, footer and column buffers of every segment it touches in one round."""

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diskreplay import CorruptStoreError, ReplayStore
from diskreplay import format as fmt
from diskreplay._fileio import crc32c
from diskreplay.segment import PageChecksums, Segment, encode_ipc, field_buffers
from diskreplay.format.sidecars import read_group_sidecar
from diskreplay.store import replay_store, segment_cache
from diskreplay.store.compaction import MergePolicy
from diskreplay.verify import repair_store, verify_store

from .conftest import flip_byte, package_at

# their stores hold segments of a few rows, which would otherwise be checked whole
pytestmark = pytest.mark.usefixtures("paged_small_segments")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the commit this feature was built on: it writes no buffer ranges
PREVIOUS_VERSION = "07367a0"
NO_MERGE = MergePolicy(max_bytes=1)
LATE = "sampling_per_token_logps"


def batch(first, n, rng, late=False, longest=40):
    """Rows ``first, ...``: ragged (one nullable late), scalar, vector and string columns."""
    ids = np.arange(first, first + n)
    b = {"prompt_id": ids // 4,
         "prompt_ids": [np.arange(int(rng.integers(1, 9)), dtype=np.int32) + i for i in ids],
         "completion_ids": [np.arange(int(rng.integers(0, longest)), dtype=np.int32) + 2 * i for i in ids],
         "rewards": (ids * 0.5).astype(np.float32),
         "reward_parts": np.stack([ids, -ids], 1).astype(np.float32),
         "source": [f"s{i % 3}" for i in ids]}
    if late:
        b[LATE] = [None if i % 3 == 0 else np.full(len(c), -i / 7, dtype=np.float32)
                   for i, c in zip(ids, b["completion_ids"])]
    return b


def parsed_buffers(store, e):
    seg = Segment(os.path.join(store.path, e.file))
    return field_buffers(seg.batch, seg._base.address), seg.batch.schema.names


def assert_recorded(store):
    """Every segment's ranges, from its sidecar and from the index, equal what parsing it gives, and
    field i is column i of the store."""
    m = store.manifest
    for e in m.segments:
        want, names = parsed_buffers(store, e)
        assert names == store.schema.names[:len(names)]
        side = read_group_sidecar(os.path.join(store.path, e.groups_file), e.groups_bytes, e.groups_crc32c,
                                  store._key_type(), e.first_row, e.num_rows)[3]
        assert side.buffers is not None and np.array_equal(side.buffers, want), e
        if store._cache.index_pages is not None:
            got = store._cache.index_pages.get(e.id, e.bytes, e.crc32c)
            if got is not None:
                assert got.buffers is not None and np.array_equal(got.buffers, want), e
        # and each range spans exactly the buffers a read of that column touches whatever the rows
        seg = Segment(os.path.join(store.path, e.file))
        for i, name in enumerate(names):
            spans = seg.column_ranges([name], [store.schema[name].kind == "ragged"])
            spans[:, 0] -= seg._base.address
            tight = (spans[:, 0].min(), (spans[:, 0] + spans[:, 1]).max()) if len(spans) else (0, 0)
            assert tuple(want[i].tolist()) == tuple(int(x) for x in tight), (name, e)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 12), min_size=1, max_size=5), st.integers(0, 4), st.booleans())
def test_recorded_ranges_equal_the_parsed_ones(tmp_path_factory, commits, late_from, merge):
    path = str(tmp_path_factory.mktemp("s"))
    rng = np.random.default_rng(len(commits))
    first = 0
    with ReplayStore(path, merge_policy=None if merge else NO_MERGE) as store:
        for i, n in enumerate(commits):
            store.extend(batch(first, n, rng, late=i >= late_from))
            first += n
        store._persist_group_index(force=True)
        store.extend(batch(first, 3, rng, late=late_from < len(commits)))  # one segment past the index
    with ReplayStore(path, readonly=True) as store:
        store.group_index()
        assert_recorded(store)
        got = store.read(store.row_ids())
    with ReplayStore(path, readonly=True, verify_reads=False) as plain:
        want = plain.read(plain.row_ids())
    assert_same(got, want)


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k, v in want.items():
        if v is None or isinstance(v, list):
            assert got[k] == v, k
        elif hasattr(v, "offsets"):
            assert np.array_equal(got[k].values, v.values) and np.array_equal(got[k].offsets, v.offsets), k
            assert (got[k].validity is None) == (v.validity is None), k
            if v.validity is not None:
                assert np.array_equal(got[k].validity, v.validity), k
        else:
            assert np.array_equal(got[k], v, equal_nan=True), k


def fill(path, commits=replay_store.INDEX_TAIL_SEGMENTS + 3, rows=16, longest=40):
    rng = np.random.default_rng(0)
    with ReplayStore(path, merge_policy=NO_MERGE) as store:
        for c in range(commits):
            store.extend(batch(c * rows, rows, rng, longest=longest))
    return path


@pytest.mark.parametrize("how", ["read", "read_ranges", "prefetch", "collator"])
def test_a_cold_read_asks_for_every_segments_buffers_before_parsing_any(tmp_path, monkeypatch, how):
    """One ``prefetch_files`` round names, for each touched segment, its header and footer pages and the
    pages of the requested columns' buffers; it comes before the first segment is parsed. On every read
    path: ``read``, ``read_ranges`` (a packed ``Collator``'s), and ``prefetch`` (the loader's look-ahead)."""
    from diskreplay import Collator
    path = fill(str(tmp_path / "s"), rows=64, longest=2000)  # values far longer than the hint gap
    events = []
    real_prefetch, real_segment = segment_cache.prefetch_files, segment_cache.Segment
    monkeypatch.setattr(segment_cache, "prefetch_files", lambda wanted: (events.append(("hint", wanted)),
                                                                       real_prefetch(wanted)))

    def segment(*a, **k):
        events.append(("open", a[0]))
        return real_segment(*a, **k)

    monkeypatch.setattr(segment_cache, "Segment", segment)
    with ReplayStore(path, readonly=True) as store:
        rows = np.arange(0, len(store), 7)
        cols = ["completion_ids", "rewards"]
        if how == "collator":
            Collator(layout="packed").read(store, rows, ["prompt_ids", "completion_ids"])
            cols = ["prompt_ids", "completion_ids"]
        else:
            getattr(store, how)(rows, cols)
        got = store.read(rows, cols)
        assert [k for k, _ in events[:2]] == ["hint", "open"] and all(k == "open" for k, _ in events[2:])
        hinted = dict(events[0][1])
        m = store.manifest
        touched = sorted({int(i) for i in np.searchsorted([s.first_row for s in m.segments], rows, "right") - 1})
        assert len(hinted) == len(touched) > 1
        for i in touched:
            e = m.segments[i]
            seg = store._cache.segments[e.id]
            page = seg.pages.page_bytes
            asked = np.zeros(-(-e.bytes // page), dtype=bool)
            for off, length in hinted[os.path.join(path, e.file)]:
                asked[off // page:(-(-(off + length) // page) if length else len(asked))] = True
            for addr, size in seg.column_ranges(cols, [store.schema[c].kind == "ragged" for c in cols]).tolist():
                start = addr - seg._base.address
                assert asked[start // page:-(-(start + size) // page)].all(), (e, addr, size)
            # what is not asked for: the values of the ragged columns (and the columns not read)
            assert not asked.all()
    with ReplayStore(path, readonly=True, verify_reads=False) as plain:
        assert_same(got, plain.read(rows, cols))


def sidecar_with(path, e, meta_change):
    """Rewrite segment ``e``'s sidecar with its schema metadata changed, and name it in a new manifest."""
    side = pa.ipc.open_file(pa.py_buffer(open(os.path.join(path, e.groups_file), "rb").read())).get_batch(0)
    meta = dict(side.schema.metadata)
    meta_change(meta)
    data = encode_ipc(side.replace_schema_metadata(meta))
    with open(os.path.join(path, e.groups_file), "wb") as f:
        f.write(data.to_pybytes())
    return fmt.SegmentEntry(e.id, e.first_row, e.num_rows, e.bytes, e.crc32c, data.size, crc32c(data))


@pytest.mark.parametrize("change", ["missing", "short", "outside", "reversed"])
def test_a_missing_or_bad_entry_falls_back_to_parsing(tmp_path, change):
    path = str(tmp_path / "s")
    rng = np.random.default_rng(1)
    with ReplayStore(path, merge_policy=NO_MERGE) as store:
        for c in range(4):
            store.extend(batch(c * 8, 8, rng))
        want = store.read(store.row_ids())
        m = store.manifest

    def edit(meta):
        raw = np.frombuffer(meta[b"diskreplay.buffers"], dtype="<i8").copy()
        if change == "missing":
            del meta[b"diskreplay.buffers"]
        elif change == "short":
            meta[b"diskreplay.buffers"] = raw.tobytes()[:-3]
        elif change == "outside":
            raw[1] = 1 << 40
            meta[b"diskreplay.buffers"] = raw.tobytes()
        else:
            raw[0], raw[1] = raw[1] + 8, raw[0]
            meta[b"diskreplay.buffers"] = raw.tobytes()

    entries = tuple(sidecar_with(path, e, edit) for e in m.segments)
    m.evolve(generation=m.generation + 1, segments=entries).write(path)
    with ReplayStore(path, readonly=True) as store, warnings.catch_warnings():
        warnings.simplefilter("error")
        for e in store.manifest.segments:
            assert store._page_checksums(e).buffers is None
        assert_same(store.read(store.row_ids()), want)
    report = verify_store(path)
    if change == "missing":  # a sidecar written before the key existed
        assert report["ok"], report
        return
    # a value the writer cannot have written: verify names it, and repair rewrites the sidecars
    assert not report["ok"] and all("diskreplay.buffers" in p for p in report["problems"]), report
    repair_store(path)
    assert verify_store(path)["ok"]
    with ReplayStore(path, readonly=True) as store:
        assert_recorded(store)
        assert_same(store.read(store.row_ids()), want)


def test_hints_never_serve_unchecked_bytes(tmp_path):
    """Ranges that point elsewhere only change what is read ahead: every byte served is still checked
    against the page checksums, so a damaged page is refused."""
    path = str(tmp_path / "s")
    rng = np.random.default_rng(2)
    with ReplayStore(path, merge_policy=NO_MERGE) as store:
        for c in range(3):
            store.extend(batch(c * 8, 8, rng))
        m = store.manifest
    e = m.segments[1]
    body = PageChecksums.of(pa.py_buffer(open(os.path.join(path, e.file), "rb").read())).body

    def elsewhere(meta):  # every field "at" the start of the body: well formed, wrong
        raw = np.frombuffer(meta[b"diskreplay.buffers"], dtype="<i8").reshape(-1, 2).copy()
        raw[:] = (body[0], body[0] + 8)
        meta[b"diskreplay.buffers"] = raw.tobytes()

    entries = list(m.segments)
    entries[1] = sidecar_with(path, e, elsewhere)
    m.evolve(generation=m.generation + 1, segments=tuple(entries)).write(path)
    with ReplayStore(path, readonly=True, verify_reads=False) as plain:
        want = plain.read(plain.row_ids())
    with ReplayStore(path, readonly=True) as store:
        assert_same(store.read(store.row_ids()), want)
    assert any(e.groups_file in p and "diskreplay.buffers" in p for p in verify_store(path)["problems"])
    # a flipped byte in the offsets of "completion_ids" of that segment
    seg = Segment(os.path.join(path, e.file))
    off = seg.batch.column("completion_ids").buffers()[1]
    at = off.address - seg._base.address + off.size // 2
    del seg
    with open(os.path.join(path, e.file), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with ReplayStore(path, readonly=True) as store:
        with pytest.raises(CorruptStoreError, match="fails its checksum"):
            store.read(store.row_ids(), ["completion_ids"])


def test_index_ranges_that_do_not_fit_are_not_used(tmp_path):
    """An index whose ``diskreplay.index.buffers`` does not fit its ``segments`` column (checksummed:
    written so) is read without them; the sidecars' or parsing serves."""
    path = fill(str(tmp_path / "s"))
    with ReplayStore(path) as store:
        want = store.read(store.row_ids())
        pages = {s.id: (s.bytes, s.crc32c, store._page_checksums(s)) for s in store.manifest.segments}
    from diskreplay.format.sidecars import encode_group_index, _META_INDEX_BUFFERS
    import diskreplay.format.sidecars as segment_module
    real = segment_module.encode_ipc

    def truncate(batch):
        meta = dict(batch.schema.metadata or {})
        if _META_INDEX_BUFFERS in meta:
            meta[_META_INDEX_BUFFERS] = meta[_META_INDEX_BUFFERS][:-16]
        return real(batch.replace_schema_metadata(meta))

    with ReplayStore(path, readonly=True) as store:
        m = store.manifest
        gi = store.group_index()
        segment_module.encode_ipc = truncate
        try:
            data, frame = encode_group_index(gi.arrow_keys(pa.int64()), gi.offsets, gi.rows, m.head, m.next_row,
                                             pages)
        finally:
            segment_module.encode_ipc = real
    e = fmt.GroupIndexEntry(m.generation + 1, m.head, m.next_row, data.size, crc32c(data), frame)
    with open(os.path.join(path, e.file), "wb") as f:
        f.write(data.to_pybytes())
    m.evolve(generation=m.generation + 1, group_index=e).write(path)
    with ReplayStore(path, readonly=True) as store, warnings.catch_warnings():
        warnings.simplefilter("error")
        store.group_index()
        seg_entry = store.manifest.segments[0]
        assert store._cache.index_pages.get(seg_entry.id, seg_entry.bytes, seg_entry.crc32c).buffers is None
        assert_same(store.read(store.row_ids()), want)


def test_merges_compaction_and_repair_record_the_ranges(tmp_path):
    path = str(tmp_path / "s")
    rng = np.random.default_rng(3)
    with ReplayStore(path) as store:  # the default policy merges small tails
        for c in range(40):
            store.extend(batch(c * 4, 4, rng, late=c >= 20))
        assert len(store.manifest.segments) < 40
    with ReplayStore(path, readonly=True) as store:
        assert_recorded(store)
    with ReplayStore(path) as store:
        store.compact(target_bytes=8 << 10)
        want = store.read(store.row_ids())
    with ReplayStore(path, readonly=True) as store:
        assert_recorded(store)
    # repair rebuilds a lost sidecar with the key, byte for byte what the writer wrote
    with ReplayStore(path, readonly=True) as store:
        e = store.manifest.segments[1]
    before = open(os.path.join(path, e.groups_file), "rb").read()
    os.remove(os.path.join(path, e.groups_file))
    res = repair_store(path)
    assert any("rebuilt" in a for a in res["actions"]), res
    assert open(os.path.join(path, e.groups_file), "rb").read() == before
    with ReplayStore(path, readonly=True) as store:
        assert_recorded(store)
        assert_same(store.read(store.row_ids()), want)


# --------------------------------------------------------------------------- older versions


def _previous(tmp_path):
    return package_at(PREVIOUS_VERSION, tmp_path / "previous")


_DUMP = """
    import warnings
    warnings.simplefilter("error")
    s = ReplayStore(sys.argv[1], readonly=True)
    s.group_index()
    b = s.read(s.row_ids())
    np.savez(sys.argv[2], **{k + ".values": v.values for k, v in b.items() if hasattr(v, "values")},
             **{k + ".offsets": v.offsets for k, v in b.items() if hasattr(v, "offsets")},
             **{k: np.asarray(v) for k, v in b.items() if not hasattr(v, "offsets")})
    s.close()
"""


def _reads_alike(previous, path, tmp_path):
    """The previous version and this one read every row of ``path`` to the same bytes, with no warning."""
    for package, out in ((previous, "old.npz"), (ROOT, "new.npz")):
        _run(package, _DUMP, path, str(tmp_path / out))
    old, new = np.load(tmp_path / "old.npz"), np.load(tmp_path / "new.npz")
    assert sorted(old.files) == sorted(new.files)
    for k in old.files:
        assert np.array_equal(old[k], new[k]), k


def _run(package, body, *args):
    code = "import sys, numpy as np\nfrom diskreplay import ReplayStore\n" + textwrap.dedent(body)
    code += "\nprint(sys.modules['diskreplay'].__file__)"
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=package), cwd=package)
    assert proc.returncode == 0 and package in proc.stdout, (proc.stdout, proc.stderr)
    return proc


@pytest.mark.parametrize("writer", ["previous", "this"])
def test_stores_of_either_version_read_bit_exactly_with_the_other(tmp_path, writer):
    """A store written before the ranges existed reads with this version; one written by this version
    (sidecars and index with the new keys) reads with the previous one, with no warning, and the same
    bytes."""
    previous = _previous(tmp_path)
    path = str(tmp_path / "s")
    fill_code = f"""
        from diskreplay import segment
        from diskreplay.store.compaction import MergePolicy
        segment.PAGED_SEGMENT_BYTES = 0  # (paged_small_segments, in the writer's process; older versions ignore it)
        rng = np.random.default_rng(0)
        with ReplayStore(sys.argv[1], merge_policy=MergePolicy(max_bytes=1)) as s:
            for c in range({replay_store.INDEX_TAIL_SEGMENTS + 3}):
                ids = np.arange(c * 16, c * 16 + 16)
                s.extend({{"prompt_id": ids // 4, "rewards": (ids * 0.5).astype(np.float32),
                          "completion_ids": [np.arange(int(rng.integers(0, 30)), dtype=np.int32) + 2 * i
                                             for i in ids]}})
    """
    _run(previous if writer == "previous" else ROOT, fill_code, path)
    with ReplayStore(path, readonly=True) as store:
        assert store.manifest.group_index is not None
        e = store.manifest.segments[0]
        has = store._page_checksums(e).buffers is not None
        assert has == (writer == "this")
    _reads_alike(previous, path, tmp_path)
    assert verify_store(path)["ok"]


def test_small_segments_without_page_checksums_read_with_the_previous_version(tmp_path):
    """Segments of a few rows written by this version have sidecars without page checksums: the
    previous version reads them (checking each whole, as it does a segment without them) with no
    warning and the same bytes, and refuses one that is damaged."""
    previous = _previous(tmp_path)
    path = str(tmp_path / "s")
    _run(ROOT, """
        from diskreplay.store.compaction import MergePolicy
        rng = np.random.default_rng(1)
        with ReplayStore(sys.argv[1], merge_policy=MergePolicy(max_bytes=1)) as s:
            for c in range(5):
                ids = np.arange(c * 8, c * 8 + 8)
                s.extend({"prompt_id": ids // 4, "rewards": (ids * 0.5).astype(np.float32),
                          "completion_ids": [np.arange(int(rng.integers(1, 30)), dtype=np.int32) + i for i in ids]})
    """, path)
    with ReplayStore(path, readonly=True) as store:
        assert all(store._sidecar(e)[3] is None for e in store.manifest.segments)  # no page checksums
        victim = store.manifest.segments[2]
    _reads_alike(previous, path, tmp_path)
    flip_byte(path, victim.file, victim.bytes // 2)
    _run(previous, f"""
        from diskreplay import CorruptStoreError
        s = ReplayStore(sys.argv[1], readonly=True)
        try:
            s.read(np.arange({victim.first_row}, {victim.end_row}))
            raise SystemExit("a damaged segment was served")
        except CorruptStoreError as exc:
            assert "{victim.file}" in str(exc) and "crc32c" in str(exc), exc
    """, path)


# --------------------------------------------------------------------------- object stores


def test_a_remote_read_fetches_column_buffers_with_the_frames(s3_server, s3_url, tmp_path):
    """On an object store whose segments' checksums are known (here from the sidecars the group index
    was built from), a cold read needs two rounds of range GETs per segment: Arrow's frame with the
    recorded buffers, then the rows' values (without the ranges: frame, buffers, values)."""
    rng = np.random.default_rng(4)
    with ReplayStore(s3_url, storage_options=s3_server.storage_options, cache_dir=str(tmp_path / "w"),
                     merge_policy=NO_MERGE) as store:
        for c in range(3):  # long prompts: completion_ids' offsets lie far from Arrow's header and footer
            ids = np.arange(c * 64, c * 64 + 64)
            store.extend({"prompt_id": ids // 8, "rewards": ids.astype(np.float32),
                          "prompt_ids": [np.arange(int(rng.integers(500, 1500)), dtype=np.int32) + i for i in ids],
                          "completion_ids": [np.arange(int(rng.integers(0, 2000)), dtype=np.int32) for i in ids]})
        want = store.read(store.row_ids())
    with ReplayStore(s3_url, readonly=True, storage_options=s3_server.storage_options,
                     cache_dir=str(tmp_path / "cold")) as cold:
        cold.group_index()  # reads the sidecars: the segments' checksums and buffer ranges
        gets = []
        real = cold.storage._call

        def call(op, rel, *a, **k):
            if op == "GET" and rel.startswith("segments/"):
                gets.append((rel, list(zip(k.get("starts", []), k.get("ends", [])))))
            return real(op, rel, *a, **k)

        cold.storage._call = call
        rows = np.arange(0, len(cold), 5)
        got = cold.read(rows)
        assert len(gets) == 2 * len(cold.manifest.segments), gets
    with ReplayStore(s3_url, readonly=True, storage_options=s3_server.storage_options,
                     cache_dir=str(tmp_path / "check")) as again:
        assert_same(got, again.read(rows))
    with ReplayStore(s3_url, readonly=True, storage_options=s3_server.storage_options,
                     cache_dir=str(tmp_path / "all")) as whole:
        assert_same(whole.read(whole.row_ids()), want)
