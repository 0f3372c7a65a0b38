"""verl v1's async trainer loop over TransferQueue with the DiskReplay backend, on CPU (run in .venv-verl/).

tests/test_verl.py runs it with that environment's python; no GPU, no vLLM, no model:

- ``cluster``: starts a local Ray cluster on 127.0.0.1, prints its address, and stops it when stdin closes.
- ``train STORE CKPT``: one trainer process. It imports verl, prints ``ready``, reads the cluster's address
  from stdin (so it can start before the cluster is up, or before the trainer it replaces is killed), calls
  ``tq.init`` with the DiskReplay backend, then runs verl's own code for everything that touches TransferQueue:
  ``PPOTrainer._submit_batch_to_rollout`` (prompts registered with their fields and a ``pending`` tag),
  ``ReplayBufferAsync.sample`` (verl's v1 replay buffer picks finished groups and clears their prompt keys),
  ``tq.kv_batch_get`` / ``tq.kv_clear`` of the sampled trajectories as the trainer does,
  ``tq.save_checkpoint`` every second step as verl's ``_save_checkpoint`` does in its async modes, and on
  resume ``tq.load_checkpoint`` then ``PPOTrainer._reissue_inflight_prompts``. Only the rollout is a
  stand-in (``Rollout``): it does what verl's ``AgentLoopWorkerTQ`` does with TransferQueue (a ``running``
  tag, one ``kv_batch_put`` per session of key ``{uid}_{session}_0``, then ``finished``), with trajectories
  that are a fixed function of (uid, session) instead of a model's output. It leaves half a batch of groups
  running (some sessions put) and a batch pending at every checkpoint.

The trainer prints one JSON line per event, after the call it reports has returned: ``gen`` (a group's
rollout starts), ``put`` (a trajectory acknowledged), ``trained`` (a step's groups, ``bad`` listing any value
that differs from what was put), ``ckpt`` (a checkpoint written, with what TransferQueue held), ``resumed``.
"""

import json
import os
import signal
import sys
import time
import zlib
from types import SimpleNamespace

PROMPTS = 24  # the dataset: prompt uids p0 .. p23
BATCH = 4  # prompt groups per training step
N = 2  # trajectories per group (GRPO's rollout.n)
SAVE_FREQ = 2  # verl's trainer.save_freq: a checkpoint after every second step
PARTITION = "train"


def say(**event):
    print(json.dumps(event), flush=True)


def cluster():
    import ray

    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 2**20)
    signal.signal(signal.SIGTERM, lambda *_: (ray.shutdown(), os._exit(0)))
    say(address=ray.get_runtime_context().gcs_address)
    sys.stdin.read()
    ray.shutdown()


def _generator(*parts):
    import torch
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


def prompt_ids(uid):
    import torch
    g = _generator(uid)
    return torch.randint(0, 32000, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)


def trajectory(uid, session):
    """What the stand-in rollout puts for one session: jagged ids and scores, a string and an int."""
    import torch
    g = _generator(uid, session)
    n = int(torch.randint(1, 24, (1,), generator=g))
    return {"prompts": prompt_ids(uid), "responses": torch.randint(0, 32000, (n,), generator=g),
            "response_mask": torch.ones(n, dtype=torch.int64), "rm_scores": torch.rand(n, generator=g),
            "uid": uid, "session_id": session}


class Rollout:
    """Stands in for verl's AgentLoopManagerTQ/AgentLoopWorkerTQ: the same TransferQueue calls, no model."""

    def __init__(self, tq):
        self.tq, self.queue, self.running = tq, [], []

    def generate_sequences(self, batch):  # what verl's trainer hands a batch of prompts to
        self.queue += list(batch["uid"])

    def _put_session(self, uid, session):
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict
        key = f"{uid}_{session}_0"
        self.tq.kv_batch_put(keys=[key], partition_id=PARTITION,
                             fields=list_of_dict_to_tensordict([trajectory(uid, session)]),
                             tags=[{"status": "success", "global_steps": self.global_steps}])
        say(put=key)

    def advance(self, global_steps, buffer, batch):
        """Finish the running groups, start the queued ones and leave the last batch//2 of them running."""
        self.global_steps = global_steps
        for uid in self.running:
            self._put_session(uid, N - 1)
            self.tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "finished"})
        started, self.queue = self.queue, []
        self.running = started[len(started) - batch // 2:] if len(started) > batch // 2 else []
        for uid in started:
            say(gen=uid)
            self.tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "running"})
            for session in range(N - 1):
                self._put_session(uid, session)
            if uid not in self.running:
                self._put_session(uid, N - 1)
                self.tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "finished"})
        if buffer.get_sampleable_count(global_steps, PARTITION) < batch:  # the last steps: finish everything
            self.queue, self.running = [], self.running + self.queue
            self.advance(global_steps, buffer, batch)


