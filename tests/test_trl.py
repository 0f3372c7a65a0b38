"""Real GRPOTrainer steps on CPU with replay from disk (no mocks of TRL, nothing downloaded).

A 2-layer Qwen2 with a 98-token character vocabulary, a tokenizer built with
``tokenizers``, two prompts and rule-based rewards: a few optimizer steps per
replay mode, checking that the store grew by every generated row, that the
replayed rows reached the loss with their stored old log-probs, that the
batch keeps the parent's keys, dtypes and size, and that a resumed run
continues the store and the sampler.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from diskreplay import ReplayStore  # noqa: E402
from diskreplay.synthetic import char_tokenizer  # noqa: E402
from diskreplay.integrations.trl import (CHECKPOINT_FILE, DiskReplayGRPOConfig,  # noqa: E402
                                         DiskReplayGRPOTrainer, prompt_key)

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
        # recomputed advantages: the stored reward against this step's fresh rows of the same prompt
        fresh = store.read(h["fresh_rows"], ["prompt_id", "rewards"])
        got = store.read(h["replayed_rows"], ["prompt_id", "rewards", "completion_ids"])
        seen = {tuple(x[1]): x[3] for x in loss_rows(trainer, [batch])}
        for i in range(2):
            ref = fresh["rewards"][fresh["prompt_id"] == got["prompt_id"][i]].astype(np.float64)
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
    with open(os.path.join(ckpt, CHECKPOINT_FILE)) as fh:
        doc = json.load(fh)
    assert doc["next_row"] == 16 and doc["store_path"] == os.path.abspath(first.args.replay_store_path)
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
