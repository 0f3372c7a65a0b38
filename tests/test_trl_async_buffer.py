"""The durable rollout buffer with TRL's own AsyncGRPOTrainer pieces on CPU (nothing downloaded).

The samples are TRL's ``RolloutSample``; the trainer side is TRL's ``RolloutQueueDataset``, its
batchers and collator, and the ``AsyncGRPOTrainer`` itself, built with a CPU rollout worker (the
samples come through the store from another process), a no-op weight transfer, a ``token_budget``
and a CPU stand-in for ``get_peak_flops_per_device``. TRL's loss forwards through tree attention,
whose kernel needs CUDA, so the trainer here is ``AsyncGRPOTrainer`` with a CPU ``compute_loss``
that records which samples each micro-batch holds: everything else (the data loader and its
prefetch, the optimizer steps, checkpoints, resume) is TRL's and transformers' own.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import time
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402

import trl.experimental.async_grpo.async_grpo_trainer as agt  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import (FixedCountBatcher, RolloutQueueDataset,  # noqa: E402
                                                             TokenBudgetBatcher)
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402

from diskreplay import ReplayStore  # noqa: E402
from diskreplay.errors import BatchError, StreamFencedError  # noqa: E402
from diskreplay.integrations.trl import DurableRolloutQueue  # noqa: E402
from diskreplay.synthetic import char_tokenizer  # noqa: E402
from tests.torchrun import ROOT, child_env  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

#: a sample's first token is MARK + its serial: unique, so TRL's prefix tree never merges two samples
MARK = 10
STALE_VERSION = -100
STALE_HERE = (3, 17)


def make_sample(serial, version=0, cls=RolloutSample):
    rng = np.random.default_rng(serial)
    n = 4 + serial % 5
    ids = np.r_[MARK + serial, rng.integers(3, MARK, n)].astype(np.int64)
    mask = np.r_[np.zeros(2, np.int64), np.ones(n - 1, np.int64)]
    return cls(prompt=[{"role": "user", "content": f"q{serial}"}], completion=[{"role": "assistant", "content": "a"}],
               input_ids=ids, completion_mask=mask, old_log_probs=rng.normal(size=n + 1).astype(np.float32),
               advantage=float(serial % 3) - 1.0, model_version=version, group_id=serial // 4,
               metrics={"reward": float(serial % 2), "tools/call_frequency": float("nan")}, enqueued_at=None)


def serial_of(sample):
    return int(sample.input_ids[0]) - MARK


class StoreFedWorker:
    """A ``RolloutWorkerProtocol`` whose rollouts come from other processes, through the store."""

    def __init__(self, rollout_buffer):
        self.rollout_buffer, self.metrics_queue, self.model_version = rollout_buffer, queue.Queue(), 0

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        self.model_version = model_version

    def check_health(self, stale_after_s):
        pass


class NoWeightTransfer:
    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        pass

    def resume(self):
        pass

    def destroy(self):
        pass


class CpuStepTrainer(AsyncGRPOTrainer):
    """AsyncGRPOTrainer whose loss is a CPU stand-in (TRL's tree-attention forward needs CUDA); it
    records the serials of the samples each micro-batch carries."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"][inputs["attention_mask"].bool()]
        self.trained_now.extend((ids[ids >= MARK] - MARK).tolist())
        return self.accelerator.unwrap_model(model).get_input_embeddings()(ids).float().pow(2).mean()


