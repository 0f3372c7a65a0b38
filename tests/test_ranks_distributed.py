"""Trainer ranks in real processes (issue 9): torchrun, gloo, CPU.

2 and 4 ranks sample from one store while another process keeps appending to
it. Every rank pins the generation rank 0 broadcasts (``agree_generation``);
the ranks' draws must be disjoint slices of one global batch, equal to what
one sampler with ``world_size=1`` draws from that generation in another
process (so a rerun draws them again), and a rank resumed from its ``state_dict()`` mid-stream must go on
bit-exactly.

This file is also the worker torchrun starts: ``python -m torch.distributed.run
... tests/test_ranks_distributed.py OUT STORE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

try:
    from tests.torchrun import ROOT, child_env, torchrun
except ImportError:  # run by torchrun as a script: tests/ is not a package on sys.path then
    from torchrun import ROOT, child_env, torchrun
BATCH = 8          # rows per rank per draw
DRAWS = 4          # draws per sampler; a resumed copy takes over after RESUME_AT of them
RESUME_AT = 2


def _samplers(rank: int, world: int):
    from diskreplay import PrioritizedSampler, PromptGroupSampler, RandomSampler

    return {
        "group-random": PromptGroupSampler(samples_per_group=4, seed=3, rank=rank, world_size=world),
        "group-variance": PromptGroupSampler(samples_per_group=4, strategy="variance", seed=3, rank=rank,
                                             world_size=world),
        "uniform": RandomSampler(seed=3, rank=rank, world_size=world),
        "ssr": PrioritizedSampler(alpha=1.0, seed=3, rank=rank, world_size=world),
    }


def _draw(store, rank: int, world: int, batch: int = BATCH):
    """Every sampler's draws, and the draws of a copy resumed from its state after RESUME_AT of them."""
    out = {}
    for name, sampler in _samplers(rank, world).items():
        draws, state = [], None
        for i in range(DRAWS):
            if i == RESUME_AT:
                state = sampler.state_dict()
            draws.append(sampler.sample(store, batch).tolist())
        resumed = _samplers(rank, world)[name]
        resumed.load_state_dict(state)
        out[name] = {"draws": draws, "resumed": [resumed.sample(store, batch).tolist()
                                                 for _ in range(DRAWS - RESUME_AT)]}
    return out


def _worker(out_dir: str, path: str) -> None:
    import torch.distributed as dist

    from diskreplay import ReplayStore
    from diskreplay.samplers import agree_generation

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with ReplayStore(path, readonly=True) as follower:
        if rank != 0:
            time.sleep(0.2 * rank)  # the writer commits meanwhile: the ranks' own views differ
            follower.refresh()
        with agree_generation(follower) as snap:
            result = {"rank": rank, "generation": snap.generation, "head": snap.head, "next_row": snap.next_row,
                      "draws": _draw(snap, rank, world)}
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


FOLLOW_STEPS = 20


