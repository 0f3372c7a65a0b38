"""TorchRL on a repaired store: DiskReplayStorage's slots are its live rows, so TorchRL's own samplers
never draw a row of a hole (docs/FORMAT.md, "Manifests": holes)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
pytest.importorskip("torchrl")

from tensordict import TensorDict  # noqa: E402
from torchrl.data import ReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import RandomSampler, SamplerWithoutReplacement  # noqa: E402

from diskreplay import ReplayStore  # noqa: E402
from diskreplay.integrations.torchrl import DiskReplayStorage, DiskReplayWriter  # noqa: E402
from diskreplay.store import MergePolicy  # noqa: E402
from diskreplay.verify import repair_store, verify_store  # noqa: E402

from .conftest import flip_byte  # noqa: E402

ROWS = 16  # per commit: one segment each


def _damaged_store(path, max_size, commits):
    """``commits`` commits of ROWS rows (one segment each, column x = row id), one byte flipped in the
    middle live segment, repaired; the live row ids."""
    storage = DiskReplayStorage(path, max_size, merge_policy=MergePolicy(max_bytes=1))
    for c in range(commits):
        x = torch.arange(c * ROWS, (c + 1) * ROWS)
        storage.append(TensorDict({"x": x, "v": x[:, None].float().expand(-1, 64)}, [ROWS]))
    segs = storage.store.manifest.segments
    storage.close()
    bad = segs[len(segs) // 2]
    flip_byte(path, bad.file, bad.bytes // 2)
    repair_store(path)
    assert verify_store(path)["ok"]
    with ReplayStore(path, readonly=True) as store:
        assert store.holes == ((bad.first_row, bad.end_row),)
        return set(store.row_ids().tolist())


@pytest.mark.parametrize("max_size,commits", [(100, 3), (48, 4)], ids=["under-capacity", "wrapped"])
@pytest.mark.parametrize("sampler", [RandomSampler, SamplerWithoutReplacement])
def test_torchrl_samplers_never_draw_a_hole(tmp_path, max_size, commits, sampler):
    path = str(tmp_path / "s")
    live = _damaged_store(path, max_size, commits)
    torch.manual_seed(0)
    storage = DiskReplayStorage(path)
    rb = ReplayBuffer(storage=storage, sampler=sampler(), batch_size=8)
    assert len(storage) == len(rb) == len(live)
    drawn = []
    for _ in range(40):
        drawn += rb.sample()["x"].tolist()
    assert set(drawn) == live  # every live row drawn, none of the hole
    # every slot below len() is a live row, each once
    assert sorted(storage.get(torch.arange(len(storage)))["x"].tolist()) == sorted(live)
    # rows appended after the repair are drawn too, and the slots the writer returns are theirs
    rb = ReplayBuffer(storage=storage, writer=DiskReplayWriter(), sampler=sampler(), batch_size=8)
    new = torch.arange(1000, 1000 + ROWS)
    slots = rb.extend(TensorDict({"x": new, "v": new[:, None].float().expand(-1, 64)}, [ROWS]))
    assert storage.get(slots)["x"].tolist() == new.tolist()
    with ReplayStore(path, readonly=True) as store:
        live = set(store.row_ids().tolist())
    assert len(storage) == len(live)
    drawn = set()
    for _ in range(60):
        drawn |= set(rb.sample()["x"].tolist())
    assert set(new.tolist()) <= drawn and not drawn - set(new.tolist()) - live
    # TorchRL's default writer appends too (it follows the store), and its rows are drawn
    rb = ReplayBuffer(storage=storage, sampler=sampler(), batch_size=8)
    more = torch.arange(2000, 2000 + ROWS)
    rb.extend(TensorDict({"x": more, "v": more[:, None].float().expand(-1, 64)}, [ROWS]))
    with ReplayStore(path, readonly=True) as store:
        live = set(store.row_ids().tolist())
    assert len(storage) == len(live)
    drawn = set()
    for _ in range(80):
        drawn |= set(rb.sample()["x"].tolist())
    assert set(more.tolist()) <= drawn and not drawn - set(more.tolist()) - set(new.tolist()) - live
    storage.close()
