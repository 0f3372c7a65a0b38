"""Syscall-level fault sweep of a writer: every store syscall made to fail, in turn.

A child Python process opens an existing store as its writer and does 20
appends (with FIFO eviction, garbage collection of old manifests and evicted
segments, a merge of small segments) and two ``save_state`` calls. It runs
under ``strace``, which makes exactly one invocation of one syscall fail:

* ``SIGKILL``: the process is killed on entry to that syscall (a crash there);
* ``EIO``, ``ENOSPC``, ``EDQUOT``: the syscall is not executed and returns that
  error (``strace -e inject=SYSCALL:error=E:when=N``); strace also sends the
  child SIGUSR1, so the child knows a fault happened even when the store
  swallowed it, stops its workload after the call in progress, and then opens
  the store as a writer again in the same process (a leaked lock shows here)
  and appends once more.

A baseline run without faults lists the invocations that touch the store
(``strace -y`` names each descriptor's file); each is one case. After each
faulted run a fresh process checks the invariants of docs/FORMAT.md
"Guarantees" (the names in the table):

``open-ro`` / ``open-rw``   the store opens read-only and as a writer
``acked``                   every acknowledged append (the child prints each
                            returned row range, one ``write()`` per line) is
                            present and bit-exact, unless evicted by capacity
``partial``                 the rows end at an append boundary: no part of an
                            append is visible; every live row is bit-exact
``state``                   the newest acknowledged saved state (or the one in
                            flight) loads intact
``verify``                  ``verify_store`` reports no problems
``lock``                    after an error the child could open the store as
                            a writer again in the same process
``deleted``                 no file was deleted that the child had failed to
                            read (before a newer commit made it garbage), and
                            the newest ``KEEP_MANIFESTS`` manifests all exist
``error``                   an error that reached the caller is an ``OSError``
                            (or a ``DiskReplayError``), not something else

Two more columns count what a caller sees, without failing a case:
``raised-committed`` (an append raised, yet its rows are committed: a retry
would append them twice) and ``unnamed-error`` (a bare
``OSError`` that names no file reached the caller).

A case whose injection did not hit the syscall the baseline saw there (the run
diverged: rare, and run again up to twice) is counted as ``missed``, not as
survived.

``--power-loss`` also checks the order of the baseline's creations and deletions against the
usual power-loss model (an unlink is durable only after an fsync of its
directory, and may become durable any time before): no data file may be
unlinked while the unlink of a manifest that may name it is not yet durable,
every unlink must be made durable by a directory fsync before the next
commit, and so must every new name of a data file (a creation, a link) made
before a commit point (a name reserved ahead, made durable when it is
reserved, passes; one a commit named without its directory's fsync would not).

Examples::

    python tools/faults.py                          # the full sweep (about 2,000 runs)
    python tools/faults.py --syscalls flock,ftruncate --faults EIO
    python tools/faults.py --sample 40 --seed 1 --jobs 2 --power-loss
    python tools/faults.py --case openat:EIO:7 --keep /tmp/case   # one case, store kept
    python tools/faults.py --multi-writer --sample 100            # a multi-writer store, lost races

Needs ``strace`` (``apt-get install strace``) and permission to ptrace.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import json
import functools
import gc
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# strace counts an injection's when=N per thread; the store fsyncs a commit's files from a few
# threads at once, so the traced child does all its I/O on its one thread (same syscalls, in order)
os.environ["DISKREPLAY_SERIAL_IO"] = "1"
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from diskreplay import ReplayStore  # noqa: E402
from diskreplay import format as fmt  # noqa: E402
from diskreplay.testing.workload import expected_rows, rows_mismatch  # noqa: E402
from diskreplay.verify import verify_store  # noqa: E402
from diskreplay.cli.parser import number  # noqa: E402

_count = number(int, 1, "a positive integer")

SYSCALL_GROUPS = {
    "write": ("write",),
    "fsync": ("fsync", "fdatasync"),
    "rename": ("rename", "renameat", "renameat2"),
    "link": ("link", "linkat"),
    "unlink": ("unlink", "unlinkat"),
    "openat": ("openat", "open"),
    "close": ("close",),
    "ftruncate": ("ftruncate",),
    "flock": ("flock",),
    "read": ("read", "pread64"),
}
DEFAULT_GROUPS = ("write", "fsync", "rename", "link", "unlink", "openat", "close", "ftruncate", "flock")
FAULTS = ("SIGKILL", "EIO", "ENOSPC", "EDQUOT")
INVARIANTS = ("open-ro", "open-rw", "acked", "partial", "state", "verify", "lock", "deleted", "error")
INFO = ("raised-committed", "unnamed-error")  # counted in the table, not failures
# fd-first syscalls name their file through strace -y's "<path>" annotation
_FD_SYSCALLS = {"write", "fsync", "fdatasync", "close", "ftruncate", "flock", "read", "pread64"}

CAPACITY = 600  # rows; the template holds 596, so the child's appends evict from the first one on
APPENDS = 20


# --------------------------------------------------------------------------- row content
# A row's content is a function of its id, so any row the store serves can be checked.


def state_for(k: int) -> dict:
    """The ``k``-th sampler state the child saves."""
    return {"k": k, "weights": np.arange(k + 3, dtype=np.float32) * np.float32(0.5), "rng": [k, k + 1]}


def batch_size(b: int) -> int:
    """Rows in the ``b``-th append of the child."""
    return 3 + b % 4


# --------------------------------------------------------------------------- the store and the child

TEMPLATE_APPENDS = [4, 4, 4, 4, 580]  # small segments that get evicted, then one that holds the head


def make_template(path: str, multi_writer: bool = False) -> None:
    """The store every case starts from: 596 rows in 5 segments, a saved state, 4 retained manifests.

    ``multi_writer``: a multi-writer store whose files are all made two hours old (past its
    ``retain_seconds``), so that the child's clean-up (the sweep at its open) deletes the superseded
    manifests and evicted segments, as a single writer's does, and the same ones in every run (the
    child's own files are young: kept).
    """
    kw = {"multi_writer": True, "retain_seconds": 3600} if multi_writer else {}
    with ReplayStore(path, capacity=CAPACITY, **kw) as store:
        for n in TEMPLATE_APPENDS:
            first = store.next_row
            store.extend(expected_rows(np.arange(first, first + n)))
        store.save_state("sampler", state_for(0))
    if multi_writer:
        old = time.time() - 7200
        for d, _, names in os.walk(path):
            for name in names:
                os.utime(os.path.join(d, name), (old, old))


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write() per line: a line is there or it is not


def _describe(exc: BaseException) -> str:
    return (f"{type(exc).__name__} errno={getattr(exc, 'errno', None)} "
            f"names-file={getattr(exc, 'filename', None) is not None} {str(exc)[:160]!r}")


def _append(store: ReplayStore) -> None:
    first = store.next_row
    n = batch_size(first)
    _say(f"begin {first} {n}")
    rows = store.extend(expected_rows(np.arange(first, first + n)))
    assert rows.tolist() == list(range(first, first + n)), rows
    _say(f"rows {first} {n}")


UPDATE_AT = (4, 14)  # after these appends the child writes values for its newest rows (``update``)
UPDATE_ROWS = 6


def update_values(rows: np.ndarray, k: int) -> np.ndarray:
    """The ``score`` the ``k``-th update of the child writes for ``rows``."""
    return np.asarray(rows, dtype=np.float64) * 10 + k


def _update(store: ReplayStore, k: int) -> None:
    rows = np.arange(store.next_row - UPDATE_ROWS, store.next_row)
    _say(f"begin-update {k} {int(rows[0])}")
    store.update(rows, {"score": update_values(rows, k)}, token=f"update:{k}")
    _say(f"updated {k} {int(rows[0])}")


def workload(path: str) -> None:
    """What the traced child does: open as writer, 20 appends, two updates of committed rows, two
    saved states; then, after a fault or at the end, a writer open in the same process and one
    more append.

    strace sends SIGUSR1 with an injected error, so the child stops after the call in
    progress even when the store swallowed the error (a clean-up failure only warns).
    """
    from diskreplay.errors import DiskReplayError

    faulted: List[int] = []
    signal.signal(signal.SIGUSR1, lambda *a: faulted.append(1))
    warnings.simplefilter("ignore")
    multi = MULTI_WRITER

    def run() -> None:
        store = ReplayStore(path, capacity=CAPACITY)
        _say("open")
        race = _arrange_races(store, path) if multi else []
        try:
            for b in range(APPENDS):
                if faulted:
                    return
                if multi and b % RACE_EVERY == RACE_EVERY - 1:
                    race.append(b)  # this append loses a race to another writer and retries
                _append(store)
                if b in UPDATE_AT and not faulted:
                    _update(store, UPDATE_AT.index(b) + 1)
                if b == 9 and not faulted:
                    _say("begin-state 1")
                    store.save_state("sampler", state_for(1))
                    _say("state 1")
            if faulted:
                return
            _say("begin-state 2")
            store.save_state("sampler", state_for(2))
            _say("state 2")
        finally:
            store.close()
        _say("closed")

    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported, and judged by the checker
        _say(("error " if isinstance(exc, (OSError, DiskReplayError)) else "error-unexpected ") + _describe(exc))
    _say(f"fault {len(faulted)}")
    # Writer opens in the same process after the fault (a leaked lock fails them): an attempt
    # that meets the fault itself (injected into this phase) is followed by another one.
    for attempt in range(3):
        _say(f"reopen {attempt + 1}")
        try:
            store = ReplayStore(path, capacity=CAPACITY)
        except Exception as exc:  # noqa: BLE001
            _say("reopen-failed " + _describe(exc))
            continue
        failed = False
        try:
            _append(store)
        except Exception as exc:  # noqa: BLE001
            failed = True
            _say("error " + _describe(exc))
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001
            failed = True
            _say("error " + _describe(exc))
        if not failed:
            _say("writer ok")
            break
    _say("done")


RACE_EVERY = 4  # multi-writer child: every 4th append loses a race
MULTI_WRITER = False  # --multi-writer (set before the template is made; forked children inherit it)


def _arrange_races(store: ReplayStore, path: str) -> List[int]:
    """Multi-writer child: a second writer (another store object in this process, with its own
    writer id) commits between the append's read of the newest manifest and its create-if-absent
    whenever the returned list is non-empty, so that append loses the race, re-reads and retries.
    The rival saves a state (rows stay where the content checks expect them)."""
    rival = ReplayStore(path)
    storage = store._committer.storage
    real_link = storage.link_new
    race: List[int] = []

    def link(src, rel):
        if race and rel.startswith(fmt.MANIFEST_DIR + "/"):
            b = race.pop()
            rival.save_state("rival", state_for(100 + b))
        return real_link(src, rel)

    storage.link_new = link
    return race


def warm_up(workdir: str, multi_writer: bool = False) -> None:
    """Import lazily loaded modules before tracing starts, so the traced calls are the store's own."""
    scratch = os.path.join(workdir, "warm-up")
    with ReplayStore(scratch, capacity=8, multi_writer=multi_writer) as store:
        for k in range(3):
            store.extend(expected_rows(np.arange(4 * k, 4 * k + 4)))
        store.save_state("s", state_for(0))
        store.read(store.row_ids())
        store.compact()
    with ReplayStore(scratch, readonly=True) as ro:
        ro.load_state("s")
    shutil.rmtree(scratch)


