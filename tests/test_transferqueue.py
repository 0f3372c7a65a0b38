"""TransferQueue's key-value client on a store: values round-trip without pickle, clear and reuse, exactly once.

TransferQueue's own tests run against the backend in tests/transferqueue_upstream/; the kill test is
tests/test_transferqueue_kill.py.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transfer_queue", reason="TransferQueue is not installed: pip install 'diskreplay[transferqueue]'")

from diskreplay import ReplayStore  # noqa: E402
from diskreplay.errors import ArgumentError, BatchError, IndexOutOfRangeError, RowsEvictedError  # noqa: E402
from diskreplay.integrations.transferqueue import (BACKEND, CLIENT, DiskReplayStorageClient,  # noqa: E402
                                                   DiskReplayStorageManager, FieldTable)


def _values():
    return {
        "0@ids": torch.tensor([5, 6, 7, 8, 9]),
        "1@ids": torch.tensor([1]),
        "0@logp": torch.randn(5, dtype=torch.float32),
        "0@bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "0@mask": torch.tensor([True, False, True]),
        "0@odd": torch.arange(7, dtype=torch.uint8),  # 7 bytes: the word padding is cut off on read
        "0@scalar": torch.tensor(3.5, dtype=torch.float64),
        "0@empty": torch.zeros(0, 4, dtype=torch.int16),
        "0@np": np.arange(6, dtype=np.int32).reshape(3, 2),
        "0@npscalar": np.float32(0.25),
        "0@uid": "prompt-7",
        "0@meta": {"source": "gsm8k", "turns": [1, 2], "score": None, "ok": True, "r": 0.5},
        "0@none": None,
    }


def _equal(a, b):
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(b, (np.ndarray, np.generic)):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def test_every_kind_of_value_round_trips_and_survives_a_reopen(tmp_path):
    values = _values()
    client = DiskReplayStorageClient({"path": str(tmp_path / "tq")})
    assert client.put(list(values), list(values.values())) is None
    got = client.get(list(values))
    assert all(_equal(g, v) for g, v in zip(got, values.values())), got
    client.close()
    again = DiskReplayStorageClient({"path": str(tmp_path / "tq")})
    got = again.get(list(reversed(values)))
    assert all(_equal(g, v) for g, v in zip(got, reversed(list(values.values()))))
    again.close()


@pytest.mark.parametrize("bad", [(1, 2), object(), np.array(["a", None], dtype=object), {1: "int key"}, [1, ("t",)]])
def test_a_value_that_needs_pickle_is_refused_naming_its_key_and_nothing_is_written(tmp_path, bad):
    table = FieldTable(tmp_path / "tq")
    table.put(["0@ok"], [torch.tensor([1])])
    rows = table.store.next_row
    with pytest.raises(BatchError, match="'3@extra'") as info:
        table.put(["3@good", "3@extra"], [torch.tensor([2]), bad])
    assert "pickle" in str(info.value)
    assert table.store.next_row == rows and not table.contains("3@good")
    table.close()


def test_clear_then_reuse_of_an_index_is_a_new_generation_and_a_cleared_key_is_gone(tmp_path):
    table = FieldTable(tmp_path / "tq")
    table.put(["4@ids", "4@uid"], [torch.tensor([1, 2]), "a"])
    table.clear(["4@ids", "4@uid", "99@never"])
    assert not table.contains("4@ids") and table.generation("4@ids") == 1
    with pytest.raises(IndexOutOfRangeError, match="'4@ids'"):
        table.get(["4@ids"])
    # TransferQueue hands index 4 to a new sample: the same value again is a new row, not a duplicate
    table.put(["4@ids"], [torch.tensor([1, 2])])
    assert table.get(["4@ids"])[0].tolist() == [1, 2] and table.generation("4@ids") == 1
    table.close()
    reopened = FieldTable(tmp_path / "tq")
    assert reopened.keys() == ["4@ids"] and reopened.generation("4@ids") == 1
    assert reopened.store.next_row == 5  # 2 puts + 2 clears + 1 put; the never-put key wrote nothing
    reopened.close()


def test_a_put_sent_again_writes_nothing_and_a_value_put_back_after_another_is_written(tmp_path):
    table = FieldTable(tmp_path / "tq")
    keys = ["0@ids", "1@ids"]
    table.put(keys, [torch.tensor([1]), torch.tensor([2])])
    rows = table.store.next_row
    table.put(keys, [torch.tensor([1]), torch.tensor([2])])  # a retry, this process
    other = FieldTable(tmp_path / "tq")  # a retry from a restarted process
    other.put(keys, [torch.tensor([1]), torch.tensor([2])])
    assert table.store.next_row == rows == other.store.next_row
    # A, B, A: the last put must win, although its value was committed once before
    table.put(["0@ids"], [torch.tensor([7])])
    table.put(["0@ids"], [torch.tensor([1])])
    assert other.get(["0@ids"])[0].tolist() == [1]
    assert table.store.next_row == rows + 2
    table.close(), other.close()


def test_writers_see_each_others_puts_and_clears(tmp_path):
    a, b = FieldTable(tmp_path / "tq"), FieldTable(tmp_path / "tq")
    a.put(["0@prompt"], [torch.tensor([1, 2, 3])])
    b.put(["0@response"], [torch.tensor([4])])  # another stage adds a field of the same sample
    assert [v.tolist() for v in a.get(["0@prompt", "0@response"])] == [[1, 2, 3], [4]]
    b.clear(["0@prompt", "0@response"])
    assert a.keys() == []
    a.close(), b.close()


def test_get_checks_the_dtype_and_shape_transferqueue_expects(tmp_path):
    table = FieldTable(tmp_path / "tq")
    table.put(["0@ids"], [torch.tensor([1, 2])])
    assert table.get(["0@ids"], shapes=[torch.Size([2])], dtypes=[torch.int64])[0].tolist() == [1, 2]
    table.put(["0@reward"], [torch.tensor(0.5)])  # a sample of a [B] field: TransferQueue says (1,), stored ()
    assert table.get(["0@reward"], shapes=[torch.Size([1])], dtypes=[torch.float32])[0].item() == 0.5
    with pytest.raises(BatchError, match="'0@ids' holds a torch.int64 tensor but torch.float32"):
        table.get(["0@ids"], dtypes=[torch.float32])
    with pytest.raises(BatchError, match=r"shape \(2,\) but \(3,\)"):
        table.get(["0@ids"], shapes=[torch.Size([3])])
    with pytest.raises(ArgumentError, match="one entry per key"):
        table.get(["0@ids"], shapes=[None, None])
    table.close()


def test_a_value_evicted_by_the_capacity_is_an_error_naming_it(tmp_path):
    table = FieldTable(tmp_path / "tq", capacity=3)
    for i in range(5):
        table.put([f"{i}@ids"], [torch.tensor([i])])
    assert table.get(["4@ids"])[0].tolist() == [4]
    with pytest.raises(RowsEvictedError, match="'0@ids'.*capacity of 3 rows"):
        table.get(["0@ids", "4@ids"])
    table.close()


def test_the_backend_is_registered_under_its_names_and_needs_a_path(tmp_path):
    from transfer_queue.storage.clients.base import StorageClientFactory
    from transfer_queue.storage.managers.base import StorageManagerFactory
    assert StorageManagerFactory._registry[BACKEND] is DiskReplayStorageManager
    client = StorageClientFactory.create(CLIENT, {"path": str(tmp_path / "tq")})
    assert isinstance(client, DiskReplayStorageClient)
    client.close()
    with pytest.raises(ArgumentError, match=r"backend\.DiskReplay\.path"):
        DiskReplayStorageClient({})
    # the store is an ordinary store: any diskreplay tool reads it
    with ReplayStore(tmp_path / "tq", readonly=True) as store:
        assert len(store) == 0


def test_restore_brings_every_value_back_to_its_mark_by_appending(tmp_path):
    table = FieldTable(tmp_path / "tq")
    table.put(["0@x", "1@x", "2@x"], [torch.tensor([1]), torch.tensor([2]), "kept"])
    mark = table.mark()
    table.put(["0@x"], [torch.tensor([9])])  # overwritten after the checkpoint
    table.clear(["1@x"])                      # cleared after it
    table.put(["3@x"], [torch.tensor([3])])   # new after it
    other = FieldTable(tmp_path / "tq")       # another process's view follows
    assert table.restore(mark) == 3
    assert [v.tolist() for v in other.get(["0@x", "1@x"])] == [[1], [2]] and other.get(["2@x"]) == ["kept"]
    assert not other.contains("3@x")
    rows = table.store.next_row
    assert table.restore(mark) == 0 and table.store.next_row == rows  # again (a resume that crashed): nothing
    with pytest.raises(ArgumentError, match="past the newest row"):
        table.restore(rows + 1)
    table.close(), other.close()


def test_a_storage_checkpoint_is_a_row_number_and_loads_back(tmp_path):
    import asyncio
    import json

    table = FieldTable(tmp_path / "tq")
    manager = DiskReplayStorageManager.__new__(DiskReplayStorageManager)  # no controller: the two methods only
    manager.storage_client = type("C", (), {"table": table, "close": lambda self: None})()
    table.put(["0@x"], [torch.tensor([1])])
    asyncio.run(manager.save_checkpoint(str(tmp_path / "ckpt")))
    saved = json.loads((tmp_path / "ckpt" / "diskreplay_storage.json").read_text())
    assert saved["mark"] == 1 and saved["version"] == 1
    table.put(["0@x"], [torch.tensor([2])])
    asyncio.run(manager.load_checkpoint(str(tmp_path / "ckpt")))
    assert table.get(["0@x"])[0].tolist() == [1]
    table.close()


def test_the_doc_blocks_run():
    """docs/transferqueue.md's ```python blocks run as written (```python no-run ones need a Ray cluster)."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parent.parent / "docs" / "transferqueue.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/transferqueue.md python block {i}", "exec"), {})
