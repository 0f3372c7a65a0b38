"""Benchmarks of diskreplay against baselines measured in the same run.

    python tools/bench.py store  [--groups 4096] [--big 10] [--dir DIR] [--small-commits 3000]
    python tools/bench.py sample [--groups 4096] [--dir DIR] [--quick] [--only cold|restart|ids]
    python tools/bench.py export [--groups 4096] [--big 10] [--dir DIR]
    python tools/bench.py priorities [--sizes 32768,1000000,10000000] [--dir DIR]
    python tools/bench.py writers [--groups 1024] [--commits 100] [--rounds 3] [--dir DIR]
    python tools/bench.py remote [--groups 1024] [--dir DIR]
    python tools/bench.py commit-cpu [--commits 300] [--profile] [--dir DIR]
    python tools/bench.py stream [--groups 1024] [--commits 100] [--rounds 3] [--dir DIR]
    python tools/bench.py async-buffer [--groups 256] [--rounds 3] [--dir DIR]
    python tools/bench.py transferqueue [--groups 1024 (rows)] [--rounds 3] [--dir DIR]
    python tools/bench.py media [--groups 4096] [--image-kib 1024] [--rounds 3] [--dir DIR]

Every number is printed next to its baseline and the ratio. The workload is
the GRPO one of diskreplay.synthetic: 8 completions per prompt, prompts ~256
tokens, completions ~600, old/ref log-probs per completion token.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Dict, List, Tuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mmap  # noqa: E402
import multiprocessing as mp  # noqa: E402
import statistics  # noqa: E402

import pyarrow as pa  # noqa: E402

import torch  # noqa: E402

from diskreplay import (Collator, PromptGroupSampler, RaggedColumn, ReplayStore, collate,  # noqa: E402
                        collate_unpadded)
from diskreplay.loader import ReplayLoader  # noqa: E402
from diskreplay import _jit  # noqa: E402
from diskreplay import format as fmt  # noqa: E402
from diskreplay.samplers import STRATEGIES  # noqa: E402
from diskreplay.store.replay_store import INDEX_TAIL_SEGMENTS  # noqa: E402
from diskreplay.synthetic import rollout_stream  # noqa: E402


TOKEN_COLUMNS = ("completion_ids", "old_per_token_logps", "ref_per_token_logps")


def row(label: str, value: str, baseline: str = "", ratio: str = "") -> None:
    print(f"  {label:<44} {value:>18} {baseline:>18} {ratio:>10}")


#: the sample benchmark's targets, filled as the sample benchmark measures them: (what, ratio, target, met)
TARGETS: List[tuple] = []


def target(what: str, ratio: float, goal: str) -> str:
    """Record ``ratio`` against ``goal`` (">= 0.9" or "<= 1.1") and return the column text."""
    op, bound = goal.split()
    met = ratio >= float(bound) if op == ">=" else ratio <= float(bound)
    TARGETS.append((what, ratio, goal, met))
    return f"{ratio:.2f}x ({'met' if met else 'NOT met'}: {goal})"


def print_targets(report=print) -> None:
    if not TARGETS:
        return
    report("\ntargets (ratios of paths measured in this run)")
    for what, ratio, goal, met in TARGETS:
        report(f"  {what:<64} {ratio:8.2f}x  target {goal:<7} {'met' if met else 'NOT met'}")


def ensure_group_index(path: str) -> None:
    """Give a store written before persisted group indexes existed one (docs/FORMAT.md, "Group index")
    so that reopening it is measured as a store written now would be."""
    with ReplayStore(path, readonly=True) as store:
        gi = store.manifest.group_index
        if (gi is not None and gi.frame is not None) or store.group_key is None:  # (frame: layout 2)
            return
    with ReplayStore(path) as writer:
        writer._persist_group_index(force=True)


def evict_from_page_cache(path: str) -> None:
    """Drop a directory's files from the page cache (they are clean, so this is honoured)."""
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def make_batches(groups: int, seed: int = 0) -> List[Dict[str, object]]:
    return list(rollout_stream(groups, 64, 8, seed=seed))


def payload_bytes(batches) -> Dict[str, int]:
    comp = sum(int(sum(len(x) for x in b["completion_ids"])) for b in batches)
    prompt = sum(int(sum(len(x) for x in b["prompt_ids"])) for b in batches)
    rows = sum(len(b["prompt_id"]) for b in batches)
    return {"completion_tokens": comp, "prompt_tokens": prompt, "rows": rows,
            # ids + old + ref log-probs per completion token, prompt ids
            "raw": comp * 12 + prompt * 4}


def write_raw(batches, path: str) -> float:
    """Baseline: the same rollouts flattened (one concatenate per column) and appended to one
    file with numpy ``tofile``, fsync per step: the bytes, with no format, index or commit."""
    t = time.perf_counter()
    with open(path, "wb") as f:
        for b in batches:
            for k in ("prompt_ids",) + TOKEN_COLUMNS:
                np.concatenate(b[k]).tofile(f)
            for k in ("prompt_id", "policy_version", "rewards", "advantages"):
                np.asarray(b[k]).tofile(f)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t


def warm_free_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it, right before a measured run allocates.

    This VM returns free memory to its host a few seconds after it is freed
    (virtio-balloon free page reporting), and the next touch of such a page
    costs ~3 ns per byte, page cache included: writing 4 MB into a new file
    took 14 ms here, into a just-truncated one (pages freed a moment ago) 2 ms,
    and 2 ms into a new file right after this warm-up. Without it a run that
    creates new files pays for the VM, and a baseline that rewrites one file
    does not.

    >>> warm_free_memory(1 << 20)
    """
    block = np.ones(nbytes, dtype=np.uint8)
    del block


def write_store(batches, path: str) -> float:
    t = time.perf_counter()
    with ReplayStore(path) as store:
        for b in batches:
            store.extend(b)
    return time.perf_counter() - t


REOPEN_CHILD = textwrap.dedent("""
    import sys, time, json
    import torch, numpy, pyarrow  # interpreter and import time are excluded
    import diskreplay
    t = time.perf_counter()
    store = diskreplay.ReplayStore(sys.argv[1], readonly=True)
    first = store.read([store.head])
    t1 = time.perf_counter()
    store.group_keys()
    t2 = time.perf_counter()
    print(json.dumps({"open_first_row_ms": 1e3 * (t1 - t), "group_index_ms": 1e3 * (t2 - t1)}))
""")


def reopen_ms(path: str, cold: bool) -> Dict[str, float]:
    runs = []
    for _ in range(3):
        if cold:
            evict_from_page_cache(path)
        out = subprocess.run([sys.executable, "-c", REOPEN_CHILD, path], check=True, capture_output=True,
                             text=True).stdout
        runs.append(json.loads(out))
    return {k: min(r[k] for r in runs) for k in runs[0]}


def big_store(work: str, args) -> str:
    """The ``args.big`` times larger store (built once per work directory, then reused)."""
    path = os.path.join(work, f"store_x{args.big}")
    if not os.path.exists(os.path.join(path, "manifests")) or not os.listdir(os.path.join(path, "manifests")):
        print(f"  writing the {args.big}x store ({args.groups * args.big} groups) ...", flush=True)
        shutil.rmtree(path, ignore_errors=True)
        with ReplayStore(path) as store:
            for b in rollout_stream(args.groups * args.big, 64, 8, seed=1):
                store.extend(b)
    return path


def bench_store(args) -> None:
    work = args.dir or tempfile.mkdtemp(prefix="diskreplay-bench-")
    os.makedirs(work, exist_ok=True)
    print(f"workload: {args.groups} groups x 8 rows, synthetic GRPO rollouts; work dir {work}")
    batches = make_batches(args.groups)
    pay = payload_bytes(batches)
    print(f"  rows {pay['rows']}, completion tokens {pay['completion_tokens']:,}, prompt tokens "
          f"{pay['prompt_tokens']:,}, raw payload {pay['raw'] / 2**20:.1f} MiB")
    raw_path, store_path = os.path.join(work, "raw.bin"), os.path.join(work, "store")
    shutil.rmtree(store_path, ignore_errors=True)
    # alternate to even out the disk's mood; keep the best of three; both write into free memory
    # touched right before (see warm_free_memory)
    t_raw, t_store = [], []
    for i in range(3):
        warm_free_memory(3 * pay["raw"])
        t_raw.append(write_raw(batches, raw_path))
        shutil.rmtree(store_path, ignore_errors=True)
        warm_free_memory(3 * pay["raw"])
        t_store.append(write_store(batches, store_path))
    t_raw, t_store = min(t_raw), min(t_store)
    print("\nappend (one commit per 512 rows, fsync included) diskreplay         raw tofile     ratio")
    row("rows/s", f"{pay['rows'] / t_store:,.0f}", f"{pay['rows'] / t_raw:,.0f}", f"{t_raw / t_store:.2f}")
    row("completion tokens/s", f"{pay['completion_tokens'] / t_store:,.0f}",
        f"{pay['completion_tokens'] / t_raw:,.0f}", f"{t_raw / t_store:.2f}")
    with ReplayStore(store_path, readonly=True) as store:
        nbytes = store.nbytes
    print("\nbytes on disk per completion token                  diskreplay        raw payload     ratio")
    row("bytes/token", f"{nbytes / pay['completion_tokens']:.2f}", f"{pay['raw'] / pay['completion_tokens']:.2f}",
        f"{nbytes / pay['raw']:.3f}")
    del batches
    big_path = big_store(work, args) if args.big > 1 else None
    print("\nreopen in a fresh process until the first row is read (ms, best of 3)")
    small_w, small_c = reopen_ms(store_path, cold=False), reopen_ms(store_path, cold=True)
    row("1x store, warm / cold", f"{small_w['open_first_row_ms']:.1f} / {small_c['open_first_row_ms']:.1f}")
    row("1x store, group index rebuilt (warm)", f"{small_w['group_index_ms']:.1f}")
    if args.big > 1:
        big_w, big_c = reopen_ms(big_path, cold=False), reopen_ms(big_path, cold=True)
        row(f"{args.big}x store, warm / cold", f"{big_w['open_first_row_ms']:.1f} / {big_c['open_first_row_ms']:.1f}",
            "", f"{big_c['open_first_row_ms'] / small_c['open_first_row_ms']:.2f}")
        row(f"{args.big}x store, group index rebuilt (warm)", f"{big_w['group_index_ms']:.1f}", "",
            f"{big_w['group_index_ms'] / max(small_w['group_index_ms'], 1e-3):.2f}")
        # the same open without the segment table: what a reader parsing the JSON entries pays
        newest = fmt.load_newest_manifest(big_path)[0]
        if newest.segment_table is not None:
            table = os.path.join(big_path, newest.segment_table.file)
            os.rename(table, table + ".aside")
            try:
                json_w, json_c = reopen_ms(big_path, cold=False), reopen_ms(big_path, cold=True)
            finally:
                os.rename(table + ".aside", table)
            row(f"{args.big}x store, {len(newest.segments)} segments: table vs JSON entries, warm",
                f"{big_w['open_first_row_ms']:.1f}", f"{json_w['open_first_row_ms']:.1f}",
                f"{json_w['open_first_row_ms'] / big_w['open_first_row_ms']:.2f}")
            row(f"{args.big}x store: table vs JSON entries, cold", f"{big_c['open_first_row_ms']:.1f}",
                f"{json_c['open_first_row_ms']:.1f}", f"{json_c['open_first_row_ms'] / big_c['open_first_row_ms']:.2f}")
        print(f"  target: {args.big}x store vs 1x, reopen to first row, warm {big_w['open_first_row_ms'] / small_w['open_first_row_ms']:.2f}x"
              f" / cold {big_c['open_first_row_ms'] / small_c['open_first_row_ms']:.2f}x (<= 1.5)")
    os.remove(raw_path)
    bench_small_commits(work, args.small_commits)


SMALL_CHILD = textwrap.dedent("""
    import json, os, sys, time
    from diskreplay import ReplayStore
    from diskreplay.store import MergePolicy
    from diskreplay.synthetic import make_rollouts
    path, n, merge = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    # without merging: one segment per commit, as before merging existed
    store = ReplayStore(path, merge_policy=None if merge else MergePolicy(fanin=1 << 40))
    batch = make_rollouts(2, 4, seed=0, completion_mean=50)
    t0 = time.perf_counter()
    last = max(n - 500, 0)
    for i in range(n):
        if i == last:
            t1 = time.perf_counter()
        store.extend(batch)
    t2 = time.perf_counter()
    manifest = os.path.getsize(os.path.join(path, store.manifest.file))
    segments = len(store.manifest.segments)
    store.close()
    t = time.perf_counter()
    ReplayStore(path, readonly=True).read([0])
    print(json.dumps({"total_s": t2 - t0, "last_ms": 1e3 * (t2 - t1) / (n - last), "segments": segments,
                      "manifest": manifest, "reopen_ms": 1e3 * (time.perf_counter() - t)}))
""")


def bench_small_commits(work: str, n: int) -> None:
    """A training loop's small steps (8 rows each): merging small segments vs one segment per commit."""
    if n <= 0:
        return
    runs = {}
    for merge in (True, False):
        path = os.path.join(work, f"small_{'merged' if merge else 'unmerged'}")
        shutil.rmtree(path, ignore_errors=True)
        out = subprocess.run([sys.executable, "-c", SMALL_CHILD, path, str(n), "1" if merge else "0"], check=True,
                             capture_output=True, text=True).stdout
        runs[merge] = json.loads(out)
        shutil.rmtree(path, ignore_errors=True)
    on, off = runs[True], runs[False]
    print(f"\n{n:,} commits of 8 rows (small training steps)        merged   one per commit     ratio")
    row("total time (s)", f"{on['total_s']:.2f}", f"{off['total_s']:.2f}", f"{off['total_s'] / on['total_s']:.2f}")
    row("ms per commit, last 500", f"{on['last_ms']:.2f}", f"{off['last_ms']:.2f}",
        f"{off['last_ms'] / on['last_ms']:.2f}")
    row("segments / manifest bytes", f"{on['segments']} / {on['manifest']:,}",
        f"{off['segments']} / {off['manifest']:,}")
    row("reopen to first row (ms, warm)", f"{on['reopen_ms']:.1f}", f"{off['reopen_ms']:.1f}",
        f"{off['reopen_ms'] / on['reopen_ms']:.2f}")


EXPORT_CHILD = textwrap.dedent("""
    import json, os, sys, threading, time
    import pyarrow as pa
    from diskreplay.export import export_parquet

    def anon_kib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:"))

    base, peak, done = anon_kib(), [0], []
    def sample():
        while not done:
            peak[0] = max(peak[0], anon_kib()); time.sleep(0.005)
    threading.Thread(target=sample, daemon=True).start()
    t = time.perf_counter()
    res = export_parquet(sys.argv[1], sys.argv[2], overwrite=True)
    done.append(1)
    print(json.dumps({"s": time.perf_counter() - t, "rows": res["rows"], "bytes": res["bytes"],
                      "peak_anon_mib": (max(peak[0], anon_kib()) - base) / 1024,
                      "arrow_pool_peak_mib": pa.default_memory_pool().max_memory() / 2**20}))
""")


def export_child(store_path: str, out: str) -> Dict[str, float]:
    out_json = subprocess.run([sys.executable, "-c", EXPORT_CHILD, store_path, out], check=True,
                              capture_output=True, text=True).stdout
    return json.loads(out_json)


def bench_export(args) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from diskreplay.export import export_parquet
    from diskreplay.export._common import column_to_arrow

    work = args.dir or tempfile.mkdtemp(prefix="diskreplay-bench-")
    os.makedirs(work, exist_ok=True)
    store_path = os.path.join(work, "store")
    if not os.path.exists(store_path):
        write_store(make_batches(args.groups), store_path)
    print(f"workload: {args.groups} groups x 8 rows; work dir {work}")
    with ReplayStore(store_path, readonly=True) as store:
        data = store.read(store.row_ids())  # the same rows, in memory, as one Arrow table
        table = pa.table({c: column_to_arrow(store.schema[c], data[c], len(store)) for c in store.columns})
        del data
        base_t, ours_t = [], []
        for _ in range(5):  # interleaved, best of 5: the machine may be shared
            t = time.perf_counter()
            pq.write_table(table, os.path.join(work, "baseline.parquet"))
            base_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            export_parquet(store, os.path.join(work, "export.parquet"), overwrite=True)
            ours_t.append(time.perf_counter() - t)
        seg_mib = max(s.bytes for s in store.manifest.segments) / 2**20
    b, o = min(base_t), min(ours_t)
    print(f"  {len(table):,} rows, {table.nbytes / 2**20:.0f} MiB in Arrow; largest segment {seg_mib:.1f} MiB")
    row("parquet export incl. fsync (s, best of 5)", f"{o:.3f}", f"write_table {b:.3f}", f"{o / b:.2f}x")
    del table
    one = export_child(store_path, os.path.join(work, "export.parquet"))
    row("export peak anon RSS / arrow pool (MiB)", f"{one['peak_anon_mib']:.0f} / {one['arrow_pool_peak_mib']:.0f}")
    if args.big > 1:
        big_path = big_store(work, args)
        res = export_child(big_path, os.path.join(work, "export_big.parquet"))
        row(f"{args.big}x store: rows / export s", f"{res['rows']:,} / {res['s']:.1f}")
        row(f"{args.big}x store: peak anon RSS (MiB)", f"{res['peak_anon_mib']:.0f}",
            f"1x: {one['peak_anon_mib']:.0f}", f"{res['peak_anon_mib'] / max(one['peak_anon_mib'], 1):.2f}x")
        row(f"{args.big}x store: arrow pool peak (MiB)", f"{res['arrow_pool_peak_mib']:.0f}")
        os.remove(os.path.join(work, "export_big.parquet"))


