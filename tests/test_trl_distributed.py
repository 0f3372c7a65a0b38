"""DiskReplayGRPOTrainer in a real 2-process run: torchrun, gloo, CPU, nothing downloaded.

The test launches this file under ``torch.distributed.run`` with two workers.
Each worker trains the tiny Qwen2 of ``tests/test_trl.py`` with three
configurations (repo, ssr, repo with ``replay_append``), checks what needs the
live trainer (replayed rows reached the loss with their stored old log-probs,
``num_items_in_batch`` counts the tokens of both processes, each stored reward
is the reward of that row's own completion), and writes a JSON summary. The
test then opens both per-rank stores read-only.

The ``append`` configuration gives the two processes different data, so that
process 0 has stored generations of its prompts to append and process 1 has
none: TRL's loss gathers per-row tensors across processes, so both must still
see batches of the same size.

Workers leave with ``os._exit`` after a barrier: with gloo, an interpreter that
finalizes while a gloo worker thread still drops its last work objects aborts
("terminate called without an active exception", cf. pytorch/pytorch#190489),
even after ``destroy_process_group()``; a plain ``GRPOTrainer`` run hits it in
about a third of the launches here.
"""

import json
import math
import os
import sys
import time

import numpy as np
import pytest

pytest.importorskip("trl")

try:
    from tests.torchrun import torchrun
except ImportError:  # run by torchrun as a script: tests/ is not a package on sys.path then
    from torchrun import torchrun
WORLD = 2
STEPS = 3
PER_DEVICE = 8
PROMPTS = ["count: 1 2 3", "spell: abc", "say: hi", "echo: xyz"]
# append: process 0 sees one prompt over and over, process 1 eight distinct ones (a single epoch in 2 steps)
APPEND_PROMPTS = (["repeat: a"] * 8, [f"fresh: {c}" for c in "abcdefgh"])
CONFIGS = {
    "repo": dict(replay_mode="repo", replay_k=2),
    "ssr": dict(replay_mode="ssr", ssr_replay_fraction=0.5),
    "append": dict(replay_mode="repo", replay_k=2, replay_append=True, max_steps=2),
}

# TRL and transformers warn about their own deprecations and generation settings
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]


# --------------------------------------------------------------------------- worker (run by torchrun)


def _worker(out_dir):
    import warnings

    warnings.simplefilter("ignore")
    from datasets import Dataset

    from diskreplay import ReplayStore
    from diskreplay.integrations.trl import DiskReplayGRPOConfig
    from tests.test_trl import (ProbeTrainer, assert_finite_losses, assert_replayed_rows_reached_the_loss,
                                lowercase_reward, make_model, make_tokenizer)

    class DrawCounter(ProbeTrainer):
        """Also keeps how many rows each generation drew, before the processes agree on a count."""

        def __init__(self, *args, **kwargs):
            self.drawn = []
            super().__init__(*args, **kwargs)

        def _plan(self, *args, **kwargs):
            plan = super()._plan(*args, **kwargs)
            self.drawn.append(len(plan))
            return plan

    trainer = None
    for name, opts in CONFIGS.items():
        kw = dict(output_dir=os.path.join(out_dir, name, "out"), replay_store_path=os.path.join(out_dir, name, "store"),
                  per_device_train_batch_size=PER_DEVICE, num_generations=4, max_completion_length=10,
                  max_steps=STEPS, learning_rate=1e-2, report_to=[], use_cpu=True, bf16=False, fp16=False,
                  save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True)
        kw.update(opts)
        args = DiskReplayGRPOConfig(**kw)
        rank = args.process_index
        prompts = APPEND_PROMPTS[rank] if name == "append" else PROMPTS
        trainer = DrawCounter(model=make_model(), reward_funcs=lowercase_reward, args=args,
                         train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=make_tokenizer())
        trainer.train()
        acc = trainer.accelerator
        assert acc.num_processes == WORLD and str(acc.distributed_type).endswith("MULTI_CPU")

        tok = make_tokenizer()
        with ReplayStore(os.path.join(args.replay_store_path, f"rank-{rank:05d}"), readonly=True) as store:
            got = store.read(store.row_ids(), ["completion_ids", "rewards"])
            texts = tok.batch_decode([np.asarray(c).tolist() for c in got["completion_ids"]],
                                     skip_special_tokens=True)
            # the reward stored with a row is that row's own, not another process's
            np.testing.assert_allclose(got["rewards"], lowercase_reward(texts), rtol=1e-5, atol=1e-6)
            for h in trainer.replay_history:
                if len(h["replayed_rows"]):
                    assert_replayed_rows_reached_the_loss(trainer, store, h["replayed_rows"])
        assert_finite_losses(trainer)
        sizes = []
        for batch in trainer.loss_batches:
            mask = batch["completion_mask"]
            tokens = int(acc.gather(mask.sum().reshape(1)).sum())
            if batch.get("num_items_in_batch") is not None:
                assert int(batch["num_items_in_batch"]) == tokens
            sizes.append(int(batch["prompt_ids"].shape[0]))
        summary = {"rank": rank, "sizes": sizes, "drawn": trainer.drawn, "losses": trainer.losses,
                   "replayed": [len(h["replayed_rows"]) for h in trainer.replay_history],
                   "steps": [int(h["global_step"]) for h in trainer.replay_history],
                   "log_history": trainer.state.log_history}
        with open(os.path.join(out_dir, name, f"result-{rank}.json"), "w") as fh:
            json.dump(summary, fh, default=float)
    trainer.accelerator.wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalization: see the module docstring


