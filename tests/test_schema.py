"""schema: what extend accepts as token ids (issue 12 item 8: float or string ids were stored as such)."""

import tempfile

import numpy as np
import pyarrow as pa
import pytest
import torch

from diskreplay import BatchError, ReplayStore


@pytest.mark.parametrize("ids", [
    [[1.0, 2.0], [3.0]],                                 # ragged floats
    torch.tensor([[1.0, 2.0], [3.0, 0.0]]),              # padded floats
    ["ab", "c"],                                         # one string per row
    np.array([4, 5]),                                    # one integer per row
])
@pytest.mark.parametrize("column", ["prompt_ids", "completion_ids"])
def test_token_ids_must_be_integer_sequences(tmp_path, column, ids):
    store = ReplayStore(tmp_path / "s")
    with pytest.raises(BatchError, match=column):
        store.extend({"prompt_id": [1, 1], column: ids})
    assert store.next_row == 0 and store.schema is None  # nothing written
    assert store.extend({"prompt_id": [1, 1], column: [[1, 2], [3]]}).tolist() == [0, 1]
    assert store.schema[column].dtype == "int32"


def test_empty_token_id_rows_are_integers(tmp_path):
    store = ReplayStore(tmp_path / "s")
    assert store.extend({"prompt_id": [1], "completion_ids": [[]]}).tolist() == [0]
    assert store.schema["completion_ids"].dtype == "int32"


def test_an_empty_row_beside_integer_rows_keeps_them_integers(tmp_path):
    store = ReplayStore(tmp_path / "s")
    store.extend({"prompt_id": [1, 1], "completion_ids": [[5, 6], []]})
    assert store.schema["completion_ids"].dtype == "int32"
    store.extend({"prompt_id": [2, 2], "completion_ids": [[], []]})
    assert store.read([0, 1, 2])["completion_ids"][0].tolist() == [5, 6]


def test_arrow_array_equals_pyarrow_for_every_kind_of_column():
    import pyarrow as pa
    from hypothesis import given, settings, strategies as st

    from diskreplay.ragged import arrow_array

    dtypes = [np.int32, np.int64, np.float32, np.float64, np.bool_, np.uint8]

    @settings(max_examples=60, deadline=None)
    @given(st.sampled_from(dtypes), st.lists(st.integers(0, 255), max_size=40), st.data())
    def check(dtype, values, data):
        arr = np.array(values, dtype=dtype)
        mask = np.array(data.draw(st.lists(st.booleans(), min_size=len(values), max_size=len(values))), dtype=bool)
        got = arrow_array(arr, mask=mask)
        want = pa.array(arr, mask=mask)
        assert got.type == want.type and got.equals(want)
        assert arrow_array(arr[::2]).equals(pa.array(arr[::2]))  # a strided view is copied

    check()
    strings = ["a", None, "", "ünïcode", "x" * 300]
    assert arrow_array(strings).equals(pa.array(strings, type=pa.large_string()))
    assert arrow_array(np.array(["a", "bc"])).to_pylist() == ["a", "bc"]


