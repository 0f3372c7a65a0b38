#!/usr/bin/env python
"""Bounded soak test of a diskreplay store: append, evict, sample, kill, reopen.

For ``--minutes N`` a writer child appends batches to a store with a small
capacity (so every commit evicts and garbage-collects) and saves a sampler
state now and then; after a random while it is either killed with SIGKILL or
told to stop. Between writers the soak verifies the whole store
(``verify_store``), reopens it read-only and as a writer, checks every live
row, the group index and the saved state against what was written, and
samples random rows. Reader children follow the writer the whole time
(``readonly=True`` + ``refresh()``), checking every row they read.

Every row's content is a function of its row id, so any row served can be
checked. The summary table counts commits, kills, reopens, rows verified and
rows lost; the exit status is 1 if any row was lost or wrong, or any process
failed in an unexpected way.

    python tools/soak.py --minutes 5 [--dir D] [--seed S]
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
import textwrap
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CAPACITY = 1000  # large enough that small segments get merged (a merge may hold 1/8 of it)

# The soak's children import the store without diskreplay/__init__.py (which
# imports torch, ~2 s a process), so that a minute holds dozens of kills.
CHILD_PRELUDE = textwrap.dedent(f"""
    import os, sys, json, time, types, signal
    import numpy as np
    _pkg = types.ModuleType("diskreplay")
    _pkg.__path__ = [{os.path.join(ROOT, "diskreplay")!r}]
    sys.modules["diskreplay"] = _pkg
    from diskreplay.errors import RowsEvictedError
    from diskreplay.store import ReplayStore
""")

CONTENT = '''
def expected_rows(ids):
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)

    def tokens(r, salt, n):
        return ((np.arange(n, dtype=np.int64) * 2654435761 + int(r) * 40503 + salt * 977) % 50021).astype(np.int32)

    plen = 1 + (ids * 13) % 64
    clen = (ids * 7) % 200
    return {
        "prompt_id": ids // 8,
        "prompt_ids": [tokens(r, 1, n) for r, n in zip(ids, plen)],
        "completion_ids": [tokens(r, 2, n) for r, n in zip(ids, clen)],
        "old_per_token_logps": [tokens(r, 3, n).astype(np.float32) / np.float32(-50021.0) for r, n in zip(ids, clen)],
        "advantages": ((ids * 7) % 11).astype(np.float32) / np.float32(10) - np.float32(0.5),
        "tag": [f"row-{r}" for r in ids.tolist()],
    }


def rows_mismatch(got, ids):
    """Ids of the rows in ``got`` that differ from what was written for them."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = set()
    for name, want in expected_rows(ids).items():
        col = got[name]
        for i, r in enumerate(ids.tolist()):
            w = want[i]
            g = col[i]
            if isinstance(w, np.ndarray):
                if g is None or g.dtype != w.dtype or g.tobytes() != w.tobytes():
                    bad.add(r)
            elif isinstance(w, str):
                if g != w:
                    bad.add(r)
            elif np.asarray(g).tobytes() != np.asarray(w).tobytes():
                bad.add(r)
    return sorted(bad)


def state_for(k):
    return {"k": k, "weights": np.arange(k % 50, dtype=np.float32) + np.float32(k)}


def state_ok(state, k):
    want = state_for(k)
    return (state is not None and state.get("k") == k
            and np.asarray(state["weights"]).tobytes() == want["weights"].tobytes())
'''

WRITER = '''
path, seed, capacity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
rng = np.random.default_rng(seed)
store = ReplayStore(path, capacity=capacity)
saved = store.load_state("sampler")
k = saved["k"] if saved else 0
print("open", flush=True)
while not stop:
    if rng.random() < 0.1:
        k += 1
        print("savestate", k, flush=True)
        store.save_state("sampler", state_for(k))
        print("state", k, flush=True)
        continue
    first, n = store.next_row, int(rng.integers(1, 17))
    print("begin", first, n, flush=True)
    rows = store.extend(expected_rows(np.arange(first, first + n)))
    print("rows", int(rows[0]), len(rows), flush=True)
    if rng.random() < 0.3:  # sample a few live rows, as a trainer would
        ids = rng.integers(store.head, store.next_row, size=8)
        if rows_mismatch(store.read(ids), ids):
            print("WRONG", ids.tolist(), flush=True)
            sys.exit(3)
store.close()
print("closed", flush=True)
'''

READER = '''
path, seed, stop_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(seed)
stats = {"reads": 0, "rows": 0, "evicted": 0, "wrong": 0}
store = None
while store is None:
    try:
        store = ReplayStore(path, readonly=True)
    except FileNotFoundError:
        time.sleep(0.05)


