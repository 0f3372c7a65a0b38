"""schema: what extend accepts as token ids (issue 12 item 8: float or string ids were stored as such)."""

import numpy as np
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
