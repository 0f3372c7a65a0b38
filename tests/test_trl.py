"""Real GRPOTrainer steps on CPU with replay from disk (no mocks of TRL, nothing downloaded).

A 2-layer Qwen2 with a 98-token character vocabulary, a tokenizer built with
``tokenizers``, two prompts and rule-based rewards: a few optimizer steps per
replay mode, checking that the store grew by every generated row, that the
replayed rows reached the loss with their stored old log-probs, that the
batch keeps the parent's keys, dtypes and size, and that a resumed run
continues the store and the sampler.
"""

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from diskreplay import ReplayConfigError, ReplayStore  # noqa: E402
from diskreplay.synthetic import char_tokenizer  # noqa: E402
from diskreplay.integrations.trl import DiskReplayGRPOConfig, DiskReplayGRPOTrainer, prompt_key  # noqa: E402
from diskreplay.integrations.trl.checkpoint import checkpoint_state_path, load_checkpoint_state  # noqa: E402

# TRL and transformers warn about their own deprecations and generation settings
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

PAD, EOS, BOS = 0, 1, 2


def make_tokenizer():
    return char_tokenizer()


def make_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=98, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def lowercase_reward(completions, **kwargs):
    return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


def const_or_lowercase_reward(prompts, completions, **kwargs):
    """1.0 for every completion of a 'const' prompt (a zero-spread group), else the lowercase share."""
    return [1.0 if p.startswith("const") else r for p, r in zip(prompts, lowercase_reward(completions))]


PROMPTS = ["count: 1 2 3", "spell: abc"]


def make_config(tmp_path, name="run", **kw):
    base = dict(output_dir=str(tmp_path / name / "out"), replay_store_path=str(tmp_path / name / "store"),
                per_device_train_batch_size=8, num_generations=4, max_completion_length=10, max_steps=3,
                learning_rate=1e-2, report_to=[], use_cpu=True, bf16=False, fp16=False, save_strategy="no",
                logging_steps=1, seed=0, disable_tqdm=True)
    base.update(kw)
    return DiskReplayGRPOConfig(**base)


class ProbeTrainer(DiskReplayGRPOTrainer):
    """Keeps a copy of every batch the loss sees and every loss value."""

    def __init__(self, *args, **kwargs):
        self.loss_batches, self.losses = [], []
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.loss_batches.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                  for k, v in inputs.items()})
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append(float(loss.detach()))
        return loss


