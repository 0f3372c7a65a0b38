"""segment: pure helpers of the page hints."""

import numpy as np
from hypothesis import given, settings, strategies as st

from diskreplay._ranges import coalesce


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 500)), max_size=40), st.integers(0, 300))
def test_coalesce_covers_every_range_with_disjoint_spans_further_apart_than_the_gap(ranges, gap):
    starts = np.array([a for a, _ in ranges], dtype=np.int64)
    ends = np.array([a + n for a, n in ranges], dtype=np.int64)
    lo, hi = coalesce(starts, ends, gap)
    assert np.all(np.diff(lo) > 0) and np.all(lo[1:] > hi[:-1] + gap)   # sorted, disjoint, apart
    for a, b in zip(starts, ends):
        i = np.searchsorted(lo, a, side="right") - 1
        assert i >= 0 and lo[i] <= a and b <= hi[i]                       # each range lies in one span
    covered = sum(int(b - a) for a, b in zip(lo, hi))
    union = len(set().union(*[range(a, b) for a, b in zip(starts, ends)])) if ranges else 0
    assert covered <= union + gap * max(len(lo) and len(ranges) - 1, 0)  # only gaps are added


# --------------------------------------------------------------------------- the files of a small commit

import pyarrow as pa  # noqa: E402

from diskreplay.ragged import arrow_array, numpy_view  # noqa: E402
from diskreplay.segment import PageChecksums, encode_ipc  # noqa: E402
from diskreplay.format.sidecars import group_sidecar  # noqa: E402


def _sidecar_by_dictionary(keys, first_row):
    """The group sidecar as its definition says it (every group through a dictionary encoding)."""
    enc = keys.dictionary_encode()
    codes = numpy_view(enc.indices).astype(np.int64)
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes, minlength=len(enc.dictionary)).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows = pa.LargeListArray.from_arrays(arrow_array(offsets), arrow_array(order + (first_row or 0)))
    return pa.RecordBatch.from_arrays([enc.dictionary, arrow_array(counts), rows], names=["key", "count", "rows"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=40), st.integers(0, 20), st.integers(0, 5),
       st.sampled_from([None, 0, 1000]), st.booleans())
def test_group_sidecar_of_one_group_or_many_is_the_dictionary_encoded_one(keys, lo, width, first_row, strings):
    # slices too: a segment of a split append holds a slice of the batch's key column
    arr = pa.array([f"k{k}" for k in keys], pa.large_string()) if strings else pa.array(keys, pa.int64())
    arr = arr.slice(min(lo, len(keys) - 1), width or None)
    got, want = group_sidecar(arr, first_row), _sidecar_by_dictionary(arr, first_row)
    assert got.schema.equals(want.schema) and got.equals(want)
    # the same bytes: a sidecar's CRC-32C is in its manifest entry, and a rebuilt one must match
    assert encode_ipc(got.replace_schema_metadata(None)).equals(encode_ipc(want))
    assert group_sidecar(pa.array([7] * 8, pa.int64()), None).column("rows").to_pylist() == [list(range(8))]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=12), st.booleans())
def test_page_checksums_body_holds_every_buffer_and_nothing_arrow_parses(lengths, with_nulls):
    rows = [None if with_nulls and i % 3 == 1 else np.arange(n, dtype=np.int32) for i, n in enumerate(lengths)]
    offsets = np.concatenate([[0], np.cumsum([0 if r is None else len(r) for r in rows])]).astype(np.int64)
    values = np.concatenate([r for r in rows if r is not None] + [np.zeros(0, np.int32)])
    valid = np.array([r is not None for r in rows])
    ragged = pa.Array.from_buffers(pa.large_list(pa.int32()), len(rows),
                                   [None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little")),
                                    pa.py_buffer(offsets)], children=[arrow_array(values)])
    batch = pa.RecordBatch.from_arrays([ragged, arrow_array(np.arange(len(rows), dtype=np.int64))], names=["c", "k"])
    data = encode_ipc(batch)
    pages = PageChecksums.of(data)
    start, end = pages.body
    parsed = pa.ipc.open_file(data).get_batch(0)
    spans = [(b.address - data.address, b.address - data.address + b.size)
             for col in parsed.columns for b in col.buffers() if b is not None and b.size]
    assert all(start <= a and b <= end for a, b in spans)  # every buffer is in the body
    assert 8 < start and end < data.size  # the schema and batch metadata before it, the footer after it
    assert end - start <= sum(b - a for a, b in spans) + 8 * (len(spans) + 1)  # buffers and their padding only
    assert len(pages.crcs) == -(-data.size // pages.page_bytes)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), key=st.integers(-(1 << 63), (1 << 63) - 1), other=st.integers(-5, 5),
       local=st.booleans())
def test_a_sidecar_from_its_template_is_the_file_arrow_writes(n, key, other, local):
    """The template of a one-group sidecar gives byte for byte the file of the batch it stands
    for; several groups or global rows take the general path, with the same result."""
    from diskreplay.format.sidecars import encode_group_sidecar

    keys = pa.array([key] * n, pa.int64())
    first_row = None if local else 1000
    assert encode_group_sidecar(keys, first_row).equals(encode_ipc(group_sidecar(keys, first_row)))
    mixed = pa.array([key] * n + [other], pa.int64())
    assert encode_group_sidecar(mixed, first_row).equals(encode_ipc(group_sidecar(mixed, first_row)))
