"""The codecs of ``diskreplay.format`` tested directly, without a store: group sidecars, persisted group
indexes, saved states, token logs and the batch fingerprints token records hold (docs/FORMAT.md,
"Group sidecars", "Group index", "Saved states", "Exactly-once tokens").

Each codec: what it encodes decodes to the same value; a byte changed anywhere in a file that a
checksum covers is refused (``DiskReplayError``), and where one is not covered (an Arrow file's
padding) the value read is still exactly the one written.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from diskreplay import format as fmt
from diskreplay._fileio import crc32c
from diskreplay.errors import CorruptStoreError, DiskReplayError
from diskreplay.segment import PageChecksums
from diskreplay.storage.local import LocalStorage

SETTINGS = settings(max_examples=40, deadline=None)


def _write(data: Any) -> str:
    fd, path = tempfile.mkstemp(suffix=".arrow")
    with os.fdopen(fd, "wb") as f:
        f.write(bytes(data))
    return path


def _flipped(data: Any, at: int, xor: int) -> bytes:
    raw = bytearray(bytes(data))
    raw[at % len(raw)] ^= xor
    return bytes(raw)


# --------------------------------------------------------------------------
# group sidecars
# --------------------------------------------------------------------------

int_keys = st.lists(st.integers(-3, 3), min_size=1, max_size=40).map(lambda v: pa.array(v, pa.int64()))
str_keys = st.lists(st.sampled_from(["a", "b", "prompt-7", ""]), min_size=1, max_size=40).map(
    lambda v: pa.array(v, pa.large_string()))


@st.composite
def page_checksums(draw, nbytes: int = 1 << 16):
    page = draw(st.sampled_from([512, 8192]))
    crcs = np.array(draw(st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=9)), dtype=np.uint32)
    start = draw(st.integers(0, nbytes // 2))
    end = draw(st.integers(start, nbytes))
    buffers = None
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(start, end), min_size=2, max_size=8)))
        buffers = np.array(cuts[:len(cuts) // 2 * 2], dtype=np.int64).reshape(-1, 2)
    return PageChecksums(crcs, page, (start, end), buffers)


def _same_pages(got, want) -> bool:
    if want is None or got is None:
        return got is want
    same_buffers = (got.buffers is None and want.buffers is None) or (
        got.buffers is not None and want.buffers is not None and got.buffers.tolist() == want.buffers.tolist())
    return (got.crcs.tolist() == want.crcs.tolist() and got.page_bytes == want.page_bytes
            and tuple(got.body) == tuple(want.body) and same_buffers)


def _groups_of(keys: pa.Array, first_row: int):
    """The sidecar a segment of ``keys`` at ``first_row`` must have, by a plain loop."""
    order, rows = [], {}
    for i, k in enumerate(keys.to_pylist()):
        if k not in rows:
            order.append(k)
            rows[k] = []
        rows[k].append(first_row + i)
    return order, [len(rows[k]) for k in order], [r for k in order for r in rows[k]]


@SETTINGS
@given(st.one_of(int_keys, str_keys), st.integers(0, 10 ** 9), st.booleans(), st.one_of(st.none(), page_checksums()))
def test_group_sidecar_round_trip(keys, first_row, local, pages):
    """A sidecar read back (``read_group_sidecar``) gives each group once in order of first appearance,
    its count and its global rows ascending, and the page checksums it carried: whether its rows
    were written global or segment-local (an append delta's)."""
    data = fmt.encode_group_sidecar(keys, None if local else first_row, pages)
    path = _write(data)
    try:
        got_keys, counts, rows, got_pages = fmt.read_group_sidecar(path, data.size, crc32c(data), keys.type,
                                                                   first_row, len(keys))
    finally:
        os.unlink(path)
    want_keys, want_counts, want_rows = _groups_of(keys, first_row)
    assert got_keys.to_pylist() == want_keys
    assert counts.tolist() == want_counts and rows.tolist() == want_rows
    assert _same_pages(got_pages, pages)


@SETTINGS
@given(st.one_of(int_keys, str_keys), st.integers(0, 10 ** 6), st.integers(0, 1 << 20), st.integers(1, 255))
def test_a_damaged_group_sidecar_is_refused(keys, first_row, at, xor):
    """A sidecar's whole file is checked against the manifest's CRC-32C before it is parsed."""
    data = fmt.encode_group_sidecar(keys, first_row)
    path = _write(_flipped(data, at, xor))
    try:
        with pytest.raises(CorruptStoreError, match="checksum"):
            fmt.read_group_sidecar(path, data.size, crc32c(data), keys.type, first_row, len(keys))
    finally:
        os.unlink(path)


@SETTINGS
@given(st.lists(st.integers(-2, 2), min_size=1, max_size=20), st.integers(0, 10 ** 6))
def test_an_inline_group_is_the_sidecar_it_replaces(values, first_row):
    """``inline_group`` names a key exactly when every row has that one int64 key, and
    ``inline_group_sidecar`` of it is what the sidecar of those rows would say."""
    keys = pa.array(values, pa.int64())
    key = fmt.inline_group(keys)
    assert (key is not None) == (len(set(values)) == 1)
    if key is None:
        return
    assert key == values[0]
    got_keys, counts, rows, pages = fmt.inline_group_sidecar(key, pa.int64(), first_row, len(values))
    assert (got_keys.to_pylist(), counts.tolist(), rows.tolist(), pages) == (*_groups_of(keys, first_row), None)
    side = fmt.group_sidecar(keys, first_row)
    assert side.column("key").to_pylist() == [key] and side.column("rows")[0].as_py() == rows.tolist()
    with pytest.raises(CorruptStoreError):
        fmt.inline_group_sidecar(key, pa.large_string(), first_row, len(values))


# --------------------------------------------------------------------------
# persisted group indexes
# --------------------------------------------------------------------------

@st.composite
def group_indexes(draw):
    """``(keys, offsets, rows, first_row, end_row, pages)`` as a writer persists them: groups in
    order of their oldest row, rows ascending, every row of ``[first_row, end_row)`` once."""
    first_row = draw(st.integers(0, 10 ** 6))
    n = draw(st.integers(0, 60))
    labels = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n))
    order = list(dict.fromkeys(labels))
    members = {g: [first_row + i for i, lab in enumerate(labels) if lab == g] for g in order}
    offsets = np.cumsum([0] + [len(members[g]) for g in order]).astype(np.int64)
    rows = np.array([r for g in order for r in members[g]], dtype=np.int64)
    keys = pa.array([10 * g + 1 for g in order], pa.int64())
    pages = {}
    for sid in draw(st.lists(st.integers(0, 10 ** 6), unique=True, max_size=4)):
        pages[sid] = (draw(st.integers(1, 1 << 30)), draw(st.integers(0, 2 ** 32 - 1)), draw(page_checksums()))
    return keys, offsets, rows, first_row, first_row + n, pages


