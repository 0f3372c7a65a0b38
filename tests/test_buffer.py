"""ReplayBuffer: the TorchRL-shaped extend / sample convenience."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

import diskreplay.buffer as buffer_module
from diskreplay import (PrioritizedSampler, PromptGroupSampler, RandomSampler, ReadOnlyError, ReplayStore)
from diskreplay.buffer import ReplayBuffer
from diskreplay.batching.padded import collate
from diskreplay.synthetic import make_rollouts


def test_the_snippet(tmp_path):
    path = tmp_path / "rb"
    rb = ReplayBuffer(ReplayStore(path, capacity=100, group_key="prompt"),
                      sampler=PromptGroupSampler(num_groups=2, group_key="prompt"), batch_size=8)
    rb.extend({"prompt": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]), "reward": torch.arange(12.0)})
    s = rb.sample()   # 2 distinct prompts, 8 rows
    assert set(s) == {"prompt", "reward", "rows"}  # no token columns: per-row tensors only
    assert s["prompt"].shape == (8,) and s["reward"].shape == (8,) and s["rows"].dtype == torch.int64
    assert len(set(s["prompt"].tolist())) == 2
    # laid out group by group, and the values are the rows' own
    assert len(set(s["prompt"][:4].tolist())) == 1 and len(set(s["prompt"][4:].tolist())) == 1
    assert torch.equal(s["reward"], s["rows"].float())
    assert len(rb) == 12
    rb.close()


def test_doctests():
    assert doctest.testmod(buffer_module).failed == 0


@pytest.fixture
def rb(tmp_path):
    with ReplayBuffer(ReplayStore(tmp_path / "s"), PromptGroupSampler(samples_per_group=4, seed=0), batch_size=8,
                      pad_token_id=5) as buf:
        buf.extend(make_rollouts(6, 4, seed=0, prompt_mean=10, completion_mean=12, layout="trl"))
        yield buf


def test_sample_is_collate_of_the_rows(rb):
    s = rb.sample()
    rows = s["rows"].numpy()
    want = collate(rb.store.read(rows), 5)
    assert set(s) == set(want) | {"rows"}
    assert "policy_version" in s and "completion_mask" in s
    for k, v in want.items():
        assert torch.equal(s[k], v), k
    assert s["completion_ids"].shape[0] == 8


def test_sample_passes_keyword_arguments(rb):
    s = rb.sample(12, groups=[3, 1, 4])
    assert s["prompt_id"].tolist() == [3] * 4 + [1] * 4 + [4] * 4
    assert rb.sample(batch_size=4)["rows"].shape == (4,)


def test_device(rb):
    s = ReplayBuffer(rb.store, PromptGroupSampler(num_groups=2, seed=0), 8, pad_token_id=5, device="cpu",
                     state_name=None).sample()
    assert all(v.device.type == "cpu" for v in s.values() if isinstance(v, torch.Tensor))


def test_save_and_resume(tmp_path):
    path = tmp_path / "s"
    batch = make_rollouts(10, 4, seed=1, prompt_mean=8, completion_mean=8)
    with ReplayBuffer(ReplayStore(path), PromptGroupSampler(num_groups=2, seed=3), 8) as buf:
        buf.extend(batch)
        first = [buf.sample()["rows"] for _ in range(3)]
        buf.save()
        want = [buf.sample()["rows"] for _ in range(3)]
        buf.load_state_dict(buf.store.load_state("replay_buffer"))
        assert all(torch.equal(a, b) for a, b in zip(want, [buf.sample()["rows"] for _ in range(3)]))
        buf.load_state_dict(buf.store.load_state("replay_buffer"))
    # close() saved the state after the last sample; rewind to the saved one to compare
    with ReplayBuffer(ReplayStore(path), PromptGroupSampler(num_groups=2, seed=77), 8) as buf:
        got = [buf.sample()["rows"] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert not all(torch.equal(a, b) for a, b in zip(first, got))


def test_close_saves_only_without_an_error(tmp_path):
    path = tmp_path / "s"
    with ReplayBuffer(ReplayStore(path), RandomSampler(seed=0), 4) as buf:
        buf.extend(make_rollouts(4, 2, seed=0, prompt_mean=4, completion_mean=4))
        buf.sample()
        saved = buf.state_dict()
    with pytest.raises(RuntimeError):
        with ReplayBuffer(ReplayStore(path), RandomSampler(seed=0), 4) as buf:
            assert buf.state_dict()["position"]["cursor"] == saved["position"]["cursor"]
            buf.sample()
            raise RuntimeError("training failed")
    with ReplayBuffer(ReplayStore(path), RandomSampler(seed=0), 4) as buf:  # the writer lock was released
        assert buf.state_dict()["position"]["cursor"] == saved["position"]["cursor"]


def test_update_priorities(tmp_path):
    with ReplayBuffer(ReplayStore(tmp_path / "s"), PrioritizedSampler(eps=0.0, seed=0), 4) as buf:
        buf.extend(make_rollouts(2, 4, seed=0, prompt_mean=4, completion_mean=4))
        buf.update_priorities(torch.arange(8), torch.tensor([0.0] * 7 + [5.0]))
        assert buf.sample()["rows"].tolist() == [7, 7, 7, 7]
    with ReplayBuffer(ReplayStore(tmp_path / "t"), RandomSampler(seed=0), 4) as buf:
        buf.extend(make_rollouts(2, 4, seed=0, prompt_mean=4, completion_mean=4))
        buf.update_priorities([0], [1.0])  # no priorities: a no-op, as in TorchRL


def test_readonly_buffer_follows_the_writer(tmp_path):
    path = tmp_path / "s"
    writer = ReplayStore(path)
    writer.extend(make_rollouts(2, 4, seed=0, prompt_mean=4, completion_mean=4))
    with ReplayBuffer(ReplayStore(path, readonly=True), PromptGroupSampler(samples_per_group=4, seed=0), 4,
                      state_name=None) as buf:
        with pytest.raises(ReadOnlyError):
            buf.extend(make_rollouts(1, 4, seed=1))
        writer.extend(make_rollouts(2, 4, seed=1, first_group=2, prompt_mean=4, completion_mean=4))
        s = buf.sample(8, groups=[3, 2])
        assert s["prompt_id"].tolist() == [3] * 4 + [2] * 4
        assert len(buf) == 16
    writer.close()


def test_bad_arguments(tmp_path):
    store = ReplayStore(tmp_path / "s")
    with pytest.raises(ValueError):
        ReplayBuffer(store, RandomSampler(), 0)
    with pytest.raises(TypeError):
        ReplayBuffer(store, object(), 4)
    with pytest.raises(ValueError):
        ReplayBuffer(store, RandomSampler(), 4, state_name=None).save()
    store.close()


def test_iteration_is_one_pass_over_the_live_rows(tmp_path):
    from diskreplay import SamplerError
    with ReplayBuffer(ReplayStore(tmp_path / "s"), RandomSampler(seed=0), 4, state_name=None) as buf:
        buf.extend(make_rollouts(5, 2, seed=0, prompt_mean=4, completion_mean=4))  # 10 rows
        batches = [b["rows"].tolist() for b in buf]
        assert [len(b) for b in batches] == [4, 4, 2]
        assert sorted(sum(batches, [])) == list(range(10))
        buf.sample(3)  # a pass started by sample() is finished by the next iteration
        rest = [b["rows"].tolist() for b in buf]
        assert [len(b) for b in rest] == [4, 3]
    with ReplayBuffer(ReplayStore(tmp_path / "t"), RandomSampler(drop_last=True, shuffle=False), 4,
                      state_name=None) as buf:
        buf.extend(make_rollouts(5, 2, seed=0, prompt_mean=4, completion_mean=4))
        assert [b["rows"].tolist() for b in buf] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        buf.sampler = PromptGroupSampler(num_groups=2)
        with pytest.raises(SamplerError, match="RandomSampler"):
            next(iter(buf))


def test_sample_reuses_its_buffers_until_the_next_sample(tmp_path):
    rb = ReplayBuffer(ReplayStore(tmp_path / "s"), PromptGroupSampler(samples_per_group=4, seed=0), batch_size=8,
                      pad_token_id=5, reuse_buffers=True)
    rb.extend(make_rollouts(6, 4, seed=0, prompt_mean=10, completion_mean=12, layout="trl"))
    # buffers grow (with headroom) until they hold the widest batch, then every sample reuses them
    ptrs = {rb.sample()["completion_ids"].data_ptr() for _ in range(30)}
    assert len(ptrs) <= 4, len(ptrs)  # no fresh batch per call
    first = rb.sample()
    kept = {k: v.clone() for k, v in first.items() if isinstance(v, torch.Tensor)}
    second = rb.sample()
    assert second["completion_ids"].data_ptr() == first["completion_ids"].data_ptr()
    for k, v in second.items():
        if k != "rows" and isinstance(v, torch.Tensor):
            assert torch.equal(v, collate(rb.store.read(second["rows"].numpy()), 5)[k]), k
    assert not all(torch.equal(kept[k], first[k]) for k in kept)  # the first one was overwritten, as documented
    # its rows too (checked above against the newest batch's data): a batch never disagrees with itself
    assert first["rows"].data_ptr() == second["rows"].data_ptr() and torch.equal(first["rows"], second["rows"])
    rb.close()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_batches_own_their_memory_by_default(tmp_path, layout):
    from diskreplay import collate_packed

    def expected(b):
        batch = rb.store.read(b["rows"].numpy())
        return collate(batch, 5) if layout == "padded" else collate_packed(batch)

    with ReplayBuffer(ReplayStore(tmp_path / "s"), PromptGroupSampler(samples_per_group=4, seed=0), batch_size=8,
                      pad_token_id=5, layout=layout, state_name=None) as rb:
        rb.extend(make_rollouts(6, 4, seed=0, prompt_mean=10, completion_mean=12, layout="trl"))
        kept = [rb.sample() for _ in range(12)]
        for b in kept:  # every batch still holds the rows it names, after the draws that followed it
            for k, v in expected(b).items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(b[k], v), k
        assert len({b["completion_ids" if layout == "padded" else "input_ids"].data_ptr() for b in kept}) == 12


def test_list_of_an_iteration_keeps_data_and_rows_together(tmp_path):
    with ReplayBuffer(ReplayStore(tmp_path / "s"), RandomSampler(shuffle=False), 4, state_name=None) as rb:
        rb.extend({"prompt_id": list(range(10)), "x": list(range(100, 110))})
        batches = list(rb)
        assert [b["rows"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert [b["x"].tolist() for b in batches] == [[100, 101, 102, 103], [104, 105, 106, 107], [108, 109]]


def test_packed_layout(tmp_path):
    from diskreplay import collate_packed

    with ReplayBuffer(ReplayStore(tmp_path / "s"), PromptGroupSampler(samples_per_group=4, seed=0), batch_size=8,
                      layout="packed") as buf:
        buf.extend(make_rollouts(6, 4, seed=0, prompt_mean=10, completion_mean=12, layout="trl"))
        s = buf.sample()
        want = collate_packed(buf.store.read(s["rows"].numpy()))
        assert set(s) == set(want) | {"rows"}
        assert all(torch.equal(s[k], v) if isinstance(v, torch.Tensor) else s[k] == v for k, v in want.items())


def test_a_saved_state_of_another_sampler_says_how_to_start_afresh(tmp_path):
    """ReplayBuffer's default state_name met the state of another sampler class (offline replay of a
    store trained with SSR): the error named neither the state nor state_name=None."""
    from diskreplay import PrioritizedSampler, PromptGroupSampler, ReplayBuffer, SamplerError

    path = str(tmp_path / "s")
    with ReplayBuffer(ReplayStore(path), PrioritizedSampler(seed=0), 4) as buffer:
        buffer.store.extend({"prompt_id": [0, 0, 1, 1], "completion_ids": [[1], [2], [3], [4]],
                             "advantages": np.float32([1, 2, 3, 4])})
        buffer.sample()
    with pytest.raises(SamplerError, match="state_name='replay_buffer'.*state_name=None"):
        ReplayBuffer(ReplayStore(path, readonly=True), PromptGroupSampler(num_groups=1), 4)
    with ReplayBuffer(ReplayStore(path, readonly=True), PromptGroupSampler(num_groups=1), 2,
                      state_name=None) as buffer:
        assert len(buffer.sample()["rows"]) == 2
