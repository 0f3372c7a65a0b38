"""RandomSampler(replacement=False) against TorchRL's own SamplerWithoutReplacement: the same calls on
both, row ids compared batch by batch (TorchRL's indices are row ids: its storage never evicts here).

TorchRL is the ``[torchrl]`` extra; without it these tests skip.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
pytest.importorskip("torchrl")

from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyTensorStorage  # noqa: E402
from torchrl.data import ReplayBuffer as TorchRLReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement  # noqa: E402

from diskreplay import RandomSampler, ReplayStore  # noqa: E402
from diskreplay.buffer import ReplayBuffer  # noqa: E402

# (op, n): extend n rows, or sample n rows
SCRIPT = [("extend", 10), ("sample", 4), ("sample", 4), ("sample", 4), ("sample", 4), ("sample", 4),
          ("sample", 4), ("extend", 4), ("sample", 4), ("sample", 4), ("sample", 4), ("sample", 4),
          ("extend", 3), ("sample", 4), ("sample", 4), ("sample", 4), ("sample", 4), ("sample", 4),
          ("sample", 4), ("sample", 4), ("sample", 4), ("sample", 4)]
VARYING = [("extend", 10), ("sample", 3), ("sample", 5), ("sample", 4), ("sample", 2), ("sample", 6),
           ("extend", 5), ("sample", 7), ("sample", 7), ("sample", 7), ("sample", 1), ("sample", 20)]


def _torchrl(drop_last, shuffle):
    # (TorchRL wants a batch size here with drop_last=True; sample(n) overrides it, with a warning once)
    return TorchRLReplayBuffer(storage=LazyTensorStorage(1000), batch_size=4,
                               sampler=SamplerWithoutReplacement(drop_last=drop_last, shuffle=shuffle))


def _their_sample(rb, n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return rb.sample(n, return_info=True)


def _run(script, theirs, ours, store):
    """Both sides' (rows, ran_out) after every sample of ``script`` (and ("extend", n) where it extends)."""
    got_theirs, got_ours, written = [], [], 0
    for op, n in script:
        if op == "extend":
            x = torch.arange(written, written + n)
            theirs.extend(TensorDict({"x": x}, batch_size=[n]))
            store.extend({"prompt_id": x.numpy(), "x": x.numpy()})
            written += n
            got_theirs.append(("extend", n))  # a new pass on both sides
            got_ours.append(("extend", n))
            continue
        data, info = _their_sample(theirs, n)
        assert data["x"].tolist() == info["index"].tolist()  # index == row id: nothing evicted
        got_theirs.append((info["index"].tolist(), theirs.sampler.ran_out))
        got_ours.append((ours.sample(store, n).tolist(), ours.ran_out))
    return got_theirs, got_ours


# (drop_last=True with a batch size that grows mid-pass is the documented difference, tested below)
@pytest.mark.parametrize("drop_last,script", [(False, SCRIPT), (True, SCRIPT), (False, VARYING)],
                         ids=["fixed", "fixed-drop_last", "varying"])
def test_ordered_passes_match_torchrl_batch_by_batch(tmp_path, drop_last, script):
    with ReplayStore(tmp_path / "s") as store:
        theirs, ours = _run(script, _torchrl(drop_last, False), RandomSampler(shuffle=False, drop_last=drop_last),
                            store)
    assert ours == theirs


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_passes_match_torchrl_in_shape(tmp_path, drop_last):
    """Random permutations differ (two generators); sizes, pass ends and each pass's rows agree."""
    with ReplayStore(tmp_path / "s") as store:
        theirs, ours = _run(SCRIPT, _torchrl(drop_last, True), RandomSampler(seed=0, drop_last=drop_last), store)
    assert [(len(r), out) for r, out in ours] == [(len(r), out) for r, out in theirs]

    def passes(got):
        out, cur = [], []
        for rows, ran_out in got:
            if rows == "extend":
                out += [sorted(cur)] if cur else []
                cur = []
                continue
            cur += rows
            if ran_out:
                out.append(sorted(cur))
                cur = []
        return out

    if drop_last:  # which rows a pass drops is random on each side
        assert [len(p) for p in passes(ours)] == [len(p) for p in passes(theirs)]
    else:
        assert passes(ours) == passes(theirs)
    assert all(len(p) == len(set(p)) for p in passes(ours))


def test_drop_last_keeps_full_batches_when_the_batch_grows_mid_pass(tmp_path):
    """The one deliberate difference: TorchRL decides a pass's end with the previous call's batch size, so
    a larger batch can come short under drop_last=True; ours starts the new pass instead."""
    with ReplayStore(tmp_path / "s") as store:
        store.extend({"prompt_id": np.arange(10)})
        s = RandomSampler(shuffle=False, drop_last=True)
        assert s.sample(store, 3).tolist() == [0, 1, 2] and s.sample(store, 3).tolist() == [3, 4, 5]
        assert s.sample(store, 5).tolist() == [0, 1, 2, 3, 4]  # 4 left < 5: a new pass, never a short batch
        theirs = _torchrl(True, False)
        theirs.extend(TensorDict({"x": torch.arange(10)}, batch_size=[10]))
        sizes = [len(_their_sample(theirs, n)[1]["index"]) for n in (3, 3, 5)]
        assert sizes == [3, 3, 4]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_iterating_the_buffer_matches_torchrl(tmp_path, drop_last, shuffle):
    theirs = TorchRLReplayBuffer(storage=LazyTensorStorage(100), batch_size=4,
                                 sampler=SamplerWithoutReplacement(drop_last=drop_last, shuffle=shuffle))
    theirs.extend(TensorDict({"x": torch.arange(100, 110)}, batch_size=[10]))
    with ReplayBuffer(ReplayStore(tmp_path / "s"), RandomSampler(seed=0, drop_last=drop_last, shuffle=shuffle), 4,
                      state_name=None) as rb:
        rb.extend({"prompt_id": np.arange(10), "x": np.arange(100, 110)})
        for _ in range(2):  # a second iteration walks a whole new pass, on both sides
            mine, theirs_ = [b["x"].tolist() for b in rb], [b["x"].tolist() for b in theirs]
            assert [len(b) for b in mine] == [len(b) for b in theirs_] == ([4, 4] if drop_last else [4, 4, 2])
            if not shuffle:
                assert mine == theirs_
            assert len(set(sum(mine, []))) == sum(len(b) for b in mine)