# --------------------------------------------------------------------------- strace


TRACING = 999999999  # what getppid returns once strace traces the child (no pid is that large)


def traced_names() -> List[str]:
    return sorted({n for names in SYSCALL_GROUPS.values() for n in names})


def strace_cmd(log: str, inject: Optional[str], pid: int) -> List[str]:
    # no --seccomp-bpf: with it, strace 6.1 does not deliver an injection's signal=
    cmd = ["strace", "-f", "-qq", "-y", "-s", "48", "-e", "signal=none", "-o", log,
           "-e", "trace=" + ",".join(traced_names() + ["getppid"]),
           "-e", f"inject=getppid:retval={TRACING}:when=1"]
    if inject:
        cmd += ["-e", "inject=" + inject]
    return cmd + ["-p", str(pid)]


def _traced(pid: int) -> bool:
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/status") as f:
                if not re.search(r"^TracerPid:\s*[1-9]", f.read(), re.M):
                    return False
    except OSError:
        return False
    return True


def run_traced(workdir: str, action, inject: Optional[str], timeout: float = 120) -> Tuple[int, str, str, str]:
    """Fork a child that runs ``action()`` under strace; ``(exit code, stdout, stderr, strace log)``.

    The child is forked from this process, whose imports are done, and strace
    attaches to it before it starts: startup costs nothing and the occurrence
    numbers of ``when=`` count the child's calls from the start of ``action``.
    """
    log = os.path.join(workdir, "strace.log")
    out_path, err_path = os.path.join(workdir, "child.out"), os.path.join(workdir, "child.err")
    go_r, go_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child
        code = 70
        try:
            os.close(go_w)
            for fd, p in ((1, out_path), (2, err_path)):
                f = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            if os.read(go_r, 1) == b"g":
                os.close(go_r)
                # strace is attached, but may not trace yet: wait for its answer to getppid,
                # so that its when= counts start at the first call of action()
                deadline = time.monotonic() + 60
                while os.getppid() != TRACING and time.monotonic() < deadline:
                    time.sleep(0.0005)
                # A full collection resets the collector's counters (inherited from whatever
                # this process did before, and moved by the wait above): without it, a cycle
                # holding a descriptor would be closed at a different call in each run.
                gc.collect()
                action()
                code = 0
        except BaseException:  # noqa: BLE001 - the child must never return into the parent's code
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(go_r)
    tracer = subprocess.Popen(strace_cmd(log, inject, pid), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not _traced(pid) and tracer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    attached = _traced(pid)
    os.write(go_w, b"g" if attached else b"x")
    os.close(go_w)
    try:
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        rc = os.waitstatus_to_exitcode(status)
    finally:
        if tracer.poll() is None and not attached:
            tracer.kill()
        trace_err = tracer.communicate(timeout=60)[1].decode(errors="replace")
    if not attached:
        raise RuntimeError(f"strace could not attach to the child: {trace_err.strip() or 'no reason given'}")
    with open(out_path, errors="replace") as f:
        text = f.read()
    with open(err_path, errors="replace") as f:
        err_text = f.read()
    return rc, text[: text.rfind("\n") + 1], err_text, log


def _probe_action() -> None:
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)
    except OSError as exc:
        os._exit(0 if exc.errno == errno.EIO else 8)
    os._exit(7)


