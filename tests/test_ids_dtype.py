"""``ids_dtype``: token ids collated as int32 instead of TRL's int64, in both layouts, on the host and on
a device, through Collator and ReplayLoader; the same values, the rest of the batch unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diskreplay import (ArgumentError, BatchError, Collator, PromptGroupSampler, RaggedColumn, ReplayLoader,
                        ReplayStore, collate, collate_packed, collate_unpadded, pack_on_device, pad_on_device)
from diskreplay.synthetic import make_rollouts

IDS = {"padded": ("prompt_ids", "completion_ids"), "packed": ("input_ids",)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = ReplayStore(str(tmp_path_factory.mktemp("ids") / "store"))
    s.extend(make_rollouts(8, 4, seed=3, prompt_mean=20, completion_mean=30))
    s.extend(make_rollouts(8, 4, seed=4, first_group=8, prompt_mean=20, completion_mean=30))
    yield s
    s.close()


def _same_batch(wide, narrow, ids):
    assert set(wide) == set(narrow)
    for name, value in wide.items():
        if not isinstance(value, torch.Tensor):
            assert value == narrow[name], name
            continue
        if name in ids:
            assert value.dtype == torch.int64 and narrow[name].dtype == torch.int32, name
            assert torch.equal(value, narrow[name].to(torch.int64)), name
        else:
            assert value.dtype == narrow[name].dtype and torch.equal(value, narrow[name]), name


@pytest.mark.parametrize("jit", ["1", "0"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_collator_gives_int32_ids_with_the_same_values(store, monkeypatch, layout, jit):
    monkeypatch.setenv("DISKREPLAY_JIT", jit)
    rows = PromptGroupSampler(num_groups=4, seed=1).sample(store, 16)
    wide = Collator(7, layout=layout).read(store, rows)
    narrow_collator = Collator(7, layout=layout, ids_dtype=torch.int32)
    for _ in range(2):  # the reused buffers keep their dtype
        narrow = narrow_collator.read(store, rows)
        _same_batch(wide, narrow, IDS[layout])
    assert "ids_dtype=torch.int32" in repr(narrow_collator)
    # the one-call functions too, from an ordinary read
    batch = store.read(rows)
    _same_batch(collate(batch, 7), collate(batch, 7, ids_dtype=torch.int32), IDS["padded"])
    _same_batch(collate_packed(batch), collate_packed(batch, ids_dtype=torch.int32), IDS["packed"])


def test_the_device_paths_give_int32_ids_as_the_host_does(store):
    batch = store.read(PromptGroupSampler(num_groups=3, seed=2).sample(store, 12))
    host = collate(batch, 5, ids_dtype=torch.int32)
    device = pad_on_device(collate_unpadded(batch), 5, ids_dtype=torch.int32)
    assert all(torch.equal(host[k], device[k]) and host[k].dtype == device[k].dtype
               for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
    packed = collate_packed(batch, ids_dtype=torch.int32)
    on_device = pack_on_device(collate_unpadded(batch), ids_dtype=torch.int32)
    assert on_device["input_ids"].dtype == torch.int32 and torch.equal(packed["input_ids"], on_device["input_ids"])


@pytest.mark.parametrize("layout, on_device", [("padded", False), ("padded", True), ("packed", False),
                                               ("packed", True)])
def test_replay_loader_carries_ids_dtype(store, layout, on_device):
    def batches(**kw):
        with ReplayLoader(store, PromptGroupSampler(num_groups=2, seed=9), 8, 0, num_batches=2, layout=layout,
                          pad_on_device=on_device, device="cpu" if on_device else None, **kw) as loader:
            return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in loader]

    for wide, narrow in zip(batches(), batches(ids_dtype=torch.int32)):
        _same_batch(wide, narrow, IDS[layout])


@pytest.mark.parametrize("bad", [torch.float32, torch.int16, "int32", np.int32, None])
def test_an_ids_dtype_other_than_int64_or_int32_is_refused(store, bad):
    with pytest.raises(ArgumentError, match="ids_dtype must be torch.int64 .* or torch.int32"):
        Collator(0, ids_dtype=bad)
    with pytest.raises(ArgumentError, match="ids_dtype"):
        ReplayLoader(store, PromptGroupSampler(num_groups=1, seed=0), 4, 0, ids_dtype=bad)
    with pytest.raises(ArgumentError, match="ids_dtype"):
        collate({"completion_ids": RaggedColumn.from_arrays([[1]], dtype=np.int32)}, 0, ids_dtype=bad)


def test_ids_or_a_pad_token_outside_int32_are_refused_not_wrapped():
    big = {"completion_ids": RaggedColumn.from_arrays([[1, 2**31]], dtype=np.int64)}
    assert collate(big, 0)["completion_ids"].tolist() == [[1, 2**31]]
    with pytest.raises(BatchError, match=r"'completion_ids' holds token ids in \[1, 2147483648\], outside int32"):
        collate(big, 0, ids_dtype=torch.int32)
    with pytest.raises(BatchError, match="outside int32"):
        collate_packed(big, ids_dtype=torch.int32)
    fits = {"completion_ids": RaggedColumn.from_arrays([[1, 2**31 - 1]], dtype=np.int64)}
    assert collate(fits, 0, ids_dtype=torch.int32)["completion_ids"].tolist() == [[1, 2**31 - 1]]
    with pytest.raises(ArgumentError, match="pad_token_id=2147483648 does not fit ids_dtype=torch.int32"):
        Collator(2**31, ids_dtype=torch.int32)
