"""A rollout stream's trainer ranks in real processes (torchrun, gloo, CPU): while another process
keeps committing, every rank's slice of each global batch is whole groups, the slices are
disjoint, no row is handed out twice over the run, and ranks that restart from the committed
cursor go on where it was.

This file is also the worker torchrun starts: ``python -m torch.distributed.run ...
tests/test_stream_ranks.py OUT STORE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

try:
    from tests.torchrun import ROOT, child_env, torchrun
except ImportError:  # run by torchrun as a script
    from torchrun import ROOT, child_env, torchrun

GROUP, BATCH, STEPS, RESTART_AT = 4, 8, 12, 6   # BATCH rows per rank per step


def _worker(out_dir: str, path: str) -> None:
    import time

    import torch.distributed as dist

    from diskreplay import ReplayStore
    from diskreplay.stream import RolloutStream

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    store = ReplayStore(path) if rank == 0 else ReplayStore(path, readonly=True)  # only rank 0 commits
    stream = RolloutStream(store, "trainer", group_size=GROUP, rank=rank, world_size=world)
    steps = []
    for step in range(STEPS):
        if step == RESTART_AT:  # every rank restarts from the committed cursor
            stream.save()
            dist.barrier()
            stream = RolloutStream(store, "trainer", group_size=GROUP, rank=rank, world_size=world)
        time.sleep(0.01 * rank)  # the ranks' own views of the store differ
        rows = stream.next(BATCH, timeout=60)
        steps.append(None if rows is None else rows.tolist())
    stream.save()
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
        json.dump({"steps": steps, "keys": [store.read(np.asarray(r, np.int64), columns=["prompt_id"])
                                            ["prompt_id"].tolist() for r in steps if r]}, fh)
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def test_ranks_take_disjoint_whole_groups_of_one_stream(tmp_path):
    from diskreplay import ReplayStore

    path = str(tmp_path / "store")
    ReplayStore(path, multi_writer=True).close()
    code = f"""
import time, numpy as np
from diskreplay import ReplayStore
with ReplayStore({path!r}) as store:
    for step in range(400):
        # two samples of each of 2 prompts now, the other two of each in the next commit
        prompts = np.repeat(np.arange(2) + 2 * (step // 2), 2)
        store.extend({{"prompt_id": prompts, "rewards": np.zeros(4)}})
        time.sleep(0.003)
"""
    writer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=child_env())
    try:
        torchrun(__file__, [str(tmp_path), path], nproc=2, timeout=240)
    finally:
        writer.wait(timeout=120)
    ranks = [json.load(open(tmp_path / f"rank-{r}.json")) for r in range(2)]
    seen = []
    for step in range(STEPS):
        parts = [r["steps"][step] for r in ranks]
        assert all(p is not None and len(p) == BATCH for p in parts), parts
        assert not set(parts[0]) & set(parts[1]), f"step {step}: the ranks overlap"
        seen.extend(parts[0] + parts[1])
    assert len(seen) == len(set(seen)), "a row handed out twice"
    for r in ranks:
        for keys in r["keys"]:
            groups = np.asarray(keys).reshape(-1, GROUP)
            assert (groups == groups[:, :1]).all(), "a rank's slice splits a group"
    with ReplayStore(path, readonly=True) as store:
        state = store.load_state("stream.trainer")
        assert state["counts"]["handed_out"] == len(seen)
        assert set(seen).isdisjoint(state["pending"].tolist())
        assert sorted(seen + state["pending"].tolist()) == list(range(state["next_row"]))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