def strace_problem() -> Optional[str]:
    """Why strace fault injection cannot run here, or None when it can."""
    if shutil.which("strace") is None:
        return "strace is not installed (apt-get install strace)"
    workdir = tempfile.mkdtemp(prefix="diskreplay-strace-probe-")
    try:
        rc, _, err, _ = run_traced(workdir, _probe_action, "ftruncate:error=EIO:when=1", timeout=60)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"strace cannot attach here (ptrace not permitted?): {exc}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if rc != 0:
        return f"strace attached but did not inject a fault (child exit {rc}): {err.strip()[-200:]}"
    return None


_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. )?([a-z0-9_]+)(\(| resumed>)(.*)$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"\d+<([^>]*)>")
_TMPFILE = re.compile(r"/#\d+$")
# a temporary name ends in .<writer id>.<pid>.<n> (a store's files) or .<pid> (a state's staging file);
# the writer id is the pid, or in a multi-writer store random bits-host-pid; each differs from run to run
_TMP_PID = re.compile(r"(\.tmp-[^/]*?)(?:\.(?:[0-9a-f]{16}-[^/.]*-)?\d+\.\d+\.\d+|\.\d+)$")


@dataclasses.dataclass
class Call:
    """One syscall invocation of the child's main thread, as strace logged it."""
    pid: int
    name: str
    occurrence: int  # 1-based, per syscall name and thread: what strace's when= counts
    paths: Tuple[str, ...]
    args: str
    result: str
    injected: bool
    step: str  # the child's last line before this call


