"""``extend`` takes pyarrow tables, record batches and mappings of pyarrow arrays (datasets, Parquet,
Lance and Delta readers give those): the same rows as the ragged layout, the same errors."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diskreplay import BatchError, ReplayStore
from diskreplay.ingest import normalize_batch

from .conftest import assert_rows_equal
from .test_store import ragged_batches

RAGGED = ("prompt_ids", "completion_ids", "old_per_token_logps")


def _arrow_rows(rows, value_type, large):
    list_type = pa.large_list(value_type) if large else pa.list_(value_type)
    return pa.array([None if r is None else r.tolist() for r in rows], type=list_type)


def as_table(batch, large=True, chunks=1, pad=0):
    """``batch`` (ragged layout) as a pyarrow table: ids as int64 lists, ``chunks`` chunks per
    column, each column a slice of a longer one when ``pad`` (so offsets do not start at 0)."""
    types = {"prompt_ids": pa.int64(), "completion_ids": pa.int64(), "old_per_token_logps": pa.float32()}
    cols = {}
    for k, v in batch.items():
        if k in types:
            arr = _arrow_rows([np.zeros(2)] * pad + list(v), types[k], large).slice(pad)
        else:
            arr = pa.array(list(v))
        if chunks > 1 and len(arr) > 1:
            cut = len(arr) // 2
            arr = pa.chunked_array([arr.slice(0, cut), arr.slice(cut)])
        cols[k] = arr
    return pa.table(cols)


@settings(max_examples=60, deadline=None)
@given(batch=ragged_batches(), large=st.booleans(), chunks=st.sampled_from([1, 2]), pad=st.integers(0, 2))
def test_a_table_normalizes_to_the_record_batch_of_its_ragged_layout(batch, large, chunks, pad):
    want, want_schema = normalize_batch(batch, None, "prompt_id")
    got, got_schema = normalize_batch(as_table(batch, large, chunks, pad), None, "prompt_id")
    assert got_schema == want_schema
    assert got.equals(want)


def as_stored(batch, schema):
    """``batch`` as a pyarrow table of exactly the store's column types (what the store's own
    exports and Arrow-native producers give): taken as it is, its buffers not converted."""
    cols = {}
    for k, v in batch.items():
        t = schema[k].arrow_type
        cols[k] = pa.array([None if r is None else r.tolist() for r in v], type=t) if isinstance(v, list) and \
            schema[k].kind == "ragged" else pa.array(list(v), type=t)
    return pa.table(cols)


@settings(max_examples=60, deadline=None)
@given(first=ragged_batches(), batch=ragged_batches())
def test_a_table_of_the_stores_types_is_stored_as_the_general_path_stores_it(first, batch):
    """With the schema known, a table of its exact types is taken as it is when nothing needs
    converting (and by the general path otherwise): the same record batch, the same file bytes
    (so the same exactly-once digest) as the ragged layout gives."""
    from diskreplay.ingest import _arrow_columns
    from diskreplay.segment import encode_ipc

    if type(first["prompt_id"][0]) is not type(batch["prompt_id"][0]):
        batch = first
    _, schema = normalize_batch(first, None, "prompt_id")
    table = as_stored(batch, schema)
    want, _ = normalize_batch(batch, schema, "prompt_id")
    got, got_schema = normalize_batch(table, schema, "prompt_id")
    assert got_schema == schema and got.equals(want)
    assert encode_ipc(got).equals(encode_ipc(want))
    nulls = any(r is None for r in batch["old_per_token_logps"])
    assert (_arrow_columns(table, schema) is None) == nulls  # nulls: the general path
    # a slice of a longer table holds longer buffers: the file is the same all the same
    longer = pa.concat_tables([table, table])
    assert encode_ipc(normalize_batch(longer.slice(0, table.num_rows), schema, "prompt_id")[0]).equals(
        encode_ipc(want))


def test_the_fast_path_leaves_every_problem_to_the_general_path():
    _, schema = normalize_batch({"prompt_id": [1], "completion_ids": [np.array([1], np.int32)],
                                 "old_per_token_logps": [np.array([-1.0], np.float32)],
                                 "rewards": np.array([1.0], np.float32)}, None, "prompt_id")
    ids = pa.array([[1, 2], [3]], pa.large_list(pa.int32()))
    good = {"prompt_id": pa.array([1, 1]), "completion_ids": ids,
            "old_per_token_logps": pa.array([[-1.0, -2.0], [-3.0]], pa.large_list(pa.float32())),
            "rewards": pa.array([1.0, 0.0], pa.float32())}
    normalize_batch(pa.table(good), schema, "prompt_id")
    for change, message in [
        ({"old_per_token_logps": pa.array([[-1.0, float("nan")], [-3.0]], pa.large_list(pa.float32()))},
         r"'old_per_token_logps' row 0 position 1 is NaN"),
        ({"old_per_token_logps": pa.array([[-1.0], [-3.0, -4.0]], pa.large_list(pa.float32()))},
         r"'old_per_token_logps' row 0 has 1 values but 'completion_ids' has 2"),
        ({"rewards": pa.array([1.0, None], pa.float32())}, None),  # a null float: NaN, as in a dict
        ({"prompt_id": None}, r"no group key column 'prompt_id'"),
    ]:
        batch = {k: v for k, v in {**good, **change}.items() if v is not None}
        if message is None:
            record, _ = normalize_batch(pa.table(batch), schema, "prompt_id")
            assert np.isnan(record.column("rewards").to_pylist()[1])
            continue
        with pytest.raises(BatchError, match=message):
            normalize_batch(pa.table(batch), schema, "prompt_id")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=ragged_batches())
def test_a_table_appends_the_rows_a_dict_does(tmp_path_factory, batch):
    path = tmp_path_factory.mktemp("s")
    with ReplayStore(path) as store:
        first = store.extend(batch)
        second = store.extend(as_table(batch).to_batches()[0] if len(batch["prompt_id"]) else batch)
        a, b = store.read(first), store.read(second)
        assert_rows_equal(b, {k: _rows(a[k]) for k in RAGGED})
        assert list(a["prompt_id"]) == list(b["prompt_id"])


def _rows(col):
    return [None] * len(col) if col is None else [col[i] for i in range(len(col))]


def test_a_mapping_of_arrow_arrays_and_a_resent_table_count_once(tmp_path):
    ids = pa.array([[1, 2], [3]], pa.list_(pa.int32()))
    batch = {"prompt_id": pa.array(["a", "a"]).dictionary_encode(), "completion_ids": ids,
             "rewards": pa.array([1.0, 0.0], pa.float16()), "ref_per_token_logps": pa.nulls(2, pa.list_(pa.float32()))}
    with ReplayStore(str(tmp_path / "s"), multi_writer=True) as store:
        assert store.extend(batch, token="w:0").tolist() == [0, 1]
        assert store.extend(pa.table(batch), token="w:0").tolist() == [0, 1]  # the same rows: not again
        assert len(store) == 2 and "ref_per_token_logps" not in store.schema.names  # all null: not computed
        got = store.read([0, 1])
        assert [r.tolist() for r in got["completion_ids"]] == [[1, 2], [3]]
        assert store.group_rows("a").tolist() == [0, 1]


@pytest.mark.parametrize("column, value, message", [
    ("completion_ids", pa.array([[1, None], [3]], pa.list_(pa.int64())), r"'completion_ids' row 0 position 1 is null"),
    ("rewards", pa.array([1, None], pa.int64()), r"'rewards' row 1 is null"),
    ("prompt_id", pa.array([1, None]), r"'prompt_id' row 1 is null"),
    ("when", pa.array([1, 2], pa.timestamp("s")), r"'when' has Arrow type timestamp\[s\]"),
    ("completion_ids", pa.array([["a"], ["b"]]), r"'completion_ids' holds Arrow string values"),
    ("scores", pa.array([[1.0, 2.0], None], pa.list_(pa.float32(), 2)), r"'scores' row 1 is null"),
])
def test_bad_arrow_columns_are_refused_naming_the_column_and_row(tmp_path, column, value, message):
    batch = {"prompt_id": pa.array([1, 1]), "completion_ids": pa.array([[1, 2], [3]]), "rewards": pa.array([1.0, 0.0])}
    batch[column] = value
    path = str(tmp_path / "s")
    with ReplayStore(path) as store:
        with pytest.raises(BatchError, match=message):
            store.extend(pa.table(batch))
        assert len(store) == 0


def test_null_rows_of_a_list_column_are_not_computed_whatever_values_they_span():
    # Arrow lets a null list slot span values; they are not the row's, so they are dropped
    values = pa.array([1.0, 2.0, 9.0, 9.0, 3.0], pa.float32())
    arr = pa.LargeListArray.from_arrays(pa.array([0, 2, 4, 5], pa.int64()), values,
                                        mask=pa.array([False, True, False]))
    batch = {"prompt_id": pa.array([1, 1, 1]), "completion_ids": pa.array([[5, 6], [7, 8], [9]]),
             "old_per_token_logps": arr}
    record, _ = normalize_batch(batch, None, "prompt_id")
    assert record.column("old_per_token_logps").to_pylist() == [[1.0, 2.0], None, [3.0]]


def test_a_resent_slice_of_a_longer_table_counts_once(tmp_path):
    """Found in review: a table sliced from a longer one keeps its longer buffers; stored as they
    were, the file (and so the exactly-once digest) differed and the resend was refused."""
    full = pa.table({"prompt_id": pa.array([1, 2, 3, 4, 5, 6], pa.int64()),
                     "rewards": pa.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], pa.float32())})
    with ReplayStore(str(tmp_path / "s")) as store:
        store.extend({"prompt_id": [0], "rewards": np.array([0.0], np.float32)})
        first = store.extend(pa.table({"prompt_id": pa.array([1, 2], pa.int64()),
                                       "rewards": pa.array([1.0, 2.0], pa.float32())}), token="w:1")
        assert store.extend(full.slice(0, 2), token="w:1").tolist() == first.tolist() == [1, 2]


@pytest.mark.parametrize("make, message", [
    (lambda: pa.record_batch({"x": pa.array([1, 2, 3])}).select([]), "the batch is empty"),
    (lambda: pa.table([pa.array([1, 1]), pa.array([2, 2])], names=["prompt_id", "prompt_id"]),
     "'prompt_id' appears twice"),
    (lambda: pa.table({"prompt_id": pa.array([1, 1]), "completion_ids": pa.array([[1], [2]]),
                       "name": pa.Array.from_buffers(pa.large_string(), 2, [None, pa.py_buffer(
                           np.array([0, 1, 2], np.int64)), pa.py_buffer(b"\xff\xfe")])}), "'name' holds a string that is not UTF-8"),
])
def test_malformed_tables_are_refused_like_any_batch(tmp_path, make, message):
    with ReplayStore(str(tmp_path / "s"), group_key=None) as store:
        store.extend({"prompt_id": [0], "completion_ids": [[1]], "name": ["a"]})
        with pytest.raises(BatchError, match=message):
            store.extend(make())
        assert len(store) == 1


def test_a_half_precision_column_is_float32_with_or_without_nulls():
    for values in ([1.0, 2.0], [1.0, None]):
        batch = {"prompt_id": pa.array([1, 1]), "score": pa.array(values, pa.float16())}
        _, schema = normalize_batch(batch, None, "prompt_id")
        assert schema["score"].dtype == "float32"


def test_a_table_of_exactly_the_stores_columns_is_stored_as_it_is():
    """The common case (a rollout worker's table of the store's columns and types) is stored from
    its own arrays, and gives the bytes the general path gives; anything that needs looking at
    (a slice with longer buffers, a validity bitmap, a NaN log-prob) goes the general way."""
    from diskreplay.ingest import _arrow_record
    from diskreplay.segment import encode_ipc

    rows = {"prompt_id": np.array([4, 4, 4]), "completion_ids": [np.arange(k, dtype=np.int32) for k in (2, 0, 3)],
            "old_per_token_logps": [np.full(k, -0.5, np.float32) for k in (2, 0, 3)],
            "rewards": np.array([1.0, 0.0, 0.5], np.float32)}
    _, schema = normalize_batch(rows, None, "prompt_id")
    table = pa.table({"prompt_id": pa.array(rows["prompt_id"]),
                      "completion_ids": pa.array([r.tolist() for r in rows["completion_ids"]],
                                                 pa.large_list(pa.int32())),
                      "old_per_token_logps": pa.array([r.tolist() for r in rows["old_per_token_logps"]],
                                                      pa.large_list(pa.float32())),
                      "rewards": pa.array(rows["rewards"])})
    record = _arrow_record(table, schema)
    assert record is not None and record.column(1).buffers()[3].address == table.column(1).chunk(0).buffers()[3].address
    want = encode_ipc(normalize_batch(rows, schema, "prompt_id")[0])
    assert encode_ipc(normalize_batch(table, schema, "prompt_id")[0]).equals(want)
    masked = table.set_column(3, "rewards", pa.array([1.0, 0.0, 0.5], pa.float32(), mask=np.zeros(3, bool)))
    nan = table.set_column(2, "old_per_token_logps", pa.array([[-0.5, float("nan")], [], [-0.5] * 3],
                                                              pa.large_list(pa.float32())))
    longer = pa.concat_tables([table, table]).combine_chunks().slice(0, 3)
    # a table whose schema is the stored one is stored as it is; one that carries metadata (a
    # pandas round trip's) or other field flags is rebuilt on the stored schema: the same file
    assert table.schema.equals(schema.arrow_schema(), check_metadata=True)
    assert _arrow_record(table, schema).schema.equals(table.schema, check_metadata=True)
    tagged = table.replace_schema_metadata({b"pandas": b"{}"})
    flagged = pa.table(table.columns, schema=pa.schema([f.with_nullable(False) for f in table.schema]))
    for other in (tagged, flagged):
        assert _arrow_record(other, schema).schema.equals(schema.arrow_schema(), check_metadata=True)
    for other in (masked, longer, tagged, flagged):  # whichever way it goes, the same file
        assert encode_ipc(normalize_batch(other, schema, "prompt_id")[0]).equals(want)
    assert _arrow_record(longer, schema) is None and _arrow_record(nan, schema) is None
    assert _arrow_record(table.select([0, 1, 3]), schema) is None  # a list column left out: nulls to add
    with pytest.raises(BatchError, match="row 0 position 1 is NaN"):
        normalize_batch(nan, schema, "prompt_id")