while not os.path.exists(stop_file):
    try:
        store.refresh()
        if store.next_row == store.head:
            time.sleep(0.01)
            continue
        ids = rng.integers(store.head, store.next_row, size=int(rng.integers(1, 32)))
        got = store.read(ids)
    except RowsEvictedError:
        stats["evicted"] += 1
        continue
    bad = rows_mismatch(got, ids)
    stats["wrong"] += len(bad)
    stats["reads"] += 1
    stats["rows"] += len(ids)
    if stats["reads"] % 20 == 0:
        gi = store.group_index()  # may catch up to a newer commit first
        live = store.row_ids()
        for g, key in enumerate(gi.keys):
            if not np.array_equal(gi.group(g), live[live // 8 == key]):
                stats["wrong"] += 1
    time.sleep(0.002)  # leave the writer its share of the CPUs
print(json.dumps(stats), flush=True)
'''


class Child:
    def __init__(self, body: str, *args: object, workdir: str) -> None:
        fd, self.out = tempfile.mkstemp(dir=workdir, suffix=".out")
        os.close(fd)
        self.err = self.out[:-4] + ".err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + CONTENT + body, *map(str, args)],
                                         stdout=out, stderr=err)

    def lines(self) -> list:
        with open(self.out) as f:
            text = f.read()
        return text[: text.rfind("\n") + 1].splitlines()

    def errors(self) -> str:
        with open(self.err) as f:
            return f.read()

    def wait_for(self, prefix: str, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.startswith(prefix) for line in self.lines()):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.005)
        return False


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of minutes, got {text!r}")
    return value


def main(argv=None) -> int:
    from diskreplay.cli.parser import number

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=_minutes, required=True, metavar="N",
                    help="how long to soak, in minutes (required; writers keep starting until then)")
    ap.add_argument("--dir", default=None, metavar="DIR",
                    help="the store is DIR/store (one already there is replaced) and is kept at the end "
                         "(default: a temporary directory, removed at the end)")
    ap.add_argument("--seed", type=int, default=0, metavar="S",
                    help="seed of every random choice: kill times, the children's appends and reads, the rows "
                         "sampled (default: %(default)s)")
    ap.add_argument("--readers", type=number(int, 0, "an integer >= 0"), default=2, metavar="N",
                    help="reader children following the writer the whole time (0: none; default: %(default)s)")
    args = ap.parse_args(argv)

    from diskreplay.store import ReplayStore
    from diskreplay.verify import verify_store
    content: dict = {"np": np}
    exec(CONTENT, content)  # the children's own definitions, so both sides agree
    rows_mismatch, state_ok = content["rows_mismatch"], content["state_ok"]

    base = args.dir or tempfile.mkdtemp(prefix="diskreplay-soak-")
    os.makedirs(base, exist_ok=True)
    path = os.path.join(base, "store")
    if os.path.exists(path):
        shutil.rmtree(path)
    work = tempfile.mkdtemp(prefix="soak-io-", dir=base)
    stop_file = os.path.join(work, "STOP")
    rng = random.Random(args.seed)
    t = {"commits": 0, "state saves": 0, "kills (SIGKILL)": 0, "kills mid-append": 0,
         "in-flight appends kept": 0, "in-flight appends dropped": 0, "clean stops": 0, "reopens": 0,
         "verify runs": 0, "rows verified": 0, "rows sampled": 0, "rows lost": 0, "rows wrong": 0,
         "reader rows verified": 0, "reader evicted reads": 0,
         "unexpected errors": 0}
    problems = []
    end, k_saved = 0, 0
    deadline = time.monotonic() + args.minutes * 60
    readers = [Child(READER, path, args.seed * 100 + i, stop_file, workdir=work) for i in range(args.readers)]
    cycle = 0
    while time.monotonic() < deadline:
        cycle += 1
        w = Child(WRITER, path, args.seed * 100000 + cycle, CAPACITY, workdir=work)
        if not w.wait_for("open"):
            problems.append(f"writer {cycle} did not open: {w.errors()[-2000:]}")
            t["unexpected errors"] += 1
            break
        time.sleep(rng.uniform(0.05, 1.5))
        if rng.random() < 0.7:
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait()
            t["kills (SIGKILL)"] += 1
            if w.proc.returncode != -signal.SIGKILL:
                problems.append(f"writer {cycle} exited {w.proc.returncode}: {w.errors()[-2000:]}")
                t["unexpected errors"] += 1
        else:
            w.proc.send_signal(signal.SIGTERM)
            w.proc.wait(timeout=60)
            t["clean stops"] += 1
            if w.proc.returncode != 0:
                problems.append(f"writer {cycle} exited {w.proc.returncode}: {w.errors()[-2000:]}")
                t["unexpected errors"] += 1
        lines = w.lines()
        killed = w.proc.returncode == -signal.SIGKILL
        pending = 0
        saving = None
        for line in lines:
            parts = line.split()
            if parts[0] == "rows":
                first, n = int(parts[1]), int(parts[2])
                if first != end:
                    problems.append(f"writer {cycle} appended at row {first}, expected {end}")
                    t["rows lost"] += max(0, end - first)
                end = first + n
                t["commits"] += 1
                pending = 0
            elif parts[0] == "begin":
                pending = int(parts[2])
            elif parts[0] == "savestate":
                saving = int(parts[1])
            elif parts[0] == "state":
                k_saved, saving = int(parts[1]), None
                t["commits"] += 1
                t["state saves"] += 1
            elif parts[0] == "WRONG":
                t["rows wrong"] += 1
                problems.append(f"writer {cycle}: {line}")
        if not killed:
            pending = 0
        if pending:
            t["kills mid-append"] += 1

        # after every writer: verify, reopen read-only, check everything
        report = verify_store(path)
        t["verify runs"] += 1
        if not report["ok"]:
            problems.append(f"verify after writer {cycle}: {report['problems']}")
            t["unexpected errors"] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store = ReplayStore(path, readonly=True)
        t["reopens"] += 1
        if store.next_row < end:
            t["rows lost"] += end - store.next_row
            problems.append(f"after writer {cycle}: next_row {store.next_row} < {end} returned")
        elif store.next_row not in (end, end + pending):
            problems.append(f"after writer {cycle}: next_row {store.next_row}, expected {end} or {end + pending}")
            t["unexpected errors"] += 1
        if pending:
            t["in-flight appends kept" if store.next_row > end else "in-flight appends dropped"] += 1
        want_head = max(0, max(end, store.next_row) - CAPACITY)
        if store.head > want_head:
            t["rows lost"] += store.head - want_head
            problems.append(f"after writer {cycle}: head {store.head} > {want_head}")
        end = store.next_row
        ids = store.row_ids()
        bad = rows_mismatch(store.read(ids), ids)
        t["rows verified"] += len(ids) - len(bad)
        t["rows wrong"] += len(bad)
        if bad:
            problems.append(f"after writer {cycle}: rows {bad[:10]} differ")
        gi = store.group_index()
        for g, key in enumerate(gi.keys):
            if not np.array_equal(gi.group(g), ids[ids // 8 == key]):
                problems.append(f"after writer {cycle}: group {key} is wrong")
                t["rows wrong"] += 1
        st = store.load_state("sampler")
        if saving is not None and killed and state_ok(st, saving):
            k_saved = saving
        if k_saved and not state_ok(st, k_saved):
            problems.append(f"after writer {cycle}: state is not state {k_saved}")
            t["rows lost"] += 1
        store.close()
        if cycle % 3 == 0:  # reopen as writer and sample, as a resumed trainer would
            with ReplayStore(path) as store:
                t["reopens"] += 1
                if len(store):
                    sample = np.array(rng.choices(range(store.head, store.next_row), k=64))
                    bad = rows_mismatch(store.read(sample), sample)
                    t["rows sampled"] += len(sample)
                    t["rows wrong"] += len(bad)
    open(stop_file, "w").close()
    for r in readers:
        try:
            r.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            r.proc.kill()
        if r.proc.returncode != 0:
            problems.append(f"reader failed: {r.errors()[-2000:]}")
            t["unexpected errors"] += 1
            continue
        stats = json.loads(r.lines()[-1])
        t["reader rows verified"] += stats["rows"] - stats["wrong"]
        t["rows wrong"] += stats["wrong"]
        t["reader evicted reads"] += stats["evicted"]
    report = verify_store(path)
    if not report["ok"]:
        problems.append(f"final verify: {report['problems']}")
        t["unexpected errors"] += 1

    width = max(map(len, t))
    print(f"diskreplay soak: {args.minutes:g} min, seed {args.seed}, capacity {CAPACITY} rows, "
          f"{args.readers} readers, store {path}")
    print(f"{'counter':<{width}}  value")
    print(f"{'-' * width}  -----")
    for key, value in t.items():
        print(f"{key:<{width}}  {value}")
    for p in problems[:20]:
        print("PROBLEM:", p)
    failed = t["rows lost"] or t["rows wrong"] or t["unexpected errors"]
    print("RESULT:", "FAIL" if failed else "OK (0 rows lost, 0 wrong)")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
