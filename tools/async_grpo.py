"""Asynchronous GRPO on one store: generator processes and a trainer run at once; the trainer is
killed (SIGKILL) and resumed, and every rollout is still consumed exactly once within the lag bound.

``--generators`` processes each commit batches of prompt groups through a
:class:`~diskreplay.integrations.ray.RolloutWriter` (exactly-once tokens,
``max_ahead_rows`` back-pressure). The samples of one prompt come from two
generators, so a group completes only when both have committed theirs. A
generator reads the trainer's policy version from its committed cursor before
each batch, as it would load new weights; some completions are partial
rollouts continued under the next version (per-token ``token_policy_versions``)
and hold tool tokens (``tool_mask`` 0).

The trainer consumes whole groups with a
:class:`~diskreplay.stream.RolloutStream` (``max_policy_lag``), collates each
batch in TRL's layout, takes a step, and commits its cursor together with its
state (the policy version and the rows it consumed). The driver kills it
``--kills`` times at random points and starts it again. At the end it checks:
no row consumed twice; consumed + skipped as stale + evicted + dropped + still
waiting = every committed row; every consumed batch within the lag bound.

    python tools/async_grpo.py                          # 4 generators, ~20 s on 2 cores
    python tools/async_grpo.py --generators 8 --steps 60 --store /tmp/run --keep
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from diskreplay.cli.parser import number  # noqa: E402

GENERATOR = r"""
import json, sys, time
import numpy as np
from diskreplay.integrations.ray import RolloutWriter
from diskreplay.synthetic import make_rollouts
path, me, generators, steps, groups, half, max_ahead, seconds = sys.argv[1:9]
me, generators, steps, groups, half, max_ahead = map(int, (me, generators, steps, groups, half, max_ahead))
pair = me // 2  # generators 2k and 2k+1 each write half of the samples of the same prompts
with RolloutWriter(path, f"gen-{me}", max_ahead_rows=max_ahead, wait_timeout=30) as writer:
    for step in range(steps):
        def batch():  # called after the writer's wait for the trainer (back-pressure)
            writer.store.refresh()
            saved = writer.store.load_state("stream.trainer")
            version = int(((saved or {}).get("extra") or {}).get("policy_version", 0))  # "load new weights"
            b = make_rollouts(groups, half, seed=me * 100_003 + step, first_group=(pair * steps + step) * groups,
                              policy_version=version, prompt_mean=32, completion_mean=48)
            rng = np.random.default_rng(me * 7 + step)
            masks, versions = [], []
            for c in b["completion_ids"]:
                mask = np.ones(len(c), np.int8)
                if rng.random() < 0.5:                 # a tool call's output inside the completion
                    a = int(rng.integers(0, len(c)))
                    mask[a:a + int(rng.integers(1, 8))] = 0
                masks.append(mask)
                if rng.random() < 0.3:                 # continued under the next weights from token cut
                    cut = int(rng.integers(0, len(c) + 1))
                    versions.append(np.r_[np.full(cut, version), np.full(len(c) - cut, version + 1)])
                else:
                    versions.append(None)
            b["tool_mask"], b["token_policy_versions"] = masks, versions
            return b

        writer.append(step, batch)
        time.sleep(float(seconds))  # the next generation
print(json.dumps(writer.stats()))
"""

TRAINER = r"""
import json, os, sys
import numpy as np, torch
from diskreplay import Collator, ReplayStore
from diskreplay.stream import RolloutStream
path, group, batch_size, max_lag, done_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
with ReplayStore(path) as store:
    stream = RolloutStream(store, "trainer", group_size=group, max_policy_lag=max_lag)
    extra = stream.extra or {}
    version, consumed = int(extra.get("policy_version", 0)), np.asarray(extra.get("consumed", []), np.int64)
    worst_lag = int(extra.get("worst_lag", 0))
    stream.save()  # publish the cursor: the generators wait for it
    print(json.dumps({"resumed_at": stream.position, "policy_version": version}), flush=True)
    collator = Collator(pad_token_id=0)
    while True:
        rows = stream.next(batch_size, policy_version=version, timeout=1.0)
        if rows is None:
            if os.path.exists(done_file):  # the generators are done and nothing more completes
                break
            continue
        batch = collator.read(store, rows, columns=["completion_ids", "tool_mask", "old_per_token_logps",
                                                    "advantages", "policy_version"])
        loss_tokens = batch["completion_mask"] * batch["tool_mask"]          # tool tokens are not trained on
        loss = -(batch["old_per_token_logps"] * loss_tokens).sum() / loss_tokens.sum().clamp(min=1)
        assert torch.isfinite(loss)
        worst_lag = max(worst_lag, version - int(batch["policy_version"].min()))
        version += 1                                                          # the optimizer step
        consumed = np.concatenate([consumed, rows])
        stream.save(extra={"policy_version": version, "consumed": consumed, "worst_lag": worst_lag})
    stream.save()  # the rows skipped since the last step are counted in the cursor too
