"""docs/FORMAT.md's "Reading a store" recipe, copied as written, gives the rows diskreplay gives:
``ReplayStore.read(store.row_ids())`` for ``table`` and ``row_ids``, and ``diskreplay export`` for
``exported``, on capped multi-writer stores of deltas, compacted ones, repaired ones with holes and
the store a resumed TRL run leaves (its recorded exclusions)."""

import os
import re
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diskreplay import ReplayStore, format as fmt
from diskreplay.export import export
from diskreplay.store import MergePolicy
from diskreplay.synthetic import make_rollouts
from diskreplay.verify import repair_store

from .conftest import flip_byte

DOC = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"


def recipe():
    """The python block of the "Reading a store" item of docs/FORMAT.md, as a user copies it."""
    text = DOC.read_text()
    item = text[text.index("* **Reading a store**"):]
    block = re.search(r"```python\n(.*?)```", item, flags=re.S).group(1)
    return textwrap.dedent(block)


def run_recipe(path):
    scope = {}
    exec(compile(recipe().replace("STORE/", f"{path}/"), "docs/FORMAT.md recipe", "exec"), scope)
    return scope


def _flat(column):
    return pa.concat_arrays([c.flatten() for c in column.chunks]).to_numpy()


def check_recipe(path, tmp_path):
    """The recipe's rows against the store's and the export's; the number of live and exported rows."""
    got = run_recipe(path)
    with ReplayStore(path, readonly=True) as store:
        ids = store.row_ids()
        want = store.read(ids, ["prompt_id", "completion_ids"])
    assert got["row_ids"].tolist() == ids.tolist()
    table = got["table"]
    assert table.column("prompt_id").to_pylist() == want["prompt_id"].tolist()
    assert np.array_equal(_flat(table.column("completion_ids")), want["completion_ids"].values)
    out = tmp_path / f"export-{len(os.listdir(tmp_path))}.parquet"
    export(path, str(out), columns=["prompt_id", "completion_ids"])
    exported, written = got["exported"], pq.read_table(out)
    assert exported.column("prompt_id").to_pylist() == written.column("prompt_id").to_pylist()
    assert np.array_equal(_flat(exported.column("completion_ids")), _flat(written.column("completion_ids")))
    return table.num_rows, exported.num_rows


def _batch(i, groups=1):
    return make_rollouts(groups, 8, seed=i, first_group=100 * i, completion_mean=20, prompt_mean=16)


def _end_on_deltas(store):
    """The store's writers commit deltas past a full manifest for long (each draws its own depth)."""
    store._committer._checkpoint_at = 2 * fmt.CHECKPOINT_EVERY - 1


def _chain_kinds(path, m):
    import json

    docs = [json.load(open(os.path.join(path, fmt.manifest_file(g))))
            for g in range(max(1, m.generation - m.depth), m.generation + 1)]
    return {"append" if "num_rows" in d else "rewrite" if "replaced" in d else "full" for d in docs}


