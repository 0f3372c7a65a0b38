"""Exactly-once tokens of rows that repair dropped (a hole): the batch is appended again when re-sent,
whether its record rode in the manifest (repair forgets it) or was sealed in a token log (a lookup that
finds it intersecting a hole treats it as not found). docs/FORMAT.md, "Exactly-once tokens"."""

import numpy as np

from diskreplay import ReplayStore
from diskreplay.store import MergePolicy
from diskreplay.store import tokens as tok
from diskreplay.synthetic import make_rollouts
from diskreplay.verify import repair_store, verify_store

from .conftest import flip_byte


def _batch(i):
    return make_rollouts(1, 8, seed=i, first_group=10 * i, completion_mean=300)


def test_a_resent_batch_whose_rows_repair_dropped_is_appended_again(tmp_path, monkeypatch):
    monkeypatch.setattr(tok, "INLINE_TOKENS", 2)  # the records of the first commits are sealed into logs
    path = str(tmp_path / "s")
    with ReplayStore(path, merge_policy=MergePolicy(max_bytes=1)) as store:
        for i in range(8):
            store.extend(_batch(i), token=f"step-{i}")
        m = store.manifest
        assert m.token_logs and not any(r.token == "step-1" for r in m.tokens)  # step-1's record is sealed
        assert "step-7" in {r.token for r in m.tokens}  # (the newest ones stay inline)
        bad = {s.first_row: s for s in m.segments}[8]  # step-1's rows
        last = {s.first_row: s for s in m.segments}[56]  # step-7's rows, its record inline
    flip_byte(path, bad.file, bad.bytes // 2)
    flip_byte(path, last.file, last.bytes // 2)
    repair_store(path)
    assert verify_store(path)["ok"]
    with ReplayStore(path, readonly=True) as reader:
        assert reader.holes == ((8, 16), (56, 64))
        assert reader.committed_rows("step-1") is None  # its rows are gone: not committed any more
        assert reader.committed_rows("step-0").tolist() == list(range(8))
    with ReplayStore(path, merge_policy=MergePolicy(max_bytes=1)) as store:
        assert store.committed_rows("step-1") is None and store.committed_rows("step-7") is None
        assert store.extend(_batch(0), token="step-0").tolist() == list(range(8))  # intact: a duplicate
        assert store.extend(_batch(2), token="step-2").tolist() == list(range(16, 24))
        n = len(store)
        again = store.extend(_batch(1), token="step-1")  # lost to the damage: appended again
        assert again.tolist() == list(range(64, 72)) and len(store) == n + 8
        assert store.extend(_batch(7), token="step-7").tolist() == list(range(72, 80))
        assert store.extend(_batch(1), token="step-1").tolist() == again.tolist()  # now a duplicate again
        assert store.committed_rows("step-1").tolist() == again.tolist()
        for i in range(8, 14):  # the new record is sealed in turn: it still wins over the old one
            store.extend(_batch(i), token=f"step-{i}")
        assert store.extend(_batch(1), token="step-1").tolist() == again.tolist()
        np.testing.assert_array_equal(store.read(again)["prompt_id"], _batch(1)["prompt_id"])
    with ReplayStore(path, readonly=True) as reader:
        assert reader.committed_rows("step-1").tolist() == again.tolist()