def _follow_worker(out_dir: str, path: str) -> None:
    """A ReplayLoader and a ReplayBuffer on a read-only store that a writer keeps appending to: each
    rank logs the rows of every batch (the ranks start and step a little apart: their own views differ)."""
    import torch.distributed as dist

    from diskreplay import ReplayBuffer, ReplayLoader, ReplayStore
    from diskreplay.samplers import PromptGroupSampler, RandomSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    time.sleep(0.05 * rank)
    out = {"loader": [], "buffer": []}
    with ReplayStore(path, readonly=True) as store:
        with ReplayLoader(store, PromptGroupSampler(samples_per_group=2, seed=5, rank=rank, world_size=world),
                          batch_size=4, pad_token_id=0, prefetch=2, num_batches=FOLLOW_STEPS) as loader:
            for batch in loader:
                out["loader"].append(batch["rows"].tolist())
                time.sleep(0.02 + 0.01 * rank)  # the writer commits meanwhile
    with ReplayBuffer(ReplayStore(path, readonly=True), RandomSampler(seed=5, rank=rank, world_size=world),
                      batch_size=4, state_name=None) as buffer:
        for _ in range(FOLLOW_STEPS):
            out["buffer"].append(buffer.sample()["rows"].tolist())
            time.sleep(0.02 + 0.01 * rank)
    with open(os.path.join(out_dir, f"follow-{rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- test


def _append_forever(path: str, stop_file: str) -> subprocess.Popen:
    code = f"""
import os, time
from diskreplay import ReplayStore
from diskreplay.synthetic import make_rollouts
with ReplayStore({path!r}) as store:
    i = 0
    while not os.path.exists({stop_file!r}):
        store.extend(make_rollouts(4, 4, seed=100 + i, prompt_mean=6, completion_mean=8))
        i += 1
        time.sleep(0.02)
"""
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=child_env())


def _ranks_next_to_a_writer(tmp_path, world: int, first_rows: dict, mode: str = "rank", **options):
    """``(store path, each rank's output)`` of a torchrun job of ``world`` ranks (``mode``: this
    file's worker, "rank", or "follow") on a multi-writer store that another process appends to."""
    from diskreplay import ReplayStore

    path = str(tmp_path / "store")
    with ReplayStore(path, multi_writer=True, **options) as store:  # retains a pinned generation's files an hour
        store.extend(first_rows)
    stop = str(tmp_path / "stop")
    writer = _append_forever(path, stop)
    try:
        out = tmp_path / "run"
        out.mkdir()
        torchrun(__file__, [str(out), path, mode], world, 240)
        ranks = [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(world)]
    finally:
        open(stop, "w").close()
        writer.wait(timeout=60)
    assert writer.returncode == 0
    return path, ranks


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_draw_disjoint_slices_of_one_global_batch_while_a_writer_appends(tmp_path, world):
    from diskreplay import ReplayStore
    from diskreplay.synthetic import make_rollouts

    path, ranks = _ranks_next_to_a_writer(tmp_path, world, make_rollouts(16, 4, seed=0, prompt_mean=6,
                                                                         completion_mean=8))
    gens = {r["generation"] for r in ranks}
    assert len(gens) == 1, f"the ranks sampled different generations: {gens}"
    with ReplayStore(path, readonly=True, generation=gens.pop()) as snap:
        single = _draw(snap, 0, 1, BATCH * world)  # one sampler drawing the global batch
        groups = snap.group_index()
        group_of = {int(row): g for g in range(len(groups)) for row in groups.group(g)}
    for name in single:
        for i in range(DRAWS):
            per_rank = [r["draws"][name]["draws"][i] for r in ranks]
            whole = single[name]["draws"][i]
            assert sum(per_rank, []) == whole, (name, i)  # rank r holds the r-th slice of the global batch
            if name != "ssr":  # SSR draws with replacement; the others never repeat a row in a batch
                assert len(set(whole)) == len(whole), (name, i)
            if name.startswith("group"):  # whole groups stay on one rank
                owners = [{group_of[row] for row in rows} for rows in per_rank]
                for a in range(world):
                    for b in range(a + 1, world):
                        assert not owners[a] & owners[b], (name, i, a, b)
        for r in ranks:  # a rank resumed from its state goes on exactly as it would have
            assert r["draws"][name]["resumed"] == r["draws"][name]["draws"][RESUME_AT:], (name, r["rank"])


@pytest.mark.slow
def test_a_loader_and_a_buffer_of_ranks_follow_a_writer_together(tmp_path):
    """Ranks refreshing a reader on their own sat on both sides of a commit and drew overlapping rows;
    their loaders and buffers now move to rank 0's newest commit together: every step's batches of
    the ranks are disjoint while the writer appends, and the store's new rows do get drawn."""
    from diskreplay.synthetic import make_rollouts

    # a few live groups (the writer's 16-row commits evict the oldest): draws of two generations collide
    _, ranks = _ranks_next_to_a_writer(tmp_path, 2, make_rollouts(4, 2, seed=0, prompt_mean=6, completion_mean=8),
                                       "follow", capacity=128)
    for kind in ("loader", "buffer"):
        steps = list(zip(*(r[kind] for r in ranks)))
        assert len(steps) == FOLLOW_STEPS
        for i, (a, b) in enumerate(steps):
            assert not set(a) & set(b), (kind, i, a, b)
        assert max(max(a + b) for a, b in steps) >= 8, kind  # rows committed after the start were drawn


if __name__ == "__main__":
    (_follow_worker if sys.argv[3] == "follow" else _worker)(sys.argv[1], sys.argv[2])