def parse_log(log_path: str) -> Tuple[List[Call], Optional[int]]:
    """The main thread's calls in order (its pid is the first one logged)."""
    calls: List[Call] = []
    counts: Dict[Tuple[int, str], int] = collections.Counter()
    main = None
    step = "start"
    with open(log_path, errors="replace") as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if not m:
                continue
            pid, name, kind, rest = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            if main is None:
                main = pid
            if kind != "(":
                # "<... write resumed>": the result of a call logged (and counted) as unfinished
                if pid == main and calls and calls[-1].name == name and not calls[-1].result:
                    calls[-1].result = rest.rsplit("= ", 1)[-1] if "= " in rest else ""
                    calls[-1].injected = "(INJECTED)" in rest
                continue
            counts[(pid, name)] += 1
            if pid != main:
                continue
            args, _, result = rest.rpartition(") = ") if ") = " in rest else (rest, "", "")
            if name in _FD_SYSCALLS:
                fd = _FD_PATH.match(args)
                paths = (fd.group(1),) if fd else ()
            else:
                paths = tuple(_QUOTED.findall(args))
            if name == "write" and args.startswith("1<"):
                text = _QUOTED.search(args)
                if text:
                    step = text.group(1).replace("\\n", "").strip()
            calls.append(Call(pid, name, counts[(pid, name)], paths, args, result, "(INJECTED)" in rest, step))
    return calls, main


def normalize(path: str) -> str:
    # an unnamed O_TMPFILE file shows as DIR/#INODE: the inode number differs from run to run
    return _TMP_PID.sub(r"\1.PID", _TMPFILE.sub("/#TMPFILE", path.replace(" (deleted)", "")))


def in_store(call: Call, store: str) -> bool:
    return any(p == store or p.startswith(store + "/") for p in call.paths)


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    syscall: str
    fault: str
    occurrence: int
    target: str  # the file (relative to the store) the baseline's call touched
    step: str  # what the child was doing

    @property
    def label(self) -> str:
        return f"{self.syscall}:{self.fault}:{self.occurrence}"

    def inject(self) -> str:
        what = "signal=SIGKILL" if self.fault == "SIGKILL" else f"error={self.fault}:signal=SIGUSR1"
        return f"{self.syscall}:{what}:when={self.occurrence}"


def baseline(workdir: str, template: str, groups: Sequence[str]) -> Tuple[List[Case], List[Call], str]:
    """Cases for every store call of the chosen syscalls in an unfaulted run, and the run's calls."""
    store = os.path.join(workdir, "store")
    shutil.copytree(template, store)
    rc, out, err, log = run_traced(workdir, functools.partial(workload, store), None)
    if rc != 0 or not out.rstrip().endswith("done") or "error" in out:
        raise RuntimeError(f"the unfaulted child failed (exit {rc}):\n{out}\n{err}")
    calls, _ = parse_log(log)
    names = {n for g in groups for n in SYSCALL_GROUPS[g]}
    sites = [c for c in calls if c.name in names and in_store(c, store)]
    cases = [Case(c.name, fault, c.occurrence, os.path.relpath(normalize(c.paths[0]), store)
                  if c.paths[0].startswith(store) else os.path.relpath(normalize(c.paths[-1]), store), c.step)
             for c in sites for fault in FAULTS]
    return cases, calls, store


# --------------------------------------------------------------------------- invariants


def _parse_updates(out: str) -> Tuple[Dict[int, int], Dict[int, int]]:
    """``({k: first row} of the updates begun, of those acknowledged)``."""
    begun, acked = {}, {}
    for line in out.splitlines():
        p = line.split()
        if p[:1] == ["begin-update"]:
            begun[int(p[1])] = int(p[2])
        elif p[:1] == ["updated"]:
            acked[int(p[1])] = int(p[2])
    return begun, acked


def updates_mismatch(store: ReplayStore, out: str) -> Optional[Tuple[str, str]]:
    """``(invariant, what)`` when the ``score`` values the store serves break the rules: an
    acknowledged update is there for its live rows, an update in flight wholly or not at all, and
    no other row has a value."""
    begun, acked = _parse_updates(out)
    live = store.row_ids()
    if "score" not in store.columns:
        return ("acked", f"update(s) {sorted(acked)} acknowledged, but the store has no score column") if acked \
            else None
    got = store.read(live, ["score"])["score"]
    expect_set = np.zeros(len(live), dtype=bool)
    for k, first in begun.items():
        rows = np.arange(first, first + UPDATE_ROWS)
        at = np.searchsorted(live, rows)
        inside = (at < len(live)) & (live[np.minimum(at, len(live) - 1)] == rows)
        vals = got[at[inside]]
        want = update_values(rows[inside], k)
        present = vals == want
        if k in acked and not present.all():
            return "acked", f"update {k} acknowledged, rows {rows[inside][~present].tolist()} read {vals[~present]}"
        if present.any() and not present.all():
            return "partial", f"update {k} is visible for rows {rows[inside][present].tolist()} only"
        expect_set[at[inside]] = present
    stray = ~np.isnan(got) & ~expect_set
    if stray.any():
        return "partial", f"rows {live[stray][:5].tolist()} hold a score no update wrote"
    return None


