"""Per-token tensor columns (MoE routed experts: ``[num_layers, top_k]`` per token): declared with
``PerTokenTensor``, stored as uint8/uint16/int16, checked for range and alignment, and laid out by
``collate`` (padded, with the declared fill), ``collate_packed`` and ``Collator``."""

import os
import tempfile

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diskreplay import Collator, ReplayStore, collate
from diskreplay.batching import collate_packed
from diskreplay.errors import ArgumentError, BatchError, BatchSchemaError, FormatError
from diskreplay.ragged import PerTokenTensor
from diskreplay.schema import ColumnSpec

DTYPES = ("uint8", "uint16", "int16")


def _tokens(align, p, c):
    return {"prompt": p, "completion": c, "sequence": max(p + c - 1, 0)}[align]


@st.composite
def routing_batches(draw):
    dtype = draw(st.sampled_from(DTYPES))
    info = np.iinfo(dtype)
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    align = draw(st.sampled_from(("completion", "prompt", "sequence")))
    fill = draw(st.integers(int(info.min), int(info.max)))
    n = draw(st.integers(1, 6))
    plens = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    clens = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    missing = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**31))
    return dtype, shape, align, fill, plens, clens, missing, seed


def _batch(dtype, shape, align, fill, plens, clens, missing, seed):
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    rows = [None if gone else rng.integers(int(info.min), int(info.max) + 1, (_tokens(align, p, c),) + shape)
            for p, c, gone in zip(plens, clens, missing)]
    batch = {"prompt_id": list(range(len(plens))),
             "prompt_ids": [rng.integers(1, 100, p) for p in plens],
             "completion_ids": [rng.integers(1, 100, c) for c in clens],
             "routed": PerTokenTensor(rows, dtype, align=align, fill=fill, shape=shape)}
    return batch, rows


def _expected_padded(rows, plens, clens, align, fill, shape, dtype):
    P, C = max(plens), max(clens)
    W = {"prompt": P, "completion": C, "sequence": P + C}[align]
    out = np.full((len(rows), W) + shape, fill, dtype=dtype)
    for i, (r, p, c) in enumerate(zip(rows, plens, clens)):
        if r is None:
            continue
        for t in range(len(r)):
            col = {"prompt": P - p + t, "completion": t,
                   "sequence": P - p + t if t < p else P + t - p}[align]
            out[i, col] = r[t]
    return out


def _expected_packed(rows, plens, clens, align, fill, shape, dtype):
    T = sum(plens) + sum(clens)
    out = np.full((T,) + shape, fill, dtype=dtype)
    at = 0
    for r, p, c in zip(rows, plens, clens):
        if r is not None:
            first = at + (p if align == "completion" else 0)
            out[first:first + len(r)] = r
        at += p + c
    return out


@settings(max_examples=40, deadline=None)
@given(case=routing_batches(), order_seed=st.integers(0, 1000))
def test_round_trip_through_read_padded_packed_and_collator(case, order_seed):
    dtype, shape, align, fill, plens, clens, missing, seed = case
    batch, rows = _batch(*case)
    with tempfile.TemporaryDirectory() as d:
        store = ReplayStore(d)
        store.extend(batch)
        order = np.random.default_rng(order_seed).permutation(len(rows)).tolist()
        rows = [rows[i] for i in order]
        plens, clens = [plens[i] for i in order], [clens[i] for i in order]
        got = store.read(order)
        col = got["routed"]
        if all(r is None for r in rows):  # not computed in any row: no column, as any ragged one
            assert col is None and collate(got, 0, schema=store.schema)["routed"] is None
            store.close()
            return
        assert col.values.dtype == np.dtype(dtype)
        for r, v in zip(rows, col):  # flat, prod(shape) values a token, zero-copy as any ragged column
            assert (v is None) == (r is None)
            if r is not None:
                np.testing.assert_array_equal(v.reshape((-1,) + shape), r)
        want = _expected_padded(rows, plens, clens, align, fill, shape, dtype)
        padded = collate(got, 0, schema=store.schema)
        assert padded["routed"].numpy().dtype == np.dtype(dtype)
        np.testing.assert_array_equal(padded["routed"].numpy(), want)
        present = np.array([r is not None for r in rows])
        if not present.all():
            np.testing.assert_array_equal(padded["routed_present"].numpy(), present)
        packed_want = _expected_packed(rows, plens, clens, align, fill, shape, dtype)
        packed = collate_packed(got, schema=store.schema)
        np.testing.assert_array_equal(packed["routed"].numpy()[0], packed_want)
        collator = Collator(0)
        for _ in range(2):  # the second call writes into the buffers of the first
            np.testing.assert_array_equal(collator.read(store, order)["routed"].numpy(), want)
        np.testing.assert_array_equal(
            Collator(layout="packed", batch_dim=False).read(store, order)["routed"].numpy(), packed_want)
        spec = store.schema["routed"]
        store.close()
        reopened = ReplayStore(d)
        assert reopened.schema["routed"] == spec == ColumnSpec("routed", "ragged", dtype, align, shape=shape,
                                                              fill=fill)
        np.testing.assert_array_equal(collate(reopened.read(order), 0, schema=reopened.schema)["routed"].numpy(),
                                      want)
        reopened.close()