print(json.dumps({"done": True, **stream.stats()}), flush=True)
"""


def _start(code: str, *args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen, what: str, timeout: float = 600) -> str:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}):\n{err[-3000:]}")
    return out


def main(argv=None) -> int:
    positive, non_negative = number(int, 1, "a positive integer"), number(int, 0, "an integer >= 0")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generators", type=positive, default=4, metavar="N",
                    help="generator processes (even: they work in pairs; default: %(default)s)")
    ap.add_argument("--steps", type=positive, default=24, metavar="N",
                    help="batches per generator (default: %(default)s)")
    ap.add_argument("--groups", type=positive, default=4, metavar="N",
                    help="prompts per batch (default: %(default)s)")
    ap.add_argument("--group-size", type=positive, default=8, metavar="N",
                    help="completions per prompt (even: half from each of a pair; default: %(default)s)")
    ap.add_argument("--batch-groups", type=positive, default=4, metavar="N",
                    help="groups per trainer step (default: %(default)s)")
    ap.add_argument("--max-lag", type=non_negative, default=4, metavar="N",
                    help="max_policy_lag of the trainer's stream: older rows are skipped as stale "
                         "(default: %(default)s)")
    ap.add_argument("--max-ahead", type=positive, default=None, metavar="ROWS",
                    help="generators' max_ahead_rows, their back-pressure (default: the rows of "
                         "max(1, --max-lag - 1) trainer batches)")
    ap.add_argument("--gen-seconds", type=number(float, 0, "a number of seconds >= 0"), default=0.15,
                    metavar="S", help="seconds a generator takes per batch (default: %(default)s)")
    ap.add_argument("--kills", type=non_negative, default=2, metavar="N",
                    help="times the trainer is SIGKILLed and resumed (default: %(default)s)")
    ap.add_argument("--store", metavar="DIR",
                    help="store directory, kept at the end (default: a temporary one, removed unless --keep)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the temporary store and its directory (default: removed)")
    ap.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the kill times (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.generators < 2 or args.generators % 2 or args.group_size % 2:
        ap.error("--generators and --group-size must be even (a prompt's samples come from two generators)")
    from diskreplay import ReplayStore

    root = args.store or tempfile.mkdtemp(prefix="async-grpo-")
    path = os.path.join(root, "store") if args.store is None else root
    ReplayStore(path, multi_writer=True).close()
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    batch_rows = args.batch_groups * args.group_size
    max_ahead = args.max_ahead if args.max_ahead is not None else max(1, args.max_lag - 1) * batch_rows
    done_file = os.path.join(tempfile.mkdtemp(prefix="async-grpo-"), "generators-done")
    trainer_args = (path, args.group_size, batch_rows, args.max_lag, done_file)
    trainer = _start(TRAINER, *trainer_args)
    lives = [json.loads(trainer.stdout.readline())]  # its cursor is committed: generation may start
    gens = [_start(GENERATOR, path, i, args.generators, args.steps, args.groups, args.group_size // 2,
                   max_ahead, args.gen_seconds) for i in range(args.generators)]
    try:
        for _ in range(args.kills):
            time.sleep(rng.uniform(0.5, 2.0))
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
            print(f"trainer killed (SIGKILL) after resuming at row {lives[-1]['resumed_at']}, "
                  f"policy version {lives[-1]['policy_version']}; starting it again")
            trainer = _start(TRAINER, *trainer_args)
            lives.append(json.loads(trainer.stdout.readline()))
        writers = [json.loads(_finish(g, "a generator").splitlines()[-1]) for g in gens]
        open(done_file, "w").close()  # the trainer drains what completes and stops
        stats = json.loads(_finish(trainer, "the trainer").splitlines()[-1])
    finally:
        for g in gens:
            if g.poll() is None:
                g.kill()
    wall = time.monotonic() - t0
    with ReplayStore(path, readonly=True) as store:
        state = store.load_state("stream.trainer")
        consumed = np.asarray(state["extra"]["consumed"], np.int64)
        counts = state["counts"]
        accounted = (consumed.size + counts["stale"] + counts["evicted"] + counts["dropped_incomplete"]
                     + len(state["pending"]))
        checks = {
            "no row consumed twice": consumed.size == np.unique(consumed).size,
            "consumed + stale + evicted + dropped + waiting = committed rows": accounted == store.next_row == state["next_row"],
            f"every batch within max_policy_lag={args.max_lag}": state["extra"]["worst_lag"] <= args.max_lag,
            "every generator batch committed once": sum(w["appended"] for w in writers) ==
            args.generators * args.steps,
        }
        print(f"{store.next_row} rows from {args.generators} generators in {wall:.1f} s; trainer resumed at rows "
              f"{[life['resumed_at'] for life in lives]}; consumed {consumed.size}, skipped as stale "
              f"{counts['stale']}, waiting {len(state['pending'])}; worst lag {state['extra']['worst_lag']}; "
              f"generators waited {sum(w['waited_s'] for w in writers):.1f} s for the trainer; "
              f"{stats['batches']} batches in the last life")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    if not args.keep and args.store is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
