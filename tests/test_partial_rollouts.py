"""Partial rollouts and multi-turn masks: a per-token policy version (null for rows generated under
one policy) and a per-token loss mask inside the completion (0 for tool or environment tokens)
are stored, validated, and come back bit-exact through every batch layout and every export."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from diskreplay import BatchError, Collator, ReplayStore, collate, collate_packed
from diskreplay.export import export, import_rollouts

FORMATS = ["parquet", "jsonl", "hf", "zarr"]


def _rollouts(rng, n):
    """Multi-turn rollouts: completions of model and tool spans; some rows continued under newer weights."""
    prompts = [rng.integers(1, 1000, rng.integers(1, 6), dtype=np.int64) for _ in range(n)]
    completions, masks, versions = [], [], []
    for i in range(n):
        length = int(rng.integers(1, 12))
        completions.append(rng.integers(1, 1000, length))
        masks.append((rng.random(length) < 0.7).astype(np.int64))   # tool tokens are 0
        if i % 3 == 0:
            versions.append(None)                                     # generated under one policy
        else:
            switch = int(rng.integers(0, length + 1))                 # continued under new weights there
            versions.append(np.r_[np.full(switch, 4), np.full(length - switch, 5)].astype(np.int64))
    return {"prompt_id": np.arange(n) // 2, "prompt_ids": prompts, "completion_ids": completions,
            "tool_mask": masks, "token_policy_versions": versions, "policy_version": np.full(n, 4),
            "old_per_token_logps": [-rng.random(len(c)).astype(np.float32) for c in completions]}


def _present(out, name, n):
    """Which rows hold ``name`` (a batch has ``name + "_present"`` only when some rows do not; its
    column is None when no row does)."""
    if out.get(name) is None:  # (a first batch of only None makes no column at all)
        return [False] * n
    flags = out.get(name + "_present")
    return [True] * n if flags is None else flags.tolist()


def _expect_padded(out, data, rows):
    flags = _present(out, "token_policy_versions", len(rows))
    for j, i in enumerate(rows):
        length = len(data["completion_ids"][i])
        assert out["completion_mask"][j].sum() == length
        assert out["tool_mask"][j, :length].tolist() == data["tool_mask"][i].tolist()
        present = data["token_policy_versions"][i] is not None
        assert flags[j] == present
        if present:
            assert out["token_policy_versions"][j, :length].tolist() == data["token_policy_versions"][i].tolist()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 24), st.integers(0, 2**31))
def test_masks_and_token_versions_through_every_batch_layout(tmp_path_factory, n, seed):
    data = _rollouts(np.random.default_rng(seed), n)
    store = ReplayStore(str(tmp_path_factory.mktemp("s")))
    rows = store.extend(data)
    order = np.random.default_rng(seed + 1).permutation(rows)
    got = store.read(order)
    _expect_padded(collate(got, pad_token_id=0), data, order)
    _expect_padded(Collator(pad_token_id=0).read(store, order), data, order)
    packed = collate_packed(got)
    completion = packed["completion_mask"].bool()
    flat = lambda name: np.concatenate([data[name][i] for i in order])  # noqa: E731
    assert packed["tool_mask"][completion].tolist() == flat("tool_mask").tolist()
    present = [data["token_policy_versions"][i] is not None for i in order]
    assert _present(packed, "token_policy_versions", len(order)) == present
    if any(present):
        per_row = np.repeat(present, [len(data["completion_ids"][i]) for i in order])
        versions = packed["token_policy_versions"][completion].numpy()[per_row]
        want = [data["token_policy_versions"][i] for i in order if data["token_policy_versions"][i] is not None]
        assert versions.tolist() == np.concatenate(want).tolist()
    store.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_masks_and_token_versions_through_every_export(tmp_path, fmt):
    if fmt == "zarr":
        pytest.importorskip("zarr")
    if fmt == "hf":
        pytest.importorskip("datasets")
    data = _rollouts(np.random.default_rng(7), 30)
    src = ReplayStore(str(tmp_path / "src"))
    src.extend(data)
    out = str(tmp_path / {"parquet": "x.parquet", "jsonl": "x.jsonl", "hf": "x", "zarr": "x.zarr"}[fmt])
    export(src, out, format=fmt)
    import_rollouts(out, str(tmp_path / "back"))
    back = ReplayStore(str(tmp_path / "back"), readonly=True)
    a, b = src.read(src.row_ids()), back.read(back.row_ids())
    for name in ("tool_mask", "token_policy_versions", "completion_ids", "old_per_token_logps"):
        assert np.array_equal(a[name].offsets, b[name].offsets), name
        assert a[name].values.tobytes() == b[name].values.tobytes(), name
        va, vb = a[name].validity, b[name].validity
        assert (va is None and (vb is None or vb.all())) or np.array_equal(va, vb), name
    assert back.schema["tool_mask"] == src.schema["tool_mask"]
    src.close(), back.close()


def test_a_loss_mask_holds_only_zeros_and_ones(tmp_path):
    store = ReplayStore(str(tmp_path / "s"), group_key=None)
    for bad, where in (([[1, 0, 2]], "row 0 token 2 holds 2"), ([[1.0, 0.5, 1.0]], "")):
        with pytest.raises(BatchError, match=f"'tool_mask'.*{where}"):
            store.extend({"completion_ids": [[1, 2, 3]], "tool_mask": bad})
    with pytest.raises(BatchError, match="'loss_mask' row 1 token 0 holds -1"):
        store.extend({"completion_ids": [[1], [2, 3]], "loss_mask": [[1], [-1, 1]]})
    with pytest.raises(BatchError, match="'tool_mask' row 0 has 2 values but 'completion_ids' has 3"):
        store.extend({"completion_ids": [[1, 2, 3]], "tool_mask": [[1, 0]]})
    assert len(store) == 0


def test_trl_records_and_replays_the_tool_mask(tmp_path):
    """The TRL integration's own path: TRL's padded batch with a ``tool_mask`` recorded into the store,
    then replayed into a later batch, whose loss tokens leave the tool tokens out."""
    pytest.importorskip("trl")
    from diskreplay.integrations.trl.batch import assemble, record
    from diskreplay.integrations.trl.planners import ReplayPlan

    def trl_batch(seed):
        g = torch.Generator().manual_seed(seed)
        out = {"prompt_ids": torch.randint(1, 50, (4, 3), generator=g), "prompt_mask": torch.ones(4, 3, dtype=torch.long),
               "completion_ids": torch.randint(1, 50, (4, 5), generator=g),
               "completion_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]),
               "tool_mask": torch.tensor([[1, 0, 0, 1, 1], [1, 1, 0, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
               "advantages": torch.randn(4, generator=g)}
        out["completion_ids"] = out["completion_ids"] * out["completion_mask"]
        return out

    first = trl_batch(0)
    store = ReplayStore(str(tmp_path / "s"))
    rec = record(first, np.array([1, 1, 2, 2]), np.zeros(4), np.zeros((4, 1)),
                 torch.zeros(4, 5), step=0, ratio_mode="token")
    rows = store.extend(rec)
    assert store.read(rows)["tool_mask"][1].tolist() == [1, 1, 0]      # padding stripped, mask kept
    replay = collate(store.read(rows[[0, 1]]), pad_token_id=0)
    second = trl_batch(1)
    merged = assemble(second, torch.zeros(4, 5), replay, ReplayPlan(rows[[0, 1]], None), 0, None, "token")
    assert merged["tool_mask"].shape == (6, 5)
    assert torch.equal(merged["tool_mask"][4] * merged["completion_mask"][4], first["tool_mask"][0])
    assert torch.equal(merged["tool_mask"][5] * merged["completion_mask"][5],
                       first["tool_mask"][1] * first["completion_mask"][1])