def _parse_child(out: str):
    begun, acked, states_begun, states = [], [], [], []
    for line in out.splitlines():
        p = line.split()
        if not p:
            continue
        if p[0] == "begin":
            begun.append((int(p[1]), int(p[2])))
        elif p[0] == "rows":
            acked.append((int(p[1]), int(p[2])))
        elif p[0] == "begin-state":
            states_begun.append(int(p[1]))
        elif p[0] == "state":
            states.append(int(p[1]))
    return begun, acked, states_begun, states


def _read_failed(call: Call, opened: Dict[int, str]) -> bool:
    """Whether the injected call was part of reading a file (as opposed to writing one)."""
    if call.name in ("openat", "open"):
        return not re.search(r"O_WRONLY|O_RDWR|O_CREAT", call.args) and "O_DIRECTORY" not in call.args
    if call.name in ("read", "pread64"):
        return True
    if call.name == "close":
        fd = re.match(r"(\d+)<", call.args)
        return bool(fd) and opened.get(int(fd.group(1))) == "r"
    return False


def _deleted_after_failed_read(calls: List[Call], store: str) -> Optional[str]:
    opened: Dict[int, str] = {}
    for i, c in enumerate(calls):
        if c.name in ("openat", "open") and c.result[:1].isdigit():
            fd = int(re.match(r"\d+", c.result).group(0))
            opened[fd] = "w" if re.search(r"O_WRONLY|O_RDWR|O_CREAT", c.args) else "r"
        if not c.injected or c.name not in ("openat", "open", "close", "read", "pread64"):
            continue
        if not _read_failed(c, opened) or not c.paths:
            return None
        target = normalize(c.paths[-1] if c.name in ("openat", "open") else c.paths[0])
        if not target.startswith(store + "/") or "/.tmp-" in target:
            return None
        for later in calls[i + 1:]:
            if later.name in ("rename", "renameat", "renameat2", "link", "linkat") and any(
                    p.startswith(os.path.join(store, fmt.MANIFEST_DIR) + "/") and "/.tmp-" not in p
                    for p in later.paths[1:]):
                return None  # a newer commit: from here on a deletion may be legitimate GC
            if later.name in ("unlink", "unlinkat") and target in map(normalize, later.paths):
                return f"{os.path.relpath(target, store)} was deleted after reading it failed"
        return None
    return None


