"""Rollout actors on a Ray cluster append GRPO groups to one store; a trainer samples while they write.

Starts a local Ray cluster (or joins one with ``--address``), creates a
multi-writer store, and runs ``--actors`` rollout actors
(:func:`diskreplay.integrations.ray.rollout_actor_class`) that each append
``--steps`` batches of synthetic GRPO groups (``diskreplay.synthetic``) with
exactly-once tokens. Meanwhile one trainer actor follows the store
(:class:`~diskreplay.integrations.ray.StoreFollower`) and draws whole prompt
groups with :class:`~diskreplay.PromptGroupSampler`. Unless ``--no-kill``,
actor 0 is killed after its first acknowledged batch; Ray restarts it and
sends its calls again, and the tokens keep every batch in the store once.
Prints a short summary and checks that every acknowledged batch is in the
store exactly once.

    python tools/ray_rollouts.py                                # 4 actors x 6 steps, ~30 s on 2 cores
    python tools/ray_rollouts.py --actors 8 --steps 20 --store /shared/run1 --keep
    python tools/ray_rollouts.py --address auto --actor-cpus 1  # on a running cluster (a path all nodes see)

``--store`` is a directory every node sees, or an ``s3://`` URL with
``--storage-option key=value`` (repeatable), passed to ``ReplayStore``
unchanged (the ``[s3]`` backend).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from diskreplay import PromptGroupSampler, ReplayStore  # noqa: E402
from diskreplay.integrations.ray import StoreFollower, rollout_actor_class  # noqa: E402
from diskreplay.synthetic import make_rollouts  # noqa: E402


class GrpoGroups:
    """Actor ``worker``'s batch of one step: ``groups`` prompts x ``group_size`` completions.

    Prompt ids never collide between actors; the policy version is the step.
    """

    def __init__(self, worker: int, steps: int, groups: int, group_size: int) -> None:
        self.worker, self.steps, self.groups, self.group_size = worker, steps, groups, group_size

    def __call__(self, step: int) -> Dict[str, Any]:
        first = (self.worker * self.steps + step) * self.groups
        return make_rollouts(self.groups, self.group_size, seed=self.worker * 1_000_003 + step,
                             first_group=first, policy_version=step, prompt_mean=64, completion_mean=128)


def train(follower: StoreFollower, steps: int, batch_size: int, interval: float) -> Dict[str, Any]:
    """The trainer: waits for the first groups, then draws ``steps`` batches while the actors write."""
    if not follower.wait_for_rows(batch_size, timeout=120):
        raise TimeoutError(f"no {batch_size} rows in the store after 120 s")
    rewards, lengths, generations = [], [], []
    for _ in range(steps):
        rows, batch = follower.sample_batch(batch_size, columns=["rewards", "completion_ids", "prompt_id"])
        rewards.append(float(np.mean(batch["rewards"])))
        lengths.append(float(np.mean(batch["completion_ids"].lengths)))
        generations.append(follower.stats()["generation"])
        time.sleep(interval)
    return {"batches": steps, "mean_reward": float(np.mean(rewards)), "mean_completion": float(np.mean(lengths)),
            "first_generation": generations[0], "last_generation": generations[-1], **follower.stats()}


def parse_options(items: List[str]) -> Dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--storage-option takes key=value, got {item!r}")
        out[key] = value
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--store", metavar="DIR|s3://...",
                        help="store directory (every node must see it) or s3:// URL (default: a temporary "
                             "directory, removed at the end unless --keep)")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to ReplayStore(storage_options=...) for an s3:// store (repeatable; "
                             "default: none)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary store and print its path (default: removed)")
    parser.add_argument("--actors", type=int, default=4, metavar="N", help="rollout actors (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=6, metavar="N", help="batches per actor (default: %(default)s)")
    parser.add_argument("--groups", type=int, default=4, metavar="N",
                        help="prompt groups per batch (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=8, metavar="N",
                        help="completions per prompt (default: %(default)s)")
    parser.add_argument("--train-steps", type=int, default=10, metavar="N",
                        help="batches the trainer draws (default: %(default)s)")
    parser.add_argument("--train-groups", type=int, default=4, metavar="N",
                        help="groups per trainer batch (default: %(default)s)")
    parser.add_argument("--samples-per-group", type=int, default=4, metavar="N",
                        help="rows per drawn group (default: %(default)s)")
    parser.add_argument("--train-interval", type=float, default=0.2, metavar="S",
                        help="seconds between the trainer's draws (default: %(default)s)")
    parser.add_argument("--no-kill", action="store_true",
                        help="do not kill actor 0 mid-run (default: killed after its first acknowledged batch)")
    parser.add_argument("--address", metavar="ADDRESS",
                        help="join this Ray cluster ('auto': the running one) instead of starting one "
                             "(default: a local cluster of --num-cpus CPUs)")
    parser.add_argument("--num-cpus", type=int, default=2, metavar="N",
                        help="CPUs of the local cluster (default: %(default)s)")
    parser.add_argument("--actor-cpus", type=float, default=0, metavar="N",
                        help="CPUs each actor reserves (default: %(default)s, so that all actors fit a small "
                             "local cluster)")
    args = parser.parse_args(argv)
    for name in ("actors", "steps", "groups", "group_size", "train_steps", "train_groups", "samples_per_group",
                 "num_cpus"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("train_interval", "actor_cpus"):
        if not 0 <= getattr(args, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a number >= 0, got {getattr(args, name)}")

    import ray

    started = time.monotonic()
    temporary = args.store is None
    path = tempfile.mkdtemp(prefix="ray-rollouts-") if temporary else args.store
    storage_options = parse_options(args.storage_option) or None
    extra = {"storage_options": storage_options} if storage_options else {}
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        ReplayStore(path, multi_writer=True, **extra).close()  # created once, here, before any actor
        Actor = rollout_actor_class(max_restarts=3, num_cpus=args.actor_cpus)
        actors = [Actor.remote(path, f"rollout-{w}", GrpoGroups(w, args.steps, args.groups, args.group_size),
                               storage_options=storage_options) for w in range(args.actors)]
        sampler = PromptGroupSampler(num_groups=args.train_groups, seed=0)
        follower = StoreFollower(path, sampler, storage_options=storage_options)  # pickled to the trainer
        trainer = ray.remote(train).options(num_cpus=args.actor_cpus).remote(
            follower, args.train_steps, args.train_groups * args.samples_per_group, args.train_interval)
        follower.close()

        pending = {(w, s): actors[w].rollout.remote(s) for w in range(args.actors) for s in range(args.steps)}
        if not args.no_kill:
            ray.wait([pending[(0, 0)]], timeout=120)
            ray.kill(actors[0], no_restart=False)  # like a node losing the process: Ray restarts it
        acked = dict(zip(pending, ray.get(list(pending.values()))))
        trained = ray.get(trainer)
        infos = ray.get([a.info.remote() for a in actors])

        with ReplayStore(path, readonly=True, **extra) as store:
            total = sum(len(r) for r in acked.values())
            all_rows = np.sort(np.concatenate(list(acked.values())))
            once = len(store) == store.next_row == total and np.array_equal(all_rows, np.arange(total))
            print(f"store      {path} (multi-writer): generation {store.generation}, {len(store)} rows, "
                  f"{store.num_groups} prompt groups")
            restarted = [i["worker_id"] for i in infos if i["restarted"]]
            print(f"rollouts   {args.actors} actors x {args.steps} steps = {len(acked)} batches acknowledged, "
                  f"{total} rows; restarted: {', '.join(restarted) or 'none'}; batches sent again after a "
                  f"restart and found committed: {sum(i['replayed'] for i in infos)}")
            print(f"exactly    every acknowledged batch in the store once: {'yes' if once else 'NO'}")
            print(f"trainer    {trained['batches']} batches of {args.train_groups} groups x "
                  f"{args.samples_per_group} rows, generations {trained['first_generation']} -> "
                  f"{trained['last_generation']} ({trained['refreshes']} refreshes), mean reward "
                  f"{trained['mean_reward']:.3f}, mean completion {trained['mean_completion']:.0f} tokens")
            print(f"time       {time.monotonic() - started:.1f} s")
        return 0 if once else 1
    finally:
        ray.shutdown()
        if temporary and not args.keep:
            shutil.rmtree(path, ignore_errors=True)
        elif temporary:
            print(f"kept       {path}")


if __name__ == "__main__":
    sys.exit(main())
