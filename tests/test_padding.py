"""collate / collate_unpadded / pad_on_device / repad against slow per-row references."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import importlib

collate_module = importlib.import_module("diskreplay.batching.padded")
from diskreplay.batching.padded import collate, collate_unpadded, pad_on_device, repad, repad_stacked
from diskreplay.ragged import RaggedColumn

PAD = 99
FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------
# building batches
# --------------------------------------------------------------------------

def ragged(rows, dtype, validity=None, junk=0):
    """A RaggedColumn of ``rows``; ``junk`` extra values before them make its
    offsets start past 0, as a slice of a larger column does."""
    col = RaggedColumn.from_arrays(rows, dtype=dtype)
    if junk:
        col = RaggedColumn(np.concatenate([np.full(junk, -5, dtype=dtype), col.values]),
                           col.offsets + junk)
    if validity is not None:
        col.validity = np.asarray(validity, dtype=bool)
    return col


@st.composite
def batches(draw):
    B = draw(st.integers(1, 20))
    lengths = st.lists(st.integers(0, 9), min_size=B, max_size=B)
    flags = st.lists(st.booleans(), min_size=B, max_size=B)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    p_len, c_len = draw(lengths), draw(lengths)
    junk = draw(st.integers(0, 3))
    batch = {}
    batch["prompt_ids"] = ragged([rng.integers(0, 1000, n) for n in p_len], np.int32, junk=junk)
    if draw(st.integers(0, 5)) > 0:
        batch["completion_ids"] = ragged([rng.integers(0, 1000, n) for n in c_len], np.int32)
    else:
        batch["completion_ids"] = None
    for name in ("old_per_token_logps", "ref_per_token_logps"):
        kind = draw(st.sampled_from(["full", "validity", "none"]))
        if kind == "none":
            batch[name] = None
            continue
        validity = draw(flags) if kind == "validity" else None
        # a row that is None may still hold stale values; they must not show
        batch[name] = ragged([rng.standard_normal(n) for n in c_len], np.float32,
                             validity=validity, junk=junk)
    if draw(st.booleans()):
        batch["prompt_token_weights"] = ragged([rng.random(n) for n in p_len], np.float32)
    if draw(st.booleans()):
        batch["completion_tool_flags"] = ragged([rng.integers(0, 2, n) for n in c_len], np.int8)
    batch["advantages"] = rng.standard_normal(B).astype(np.float32)
    batch["rewards"] = rng.standard_normal(B)
    batch["prompt_id"] = rng.integers(0, 50, B).astype(np.int32)
    batch["is_truncated"] = rng.random(B) < 0.5
    batch["reward_components"] = rng.random((B, draw(st.integers(1, 3)))).astype(np.float32)
    batch["text"] = [f"row {i}" for i in range(B)]
    batch["critic_values"] = None
    if not draw(st.booleans()):
        del batch["prompt_ids"]
    return batch


def reference_collate(batch, pad):
    """Row by row with Python lists: obviously right, and slow."""
    def rows(col):
        return [[] if r is None else r.tolist() for r in col]

    ragged_cols = {k: rows(v) for k, v in batch.items() if isinstance(v, RaggedColumn)}
    P = max([len(r) for k, rs in ragged_cols.items() if k.startswith("prompt_") for r in rs],
            default=0)
    C = max([len(r) for k, rs in ragged_cols.items() if not k.startswith("prompt_") for r in rs],
            default=0)
    out = {}
    for name, col in batch.items():
        if col is None or isinstance(col, list):
            out[name] = col
            continue
        if not isinstance(col, RaggedColumn):
            dtype = {"b": torch.bool, "i": torch.int64, "u": torch.int64}.get(col.dtype.kind)
            out[name] = torch.tensor(col.tolist(), dtype=dtype or getattr(torch, str(col.dtype)))
            continue
        pad_value = pad if name in ("prompt_ids", "completion_ids") else 0
        dtype = torch.float32 if col.values.dtype.kind == "f" else torch.int64
        if name.startswith("prompt_"):
            padded = [[pad_value] * (P - len(r)) + r for r in ragged_cols[name]]
            mask = [[0] * (P - len(r)) + [1] * len(r) for r in ragged_cols[name]]
        else:
            padded = [r + [pad_value] * (C - len(r)) for r in ragged_cols[name]]
            mask = [[1] * len(r) + [0] * (C - len(r)) for r in ragged_cols[name]]
        width = P if name.startswith("prompt_") else C
        out[name] = torch.tensor(padded, dtype=dtype).reshape(len(padded), width)
        if name in ("prompt_ids", "completion_ids"):
            out[name.replace("_ids", "_mask")] = torch.tensor(mask, dtype=torch.int64).reshape(
                len(padded), width)
        if col.validity is not None and not all(col.validity):  # rows "not computed" are flagged
            out[name + "_present"] = torch.tensor([bool(v) for v in col.validity])
    return out


def assert_same(got, want):
    assert list(got) == list(want)
    for name in want:
        g, w = got[name], want[name]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), name
            assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
            assert g.shape == w.shape, (name, g.shape, w.shape)
            assert torch.equal(g, w), name
        else:
            assert g == w, name


# --------------------------------------------------------------------------
# collate
# --------------------------------------------------------------------------

@FAST
@given(batches())
def test_collate_matches_reference(batch):
    assert_same(collate(batch, PAD), reference_collate(batch, PAD))


def test_collate_layout_and_dtypes():
    b = {"prompt_ids": ragged([[1, 2, 3], [4]], np.int32),
         "completion_ids": ragged([[5], []], np.int32),
         "old_per_token_logps": ragged([[-0.5], []], np.float32),
         "advantages": np.array([1.0, 2.0], np.float32),
         "prompt_id": np.array([3, 4], np.int32),
         "ok": np.array([True, False])}
    t = collate(b, 0)
    assert t["prompt_ids"].tolist() == [[1, 2, 3], [0, 0, 4]]
    assert t["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert t["completion_ids"].tolist() == [[5], [0]]
    assert t["completion_mask"].tolist() == [[1], [0]]
    assert t["old_per_token_logps"].dtype == torch.float32
    assert (t["advantages"].dtype, t["prompt_id"].dtype, t["ok"].dtype) == (
        torch.float32, torch.int64, torch.bool)
    assert list(t) == ["prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                       "old_per_token_logps", "advantages", "prompt_id", "ok"]


def test_collate_all_empty_rows_give_zero_width():
    b = {"completion_ids": ragged([[], []], np.int32)}
    t = collate(b, 0)
    assert t["completion_ids"].shape == (2, 0) and t["completion_mask"].shape == (2, 0)


def test_collate_does_not_alias_the_batch():
    adv = np.array([1.0, 2.0], np.float32)
    t = collate({"advantages": adv}, 0)
    t["advantages"][0] = 7
    assert adv[0] == 1.0


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="rows"):
        collate({"completion_ids": ragged([[1]], np.int32), "advantages": np.zeros(2)}, 0)
    with pytest.raises(ValueError, match="pad_token_id"):
        collate({"completion_ids": ragged([[1]], np.int32)}, None)
    with pytest.raises(ValueError, match="completion_mask"):
        collate({"completion_ids": ragged([[1]], np.int32), "completion_mask": np.ones(1)}, 0)
    with pytest.raises(ValueError, match="validity"):
        collate({"completion_ids": ragged([[1]], np.int32, validity=[True, False])}, 0)


@FAST
@given(batches())
def test_collate_into_out_buffers_aliases_them(batch):
    want = collate(batch, PAD)
    # buffers larger than needed, in both a [Bmax, Lmax] and a flat shape
    out = {}
    for i, (name, t) in enumerate(want.items()):
        if isinstance(t, torch.Tensor):
            shape = (25, 40) if i % 2 else (25 * 40,)
            out[name] = torch.full(shape, -1, dtype=t.dtype)
    got = collate(batch, PAD, out=out)
    assert_same(got, want)
    for name, buf in out.items():
        t = got[name]
        assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert t.is_contiguous()
        if t.numel():
            buf.view(-1)[0] = 1 if buf.dtype != torch.bool else not bool(t.view(-1)[0])
            assert t.view(-1)[0] == buf.view(-1)[0]


def test_out_buffer_checks():
    b = {"completion_ids": ragged([[1, 2, 3]], np.int32)}
    with pytest.raises(ValueError, match="elements"):
        collate(b, 0, out={"completion_ids": torch.empty(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="int64"):
        collate(b, 0, out={"completion_ids": torch.empty(8, dtype=torch.int32)})
    with pytest.raises(ValueError, match="contiguous"):
        collate(b, 0, out={"completion_ids": torch.empty(8, 8, dtype=torch.int64).t()})


# --------------------------------------------------------------------------
# collate_unpadded / pad_on_device
# --------------------------------------------------------------------------

@FAST
@given(batches())
def test_pad_on_device_equals_collate(batch):
    unpadded = collate_unpadded(batch)
    assert_same(pad_on_device(unpadded, PAD), collate(batch, PAD))


def test_collate_unpadded_layout():
    col = ragged([[1, 2], [9, 9], [3]], np.int32, validity=[True, False, True], junk=2)
    u = collate_unpadded({"completion_ids": col, "advantages": np.zeros(3, np.float32)})
    assert u["completion_ids"].dtype == torch.int32
    assert u["completion_ids"].tolist() == [1, 2, 3]
    assert u["completion_ids.offsets"].tolist() == [0, 2, 2, 3]
    assert u["advantages"].shape == (3,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pad_on_device_on_cuda():
    b = {"prompt_ids": ragged([[1, 2, 3], [4]], np.int32),
         "completion_ids": ragged([[5], [6, 7]], np.int32),
         "old_per_token_logps": ragged([[-0.5], [-1.0, -2.0]], np.float32),
         "advantages": np.array([1.0, 2.0], np.float32)}
    u = {k: v.cuda() for k, v in collate_unpadded(b).items()}
    got = pad_on_device(u, 0)
    assert all(t.is_cuda for t in got.values())
    assert_same({k: v.cpu() for k, v in got.items()}, collate(b, 0))


# --------------------------------------------------------------------------
# repad
# --------------------------------------------------------------------------

def reference_repad(rows, pad):
    def kept(row, name, mask):
        return [x for x, m in zip(row[name].reshape(-1).tolist(),
                                  row[mask].reshape(-1).tolist()) if m]

    out = {}
    for name in rows[0]:
        if name in ("prompt_ids", "prompt_mask"):
            ks = [kept(r, "prompt_ids", "prompt_mask") for r in rows]
            P = max(map(len, ks))
            fill = pad if name == "prompt_ids" else 0
            vals = ks if name == "prompt_ids" else [[1] * len(k) for k in ks]
            out[name] = torch.tensor([[fill] * (P - len(v)) + v for v in vals],
                                     dtype=rows[0][name].dtype).reshape(len(rows), P)
        elif name in ("completion_ids", "completion_mask") or name.endswith("logps"):
            if rows[0][name] is None:
                out[name] = None
                continue
            src = name if name != "completion_mask" else "completion_ids"
            ks = [kept(r, src, "completion_mask") for r in rows]
            C = max(map(len, ks))
            fill = pad if name == "completion_ids" else 0
            vals = [[1] * len(k) for k in ks] if name == "completion_mask" else ks
            out[name] = torch.tensor([v + [fill] * (C - len(v)) for v in vals],
                                     dtype=rows[0][name].dtype).reshape(len(rows), C)
        else:
            out[name] = torch.tensor([float(r[name]) for r in rows])
    return out


@st.composite
def repad_rows(draw):
    B = draw(st.integers(1, 8))
    logps_present = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for _ in range(B):
        P, C = draw(st.integers(0, 6)), draw(st.integers(0, 6))
        # any 0/1 pattern, not only padding at the edges
        pm = torch.tensor(rng.integers(0, 2, P))
        cm = torch.tensor(rng.integers(0, 2, C), dtype=torch.int64)
        row = {"prompt_ids": torch.tensor(rng.integers(0, 100, P)), "prompt_mask": pm,
               "completion_ids": torch.tensor(rng.integers(0, 100, C)), "completion_mask": cm,
               "old_per_token_logps": torch.randn(C) if logps_present else None,
               "ref_per_token_logps": None,
               "advantages": torch.tensor(float(rng.standard_normal()))}
        if draw(st.booleans()):
            row = {k: (v[None] if isinstance(v, torch.Tensor) and v.dim() == 1 else v)
                   for k, v in row.items()}
        rows.append(row)
    return rows


@FAST
@given(repad_rows())
def test_repad_stacked_matches_reference(rows):
    assert_same(repad_stacked(rows, PAD), reference_repad(rows, PAD))


def test_repad_non_contiguous_mask_and_shapes():
    rows = [{"completion_ids": torch.tensor([[1, 2, 3]]),
             "completion_mask": torch.tensor([[1, 0, 1]]),
             "old_per_token_logps": torch.tensor([[-1.0, -2.0, -3.0]]),
             "advantages": torch.tensor([0.5])},
            {"completion_ids": torch.tensor([4, 5, 6, 7]),
             "completion_mask": torch.tensor([0, 1, 0, 0]),
             "old_per_token_logps": torch.tensor([-4.0, -5.0, -6.0, -7.0]),
             "advantages": torch.tensor([1.5])}]
    out = repad_stacked(rows, 0)
    assert out["completion_ids"].tolist() == [[1, 3], [5, 0]]
    assert out["completion_mask"].tolist() == [[1, 1], [1, 0]]
    assert out["old_per_token_logps"].tolist() == [[-1.0, -3.0], [-5.0, 0.0]]
    assert out["advantages"].tolist() == [0.5, 1.5]


def test_repad_all_zero_masks_and_single_row():
    rows = [{"prompt_ids": torch.tensor([7, 7]), "prompt_mask": torch.tensor([0, 0]),
             "completion_ids": torch.tensor([7]), "completion_mask": torch.tensor([0]),
             "old_per_token_logps": None}]
    out = repad_stacked(rows, 7)
    assert out["prompt_ids"].shape == (1, 0) and out["completion_mask"].shape == (1, 0)
    assert out["old_per_token_logps"] is None
    rows.append({"prompt_ids": torch.tensor([3]), "prompt_mask": torch.tensor([1]),
                 "completion_ids": torch.tensor([0, 4]), "completion_mask": torch.tensor([0, 1]),
                 "old_per_token_logps": None})
    out = repad_stacked(rows, 7)
    assert out["prompt_ids"].tolist() == [[7], [3]]
    assert out["prompt_mask"].tolist() == [[0], [1]]
    assert out["completion_ids"].tolist() == [[7], [4]]


def test_repad_keeps_mask_dtype_and_extra_aligned_columns():
    rows = [{"completion_ids": torch.tensor([1, 2]),
             "completion_mask": torch.tensor([True, False]),
             "entropies": torch.tensor([0.1, 0.2]), "reward": 1.0}]
    out = repad_stacked(rows, 0)
    assert out["completion_mask"].dtype == torch.bool
    assert out["entropies"].tolist() == [[pytest.approx(0.1)]]
    assert out["reward"].tolist() == [1.0]


@pytest.mark.parametrize("rows, match", [
    ([{"completion_ids": torch.tensor([1, 2]), "completion_mask": torch.tensor([1])}],
     "completion_mask.*row 0"),
    ([{"completion_ids": torch.tensor([1, 2]), "completion_mask": torch.tensor([[1, 1]])}],
     "completion_mask.*row 0"),
    ([{"completion_ids": torch.tensor([1]), "completion_mask": torch.tensor([1])},
      {"completion_ids": torch.tensor([1]), "completion_mask": torch.tensor([2])}],
     "completion_mask.*row 1"),
    ([{"completion_ids": torch.tensor([1]), "completion_mask": torch.tensor([1]),
       "old_per_token_logps": None},
      {"completion_ids": torch.tensor([1]), "completion_mask": torch.tensor([1]),
       "old_per_token_logps": torch.tensor([0.5])}],
     "old_per_token_logps"),
    ([{"completion_ids": torch.tensor([1, 2]), "completion_mask": torch.tensor([1, 1]),
       "ref_per_token_logps": torch.tensor([0.5])}],
     "ref_per_token_logps.*row 0"),
    ([{"completion_ids": torch.tensor([[1, 2], [3, 4]]),
       "completion_mask": torch.tensor([[1, 1], [1, 1]])}],
     "completion_ids.*row 0"),
    ([], "no rows"),
])
def test_repad_rejects_bad_rows(rows, match):
    with pytest.raises(ValueError, match=match):
        repad_stacked(rows, 0)


@FAST
@given(repad_rows())
def test_repad_in_place_rows_are_the_stacked_rows(rows):
    want = reference_repad(rows, PAD)
    originals = [dict(r) for r in rows]
    out = repad(rows, pad_token_id=PAD)
    assert out is rows
    for i, (row, before) in enumerate(zip(out, originals)):
        assert list(row) == list(before)  # same keys, same order
        for name, w in want.items():
            if name == "advantages":  # per-row values are left as they were
                assert row[name] is before[name]
            elif w is None:
                assert row[name] is None
            else:
                assert row[name].dtype == w.dtype and torch.equal(row[name], w[i]), (name, i)


def test_repad_takes_padding_value_or_pad_token_id_once():
    rows = [{"completion_ids": torch.tensor([1, 0]), "completion_mask": torch.tensor([1, 0])},
            {"completion_ids": torch.tensor([2, 3]), "completion_mask": torch.tensor([1, 1])}]
    assert repad([dict(r) for r in rows], 9)[0]["completion_ids"].tolist() == [1, 9]
    assert repad([dict(r) for r in rows], padding_value=9)[0]["completion_ids"].tolist() == [1, 9]
    for bad in ({}, {"padding_value": 1, "pad_token_id": 1}):
        with pytest.raises(ValueError, match="padding_value"):
            repad(rows, **bad)


# TRL's tests/test_repad.py (huggingface/trl, experimental GRPO replay buffer), its three cases
# with only the import changed: our repad replaces trl.trainer.grpo_replay_buffer.repad.

PAD_TOKEN_ID = 123


def test_trl_repad_basic_padding():
    from copy import deepcopy
    sample = [
        {
            "prompt_ids": torch.LongTensor([1, 2, 3]),
            "prompt_mask": torch.LongTensor([1, 1, 0]),
            "completion_ids": torch.LongTensor([5, 6, 7, 8]),
            "completion_mask": torch.LongTensor([1, 1, 1, 0]),
            "old_per_token_logps": torch.tensor([0.1, 0.2, 0.3, 0.4]),
            "ref_per_token_logps": torch.tensor([0.0, -0.1, -0.2, -0.3]),
        },
        {
            "prompt_ids": torch.LongTensor([4, 5]),
            "prompt_mask": torch.LongTensor([1, 1]),
            "completion_ids": torch.LongTensor([9, 10]),
            "completion_mask": torch.LongTensor([1, 1]),
            "old_per_token_logps": torch.tensor([-0.5, -0.6]),
            "ref_per_token_logps": torch.tensor([0.5, 0.6]),
        }
    ]

    padded = repad(deepcopy(sample), pad_token_id=PAD_TOKEN_ID)

    assert len(padded[0]['prompt_ids']) == 2
    assert len(padded[0]['completion_ids']) == 3

    for ex in padded:
        # All sequences in same batch should have same length
        assert len(ex['prompt_ids']) == len(padded[0]['prompt_ids'])
        assert len(ex['prompt_mask']) == len(padded[0]['prompt_mask'])
        assert len(ex['completion_ids']) == len(padded[0]['completion_ids'])
        assert len(ex['completion_mask']) == len(padded[0]['completion_mask'])

        # Mask and ids should match in shape
        assert ex['prompt_ids'].shape == ex['prompt_mask'].shape
        assert ex['completion_ids'].shape == ex['completion_mask'].shape


def test_trl_repad_logps_padding():
    from copy import deepcopy
    sample = [
        {
            "prompt_ids": torch.LongTensor([1]),
            "prompt_mask": torch.LongTensor([1]),
            "completion_ids": torch.LongTensor([2, 3, 4]),
            "completion_mask": torch.LongTensor([1, 1, 0]),
            "old_per_token_logps": torch.tensor([-0.1, -0.2, -0.3]),
            "ref_per_token_logps": torch.tensor([-0.5, -0.6, -0.7]),
        },
        {
            "prompt_ids": torch.LongTensor([5, 6]),
            "prompt_mask": torch.LongTensor([1, 1]),
            "completion_ids": torch.LongTensor([7, 8]),
            "completion_mask": torch.LongTensor([1, 1]),
            "old_per_token_logps": torch.tensor([0.4, 0.5]),
            "ref_per_token_logps": torch.tensor([0.6, 0.7]),
        }
    ]

    padded = repad(deepcopy(sample), pad_token_id=PAD_TOKEN_ID)

    for logps in ["old_per_token_logps", "ref_per_token_logps"]:
        for ex in padded:
            assert len(ex[logps]) == len(padded[0][logps])
            assert isinstance(ex[logps], torch.Tensor)


def test_trl_repad_empty_masks():
    from copy import deepcopy
    sample = [
        {
            "prompt_ids": torch.tensor([0]),
            "prompt_mask": torch.tensor([0]),
            "completion_ids": torch.tensor([0]),
            "completion_mask": torch.tensor([0]),
            "old_per_token_logps": torch.tensor([0.0]),
            "ref_per_token_logps": torch.tensor([0.0]),
        },
        {
            "prompt_ids": torch.tensor([1]),
            "prompt_mask": torch.tensor([0]),
            "completion_ids": torch.tensor([1]),
            "completion_mask": torch.tensor([0]),
            "old_per_token_logps": torch.tensor([0.0]),
            "ref_per_token_logps": torch.tensor([0.0]),
        },
        {
            "prompt_ids": torch.tensor([1,1]),
            "prompt_mask": torch.tensor([0,1]),
            "completion_ids": torch.tensor([1,2]),
            "completion_mask": torch.tensor([1,0]),
            "old_per_token_logps": torch.tensor([0.0,1.0]),
            "ref_per_token_logps": torch.tensor([0.0,1.0]),
        },
        {
            "prompt_ids": torch.tensor([1,1]),
            "prompt_mask": torch.tensor([1,1]),
            "completion_ids": torch.tensor([1,2]),
            "completion_mask": torch.tensor([1,0]),
            "old_per_token_logps": torch.tensor([0.0,1.0]),
            "ref_per_token_logps": torch.tensor([0.0,1.0]),
        }
    ]
    padded = repad(deepcopy(sample), pad_token_id=999)

    assert len(padded[0]['prompt_ids']) == 2
    assert len(padded[0]['completion_ids']) == 1

    assert padded[0]["prompt_ids"].eq(999).all()
    assert padded[0]["completion_ids"].eq(999).all()


# --------------------------------------------------------------------------
# doctests
# --------------------------------------------------------------------------

def test_doctests():
    result = doctest.testmod(collate_module, extraglobs={"np": np, "torch": torch})
    assert result.attempted > 0 and result.failed == 0


def test_pad_on_device_with_host_widths_equals_without():
    from diskreplay.batching.padded import padded_widths

    rng = np.random.default_rng(3)
    batch = {"prompt_ids": RaggedColumn.from_arrays([rng.integers(0, 9, n) for n in (3, 0, 5)], dtype=np.int32),
             "completion_ids": RaggedColumn.from_arrays([rng.integers(0, 9, n) for n in (1, 4, 0)], dtype=np.int32),
             "old_per_token_logps": RaggedColumn.from_arrays([rng.random(n) for n in (1, 4, 0)], dtype=np.float32)}
    unpadded = collate_unpadded(batch)
    widths = padded_widths(unpadded)
    assert widths == {True: 5, False: 4}
    a, b = pad_on_device(unpadded, 7), pad_on_device(unpadded, 7, widths=widths)
    ref = collate(batch, 7)
    assert a.keys() == b.keys() == ref.keys()
    for k in ref:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], ref[k]), k