def check(case: Optional[Case], store: str, rc: int, out: str, err: str, log: str) -> Dict[str, object]:
    """The invariants after one run, checked in this (fresh) process."""
    broken: Dict[str, str] = {}
    calls, _ = parse_log(log) if os.path.exists(log) else ([], None)
    injected = [c for c in calls if c.injected]
    begun, acked, states_begun, states = _parse_child(out)
    lines = out.splitlines()
    status, missed_note = "ok", ""
    if case is not None:
        if case.fault == "SIGKILL":
            hit = rc in (-signal.SIGKILL, 128 + signal.SIGKILL)
            if hit:
                last = calls[-1] if calls else None
                hit = bool(last and last.name == case.syscall and last.occurrence == case.occurrence)
        else:
            hit = any(c.name == case.syscall and c.occurrence == case.occurrence for c in injected)
        if hit and calls:
            c = next((c for c in calls if c.name == case.syscall and c.occurrence == case.occurrence), None)
            if c is None or not c.paths or case.target not in (
                    os.path.relpath(normalize(p), store) for p in c.paths):
                hit = False
        if not hit:
            status = "missed"
            got = [f"{c.name}:{c.occurrence} {normalize(c.paths[0]) if c.paths else ''} [{c.step}]"
                   for c in injected] or ["nothing"]
            missed_note = "injected into " + ", ".join(got)
    if case is None or case.fault != "SIGKILL":
        if "done" not in lines:
            broken["error"] = f"the child died (exit {rc}): {err.strip().splitlines()[-1:] or ''}"
        for line in lines:
            if line.startswith("error-unexpected"):
                broken["error"] = line
        if "writer ok" not in lines:
            broken["lock"] = next((line for line in reversed(lines) if line.startswith(("reopen-failed", "error"))),
                                  "no writer open succeeded after the fault")
    bad = _deleted_after_failed_read(calls, store)
    if bad:
        broken["deleted"] = bad
    # the store, read-only
    next_row = None
    try:
        with ReplayStore(store, readonly=True) as ro:
            live = ro.row_ids()
            head, next_row = ro.head, ro.next_row
            ends = {first + n for first, n in begun} | {sum(TEMPLATE_APPENDS)}
            if next_row not in ends:
                broken["partial"] = f"next_row {next_row} is not an append boundary {sorted(ends)[-4:]}"
            for first, n in acked:
                if first + n > next_row:
                    broken["acked"] = f"acknowledged rows [{first}, {first + n}) missing: next_row {next_row}"
            if head != max(0, next_row - CAPACITY):
                broken["partial"] = f"head {head} but capacity puts it at {max(0, next_row - CAPACITY)}"
            bad = rows_mismatch(ro.read(live), live)
            if bad:
                broken["acked" if any(f < next_row for f, _ in acked) else "partial"] = bad
            bad_update = updates_mismatch(ro, out)
            if bad_update:
                broken.setdefault(*bad_update)
            got = ro.load_state("sampler")
            allowed = {max(states, default=0)} | {k for k in states_begun if k not in states}
            if got is None or got.get("k") not in allowed or np.asarray(got["weights"]).tobytes() != \
                    state_for(got["k"])["weights"].tobytes():
                broken["state"] = f"saved state {None if got is None else got.get('k')}, expected one of {allowed}"
            generation = ro.generation
    except Exception as exc:  # noqa: BLE001 - any failure to open or read is the finding
        broken["open-ro"] = f"{type(exc).__name__}: {exc}"
        generation = None
    if generation is not None:
        present = set(fmt.list_generations(store))
        missing = [g for g in range(max(1, generation - fmt.KEEP_MANIFESTS + 1), generation + 1) if g not in present]
        if missing:
            broken.setdefault("deleted", f"retained manifest(s) {missing} of generation {generation} are gone")
    report = verify_store(store)
    if not report["ok"]:
        broken["verify"] = "; ".join(report["problems"])[:300]
    try:
        with ReplayStore(store, capacity=CAPACITY) as rw:
            bad = rows_mismatch(rw.read(rw.row_ids()), rw.row_ids())
            if bad:
                broken["open-rw"] = f"after a writer open: {bad}"
    except Exception as exc:  # noqa: BLE001
        broken["open-rw"] = f"{type(exc).__name__}: {exc}"
    errors = [line for line in lines if line.startswith(("error", "reopen-failed"))]
    # not invariants, but what a caller sees: an error for an append that was committed (a
    # retry would append it twice), a bare OSError that names no file
    info = []
    if case is not None and case.fault != "SIGKILL" and generation is not None:
        if any((f, n) not in acked and f + n <= next_row for f, n in begun):
            info.append("raised-committed")
    if any(line.split()[1:2] == ["OSError"] and "names-file=False" in line for line in errors):
        info.append("unnamed-error")
    note = missed_note
    if case is not None and case.syscall == "close" and case.fault != "SIGKILL" and case.target == fmt.LOCK_FILE \
            and set(broken) == {"lock"}:
        # strace skips a syscall it fails, but Linux frees a descriptor (and drops its
        # flock) even when close fails: the lock the child still holds exists only here
        status, note, broken = "artifact", f"lock held by the unexecuted close ({broken['lock']})", {}
    return {"status": "broken" if broken else status, "broken": broken, "child": errors[:2], "note": note,
            "info": info,
            "fault_seen": "fault 1" in lines}


def _run_case(case: Case, template: str, keep: Optional[str]) -> Dict[str, object]:
    workdir = tempfile.mkdtemp(prefix="fault-", dir=os.path.dirname(template))
    try:
        store = os.path.join(workdir, "store")
        shutil.copytree(template, store)
        rc, out, err, log = run_traced(workdir, functools.partial(workload, store), case.inject())
        result = check(case, store, rc, out, err, log)
        if keep:
            shutil.copytree(workdir, keep, dirs_exist_ok=True)
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_case(case: Case, template: str, keep: Optional[str] = None, tries: int = 3) -> Dict[str, object]:
    """Run one case, again (up to ``tries`` times) while the injection misses its call: about
    one run in 500 still diverges from the baseline before it (cause not found yet)."""
    for _ in range(tries):
        result = _run_case_forked(case, template, keep)
        if result["status"] != "missed":
            break
    return result