def _files(d):
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("high", [True, False])
def test_out_of_range_refused_naming_row_and_token(tmp_path, dtype, high):
    info = np.iinfo(dtype)
    store = ReplayStore(str(tmp_path))
    ok = [np.zeros((c, 4, 2), np.int64) for c in (2, 3, 5)]
    store.extend({"prompt_id": [0, 0, 1], "completion_ids": [[1] * 2, [1] * 3, [1] * 5],
                  "routed": PerTokenTensor(ok, dtype)})
    before = _files(str(tmp_path))
    bad = [r.copy() for r in ok]
    bad[2][3, 1, 0] = int(info.max) + 1 if high else int(info.min) - 1
    with pytest.raises(BatchError, match=r"'routed' row 2 token 3 holds -?\d+ at \[1, 0\], outside " + dtype):
        store.extend({"prompt_id": [0, 0, 1], "completion_ids": [[1] * 2, [1] * 3, [1] * 5], "routed": bad})
    assert len(store) == 3 and _files(str(tmp_path)) == before
    store.close()


@pytest.mark.parametrize("align", ["completion", "sequence"])
def test_lengths_that_differ_from_the_ids_are_refused(tmp_path, align):
    store = ReplayStore(str(tmp_path))
    p, c = [[1, 2], [3]], [[4, 5, 6], [7, 8]]
    n = [3, 2] if align == "completion" else [4, 2]
    n[1] += 1
    with pytest.raises(BatchError, match=r"'routed' row 1 has \d+ tokens but"):
        store.extend({"prompt_id": [0, 0], "prompt_ids": p, "completion_ids": c,
                      "routed": PerTokenTensor([np.zeros((k, 2, 2)) .astype(np.int16) for k in n], "int16",
                                               align=align)})
    assert len(store) == 0
    store.close()


def test_declaration_kept_and_a_different_one_refused(tmp_path):
    store = ReplayStore(str(tmp_path))
    store.extend({"prompt_id": [0], "completion_ids": [[1, 2]],
                  "routed": PerTokenTensor([np.ones((2, 3, 2), np.int64)], "uint8", fill=255)})
    # later batches pass the rows as they are (the store holds the declaration), a padded tensor with lengths,
    # or Arrow's flat list of the stored type
    store.extend({"prompt_id": [1], "completion_ids": [[1]], "routed": [np.full((1, 3, 2), 7)]})
    padded = torch.full((2, 4, 3, 2), 9)
    store.extend({"prompt_id": [2, 2], "completion_ids": [[1, 1], [1, 1, 1, 1]],
                  "routed": PerTokenTensor(padded, "uint8", fill=255, lengths=[2, 4])})
    flat = pa.array([np.full(6, 5, np.uint8)], type=pa.large_list(pa.uint8()))
    store.extend(pa.table({"prompt_id": [3], "completion_ids": pa.array([[1]], type=pa.large_list(pa.int32())),
                           "routed": flat}))
    got = collate(store.read([1, 2, 3, 4]), 0, schema=store.schema)["routed"]
    assert got.shape == (4, 4, 3, 2) and got.dtype == torch.uint8
    assert got[:, :, 0, 0].tolist() == [[7, 255, 255, 255], [9, 9, 255, 255], [9, 9, 9, 9], [5, 255, 255, 255]]
    with pytest.raises(BatchSchemaError, match="'routed'"):
        store.extend({"prompt_id": [1], "completion_ids": [[1]],
                      "routed": PerTokenTensor([np.ones((1, 3, 2), np.int64)], "uint16", fill=255)})
    with pytest.raises(BatchError, match="row 0 has shape"):
        store.extend({"prompt_id": [1], "completion_ids": [[1]], "routed": [np.ones((1, 2, 2), np.int64)]})
    with pytest.raises(BatchError, match="row 0 holds 5 values, not a whole number"):
        store.extend(pa.table({"prompt_id": [3], "completion_ids": pa.array([[1]], type=pa.large_list(pa.int32())),
                               "routed": pa.array([np.full(5, 5, np.uint8)], type=pa.large_list(pa.uint8()))}))
    assert len(store) == 5
    store.close()


def test_declaration_refused_before_anything_is_written():
    with pytest.raises(ArgumentError, match="dtype='int32'"):
        PerTokenTensor([], "int32")
    with pytest.raises(ArgumentError, match="fill=256"):
        PerTokenTensor([], "uint8", fill=256)
    with pytest.raises(ArgumentError, match="align='row'"):
        PerTokenTensor([], "uint8", align="row")


def test_a_reader_refuses_what_it_cannot_lay_out():
    # a per-token tensor's dtype is one no earlier reader accepted for a ragged column, so an older
    # reader refuses the store ("Unsupported column description") instead of reading flat values
    spec = ColumnSpec("routed", "ragged", "uint8", "completion", shape=(48, 8), fill=0)
    d = spec.to_dict()
    assert d["dtype"] not in ("int32", "float32") and ColumnSpec.from_dict(d) == spec
    for bad in ({**d, "dtype": "int32"}, {**d, "shape": [0, 8]}, {**d, "fill": 256}, {**d, "fill": None},
                {**d, "align": None}, {k: v for k, v in d.items() if k != "shape"}):
        with pytest.raises(FormatError, match="Unsupported column description"):
            ColumnSpec.from_dict(bad)