def _next_prompts(start, count):
    import torch
    from tensordict import NonTensorStack, TensorDict
    uids = [f"p{i}" for i in range(start, start + count)]
    return TensorDict({"raw_prompt_ids": torch.nested.as_nested_tensor([prompt_ids(u) for u in uids],
                                                                       layout=torch.jagged),
                       "uid": NonTensorStack(*uids)}, batch_size=[count])


def _write_json(path, state):
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def train(store, ckpt):
    import torch
    import diskreplay.integrations.transferqueue  # noqa: F401  (registers "DiskReplay" in this process)
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    # the imports take most of a minute on a busy machine: the test starts this process early and sends the
    # cluster's address when this trainer's turn comes
    say(ready=os.getpid())
    ray.init(address=sys.stdin.readline().strip(), log_to_driver=False)
    latest = os.path.join(ckpt, "latest.json")  # verl's latest_checkpointed_iteration.txt, with the dataloader
    resume = os.path.exists(latest)
    if resume:  # the killed trainer owned the controller; Ray removes it with its owner
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ray.get_actor("TransferQueueController", namespace="transfer_queue")
            except ValueError:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("the killed trainer's TransferQueueController is still alive after 60 s")
    tq.init(OmegaConf.create({"backend": {"storage_backend": "DiskReplay", "DiskReplay": {"path": store}}}))
    rollout = Rollout(tq)
    trainer = SimpleNamespace(trainer_mode="async", agent_loop_manager=rollout, global_steps=1)
    buffer = ReplayBufferAsync(trainer_mode="async", trainer_config=OmegaConf.create({}), max_off_policy_threshold=None,
                               max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create({}), poll_interval=0.05)
    if resume:
        with open(latest) as f:
            state = json.load(f)
        trainer.global_steps = state["global_steps"] + 1
        tq.load_checkpoint(os.path.join(ckpt, f"global_step_{state['global_steps']}", "transfer_queue"))
        reissued = PPOTrainer._reissue_inflight_prompts(trainer, PARTITION)
        say(resumed=state["global_steps"], reissued=reissued)
    else:
        state = {"global_steps": 0, "next_prompt": 0, "trained": 0}
        for _ in range(3):  # verl's warm-up batches of an async trainer
            PPOTrainer._submit_batch_to_rollout(trainer, _next_prompts(state["next_prompt"], BATCH))
            state["next_prompt"] += BATCH

    while state["trained"] < PROMPTS:
        step = trainer.global_steps
        rollout.advance(step, buffer, BATCH)
        batch, _ = buffer.sample(global_steps=step, partition_id=PARTITION, batch_size=BATCH)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=PARTITION)
        bad = []
        for i, key in enumerate(batch.keys):
            uid, session, _ = key.split("_")
            want = trajectory(uid, int(session))
            same = all(torch.equal(data[name][i], want[name])
                       for name in ("prompts", "responses", "response_mask", "rm_scores"))
            if not same or data["uid"][i] != uid or data["session_id"][i] != int(session):
                bad.append(key)
        tq.kv_clear(keys=batch.keys, partition_id=PARTITION)
        say(trained=step, keys=sorted(batch.keys), bad=bad)
        state["trained"] += len({key.split("_")[0] for key in batch.keys})
        if state["next_prompt"] < PROMPTS:
            PPOTrainer._submit_batch_to_rollout(trainer, _next_prompts(state["next_prompt"], BATCH))
            state["next_prompt"] += BATCH
        if step % SAVE_FREQ == 0:  # verl's _save_checkpoint in its async modes: TransferQueue's, then the tracker
            tq.save_checkpoint(os.path.join(ckpt, f"global_step_{step}", "transfer_queue"),
                               metadata={"global_steps": step})
            state["global_steps"] = step
            _write_json(latest, state)
            held = tq.kv_list(PARTITION).get(PARTITION, {})
            say(ckpt=step, status={k: t.get("status") for k, t in held.items() if t.get("is_prompt")},
                trajectories=sorted(k for k, t in held.items() if not t.get("is_prompt")))
        trainer.global_steps = step + 1
    say(done=trainer.global_steps - 1)
    os._exit(0)  # every commit is durable; skip Ray's slow teardown


if __name__ == "__main__":
    if sys.argv[1] == "cluster":
        cluster()
    else:
        train(*sys.argv[2:4])