def test_writers_and_readers_never_import_pandas(tmp_path):
    """pyarrow.array imports pandas (about a second cold); appends of every column kind, sampling,
    collating and the loader do not."""
    import subprocess
    import sys

    code = f"""
import sys
import tempfile

import numpy as np
import pyarrow as pa
from diskreplay import ReplayStore
store = ReplayStore({str(tmp_path / 's')!r}, multi_writer=True)
batch = {{"prompt_id": np.array([1, 1, 2]), "completion_ids": [np.array([1, 2]), np.array([3]), np.array([4])],
          "rewards": np.array([0.5, 1.0, 0.0], dtype=np.float32), "ok": np.array([True, False, True]),
          "name": np.array(["a", "b", "c"], dtype=object), "per_func": np.ones((3, 2), dtype=np.float32)}}
store.extend(batch)
store.extend({{**batch, "late_score": np.array([np.nan, 1.0, 2.0])}})
store.extend({{**batch, "prompt_id": np.array([3, 3, 3])}})  # one group: no sidecar (inline)
store.save_state("sampler", {{"step": 3, "weights": np.ones(4, dtype=np.float32), "seen": np.zeros(2, dtype=bool)}})
assert store.load_state("sampler")["seen"].tolist() == [False, False]
store.close()
from diskreplay import Collator, PromptGroupSampler, ReplayLoader
reader = ReplayStore({str(tmp_path / 's')!r}, readonly=True)
rows = PromptGroupSampler(num_groups=2, seed=0, strategy="variance").sample(reader, 4)
Collator(0).read(reader, rows), Collator(layout="packed").read(reader, rows)
with ReplayLoader(reader, PromptGroupSampler(num_groups=2, seed=1), 4, 0, num_batches=2) as loader:
    batches = list(loader)
assert "pandas" not in sys.modules, "pandas was imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_mask_or_padded_per_token_column_without_its_ids_is_refused(tmp_path):
    """A typo in ``completion_ids`` must not store the mask as data (nor per-token padding as values):
    the error names the missing ids column, and the store is as before."""
    store = ReplayStore(str(tmp_path / "s"))
    store.extend({"prompt_id": [1, 1], "completion_ids": torch.ones(2, 3, dtype=torch.long),
                  "completion_mask": torch.ones(2, 3, dtype=torch.long)})
    typo = {"prompt_id": [2, 2], "completion_id": torch.ones(2, 3, dtype=torch.long),
            "completion_mask": torch.ones(2, 3, dtype=torch.long)}
    with pytest.raises(BatchError, match="'completion_mask' is the padding mask of 'completion_ids', which the "
                                         "batch lacks"):
        store.extend(typo)
    with pytest.raises(BatchError, match="'prompt_mask' is the padding mask of 'prompt_ids'"):
        store.extend({"prompt_id": [2, 2], "completion_ids": [[1], [2]], "prompt_mask": torch.ones(2, 3)})
    with pytest.raises(BatchError, match="'old_per_token_logps' is a padded per-token tensor .* no 'completion_ids'"):
        store.extend({"prompt_id": [2, 2], "old_per_token_logps": torch.zeros(2, 3)})
    fresh = ReplayStore(str(tmp_path / "fresh"))
    with pytest.raises(BatchError, match="padding mask of 'completion_ids'"):
        fresh.extend(typo)
    assert len(store) == 2 and len(fresh) == 0 and store.generation == 1
    # the ragged layout needs no ids to strip padding with: per-token lists alone are fine
    store.extend({"prompt_id": [3], "completion_ids": [[4, 5]], "old_per_token_logps": [[-0.5, -1.0]]})
    assert store.read([2], ["old_per_token_logps"])["old_per_token_logps"][0].tolist() == [-0.5, -1.0]


def test_a_negative_token_id_is_refused_naming_row_and_position(tmp_path):
    """-100 (a label's ignore index) or a padding value the mask kept would crash an embedding
    lookup far from the store: every input layout is refused, and nothing is written."""
    import pyarrow as pa

    store = ReplayStore(str(tmp_path / "s"))
    store.extend({"prompt_id": [1], "completion_ids": [[1, 2]]})
    bad = [({"prompt_id": [1, 1], "completion_ids": torch.tensor([[5, -100], [3, 4]]),
             "completion_mask": torch.ones(2, 2)}, "row 0 position 1 holds token id -100"),
           ({"prompt_id": [2], "completion_ids": [[0, 3, -1]]}, "row 0 position 2 holds token id -1"),
           ({"prompt_id": [2, 2], "prompt_ids": [[7], [-3, 7]], "completion_ids": [[1], [2]]},
            "'prompt_ids' row 1 position 0 holds token id -3"),
           (pa.table({"prompt_id": pa.array([3, 3], pa.int64()),
                      "completion_ids": pa.array([[4], [5, -7]], pa.large_list(pa.int32()))}),
            "row 1 position 1 holds token id -7")]
    for batch, message in bad:
        with pytest.raises(BatchError, match=message):
            store.extend(batch)
    assert len(store) == 1 and store.generation == 1
    # a masked-out -100 is padding: stripped, never stored
    store.extend({"prompt_id": [1], "completion_ids": torch.tensor([[5, -100]]),
                  "completion_mask": torch.tensor([[1, 0]])})
    assert store.read([1], ["completion_ids"])["completion_ids"][0].tolist() == [5]


def test_a_stored_vector_column_stays_a_vector_when_the_completions_are_as_wide():
    # a per-row vector of width 3 beside completions padded to 3 is not per-token once the store says so
    import torch
    from diskreplay import ReplayStore

    def batch(width):
        ids = torch.ones(2, width, dtype=torch.long)
        mask = torch.ones(2, width, dtype=torch.long)
        mask[1, 1:] = 0
        return {"prompt_id": torch.tensor([0, 0]), "completion_ids": ids, "completion_mask": mask,
                "judge_scores": torch.tensor([[.1, .2, .3], [.4, .5, .6]])}

    with tempfile.TemporaryDirectory() as d:
        store = ReplayStore(d)
        store.extend(batch(5))
        assert store.schema["judge_scores"].kind == "vector"
        assert store.extend(batch(3)).tolist() == [2, 3]
        np.testing.assert_array_equal(store.read([3])["judge_scores"], np.float32([[.4, .5, .6]]))
        store.close()
    with tempfile.TemporaryDirectory() as d:  # a first batch settles it with an Arrow fixed_size_list
        store = ReplayStore(d)
        scores = pa.FixedSizeListArray.from_arrays(pa.array([.1, .2, .3, .4, .5, .6], pa.float32()), 3)
        store.extend(pa.table({"prompt_id": [0, 0], "completion_ids": [[1, 2, 3], [1]], "judge_scores": scores}))
        store.extend(batch(3))
        np.testing.assert_array_equal(store.read([3])["judge_scores"], np.float32([[.4, .5, .6]]))
        store.close()


@pytest.mark.parametrize("column, values, message", [
    ("prompt_id", np.array([1, 2**64 - 1], np.uint64), "row 1 holds 18446744073709551615, which int64"),
    ("policy_version", np.array([0, 2**63], np.uint64), "row 1 holds 9223372036854775808, which int64"),
    ("rewards", np.array([0.5, 1e39]), r"row 1 holds 1e\+39, which float32"),
    ("per_func", np.array([[0.0, 1.0], [2.0, -1e39]]), r"row 1 holds -1e\+39, which float32"),
    ("old_per_token_logps", [np.array([-0.5]), np.array([-1e39])], r"row 1 position 0 holds -1e\+39, which float32"),
])
def test_values_the_stored_type_cannot_hold_are_refused_not_wrapped(tmp_path, column, values, message):
    # a uint64 prompt hash became a negative key (then `groups=[hash]` found nothing); 1e39 became inf
    first = {"prompt_id": [0, 0], "completion_ids": [[1], [2]], "policy_version": [0, 0],
             "rewards": np.float32([0, 1]), "per_func": np.float32([[0, 1], [1, 0]]),
             "old_per_token_logps": [np.float32([-0.5]), np.float32([-0.25])]}
    with ReplayStore(str(tmp_path / "s")) as store:
        store.extend(first)
        with pytest.raises(BatchError, match=message):
            store.extend({**first, column: values})
        assert len(store) == 2
        store.extend({**first, "rewards": np.array([np.inf, np.nan]), "policy_version": np.uint64([1, 2**63 - 1])})
        assert store.read([3])["policy_version"].tolist() == [2**63 - 1]


def test_an_arrow_fixed_size_list_is_a_vector_whatever_its_name_or_shape(tmp_path):
    """A fixed-size list states a per-row vector (extend's docstring says so), yet a name containing
    "token"/"logp" or the shape of the completions made it a per-token column (refused without ids, or
    stripped with their mask). A plain 2-D array keeps TRL's rules (a name says per-token)."""
    def fsl(values, width):
        return pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(values).reshape(-1)), width)

    store = ReplayStore(str(tmp_path / "s"))
    ids = torch.ones(2, 3, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    store.extend({"prompt_id": [0, 0], "my_token_count": fsl(np.arange(16), 8),
                  "completion_ids": ids, "completion_mask": mask, "logp_stats": fsl([.1, .2, .3, .4, .5, .6], 3)})
    assert store.schema["my_token_count"].kind == "vector" and store.schema["logp_stats"].kind == "vector"
    np.testing.assert_array_equal(store.read([1])["logp_stats"], np.float64([[.4, .5, .6]]))
    with pytest.raises(BatchError, match="'x_token' is a padded per-token tensor"):
        ReplayStore(str(tmp_path / "t")).extend({"prompt_id": [0, 0], "x_token": np.zeros((2, 8))})


@pytest.mark.parametrize("column, values, message", [
    ("rewards", ["high", "low"], "'rewards' holds strings but the store holds float32"),
    ("policy_version", [0.5, 1.5], "'policy_version' holds float64 but the store holds integers"),
    ("done", [1, 0], "'done' holds int64 but the store holds bools"),
    ("source", [1, 2], "'source' holds int64 but the store holds strings"),
    ("rewards", [[1.0], [2.0]], "'rewards' is a ragged column in this batch but a scalar column"),
    ("step", [1, 2], "'step' is not in the store's schema .* cannot be added after the first commit"),
])
def test_a_column_the_schema_refuses_is_a_batch_error_and_changes_nothing(tmp_path, column, values, message):
    """docs/batches.md: a bad batch raises BatchError. A wrong-typed column raised SchemaError, not a
    BatchError; it is both now (``except SchemaError`` keeps working)."""
    from diskreplay import SchemaError

    first = {"prompt_id": [0, 0], "completion_ids": [[1], [2]], "policy_version": [0, 0],
             "rewards": np.float32([0, 1]), "done": [True, False], "source": ["a", "b"]}
    with ReplayStore(str(tmp_path / "s")) as store:
        store.extend(first)
        files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        with pytest.raises(BatchError, match=message) as info:
            store.extend({**first, column: values})
        assert isinstance(info.value, SchemaError)
        assert len(store) == 2 and sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == files
        store.extend(first)
        assert len(store) == 4
