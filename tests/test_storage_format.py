"""A real store's files through object storage: the storage layer carries the
on-disk format unchanged, and a segment read from a sparse cache file (only
the ranges a batch needs fetched) is served, checksummed, exactly as a local one.

This is how the store will read remotely once S3Storage is plugged in (see
``diskreplay.storage``): open = the segment's non-data pages; then the
offsets of the columns asked for; then the value ranges of the rows asked for.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from diskreplay import CorruptStoreError, ReplayStore
from diskreplay.segment import PAGE_BYTES, Segment
from diskreplay.format.sidecars import read_group_sidecar
from diskreplay.storage import S3Storage

from .conftest import assert_rows_equal


def _make_store(path, rows=256):
    rng = np.random.default_rng(0)
    batch = {"prompt_id": [i // 8 for i in range(rows)],
             "completion_ids": [rng.integers(0, 50_000, int(n), dtype=np.int32)
                                for n in rng.integers(300, 700, rows)],
             "rewards": rng.random(rows).astype(np.float32)}
    with ReplayStore(path, capacity=None) as store:
        store.extend(batch)
        return store.read(np.arange(rows)), store.manifest.segments[0], store.schema


def _upload(storage, root):
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name == "LOCK":
                continue
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                storage.write_new(os.path.relpath(full, root).replace(os.sep, "/"), f.read())


def test_store_copied_through_the_bucket_opens_unchanged(s3_server, tmp_path):
    expected, _, _ = _make_store(str(tmp_path / "local"))
    st = S3Storage(f"s3://{s3_server.new_bucket()}/run1", s3_server.storage_options,
                   cache_dir=str(tmp_path / "cache"))
    _upload(st, str(tmp_path / "local"))
    copy = tmp_path / "copy"
    for reldir in ("", "manifests", "segments", "groups", "state"):
        for name in st.list(reldir):
            rel = f"{reldir}/{name}" if reldir else name
            os.makedirs(copy / reldir, exist_ok=True)
            (copy / rel).write_bytes(st.read_bytes(rel))
    with ReplayStore(str(copy), readonly=True) as store:
        got = store.read(np.arange(len(expected["rewards"])))
    assert_rows_equal(got, {k: (list(v) if k == "completion_ids" else v) for k, v in expected.items()})
    st.close()


def test_segment_served_from_a_sparse_cache_file(s3_server, tmp_path):
    expected, entry, schema = _make_store(str(tmp_path / "local"))
    st = S3Storage(f"s3://{s3_server.new_bucket()}/run1", s3_server.storage_options,
                   cache_dir=str(tmp_path / "cache"), coalesce_bytes=0)
    _upload(st, str(tmp_path / "local"))

    # Open: the group sidecar (small, whole) gives the page checksums and where
    # the data body lies; fetch everything of the segment outside the body.
    sidecar = st.local_path(entry.groups_file, size=entry.groups_bytes)
    pages = read_group_sidecar(sidecar, entry.groups_bytes, entry.groups_crc32c,
                               schema.arrow_schema().field("prompt_id").type, entry.first_row,
                               entry.num_rows)[3]
    assert pages is not None and pages.page_bytes == PAGE_BYTES
    body_start, body_end = pages.body
    path = st.fetch_ranges(entry.file, [(0, body_start), (body_end, entry.bytes)], size=entry.bytes)
    seg = Segment(path, entry.bytes, schema, entry.num_rows, None, pages)

    # Then the offsets of the ragged column (their place is known without reading them) ...
    base = seg._base.address
    offsets = seg.column("completion_ids").buffers()[1]
    st.fetch_ranges(entry.file, [(offsets.address - base, offsets.address - base + offsets.size)])
    # ... then the values of the rows asked for.
    rows = np.array([3, 4, 200])
    want = [(a - base, a - base + n) for a, n in seg.value_ranges("completion_ids", rows)]
    st.fetch_ranges(entry.file, want)
    seg.check_rows("completion_ids", rows)
    values, offs, _ = seg.ragged("completion_ids")
    for r in rows:
        np.testing.assert_array_equal(values[offs[r]:offs[r + 1]], expected["completion_ids"][r])

    stats = st.cache_stats()
    assert stats.fetched_bytes < entry.bytes / 2, stats  # only what the rows need
    assert stats.fetched_bytes <= 1.2 * stats.requested_bytes

    # A row whose pages were never fetched reads as zeros in the sparse file:
    # its page checksum refuses it (a reader that skips fetching cannot serve garbage).
    far = np.array([120])
    assert all(a - base >= want[1][1] + PAGE_BYTES for a, _ in seg.value_ranges("completion_ids", far)[:1])
    with pytest.raises(CorruptStoreError, match="fails its checksum"):
        seg.check_rows("completion_ids", far)
    st.close()