_RAGGED = ("prompt_ids", "completion_ids", "old_per_token_logps", "ref_per_token_logps")
_MASKS = {"prompt_ids": "prompt_mask", "completion_ids": "completion_mask"}


def evict_store(store):
    """Make every page of an open store cold, keeping it open (a long-running loader's view).

    POSIX_FADV_DONTNEED skips pages mapped into a process, so first drop this
    process's mappings of the open segments' pages (MADV_DONTNEED on a shared
    file mapping keeps the data, in the page cache), then evict the files.
    """
    for seg in list(store._segments.values()):
        seg._mmap.madvise(mmap.MADV_DONTNEED)
    evict_from_page_cache(store.path)


def _mem_mb():
    """VmRSS, RssAnon, VmHWM of this process in MB, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
    return out


def _nbytes(batch):
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def _median_ms(fn, n, before=None):
    times = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


class _FlatGather:
    """The "ideal numpy gather": every row's values in one flat memory-mapped .npy per column plus
    offsets, gathered into preallocated padded arrays (same outputs and dtypes as collate)."""

    def __init__(self, store, directory, chunk=4096):
        os.makedirs(directory, exist_ok=True)
        rows = store.row_ids()
        self.cols = {}
        for name in _RAGGED:
            vpath, opath = os.path.join(directory, name + ".values.npy"), os.path.join(directory, name + ".offsets.npy")
            if not os.path.exists(opath):
                parts = [store.read(rows[i:i + chunk], [name])[name] for i in range(0, len(rows), chunk)]
                lengths = np.concatenate([p.lengths for p in parts])
                offsets = np.zeros(len(rows) + 1, dtype=np.int64)
                np.cumsum(lengths, out=offsets[1:])
                values = np.lib.format.open_memmap(vpath, mode="w+", dtype=parts[0].values.dtype,
                                                   shape=(int(offsets[-1]),))
                for p, lo in zip(parts, offsets[:-1:chunk]):
                    values[lo:lo + p.values.size] = p.values
                values.flush()
                del values
                np.save(opath, offsets)
            self.cols[name] = (np.load(vpath, mmap_mode="r"), np.load(opath, mmap_mode="r"))
        self.base = int(rows[0]) if len(rows) else 0
        self.bufs = {}

    def _buf(self, name, numel, dtype):
        b = self.bufs.get((name, np.dtype(dtype)))
        if b is None or b.size < numel:
            b = self.bufs[(name, np.dtype(dtype))] = np.empty(int(numel * 1.25) + 1, dtype=dtype)
        return b

    def gather(self, rows, pad, ids_dtype=np.int64):
        """``ids_dtype``: of the token ids (the masks stay int64, as collate's)."""
        rows = np.asarray(rows) - self.base
        B = len(rows)
        out = {}
        for name, (values, offsets) in self.cols.items():
            starts = offsets[rows]
            lengths = offsets[rows + 1] - starts
            W = int(lengths.max())
            left = name.startswith("prompt_")
            dtype = (ids_dtype if name in _MASKS else np.int64) if values.dtype.kind in "iu" else values.dtype
            arr = self._buf(name, B * W, dtype)[:B * W].reshape(B, W)
            pos = np.arange(W)
            mask = pos >= (W - lengths)[:, None] if left else pos < lengths[:, None]
            total = int(lengths.sum())
            index = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)
            arr.fill(pad if name in _MASKS else 0)
            arr[mask] = np.take(values, index)
            out[name] = arr
            if name in _MASKS:
                m = self._buf(_MASKS[name], B * W, np.int64)[:B * W].reshape(B, W)
                np.copyto(m, mask)
                out[_MASKS[name]] = m
        return out


    def cold_gather(self, rows, pad, directory):
        """The ideal cold read: map the flat files afresh, ask for every needed page of the offsets
        (one ``madvise(WILLNEED)`` per column over the rows' pages), then for every needed byte of
        the values (one per coalesced span), then gather into the reused padded arrays."""
        rows = np.asarray(rows) - self.base
        page = mmap.PAGESIZE
        cols = {}
        for name in _RAGGED:
            maps = []
            for part in ("values", "offsets"):
                arr = np.load(os.path.join(directory, f"{name}.{part}.npy"), mmap_mode="r")
                maps.append(arr)
            cols[name] = maps
        for values, offsets in cols.values():
            _advise(offsets, rows * 8, (rows + 2) * 8, page)
        for values, offsets in cols.values():
            starts, ends = offsets[rows], offsets[rows + 1]
            _advise(values, starts * values.itemsize, ends * values.itemsize, page)
        saved = self.cols
        self.cols = {k: (v, o) for k, (v, o) in cols.items()}
        try:
            return self.gather(rows + self.base, pad)
        finally:
            self.cols = saved