class Record(TrainerCallback):
    """After each optimizer step: its serials, appended (and fsynced) to ``log``; then, at ``block_at``,
    a marker file and a wait to be killed."""

    def __init__(self, trainer, life, log, block_at=None, marker=None):
        self.trainer, self.life, self.log, self.block_at, self.marker = trainer, life, log, block_at, marker

    def on_step_end(self, args, state, control, **kwargs):
        with open(self.log, "a") as fh:
            fh.write(json.dumps({"life": self.life, "step": state.global_step,
                                 "serials": self.trainer.trained_now}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.trainer.trained_now = []
        if self.block_at is not None and state.global_step >= self.block_at:
            open(self.marker, "w").close()
            while True:
                time.sleep(1)


def save_tiny_model(path):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=128, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def build_trainer(root, queue_, max_steps, **kw):
    """AsyncGRPOTrainer on CPU with the durable buffer in place of its queue."""
    agt.get_peak_flops_per_device = lambda accelerator, dtype: None  # it asks torch.cuda for the device name
    if not os.path.isdir(os.path.join(root, "model")):
        save_tiny_model(os.path.join(root, "model"))
    args = AsyncGRPOConfig(output_dir=os.path.join(root, "out"), use_cpu=True, bf16=False, report_to=[],
                           per_device_train_batch_size=4, max_steps=max_steps, save_strategy="steps", save_steps=2,
                           token_budget=kw.pop("token_budget", 0), max_staleness=50, learning_rate=1e-3,
                           disable_tqdm=True, **kw)
    from datasets import Dataset
    trainer = CpuStepTrainer(model=os.path.join(root, "model"), args=args, processing_class=char_tokenizer(),
                             train_dataset=Dataset.from_dict({"prompt": ["unused"]}),
                             rollout_worker=StoreFedWorker(queue_), weight_transfer=NoWeightTransfer())
    trainer.trained_now = []
    return trainer


# ---------------------------------------------------------------------------------------------- the buffer


def test_a_rollout_sample_comes_back_field_for_field_with_trls_dtypes(tmp_path):
    q = DurableRolloutQueue(str(tmp_path / "s"))
    sent = make_sample(5, version=3)
    sent.enqueued_at = 1234.5
    q.put_nowait(sent)
    got = q.get(timeout=5)
    assert isinstance(got, RolloutSample)
    for f in ("input_ids", "completion_mask", "old_log_probs"):
        assert getattr(got, f).dtype == getattr(sent, f).dtype
        np.testing.assert_array_equal(getattr(got, f), getattr(sent, f))
    assert (got.prompt, got.completion, got.advantage, got.model_version, got.group_id, got.enqueued_at) == \
        (sent.prompt, sent.completion, sent.advantage, 3, sent.group_id, 1234.5)
    assert got.metrics["reward"] == 1.0 and np.isnan(got.metrics["tools/call_frequency"])
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    row = q.store.read([0], columns=["policy_version", "group_id", "rewards"])
    assert (row["policy_version"][0], row["group_id"][0], row["rewards"][0]) == (3, 1, 1.0)


def test_a_retried_put_commits_once_and_an_identical_rollout_is_a_row_of_its_own(tmp_path):
    path = str(tmp_path / "s")
    q = DurableRolloutQueue(path)
    q.put_nowait(make_sample(1))
    q.put_nowait(make_sample(1))           # the same completion sampled twice: two rows
    again = DurableRolloutQueue(path)      # a worker restarted after a crash puts the first one again
    again.put_nowait(make_sample(1))
    assert q.qsize() == 2 and ReplayStore(path, readonly=True).next_row == 2
    again.put_many([make_sample(2), make_sample(3)])
    again.put_many([make_sample(2), make_sample(3)], token="mine")
    again.put_many([make_sample(2), make_sample(3)], token="mine")
    assert ReplayStore(path, readonly=True).next_row == 6


def test_fields_that_cannot_be_stored_are_refused_by_name_and_nothing_is_written(tmp_path):
    q = DurableRolloutQueue(str(tmp_path / "s"))
    bad = make_sample(0)
    bad.prompt = [{"role": "user", "content": object()}]
    with pytest.raises(BatchError, match=r"RolloutSample\.prompt holds a object"):
        q.put_nowait(bad)
    bad = make_sample(0)
    bad.old_log_probs = bad.old_log_probs[:, None]
    with pytest.raises(BatchError, match=r"RolloutSample\.old_log_probs must be a 1-D float"):
        q.put_nowait(bad)
    bad = make_sample(0)
    bad.input_ids = bad.input_ids + 2 ** 40
    with pytest.raises(BatchError, match=r"RolloutSample\.input_ids holds values outside int32"):
        q.put_nowait(bad)
    with pytest.raises(BatchError, match=r"lacks \['completion_mask'"):
        q.put_nowait(SimpleNamespace(**{k: v for k, v in vars(make_sample(0, cls=SimpleNamespace)).items()
                                        if k != "completion_mask"}))
    assert q.qsize() == 0 and q.store.next_row == 0


def test_a_spawned_worker_writes_through_a_pickled_copy_that_never_takes_the_cursor(tmp_path):
    q = DurableRolloutQueue(str(tmp_path / "s"))
    assert set(pickle.loads(pickle.dumps(q)).__getstate__()) == set(q.__getstate__())
    ctx = multiprocessing.get_context("spawn")   # what TRL's AsyncRolloutWorker uses
    samples = [make_sample(i, cls=SimpleNamespace) for i in range(6)]
    child = ctx.Process(target=q.put_many, args=(samples,))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert [serial_of(q.get(timeout=5)) for _ in range(6)] == list(range(6))


def test_trls_dataset_and_batchers_drain_it_and_a_resumed_consumer_continues_exactly(tmp_path):
    PartialState(cpu=True)             # TRL's dataset logs through accelerate, which wants its state
    path = str(tmp_path / "s")
    q = DurableRolloutQueue(path, read_ahead=8)
    for i in range(24):
        q.put_nowait(make_sample(i, version=STALE_VERSION if i in STALE_HERE else 0))
    metrics = defaultdict(list)

    def dataset():
        return RolloutQueueDataset(q, lambda: 0, lambda s: None, 60, metrics, max_staleness=4, poll_interval_s=0.05)

    first = [int(s["input_ids"][0]) - MARK for row in next(iter(TokenBudgetBatcher(dataset(), 1, 40, metrics)))
             for s in row.samples]
    assert metrics["sample/dropped_stale_total"] and 3 not in first and first[0] == 0
    state = q.state_dict()             # samples handed out count as consumed; those read ahead do not
    handed = q.stats()["handed_out"] - q.stats()["unconsumed"]
    assert handed > len(first) + 1     # the stale one, and the one TokenBudgetBatcher holds for its next batch
    rest = [int(s["input_ids"][0]) - MARK for row in next(iter(FixedCountBatcher(dataset(), 1, 4)))
            for s in row.samples]      # the old consumer goes on past the saved state

    resumed = DurableRolloutQueue(path, read_ahead=8)  # a restarted trainer from that state
    resumed.load_state_dict(state)
    with pytest.raises(StreamFencedError):
        q.save()                       # the old one can no longer move the cursor
    after = [serial_of(resumed.get(timeout=5)) for _ in range(24 - handed)]
    assert after == list(range(handed, 24))
    assert rest == [s for s in after if s not in STALE_HERE][:4]
    with pytest.raises(queue.Empty):
        resumed.get(timeout=0.05)


def test_acknowledged_samples_are_consumed_and_the_rest_wait_again(tmp_path):
    path = str(tmp_path / "s")
    q = DurableRolloutQueue(path, read_ahead=4, acknowledge=True)
    for i in range(10):
        q.put_nowait(make_sample(i))
    got = [q.get(timeout=5) for _ in range(6)]
    q.acknowledge(got[:3])               # a step trained the first three; 3..5 are a prefetched batch
    state = q.state_dict()
    resumed = DurableRolloutQueue(path)
    resumed.load_state_dict(state)
    assert [serial_of(resumed.get(timeout=5)) for _ in range(7)] == list(range(3, 10))


def test_a_stream_cursor_gives_back_only_rows_it_handed_out(tmp_path):
    from diskreplay import RolloutStream
    from diskreplay.errors import ArgumentError
    store = ReplayStore(str(tmp_path / "s"), multi_writer=True, group_key=None)
    store.extend({"completion_ids": [[1], [2], [3], [4]]})
    stream = RolloutStream(store, "t")
    assert stream.next(3, timeout=0).tolist() == [0, 1, 2]
    state = stream.state_dict(unconsumed=[2, 1])
    assert state["pending"].tolist() == [1, 2, 3] and state["counts"]["handed_out"] == 1
    assert stream.stats()["handed_out"] == 3                   # the live stream is unchanged
    with pytest.raises(ArgumentError, match="unconsumed must be rows"):
        stream.state_dict(unconsumed=[3])                      # still waiting: never handed out
    again = RolloutStream(store, "t")
    again.load_state_dict(state)
    assert again.next(3, timeout=0).tolist() == [1, 2, 3]
    grouped = RolloutStream(ReplayStore(str(tmp_path / "g"), multi_writer=True), "t", group_size=2)
    with pytest.raises(ArgumentError, match="group_size=1"):
        grouped.state_dict(unconsumed=[0])


def test_async_grpo_trainer_builds_on_cpu_with_the_durable_buffer(tmp_path):
    q = DurableRolloutQueue(str(tmp_path / "store"))
    trainer = build_trainer(str(tmp_path), q, max_steps=2, token_budget=64)
    callback = q.attach(trainer)
    assert trainer.rollout_queue is q and trainer.rollout_worker.rollout_buffer is q
    assert callback in trainer.callback_handler.callbacks
    loader = trainer.get_train_dataloader()
    assert isinstance(loader.base_dataloader.dataset, TokenBudgetBatcher)
    assert loader.base_dataloader.dataset.dataset.queue is q


def test_the_docs_example_builds_the_trainer_with_the_buffer(tmp_path):
    """docs/integrations.md's AsyncGRPOTrainer block, given what its text says the user supplies (on CPU:
    with the stand-in for the peak-FLOPs lookup; it trains only where CUDA is)."""
    import re
    text = open(os.path.join(ROOT, "docs", "integrations.md")).read()
    section = text[text.index("## TRL: a durable rollout buffer"):text.index("## TorchRL")]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    save_tiny_model(str(tmp_path / "model"))
    char_tokenizer().save_pretrained(str(tmp_path / "model"))
    agt.get_peak_flops_per_device = lambda accelerator, dtype: None
    scope = {"path": str(tmp_path / "store"), "model_path": str(tmp_path / "model")}
    exec(compile(code, "docs/integrations.md AsyncGRPOTrainer block", "exec"), scope)
    assert scope["trainer"].rollout_queue is scope["rollouts"]
    assert any(type(c).__name__ == "DurableRolloutCallback" for c in scope["trainer"].callback_handler.callbacks)


# ---------------------------------------------------------------------------------------------- kill / resume

WORKER = """
import os, sys, time
from types import SimpleNamespace
sys.path.insert(0, {root!r})
from tests.test_trl_async_buffer import make_sample, STALE_VERSION
from diskreplay.integrations.trl import DurableRolloutQueue
path, first, total, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
stale = {stale!r}
q = DurableRolloutQueue(path)
for i in range(total):
    if i == first:
        while not os.path.exists(go):     # the rest after the trainer was killed
            time.sleep(0.05)
    q.put_nowait(make_sample(i, version=STALE_VERSION if i in stale else 0, cls=SimpleNamespace))
    time.sleep(0.002)
"""

TOTAL, FIRST, STALE = 72, 40, (6, 23, 50)
KILLED_AT, LAST_STEP = 5, 12


def _first_life(root, log, marker):
    """The trainer process that is killed: checkpoints at steps 2 and 4, blocks after step 5."""
    q = DurableRolloutQueue(os.path.join(root, "store"))
    trainer = build_trainer(root, q, max_steps=LAST_STEP)
    q.attach(trainer)
    trainer.add_callback(Record(trainer, 1, log, block_at=KILLED_AT, marker=marker))
    trainer.train()


@pytest.mark.slow
def test_a_sigkilled_trainer_resumes_from_its_checkpoint_with_every_rollout_consumed_once(tmp_path):
    root, log = str(tmp_path), str(tmp_path / "steps.jsonl")
    marker, go = str(tmp_path / "blocked"), str(tmp_path / "go")
    path = os.path.join(root, "store")
    DurableRolloutQueue(path).close()
    worker = subprocess.Popen([sys.executable, "-c", WORKER.format(root=ROOT, stale=STALE), path, str(FIRST),
                               str(TOTAL), go], cwd=ROOT, env=child_env(), stderr=subprocess.PIPE)
    env = dict(child_env(), CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", TRL_EXPERIMENTAL_SILENCE="1")
    code = f"import tests.test_trl_async_buffer as t; t._first_life({root!r}, {log!r}, {marker!r})"
    trainer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(marker):
            assert trainer.poll() is None, trainer.stderr.read().decode()[-4000:]
            assert time.monotonic() < deadline, "the first life never reached its step"
            time.sleep(0.1)
        trainer.send_signal(signal.SIGKILL)          # mid-run: step 5 trained, its checkpoint not written
        assert trainer.wait(60) == -signal.SIGKILL
        open(go, "w").close()
        # the second life, resumed from the newest checkpoint, in this process
        q = DurableRolloutQueue(path)
        resumed = build_trainer(root, q, max_steps=LAST_STEP)
        q.attach(resumed)
        resumed.add_callback(Record(resumed, 2, log))
        resumed.train(resume_from_checkpoint=os.path.join(root, "out", "checkpoint-4"))
        # the policy version went on from the checkpoint's (one per weight sync: at train begin, every step)
        assert resumed.model_version == LAST_STEP + 2
        assert worker.wait(120) == 0, worker.stderr.read().decode()[-4000:]
    finally:
        for p in (worker, trainer):
            if p.poll() is None:
                p.kill()

    steps = [json.loads(line) for line in open(log)]
    first = {s["step"]: s["serials"] for s in steps if s["life"] == 1}
    second = {s["step"]: s["serials"] for s in steps if s["life"] == 2}
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(second) == list(range(5, LAST_STEP + 1))
    lineage = [x for step in range(1, 5) for x in first[step]] + [x for s in sorted(second) for x in second[s]]
    assert len(lineage) == len(set(lineage)), "a rollout trained twice"
    assert not set(lineage) & set(STALE), "a stale rollout trained"
    assert set(first[KILLED_AT]) <= set(lineage), "the killed step's rollouts were lost"

    with open(os.path.join(root, "out", "checkpoint-4", "trainer_state.json")) as fh:
        at_4 = json.load(fh)["stateful_callbacks"]["DurableRolloutCallback"]["attributes"]["cursor"]
    with ReplayStore(path, readonly=True) as store:
        assert store.next_row == TOTAL                      # every put committed once
        serial = {r: int(v[0]) - MARK for r, v in enumerate(store.read(np.arange(TOTAL), ["input_ids"])["input_ids"])}
        final = store.load_state("stream.trainer")
    # the batch the data loader had prefetched at checkpoint 4 (step 5's) waited again in its cursor
    assert set(first[KILLED_AT]) <= {serial[r] for r in at_4["stream"]["pending"]}
    waiting = {serial[int(r)] for r in final["pending"]}
    assert not waiting & set(lineage)
    assert set(lineage) | set(STALE) | waiting == set(range(TOTAL)), "a rollout lost"
    assert final["counts"]["handed_out"] == TOTAL - len(waiting)