def test_sequence_alignment_needs_its_ids_in_the_batch(tmp_path):
    store = ReplayStore(str(tmp_path))
    store.extend({"prompt_id": [0], "prompt_ids": [[1, 2]], "completion_ids": [[3]],
                  "routed": PerTokenTensor([np.ones((2, 2), np.int64)], "int16", align="sequence", fill=-1)})
    with pytest.raises(BatchError, match="read it with the batch"):
        collate(store.read([0], ["completion_ids", "routed"]), 0, schema=store.schema)
    assert collate(store.read([0]), 0, schema=store.schema)["routed"].tolist() == [[[1, 1], [1, 1], [-1, -1]]]
    store.close()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_replay_loader_lays_out_the_column(tmp_path, layout):
    from diskreplay import RandomSampler, ReplayLoader
    store = ReplayStore(str(tmp_path))
    clens = [3, 1, 4, 2]
    rows = [np.full((c, 2, 3), i) for i, c in enumerate(clens)]
    store.extend({"prompt_id": [0, 0, 1, 1], "prompt_ids": [[1]] * 4, "completion_ids": [[5] * c for c in clens],
                  "routed": PerTokenTensor(rows, "uint16", fill=65535)})
    with ReplayLoader(store, RandomSampler(replacement=False, shuffle=False), batch_size=4,
                      pad_token_id=None if layout == "packed" else 0, layout=layout, num_batches=1) as loader:
        (batch,) = list(loader)
    got = batch["routed"].numpy()
    if layout == "padded":
        want = _expected_padded(rows, [1] * 4, clens, "completion", 65535, (2, 3), "uint16")
    else:
        want = _expected_packed(rows, [1] * 4, clens, "completion", 65535, (2, 3), "uint16")[None]
    np.testing.assert_array_equal(got, want)
    store.close()


def test_the_device_path_refuses_the_column_by_name(tmp_path):
    from diskreplay import RandomSampler, ReplayLoader
    store = ReplayStore(str(tmp_path))
    store.extend({"prompt_id": [0, 0], "completion_ids": [[5, 6], [7]],
                  "routed": PerTokenTensor([np.zeros((2, 2, 2), np.int64), np.ones((1, 2, 2), np.int64)], "uint8")})
    with ReplayLoader(store, RandomSampler(), batch_size=2, pad_token_id=0, pad_on_device=True,
                      num_batches=1) as loader:
        with pytest.raises(BatchError, match="'routed' is a per-token tensor column, which the device path"):
            list(loader)
    store.close()


def test_a_store_read_lays_out_without_the_schema(tmp_path):
    """``collate(store.read(rows))`` (no ``schema=``): the read's column carries its declaration."""
    import numpy as np
    from diskreplay import PerTokenTensor, ReplayStore, collate, collate_packed

    with ReplayStore(str(tmp_path / "s")) as st:
        ids = [np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32)]
        st.extend({"prompt_id": [0, 0], "completion_ids": ids,
                   "routed": PerTokenTensor([np.full((3, 4, 2), 1, np.uint8), np.full((2, 4, 2), 2, np.uint8)],
                                            dtype="uint8", align="completion", fill=255)})
        padded = collate(st.read([0, 1]), pad_token_id=0)["routed"]
        assert tuple(padded.shape) == (2, 3, 4, 2) and int(padded[1, 2, 0, 0]) == 255
        assert tuple(collate(st.read_ranges([0, 1]), pad_token_id=0)["routed"].shape) == (2, 3, 4, 2)
        assert tuple(collate_packed(st.read([1, 0]))["routed"].shape) == (1, 5, 4, 2)


def test_parquet_export_and_import_keep_the_declaration(tmp_path):
    """Parquet holds the column flat (large_list of its dtype) and its declaration in the export's
    metadata; import gives back the same column, shape and fill."""
    import numpy as np
    from diskreplay import PerTokenTensor, ReplayStore
    from diskreplay.export import export, import_rollouts

    src, out, back = str(tmp_path / "s"), str(tmp_path / "out.parquet"), str(tmp_path / "back")
    with ReplayStore(src) as st:
        ids = [np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32)]
        st.extend({"prompt_id": [0, 0], "completion_ids": ids,
                   "routed": PerTokenTensor([np.arange(24, dtype=np.uint8).reshape(3, 4, 2),
                                             np.full((2, 4, 2), 9, np.uint8)], dtype="uint8", align="completion",
                                            fill=255)})
        want = st.read([0, 1], ["routed"])["routed"]
        spec = st.schema["routed"]
    export(src, out)
    import_rollouts(out, back)
    with ReplayStore(back, readonly=True) as st:
        assert st.schema["routed"] == spec
        got = st.read([0, 1], ["routed"])["routed"]
        assert got.values.tolist() == want.values.tolist() and got.offsets.tolist() == want.offsets.tolist()