def _read_index(data: bytes, nbytes: int, crc: int, frame, first_row: int, end_row: int):
    path = _write(data)
    try:
        return fmt.read_group_index(path, nbytes, crc, frame, pa.int64(), first_row, end_row)
    finally:
        os.unlink(path)


@SETTINGS
@given(group_indexes())
def test_group_index_round_trip(index):
    """A persisted group index (layout 2) reads back as the groups it was written with, zero-copy,
    and gives each segment's page checksums for exactly that file (its size and CRC-32C)."""
    keys, offsets, rows, first_row, end_row, pages = index
    data, frame = fmt.encode_group_index(keys, offsets, rows, first_row, end_row, pages)
    got_keys, got_offsets, got_rows, indexed = _read_index(data, data.size, crc32c(data), frame, first_row, end_row)
    assert got_keys.to_pylist() == keys.to_pylist()
    assert got_offsets.tolist() == offsets.tolist() and got_rows.tolist() == rows.tolist()
    for sid, (nbytes, crc, want) in pages.items():
        assert _same_pages(indexed.get(sid, nbytes, crc), want)
        assert indexed.get(sid, nbytes + 1, crc) is None  # another file of that id
    assert indexed.get(-1, 1, 1) is None


@SETTINGS
@given(group_indexes(), st.integers(0, 1 << 20), st.integers(1, 255))
def test_a_damaged_group_index_never_serves_other_groups(index, at, xor):
    """A byte changed anywhere: the read refuses it (``CorruptStoreError``: outside the body by the
    manifest's frame, in the key and row columns by their own checksums), or, in the page-checksum
    columns, warns and serves no page checksums (the sidecars serve them); bytes no checksum covers
    (Arrow's padding) change nothing that is read."""
    keys, offsets, rows, first_row, end_row, pages = index
    data, frame = fmt.encode_group_index(keys, offsets, rows, first_row, end_row, pages)
    damaged = _flipped(data, at, xor)
    try:
        got_keys, got_offsets, got_rows, indexed = _read_index(damaged, data.size, crc32c(data), frame, first_row,
                                                               end_row)
    except CorruptStoreError:
        return
    assert got_keys.to_pylist() == keys.to_pylist()
    assert got_offsets.tolist() == offsets.tolist() and got_rows.tolist() == rows.tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for sid, (nbytes, crc, want) in pages.items():
            got = indexed.get(sid, nbytes, crc)
            assert got is None or _same_pages(got, want)