def _run_case_forked(case: Case, template: str, keep: Optional[str]) -> Dict[str, object]:
    """Run one case in a process forked for it, so that every traced child starts from the same
    state: a pool worker that had checked an earlier case held objects whose release closed
    descriptors, which moved the occurrence numbers of ``close``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                result = _run_case(case, template, keep)
            except BaseException as exc:  # noqa: BLE001 - reported as the case's outcome
                result = {"status": "broken", "broken": {"error": f"the sweep itself failed: {exc!r}"},
                          "child": [], "note": "", "info": [], "fault_seen": False}
            with os.fdopen(w, "wb") as f:
                f.write(json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


# --------------------------------------------------------------------------- power loss


def _created(c: Call, store: str) -> Optional[str]:
    """The data file ``c`` gave a new name in ``store`` (an ``O_CREAT`` open, a ``link``), if any:
    not a manifest, a temporary name or the writer lock."""
    if c.name in ("openat", "open") and "O_CREAT" in c.args and c.result[:1].isdigit():
        path = c.paths[0] if c.paths else ""
    elif c.name in ("link", "linkat", "rename", "renameat", "renameat2") and c.result.startswith("0") \
            and len(c.paths) >= 2:  # (a rename over an existing name makes no new one: counted anyway)
        path = c.paths[-1]
    else:
        return None
    path = normalize(path)
    if not path.startswith(store + "/") or "/.tmp-" in path or path.startswith(
            os.path.join(store, fmt.MANIFEST_DIR) + "/") or os.path.basename(path) == fmt.LOCK_FILE:
        return None
    return path


def power_loss_findings(calls: List[Call], store: str) -> List[str]:
    """Creations and deletions of an unfaulted run checked against the power-loss model (see the
    module docstring): every name a commit may need is durable before the commit point."""
    findings: List[str] = []
    mdir = os.path.join(store, fmt.MANIFEST_DIR)
    pending: Dict[str, List[str]] = collections.defaultdict(list)  # dir -> unlinks not yet made durable
    created: Dict[str, List[str]] = collections.defaultdict(list)  # dir -> new names not yet durable
    def rel(p):
        return os.path.relpath(p, store)
    for c in calls:
        new_name = _created(c, store)
        if new_name is not None:
            created[os.path.dirname(new_name)].append(new_name)
        if c.name in ("unlink", "unlinkat") and c.paths and c.paths[-1].startswith(store + "/") \
                and c.result.startswith("0"):
            path = normalize(c.paths[-1])
            directory = os.path.dirname(path)
            if directory != mdir and pending[mdir] and "/.tmp-" not in path:
                findings.append(f"{rel(path)} unlinked while the unlink of {rel(pending[mdir][-1])} is not "
                                f"durable (no fsync of manifests/ in between): a power cut can bring that "
                                f"manifest back without this file [{c.step}]")
            if "/.tmp-" not in path:  # a temporary name that comes back is garbage, taken by clean-up
                pending[directory].append(path)
            if path in created[directory]:  # made and removed: neither needs to last
                created[directory].remove(path)
        elif c.name in ("fsync", "fdatasync") and c.paths:
            pending.pop(normalize(c.paths[0]), None)
            created.pop(normalize(c.paths[0]), None)
        elif c.name in ("rename", "renameat", "renameat2", "link", "linkat") and len(c.paths) >= 2 and \
                c.paths[-1].startswith(mdir + "/") and "/.tmp-" not in c.paths[-1] and c.result.startswith("0"):
            for directory, paths in pending.items():
                for p in paths:
                    findings.append(f"unlink of {rel(p)} not made durable (no fsync of {rel(directory) or '.'}) "
                                    f"before the next commit [{c.step}]")
            for directory, paths in created.items():
                for p in paths:
                    findings.append(f"{rel(p)} created but its name not made durable (no fsync of "
                                    f"{rel(directory) or '.'}) before the commit point: a power cut can keep the "
                                    f"manifest without the file [{c.step}]")
            pending.clear()
            created.clear()
    for directory, paths in pending.items():
        for p in paths:
            findings.append(f"unlink of {rel(p)} never made durable (no fsync of {rel(directory) or '.'})")
    return findings


# --------------------------------------------------------------------------- the sweep


def select(cases: List[Case], faults: Sequence[str], sample: Optional[int], seed: int) -> List[Case]:
    chosen = [c for c in cases if c.fault in faults]
    if sample is not None and sample < len(chosen):
        chosen = sorted(random.Random(seed).sample(chosen, sample), key=cases.index)
    return chosen


def run_cases(cases: Sequence[Case], template: str, jobs: int, keep: Optional[str] = None,
              progress: bool = False) -> List[Tuple[Case, Dict[str, object]]]:
    """Run ``cases`` (each in a fresh copy of ``template``), ``jobs`` at once, in their order."""
    start = time.monotonic()
    results: Dict[Case, Dict[str, object]] = {}
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_case, c, template, keep): c for c in cases}
        for k, fut in enumerate(as_completed(futures), 1):
            results[futures[fut]] = fut.result()
            if progress and k % 100 == 0:
                print(f"  {k}/{len(cases)} cases, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return [(c, results[c]) for c in cases]


def table(results: List[Tuple[Case, Dict[str, object]]], group_of: Dict[str, str]) -> str:
    """Syscall x fault: runs, survived, missed, and how many broke each invariant."""
    rows: Dict[Tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for case, res in results:
        key = (group_of[case.syscall], case.fault)
        rows[key]["runs"] += 1
        rows[key][res["status"]] += 1
        for inv in list(res["broken"]) + list(res["info"]):
            rows[key][inv] += 1
    head = ["syscall", "fault", "runs", "survived", "missed", "artifact"] + list(INVARIANTS) + list(INFO)
    lines = [" ".join(f"{h:>9}" if i > 1 else f"{h:<10}" for i, h in enumerate(head[:-len(INFO)]))
             + "".join(f" {h:>16}" for h in INFO)]
    for (group, fault) in sorted(rows, key=lambda k: (DEFAULT_GROUPS.index(k[0]) if k[0] in DEFAULT_GROUPS
                                                        else 99, FAULTS.index(k[1]))):
        r = rows[(group, fault)]
        vals = [group, fault, r["runs"], r["ok"], r["missed"] or ".", r["artifact"] or "."] + \
            [r[i] or "." for i in INVARIANTS + INFO]
        lines.append(" ".join(f"{v:>9}" if i > 1 else f"{v:<10}" for i, v in enumerate(vals[:-len(INFO)]))
                     + "".join(f" {v:>16}" for v in vals[-len(INFO):]))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Invariants: " + ", ".join(INVARIANTS) + ". Exit status 1 when any case broke one.")
    parser.add_argument("--syscalls", default=",".join(DEFAULT_GROUPS), metavar="GROUP[,GROUP...]",
                        help="syscall groups to fault (default: %(default)s; also: read)")
    parser.add_argument("--faults", default=",".join(FAULTS), metavar="FAULT[,FAULT...]",
                        help="faults to inject (default: %(default)s)")
    parser.add_argument("--sample", type=_count, metavar="N",
                        help="run N cases, drawn with --seed (default: all of them)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="seed of the cases --sample draws (default: %(default)s)")
    parser.add_argument("--jobs", type=_count, default=os.cpu_count() or 1, metavar="N",
                        help="cases run at once (default: the number of CPUs, %(default)s here)")
    parser.add_argument("--case", metavar="SYSCALL:FAULT:OCCURRENCE[,...]",
                        help="run these cases only, e.g. openat:EIO:7 (see --list; default: the sweep)")
    parser.add_argument("--keep", metavar="DIR",
                        help="with one --case: copy its store, strace log and output here (default: not kept)")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the cases (with --list) or the results to this file (default: none)")
    parser.add_argument("--all", action="store_true",
                        help="list every case, not only broken ones (default: broken ones and notes)")
    parser.add_argument("--power-loss", action="store_true",
                        help="also check the baseline's order of creations, deletions and fsyncs (default: off)")
    parser.add_argument("--dir", metavar="DIR",
                        help="where stores are made (default: /dev/shm when there is one: fsync is "
                             "free there, and the faults are injected, not real; else the temporary directory)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit (default: run them)")
    parser.add_argument("--multi-writer", action="store_true",
                        help="sweep a multi-writer store (retain_seconds=3600, its files aged past it); every 4th "
                             "append of the child loses a race to another writer object in the process and "
                             "retries (default: a single-writer store)")
    args = parser.parse_args(argv)

    groups = [g.strip() for g in args.syscalls.split(",") if g.strip()]
    for g in groups:
        if g not in SYSCALL_GROUPS:
            parser.error(f"--syscalls: unknown group {g!r}; choose from {', '.join(SYSCALL_GROUPS)}")
    faults = [f.strip().upper() for f in args.faults.split(",") if f.strip()]
    for f in faults:
        if f not in FAULTS:
            parser.error(f"--faults: unknown fault {f!r}; choose from {', '.join(FAULTS)}")
    problem = strace_problem()
    if problem:
        print(f"faults.py: {problem}", file=sys.stderr)
        return 2
    base_dir = args.dir or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    top = tempfile.mkdtemp(prefix="diskreplay-faults-", dir=base_dir)
    try:
        template = os.path.join(top, "template")
        global MULTI_WRITER
        MULTI_WRITER = args.multi_writer
        make_template(template, args.multi_writer)
        warm_up(top, args.multi_writer)
        cases, calls, base_store = baseline(tempfile.mkdtemp(dir=top), template, groups)
        group_of = {n: g for g, names in SYSCALL_GROUPS.items() for n in names}
        if args.case:
            by_label = {c.label.lower(): c for c in cases}
            chosen = []
            for label in args.case.split(","):
                if label.strip().lower() not in by_label:
                    parser.error(f"--case {label}: no such store call in the baseline (see --list)")
                chosen.append(by_label[label.strip().lower()])
        else:
            chosen = select(cases, faults, args.sample, args.seed)
        if args.list:
            for c in chosen:
                print(f"{c.label:<24} {c.target:<40} [{c.step}]")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"cases": [dataclasses.asdict(c) for c in chosen]}, f, indent=1)
            return 0
        print(f"baseline: {len(calls)} traced calls of the child's main thread, "
              f"{len(cases) // len(FAULTS)} touch the store in the chosen syscalls; running {len(chosen)} cases "
              f"with {args.jobs} jobs", flush=True)
        start = time.monotonic()
        results = run_cases(chosen, template, args.jobs, args.keep if len(chosen) == 1 else None, progress=True)
        print(f"{len(results)} cases in {time.monotonic() - start:.0f} s\n")
        print(table(results, group_of))
        failing = [(c, r) for c, r in results if r["broken"]]
        listed = results if args.all else failing + [(c, r) for c, r in results if r["note"]]
        if listed:
            print("\ncase                     file                                   during         outcome")
        for c, r in listed:
            outcome = "; ".join(f"{k}: {v}" for k, v in r["broken"].items()) or r["note"] or r["status"]
            print(f"{c.label:<24} {c.target:<38} {c.step[:14]:<14} {outcome}")
        missed = [c.label for c, r in results if r["status"] == "missed"]
        if missed:
            print(f"\nmissed (the run diverged from the baseline before the call): {', '.join(missed[:20])}"
                  + (" ..." if len(missed) > 20 else ""))
        found = power_loss_findings(calls, base_store) if args.power_loss else []
        if args.power_loss:
            print(f"\npower-loss order of the unfaulted run's creations and deletions: {len(found)} finding(s)")
            for line in found[:10]:
                print("  " + line)
            if len(found) > 10:
                print(f"  ... and {len(found) - 10} more")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"results": [{**dataclasses.asdict(c), "label": c.label, **r} for c, r in results],
                           "power_loss": found if args.power_loss else None}, f, indent=1)
        return 1 if failing else 0
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