@pytest.fixture
def parent_outputs(monkeypatch):
    """Record what GRPOTrainer's own _generate_and_score_completions returns."""
    seen = []
    original = GRPOTrainer._generate_and_score_completions

    def wrapper(self, inputs):
        out = original(self, inputs)
        seen.append({k: (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else v
                     for k, v in out.items()})
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", wrapper)
    return seen


class StopAt(TrainerCallback):
    """Ends training after ``step`` optimizer steps, as a preempted job would (after saving)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def train(tmp_path, prompts=PROMPTS, reward=lowercase_reward, resume=None, stop_at=None, **kw):
    trainer = ProbeTrainer(model=make_model(), reward_funcs=reward, args=make_config(tmp_path, **kw),
                           train_dataset=Dataset.from_dict({"prompt": list(prompts)}),
                           processing_class=make_tokenizer(),
                           callbacks=None if stop_at is None else [StopAt(stop_at)])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def open_store(trainer):
    return ReplayStore(trainer.args.replay_store_path, readonly=True)


def loss_rows(trainer, batches=None):
    """(prompt tokens, completion tokens, old log-probs or None, advantage) of every row the loss saw."""
    rows = []
    for b in trainer.loss_batches if batches is None else batches:
        old = b.get("old_per_token_logps")
        for i in range(b["prompt_ids"].shape[0]):
            pm, cm = b["prompt_mask"][i].bool(), b["completion_mask"][i].bool()
            rows.append((b["prompt_ids"][i][pm].tolist(), b["completion_ids"][i][cm].tolist(),
                         None if old is None else old[i][cm], float(b["advantages"][i])))
    return rows


def assert_replayed_rows_reached_the_loss(trainer, store, rows):
    """Each stored row in ``rows`` is in some loss batch with exactly its stored old log-probs."""
    seen = loss_rows(trainer)
    got = store.read(rows, ["prompt_ids", "completion_ids", "old_per_token_logps"])
    for i in range(len(rows)):
        p, c = got["prompt_ids"][i].tolist(), got["completion_ids"][i].tolist()
        old = torch.from_numpy(np.asarray(got["old_per_token_logps"][i]))
        hits = [r for r in seen if r[0] == p and r[1] == c]
        assert hits, f"replayed row {rows[i]} never reached the loss"
        assert any(r[2] is not None and torch.equal(r[2], old) for r in hits), \
            f"replayed row {rows[i]} reached the loss without its stored old log-probs"


def assert_finite_losses(trainer):
    assert trainer.losses and all(math.isfinite(x) for x in trainer.losses)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged and all(math.isfinite(float(x)) for x in logged)


# --------------------------------------------------------------------------- tests


def test_import_is_lazy():
    code = "import sys, diskreplay; assert 'trl' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_off_records_every_row_and_keeps_the_batch(tmp_path, parent_outputs):
    trainer = train(tmp_path, replay_mode="off")
    with open_store(trainer) as store:
        assert len(store) == 3 * 8
        got = store.read(store.row_ids(), ["policy_version", "prompt_id", "rewards", "old_per_token_logps",
                                           "completion_ids", "advantages"])
        assert got["policy_version"].tolist() == [0] * 8 + [1] * 8 + [2] * 8
        tok = make_tokenizer()
        assert set(got["prompt_id"].tolist()) == {prompt_key(tok(p)["input_ids"]) for p in PROMPTS}
        # behaviour log-probs were computed although TRL skipped them (num_iterations=1)
        assert got["old_per_token_logps"] is not None
        assert all(len(got["old_per_token_logps"][i]) == len(got["completion_ids"][i]) for i in range(24))
        assert np.all(np.asarray(got["old_per_token_logps"].values) <= 0)
        # the stored per-row reward is the one TRL logged
        logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        np.testing.assert_allclose(got["rewards"].reshape(3, 8).mean(axis=1), logged, rtol=1e-5)
        assert store.load_state("trl.replay")["replay_mode"] == "off"
    assert all(h["replay_fraction"] == 0 for h in trainer.replay_history)
    # off mode hands the parent's batch through untouched
    for parent, batch in zip(parent_outputs, trainer.loss_batches):
        assert set(batch) == set(parent) and "old_per_token_logps" not in batch
    assert_finite_losses(trainer)


def test_repo_replays_past_generations_of_the_same_prompts(tmp_path, parent_outputs):
    trainer = train(tmp_path, replay_mode="repo", replay_k=2, replay_strategy="recency")
    history = list(trainer.replay_history)
    assert [h["global_step"] for h in history] == [0, 1, 2]
    assert len(history[0]["replayed_rows"]) == 0  # nothing stored yet
    with open_store(trainer) as store:
        assert len(store) == 3 * 8
        for h in history[1:]:
            rows = h["replayed_rows"]
            assert len(rows) == 2 * 2 and h["replay_fraction"] == 0.5 and h["batch_size"] == 8
            assert h["policy_lag_mean"] >= 1
            got = store.read(rows, ["prompt_id", "policy_version"])
            assert (got["policy_version"] < h["global_step"]).all()
            # RePO: each replayed row takes the place of a fresh row of the same prompt
            fresh_keys = store.read(h["fresh_rows"], ["prompt_id"])["prompt_id"]
            assert (got["prompt_id"] == fresh_keys[h["positions"]]).all()
            # recency: the newest stored generations of that prompt
            assert got["policy_version"].tolist() == [h["global_step"] - 1] * 4
            assert_replayed_rows_reached_the_loss(trainer, store, rows)
    for parent, batch in zip(parent_outputs, trainer.loss_batches):
        assert batch["prompt_ids"].shape[0] == 8
        for k, (shape, dtype, device) in parent.items():
            if k != "num_items_in_batch":
                assert batch[k].dtype == dtype and batch[k].device == device and batch[k].shape[0] == shape[0]
    # the replaying steps carry old log-probs for every row; the first step is the parent's batch
    assert "old_per_token_logps" not in trainer.loss_batches[0]
    assert all("old_per_token_logps" in b for b in trainer.loss_batches[1:])
    assert_finite_losses(trainer)


def test_repo_append_grows_the_batch_and_recounts_tokens(tmp_path):
    trainer = train(tmp_path, replay_mode="repo", replay_k=1, replay_append=True, loss_type="dapo",
                    recompute_advantages=True, max_steps=2)
    h = trainer.replay_history[-1]
    assert len(h["replayed_rows"]) == 2 and h["batch_size"] == 10
    batch = trainer.loss_batches[-1]
    assert batch["prompt_ids"].shape[0] == 10
    assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())
    with open_store(trainer) as store:
        assert len(store) == 2 * 8
        assert_replayed_rows_reached_the_loss(trainer, store, h["replayed_rows"])
        # recomputed advantages: the stored reward in a group of this step's fresh rows of the same prompt
        # and itself (as TRL's rows are in their group)
        fresh = store.read(h["fresh_rows"], ["prompt_id", "rewards"])
        got = store.read(h["replayed_rows"], ["prompt_id", "rewards", "completion_ids"])
        seen = {tuple(x[1]): x[3] for x in loss_rows(trainer, [batch])}
        for i in range(2):
            ref = np.append(fresh["rewards"][fresh["prompt_id"] == got["prompt_id"][i]], got["rewards"][i])
            ref = ref.astype(np.float64)
            want = (got["rewards"][i] - ref.mean()) / (ref.std(ddof=1) + 1e-4)
            assert seen[tuple(got["completion_ids"][i].tolist())] == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert_finite_losses(trainer)


def test_ssr_with_gradient_accumulation_and_num_iterations(tmp_path, parent_outputs):
    # 2 micro-batches of 4 per generation, each generation used for 2 iterations: 4 optimizer steps =
    # generations at steps 0 and 2; TRL computes old log-probs itself here
    trainer = train(tmp_path, replay_mode="ssr", ssr_replay_fraction=0.5, ssr_capacity_scalar=1,
                    per_device_train_batch_size=4, gradient_accumulation_steps=2, num_iterations=2, max_steps=4)
    assert all("old_per_token_logps" in p for p in parent_outputs)
    history = list(trainer.replay_history)
    assert [h["global_step"] for h in history] == [0, 2]
    h = history[1]
    assert len(h["replayed_rows"]) == 4 and h["batch_size"] == 8
    with open_store(trainer) as store:
        assert len(store) == 2 * 8
        assert (h["replayed_rows"] < 8).all()  # the window holds the previous generation only
        # the rows that gave way are those with the smallest |advantage|
        adv = np.abs(store.read(h["fresh_rows"], ["advantages"])["advantages"])
        assert adv[h["positions"]].max() <= np.delete(adv, h["positions"]).min()
        assert_replayed_rows_reached_the_loss(trainer, store, h["replayed_rows"])
    assert len(trainer.loss_batches) == 8 and all(b["prompt_ids"].shape[0] == 4 for b in trainer.loss_batches)
    assert_finite_losses(trainer)


def test_swap_zero_std_swaps_in_groups_with_spread(tmp_path):
    prompts = ["const: x", "vary: y"]
    trainer = train(tmp_path, prompts=prompts, reward=const_or_lowercase_reward, replay_mode="swap_zero_std",
                    recompute_advantages=True)
    tok = make_tokenizer()
    const_key, vary_key = (prompt_key(tok(p)["input_ids"]) for p in prompts)
    history = list(trainer.replay_history)
    assert len(history[0]["replayed_rows"]) == 0
    with open_store(trainer) as store:
        for h in history[1:]:
            fresh = store.read(h["fresh_rows"], ["prompt_id"])["prompt_id"]
            assert sorted(fresh[h["positions"]].tolist()) == [const_key] * 4  # the zero-spread group gave way
            got = store.read(h["replayed_rows"], ["prompt_id", "rewards", "advantages"])
            assert got["prompt_id"].tolist() == [vary_key] * 4 and np.ptp(got["rewards"]) > 0
            assert_replayed_rows_reached_the_loss(trainer, store, h["replayed_rows"])
            # recomputed advantages: TRL's group normalisation over the replayed group
            r = got["rewards"].astype(np.float64)
            want = (r - r.mean()) / (r.std(ddof=1) + 1e-4)
            # one optimizer step per generation here, so loss batch i belongs to generation i
            seen = {tuple(x[1]): x[3] for x in loss_rows(trainer, trainer.loss_batches[h["global_step"]:][:1])}
            comp = store.read(h["replayed_rows"], ["completion_ids"])["completion_ids"]
            np.testing.assert_allclose([seen[tuple(comp[i].tolist())] for i in range(4)], want, rtol=1e-4)
            if h is history[1]:
                # step 1 can only replay step 0's group, whose stored advantages TRL computed the same way
                np.testing.assert_allclose(store.read(h["replayed_rows"], ["advantages"])["advantages"], want,
                                           rtol=1e-4, atol=1e-5)
    assert_finite_losses(trainer)


def test_restart_continues_the_store_and_the_sampler(tmp_path):
    # one prompt text: TRL's RepeatSampler restarts its shuffle on resume, so with distinct prompts the
    # resumed run would see them in another order than a run that never stopped
    opts = dict(replay_mode="ssr", ssr_replay_fraction=0.5, max_steps=4, prompts=["spell: abc"] * 2)
    first = train(tmp_path, name="resumed", save_strategy="steps", save_steps=2, stop_at=2, **opts)
    assert first.state.global_step == 2 and len(first.replay_history) == 2
    ckpt = os.path.join(first.args.output_dir, "checkpoint-2")
    saved = load_checkpoint_state(checkpoint_state_path(ckpt))
    assert saved.next_row == 16 and saved.store_path == os.path.abspath(first.args.replay_store_path)
    assert saved.global_step == 2 and saved.timeline.excluded == ()
    resumed = train(tmp_path, name="resumed", save_strategy="steps", save_steps=2, resume=ckpt, **opts)
    straight = train(tmp_path, name="straight", **opts)
    with open_store(resumed) as a, open_store(straight) as b:
        assert len(a) == len(b) == 4 * 8
        assert a.read(a.row_ids(), ["policy_version"])["policy_version"].tolist() == \
            [s for s in range(4) for _ in range(8)]
        # the sampler continued its stream: the same rows as a run that never stopped
        assert a.load_state("trl.replay")["sampler"]["position"]["rng"] == \
            b.load_state("trl.replay")["sampler"]["position"]["rng"]
        ra, rb = (list(t.replay_history) for t in (resumed, straight))
        assert [h["global_step"] for h in ra] == [2, 3]
        for ha, hb in zip(ra, rb[2:]):
            assert ha["replayed_rows"].tolist() == hb["replayed_rows"].tolist()
        # and the rollouts themselves match where the CPU run is deterministic
        ca = a.read(a.row_ids(), ["completion_ids"])["completion_ids"]
        cb = b.read(b.row_ids(), ["completion_ids"])["completion_ids"]
        assert all(ca[i].tolist() == cb[i].tolist() for i in range(32))
        assert_replayed_rows_reached_the_loss(resumed, a, ra[-1]["replayed_rows"])


def test_bad_input_fails_at_construction(tmp_path):
    def build(args, **kw):
        return DiskReplayGRPOTrainer(model=make_model(), reward_funcs=lowercase_reward, args=args,
                                     train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                     processing_class=make_tokenizer(), **kw)

    with pytest.raises(ValueError, match="replay_k=5 exceeds num_generations=4"):
        make_config(tmp_path, replay_mode="repo", replay_k=5)
    for mode in ("ssr", "off"):  # replay_k is RePO's: another mode does not read it
        assert make_config(tmp_path, replay_mode=mode, replay_k=100).replay_k == 100
    with pytest.raises(ValueError, match="replay_mode must be one of"):
        make_config(tmp_path, replay_mode="prioritized")
    with pytest.raises(ValueError, match="ssr_replay_fraction"):
        make_config(tmp_path, replay_mode="ssr", ssr_replay_fraction=0.0)
    with pytest.raises(ValueError, match="replay_append"):
        make_config(tmp_path, replay_mode="swap_zero_std", replay_append=True)
    with pytest.raises(ValueError, match="DiskReplayGRPOConfig"):
        build(GRPOConfig(output_dir=str(tmp_path / "plain"), per_device_train_batch_size=8, num_generations=4,
                         report_to=[], use_cpu=True))
    with pytest.raises(ValueError, match="replay_store_path is not set"):
        build(make_config(tmp_path, replay_mode="off", replay_store_path=None))

    # a store without advantages or old log-probs cannot serve SSR
    path = tmp_path / "bare"
    with ReplayStore(path) as store:
        store.extend({"prompt_id": [1, 1], "prompt_ids": [[5, 6], [5, 6]], "completion_ids": [[7], [8]],
                      "policy_version": [0, 0]})
    with pytest.raises(ValueError, match="advantages"):
        build(make_config(tmp_path, replay_mode="ssr", replay_store_path=str(path)))
    # a store opened read-only
    with ReplayStore(path, readonly=True) as ro:
        with pytest.raises(ValueError, match="read-only"):
            build(make_config(tmp_path, replay_mode="off", replay_store_path=None), replay_store=ro)
    # a capacity that disagrees with the store's
    with pytest.raises(ValueError, match="replay_capacity"):
        build(make_config(tmp_path, replay_mode="off", replay_store_path=str(path), replay_capacity=7))


# --------------------------------------------------------------------------- unscorable rewards (None -> NaN)


def two_scorable_rows(prompts, completions, **kwargs):
    """Per group of 4 (TRL lays groups out consecutively): rows 0 and 1 scored, rows 2 and 3 unscorable.

    'same' prompts score [1, 1, None, None] (TRL: no gradient), 'vary' prompts [1, 0, None, None],
    'const' prompts 1.0 everywhere.
    """
    out = []
    for i, p in enumerate(prompts):
        if p.startswith("const"):
            out.append(1.0)
        elif i % 4 >= 2:
            out.append(None)
        else:
            out.append(1.0 if i % 4 == 0 or p.startswith("same") else 0.0)
    return out


def trl_group_advantages(rewards):
    """TRL's advantages of one group: NaN rewards left out of mean and std, their advantage 0."""
    r = np.asarray(rewards, dtype=np.float64)
    ok = r[~np.isnan(r)]
    std = ok.std(ddof=1) if len(ok) > 1 else np.nan
    return np.nan_to_num((r - ok.mean()) / (std + 1e-4), nan=0.0)


def test_unscorable_rewards_are_nan_and_replayed_with_trl_advantages(tmp_path):
    # RePO with recomputed advantages: a group [1, 1, nan, nan] gives TRL no gradient, and its replayed rows
    # get none either (the bug: stored as [1, 1, 0, 0] and replayed with +-0.866)
    trainer = train(tmp_path, name="repo", prompts=["same: a", "same: b"], reward=two_scorable_rows,
                    replay_mode="repo", replay_k=2, recompute_advantages=True)
    with open_store(trainer) as store:
        got = store.read(store.row_ids(), ["rewards", "rewards_per_func", "advantages"])
        assert np.isnan(got["rewards"]).reshape(-1, 4)[:, 2:].all()
        assert (got["rewards"].reshape(-1, 4)[:, :2] == 1).all()
        assert np.isnan(got["rewards_per_func"][:, 0]).sum() == 12
        assert (got["advantages"] == 0).all()
    replayed = [h for h in trainer.replay_history if len(h["replayed_rows"])]
    assert replayed, "RePO replayed nothing"
    for batch in trainer.loss_batches:
        assert (batch["advantages"] == 0).all(), batch["advantages"]
    logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert logged == [1.0] * 3  # TRL's own reward log leaves the NaN rows out

    # swap_zero_std: the 'const' group has no spread, and neither would a stored [1, 1, nan, nan] group;
    # stored 'vary' groups [1, 0, nan, nan] have spread and replace it with TRL's NaN-aware advantages
    trainer = train(tmp_path, name="swap", prompts=["const: x", "vary: y"], reward=two_scorable_rows,
                    replay_mode="swap_zero_std", recompute_advantages=True)
    tok = make_tokenizer()
    vary_key = prompt_key(tok("vary: y")["input_ids"])
    history = [h for h in trainer.replay_history if len(h["replayed_rows"])]
    assert len(history) == 2
    with open_store(trainer) as store:
        for h in history:
            got = store.read(h["replayed_rows"], ["prompt_id", "rewards", "completion_ids"])
            assert got["prompt_id"].tolist() == [vary_key] * 4
            batch = trainer.loss_batches[h["global_step"]]
            seen = {tuple(x[1]): x[3] for x in loss_rows(trainer, [batch])}
            adv = [seen[tuple(got["completion_ids"][i].tolist())] for i in range(4)]
            np.testing.assert_allclose(adv, trl_group_advantages(got["rewards"]), rtol=1e-4, atol=1e-6)
            if h is history[0]:  # only step 0's group is stored: [1, 0, nan, nan]
                assert sorted(np.round(adv, 3).tolist()) == [-0.707, 0.0, 0.0, 0.707]
    assert_finite_losses(trainer)


# --------------------------------------------------------------------------- kill, resume, discarded rows


class BlockAt(TrainerCallback):
    """After optimizer step ``step``, writes ``marker`` and waits to be killed."""

    def __init__(self, step, marker):
        self.step, self.marker = step, marker

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            with open(self.marker, "w") as fh:
                fh.write(str(state.global_step))
            while True:
                time.sleep(1)
        return control


KILL_RUN = dict(name="killed", replay_mode="repo", replay_k=2, replay_strategy="recency", save_strategy="steps",
                save_steps=2, max_steps=8)


def _run_until_killed(tmp_path, marker):
    """The training subprocess of the kill test: checkpoints at step 2, blocks after step 4 (before saving)."""
    trainer = ProbeTrainer(model=make_model(), reward_funcs=lowercase_reward, args=make_config(tmp_path, **{
        k: v for k, v in KILL_RUN.items() if k != "name"}, name=KILL_RUN["name"]),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=make_tokenizer(),
        callbacks=[BlockAt(4, marker)])
    trainer.train()


def test_resume_after_sigkill_never_replays_rows_of_the_discarded_timeline(tmp_path):
    marker = tmp_path / "blocked"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    code = f"import pathlib, tests.test_trl as t; t._run_until_killed(pathlib.Path({str(tmp_path)!r}), {str(marker)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "the training subprocess never reached step 4"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    out = tmp_path / "killed" / "out"
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-2"]
    with ReplayStore(tmp_path / "killed" / "store", readonly=True) as store:
        # steps 0-3 generated 32 rows; the checkpoint saw 16
        assert store.next_row == 32
    assert load_checkpoint_state(checkpoint_state_path(str(out / "checkpoint-2"))).next_row == 16

    with pytest.warns(RuntimeWarning, match=r"16 row\(s\) \[16, 32\).*excluded from replay"):
        resumed = train(tmp_path, resume=True, stop_at=4, **KILL_RUN)
    assert resumed.excluded_rows == 16
    history = list(resumed.replay_history)
    assert [h["global_step"] for h in history] == [2, 3]
    for h in history:
        rows = h["replayed_rows"]
        assert len(rows) == 4 and not ((rows >= 16) & (rows < 32)).any(), rows
        assert h["policy_lag_mean"] >= 1  # the bug: -1 at step 2 (the discarded step-3 rows were the newest)
    with open_store(resumed) as store:
        assert len(store) == 48  # the discarded rows stay on disk
        versions = store.read(store.row_ids(), ["policy_version"])["policy_version"]
        assert versions.tolist() == [s for s in (0, 1, 2, 3, 2, 3) for _ in range(8)]
        assert store.load_state("trl.replay")["excluded"] == [[16, 32]]
        assert_replayed_rows_reached_the_loss(resumed, store, history[0]["replayed_rows"])
    # the offline tools leave the discarded rows out too (a DPO pair was made of one), and say so
    from diskreplay.export import export, preference_pairs, store_info

    path = str(tmp_path / "killed" / "store")
    res = export(path, str(tmp_path / "rows.jsonl"), columns=["policy_version"])
    assert (res["rows"], res["excluded_rows"], res["excluded_ranges"]) == (32, 16, [[16, 32]])
    res = preference_pairs(path, str(tmp_path / "pairs.jsonl"), include_excluded=False)
    assert res["excluded_rows"] == 16
    assert all(not 16 <= json.loads(line)[k] < 32 for line in open(tmp_path / "pairs.jsonl")
               for k in ("chosen_row", "rejected_row"))
    assert store_info(path)["excluded"]["ranges"] == [[16, 32]]
    # the checkpoint the resumed run wrote carries the exclusion, for the next resume
    saved = load_checkpoint_state(checkpoint_state_path(str(out / "checkpoint-4")))
    assert saved.timeline.excluded == ((16, 32),) and saved.next_row == 48
    assert_finite_losses(resumed)


def test_stores_that_cannot_serve_the_run_fail_at_construction(tmp_path):
    def build(**kw):
        return DiskReplayGRPOTrainer(model=make_model(), reward_funcs=lowercase_reward,
                                     args=make_config(tmp_path, **kw),
                                     train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                     processing_class=make_tokenizer())

    # everything SSR replays is there, but not rewards_per_func, which every step writes: the first step failed
    path = tmp_path / "no_rpf"
    with ReplayStore(path) as store:
        store.extend({"prompt_id": [1, 1], "prompt_ids": [[5, 6], [5, 6]], "completion_ids": [[7], [8]],
                      "old_per_token_logps": [[-1.0], [-2.0]], "policy_version": [0, 0],
                      "rewards": np.array([1.0, 0.0], dtype=np.float32),
                      "advantages": np.array([1.0, -1.0], dtype=np.float32)})
    with pytest.raises(ValueError, match=r"writes \['rewards_per_func'\] with every row"):
        build(replay_mode="ssr", replay_store_path=str(path))
    with ReplayStore(path):  # the failed trainer released the writer lock
        pass

    # a file is not a store directory (it used to say "denies writes")
    afile = tmp_path / "afile.txt"
    afile.write_text("not a store")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        build(replay_mode="off", replay_store_path=str(afile))
    assert afile.read_text() == "not a store"

    # a non-empty directory without a store (it used to be silently turned into one)
    other = tmp_path / "my_data"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="non-empty directory that holds no replay store"):
        build(replay_mode="off", replay_store_path=str(other))
    assert sorted(os.listdir(other)) == ["notes.txt"]

    # an empty directory is fine: the store is created in it
    empty = tmp_path / "empty"
    empty.mkdir()
    trainer = build(replay_mode="off", replay_store_path=str(empty))
    trainer.close_replay_store()
    with ReplayStore(empty, readonly=True) as store:
        assert len(store) == 0