# --------------------------------------------------------------------------
# saved states
# --------------------------------------------------------------------------

_DTYPES = [np.dtype(t) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                 "float16", "float32", "float64")]
arrays = st.sampled_from(_DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64), st.text(max_size=8),
                    st.floats(allow_nan=False, allow_infinity=False))
# the keys the codec itself uses to mark arrays and escaped objects, among others
state_keys = st.one_of(st.sampled_from(["__array__", "__dict__", "shape", "dtype", "step"]), st.text(max_size=6))
states = st.dictionaries(state_keys, st.recursive(
    st.one_of(scalars, arrays),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.dictionaries(state_keys, inner, max_size=3)),
    max_leaves=12), max_size=5)


def _same_state(got: Any, want: Any) -> bool:
    """``got`` is what ``want`` decodes to: tuples as lists, arrays of the same dtype, shape and bytes."""
    if isinstance(want, np.ndarray):
        return (isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
                and got.tobytes() == want.tobytes())
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same_state(got[k], v)
                                                                          for k, v in want.items())
    if isinstance(want, (list, tuple)):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same_state, got, want))
    return type(got) is type(want) and got == want


@SETTINGS
@given(states)
def test_state_round_trip(state):
    """``decode_state(encode_state(s)) == s`` for JSON values and numeric arrays of any shape, keys
    that the codec uses itself included; no pickle anywhere."""
    data = fmt.encode_state(state)
    assert _same_state(fmt.decode_state(data, "x"), state)
    assert _same_state(fmt.decode_state(data.to_pybytes(), "x"), state)


@SETTINGS
@given(states, st.integers(0, 1 << 20), st.integers(1, 255))
def test_a_damaged_state_file_is_refused(state, at, xor):
    """A saved state is checked against its manifest entry's size and CRC-32C before it is decoded."""
    data = fmt.encode_state(state)
    with tempfile.TemporaryDirectory() as root:
        storage = LocalStorage(root)
        entry = fmt.StateEntry("sampler", 3, data.size, crc32c(data))
        os.makedirs(os.path.join(root, fmt.STATE_DIR))
        with open(os.path.join(root, entry.file), "wb") as f:
            f.write(bytes(data))
        assert _same_state(fmt.read_state_file(storage, root, entry), state)
        with open(os.path.join(root, entry.file), "wb") as f:
            f.write(_flipped(data, at, xor))
        with pytest.raises(CorruptStoreError, match="checksum"):
            fmt.read_state_file(storage, root, entry)