@pytest.mark.parametrize("capacity", [{"capacity": 50}, {"capacity_bytes": 40_000}], ids=["rows", "bytes"])
def test_recipe_on_a_capped_multi_writer_store(tmp_path, capacity):
    """The issue's store: the recipe applied no capacity per delta and gave 82 rows for 50."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True, merge_policy=MergePolicy(max_bytes=1), **capacity) as a, \
            ReplayStore(path, merge_policy=MergePolicy(max_bytes=1)) as b:
        _end_on_deltas(a)
        _end_on_deltas(b)
        for i in range(12):
            (a if i % 2 else b).extend(_batch(i))
        m = a.manifest
        assert m.head > 0 and "append" in _chain_kinds(path, a.manifest)
    live, exported = check_recipe(path, tmp_path)
    assert live == exported == len(ReplayStore(path, readonly=True))


def test_recipe_on_a_compacted_store_with_merges(tmp_path):
    path = str(tmp_path / "s")
    policy = MergePolicy(fanin=3, ratio=2, capacity_share=1)
    with ReplayStore(path, multi_writer=True, capacity=120, merge_policy=policy) as store:
        _end_on_deltas(store)
        for i in range(40):
            store.extend(_batch(i))
            if i >= 16 and {"append", "rewrite"} <= _chain_kinds(path, store.manifest):
                break  # merges of small segments as rewrite deltas, on top of a full manifest, evicting
        else:
            raise AssertionError("no commit followed a full manifest with both kinds of delta")
        assert store.head > 0
        check_recipe(path, tmp_path)
        store.compact()
        for i in range(40, 44):
            store.extend(_batch(i))
    check_recipe(path, tmp_path)


@pytest.mark.parametrize("multi", [False, True], ids=["single", "multi"])
def test_recipe_on_a_repaired_store_with_a_hole(tmp_path, multi):
    path = str(tmp_path / "s")
    options = dict(multi_writer=True) if multi else {}
    with ReplayStore(path, capacity=60, merge_policy=MergePolicy(max_bytes=1), **options) as store:
        for i in range(3):
            store.extend(_batch(i, groups=2))
        bad = store.manifest.segments[1]
    flip_byte(path, bad.file, bad.bytes // 2)
    repair_store(path, force=multi)
    with ReplayStore(path, capacity=60, merge_policy=MergePolicy(max_bytes=1), **options) as store:
        if multi:
            _end_on_deltas(store)
        for i in range(3, 6):  # appends past the hole (deltas on a manifest with holes)
            store.extend(_batch(i))
        assert (store.head, store.holes) == (12, ((bad.first_row, bad.end_row),))
    assert check_recipe(path, tmp_path) == (4 + 16 + 24, 4 + 16 + 24)
    with ReplayStore(path, capacity=60, merge_policy=MergePolicy(max_bytes=1), **options) as store:
        store.extend(_batch(9))  # head 20 is in the hole: it moves past it
        assert (store.head, store.holes) == (32, ())
    check_recipe(path, tmp_path)


def test_recipe_on_the_store_a_resumed_trl_run_leaves(tmp_path):
    """``DiskReplayGRPOTrainer`` records the rows committed after the checkpoint it resumed from in
    the state ``trl.replay`` (``ReplayState.timeline``); exports leave them out (368 vs 320 rows)."""
    from diskreplay.integrations.trl.checkpoint import STATE_NAME, ReplayState
    from diskreplay.integrations.trl.planners import Timeline

    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=True) as store:
        _end_on_deltas(store)
        for i in range(6):
            store.extend(_batch(i))
        # a run resumed from a checkpoint taken at row 16: rows 16..47 belong to a discarded timeline
        state = ReplayState("repo", None, np.random.Generator(np.random.PCG64(0)), next_row=16, global_step=2,
                            store_path=path, timeline=Timeline().resumed(checkpoint_rows=16, store_rows=48))
        store.save_state(STATE_NAME, state.to_dict())  # as the trainer saves it
        for i in range(6, 9):
            store.extend(_batch(i))
        assert "append" in _chain_kinds(path, store.manifest)
    live, exported = check_recipe(path, tmp_path)
    assert (live, exported) == (72, 40)


def _check_patched(path):
    got = run_recipe(path)
    with ReplayStore(path, readonly=True) as store:
        ids = store.row_ids()
        want = store.read(ids, ["rewards", "judge_logps"])
    assert got["row_ids"].tolist() == ids.tolist()
    assert got["table"].column("rewards").to_pylist() == pytest.approx(want["rewards"].tolist())
    logps = got["table"].column("judge_logps").to_pylist()
    assert [r is not None for r in logps] == [want["judge_logps"][i] is not None for i in range(len(ids))]
    assert [r for r in logps if r is not None] == [want["judge_logps"][i].tolist() for i in range(len(ids))
                                                    if want["judge_logps"][i] is not None]


@pytest.mark.parametrize("multi", [False, True])
def test_recipe_on_a_store_with_patches(tmp_path, multi):
    """Values written for committed rows (docs/FORMAT.md, "Patches"): the recipe applies the patches
    as reads do (the newest wins, a folded one is in its segments), on deltas and after compact."""
    path = str(tmp_path / "s")
    with ReplayStore(path, multi_writer=multi, capacity=60) as store:
        for i in range(6):
            store.extend(_batch(i))
        store.update([20, 30, 41], {"rewards": [5.0, 6.0, 7.0]}, version="judge")
        lengths = store.read_ranges([30, 47], ["completion_ids"])["completion_ids"].lengths
        store.update([30, 47], {"rewards": [8.0, 9.0], "judge_logps": [np.full(n, -1.0, np.float32) for n in lengths]})
        for i in range(6, 9):
            store.extend(_batch(i))  # deltas on top, rows 0-11 evicted
    _check_patched(path)
    with ReplayStore(path, multi_writer=multi) as store:
        store.compact()
        store.update([70], {"rewards": [1.5]})
    _check_patched(path)
    check_recipe(path, tmp_path)
