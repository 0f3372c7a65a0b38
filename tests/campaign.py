"""The writer process of the stopped-writers campaigns (tests/test_schedules.py, tests/test_media_schedules.py).

``python -c writer_script(batches) PATH W STEP STOP`` appends batch ``(W, STEP)``, ``(W, STEP + 1)``, ... to
the multi-writer store at PATH until the file STOP exists, printing ``ACK step first_row rows`` for each
acknowledged batch. Writer 0's wall clock runs an hour ahead (its clean-up finds everything old); writer 3
sends no tokens (on a store with leases nothing it commits is in doubt); a restarted writer re-sends its
last batch even if the run is ending (it may be committed).
"""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

_SCRIPT = textwrap.dedent("""
    import os, sys, time
    path, w, step, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if w == 0:  # this writer's wall clock runs an hour ahead: its clean-up finds everything old
        real = time.time
        time.time = lambda: real() + 3600
    from diskreplay import ReplayStore
    from diskreplay.store import collector
    from diskreplay.testing.workload import token_for
    from BATCHES_MODULE import BATCHES_FUNCTION as batch_of
    collector.SHARED_GC_EVERY = 4  # sweeps often, so that they meet the stopped writers
    store = ReplayStore(path, fsync=w % 2 == 0)
    tokened = w != 3  # writer 3 sends no tokens: on a store with leases nothing it commits is in doubt
    first = True  # a restarted writer re-sends its last batch even if the run is ending (it may be committed)
    while first or not os.path.exists(stop):
        first = False
        while True:
            try:
                rows = store.extend(batch_of(w, step), token=token_for(w, step) if tokened else None)
                break
            except OSError as exc:  # in doubt or abandoned (CommitTimeoutError): the token finds out
                print("RETRY" if tokened else "ERR", step, type(exc).__name__, exc, flush=True)
                if not tokened:
                    raise
        print("ACK", step, int(rows[0]), len(rows), flush=True)
        step += 1
        time.sleep(0.01)
    store.close()
""")


def writer_script(batches: str = "diskreplay.testing.workload:batch_for") -> str:
    """The campaign writer's source, taking its batches from ``batches`` (``module:function`` of ``(w, step)``)."""
    module, function = batches.split(":")
    return _SCRIPT.replace("BATCHES_MODULE", module).replace("BATCHES_FUNCTION", function)


def run_campaign(path, stop, *, seed, stops, kills, retain, batches=None, observe=None, writers=4):
    """Run ``writers`` campaign writer processes on the store at ``path`` until ``stops`` SIGSTOPs (each
    longer than ``retain`` seconds) and ``kills`` SIGKILLs landed at moments drawn from ``seed``;
    writer 0 (the clock an hour ahead) is never stopped, writer 3 (no tokens) never killed, a killed
    writer is started again and re-sends its last batch. ``observe()`` runs between the moves.
    Returns ``{(writer, step): row ids}`` of every acknowledged batch."""
    script = writer_script() if batches is None else writer_script(batches)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rnd = random.Random(seed)
    acked, procs = {}, {}

    def start(w):
        nxt = max((s for (v, s) in acked if v == w), default=-1) + 1  # a killed one re-sends its last batch
        procs[w] = subprocess.Popen([sys.executable, "-c", script, path, str(w), str(nxt), stop],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)

    def drain(w):
        out, err = procs[w].communicate()
        for line in out.splitlines():
            if line.startswith("ACK"):
                _, step, first, n = line.split()
                acked[(w, int(step))] = list(range(int(first), int(first) + int(n)))
        assert procs[w].returncode in (0, -signal.SIGKILL), err

    stopped = killed = 0
    try:
        for w in range(writers):
            start(w)
        deadline = time.time() + 300  # against a hang only
        while (stopped < stops or killed < kills) and time.time() < deadline:
            time.sleep(rnd.uniform(0.2, 0.6))
            if observe is not None:
                observe()
            w = rnd.randrange(1, writers)  # the writer with the jumped clock is never stopped: it sweeps
            p = procs[w]
            if p.poll() is not None:
                drain(w)
                start(w)
            elif stopped < stops and (killed >= kills or rnd.random() < 0.5):
                p.send_signal(signal.SIGSTOP)
                time.sleep(retain + rnd.uniform(0.5, 1.5))  # the others commit and collect meanwhile
                if observe is not None:
                    observe()
                p.send_signal(signal.SIGCONT)
                stopped += 1
            elif killed < kills and w != 3:
                p.send_signal(signal.SIGKILL)
                p.wait()
                killed += 1
                drain(w)
                start(w)
    finally:
        open(stop, "w").close()
        for w in procs:
            try:
                procs[w].wait(timeout=60)
            except subprocess.TimeoutExpired:
                procs[w].kill()
            drain(w)
    assert stopped == stops and killed == kills, (stopped, killed)
    return acked