def test_states_refuse_what_json_and_arrays_cannot_hold():
    from diskreplay.errors import ArgumentError

    for bad in ({1: 2}, {"x": object()}, {"x": np.array(["a"])}, {"x": {3}}):
        with pytest.raises(ArgumentError):
            fmt.encode_state(bad)
    with pytest.raises(CorruptStoreError):
        fmt.decode_state(b"not arrow", "x")


# --------------------------------------------------------------------------
# token logs and batch fingerprints
# --------------------------------------------------------------------------

records = st.lists(st.builds(fmt.TokenRecord, st.text(min_size=1, max_size=12), st.integers(0, 1 << 62),
                             st.integers(1, 1 << 62), st.integers(0, (1 << 63) - 1), st.integers(1, fmt.MAX_ID)),
                   min_size=1, max_size=20)


@SETTINGS
@given(records)
def test_token_log_round_trip(rs):
    data = fmt.token_log_bytes(rs)
    assert fmt.parse_token_log(data, "x") == rs
    assert json.loads(data)["format"] == fmt.TOKENS_FORMAT


@SETTINGS
@given(records, st.integers(0, 1 << 20), st.integers(1, 255))
def test_a_damaged_token_log_is_refused(rs, at, xor):
    """A token log is signed JSON: a byte changed anywhere is refused, never other records."""
    damaged = _flipped(fmt.token_log_bytes(rs), at, xor)
    with pytest.raises(DiskReplayError):
        fmt.parse_token_log(damaged, "x")


batches = st.integers(1, 12).flatmap(lambda n: st.fixed_dictionaries({
    "ids": st.lists(st.one_of(st.none(), st.lists(st.integers(0, 99), max_size=4)), min_size=n, max_size=n),
    "reward": st.lists(st.one_of(st.none(), st.floats(-2, 2, width=32)), min_size=n, max_size=n),
    "name": st.lists(st.one_of(st.none(), st.text(max_size=4)), min_size=n, max_size=n),
}))


def _record(cols) -> pa.RecordBatch:
    return pa.record_batch({"ids": pa.array(cols["ids"], pa.large_list(pa.int32())),
                            "reward": pa.array(cols["reward"], pa.float32()),
                            "name": pa.array(cols["name"], pa.large_string())})


@SETTINGS
@given(batches, st.data())
def test_batch_digest_depends_on_the_rows_only(cols, data):
    """A token record's ``digest``: the same rows hash the same whether sliced out of a larger batch
    or copied; an all-null column (a late column the batch never named) is left out; another
    value in any row gives another digest; it fits the record's 63 bits."""
    whole = _record(cols)
    n = whole.num_rows
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    part = whole.slice(start, stop - start)
    copied = _record({k: v[start:stop] for k, v in cols.items()})
    d = fmt.batch_digest(part)
    assert d == fmt.batch_digest(copied) and 0 <= d < 1 << 63
    late = part.append_column("late", pa.nulls(part.num_rows, pa.float32()))
    assert fmt.batch_digest(late) == d
    changed = dict(cols, reward=[(r or 0.0) + 1.0 if i == start else r for i, r in enumerate(cols["reward"])])
    assert fmt.batch_digest(_record(changed).slice(start, stop - start)) != d


def test_encoded_digest_of_older_records():
    """The fingerprint records written before ``batch_digest`` hold: the row count and each encoded
    piece's ``(bytes, crc32c)``, in order."""
    from diskreplay.format.tokens import digest

    a = digest(8, [(100, 7), (200, 9)])
    assert a == digest(8, [(100, 7), (200, 9)]) and 0 <= a < 1 << 63
    assert len({a, digest(9, [(100, 7), (200, 9)]), digest(8, [(200, 9), (100, 7)]), digest(8, [(100, 7)])}) == 4