def test_example_script_resume_starts_fresh_then_resumes(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tools", "train_grpo_replay.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    store = str(tmp_path / "replay")

    def run(steps):
        cmd = [sys.executable, script, "--steps", str(steps), "--save-steps", "2", "--batch-size", "8",
               "--store", store, "--resume"]
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    first = run(2)  # --resume on a fresh store: "No valid checkpoint found" before
    assert "starting fresh" in first and "done: 16 rows" in first
    second = run(3)
    assert "resuming from" in second and "checkpoint-2" in second and "done: 24 rows" in second


# --------------------------------------------------------------------------- late sampling log-probs


class VllmLikeTrainer(ProbeTrainer):
    """Applies TRL's importance-sampling correction in the loss wherever the batch carries a ratio
    (TRL does so only with ``use_vllm``; generation here stays on the CPU model), and records the
    loss of each such batch with the ratio replaced by ones."""

    def __init__(self, *args, **kwargs):
        self.corrected, self.uncorrected = [], []
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if inputs.get("importance_sampling_ratio") is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.use_vllm = True
        try:
            with torch.no_grad():
                ones = dict(inputs, importance_sampling_ratio=torch.ones_like(inputs["importance_sampling_ratio"]))
                self.uncorrected.append(float(GRPOTrainer.compute_loss(self, model, ones, False, num_items_in_batch)))
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.corrected.append(self.losses[-1])
            return loss
        finally:
            self.use_vllm = False


def test_sampling_logps_recorded_late_reach_the_importance_sampling_correction(tmp_path, monkeypatch):
    """vLLM's sampling log-probs start to be recorded at step 1 (a late column of the store): replayed
    rows of step 0 get no correction (ratio 1), replayed rows of step 1 a ratio from their stored
    behaviour and sampling log-probs, and that ratio is what TRL's loss multiplies by."""
    from diskreplay.integrations.trl.batch import importance_ratio

    original = GRPOTrainer._generate_and_score_completions

    def with_sampling_logps(self, inputs):
        out = original(self, inputs)
        if self.state.global_step >= 1:  # what TRL returns with vLLM and its correction on
            old = self._behaviour_logps(out)
            mask = out["completion_mask"]
            positions = torch.arange(mask.shape[1], dtype=old.dtype)[None, :]
            sampling = old - 0.1 * (1 + positions % 3) * mask  # vLLM's sampler disagreeing a little
            out["old_per_token_logps"] = old
            out["sampling_per_token_logps"] = sampling
            out["importance_sampling_ratio"] = importance_ratio(old, sampling, mask, "token_truncate", None, 3.0)
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", with_sampling_logps)
    trainer = VllmLikeTrainer(model=make_model(), reward_funcs=lowercase_reward,
                              args=make_config(tmp_path, replay_mode="repo", replay_k=2, replay_strategy="recency",
                                               vllm_importance_sampling_mode="token_truncate",
                                               vllm_importance_sampling_clip_max=3.0),
                              train_dataset=Dataset.from_dict({"prompt": list(PROMPTS)}),
                              processing_class=make_tokenizer())
    trainer.train()
    history = list(trainer.replay_history)
    with open_store(trainer) as store:
        assert store.schema.late["sampling_per_token_logps"] == (8, 2)  # added by step 1's commit
        stored = store.read(store.row_ids(), ["sampling_per_token_logps"])["sampling_per_token_logps"]
        assert stored.validity.tolist() == [False] * 8 + [True] * 16
        for step, computed in ((1, False), (2, True)):
            rows = history[step]["replayed_rows"]
            assert len(rows) == 4
            got = store.read(rows, ["prompt_ids", "completion_ids", "old_per_token_logps",
                                    "sampling_per_token_logps"])
            assert (got["sampling_per_token_logps"] is not None) == computed
            for i in range(len(rows)):
                p, c = got["prompt_ids"][i].tolist(), got["completion_ids"][i].tolist()
                old = torch.from_numpy(np.asarray(got["old_per_token_logps"][i]))
                want_sampling = torch.from_numpy(np.asarray(got["sampling_per_token_logps"][i])) if computed \
                    else old
                want_ratio = torch.exp(old - want_sampling).clamp(max=3.0)
                hits = [found for _, found in _loss_positions(trainer, p, c)]
                assert hits, f"replayed row {rows[i]} never reached the loss"
                assert any(torch.equal(s, want_sampling) and torch.allclose(r, want_ratio)
                           for s, r in hits), f"replayed row {rows[i]} reached the loss with another correction"
    # the ratio is part of the loss: with ones instead it differs wherever a row was corrected
    assert trainer.corrected and len(trainer.corrected) == len(trainer.uncorrected)
    assert any(abs(a - b) > 1e-6 for a, b in zip(trainer.corrected, trainer.uncorrected))
    assert_finite_losses(trainer)


def _loss_positions(trainer, prompt, completion):
    """``(sampling log-probs, ratio)`` over the completion of every loss-batch row with these tokens."""
    out = []
    for b in trainer.loss_batches:
        if b.get("importance_sampling_ratio") is None:
            continue
        for i in range(b["prompt_ids"].shape[0]):
            pm, cm = b["prompt_mask"][i].bool(), b["completion_mask"][i].bool()
            if b["prompt_ids"][i][pm].tolist() == prompt and b["completion_ids"][i][cm].tolist() == completion:
                out.append((b, (b["sampling_per_token_logps"][i][cm], b["importance_sampling_ratio"][i][cm])))
    return out


def test_truncated_completions_keep_their_tokens_and_stay_out_of_the_loss_when_replayed(tmp_path):
    """mask_truncated_completions zeroes the loss mask of a completion cut at max_completion_length:
    the store stripped it with that mask and kept an empty completion (with its reward and advantage);
    it now keeps the tokens, flags the row, and a replay masks it out of the loss as TRL did."""
    trainer = train(tmp_path, replay_mode="repo", replay_k=2, mask_truncated_completions=True,
                    max_completion_length=4, max_steps=4)
    with open_store(trainer) as store:
        rows = store.row_ids()
        got = store.read(rows, ["prompt_ids", "completion_ids", "completion_truncated"])
        flags = np.asarray(got["completion_truncated"])
        lengths = np.diff(got["completion_ids"].offsets)
        assert flags.sum() > 0 and (lengths[flags == 1.0] >= 1).all() and (lengths <= 4).all()
        flagged = {int(r) for r, f in zip(rows, flags) if f == 1.0}
        replayed = [int(r) for h in trainer.replay_history for r in h["replayed_rows"] if int(r) in flagged]
        assert replayed, "no truncated row was replayed: the test proves nothing"
        pad = trainer._pad_token_id()
        masked_out = set()
        for b in trainer.loss_batches:
            for i in range(b["prompt_ids"].shape[0]):
                if int(b["completion_mask"][i].sum()) == 0:
                    ids = b["completion_ids"][i].tolist()
                    while ids and ids[-1] == pad:
                        ids.pop()
                    masked_out.add((tuple(b["prompt_ids"][i][b["prompt_mask"][i].bool()].tolist()), tuple(ids)))
        for r in replayed:
            row = store.read([r], ["prompt_ids", "completion_ids"])
            key = (tuple(row["prompt_ids"][0].tolist()), tuple(row["completion_ids"][0].tolist()))
            assert key in masked_out, f"replayed truncated row {r} reached the loss unmasked"
    assert_finite_losses(trainer)


def test_a_run_that_flags_truncated_completions_goes_on_in_its_store(tmp_path):
    """The trainer writes completion_truncated, but refused a store holding it ("per-row column(s)
    ['completion_truncated'] that this trainer does not write"): such a run could be neither resumed nor
    continued, and turning the flag on for an existing store made that store unusable afterwards."""
    first = train(tmp_path, replay_mode="repo", replay_k=2, mask_truncated_completions=True,
                  max_completion_length=4, max_steps=2)
    with open_store(first) as store:
        assert "completion_truncated" in store.columns
        before = len(store)
    again = train(tmp_path, replay_mode="repo", replay_k=2, mask_truncated_completions=True,
                  max_completion_length=4, max_steps=2)  # the same config, the same store
    with open_store(again) as store:
        assert len(store) > before
    assert_finite_losses(again)


# --------------------------------------------------------------------------- the rollout stream


def _generators_commit(path, groups, first, version=0, seed=0):
    """What external generators commit: ``groups`` prompt groups of 4 completions, by two writers."""
    tok = make_tokenizer()
    rng = np.random.default_rng(seed)
    for half in range(2):  # each writer commits two samples of every prompt
        n = groups * 2
        prompts = [tok(PROMPTS[(first + i // 2) % 2])["input_ids"] for i in range(n)]
        completions = [rng.integers(3, 97, int(rng.integers(2, 8))) for _ in range(n)]
        with ReplayStore(path) as store:
            store.extend({"prompt_ids": prompts, "completion_ids": completions,
                          "old_per_token_logps": [-rng.random(len(c)).astype(np.float32) for c in completions],
                          "advantages": rng.normal(size=n).astype(np.float32),
                          "rewards": rng.random(n).astype(np.float32),
                          "prompt_id": np.repeat(np.arange(first, first + groups), 2),
                          "policy_version": np.full(n, version)})


def test_replay_stream_trains_on_every_committed_group_once_and_resumes_its_cursor(tmp_path):
    path = str(tmp_path / "s" / "store")
    ReplayStore(path, multi_writer=True).close()
    _generators_commit(path, groups=6, first=0)              # 24 rows: three steps of 8
    opts = dict(replay_stream="trainer", max_steps=3, save_strategy="steps", save_steps=1)
    first = train(tmp_path, name="s", stop_at=2, **opts)
    assert first.state.global_step == 2
    with ReplayStore(path, readonly=True) as store:
        cursor = store.load_state("stream.trainer")
        assert cursor["position"] == 16 and cursor["counts"]["handed_out"] == 16
        drawn = np.concatenate([h["stream_rows"] for h in first.replay_history])
        assert len(set(drawn.tolist())) == 16                 # each row once
        keys = store.read(drawn, ["prompt_id"])["prompt_id"].reshape(-1, 4)
        assert (keys == keys[:, :1]).all()                    # whole groups, in the order they completed
        assert keys[:, 0].tolist() == [0, 1, 2, 3]
        assert_replayed_rows_reached_the_loss(first, store, drawn)
        assert all(h["policy_lag_mean"] >= 0 for h in first.replay_history)
    _generators_commit(path, groups=2, first=6, version=2, seed=1)   # meanwhile: 8 more rows
    # resumed from the first checkpoint: its model saw groups 0 and 1 only, so groups 2-5 come next
    resumed = train(tmp_path, name="s", resume=os.path.join(first.args.output_dir, "checkpoint-1"), **opts)
    again = np.concatenate([h["stream_rows"] for h in resumed.replay_history])
    with ReplayStore(path, readonly=True) as store:
        keys = store.read(again, ["prompt_id"])["prompt_id"].reshape(-1, 4)
        assert keys[:, 0].tolist() == [2, 3, 4, 5] and (keys == keys[:, :1]).all()
        assert not set(again.tolist()) & set(drawn[:8].tolist())
        assert store.load_state("stream.trainer")["position"] == 24   # groups 6, 7 wait for a next step
        assert_replayed_rows_reached_the_loss(resumed, store, again)


def test_replay_stream_options_are_checked(tmp_path):
    with pytest.raises(ReplayConfigError, match="replay_mode='off'"):
        make_config(tmp_path, replay_stream="t", replay_mode="ssr")
    path = tmp_path / "single" / "store"
    ReplayStore(str(path)).close()  # one writer: the generators could not write it
    with pytest.raises(ReplayConfigError, match="multi_writer=True"):
        DiskReplayGRPOTrainer(model=make_model(), reward_funcs=lowercase_reward,
                              args=make_config(tmp_path, name="single", replay_stream="t"),
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=make_tokenizer())


# --------------------------------------------------------------------------- one epoch: prompts that never recur

EPOCH_PROMPTS = [f"item {c}:" for c in "abcdefghijklmnop"]  # 2 prompts per step: none recurs within 8 steps


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def said(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


def test_repo_says_once_that_it_replays_nothing_when_prompts_do_not_recur(tmp_path):
    # the run: replay/fraction 0.0 for every step and nothing said why
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(tmp_path, prompts=EPOCH_PROMPTS, replay_mode="repo", replay_k=2, max_policy_lag=2)
    empty = [w for w in caught if "replayed nothing" in str(w.message)]
    assert len(empty) == 1 and empty[0].category is RuntimeWarning, [str(w.message) for w in empty]
    message = str(empty[0].message)
    assert "at step 1" in message and "none of the batch's 2 prompt(s) has replay_min_generations=2" in message
    assert "max_policy_lag=2" in message and "replay_mode='repo_any'" in message
    assert "8 such row(s) in 2 group(s)" in message  # step 0's rows
    assert logged(trainer, "replay/fraction") == [0.0] * 3
    assert logged(trainer, "replay/eligible_groups") == [0.0] * 3
    assert [h["eligible_groups"] for h in trainer.replay_history] == [0] * 3


def test_repo_any_replays_a_run_of_one_epoch_within_the_lag(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(tmp_path, prompts=EPOCH_PROMPTS, replay_mode="repo_any", replay_k=2, max_policy_lag=1)
    assert not said(caught, "replayed nothing")
    assert logged(trainer, "replay/fraction") == [0.0, 0.5, 0.5]
    assert logged(trainer, "replay/eligible_groups") == [0.0, 2.0, 2.0]  # the previous step's groups
    history = list(trainer.replay_history)
    with open_store(trainer) as store:
        for h in history[1:]:
            got = store.read(h["replayed_rows"], ["prompt_id", "policy_version"])
            assert got["policy_version"].tolist() == [h["global_step"] - 1] * 4  # max_policy_lag=1
            fresh = store.read(h["fresh_rows"], ["prompt_id"])["prompt_id"]
            assert not set(got["prompt_id"].tolist()) & set(fresh.tolist())  # groups of other prompts
            assert len(set(got["prompt_id"].tolist())) == 2  # two distinct stored groups, k=2 rows each
            assert_replayed_rows_reached_the_loss(trainer, store, h["replayed_rows"])
    assert_finite_losses(trainer)


def test_repo_any_resumes_its_draws(tmp_path):
    # at step 2 four stored groups qualify and two are drawn: which two is the resumed RNG's
    opts = dict(replay_mode="repo_any", replay_k=2, replay_strategy="random", max_policy_lag=2, max_steps=3,
                prompts=EPOCH_PROMPTS)
    first = train(tmp_path, name="resumed", save_strategy="steps", save_steps=2, stop_at=2, **opts)
    ckpt = os.path.join(first.args.output_dir, "checkpoint-2")
    resumed = train(tmp_path, name="resumed", save_strategy="steps", save_steps=2, resume=ckpt, **opts)
    straight = train(tmp_path, name="straight", **opts)
    ra, rb = list(resumed.replay_history), list(straight.replay_history)
    assert [h["global_step"] for h in ra] == [2] and ra[0]["eligible_groups"] == 4
    assert len(ra[0]["replayed_rows"]) == 4 and ra[0]["replayed_rows"].tolist() == rb[2]["replayed_rows"].tolist()
    with open_store(resumed) as a, open_store(straight) as b:
        sa, sb = a.load_state("trl.replay"), b.load_state("trl.replay")
        assert sa["replay_mode"] == "repo_any" and sa["rng"] == sb["rng"]
        assert sa["sampler"]["position"] == sb["sampler"]["position"]


def test_the_resume_warning_is_given_once(tmp_path, caplog):
    # it was printed twice: a log line and a RuntimeWarning with the same text
    opts = dict(replay_mode="off", save_strategy="steps", save_steps=1, max_steps=2)
    first = train(tmp_path, **opts)  # checkpoint-1 saw 8 rows; the store holds 16
    ckpt = os.path.join(first.args.output_dir, "checkpoint-1")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        train(tmp_path, resume=ckpt, **opts)
    told = said(caught, "excluded from replay") + [r.getMessage() for r in caplog.records
                                                    if "excluded from replay" in r.getMessage()]
    assert len(told) == 1 and "8 row(s) [8, 16)" in told[0], told
    assert len(said(caught, "excluded from replay")) == 1
