"""Reads into reused buffers (``store.read(rows, out=...)``, ``Collator.read``) and the cold read
path (segments opened by a read, their pages hinted first) return exactly what plain reads do."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diskreplay import Collator, ReplayStore
from diskreplay.store.compaction import MergePolicy


def _store(path, commits=6, rows=12, seed=0):
    rng = np.random.default_rng(seed)
    store = ReplayStore(path, merge_policy=MergePolicy(max_bytes=1))
    for _ in range(commits):
        plen = rng.integers(1, 9, rows)
        store.extend({"prompt_id": rng.integers(0, 5, rows),
                      "prompt_ids": [rng.integers(0, 99, n).astype(np.int32) for n in plen],
                      "completion_ids": [rng.integers(0, 99, n).astype(np.int32) for n in plen + 2],
                      "old_per_token_logps": [rng.random(n).astype(np.float32) for n in plen + 2],
                      "rewards": rng.random(rows).astype(np.float32)})
    return store


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if hasattr(a[k], "offsets"):
            assert np.array_equal(a[k].values, b[k].values) and np.array_equal(a[k].offsets, b[k].offsets)
        else:
            assert np.array_equal(np.asarray(a[k]), np.asarray(b[k]))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 71), min_size=1, max_size=40), min_size=1, max_size=4))
def test_reads_into_reused_buffers_equal_fresh_reads(tmp_path_factory, draws):
    path = str(tmp_path_factory.mktemp("s"))
    writer = _store(path)
    buffers = {}
    collator = Collator(pad_token_id=0)
    with ReplayStore(path, readonly=True) as cold:  # every read below opens segments first
        for rows in draws:
            want = writer.read(rows)
            _equal(cold.read(rows, out=buffers), want)
            got = collator.read(cold, rows)
            ref = Collator(pad_token_id=0)(want)
            assert all(torch.equal(got[k], ref[k]) for k in ref if isinstance(ref[k], torch.Tensor))
    writer.close()


def test_a_reused_buffer_grows_and_earlier_results_are_documented_stale(tmp_path):
    store = _store(str(tmp_path / "s"))
    buffers = {}
    small = store.read([3, 1], out=buffers)
    grown = store.read(list(range(40, 0, -1)), out=buffers)
    assert buffers["completion_ids"].size >= grown["completion_ids"].values.size
    _equal(grown, store.read(list(range(40, 0, -1))))
    assert small["completion_ids"].values.size < grown["completion_ids"].values.size
    store.close()
