"""The diskreplay demo: write, reopen, sample, collate and export a store.

    python -m diskreplay.demo [--dir DIR] [--groups N]

Generates realistic synthetic GRPO rollouts, streams them into a store as a
training loop would (one commit per step), reopens the store in a fresh
process, samples with every strategy, re-pads a batch into TRL's layout and
exports the store to Parquet.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

from . import (PrioritizedSampler, PromptGroupSampler, RandomSampler, ReplayStore, collate)
from .errors import DiskReplayError
from .format import FORMAT_FILE
from .synthetic import rollout_stream

_REOPEN = textwrap.dedent("""
    import json, sys, time
    import diskreplay
    t = time.perf_counter()
    store = diskreplay.ReplayStore(sys.argv[1], readonly=True)
    row = store.read([store.head], ["completion_ids"])
    t_open = time.perf_counter() - t
    print(json.dumps({"ms": 1e3 * t_open, "rows": len(store), "groups": store.num_groups,
                      "first_completion_len": len(row["completion_ids"][0])}))
""")


MIN_GROUPS = 64  # the largest batch the demo draws: 64 prompt groups


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m diskreplay.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="a directory for the demo's store (DIR/store, replaced if it holds an earlier "
                                 "run's store; anything else there is refused) and its export "
                                 "(DIR/rollouts.parquet); both are kept (default: a new temporary directory, "
                                 "removed at the end unless --keep)")
    p.add_argument("--groups", type=int, default=512,
                   help=f"prompt groups to generate (8 rows each; at least {MIN_GROUPS}, the most one batch draws; "
                        "default 512)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory with the store and the export")
    args = p.parse_args(argv)
    if args.groups < MIN_GROUPS:
        p.error(f"--groups must be at least {MIN_GROUPS} (the demo draws batches of {MIN_GROUPS} prompt groups), "
                f"got {args.groups}")
    if args.dir is not None:
        path, export = os.path.join(args.dir, "store"), os.path.join(args.dir, "rollouts.parquet")
        if os.path.lexists(args.dir) and not os.path.isdir(args.dir):
            p.error(f"--dir {args.dir} exists and is not a directory")
        if os.path.lexists(path) and not os.path.exists(os.path.join(path, FORMAT_FILE)) \
                and not (os.path.isdir(path) and not os.listdir(path)):
            p.error(f"{path} exists and is not a diskreplay store; the demo replaces only a store of its own "
                    "(pass another --dir)")
        if os.path.lexists(export) and not os.path.isfile(export):
            p.error(f"{export} exists and is not a file; the demo replaces only a Parquet file there "
                    "(pass another --dir)")
    try:
        work = args.dir or tempfile.mkdtemp(prefix="diskreplay-demo-")
    except OSError as exc:
        print(f"error: cannot make a temporary directory for the demo: {exc} (pass --dir)", file=sys.stderr)
        return 1
    try:
        return _run(work, args)
    except (DiskReplayError, OSError) as exc:  # a directory it may not write, a full disk: say so, briefly
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def _run(work: str, args: argparse.Namespace) -> int:
    path = os.path.join(work, "store")
    shutil.rmtree(path, ignore_errors=True)  # an earlier run's store (main checked)
    print(f"diskreplay demo: {args.groups} prompts x 8 completions -> {path}")

    # 1. stream rollouts in, one commit per training step of 64 prompts
    t = time.perf_counter()
    with ReplayStore(path, capacity=args.groups * 8, group_key="prompt_id") as store:
        for batch in rollout_stream(args.groups, groups_per_step=64, group_size=8):
            store.extend(batch)
        nbytes, rows = store.nbytes, len(store)
    t_write = time.perf_counter() - t

    # 2. reopen in a fresh process, as a restarted job would
    out = subprocess.run([sys.executable, "-c", _REOPEN, path], check=True, capture_output=True, text=True)
    reopened = json.loads(out.stdout)

    store = ReplayStore(path, readonly=True)
    tokens = store.read(store.row_ids(), ["completion_ids"])["completion_ids"]
    n_tokens = int(tokens.offsets[-1] - tokens.offsets[0])
    print(f"  wrote {rows:,} rows ({n_tokens:,} completion tokens) in {t_write:.2f} s "
          f"({rows / t_write:,.0f} rows/s with one-time imports; fsync per commit)")
    print(f"  on disk: {_human(nbytes)}, {nbytes / n_tokens:.1f} bytes per completion token "
          f"(a padded [rows, 4096] store would need ~{12 * 4096 * rows / n_tokens:.0f})")
    print(f"  reopened in a new process: {reopened['rows']:,} rows, {reopened['groups']:,} groups, "
          f"first row read after {reopened['ms']:.1f} ms")

    # 3. sample with every strategy
    print("\n  sampling 32 prompt groups x 4 of their 8 completions:")
    for strategy in ("random", "recency", "reward", "variance"):
        sampler = PromptGroupSampler(num_groups=32, strategy=strategy, seed=0)
        t = time.perf_counter()
        ids = sampler.sample(store, 128)
        ms = 1e3 * (time.perf_counter() - t)
        r = store.read(ids, ["rewards", "prompt_id"])
        per_group = r["rewards"].reshape(32, 4)
        print(f"    {strategy:<9} {ms:6.2f} ms  groups={len(set(r['prompt_id'].tolist()))}  "
              f"mean reward={per_group.mean():.3f}  mean within-group std={per_group.std(1).mean():.3f}")
    ssr = PrioritizedSampler(priority_key="advantages", alpha=1.0, seed=0)
    ids = ssr.sample(store, 128)
    adv = np.abs(store.read(ids, ["advantages"])["advantages"]).mean()
    print(f"    SSR (|adv|^1) mean |advantage| of drawn rows {adv:.3f} "
          f"(store mean {np.abs(store.read(store.row_ids(), ['advantages'])['advantages']).mean():.3f})")
    ids = RandomSampler(seed=0).sample(store, 128)
    print(f"    uniform rows without replacement: {len(set(ids.tolist()))} distinct of 128")

    # 4. re-pad one batch into TRL's layout
    ids = PromptGroupSampler(num_groups=64, seed=1).sample(store, 512)
    collate(store.read(ids), pad_token_id=0)  # the first call pays torch's one-time set-up
    t = time.perf_counter()
    batch = collate(store.read(ids), pad_token_id=0)
    ms = 1e3 * (time.perf_counter() - t)
    shapes = {k: tuple(v.shape) for k, v in batch.items() if hasattr(v, "shape")}
    print(f"\n  collate 512 rows into TRL's layout in {ms:.1f} ms: " + ", ".join(
        f"{k}{list(s)}" for k, s in shapes.items() if k in ("prompt_ids", "completion_ids", "advantages")))

    # 5. export
    try:
        from .export import export_parquet
    except ImportError:  # pragma: no cover - export ships with the package
        export_parquet = None
    if export_parquet is not None:
        out_path = os.path.join(work, "rollouts.parquet")
        t = time.perf_counter()
        export_parquet(store, out_path, overwrite=True)
        import pyarrow.parquet as pq

        meta = pq.read_metadata(out_path)
        kept = "" if args.keep or args.dir is not None else " (removed at the end: --keep keeps it)"
        print(f"  exported to {out_path}{kept}: {meta.num_rows:,} rows, {_human(os.path.getsize(out_path))} "
              f"in {time.perf_counter() - t:.2f} s")
    store.close()
    print("\ndone.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