def _advise(arr, lo, hi, page, gap=64 << 10):
    """madvise(WILLNEED) the byte ranges [lo, hi) of a memory-mapped .npy array, coalesced."""
    from diskreplay.segment import coalesce

    mm = arr._mmap if hasattr(arr, "_mmap") and arr._mmap is not None else arr.base
    base = arr.ctypes.data - np.frombuffer(mm, dtype=np.uint8).ctypes.data
    starts, ends = coalesce((base + np.asarray(lo)) // page * page, base + np.asarray(hi), gap)
    for a, b in zip(starts.tolist(), ends.tolist()):
        mm.madvise(mmap.MADV_WILLNEED, a, b - a)


class _TorchRLPadded:
    """Baseline: TorchRL's LazyMemmapStorage holding the same rollouts padded to 1024 / 4096 tokens.

    Appending pads each step's rows and fsyncs the memmaps; sampling gathers the
    rows and trims them to the batch's own maxima, as a TorchRL user would.
    Needs the ``bench`` extra (torchrl, tensordict).
    """

    P, C = 1024, 4096

    def __init__(self, directory: str, capacity: int) -> None:
        from torchrl.data import LazyMemmapStorage

        self.dir = directory
        self.storage = LazyMemmapStorage(capacity, scratch_dir=directory)
        self.cursor = 0

    def append(self, batch) -> None:
        from tensordict import TensorDict

        n = len(batch["completion_ids"])
        data = {"prompt_ids": np.zeros((n, self.P), np.int32), "completion_ids": np.zeros((n, self.C), np.int32),
                "old_per_token_logps": np.zeros((n, self.C), np.float32),
                "ref_per_token_logps": np.zeros((n, self.C), np.float32)}
        for i in range(n):
            p = batch["prompt_ids"][i]
            data["prompt_ids"][i, self.P - len(p):] = p
            for k in ("completion_ids", "old_per_token_logps", "ref_per_token_logps"):
                data[k][i, :len(batch[k][i])] = batch[k][i]
        data = {k: torch.from_numpy(v) for k, v in data.items()}
        data["prompt_len"] = torch.tensor([len(x) for x in batch["prompt_ids"]])
        data["completion_len"] = torch.tensor([len(x) for x in batch["completion_ids"]])
        self.storage.set(torch.arange(self.cursor, self.cursor + n), TensorDict(data, batch_size=[n]))
        self.cursor += n
        for f in os.listdir(self.dir):
            if f.endswith(".memmap"):
                fd = os.open(os.path.join(self.dir, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

    def reopen(self, save: bool = True) -> None:
        """A fresh storage over the memmaps on disk (``save``: write this one's metadata first)."""
        from pathlib import Path

        from torchrl.data import LazyMemmapStorage

        if save:
            self.storage.dumps(Path(self.dir))  # writes its metadata; the memmaps stay where they are
        self.storage = LazyMemmapStorage(self.cursor)
        self.storage.loads(Path(self.dir))

    def sample(self, local_rows: np.ndarray, pad: int) -> Dict[str, torch.Tensor]:
        td = self.storage.get(torch.from_numpy(np.asarray(local_rows)))
        pl, cl = td["prompt_len"], td["completion_len"]
        P, C = int(pl.max()), int(cl.max())
        pos_p, pos_c = torch.arange(P), torch.arange(C)
        out = {"prompt_mask": (pos_p >= (P - pl)[:, None]).long(), "completion_mask": (pos_c < cl[:, None]).long()}
        out["prompt_ids"] = td["prompt_ids"][:, self.P - P:].long().masked_fill_(out["prompt_mask"] == 0, pad)
        out["completion_ids"] = td["completion_ids"][:, :C].long().masked_fill_(out["completion_mask"] == 0, pad)
        for k in ("old_per_token_logps", "ref_per_token_logps"):
            out[k] = td[k][:, :C]
        return out


def _torchrl_baseline(store: ReplayStore, directory: str, report) -> "_TorchRLPadded | None":
    try:
        import torchrl
        del torchrl
    except ImportError:
        report("  (TorchRL baseline skipped: pip install 'diskreplay[bench]')")
        return None
    meta = os.path.join(directory, "storage_metadata.json")
    base = _TorchRLPadded(directory, len(store))
    if os.path.exists(meta):
        base.cursor = len(store)
        base.reopen(save=False)  # built by an earlier run in this work directory
        return base
    rows = store.row_ids()
    t = time.perf_counter()
    for i in range(0, len(rows), 512):
        b = store.read(rows[i:i + 512], list(_RAGGED))
        base.append({k: list(b[k]) for k in _RAGGED})
    report(f"  TorchRL LazyMemmapStorage (padded 1024/4096) built: {len(rows) / (time.perf_counter() - t):,.0f} "
           f"rows/s appended incl. fsync, {sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 2**30:.1f} GiB")
    base.reopen()
    return base


def _trl_list(store, rows):
    """TRL-style buffer: a Python list with one dict of per-row tensors per row."""
    items = []
    for i in range(0, len(rows), 4096):
        b = store.read(rows[i:i + 4096], list(_RAGGED))
        for j in range(len(b["completion_ids"])):
            p = torch.from_numpy(b["prompt_ids"][j].astype(np.int64))
            c = torch.from_numpy(b["completion_ids"][j].astype(np.int64))
            items.append({"prompt_ids": p, "prompt_mask": torch.ones_like(p),
                          "completion_ids": c, "completion_mask": torch.ones_like(c),
                          "old_per_token_logps": torch.from_numpy(b["old_per_token_logps"][j].copy()),
                          "ref_per_token_logps": torch.from_numpy(b["ref_per_token_logps"][j].copy())})
    return items


def _trl_pad(items, idx, pad):
    from torch.nn.utils.rnn import pad_sequence
    picked = [items[i] for i in idx]
    out = {}
    for name in picked[0]:
        side = "left" if name.startswith("prompt_") else "right"
        value = pad if name in _MASKS else 0
        out[name] = pad_sequence([r[name] for r in picked], batch_first=True, padding_value=value,
                                 padding_side=side)
    return out


def _trl_buffer_entries(batch):
    """What TRL's replay buffer held: one dict per row, sliced from the step's padded batch."""
    return [{k: v[i] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 2}
            for i in range(len(batch["completion_ids"]))]


def _trl_buffer_repad(entries, pad):
    """TRL-style re-padding of buffered entries: drop mask-0 positions row by row, then pad_sequence."""
    from torch.nn.utils.rnn import pad_sequence
    pm = [e["prompt_mask"].bool() for e in entries]
    cm = [e["completion_mask"].bool() for e in entries]
    out = {}
    for name, masks, side in (("prompt_ids", pm, "left"), ("prompt_mask", pm, "left")):
        out[name] = pad_sequence([e[name][m] for e, m in zip(entries, masks)], batch_first=True,
                                 padding_value=pad if name in _MASKS else 0, padding_side=side)
    for name in ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps"):
        out[name] = pad_sequence([e[name][m] for e, m in zip(entries, cm)], batch_first=True,
                                 padding_value=pad if name in _MASKS else 0)
    return out


def _rss_probe(path, batch_rows, batches):
    """Run in a fresh process: peak anonymous memory while a ReplayLoader samples, per strategy."""
    import gc
    store = ReplayStore(path, readonly=True)
    store.group_index()
    before = _mem_mb()
    peaks = {}
    for strategy in STRATEGIES:
        sampler = PromptGroupSampler(num_groups=batch_rows // 8, strategy=strategy, seed=0)
        peak = 0.0
        loader = ReplayLoader(store, sampler, batch_rows, 0, num_batches=batches)
        for _ in loader:
            peak = max(peak, _mem_mb()["RssAnon"])
        loader.close()
        del loader
        gc.collect()
        peaks[strategy] = peak
    after = _mem_mb()
    return {"rows": len(store), "bytes": store.nbytes, "anon_after_open_mb": before["RssAnon"],
            "peak_anon_mb": max(peaks.values()), "peaks": peaks, "peak_rss_mb": after["VmHWM"]}


def _probe_in_subprocess(path, batch_rows, batches):
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_rss_probe, (path, batch_rows, batches))


def _bench_cold(store, label, batch_groups, B, cold, step_ms, res, report, pad=0):
    """Cold page cache, evicted before each timed batch: with and without a WILLNEED hint, and the
    loader (which hints batch k+1 while batch k trains)."""
    collator = Collator(pad)
    for strategy in STRATEGIES:
        for hint in (False, True):
            sampler = PromptGroupSampler(num_groups=batch_groups, strategy=strategy, seed=2)

            def cold_step():
                rows = sampler.sample(store, B)
                if hint:
                    store.prefetch(rows)  # what the loader's worker does, one batch ahead
                batch = store.read(rows)
                collator(batch)
            ms = _median_ms(cold_step, cold, before=lambda: evict_store(store))
            res[f"cold{label}_{strategy}{'_hint' if hint else ''}_ms"] = ms
        report(f"  cold{label} {strategy:9s} no hint {res[f'cold{label}_{strategy}_ms']:7.1f} ms/batch, WILLNEED "
               f"first {res[f'cold{label}_{strategy}_hint_ms']:7.1f} ms/batch", flush=True)
    # the groups of successive batches barely overlap, so their pages are cold after one eviction
    for step_s in (0.0, step_ms / 1e3):
        evict_store(store)
        waits = []
        with ReplayLoader(store, PromptGroupSampler(num_groups=batch_groups, seed=3), B, pad,
                          num_batches=cold * 2) as loader:
            while True:
                t0 = time.perf_counter()
                try:
                    next(loader)
                except StopIteration:
                    break
                waits.append(time.perf_counter() - t0)
                time.sleep(step_s)
        key = f"cold{label}_loader_step{int(step_s * 1e3)}ms_wait_ms"
        res[key] = 1e3 * statistics.median(waits[1:])
        report(f"  cold{label} ReplayLoader (random), {step_s * 1e3:.0f} ms training step: next() waits "
               f"{res[key]:.1f} ms/batch (median after the first)", flush=True)


def _cold_first_batch_child(store_path, torchrl_dir, batch_groups, B, pad, rounds):
    """Run in a fresh process that maps none of the files (pages mapped by a process are not
    evicted): the cold first-batch paths in turn, each evicted right before it runs; medians."""
    import gc

    store = ReplayStore(store_path, readonly=True)
    seeds = [1000 + i for i in range(rounds)]
    draws = [PromptGroupSampler(num_groups=batch_groups, seed=sd).sample(store, B) for sd in seeds]
    n, head = len(store), store.head
    flat_dir = store_path.rstrip("/") + ".flat"
    # warm output buffers on every path (fresh memory costs the same everywhere and is not the disk),
    # then let go of every map, so that eviction reaches all pages
    collator = Collator(pad)
    flat = _FlatGather(store, flat_dir)
    collator(store.read(draws[0])), flat.gather(draws[0], pad)
    _jit.kernels()  # numba's start-up, begun after the warm-up read, is over before the timed rounds
    flat.cols = {}
    store.close()
    del store
    gc.collect()
    torchrl_base = None
    if torchrl_dir is not None and os.path.exists(os.path.join(torchrl_dir, "storage_metadata.json")):
        torchrl_base = _TorchRLPadded(torchrl_dir, n)
        torchrl_base.cursor = n
    times: Dict[str, list] = {"ours": [], "ideal": [], "torchrl": []}
    for i, seed in enumerate(seeds):
        evict_from_page_cache(flat_dir)
        t0 = time.perf_counter()
        flat.cold_gather(draws[i], pad, flat_dir)
        times["ideal"].append(time.perf_counter() - t0)
        flat.cols = {}
        evict_from_page_cache(store_path)
        t0 = time.perf_counter()
        fresh = ReplayStore(store_path, readonly=True)
        rows = PromptGroupSampler(num_groups=batch_groups, seed=seed).sample(fresh, B)
        collator(fresh.read(rows))
        times["ours"].append(time.perf_counter() - t0)
        # closing (unmapping ~40 segments: ~6 ms) is after the batch, as the other paths' clean-up is
        fresh.close()
        del fresh
        assert np.array_equal(rows, draws[i])
        if torchrl_base is not None:
            torchrl_base.storage = None
            gc.collect()
            evict_from_page_cache(torchrl_dir)
            t0 = time.perf_counter()
            torchrl_base.reopen(save=False)
            torchrl_base.sample(draws[i] - head, pad)
            times["torchrl"].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items() if v}


def _bench_cold_first_batch(store_path, torchrl_base, batch_groups, B, pad, rounds, res, report):
    """A restarted job's first batch with the page cache dropped (``posix_fadvise(DONTNEED)`` of every
    file; root cannot drop caches on this VM): reopen + sample + read + collate of 512 rows, against
    the ideal gather of the same rows from flat files after WILLNEED hints, and TorchRL's padded
    memmap reopened and sampled. Paths alternate, in a fresh process (see the child)."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        ms = pool.apply(_cold_first_batch_child, (store_path, None if torchrl_base is None else torchrl_base.dir,
                                                  batch_groups, B, pad, rounds))
    res.update({f"cold_first_batch_{k}_ms": v for k, v in ms.items()})
    print(f"\ncold reopen + first batch of {B} rows, page cache dropped ({rounds} rounds, medians)")
    row("reopen + sample + read + collate vs ideal", f"{ms['ours']:.1f} ms", f"ideal {ms['ideal']:.1f} ms",
        target("cold reopen + first batch vs ideal WILLNEED gather, time", ms["ours"] / ms["ideal"], "<= 3"))
    if "torchrl" in ms:
        row("  vs TorchRL padded memmap reopen + sample", f"{ms['ours']:.1f} ms", f"{ms['torchrl']:.1f} ms",
            target("cold reopen + first batch vs TorchRL padded memmap, speed", ms["torchrl"] / ms["ours"],
                   ">= 20"))
    sys.stdout.flush()


RESTART_CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import torch  # a trainer has torch (and numpy) imported before its first batch: excluded
    path, layout, B, groups, seed, wait = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    # this VM returns freed memory to its host, whose next touch costs ~3 ns/byte (see warm_free_memory)
    block = np.ones(512 << 20, dtype=np.uint8)
    del block
    t = time.perf_counter()
    from diskreplay import Collator, PromptGroupSampler, ReplayStore, _jit
    store = ReplayStore(path, readonly=True)
    sampler = PromptGroupSampler(num_groups=groups, seed=seed)
    draws = [sampler.sample(store, B) for _ in range(14)]
    t1 = time.perf_counter()
    collator = Collator(0, layout=layout)
    t2 = time.perf_counter()
    if wait:  # what the first batch cost when a read waited for numba's start-up (the kernels cached)
        _jit.kernels()
    c2 = time.thread_time()
    collator.read(store, draws[0])
    t3, c3 = time.perf_counter(), time.thread_time()
    collator.read(store, draws[1])  # while numba starts beside it
    t4 = time.perf_counter()
    if _jit._loading is not None:
        _jit._loading.join()
    t5 = time.perf_counter()
    steady, steady_cpu = [], []
    for rows in draws[2:]:
        t6, c6 = time.perf_counter(), time.thread_time()
        collator.read(store, rows)
        steady.append(time.perf_counter() - t6)
        steady_cpu.append(time.thread_time() - c6)
    hits = {k: [sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values())]
            for k, d in _jit.dispatchers().items()}
    print(json.dumps({"import_open_sample_ms": 1e3 * (t1 - t), "first_ms": 1e3 * (t3 - t2),
                      "second_ms": 1e3 * (t4 - t3), "numba_ready_after_ms": 1e3 * (t5 - t2),
                      "steady_ms": 1e3 * sorted(steady)[len(steady) // 2], "cache": hits,
                      # the main thread's CPU time: less swayed than wall time by other processes on the cores
                      "first_cpu_ms": 1e3 * (c3 - c2), "steady_cpu_ms": 1e3 * sorted(steady_cpu)[len(steady_cpu) // 2]}))
""")


def _read_files(path: str) -> None:
    """Read every file under ``path`` (into the page cache: on this VM clean pages leave it within a
    minute or so, so a "warm" measurement warms right before it)."""
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(1 << 22):
                    pass


def _restart_runs(store_path, layout, B, batch_groups, rounds, wait, seed0=0):
    out = []
    for i in range(rounds):
        _read_files(store_path)
        done = subprocess.run([sys.executable, "-c", RESTART_CHILD, store_path, layout, str(B), str(batch_groups),
                               str(seed0 + i), str(int(wait))], check=True, capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def _bench_restart(store_path, batch_groups, B, rounds, res, report):
    """A restarted trainer's first batch: a fresh process (torch imported, free memory warmed), the
    store opened and ``rounds`` draws sampled, then the first ``Collator.read`` of ``B`` rows (warm
    page cache, numba's cache present), against the same process's steady reads (the median of 12
    more, after numba is ready), for both layouts; and the first batch as it was when a read waited
    for numba's start-up. Each round is a new process; the layouts and the waiting variant
    alternate round by round; medians."""
    _restart_runs(store_path, "packed", B, batch_groups, 1, True)  # numba's cache filled (compiled once)
    runs: Dict[tuple, list] = {}
    for i in range(rounds):
        for layout in ("padded", "packed"):
            for wait in (False, True):
                runs.setdefault((layout, wait), []).extend(
                    _restart_runs(store_path, layout, B, batch_groups, 1, wait, seed0=100 + i))
    print(f"\nrestart: a new process's first Collator.read of {B} rows, warm page cache, numba's cache present "
          f"({rounds} processes per path, medians)")
    for layout in ("padded", "packed"):
        med = {k: statistics.median(r[k] for r in runs[(layout, False)])
               for k in ("first_ms", "second_ms", "steady_ms", "numba_ready_after_ms", "import_open_sample_ms",
                         "first_cpu_ms", "steady_cpu_ms")}
        waited = statistics.median(r["first_ms"] for r in runs[(layout, True)])
        misses = sum(m for r in runs[(layout, False)] + runs[(layout, True)] for _, m in r["cache"].values())
        res[f"restart_{layout}"] = {**med, "first_waiting_for_numba_ms": waited, "cache_misses": misses}
        row(f"{layout}: first batch vs a steady one", f"{med['first_ms']:.1f} ms", f"{med['steady_ms']:.1f} ms",
            target(f"restart: first batch vs steady, {layout}, time", med["first_ms"] / med["steady_ms"], "<= 3"))
        row("  the same, the main thread's CPU time", f"{med['first_cpu_ms']:.1f} ms", f"{med['steady_cpu_ms']:.1f} ms",
            f"{med['first_cpu_ms'] / med['steady_cpu_ms']:.2f}x")
        row("  second batch (numba starting beside it)", f"{med['second_ms']:.1f} ms", f"{med['steady_ms']:.1f} ms",
            f"{med['second_ms'] / med['steady_ms']:.2f}x")
        row("  first batch waiting for numba (as before)", f"{waited:.1f} ms", f"{med['steady_ms']:.1f} ms",
            f"{waited / med['steady_ms']:.2f}x")
        row("  numba ready after the first read began", f"{med['numba_ready_after_ms']:.0f} ms", "", "")
        row("  kernels compiled in these processes", f"{misses}", "", "")
    sys.stdout.flush()


def _bench_ids_dtype(store, flat, batch_groups, B, pad, rounds, res, report):
    """Token ids as int32 (``Collator(ids_dtype=torch.int32)``) against the ideal gather writing int32
    ids into reused buffers, the int64 pair beside them; paths alternated, medians. Host->device
    bytes from the batches' tensor sizes."""
    draws = [PromptGroupSampler(num_groups=batch_groups, seed=31).sample(store, B) for _ in range(rounds)]
    c64, c32 = Collator(pad), Collator(pad, ids_dtype=torch.int32)
    p64, p32 = Collator(layout="packed"), Collator(layout="packed", ids_dtype=torch.int32)
    got, want = c32.read(store, draws[0]), flat.gather(draws[0], pad, ids_dtype=np.int32)
    assert all(got[k].numpy().dtype == want[k].dtype and np.array_equal(got[k].numpy(), want[k]) for k in want)
    for rows in draws[:3]:  # warm the pages and every buffer
        c64.read(store, rows), c32.read(store, rows), p64.read(store, rows), p32.read(store, rows)
        flat.gather(rows, pad), flat.gather(rows, pad, ids_dtype=np.int32)
    ms = _alternate({
        "padded int32": lambda i: c32.read(store, draws[i]),
        "ideal int32": lambda i: flat.gather(draws[i], pad, ids_dtype=np.int32),
        "padded int64": lambda i: c64.read(store, draws[i]),
        "ideal int64": lambda i: flat.gather(draws[i], pad),
        "packed int32": lambda i: p32.read(store, draws[i]),
        "packed int64": lambda i: p64.read(store, draws[i]),
    }, rounds)
    res.update({f"ids_{k.replace(' ', '_')}_ms": v for k, v in ms.items()})
    bytes_ = {}
    for name, collator in (("padded int64", c64), ("padded int32", c32), ("packed int64", p64),
                           ("packed int32", p32)):
        batch = collator.read(store, draws[0])
        # cu_seq_lens_q/k alias cu_seqlens: one copy crosses
        seen, total = set(), 0
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
        bytes_[name] = total
    res["ids_bytes"] = bytes_
    print(f"\ntoken ids as int32 (ids_dtype=torch.int32), {B} rows, warm ({rounds} rounds, medians)")
    row("padded int32: Collator.read vs ideal int32 gather", f"{ms['padded int32']:.1f} ms",
        f"ideal {ms['ideal int32']:.1f} ms",
        target("padded read + collate, int32 ids, vs ideal int32 gather, speed", ms["ideal int32"] / ms["padded int32"],
               ">= 0.9"))
    row("  padded int64: Collator.read vs ideal int64 gather", f"{ms['padded int64']:.1f} ms",
        f"ideal {ms['ideal int64']:.1f} ms", f"{ms['ideal int64'] / ms['padded int64']:.2f}x")
    row("  padded int32 vs int64, Collator.read", f"{ms['padded int32']:.1f} ms", f"{ms['padded int64']:.1f} ms",
        f"{ms['padded int64'] / ms['padded int32']:.2f}x")
    row("  packed int32 vs int64, Collator.read", f"{ms['packed int32']:.1f} ms", f"{ms['packed int64']:.1f} ms",
        f"{ms['packed int64'] / ms['packed int32']:.2f}x")
    for layout in ("padded", "packed"):
        b64, b32 = bytes_[f"{layout} int64"], bytes_[f"{layout} int32"]
        row(f"host->device bytes, {layout}: int32 vs int64 ids", f"{b32 / 1e6:.2f} MB", f"{b64 / 1e6:.2f} MB",
            f"-{(b64 - b32) / 1e6:.2f} MB ({1 - b32 / b64:.0%})")
    sys.stdout.flush()


INDEX_CHILD = textwrap.dedent("""
    import sys, time, json
    import torch, numpy, pyarrow  # interpreter and import time are excluded
    import diskreplay
    t = time.perf_counter()
    store = diskreplay.ReplayStore(sys.argv[1], readonly=True)
    t1 = time.perf_counter()
    store.group_index()
    t2 = time.perf_counter()
    print(json.dumps({"open_ms": 1e3 * (t1 - t), "group_index_ms": 1e3 * (t2 - t1)}))
""")


def _index_open_ms(paths: Dict[str, str], rounds: int) -> Dict[str, Dict[str, float]]:
    """Median ``open_ms`` and ``group_index_ms`` of INDEX_CHILD per store, the stores alternated."""
    times: Dict[str, list] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, path in paths.items():
            out = subprocess.run([sys.executable, "-c", INDEX_CHILD, path], check=True, capture_output=True,
                                 text=True).stdout
            times[name].append(json.loads(out))
    return {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in times.items()}


def _with_index_tail(path: str, seed: int) -> str:
    """A copy of the store (segments hard-linked) with commits added until ``INDEX_TAIL_SEGMENTS - 1``
    segments lie past its persisted group index: a store reopened just before its writer would
    persist the next one, the most a reader adds from sidecars."""
    tail = path.rstrip("/") + ".tail"
    shutil.rmtree(tail, ignore_errors=True)
    # small files copied (a lock file must not be shared), immutable Arrow files linked
    shutil.copytree(path, tail, copy_function=lambda src, dst: (os.link(src, dst) if src.endswith(".arrow")
                                                                else shutil.copy2(src, dst)))
    with ReplayStore(tail) as writer:
        for batch in rollout_stream(64 * 4 * INDEX_TAIL_SEGMENTS, 64, 8, seed=seed):
            m = writer.manifest
            past = sum(1 for s in m.segments if s.end_row > m.group_index.end_row)
            if past == INDEX_TAIL_SEGMENTS - 1:
                break
            writer.extend(batch)
    return tail


def _bench_index_scaling(small, big, factor, res, report, rounds=7):
    """The group index's cost on open (a fresh process, warm page cache, first ``group_index()``) for
    the store and the ``factor`` times larger one, alternated, medians; then the same for copies of
    both with the most segments a reader adds from their sidecars past the persisted index."""
    one_name, big_name = "1x", f"{factor}x"
    med = _index_open_ms({one_name: small, big_name: big}, rounds)
    one, big_ = med[one_name], med[big_name]
    res["group_index_open_ms"] = med
    print(f"\ngroup index on open, fresh process, warm page cache ({rounds} rounds, medians)")
    row(f"group_index(): {factor}x store vs 1x store", f"{big_['group_index_ms']:.2f} ms",
        f"{one['group_index_ms']:.2f} ms",
        target(f"group index cost on open, {factor}x store vs 1x store", big_["group_index_ms"] /
               one["group_index_ms"], "<= 1.5"))
    row("  open (manifest: one entry per segment)", f"{big_['open_ms']:.2f} ms", f"{one['open_ms']:.2f} ms",
        f"{big_['open_ms'] / one['open_ms']:.2f}x")
    tails = {one_name: _with_index_tail(small, seed=11), big_name: _with_index_tail(big, seed=11)}
    try:
        med = _index_open_ms(tails, rounds)
    finally:
        for path in tails.values():
            shutil.rmtree(path, ignore_errors=True)
    one, big_ = med[one_name], med[big_name]
    res["group_index_open_tail_ms"] = med
    row(f"  group_index() with {INDEX_TAIL_SEGMENTS - 1} segments past the index", f"{big_['group_index_ms']:.2f} ms",
        f"{one['group_index_ms']:.2f} ms", f"{big_['group_index_ms'] / one['group_index_ms']:.2f}x")
    sys.stdout.flush()


def _alternate(paths: Dict[str, object], rounds: int) -> Dict[str, float]:
    """Median ms of each path, the paths timed in turn ``rounds`` times (so that load from other
    processes hits all alike). Each path is a callable taking the round's index."""
    times: Dict[str, list] = {k: [] for k in paths}
    for i in range(rounds):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn(i)
            times[name].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


#: blocks of batches per path in the loader comparison (at least): with the 2 blocks that 20 rounds
#: gave, runs of the same code ranged from 0.92x to 1.17x
_LOADER_BLOCKS = 10


def _loader_vs_data_path(store, batch_groups, B, pad, layout, rounds, block=10):
    """ReplayLoader's consumer-visible ms per batch, back to back, against its own data path (sample, read,
    collate into reused buffers) run on this thread, in alternating blocks of ``block`` batches.

    Every row of the store is read once first, then one loader serves every round, warmed until its
    ring buffers have grown to the batches' sizes (fresh pages cost more than the work on this VM).
    Before a data-path block the worker is given time to fill its free buffer set and park, so the
    two never compete; after it, the batches the worker built meanwhile are taken untimed, so every
    timed next() waits for the worker's work on it."""
    collator = Collator(pad, layout=layout)
    direct = PromptGroupSampler(num_groups=batch_groups, seed=21)
    loader_ms, direct_ms = [], []
    # warm = every page checked once: the first read of a row checks its pages' CRCs, which the two
    # paths' different draws would otherwise pay unevenly, less and less from block to block
    for start in range(store.head, store.next_row, B):
        store.read_ranges(np.arange(start, min(start + B, store.next_row)))
    with ReplayLoader(store, PromptGroupSampler(num_groups=batch_groups, seed=22), B, pad, prefetch=2,
                      layout=layout) as loader:
        for _ in range(4 * block):
            next(loader), collator.read(store, direct.sample(store, B))
        for _ in range(max(_LOADER_BLOCKS, rounds // block)):
            time.sleep(0.5)
            t0 = time.perf_counter()
            for _ in range(block):
                collator.read(store, direct.sample(store, B))
            direct_ms.append(1e3 * (time.perf_counter() - t0) / block)
            for _ in range(loader.prefetch + 1):
                next(loader)
            t0 = time.perf_counter()
            for _ in range(block):
                next(loader)
            loader_ms.append(1e3 * (time.perf_counter() - t0) / block)
    return statistics.median(loader_ms), statistics.median(direct_ms)


def _one_token_rows(batch):
    """``batch`` with every ragged row cut to its first value (empty rows stay empty): collating it
    costs the per-row work of the full batch (views, pieces, per-row columns) and almost no bytes."""
    out = {}
    for name, col in batch.items():
        if isinstance(col, RaggedColumn):
            lengths = np.minimum(col.lengths, 1)
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            out[name] = RaggedColumn(col.values[col.offsets[:-1][lengths > 0] - col.offsets[0]], offsets,
                                     col.validity)
        else:
            out[name] = col
    return out


class _Floor:
    """The memory floor of an output layout: its tensors' bytes written once into warm arrays of
    their own with no per-row work, as one memset each (``fill``: write only) or one copy from
    contiguous memory (``copy``: read and write). No kernel that writes that layout can beat it."""

    def __init__(self, batch):
        seen, self.dst = set(), []
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.data_ptr() not in seen:  # cu_seq_lens_q/k alias cu_seqlens
                seen.add(v.data_ptr())
                self.dst.append(np.empty(v.numel(), dtype=v.numpy().dtype))
        self.src = [np.ones_like(d) for d in self.dst]
        self.nbytes = sum(d.nbytes for d in self.dst)
        self.fill(), self.copy()  # first touch outside the timing

    def fill(self, i=0):
        for d in self.dst:
            d.fill(0)

    def copy(self, i=0):
        for d, s in zip(self.dst, self.src):
            np.copyto(d, s)


def _bench_batches(store, flat, torchrl_base, batch_groups, B, pad, rounds, res, report):
    """Issue 13's table: the same rows built every way, alternated, medians."""
    padded_c, packed_c, readme_c = Collator(pad), Collator(layout="packed"), Collator(pad)
    read_out: dict = {}
    draws = [PromptGroupSampler(num_groups=batch_groups, seed=11).sample(store, B) for _ in range(rounds)]
    batches = [store.read(rows) for rows in draws]
    ref = packed_c(batches[0])
    if torchrl_base is not None:
        got = torchrl_base.sample(draws[0] - store.head, pad)
        want = collate(batches[0], pad)
        assert all(torch.equal(want[k], got[k]) for k in got), "TorchRL baseline disagrees with collate"
    for b, rows in zip(batches[:3], draws[:3]):  # warm the pages and every buffer
        padded_c.read(store, rows), packed_c.read(store, rows), collate(b, pad), flat.gather(rows, pad), readme_c(b)
        store.read(rows, out=read_out)
    if torchrl_base is not None:  # its 1.6 GiB memmap: every drawn row in the page cache, as ours are
        for rows in draws:
            torchrl_base.sample(rows - store.head, pad)
    # each layout's output bytes written once at this VM's memory speed, timed with the paths
    floors = {"packed": _Floor(ref), "padded": _Floor(collate(batches[0], pad))}
    short = [_one_token_rows(b) for b in batches]
    short_c = Collator(layout="packed")
    short_c(short[0])
    paths = {
        "read": lambda i: store.read(draws[i]),
        "padded collate, reused": lambda i: padded_c(batches[i]),
        "packed collate, reused": lambda i: packed_c(batches[i]),
        "padded read + collate, fresh (collate())": lambda i: collate(store.read(draws[i]), pad),
        "padded read + collate, reused (Collator)": lambda i: padded_c.read(store, draws[i]),
        "packed read + collate, reused (Collator)": lambda i: packed_c.read(store, draws[i]),
        # the same batch through an ordinary read (its values copied twice: into the read's buffers,
        # then into the stream), as the packed path read before read_ranges
        "packed: store.read into reused buffers, then collate": lambda i: packed_c(store.read(draws[i], out=read_out)),
        "ideal numpy gather, padded": lambda i: flat.gather(draws[i], pad),
        "README: collator.read(store, rows), one collator per call site":
            lambda i: readme_c.read(store, draws[i]),
        "read into reused buffers": lambda i: store.read(draws[i], out=read_out),
        "packed on device: read_ranges + collate_unpadded, reused":
            lambda i: packed_c.unpadded(store.read_ranges(draws[i])),
    }
    paths["packed collate, the same rows cut to one token"] = lambda i: short_c(short[i])
    for layout, floor in floors.items():
        paths[f"floor {layout}: memset"] = floor.fill
        paths[f"floor {layout}: contiguous copy"] = floor.copy
    if torchrl_base is not None:
        paths["TorchRL padded memmap sample"] = lambda i: torchrl_base.sample(draws[i] - store.head, pad)
    ms = _alternate(paths, rounds)
    for k, v in ms.items():
        res[f"batch_{k}_ms"] = v
    fresh, reused = ms["padded read + collate, fresh (collate())"], ms["padded read + collate, reused (Collator)"]
    readme = ms["README: collator.read(store, rows), one collator per call site"]
    packed = ms["packed read + collate, reused (Collator)"]
    ideal = ms["ideal numpy gather, padded"]
    print(f"\nbatches of {B} rows, warm, the same rows every way ({rounds} rounds, medians)"
          f"{'':>8}{'ours':>18}{'baseline':>18}{'ratio':>10}")
    row("padded: read + collate into reused buffers", f"{reused:.1f} ms", f"ideal {ideal:.1f} ms",
        target("padded read + collate (reused) vs ideal numpy gather, speed", ideal / reused, ">= 0.9"))
    row("one call collate(read) vs Collator (reused)", f"{fresh:.1f} ms", f"{reused:.1f} ms", f"{fresh / reused:.2f}x")
    row("  README's path (its own Collator) vs reused", f"{readme:.1f} ms", f"{reused:.1f} ms",
        target("README one-call path (collator.read(store, rows)) vs reused, time", readme / reused, "<= 1.1"))
    row("packed vs padded, read + collate", f"{packed:.1f} ms", f"{reused:.1f} ms",
        target("packed vs padded batch (read + collate), speed", reused / packed, ">= 5"))
    two_copies = ms["packed: store.read into reused buffers, then collate"]
    row("  packed read + collate vs store.read, then collate", f"{packed:.1f} ms", f"{two_copies:.1f} ms",
        f"{two_copies / packed:.2f}x")
    row("packed vs padded, collate only", f"{ms['packed collate, reused']:.1f} ms",
        f"{ms['padded collate, reused']:.1f} ms",
        f"{ms['padded collate, reused'] / ms['packed collate, reused']:.2f}x")
    row("  the read both share (fresh / reused buffers)", f"{ms['read into reused buffers']:.1f} ms",
        f"{ms['read']:.1f} ms", f"{ms['read'] / ms['read into reused buffers']:.2f}x")
    unp = ms["packed on device: read_ranges + collate_unpadded, reused"]
    row("packed on device (host: payload from the maps) vs padded", f"{unp:.1f} ms", f"{reused:.1f} ms",
        f"{reused / unp:.2f}x")
    if torchrl_base is not None:
        rl = ms["TorchRL padded memmap sample"]
        row("packed vs TorchRL padded memmap sample", f"{packed:.1f} ms", f"{rl:.1f} ms",
            target("packed batch vs TorchRL padded memmap sample, speed", rl / packed, ">= 3"))
        row("packed on device vs TorchRL padded memmap sample", f"{unp:.1f} ms", f"{rl:.1f} ms",
            f"{rl / unp:.2f}x")
    else:
        row("packed vs TorchRL padded memmap sample", "skipped", "no torchrl")
    # how far each path is from writing its layout's bytes once (the packed-vs-padded target
    # is a ratio of two layouts: at their floors it cannot exceed the ratio of their floors)
    for layout, path in (("packed", packed), ("padded", reused)):
        fl = floors[layout]
        fill, copy = ms[f"floor {layout}: memset"], ms[f"floor {layout}: contiguous copy"]
        res[f"floor_{layout}_memset_ms"], res[f"floor_{layout}_copy_ms"] = fill, copy
        row(f"floor, {layout} layout ({fl.nbytes / 1e6:.1f} MB): memset / copy", f"{fill:.2f} ms", f"{copy:.2f} ms",
            f"{fl.nbytes / 1e6 / copy:.1f} GB/s")
        row(f"  {layout} read + collate vs the copy floor", f"{path:.1f} ms", f"{copy:.2f} ms", f"{path / copy:.1f}x")
    one = ms["packed collate, the same rows cut to one token"]
    row("  per-row work: packed collate of the rows cut to one token", f"{one:.1f} ms",
        f"{ms['packed collate, reused']:.1f} ms", f"{one / ms['packed collate, reused']:.2f}x")
    fp, fd = ms["floor packed: contiguous copy"], ms["floor padded: contiguous copy"]
    row("  packed vs padded speed-up at the floors (copy / memset)", f"{fd / fp:.2f}x",
        f"{ms['floor padded: memset'] / ms['floor packed: memset']:.2f}x")
    if torchrl_base is not None:
        row("  TorchRL padded sample vs the padded copy floor", f"{rl:.1f} ms", f"{fd:.2f} ms", f"{rl / fd:.1f}x")
    # host bytes per batch
    batch = batches[0]
    payload = sum(c.values.nbytes if isinstance(c, RaggedColumn) else getattr(c, "nbytes", 0)
                  for c in batch.values() if c is not None)
    shipped = _nbytes(collate_unpadded(batch))  # what the packed (and padded) pad_on_device path copies
    host_packed = _nbytes({k: v for k, v in ref.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k")})
    res.update(bytes_payload=payload, bytes_packed_shipped=shipped, bytes_packed_host=host_packed,
               bytes_padded_host=_nbytes(collate(batch, pad)))
    row("host->device bytes, packed on device vs payload", f"{shipped / 1e6:.2f} MB", f"{payload / 1e6:.2f} MB",
        target("host bytes per packed batch shipped (pack_on_device) vs payload", shipped / payload, "<= 1.05"))
    # built on the host the packed layout is int64 ids/positions/mask and per-token columns over all
    # T tokens (prompt positions 0), as the target specifies it: ~3.3x the payload by construction
    row("host bytes, packed layout built on host", f"{host_packed / 1e6:.2f} MB", f"{payload / 1e6:.2f} MB",
        f"{host_packed / payload:.2f}x")
    row("host bytes, padded layout", f"{res['bytes_padded_host'] / 1e6:.2f} MB", f"{payload / 1e6:.2f} MB",
        f"{res['bytes_padded_host'] / payload:.2f}x")
    # the loader against its own data path
    for layout in ("padded", "packed"):
        lo, dp = _loader_vs_data_path(store, batch_groups, B, pad, layout, rounds)
        res[f"loader_{layout}_ms"], res[f"data_path_{layout}_ms"] = lo, dp
        row(f"ReplayLoader next() vs its data path, {layout}", f"{lo:.1f} ms", f"{dp:.1f} ms",
            target(f"ReplayLoader next() vs its own data path, {layout}, time", lo / dp, "<= 1.1"))
    sys.stdout.flush()


class _Replay:
    """A sampler for ``ReplayLoader`` that hands out given batches of row ids in order."""

    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def sample(self, store, batch_size, **kwargs):
        rows = self.batches[self.i % len(self.batches)]
        self.i += 1
        return rows

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def _fresh_batches(store, batch_groups, group_size, seed=5):
    """Batches of whole groups, no two sharing a group: every batch holds rows read by no earlier one."""
    keys = store.read(store.row_ids(), ["prompt_id"])["prompt_id"]
    order = np.argsort(keys, kind="stable")
    starts = np.flatnonzero(np.r_[True, keys[order][1:] != keys[order][:-1]])
    groups = [order[a:a + group_size] + store.head for a in starts]
    pick = np.random.default_rng(seed).permutation(len(groups))
    return [np.sort(np.concatenate([groups[g] for g in pick[i:i + batch_groups]]))
            for i in range(0, len(pick) - batch_groups + 1, batch_groups)]


def _pages_checked(store, before):
    """``(segment buffer, page ids)`` of the pages ``store`` checked since ``before`` (its bitmaps then)."""
    out = []
    for sid, pages in store._cache.pages.items():
        new = np.flatnonzero(pages.verified & ~before.get(sid, np.zeros_like(pages.verified)))
        if len(new):
            out.append((store._cache.segments[sid].path, pages.page_bytes, new))
    return out


def _bench_fresh_rows(store_path, flat, torchrl_base, batch_groups, group_size, pad, res, report):
    """Fresh rows, warm page cache: every batch drawn from rows this process has not read before, over
    a store many times larger than a batch. Each path reads through its own store (its own record of
    checked pages); the paths alternate batch by batch."""
    import google_crc32c

    probe = ReplayStore(store_path, readonly=True)
    batches = _fresh_batches(probe, batch_groups, group_size)
    probe.close()
    for name in sorted(os.listdir(os.path.join(store_path, "segments"))):  # the page cache holds the store
        with open(os.path.join(store_path, "segments", name), "rb") as f:
            while f.read(1 << 24):
                pass
    kinds = {(layout, verify) for layout in ("padded", "packed", "ranges") for verify in (True, False)}
    stores = {k: ReplayStore(store_path, readonly=True, verify_reads=k[1]) for k in kinds}
    collators = {k: Collator(pad, layout=k[0]) for k in kinds if k[0] != "ranges"}
    warm, timed = batches[-3:], batches[:-3]
    for k, c in collators.items():  # buffers grown on rows no timed batch holds
        for rows in warm:
            c.read(stores[k], rows)
    maps: Dict[str, Any] = {}
    scratch = np.ones(64 << 20, dtype=np.uint8)  # read through before a compared step: CPU caches hold none of it
    t: Dict[str, list] = {n: [] for n in ("padded_v", "padded_u", "packed_v", "packed_u", "ranges_v", "ranges_u",
                                          "ideal", "crc", "torchrl")}
    pages_per_batch = []
    checker = stores[("ranges", True)]
    for i, rows in enumerate(timed):
        before = {sid: p.verified.copy() for sid, p in checker._cache.pages.items()}
        for verify in ((True, False) if i % 2 else (False, True)):  # the checks alone: where the rows lie
            scratch.sum()
            t0 = time.perf_counter()
            stores[("ranges", verify)].read_ranges(rows)
            t["ranges_v" if verify else "ranges_u"].append(time.perf_counter() - t0)
        steps = [("padded_v", lambda: collators[("padded", True)].read(stores[("padded", True)], rows)),
                 ("padded_u", lambda: collators[("padded", False)].read(stores[("padded", False)], rows)),
                 ("packed_v", lambda: collators[("packed", True)].read(stores[("packed", True)], rows)),
                 ("packed_u", lambda: collators[("packed", False)].read(stores[("packed", False)], rows)),
                 ("ideal", lambda: flat.gather(rows, pad))]
        if torchrl_base is not None:
            steps.append(("torchrl", lambda: torchrl_base.sample(rows - stores[("padded", True)].head, pad)))
        for name, step in steps[i % len(steps):] + steps[:i % len(steps)]:
            t0 = time.perf_counter()
            step()
            t[name].append(time.perf_counter() - t0)
        # a plain CRC-32C of the very pages the checked read_ranges checked, one call per page, from a
        # mapping of its own (pages in the page cache, not yet touched through this map)
        checked = _pages_checked(checker, before)
        views = []
        for path, p, ids in checked:
            if path not in maps:
                with open(path, "rb") as f:
                    maps[path] = pa.py_buffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
            buf = maps[path]
            views += [(buf, int(j) * p, min(p, buf.size - int(j) * p)) for j in ids]
        scratch.sum()
        t0 = time.perf_counter()
        for buf, start, n in views:
            google_crc32c.value(buf.slice(start, n))
        t["crc"].append(time.perf_counter() - t0)
        pages_per_batch.append(len(views))
    ms = {k: 1e3 * statistics.median(v) for k, v in t.items() if v}
    # the loader, back to back (no training step), each on its own store, on fresh batches
    loader_ms = {}
    for layout in ("padded", "packed"):
        for verify in (True, False):
            with ReplayLoader(ReplayStore(store_path, readonly=True, verify_reads=verify), _Replay(timed),
                              len(timed[0]), pad, prefetch=2, layout=layout) as loader:
                it = iter(loader)
                times = []
                for _ in range(len(timed) - 1):
                    t0 = time.perf_counter()
                    next(it)
                    times.append(time.perf_counter() - t0)
            loader_ms[(layout, verify)] = 1e3 * statistics.median(times[2:])
    for k, v in ms.items():
        res[f"fresh_{k}_ms"] = v
    for (layout, verify), v in loader_ms.items():
        res[f"fresh_loader_{layout}_{'v' if verify else 'u'}_ms"] = v
    check = ms["ranges_v"] - ms["ranges_u"]
    n_pages = statistics.median(pages_per_batch)
    report(f"\nfresh rows: {len(timed)} batches of {len(timed[0])} rows, each of rows this process had not "
           f"read, warm page cache, medians (checked: {n_pages:.0f} pages of 8 KiB a batch)"
           f"{'':>4}{'ours':>18}{'baseline':>18}{'ratio':>10}")
    row("page checks of a fresh batch (read_ranges checked - unchecked) vs CRC-32C alone", f"{check:.2f} ms",
        f"{ms['crc']:.2f} ms",
        target("fresh batch: page checks vs google_crc32c alone on the same pages, time", check / ms["crc"],
               "<= 1.3"))
    for verify, tag in ((True, "checked"), (False, "unchecked")):
        ours = ms["padded_v" if verify else "padded_u"]
        base = ms["ideal"] + (ms["crc"] if verify else 0.0)
        row(f"padded Collator.read, {tag}, vs ideal gather{' + CRC' if verify else ''}", f"{ours:.1f} ms",
            f"{base:.1f} ms", target(f"fresh padded batch ({tag}) vs ideal gather"
                                     f"{' + CRC' if verify else ''}, speed", base / ours, ">= 0.8"))
    if "torchrl" in ms:
        rl = ms["torchrl"]
        for verify, tag in ((True, "checked"), (False, "unchecked")):
            ours = ms["packed_v" if verify else "packed_u"]
            row(f"packed Collator.read, {tag}, vs TorchRL padded memmap", f"{ours:.1f} ms", f"{rl:.1f} ms",
                target(f"fresh packed batch ({tag}) vs TorchRL padded memmap sample, speed", rl / ours, ">= 1.5"))
        for layout, goal in (("padded", ">= 1"), ("packed", ">= 1.5")):
            for verify, tag in ((True, "checked"), (False, "unchecked")):
                ours = loader_ms[(layout, verify)]
                row(f"ReplayLoader next(), {layout}, {tag}, vs TorchRL", f"{ours:.1f} ms", f"{rl:.1f} ms",
                    target(f"fresh ReplayLoader {layout} ({tag}) vs TorchRL padded memmap sample, speed",
                           rl / ours, goal))
    else:
        row("packed and ReplayLoader vs TorchRL padded memmap", "skipped", "no torchrl")
    for st_ in stores.values():
        st_.close()
    sys.stdout.flush()


def bench_sample(args, batch_groups=64, group_size=8, warm=20, cold=6, step_ms=50.0, report=print):
    """sample: warm/cold sample+read+collate per PromptGroupSampler strategy, against an ideal numpy
    gather, TorchRL's LazyMemmapStorage (padded) and a TRL-style list + pad_sequence; host->device
    bytes; peak memory vs store size."""
    work = args.dir or tempfile.mkdtemp(prefix="diskreplay-bench-")
    os.makedirs(work, exist_ok=True)
    store_path = os.path.join(work, "store")
    if not os.path.exists(os.path.join(store_path, "FORMAT.json")):
        write_store(make_batches(args.groups), store_path)
    B = batch_groups * group_size
    pad = 0
    res = {"batch_rows": B}
    ensure_group_index(store_path)
    store = ReplayStore(store_path, readonly=True)
    flat = _FlatGather(store, store_path.rstrip("/") + ".flat")
    torchrl_base = _torchrl_baseline(store, os.path.join(work, "torchrl_padded"), report)
    report(f"sample: store {len(store)} rows ({store.nbytes / 1e6:.0f} MB), batch {batch_groups} groups x "
           f"{group_size} rows")
    if not args.quick and args.only in (None, "cold"):  # first: nothing of the store is mapped in this process yet
        _bench_cold_first_batch(store_path, torchrl_base, batch_groups, B, pad, cold, res, report)
    if not args.quick and args.only in (None, "restart"):
        _bench_restart(store_path, batch_groups, B, args.rounds if args.only == "restart" else 5, res, report)
    if args.only in ("cold", "restart"):
        store.close()
        print_targets(report)
        return res
    if args.only == "ids":
        _bench_ids_dtype(store, flat, batch_groups, B, pad, warm, res, report)
        store.close()
        print_targets(report)
        return res

    # --- warm page cache
    rows0 = PromptGroupSampler(num_groups=batch_groups, seed=0).sample(store, B)
    ref = collate(store.read(rows0), pad)
    got = flat.gather(rows0, pad)
    assert all(np.array_equal(ref[k].numpy(), got[k]) for k in got), "ideal gather disagrees with collate"
    res["padded_mb"] = _nbytes(ref) / 1e6
    report(f"  padded output {res['padded_mb']:.1f} MB per batch (int64 ids and masks, float32 log-probs)")
    _bench_batches(store, flat, torchrl_base, batch_groups, B, pad, warm, res, report)
    _bench_ids_dtype(store, flat, batch_groups, B, pad, warm, res, report)
    _bench_fresh_rows(store_path, flat, torchrl_base, batch_groups, group_size, pad, res, report)
    if args.quick:
        store.close()
        print_targets(report)
        return res
    trl = _trl_list(store, store.row_ids())
    got = _trl_pad(trl, rows0 - store.head, pad)
    assert all(torch.equal(ref[k], got[k]) for k in got), "TRL-style pad disagrees with collate"
    for _ in range(3):  # warm the pages and the buffers
        flat.gather(rows0, pad)
        store.read(rows0)
    # ours, the ideal gather and the TRL-style list are timed in turn on the same rows, so that load
    # from other processes hits all three alike
    collator = Collator(pad)
    for strategy in STRATEGIES:
        sampler = PromptGroupSampler(num_groups=batch_groups, strategy=strategy, seed=0)
        t = {"ours": [], "ideal": [], "trl": [], "torchrl": [], "trl_buffer": []}
        for i in range(warm + 3):
            t0 = time.perf_counter()
            rows = sampler.sample(store, B)  # exactly the loader worker's host path:
            batch = store.read(rows)  # sample, read, collate into a reused buffer set
            collator(batch)
            t1 = time.perf_counter()
            flat.gather(rows, pad)
            t2 = time.perf_counter()
            _trl_pad(trl, rows - store.head, pad)
            t3 = time.perf_counter()
            if torchrl_base is not None:
                torchrl_base.sample(rows - store.head, pad)
            t4 = time.perf_counter()
            entries = _trl_buffer_entries(collate(batch, pad))  # built untimed, as TRL's buffer held them
            t5 = time.perf_counter()
            _trl_buffer_repad(entries, pad)
            t6 = time.perf_counter()
            if i >= 3:
                t["ours"].append(t1 - t0), t["ideal"].append(t2 - t1), t["trl"].append(t3 - t2)
                t["torchrl"].append(t4 - t3), t["trl_buffer"].append(t6 - t5)
        ours, ideal, trl_ms, trl_rl, trl_buf = (1e3 * statistics.median(t[k])
                                                for k in ("ours", "ideal", "trl", "torchrl", "trl_buffer"))
        res[f"warm_{strategy}_ms"], res[f"ideal_{strategy}_ms"], res[f"trl_{strategy}_ms"] = ours, ideal, trl_ms
        res[f"torchrl_{strategy}_ms"], res[f"trl_buffer_{strategy}_ms"] = trl_rl, trl_buf
        report(f"  warm {strategy:9s} ours {ours:5.1f} ms | ideal numpy gather {ideal:5.1f} ms ({ideal / ours:.2f}x) | "
               f"TorchRL padded memmap {trl_rl:5.1f} ms ({trl_rl / ours:.2f}x) | unpadded list + pad_sequence "
               f"{trl_ms:5.1f} ms ({trl_ms / ours:.1f}x) | TRL buffer entries, drop padding + re-pad "
               f"{trl_buf:5.1f} ms ({trl_buf / ours:.1f}x)", flush=True)

    # --- the loader, warm: consumer-visible time per batch with no training step
    for pod in (False, True):
        with ReplayLoader(store, PromptGroupSampler(num_groups=batch_groups, seed=1), B, pad, prefetch=2,
                          device="cpu" if pod else None, pad_on_device=pod) as loader:
            for _ in range(3):
                next(loader)
            ms = _median_ms(lambda: next(loader), warm)
        res[f"loader_warm{'_pad_on_device' if pod else ''}_ms"] = ms
        report(f"  warm ReplayLoader next() {'(pad_on_device, cpu) ' if pod else ''}{ms:.1f} ms/batch")

    _bench_cold(store, "", batch_groups, B, cold, step_ms, res, report, pad)

    # --- bytes host -> device per batch
    batch = store.read(rows0)
    payload = sum(c.values.nbytes if isinstance(c, RaggedColumn) else getattr(c, "nbytes", 0)
                  for c in batch.values() if c is not None)
    res["bytes_padded"] = _nbytes(collate(batch, pad))
    res["bytes_pad_on_device"] = _nbytes(collate_unpadded(batch))
    res["bytes_payload"] = payload
    report(f"  host->device bytes/batch: padded {res['bytes_padded'] / 1e6:.1f} MB "
           f"({res['bytes_padded'] / payload:.2f}x payload), pad_on_device {res['bytes_pad_on_device'] / 1e6:.1f} MB "
           f"({res['bytes_pad_on_device'] / payload:.3f}x), unpadded payload {payload / 1e6:.1f} MB")
    store.close()
    del trl, flat

    # --- peak memory while sampling, this store and one big_factor times larger, each in a fresh process
    big_factor = args.big
    big = big_store(work, args)
    ensure_group_index(big)
    _bench_index_scaling(store_path, big, big_factor, res, report)
    with ReplayStore(big, readonly=True) as big_st:
        big_st.group_index()
        _bench_cold(big_st, f"[{big_factor}x store]", batch_groups, B, cold, step_ms, res, report, pad)
    for name, path in (("1x", store_path), (f"{big_factor}x", big)):
        m = _probe_in_subprocess(path, B, cold * 2)
        res[f"mem_{name}"] = m
        report(f"  memory, {name} store ({m['rows']} rows, {m['bytes'] / 1e9:.2f} GB): RssAnon "
               f"{m['anon_after_open_mb']:.0f} MB after open + index, peak {m['peak_anon_mb']:.0f} MB while a "
               f"ReplayLoader samples (per strategy: "
               + ", ".join(f"{k} {v:.0f}" for k, v in m["peaks"].items())
               + f"); peak RSS incl. mapped file pages {m['peak_rss_mb']:.0f} MB", flush=True)
    print_targets(report)
    return res


# --------------------------------------------------------------------------- priorities


class _CumsumPriorities:
    """Baseline: PrioritizedSampler before the sum tree (kept here to measure against).

    update_priorities wrote the new values and dropped the cached CDF; the next
    sample rebuilt ``cumsum((|p| + eps) ** alpha)`` over all live rows and
    binary-searched it. The loader also copied the whole priority array into
    every batch's state.
    """

    def __init__(self, priorities: np.ndarray, alpha: float, eps: float, seed: int) -> None:
        self.prio = np.abs(priorities.astype(np.float64))
        self.alpha, self.eps = alpha, eps
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.cdf = None
        self.last = -1

    def update_priorities(self, rows: np.ndarray, values: np.ndarray) -> None:
        _, last = np.unique(rows[::-1], return_index=True)
        last = len(rows) - 1 - last
        self.prio[rows[last]] = np.abs(values[last])
        self.cdf = None

    def sample(self, n: int) -> np.ndarray:
        if self.cdf is None:
            w = (self.prio + self.eps) ** self.alpha
            self.cdf = np.cumsum(w)
            self.last = int(np.flatnonzero(w)[-1])
        u = self.rng.random(n) * self.cdf[-1]
        return np.minimum(np.searchsorted(self.cdf, u, side="right"), self.last)

    def batch_state(self) -> dict:
        return {"priorities": self.prio.copy()}


def _priority_store(path: str, n: int) -> ReplayStore:
    store = ReplayStore(path, group_key=None)
    rng = np.random.default_rng(0)
    step = 1 << 20
    for start in range(0, n, step):
        k = min(step, n - start)
        store.extend({"advantages": rng.standard_normal(k).astype(np.float32)})
    return store


def bench_priorities(args) -> None:
    """update_priorities(512) + sample(512) per training step: sum tree vs the cumsum it replaced."""
    from diskreplay import PrioritizedSampler

    work = args.dir or tempfile.mkdtemp(prefix="diskreplay-bench-")
    sizes = [int(x) for x in args.sizes.split(",")]
    k, steps = 512, args.steps
    print(f"priorities: update_priorities({k}) + sample({k}) per step, medians of {steps} steps, paths alternated")
    row("", "sum tree", "cumsum", "speed-up")
    for n in sizes:
        path = os.path.join(work, f"prio-{n}")
        shutil.rmtree(path, ignore_errors=True)
        store = _priority_store(path, n)
        ours = PrioritizedSampler(alpha=0.6, eps=1e-4, seed=0)
        ours.sample(store, k)  # reads the priorities once and builds the tree (not timed)
        base = _CumsumPriorities(store.read(np.arange(n), ["advantages"])["advantages"], 0.6, 1e-4, 0)
        base.sample(k)
        rng = np.random.default_rng(1)
        t_ours, t_base, t_pos, t_state = [], [], [], []
        for i in range(steps + 3):  # 3 warm-up steps
            rows = rng.integers(0, n, k)
            vals = rng.standard_normal(k)
            order = (0, 1) if i % 2 else (1, 0)
            for which in order:
                t0 = time.perf_counter()
                if which == 0:
                    ours.update_priorities(rows, vals)
                    ours.sample(store, k)
                    dt = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    ours.position()  # what the loader keeps per batch now
                    dp = time.perf_counter() - t1
                    if i >= 3:
                        t_ours.append(dt)
                        t_pos.append(dp)
                else:
                    base.update_priorities(rows, vals)
                    base.sample(k)
                    dt = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    base.batch_state()  # what the loader copied per batch before
                    ds = time.perf_counter() - t1
                    if i >= 3:
                        t_base.append(dt)
                        t_state.append(ds)
        mo, mb = statistics.median(t_ours) * 1e3, statistics.median(t_base) * 1e3
        row(f"{n:>10,} live rows: update+sample", f"{mo:.3f} ms", f"{mb:.3f} ms", f"{mb / mo:.1f}x")
        mp_, ms = statistics.median(t_pos) * 1e3, statistics.median(t_state) * 1e3
        row(f"{n:>10,} live rows: per-batch loader state", f"{mp_:.4f} ms", f"{ms:.3f} ms", f"{ms / mp_:.0f}x")
        tree_b = ours._tree.nbytes
        held = tree_b + ours._prio._buf.nbytes + ours._counts._buf.nbytes
        row(f"{n:>10,} live rows: bytes per live row", f"{held / n:.1f} B", f"{(3 * 8 * n) / n:.1f} B",
            f"tree {tree_b / n:.1f} B")
        store.close()
        del ours, base
        shutil.rmtree(path, ignore_errors=True)
    print("  bytes per row: sum tree (2 x ring capacity x 8 B, ring = next power of two) + priorities + sample "
          "counts (amortised buffers up to 2x); cumsum: priorities + CDF + counts (8 B each) plus an N-row "
          "temporary per rebuild")


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the writers import this diskreplay
WRITER_CHILD = textwrap.dedent("""
    import json, os, shutil, sys, time
    import numpy as np
    kind, path, w, n, rows, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    import pyarrow as pa
    from diskreplay import ReplayStore
    from diskreplay.synthetic import make_rollouts, rollout_stream
    if rows:  # small commits of `rows` rows
        batches = [make_rollouts(1, rows, seed=w * 100_003 + i, first_group=w * 100_003 + i, completion_mean=50)
                   for i in range(n)]
    else:  # the GRPO workload of `bench.py store`: n batches of 512 rows
        batches = list(rollout_stream(n * 64, 64, 8, seed=w))
    def table(b):  # the store's own types (int32 ids, float32 log-probs), from the arrays' buffers
        def ragged(rows):
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([len(r) for r in rows], out=offsets[1:])
            return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(rows)))
        return pa.table({k: ragged(v) if isinstance(v, list) else pa.array(v)
                         for k, v in b.items() if v is not None and k != "rewards_per_func"})
    # every system appends the same pyarrow tables (made before the timing); "diskreplay-dict" the
    # batches as a trainer holds them (lists of numpy arrays), and so do the 512-row commits
    ours = kind.startswith("diskreplay")
    tables = [table(b) for b in batches] if rows and kind != "diskreplay-dict" else batches
    if ours:
        fsync = kind != "diskreplay-nofsync"
        open_store = lambda p: ReplayStore(p, multi_writer=True, fsync=fsync)
        append = lambda s, b, i: s.extend(tables[i], token=f"{w}:{i}")
    elif kind == "delta":
        from deltalake import write_deltalake
        open_store = lambda p: p
        append = lambda p, b, i: write_deltalake(p, tables[i], mode="append")
    elif kind == "floor":
        # the disk's part of a durable small commit and nothing else: a segment file and a manifest-to-be
        # of the same sizes, both fsynced at once, the link, the fsync of manifests/ (the segment's name
        # was made durable beforehand, as names reserved ahead are); no Python work, no reads
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(2)
        payloads, manifest = [bytes(t.nbytes) for t in tables], bytes(800)  # made before the timing
        def open_store(p):
            for d in ("segments", "manifests"):
                os.makedirs(os.path.join(p, d), exist_ok=True)
            return p, os.open(os.path.join(p, "manifests"), os.O_RDONLY)
        def append(s, b, i):
            root, mdir = s
            fd = os.open(f"{root}/segments/{w}-{i}-{time.monotonic_ns()}", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            os.write(fd, payloads[i])
            tf = os.open(f"{root}/manifests", os.O_TMPFILE | os.O_WRONLY)
            os.write(tf, manifest)
            list(pool.map(os.fsync, (fd, tf)))
            os.link(f"/proc/self/fd/{tf}", f"{w}-{i}-{time.monotonic_ns()}", dst_dir_fd=mdir)
            os.close(fd)
            os.close(tf)
            os.fsync(mdir)
    else:
        import lance
        open_store = lambda p: p
        append = lambda p, b, i: lance.write_dataset(tables[i], p, mode="append")
    # warm up every compared path the same way: one commit of the first batch into a scratch
    # store of its own (lazy imports, first-touch allocations, thread pools are paid here)
    scratch = f"{path}.warm{w}"
    s = open_store(scratch)
    append(s, batches[0], 0)
    if ours:
        s.close()  # the parent removes the scratch store when the whole benchmark ends (see _Trash)
    store = open_store(path)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.0005)
    t, cpu = time.perf_counter(), time.process_time()
    errors = 0
    for i, b in enumerate(batches):
        for attempt in range(100):  # Delta and Lance raise on a lost race: retry as their users do
            try:
                append(store, b, i)
                break
            except Exception as exc:
                if ours:
                    raise
                errors += 1
    out = {"start": t, "seconds": time.perf_counter() - t, "errors": errors, "cpu": time.process_time() - cpu}
    if ours:
        out.update(store.stats())
        store.close()
    out["end"] = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    print(json.dumps(out), flush=True)
""")


def _run_writers(kind: str, path: str, writers: int, n: int, rows: int, go: str = "",
                 warm_bytes: int = 256 << 20) -> Dict[str, float]:
    """``writers`` processes append ``n`` batches each, started together; the wall time from the
    start signal to the last writer's last commit (measured by the writers: interpreter start,
    imports, warm-up and exit are outside it) and their summed stats. ``warm_bytes`` of free
    memory are touched right before the start (:func:`warm_free_memory`)."""
    go = go or path + ".go"
    if os.path.exists(go):
        os.remove(go)
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER_CHILD, kind, path, str(w), str(n), str(rows), go],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for w in range(writers)]
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "ready":
            for q in procs:
                q.kill()
            raise RuntimeError(f"{kind} writer failed: {line}{p.stderr.read()}")
    warm_free_memory(warm_bytes)
    t = time.perf_counter()
    open(go, "w").close()
    outs = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{kind} writer failed: {err}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    os.remove(go)
    res = {"wall": max(o["end"] for o in outs) - t, "commits": writers * n}
    for key in ("conflicts", "commit_seconds", "manifest_seconds", "retry_seconds", "errors", "cpu",
                "dropped_rewrites"):
        res[key] = sum(o.get(key, 0) for o in outs)
    if kind.startswith("diskreplay"):  # what the merges left: many small segments make every commit dearer
        from diskreplay import ReplayStore
        with ReplayStore(path, readonly=True) as ro:
            res["segments"] = len(ro.manifest.segments)
    return res


def _fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


class _Trash:
    """Finished runs' directories, removed only when the benchmark ends.

    On ext4 without a journal (this VM's root filesystem) creating a file scans
    past every inode of its block group freed in the last 1 to 6 minutes
    (``recently_deleted()`` in the kernel's inode allocator): after a run's
    thousands of files are removed, each file the next run creates costs up to
    ~1 ms of CPU instead of ~0.03 ms. Removing runs between the compared runs
    would charge one run for the files of the one before it.
    """

    def __init__(self, work: str) -> None:
        self.dir = os.path.join(work, ".trash")
        os.makedirs(self.dir, exist_ok=True)
        self.count = 0

    def keep(self, path: str) -> None:
        """Move ``path`` and its writers' warm-up stores (``path.warm*``) out of the way."""
        for p in [path] + glob.glob(glob.escape(path) + ".warm*"):
            if os.path.exists(p):
                self.count += 1
                os.rename(p, os.path.join(self.dir, str(self.count)))

    def empty(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def bench_writers(args) -> None:
    """Many writer processes on one multi-writer store vs raw write+fsync, and Delta/Lance small commits.

    Every compared run is repeated ``args.rounds`` times, the runs of one round alternating
    (raw, 1, 2, 4, 8 writers; diskreplay, Delta, Lance, and the disk floor of a durable small
    commit: its files and fsyncs without the Python work), and the medians are reported.
    """
    work = args.dir or tempfile.mkdtemp(prefix="diskreplay-bench-writers-")
    os.makedirs(work, exist_ok=True)
    rounds = args.rounds
    n_big = max(1, args.groups // 64)
    batches = make_batches(64 * n_big)
    pay = payload_bytes(batches)
    raw_path = os.path.join(work, "raw.bin")
    print(f"workload: {n_big} batches of 512 GRPO rows per writer ({pay['raw'] / 2**20:.1f} MiB raw each); "
          f"{rounds} alternating rounds, medians; work dir {work}; load average {os.getloadavg()[0]:.1f}")
    counts = (1, 2, 4, 8)
    walls: Dict[int, List[float]] = {w: [] for w in counts}
    t_raw = []
    trash = _Trash(work)
    create_ms = _create_cpu_ms(work)
    print(f"creating an empty file in the work dir: CPU {create_ms:.3f} ms (a fresh ext4 ~0.03 ms; "
          "far more on an ext4 without a journal within minutes of mass deletes there: see _Trash)")
    if create_ms > CHURNED_CREATE_MS:
        print(f"  WARNING: at {create_ms:.2f} ms per file every system's small commits here pay for the files "
              "deleted nearby lately (each creates 3 or more): run with --dir on a fresh top-level directory "
              "(e.g. mkdir /bench-$$), or minutes later")
    write_raw(batches, raw_path)  # warm: numpy's first calls
    trash.keep(raw_path)
    warm = 3 * pay["raw"]  # per writer: its columns joined, its segments' bytes, their page cache
    for r in range(rounds):
        warm_free_memory(warm)
        t_raw.append(write_raw(batches, raw_path))  # a new file, as a store's appends are
        trash.keep(raw_path)
        for w in counts:
            path = _fresh(os.path.join(work, f"big{w}.{r}"))
            ReplayStore(path, multi_writer=True).close()
            walls[w].append(_run_writers("diskreplay", path, w, n_big, 0, warm_bytes=w * warm)["wall"])
            trash.keep(path)
    raw_rate = pay["rows"] / statistics.median(t_raw)
    print("\naggregate append, 512-row commits, fsync incl.     rows/s    raw write+fsync     ratio")
    print("  (raw: one process appends one writer's bytes to a new file, fsync per batch; free memory "
          "is touched before every run: see warm_free_memory)")
    for w in counts:
        rate = w * pay["rows"] / statistics.median(walls[w])
        row(f"{w} writer process(es)", f"{rate:,.0f}", f"{raw_rate:,.0f}", f"{rate / raw_rate:.2f}")

    n = args.commits
    print(f"\nsmall commits: {n} commits of 8 rows per writer   commits/s  conflicts/commit  retry share")
    print("  (every system appends the same pyarrow tables, made before the timing; 'dict input': the same"
          " rows as lists of numpy arrays, as a trainer holds them)")
    print("  (retry share: time lost to races / commit time (first data write to publish); in brackets /"
          " the manifest step's time; CPU: the writers' process time (all threads) per commit)")
    runs: Dict[Tuple[str, int], List[Dict[str, float]]] = {}
    ours = [("diskreplay", w) for w in counts] + [("diskreplay-dict", 4), ("diskreplay-nofsync", 1),
                                                  ("diskreplay-nofsync", 4)]
    anchors = [(k, w) for k in ("delta", "lance") for w in (1, 4)]
    plan = ours + anchors + [("floor", 1), ("floor", 4)]
    failed: Dict[Tuple[str, int], str] = {}
    for r in range(rounds):
        for kind, w in plan:
            if (kind, w) in failed:
                continue
            path = _fresh(os.path.join(work, f"{kind}{w}.{r}"))
            if kind.startswith("diskreplay"):
                ReplayStore(path, multi_writer=True).close()
            try:
                runs.setdefault((kind, w), []).append(_run_writers(kind, path, w, n, 8))
            except Exception as exc:  # a missing package or a failed run is reported, not fatal
                if kind.startswith("diskreplay"):
                    raise
                failed[(kind, w)] = str(exc).splitlines()[-1][:60]
            trash.keep(path)

    def median_run(key):
        rs = sorted(runs[key], key=lambda r: r["wall"])
        return rs[len(rs) // 2]

    dr: Dict[int, float] = {}
    unsynced: Dict[int, float] = {}
    for kind, w in ours:
        r = median_run((kind, w))
        rate = r["commits"] / r["wall"]
        if kind == "diskreplay":
            dr[w] = rate
        elif kind == "diskreplay-nofsync":
            unsynced[w] = rate
        label = f"diskreplay, {w} writer(s)" + {"diskreplay-dict": ", dict input",
                                                "diskreplay-nofsync": ", fsync=False"}.get(kind, "")
        row(label, f"{rate:,.1f}", f"{r['conflicts'] / r['commits']:.2f}",
            f"{r['retry_seconds'] / max(r['commit_seconds'], 1e-9):.1%} "
            f"[{r['retry_seconds'] / max(r['manifest_seconds'], 1e-9):.0%}] "
            f"CPU {1e3 * r['cpu'] / r['commits']:.1f} ms/commit, {r.get('segments', '?')} segments at the end"
            + (f", {r['dropped_rewrites']} merges lost" if r["dropped_rewrites"] else ""))
    for kind, w in anchors:
        if (kind, w) in failed:
            row(f"{kind}, {w} writer(s)", f"failed: {failed[(kind, w)]}")
            continue
        r = median_run((kind, w))
        rate = r["commits"] / r["wall"]
        row(f"{kind}, {w} writer(s)", f"{rate:,.1f}", f"{r['errors'] / r['commits']:.2f} retries",
            f"dr/{kind} {dr[w] / rate:.1f}x (fsync=False {unsynced[w] / rate:.1f}x) "
            f"CPU {1e3 * r['cpu'] / r['commits']:.1f} ms/commit")
        # the same ratios within each round (its runs were minutes apart at most): the VM's speed drifts
        # between rounds, and a ratio of runs from one round is the steadier figure
        for mine, label in (("diskreplay", "durable"), ("diskreplay-nofsync", "fsync=False")):
            per_round = [(a["commits"] / a["wall"]) / (b["commits"] / b["wall"])
                         for a, b in zip(runs[(mine, w)], runs[(kind, w)])]
            print(f"    dr/{kind}, {label}, round by round: "
                  f"{' '.join(f'{x:.1f}x' for x in per_round)} (median {statistics.median(per_round):.1f}x)")
    print("  (neither Delta's nor Lance's append calls fsync (strace): fsync=False is the like-for-like setting; "
          "diskreplay's default makes every commit durable)")
    # what the disk allows a durable commit on this machine now: the VM's fsync latency moves by 2-3x within
    # hours, and with it every durable figure above; Lance's rate does not follow it (no fsync)
    for w in (1, 4):
        if ("floor", w) not in runs:
            continue
        rates = [r["commits"] / r["wall"] for r in runs[("floor", w)]]
        mine = [r["commits"] / r["wall"] for r in runs[("diskreplay", w)]]
        lance = [r["commits"] / r["wall"] for r in runs.get(("lance", w), [])]
        floor = statistics.median(rates)
        row(f"disk floor of a durable commit, {w} writer(s)", f"{floor:,.1f}", "",
            f"diskreplay durable at {statistics.median(mine) / floor:.0%} of it")
        print(f"    (each: a segment file and a manifest-to-be of the same sizes, both fsynced at once, a link, "
              f"the fsync of manifests/; no Python work) round by round: {' '.join(f'{x:,.0f}' for x in rates)}"
              + (f"; 3x Lance's rate is {3 * statistics.median(lance) / floor:.0%} of it" if lance else ""))
    print(f"  load average at the end {os.getloadavg()[0]:.1f}; creating an empty file in the work dir now: "
          f"CPU {_create_cpu_ms(work):.3f} ms")
    trash.empty()


# ---------------------------------------------------------------------------
# remote: the same store in a loopback seaweedfs against local disk


def _needed_bytes(batch) -> int:
    """Bytes of the values a read returned (what a perfect fetch would download)."""
    total = 0
    for v in batch.values():
        if isinstance(v, RaggedColumn):
            total += v.values.nbytes + 8 * len(v)  # values and one offset per row
        elif isinstance(v, np.ndarray):
            total += v.nbytes
    return total


def bench_remote(args) -> None:
    """Append rows/s (4 writer processes), reopen + first batch cold and warm, bytes
    fetched over bytes needed and the cache's hit rate: a store in a loopback
    seaweedfs (``weed server -s3``) against the same store on local disk, in one run."""
    from tests.s3servers import start

    # The client is obstore: python tools/s3_clients.py compares it with s3fs and pyarrow.fs
    # (lowest per-request cost, create-if-absent with its own error, concurrent range GETs;
    # diskreplay/storage/s3.py has the numbers).
    work = args.dir or tempfile.mkdtemp(prefix="diskreplay-bench-remote-")
    os.makedirs(work, exist_ok=True)
    server = start("seaweedfs", os.path.join(work, "weed"))
    try:
        os.environ.update({k: v for k, v in server.env.items()})  # the writer processes find it this way
        bucket = server.new_bucket()
        n_batches = max(1, args.groups // 64)
        print(f"workload: 4 writers x {n_batches} GRPO batches of 512 rows; seaweedfs {server.endpoint} "
              f"(loopback); local disk under {work}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

        # -- append, 4 writer processes, alternating local and remote runs; best of 2
        walls: Dict[str, List[float]] = {"local": [], "remote": []}
        for rep in range(2):
            for kind in ("local", "remote"):
                path = (os.path.join(work, f"append{rep}") if kind == "local"
                        else f"s3://{bucket}/append{rep}")
                ReplayStore(path, multi_writer=True).close()
                go = os.path.join(work, "go")
                walls[kind].append(_run_writers("diskreplay", path, 4, n_batches, 0, go=go)["wall"])
        rows = 4 * n_batches * 512
        print("\nappend, 4 writer processes, 512-row commits      rows/s        local disk      ratio")
        rate = {k: rows / min(v) for k, v in walls.items()}
        row("seaweedfs (loopback)", f"{rate['remote']:,.0f}", f"{rate['local']:,.0f}",
            f"{rate['remote'] / rate['local']:.2f}")

        # -- reads: one store of n_batches * 512 rows, written once to each place
        local = os.path.join(work, "read")
        url = f"s3://{bucket}/read"
        for path in (local, url):
            with ReplayStore(path, capacity=None) as st:
                for b in make_batches(64 * n_batches, seed=3):
                    st.extend(b)
        rng = np.random.default_rng(0)
        with ReplayStore(local, readonly=True) as st:
            gi = st.group_index()
            store_bytes = st.nbytes

        def batch_rows():  # 64 random groups of 8: the GRPO sample
            g = rng.choice(len(gi), 64, replace=False)
            return np.concatenate([gi.group(int(i)) for i in g])

        cold: Dict[str, List[float]] = {"local": [], "remote": []}
        fetched, needed = [], []
        for rep in range(5):
            rows_ = batch_rows()
            for kind in ("local", "remote"):
                if kind == "local":
                    evict_from_page_cache(local)
                    t = time.perf_counter()
                    with ReplayStore(local, readonly=True) as st:
                        out = st.read(rows_)
                    cold[kind].append(time.perf_counter() - t)
                else:
                    cache = os.path.join(work, f"cache-cold{rep}")
                    t = time.perf_counter()
                    with ReplayStore(url, readonly=True, cache_dir=cache) as st:
                        out = st.read(rows_)
                        cold[kind].append(time.perf_counter() - t)
                        stats = st.stats()["cache"]
                    fetched.append(stats["fetched_bytes"])
                    needed.append(_needed_bytes(out))
                    shutil.rmtree(cache, ignore_errors=True)
        print("\nreopen + first batch (512 rows), cold             ms            local disk      ratio")
        c = {k: statistics.median(v) * 1e3 for k, v in cold.items()}
        row("seaweedfs, empty cache", f"{c['remote']:.1f}", f"{c['local']:.1f}", f"{c['remote'] / c['local']:.2f}")
        ratio = statistics.median(f / n for f, n in zip(fetched, needed))
        row("bytes fetched / bytes needed (cold batch)", f"{ratio:.2f}", "", "")

        # -- warm: every page of the store local (page cache / full object cache); random batches
        full = os.path.join(work, "cache-full")
        warm: Dict[str, List[float]] = {"local": [], "remote": []}
        with ReplayStore(local, readonly=True) as lst, ReplayStore(url, readonly=True, cache_dir=full) as rst:
            every = lst.row_ids()
            lst.read(every)
            rst.read(every)
            for _ in range(3):
                rows_ = batch_rows()
                lst.read(rows_)
                rst.read(rows_)
            for _ in range(30):
                rows_ = batch_rows()
                for kind, st in (("local", lst), ("remote", rst)):
                    t = time.perf_counter()
                    st.read(rows_)
                    warm[kind].append(time.perf_counter() - t)
        w = {k: statistics.median(v) * 1e3 for k, v in warm.items()}
        print("\nbatch of 512 rows, warm                          ms            local disk      ratio")
        row("seaweedfs, cache holds the store", f"{w['remote']:.2f}", f"{w['local']:.2f}",
            f"{w['remote'] / w['local']:.2f}")

        # -- hit rate over a run with a cache of half the store
        with ReplayStore(url, readonly=True, cache_dir=os.path.join(work, "cache-half"),
                         cache_bytes=store_bytes // 2) as st:
            t = time.perf_counter()
            for _ in range(100):
                st.read(batch_rows())
            run_s = time.perf_counter() - t
            stats = st.stats()["cache"]
        print("\ncache of half the store, 100 random batches")
        row("hit rate (bytes served from the cache)", f"{stats['hit_rate']:.1%}")
        row("evicted / fetched", f"{_size(stats['evicted_bytes'])} / {_size(stats['fetched_bytes'])}")
        row("batches per second", f"{100 / run_s:.1f}")
    finally:
        server.close()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------
# commit-cpu: what one small commit of a multi-writer store costs in CPU


CHURNED_CREATE_MS = 0.1  # a file create costing more than this (0.02-0.05 ms when quiet) skews small commits


def _create_cpu_ms(directory: str, n: int = 200) -> float:
    """CPU ms to create (and close) one empty file in ``directory``: on a busy ext4 it ranges from
    0.03 to over 1 ms (inode allocation skipping recently freed inodes), a large share of a commit."""
    d = tempfile.mkdtemp(prefix="creates-", dir=directory)
    try:
        c = time.process_time()
        for i in range(n):
            os.close(os.open(os.path.join(d, str(i)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return 1e3 * (time.process_time() - c) / n
    finally:
        shutil.rmtree(d, ignore_errors=True)


def bench_commit_cpu(args) -> None:
    """CPU and wall time per small commit (8 GRPO rows, token, fsync) in ONE process on a
    multi-writer store: the cost that bounds ``writers``' commits/s on a machine with fewer
    cores than writers. ``--profile`` adds cProfile tables of the commits (by tottime and
    cumulative), and of the writer's import and open, measured apart."""
    import cProfile
    import io
    import pstats

    n = args.commits
    work = args.dir or tempfile.mkdtemp(prefix="diskreplay-bench-commit-cpu-")
    os.makedirs(work, exist_ok=True)
    # the rows of bench.py writers' WRITER_CHILD: one group of 8, completions ~50 tokens
    from diskreplay.synthetic import make_rollouts
    batches = [make_rollouts(1, 8, seed=i, first_group=i, completion_mean=50) for i in range(n)]
    warm = [make_rollouts(1, 8, seed=10**6 + i, first_group=10**6 + i, completion_mean=50) for i in range(20)]
    path = _fresh(os.path.join(work, "store"))
    c0, t0 = time.process_time(), time.perf_counter()
    store = ReplayStore(path, multi_writer=True)
    open_cpu, open_wall = time.process_time() - c0, time.perf_counter() - t0
    for i, b in enumerate(warm):  # first calls, the schema, first merges
        store.extend(b, token=f"warm:{i}")
    # CPU time, not wall: waits on fsync and on the I/O threads are not what bounds 4 writers on 2 cores
    prof = cProfile.Profile(time.process_time) if args.profile else None
    c0, t0, os0 = time.process_time(), time.perf_counter(), os.times()
    if prof:
        prof.enable()
    for i, b in enumerate(batches):
        store.extend(b, token=f"0:{i}")
    if prof:
        prof.disable()
    cpu, wall, os1 = time.process_time() - c0, time.perf_counter() - t0, os.times()
    create_ms = _create_cpu_ms(os.path.join(path, "segments"))
    stats = store.stats()
    store.close()
    print(f"{n} commits of 8 rows, one writer, multi_writer=True store, token per commit; "
          f"load average {os.getloadavg()[0]:.1f}{' (cProfile on: times inflated)' if prof else ''}")
    print(f"  CPU  ms/commit {1e3 * cpu / n:7.2f}   (time.process_time, all threads: user "
          f"{1e3 * (os1.user - os0.user) / n:.2f}, system {1e3 * (os1.system - os0.system) / n:.2f})")
    print(f"  wall ms/commit {1e3 * wall / n:7.2f}")
    print(f"  open (warm imports): CPU {1e3 * open_cpu:.1f} ms, wall {1e3 * open_wall:.1f} ms; "
          f"commits {stats.get('commits')}, conflicts {stats.get('conflicts')}")
    print(f"  creating an empty file beside the store's segments: CPU {create_ms:.3f} ms (the kernel's inode "
          "allocation; a small commit creates 3 files: segment, sidecar, delta)")
    if prof:
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(35)
            print(f"\n--- commits, by {key} ---")
            print("\n".join(out.getvalue().splitlines()[4:]))
        code = ("import cProfile, pstats, sys, time\n"
                "p = cProfile.Profile(time.process_time); p.enable()\n"
                "from diskreplay import ReplayStore\n"
                f"s = ReplayStore({path!r}, multi_writer=True); s.close()\n"
                "p.disable(); pstats.Stats(p).sort_stats('cumulative').print_stats(20)\n")
        env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        print("\n--- a fresh process: import diskreplay + open the store, by cumulative ---")
        print("\n".join(out.stdout.splitlines()[:45]) or out.stderr)
    if not prof:
        _small_segments_ab(batches, work)
    shutil.rmtree(work if not args.dir else path, ignore_errors=True)


def _small_segments_ab(batches, work: str, rounds: int = 5) -> None:
    """CPU per small commit with segments below 64 KiB checked whole (their sidecars without page
    checksums, the default) against page checksums on every segment (what older versions wrote), alternating
    in this process, fresh stores, the same batches; medians."""
    from diskreplay import segment

    default = segment.PAGED_SEGMENT_BYTES
    cpu: Dict[int, List[float]] = {default: [], 0: []}
    try:
        for r in range(rounds):
            for threshold in (0, default):
                segment.PAGED_SEGMENT_BYTES = threshold
                path = _fresh(os.path.join(work, f"ab{r}.{threshold}"))
                with ReplayStore(path, multi_writer=True) as store:
                    for i, b in enumerate(batches[:20]):  # warm: first calls, the schema, first merges
                        store.extend(b, token=f"warm:{i}")
                    c0 = time.process_time()
                    for i, b in enumerate(batches):
                        store.extend(b, token=f"ab:{i}")
                    cpu[threshold].append(1e3 * (time.process_time() - c0) / len(batches))
    finally:
        segment.PAGED_SEGMENT_BYTES = default
        for r in range(rounds):  # after every timing: removing files slows creates here for minutes
            for threshold in (0, default):
                shutil.rmtree(os.path.join(work, f"ab{r}.{threshold}"), ignore_errors=True)
    whole, paged = statistics.median(cpu[default]), statistics.median(cpu[0])
    print(f"  small segments checked whole (sidecar without page checksums) vs page checksums on every segment, "
          f"{rounds} alternating rounds: CPU {whole:.2f} vs {paged:.2f} ms/commit ({whole / paged:.2f}x)")


# --------------------------------------------------------------------------- stream

STREAM_CHILD = r"""
import json, os, sys, time
role, path, me, writers, commits, groups, go = sys.argv[1:8]
me, writers, commits, groups = int(me), int(writers), int(commits), int(groups)
from diskreplay import Collator, ReplayStore
from diskreplay.stream import RolloutStream
from diskreplay.synthetic import make_rollouts

def wait_go():
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)

store = ReplayStore(path)
if role == "writer":
    batches = [make_rollouts(groups, 8, seed=me * 10007 + i, first_group=(me * commits + i) * groups)
               for i in range(commits)]
    store.extend(make_rollouts(1, 8, seed=99, first_group=10**9 + me))  # warm: the schema is fixed
    wait_go()
    waited = 0.0
    for i, b in enumerate(batches):
        t = time.perf_counter()
        store.wait_for_consumers(max_ahead_rows=64 * groups * 8, timeout=60, poll=0.01)
        waited += time.perf_counter() - t
        store.extend(b, token=f"w{me}:{i}")
    stats = store.stats()
    store.close()
    print(json.dumps({"end": time.time(), "waited": waited, "conflicts": stats.get("conflicts", 0),
                      "commit_seconds": stats.get("commit_seconds", 0)}), flush=True)
else:
    batch_rows, total = 512, writers * commits * groups * 8
    got = steps = 0
    stream = RolloutStream(store, "trainer", group_size=8)
    stream.next(8, timeout=60)  # the warm-up rows of the writers' first commits
    while stream.next(8, timeout=0) is not None:
        pass
    stream.save()
    collator = Collator(pad_token_id=0)
    wait_go()
    while got < total:
        rows = stream.next(min(batch_rows, total - got), timeout=60)
        batch = collator.read(store, rows, columns=["prompt_ids", "completion_ids", "old_per_token_logps",
                                                    "advantages"])
        got += len(rows)
        steps += 1
        stream.save()  # the cursor, durably: a restart goes on from here
    print(json.dumps({"end": time.time(), "rows": got, "steps": steps}), flush=True)
"""


def _rows_batch(buf: Dict[str, list], n: int) -> dict:
    """The first ``n`` received rows as TRL's padded batch (the in-memory baseline's trainer step)."""
    return collate({**{k: RaggedColumn.from_arrays(buf[k][:n]) for k in TOKEN_COLUMNS[:2] + ("prompt_ids",)},
                    "advantages": np.asarray(buf["advantages"][:n], np.float32)}, pad_token_id=0)


def _queue_writer(q, me: int, commits: int, groups: int, ready, go, done) -> None:
    from diskreplay.synthetic import make_rollouts as make
    batches = [make(groups, 8, seed=me * 10007 + i, first_group=(me * commits + i) * groups) for i in range(commits)]
    ready.put(me)
    go.wait()
    for b in batches:
        q.put(b)
    done.put(time.time())


def _queue_trainer(q, total: int, ready, go, done) -> None:
    buf: Dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "old_per_token_logps", "advantages")}
    _rows_batch({k: [np.zeros(1, np.int32)] if k != "advantages" else [0.0] for k in buf}, 1)  # warm
    ready.put("trainer")
    go.wait()
    got = steps = 0
    while got < total:
        b = q.get()
        for k in ("prompt_ids", "completion_ids", "old_per_token_logps"):
            buf[k].extend(b[k])
        buf["advantages"].extend(b["advantages"].tolist())
        while got < total and len(buf["advantages"]) >= min(512, total - got):
            n = min(512, total - got)
            _rows_batch(buf, n)
            buf = {k: v[n:] for k, v in buf.items()}
            got, steps = got + n, steps + 1
    done.put({"end": time.time(), "rows": got, "steps": steps})


def _queue_run(writers: int, commits: int, groups: int) -> Dict[str, float]:
    """The same processes (spawned) and batches, through one ``multiprocessing.Queue``: nothing durable."""
    ctx = mp.get_context("spawn")
    q, ready, done, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    total = writers * commits * groups * 8
    procs = [ctx.Process(target=_queue_writer, args=(q, w, commits, groups, ready, go, done)) for w in range(writers)]
    procs.append(ctx.Process(target=_queue_trainer, args=(q, total, ready, go, done)))
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    t = time.time()
    go.set()
    ends = [done.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    end = max(e["end"] if isinstance(e, dict) else e for e in ends)
    return {"rows": total, "wall": end - t, "rows_per_s": total / (end - t)}


def _stream_run(kind: str, work: str, writers: int, commits: int, groups: int) -> Dict[str, float]:
    """Rows per second from ``writers`` processes to one consuming trainer process (``kind``:
    diskreplay's store and stream; "writers": the same writers with no trainer; "queue": a
    ``multiprocessing.Queue``), timed from one start signal to the trainer's last batch (the
    writers' last commit); every process has made its batches and opened its ends before."""
    if kind == "queue":
        return _queue_run(writers, commits, groups)
    alone = kind == "writers"  # diskreplay's writers with no trainer: what their commits cost by themselves
    path = os.path.join(work, f"{kind}-{time.monotonic_ns()}")
    go = path + ".go"
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ReplayStore(path, multi_writer=True).close()
    args = [path, "0", str(writers), str(commits), str(groups), go]

    def start(role: str, me: int) -> subprocess.Popen:
        a = list(args)
        a[1] = str(me)
        return subprocess.Popen([sys.executable, "-c", STREAM_CHILD, role, *a], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    trainer = None if alone else start("trainer", 0)
    procs = [start("writer", w) for w in range(writers)]
    everyone = procs + ([] if alone else [trainer])
    for p in everyone:  # (the trainer skips the writers' warm-up commits before it is ready)
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    t = time.time()
    open(go, "w").close()
    outs = []
    for p in everyone:
        out, err = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"{kind} stream child failed: {err[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    rows = writers * commits * groups * 8 if alone else outs[-1]["rows"]
    end = max(o["end"] for o in outs)
    res = {"rows": rows, "wall": end - t, "rows_per_s": rows / (end - t)}
    for key in ("waited", "conflicts", "commit_seconds"):
        res[key] = sum(o.get(key, 0) for o in outs[:writers])
    return res


def bench_stream(args) -> None:
    """Rollouts from writer processes to a consuming trainer: a durable store and its stream (every
    commit and every cursor fsynced) vs a ``multiprocessing.Queue`` between the same processes,
    and vs the same writers with no trainer; the three alternate, medians are reported."""
    work = args.dir
    writers, commits, groups = 4, args.commits, max(1, args.groups // 256)
    print(f"stream: {writers} writers x {commits} commits x {groups} groups of 8 rows "
          f"({writers * commits * groups * 8} rows, GRPO workload), trainer batches of 512 rows padded; "
          f"{args.rounds} alternating rounds, medians")
    runs: Dict[str, List[float]] = {"diskreplay": [], "queue": [], "writers": []}
    for _ in range(args.rounds):
        for kind in runs:
            runs[kind].append(_stream_run(kind, work, writers, commits, groups)["rows_per_s"])
    dr, queue, alone = (statistics.median(runs[k]) for k in ("diskreplay", "queue", "writers"))
    row("", "diskreplay", "baseline", "ratio")
    row("rows/s writers -> trainer vs mp.Queue", f"{dr:,.0f}", f"{queue:,.0f}", f"{dr / queue:.2f}x")
    row("rows/s writers -> trainer vs writers alone", f"{dr:,.0f}", f"{alone:,.0f}", f"{dr / alone:.2f}x")
    print("  (mp.Queue: the same process layout, batches pickled through one multiprocessing.Queue, nothing "
          "durable; writers alone: diskreplay's commits with no trainer)")
    print("  runs: " + ", ".join(f"{k} {[round(x) for x in v]}" for k, v in runs.items()))


def _rollout_samples(n: int, seed: int = 0) -> list:
    """``n`` samples with TRL's ``RolloutSample`` fields (prompt + completion 256..768 tokens, groups of 8)."""
    from types import SimpleNamespace
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length, prompt = int(rng.integers(256, 769)), int(rng.integers(32, 128))
        out.append(SimpleNamespace(
            prompt=[{"role": "user", "content": f"question {i // 8}"}], completion=[{"role": "assistant",
                                                                                 "content": "answer"}],
            input_ids=rng.integers(0, 32000, length), completion_mask=np.r_[np.zeros(prompt, np.int64),
                                                                            np.ones(length - prompt, np.int64)],
            old_log_probs=-rng.random(length, dtype=np.float32), advantage=float(rng.normal()), model_version=0,
            group_id=i // 8, metrics={"reward": float(rng.random())}, enqueued_at=None))
    return out


def _buffer_writer(q, kind: str, n: int, ready, go, done) -> None:
    samples = _rollout_samples(n)
    if kind != "queue":
        q.put_nowait(_rollout_samples(1, seed=1)[0])  # warm: the store open, the schema fixed (not timed)
    ready.put("worker")
    go.wait()
    if kind == "durable-group":
        for i in range(0, n, 8):
            q.put_many(samples[i:i + 8])
    else:
        for s in samples:
            q.put_nowait(s)
    done.put(time.time())


def _buffer_trainer(q, kind: str, n: int, ready, go, done) -> None:
    if kind != "queue":
        q.get(timeout=300)  # the warm-up sample; builds TRL's RolloutSample (imports TRL) before the clock
    ready.put("trainer")
    go.wait()
    for _ in range(n):
        q.get(timeout=300)
    done.put(time.time())


def async_buffer_rows_per_s(kind: str, work: str, n: int) -> Dict[str, float]:
    """Rows (rollout samples) per second from a worker process's ``put_nowait`` to a trainer
    process's ``get``: ``kind`` "durable" (``DurableRolloutQueue``, a commit per sample, fsynced),
    "durable-nofsync" (the same with ``fsync=False``: survives a process's death, not the machine's),
    "durable-group" (``put_many``, a fsynced commit per group of 8) or "queue" (the
    ``multiprocessing.Queue`` TRL's ``AsyncRolloutWorker`` uses). Both processes are spawned, have
    made their samples and opened their ends before the clock starts."""
    from diskreplay.integrations.trl import DurableRolloutQueue
    ctx = mp.get_context("spawn")
    q = ctx.Queue() if kind == "queue" else DurableRolloutQueue(os.path.join(work, f"{kind}-{time.monotonic_ns()}"),
                                                                 fsync=kind != "durable-nofsync")
    ready, done, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=f, args=(q, kind, n, ready, go, done)) for f in (_buffer_writer, _buffer_trainer)]
    procs[0].start()
    ready.get(timeout=600)  # the worker's warm-up sample is committed: the trainer's first get returns
    procs[1].start()
    ready.get(timeout=600)
    t = time.time()
    go.set()
    end = max(done.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return {"rows": n, "wall": end - t, "rows_per_s": n / (end - t)}


def bench_async_buffer(args) -> None:
    """TRL AsyncGRPOTrainer's rollout buffer: ``DurableRolloutQueue`` (put in a worker process, get in
    the trainer process) vs the ``multiprocessing.Queue`` it replaces, the same samples, alternating."""
    n = args.groups * 8
    print(f"async-buffer: {n} RolloutSamples (256..768 tokens) from a worker process to a trainer process; "
          f"{args.rounds} alternating rounds, medians")
    runs: Dict[str, List[float]] = {"durable": [], "durable-nofsync": [], "durable-group": [], "queue": []}
    for _ in range(args.rounds):
        for kind in runs:
            runs[kind].append(async_buffer_rows_per_s(kind, args.dir, n)["rows_per_s"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    row("", "diskreplay", "mp.Queue", "ratio")
    row("rows/s put_nowait -> get (a commit per sample)", f"{med['durable']:,.0f}", f"{med['queue']:,.0f}",
        f"{med['durable'] / med['queue']:.2f}x")
    row("rows/s the same, fsync=False", f"{med['durable-nofsync']:,.0f}", f"{med['queue']:,.0f}",
        f"{med['durable-nofsync'] / med['queue']:.2f}x")
    row("rows/s put_many(8) -> get (a commit per group)", f"{med['durable-group']:,.0f}", f"{med['queue']:,.0f}",
        f"{med['durable-group'] / med['queue']:.2f}x")
    print("  (diskreplay: every commit fsynced, each sample once across a SIGKILL of either process; mp.Queue: "
          "pickled through a pipe, gone with the trainer)")
    print("  runs: " + ", ".join(f"{k} {[round(x) for x in v]}" for k, v in runs.items()))


def _tq_fields(rows: int, fields: int, max_tokens: int, seed: int = 0):
    """TransferQueue's perftest shape: jagged float32 fields, lengths spread over 1..max_tokens."""
    from tensordict import TensorDict
    g = torch.Generator().manual_seed(seed)
    data = {}
    for f in range(fields):
        lengths = torch.randint(1, max_tokens + 1, (rows,), generator=g).tolist()
        flat = torch.randn(sum(lengths), generator=g)
        data[f"field_{f}"] = torch.nested.as_nested_tensor(list(torch.split(flat, lengths)), layout=torch.jagged)
    return TensorDict(data, batch_size=rows)


def _tq_cycles(conf: dict, data, rounds: int) -> Dict[str, float]:
    """put -> get -> clear of the whole batch through TransferQueue's KV API, ``rounds`` timed cycles after
    one warm-up; median seconds of each step."""
    import transfer_queue as tq
    from omegaconf import OmegaConf
    tq.init(OmegaConf.create(conf))
    keys = [f"k{i}" for i in range(data.batch_size[0])]
    times: Dict[str, List[float]] = {"put": [], "get": [], "clear": []}
    try:
        for cycle in range(rounds + 1):
            t0 = time.perf_counter()
            tq.kv_batch_put(keys=keys, partition_id="bench", fields=data)
            t1 = time.perf_counter()
            got = tq.kv_batch_get(keys=keys, partition_id="bench")
            t2 = time.perf_counter()
            tq.kv_clear(keys=keys, partition_id="bench")
            t3 = time.perf_counter()
            if cycle == 0:
                a, b = got["field_0"].unbind(0), data["field_0"].unbind(0)
                assert all(torch.equal(x, y) for x, y in zip(a, b)), "values came back different"
                continue
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(dt)
    finally:
        tq.close()
    out = {k: statistics.median(v) for k, v in times.items()}
    out["cycle"] = sum(out.values())
    return out


def bench_transferqueue(args) -> None:
    """TransferQueue put -> get -> clear cycles (kv_batch_put, kv_batch_get, kv_clear of one batch) through
    SimpleStorage in memory, SimpleStorage with SSD offload, and the DiskReplay backend (every put fsynced)."""
    import ray

    import diskreplay.integrations.transferqueue  # noqa: F401  (registers the DiskReplay backend)
    rows, fields, max_tokens = args.groups, 10, 8192
    data = _tq_fields(rows, fields, max_tokens)
    nbytes = sum(v.values().numel() * 4 for v in data.values())
    print(f"transferqueue: {rows} rows x {fields} jagged float32 fields, 1..{max_tokens} tokens "
          f"({_size(nbytes)} a batch); {args.rounds} put -> get -> clear cycles after a warm-up, medians; "
          "a local Ray cluster on 127.0.0.1")
    simple = {"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": 2}}
    ssd = {"storage_backend": "SimpleStorage", "SimpleStorage": {
        "num_data_storage_units": 2,
        # every value offloaded: the default 1 MiB threshold offloads none of these (a sample's field is
        # 4 B..32 KiB)
        "ssd_offload": {"enabled": True, "path": os.path.join(args.dir, "tq-ssd"), "threshold_bytes": 1}}}
    durable = {"storage_backend": "DiskReplay", "DiskReplay": {"path": os.path.join(args.dir, "tq-store")}}
    # logical CPUs: TransferQueue's controller and each storage unit are actors that each ask for one
    ray.init(_node_ip_address="127.0.0.1", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        res = {}
        for name, backend in (("memory", simple), ("ssd", ssd), ("diskreplay", durable)):
            res[name] = _tq_cycles({"controller": {"polling_mode": True}, "backend": backend}, data, args.rounds)
            print(f"  {name}: " + ", ".join(f"{k} {v:.3f} s" for k, v in res[name].items()), flush=True)
    finally:
        ray.shutdown()
    row("", "diskreplay", "SimpleStorage", "ratio (throughput)")
    for step in ("put", "get", "clear", "cycle"):
        d = res["diskreplay"][step]
        for base, label in (("memory", "in memory"), ("ssd", "SSD offload")):
            b = res[base][step]
            row(f"{step} s ({label})", f"{d:.3f}", f"{b:.3f}", f"{b / d:.2f}x")
    cycle = res["diskreplay"]["cycle"]
    print(f"  diskreplay cycle: {nbytes / cycle / 2**20:,.0f} MiB/s; "
          + target("cycle vs SimpleStorage in memory", res["memory"]["cycle"] / cycle, ">= 0.5") + "; "
          + target("cycle vs SimpleStorage SSD offload", res["ssd"]["cycle"] / cycle, ">= 1"))
    print("  (diskreplay: each put one fsynced commit, readable after a SIGKILL of any process; SimpleStorage: "
          "Ray actors' memory, or files written without fsync, gone with the job)")
    async_buffer = globals().get("bench_async_buffer")
    if async_buffer is not None:
        args.groups = 256
        async_buffer(args)


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def bench_update(args) -> None:
    """Values for committed rows (``ReplayStore.update``): what a 512-row update commit costs against
    an append of the same rows, what reading a 512-row batch costs when 10 % / 100 % of the store's
    rows carry patched values (and after ``compact`` folded them) against the same rows with no
    patches, and a patch's bytes against the values it holds. Reads alternate between the stores."""
    from diskreplay.synthetic import make_rollouts
    work, n_groups = args.dir, args.groups
    cols = ["rewards", "advantages", "ref_per_token_logps"]
    base = os.path.join(work, "base")
    batches = [make_rollouts(64, 8, seed=i, first_group=i * 64, policy_version=i) for i in range(n_groups // 64)]
    with ReplayStore(base) as store:
        for b in batches:
            store.extend(b)
        n = len(store)
        values = store.read(np.arange(n), cols)
    print(f"update: {n} rows ({n_groups} groups of 8, prompt + completion 64..1024 tokens); updates of 512 rows "
          f"writing {cols}; reads of 512 random rows through Collator (padded), {args.rounds * 10} batches per "
          "store, alternating")

    def chunk(rows):
        return {"rewards": values["rewards"][rows], "advantages": values["advantages"][rows],
                "ref_per_token_logps": [values["ref_per_token_logps"][int(r)] for r in rows]}

    rng = np.random.default_rng(0)
    stores = {"none": base}
    update_ms, append_ms, patch_bytes, value_bytes = [], [], [], []
    for name, share in (("10%", 0.1), ("100%", 1.0)):
        path = stores[name] = os.path.join(work, name)
        shutil.copytree(base, path)
        os.sync()  # the copy's dirty pages written back first: an fsync would otherwise wait for them
        picked = np.sort(rng.choice(n, int(n * share), replace=False))
        with ReplayStore(path) as store:
            for k in range(0, len(picked), 512):
                rows = picked[k:k + 512]
                data = chunk(rows)
                t = time.perf_counter()
                store.update(rows, data, token=f"bench:{k}")
                update_ms.append((time.perf_counter() - t) * 1e3)
                p = store.manifest.patches[-1]
                patch_bytes.append(p.bytes)
                value_bytes.append(8 * len(rows) + sum(v.nbytes for v in data["ref_per_token_logps"])
                                   + data["rewards"].nbytes + data["advantages"].nbytes)
    stores["100% compacted"] = os.path.join(work, "compacted")
    shutil.copytree(stores["100%"], stores["100% compacted"])
    with ReplayStore(stores["100% compacted"]) as store:
        store.compact()
    # the baseline commit: an append of 512 rows of the same workload (all columns)
    with ReplayStore(os.path.join(work, "append")) as store:
        for b in batches[:8]:
            t = time.perf_counter()
            store.extend(b)
            append_ms.append((time.perf_counter() - t) * 1e3)
    opened = {k: ReplayStore(v, readonly=True) for k, v in stores.items()}
    collator = Collator(pad_token_id=0)
    read_cols = ["completion_ids", *cols]
    draws = [np.sort(rng.choice(n, 512, replace=False)) for _ in range(args.rounds * 10)]
    times: Dict[str, List[float]] = {k: [] for k in opened}
    for k, st in opened.items():  # warm: pages, kernels, the patch index
        for rows in draws[:3]:
            collator.read(st, rows, columns=read_cols)
    for rows in draws:
        for k, st in opened.items():
            t = time.perf_counter()
            collator.read(st, rows, columns=read_cols)
            times[k].append((time.perf_counter() - t) * 1e3)
    for st in opened.values():
        st.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    row("", "value", "baseline", "ratio")
    row("update commit of 512 rows, ms (vs append)", f"{statistics.median(update_ms):.2f}",
        f"{statistics.median(append_ms):.2f}", f"{statistics.median(update_ms) / statistics.median(append_ms):.2f}x")
    for k, goal in (("10%", "<= 1.2"), ("100%", "<= 1.2"), ("100% compacted", "<= 1.05")):
        row(f"read 512 rows, {k} of rows patched, ms", f"{med[k]:.2f}", f"{med['none']:.2f}",
            target(f"update: read with {k} of rows patched vs none", med[k] / med["none"], goal))
    row("patch bytes vs the values it holds", f"{statistics.median(patch_bytes):,.0f}",
        f"{statistics.median(value_bytes):,.0f}", f"{statistics.median(patch_bytes) / statistics.median(value_bytes):.2f}x")
    print_targets()


def bench_routing(args) -> None:
    """Routed experts (MoE router replay): a ``[48 layers, top_k 8]`` tensor per completion token stored as a
    uint8 or int16 per-token tensor column (``PerTokenTensor``) against int32 stored as one does without them
    (a plain ragged int32 column of 384 values a token, batched by ``collate`` as int64 ``[B, C * 384]``).
    Bytes on disk of each store (a group key and the column; ``--groups`` groups of 8 (64 to 128), completions
    of 32..512 tokens) and the padded batch time of 512 random rows through ``Collator.read``, the stores
    alternating, medians of ``--rounds * 5`` batches."""
    from diskreplay import PerTokenTensor
    layers, top_k, B = 48, 8, 512
    n_groups = max(B // 8, min(args.groups, 128))  # at least one batch of rows
    rng = np.random.default_rng(0)
    lengths = rng.integers(32, 513, n_groups * 8)
    experts = [rng.integers(0, 256, (int(n), layers, top_k)) for n in lengths]
    keys = np.repeat(np.arange(n_groups), 8)
    kinds = {"uint8": lambda rows: PerTokenTensor(rows, "uint8", fill=255),
             "int16": lambda rows: PerTokenTensor(rows, "int16", fill=-1),
             "int32": lambda rows: [r.astype(np.int32).reshape(-1) for r in rows]}
    stores, disk = {}, {}
    for kind, make in kinds.items():
        path = os.path.join(args.dir, f"routing-{kind}")
        with ReplayStore(path) as store:
            for k in range(0, len(lengths), 256):
                # the routing column alone beside the group key: the stores differ in nothing else
                store.extend({"prompt_id": keys[k:k + 256], "routed_experts": make(experts[k:k + 256])})
        disk[kind] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        stores[kind] = ReplayStore(path, readonly=True)
    tokens = int(lengths.sum())
    print(f"routing: {len(lengths)} rows, {tokens:,} completion tokens, [{layers}, {top_k}] experts a token; "
          f"padded batches of {B} random rows through Collator.read, {args.rounds * 5} per store, alternating")
    collators = {k: Collator(pad_token_id=0) for k in stores}
    draws = [np.sort(rng.choice(len(lengths), B, replace=False)) for _ in range(args.rounds * 5)]
    times: Dict[str, List[float]] = {k: [] for k in stores}
    shapes = {}
    for k, st in stores.items():  # warm: pages, buffers
        shapes[k] = tuple(collators[k].read(st, draws[0])["routed_experts"].shape)
    for rows in draws:
        for k, st in stores.items():
            t = time.perf_counter()
            batch = collators[k].read(st, rows)
            times[k].append((time.perf_counter() - t) * 1e3)
            assert batch["routed_experts"].numel() > 0
    for st in stores.values():
        st.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    row("", "value", "int32 (flat)", "ratio")
    for k in ("uint8", "int16"):
        row(f"bytes on disk, {k} per-token tensor", _size(disk[k]), _size(disk["int32"]),
            f"{disk[k] / disk['int32']:.2f}x")
    for k in ("uint8", "int16"):
        row(f"padded batch of {B}, {k} {list(shapes[k][1:])}, ms", f"{med[k]:.1f}", f"{med['int32']:.1f}",
            f"{med[k] / med['int32']:.2f}x")
    print(f"  (int32 batches are int64 {list(shapes['int32'][1:])}: a ragged int column as collate gives it)")


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bench_media(args) -> None:
    """Media columns: ``--groups`` prompt groups of 8 samples sharing one ``--image-kib`` image per group,
    stored as a media column (``diskreplay.Media``: one blob per content) against the same bytes stored in
    every row (a ragged int32 column of the image's bytes, 4 to a value: what a store without media
    columns holds). Bytes on disk against one copy per group, and the time of a batch of 8 random groups
    (64 rows): the media store's hashes alone, its hashes and each row's blob served zero-copy
    (``MediaReader.batch``, a ``memoryview`` of the mapped blob, one per distinct image), the per-row store's
    bytes (copied into the batch); medians of ``--rounds * 5`` batches, the stores alternating."""
    from diskreplay import Media, MediaReader
    size = args.image_kib << 10
    groups, per, commit_groups = args.groups, 8, 16
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, size, dtype=np.uint8)

    def image(g: int) -> bytes:  # a distinct image per group (its first 8 bytes say which)
        a = base.copy()
        a[:8] = np.frombuffer(np.int64(g).tobytes(), np.uint8)
        return a.tobytes()

    paths = {k: os.path.join(args.dir, f"media-{k}") for k in ("media", "rows")}
    commit_s = {}
    for kind, path in paths.items():
        t = time.perf_counter()
        with ReplayStore(path) as store:
            for g0 in range(0, groups, commit_groups):
                gs = range(g0, min(groups, g0 + commit_groups))
                keys = np.repeat(np.array(list(gs)), per)
                imgs = [image(g) for g in gs]
                rows = [imgs[i // per] for i in range(len(keys))]
                col = (Media(rows, mime="image/png") if kind == "media"
                       else [np.frombuffer(r, dtype=np.int32) for r in rows])
                # the image column alone beside the group key: the stores differ in nothing else
                store.extend({"prompt_id": keys, "image": col})
        commit_s[kind] = time.perf_counter() - t
    disk = {k: _tree_bytes(p) for k, p in paths.items()}
    one_copy = groups * size
    print(f"media: {groups} groups x {per} samples sharing one {args.image_kib} KiB image per group "
          f"({_size(one_copy)} of images, one copy each); commits of {commit_groups} groups")
    row("", "value", "baseline", "ratio")
    row("bytes on disk, media column", _size(disk["media"]), f"{_size(one_copy)} (one copy per group)",
        f"{disk['media'] / one_copy:.3f}x (target <= 1.05x)")
    row("bytes on disk, bytes in every row", _size(disk["rows"]), f"{_size(one_copy)} (one copy per group)",
        f"{disk['rows'] / one_copy:.3f}x")
    row("append time, media / in-row, s", f"{commit_s['media']:.1f}", f"{commit_s['rows']:.1f}",
        f"{commit_s['media'] / commit_s['rows']:.2f}x")
    stores = {k: ReplayStore(p, readonly=True) for k, p in paths.items()}
    reader = MediaReader(stores["media"])
    draws = [np.sort((rng.choice(groups, 8, replace=False)[:, None] * per + np.arange(per)).reshape(-1))
             for _ in range(args.rounds * 5)]

    def refs(rows):
        return stores["media"].read(rows, ["image"])["image"]

    def served(rows):
        views = reader.batch(stores["media"].read(rows, ["image"])["image"])
        return sum({id(v): v.nbytes for v in views}.values())  # the distinct blobs' mapped bytes

    def in_row(rows):
        return stores["rows"].read(rows, ["image"])["image"].values.nbytes

    fns = {"refs": refs, "served": served, "in-row": in_row}
    held = {k: f(draws[0]) for k, f in fns.items() if k != "refs"}  # (and warm: pages, buffers)
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for rows in draws:
        for k, f in fns.items():
            t = time.perf_counter()
            f(rows)
            times[k].append((time.perf_counter() - t) * 1e3)
    for st in stores.values():
        st.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    row("batch of 64 rows (8 groups), hashes only, ms", f"{med['refs']:.3f}", f"{med['in-row']:.2f} (bytes in rows)",
        f"{med['refs'] / med['in-row']:.4f}x")
    row("batch of 64 rows, hashes + blobs served, ms", f"{med['served']:.3f}", f"{med['in-row']:.2f} (bytes in rows)",
        f"{med['served'] / med['in-row']:.4f}x")
    # what a batch keeps in memory: the media store's blobs are pages of the mapped files (shared with the
    # page cache, one per distinct image); the in-row store's bytes are copied into the batch, one per row
    row("memory a batch holds, media (mapped blobs)", _size(held["served"]), f"{_size(held['in-row'])} (copied)",
        f"{held['served'] / held['in-row']:.3f}x")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("what", choices=["store", "sample", "export", "priorities", "writers", "remote",
                                      "commit-cpu", "stream", "async-buffer", "transferqueue", "update", "routing",
                                      "media"])
    p.add_argument("--groups", type=int, default=None, help="prompt groups of 8 rows in the workload "
                   "(default 4096; writers: per writer, and remote: default 1024)")
    p.add_argument("--commits", type=int, default=None,
                   help="writers: small commits per writer (default 100); commit-cpu: commits timed (default 300)")
    p.add_argument("--rounds", type=int, default=3, help="writers: alternating rounds (medians are reported); "
                   "sample --only restart: processes per path")
    p.add_argument("--big", type=int, default=10, help="size factor of the large store (1: skip it)")
    p.add_argument("--dir", help="work directory, kept (default: a new temporary one, removed at the end); "
                   "big stores are reused")
    p.add_argument("--quick", action="store_true",
                   help="sample: only the warm batch table (skip the per-strategy, cold and memory sections)")
    p.add_argument("--only", choices=["cold", "restart", "ids"],
                   help="sample: only this block (cold: reopen + first batch with the page cache dropped; "
                   "restart: a new process's first batch, warm page cache, vs its steady batches (--rounds "
                   "processes per path); ids: int32 token ids vs the ideal int32 gather, and the bytes saved)")
    p.add_argument("--small-commits", type=int, default=3000,
                   help="store: commits of 8 rows for the small-commit comparison (0: skip it)")
    p.add_argument("--sizes", default="32768,1000000,10000000",
                   help="priorities: live-row counts to measure, comma separated")
    p.add_argument("--profile", action="store_true", help="commit-cpu: cProfile tables of commits and open")
    p.add_argument("--image-kib", type=int, default=1024, help="media: the size of a group's image, KiB")
    p.add_argument("--steps", type=int, default=41, help="priorities: timed steps per size")
    args = p.parse_args(argv)
    if args.groups is None:
        args.groups = 1024 if args.what in ("writers", "remote", "stream", "transferqueue", "update") else 256 if args.what == "async-buffer" else 4096
    if args.commits is None:
        args.commits = 300 if args.what == "commit-cpu" else 100
    run = {"store": bench_store, "export": bench_export, "sample": bench_sample,
           "priorities": bench_priorities, "writers": bench_writers, "remote": bench_remote,
           "commit-cpu": bench_commit_cpu, "stream": bench_stream, "async-buffer": bench_async_buffer,
           "transferqueue": bench_transferqueue, "update": bench_update, "routing": bench_routing,
           "media": bench_media}[args.what]
    if args.dir:
        run(args)
        return
    # a temporary work directory goes when the run ends (a `sample` run writes ~5 GB)
    with tempfile.TemporaryDirectory(prefix=f"diskreplay-bench-{args.what}-") as work:
        args.dir = work
        run(args)


if __name__ == "__main__":
    main()