# --------------------------------------------------------------------------- test


def _launch(out_dir, timeout=180):
    return torchrun(__file__, [str(out_dir)], WORLD, timeout)


def _results(out_dir, name):
    res = []
    for rank in range(WORLD):
        with open(os.path.join(out_dir, name, f"result-{rank}.json")) as fh:
            res.append(json.load(fh))
    return res


def test_two_processes_write_one_store_each_and_replay(tmp_path):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    from diskreplay import ReplayStore
    from diskreplay.integrations.trl import prompt_key
    from tests.test_trl import make_tokenizer

    start = time.monotonic()
    _launch(tmp_path)
    elapsed = time.monotonic() - start

    for name in ("repo", "ssr"):
        results = _results(tmp_path, name)
        assert sorted(os.listdir(tmp_path / name / "store")) == ["rank-00000", "rank-00001"]
        for rank, res in enumerate(results):
            with ReplayStore(tmp_path / name / "store" / f"rank-{rank:05d}", readonly=True) as store:
                # every row this process generated, and only those: PER_DEVICE per step
                assert len(store) == STEPS * PER_DEVICE
                versions = store.read(store.row_ids(), ["policy_version"])["policy_version"]
                assert versions.tolist() == [s for s in range(STEPS) for _ in range(PER_DEVICE)]
            assert res["steps"] == list(range(STEPS)) and res["replayed"][0] == 0
            assert res["sizes"] == [PER_DEVICE] * STEPS
            assert all(math.isfinite(x) for x in res["losses"])
        if name == "ssr":  # half of every later batch, on each process
            assert all(res["replayed"][1:] == [PER_DEVICE // 2] * (STEPS - 1) for res in results)
        else:  # RePO replays k rows per prompt group that has stored generations
            assert all(n % 2 == 0 for res in results for n in res["replayed"])
            assert sum(sum(res["replayed"]) for res in results) > 0
        # the two processes generated different rows
        with ReplayStore(tmp_path / name / "store" / "rank-00000", readonly=True) as a, \
                ReplayStore(tmp_path / name / "store" / "rank-00001", readonly=True) as b:
            ca = [c.tolist() for c in a.read(a.row_ids(), ["completion_ids"])["completion_ids"]]
            cb = [c.tolist() for c in b.read(b.row_ids(), ["completion_ids"])["completion_ids"]]
            assert ca != cb
        logged = [h for h in results[0]["log_history"] if "replay/fraction" in h]
        assert len(logged) == STEPS and logged[0]["replay/fraction"] == 0
        assert all(math.isfinite(h["loss"]) for h in results[0]["log_history"] if "loss" in h)
        if name == "ssr":
            assert all(h["replay/fraction"] == 0.5 for h in logged[1:])

    # append: process 0 drew 2 x 2 rows at step 1, process 1 none; both appended the same number (none)
    results = _results(tmp_path, "append")
    assert results[0]["drawn"] == [0, 4] and results[1]["drawn"] == [0, 0]
    assert results[0]["sizes"] == results[1]["sizes"] == [PER_DEVICE, PER_DEVICE]
    tok = make_tokenizer()
    for rank in range(WORLD):
        with ReplayStore(tmp_path / "append" / "store" / f"rank-{rank:05d}", readonly=True) as store:
            keys = set(store.read(store.row_ids(), ["prompt_id"])["prompt_id"].tolist())
        want = {prompt_key(tok(p)["input_ids"]) for p in APPEND_PROMPTS[rank]}
        assert keys <= want and (len(keys) == 1 if rank == 0 else len(keys) == 4)
    print(f"2-process run: {elapsed:.1f} s")


if __name__ == "__main__":
    _worker(sys.argv[1])
