"""The writer process of the stopped-writers campaigns (tests/test_schedules.py, tests/test_media_schedules.py).

``python -c writer_script(batches) PATH W STEP STOP`` appends batch ``(W, STEP)``, ``(W, STEP + 1)``, ... to
the multi-writer store at PATH until the file STOP exists, printing ``ACK step first_row rows`` for each
acknowledged batch. Writer 0's wall clock runs an hour ahead (its clean-up finds everything old); writer 3
sends no tokens (on a store with leases nothing it commits is in doubt); a restarted writer re-sends its
last batch even if the run is ending (it may be committed).
"""

import textwrap

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
