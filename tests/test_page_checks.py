"""Page checks of fresh reads: the compiled one-pass check (every segment of a read in one call)
and the per-segment numpy check find the same damage, check the same pages, and mark a row only
once all of its pages passed; a loader's worker, which reads ahead, surfaces the damage too."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from diskreplay import CorruptStoreError, PromptGroupSampler, ReplayLoader, ReplayStore
from diskreplay import _jit
from diskreplay.segment import PAGE_BYTES
from diskreplay.store.compaction import MergePolicy
from diskreplay.synthetic import make_rollouts

from .conftest import flip_byte

RAGGED = ("prompt_ids", "completion_ids", "old_per_token_logps", "ref_per_token_logps")
COMPILED = _jit.kernels() is not None and _jit.crc32c_function() is not None
PATHS = ["numpy", pytest.param("compiled", marks=pytest.mark.skipif(not COMPILED, reason="needs numba and "
                                                                                          "google_crc32c's C library"))]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """Four segments of 16 prompt groups each, all with page checksums (no merges)."""
    path = str(tmp_path_factory.mktemp("pages") / "store")
    with ReplayStore(path, merge_policy=MergePolicy(max_bytes=1)) as store:
        for k in range(4):
            store.extend(make_rollouts(16, 4, seed=k, first_group=16 * k, prompt_mean=120, completion_mean=300))
        segments = store.manifest.segments
        want = store.read(store.row_ids(), list(RAGGED))
    assert len(segments) == 4
    return path, segments, want


def _use(monkeypatch, path):
    monkeypatch.setenv("DISKREPLAY_JIT", "1" if path == "compiled" else "0")


def _row_pages(store_path, seg):
    """The pages each row's ragged values lie in, and the pages every read of the segment checks
    (header, footer, the ragged columns' offsets), from pyarrow's own view of the file."""
    with pa.memory_map(os.path.join(store_path, seg.file)) as source:
        data = source.read_buffer()
    batch = pa.ipc.open_file(data).get_batch(0)

    def pages_of(a, b):
        return set(range(a // PAGE_BYTES, (b - 1) // PAGE_BYTES + 1)) if b > a else set()

    spans = [(b.address - data.address, b.address - data.address + b.size)
             for col in batch.columns for arr in (col, getattr(col, "values", None)) if arr is not None
             for b in arr.buffers()[:2] if b is not None and b.size]
    n_pages = -(-data.size // PAGE_BYTES)
    shared = pages_of(0, min(a for a, _ in spans)) | pages_of(max(b for _, b in spans), data.size) \
        | {n_pages - 1}
    rows = [set() for _ in range(batch.num_rows)]
    for name in RAGGED:
        col = batch.column(name)
        values, width = col.values, col.values.type.byte_width
        start = values.buffers()[1].address - data.address + values.offset * width
        offsets = col.offsets.to_numpy()
        shared |= pages_of(col.buffers()[1].address - data.address,
                           col.buffers()[1].address - data.address + col.buffers()[1].size)
        for r in range(batch.num_rows):
            rows[r] |= pages_of(start + offsets[r] * width, start + offsets[r + 1] * width)
    return rows, shared, data.size


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_flipped_byte_is_refused_by_every_read_that_touches_its_page(original, tmp_path, monkeypatch, path,
                                                                       data):
    """Damage anywhere in a segment's values (its first page, a middle one, the short last page) is
    refused, naming the file and the page's bytes, by exactly the reads of rows whose values lie in
    that page; every other row reads back exactly, before and after."""
    _use(monkeypatch, path)
    src, segments, want = original
    store_path = os.path.join(tempfile.mkdtemp(dir=tmp_path), "s")
    shutil.copytree(src, store_path)
    seg = data.draw(st.sampled_from(segments))
    pages, shared, size = _row_pages(store_path, seg)
    value_pages = sorted(set().union(*pages))
    where = data.draw(st.sampled_from(["first", "last", "any"]))
    page = {"first": value_pages[0], "last": value_pages[-1]}[where] if where != "any" \
        else data.draw(st.sampled_from(value_pages))
    offset = data.draw(st.integers(page * PAGE_BYTES, min(size, (page + 1) * PAGE_BYTES) - 1))
    flip_byte(store_path, seg.file, offset)
    # a page of the header, footer or offsets is checked by every read of the segment
    hit = {seg.first_row + r for r, p in enumerate(pages) if page in p or page in shared}
    with ReplayStore(store_path, readonly=True) as reader:
        # batches across all segments, in random order: a read touching the page fails, others pass
        order = data.draw(st.permutations(range(reader.head, reader.next_row)))
        for batch in np.array_split(np.array(order), 6):
            if hit & set(batch.tolist()):
                with pytest.raises(CorruptStoreError, match=f"{seg.file} fails its checksum at bytes "
                                                            f"\\[{page * PAGE_BYTES}, "):
                    reader.read(batch, list(RAGGED))
            else:
                got = reader.read(batch, list(RAGGED))
                for name in RAGGED:
                    for i, row in enumerate(batch.tolist()):
                        assert np.array_equal(got[name][i], want[name][row]), (name, row)
        # the damaged rows stay refused: a failed check marks nothing as checked
        for row in sorted(hit)[:3]:
            with pytest.raises(CorruptStoreError):
                reader.read(np.array([row]), list(RAGGED))


def test_both_paths_check_the_same_pages(original, monkeypatch):
    """The compiled pass and the per-segment one leave the same record of checked pages after the
    same reads (only pages of rows read, each read's pages all checked)."""
    if not COMPILED:
        pytest.skip("needs numba and google_crc32c's C library")
    src, _, _ = original
    rng = np.random.default_rng(7)
    batches = [rng.choice(np.arange(256), size=int(rng.integers(1, 8)), replace=False) for _ in range(5)]
    records = {}
    for path in ("numpy", "compiled"):
        _use(monkeypatch, path)
        with ReplayStore(src, readonly=True) as reader:
            for batch in batches:
                reader.read(batch, list(RAGGED))
            records[path] = {sid: p.verified.copy() for sid, p in reader._cache.pages.items()}
    assert records["numpy"].keys() == records["compiled"].keys()
    for sid in records["numpy"]:
        assert np.array_equal(records["numpy"][sid], records["compiled"][sid]), sid
    assert 0 < sum(int(v.sum()) for v in records["compiled"].values()) < sum(len(v) for v in records["compiled"].values())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["advantages", "completion_ids"])
def test_damage_in_a_buffer_every_read_of_a_column_needs_is_refused_by_the_first_read(original, tmp_path,
                                                                                     monkeypatch, path, name):
    """The buffers a read of a column needs whatever its rows (a per-row column's values, a ragged
    column's offsets) are checked when the read opens their segment, all in one pass: damage there is
    refused by the first read of any row of that segment, naming the file and the page; the other
    segments read as before."""
    _use(monkeypatch, path)
    src, segments, want = original
    store_path = str(tmp_path / "s")
    shutil.copytree(src, store_path)
    seg = segments[1]
    with pa.memory_map(os.path.join(store_path, seg.file)) as source:
        data = source.read_buffer()
        buf = pa.ipc.open_file(data).get_batch(0).column(name).buffers()[1]  # the values / the offsets
        at = buf.address - data.address + buf.size // 2
    flip_byte(store_path, seg.file, at)
    page = at // PAGE_BYTES
    with ReplayStore(store_path, readonly=True) as reader:
        with pytest.raises(CorruptStoreError, match=f"{seg.file} fails its checksum at bytes \\[{page * PAGE_BYTES}, "):
            reader.read(np.array([seg.first_row + seg.num_rows - 1]), [name])
        other = segments[2].first_row
        got = reader.read(np.array([other]), ["completion_ids"])["completion_ids"][0]
        assert np.array_equal(got, want["completion_ids"][other])


@pytest.mark.parametrize("path", PATHS)
def test_the_loaders_worker_surfaces_damage(original, tmp_path, monkeypatch, path):
    """A batch the loader's worker read ahead from a damaged page raises from ``next`` (naming the
    file), never a batch of damaged values."""
    _use(monkeypatch, path)
    src, segments, _ = original
    store_path = str(tmp_path / "s")
    shutil.copytree(src, store_path)
    seg = segments[2]
    pages, _, _ = _row_pages(store_path, seg)
    flip_byte(store_path, seg.file, min(pages[0]) * PAGE_BYTES + 5)
    with ReplayStore(store_path, readonly=True) as reader:
        loader = ReplayLoader(reader, PromptGroupSampler(num_groups=64), 256, pad_token_id=0, prefetch=2)
        with pytest.raises(CorruptStoreError, match=seg.file):
            with loader:
                next(iter(loader))
