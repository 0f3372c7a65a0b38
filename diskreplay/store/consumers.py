"""Where a store's consumers are: the committed cursors of its rollout streams, and the writers'
wait for the slowest of them (back-pressure).

A stream (:class:`diskreplay.stream.RolloutStream`) commits its cursor as the saved state
``stream.<name>``. Its ``position`` is every row below its scan point except those of complete
groups it has not handed out yet: a writer is ``next_row - position`` rows ahead of it. The rows
of incomplete groups count as reached, because there the stream waits for the writers: if they
waited for it in turn (the writer of a group's last samples held back by the others' rows),
neither would move.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

from .. import format as fmt
from ..errors import ArgumentError

STREAM_PREFIX = "stream."
STREAM_KIND = "diskreplay.stream"
#: a stream whose cursor was not committed for this long is taken for dead by the writers' wait
DEAD_AFTER_S = 600.0


def stream_state_name(name: str) -> str:
    """The saved state a stream called ``name`` commits its cursor under.

    >>> stream_state_name("trainer")
    'stream.trainer'
    """
    if not isinstance(name, str) or not name or len(name) > 64 - len(STREAM_PREFIX):
        raise ArgumentError(f"a stream name is 1-{64 - len(STREAM_PREFIX)} letters, digits, '_', '.' or '-', "
                            f"got {name!r}")
    return fmt.check_state_name(STREAM_PREFIX + name)


@dataclasses.dataclass(frozen=True)
class Consumer:
    """One stream's committed cursor as the writers see it.

    >>> Consumer("trainer", position=96, saved_at=0.0, next_row=128).behind(160)
    64
    """

    name: str
    position: int
    saved_at: float
    next_row: int

    def behind(self, next_row: int) -> int:
        """How many of the store's ``next_row`` rows this consumer has not dealt with."""
        return max(0, int(next_row) - self.position)


def consumers(store: Any, known: Optional[Dict[str, Tuple[Any, Optional[Consumer]]]] = None
              ) -> Dict[str, Consumer]:
    """Every stream's committed cursor in the commit ``store`` holds, by stream name. ``known``
    remembers the cursors read, by their state entry, so that a writer polling for back-pressure
    reads a stream's state file again only when the stream committed a new cursor."""
    known = {} if known is None else known
    out: Dict[str, Consumer] = {}
    for state, entry in sorted(store.manifest.states.items()):
        if not state.startswith(STREAM_PREFIX):
            continue
        seen = known.get(state)
        if seen is None or seen[0] != entry:
            saved = store.load_state(state)
            consumer = None
            if saved and saved.get("kind") == STREAM_KIND:
                consumer = Consumer(state[len(STREAM_PREFIX):], int(saved["position"]), float(saved["saved_at"]),
                                    int(saved["next_row"]))
            seen = known[state] = (entry, consumer)
        if seen[1] is not None:
            out[seen[1].name] = seen[1]
    return out


def check_max_ahead(value: Any, allow_none: bool = False) -> Optional[int]:
    """``value`` as a ``max_ahead_rows``: an int >= 0 (or None, where that means no back-pressure)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArgumentError(f"max_ahead_rows must be an integer >= 0{' or None' if allow_none else ''}, "
                            f"got {value!r}")
    return value


def wait_for_consumers(store: Any, max_ahead_rows: int, timeout: Optional[float], dead_after: float,
                       streams: Optional[Sequence[str]], poll: float, gave_up: Dict[str, float],
                       known: Optional[Dict[str, Tuple[Any, Optional[Consumer]]]] = None) -> bool:
    """Block until the store's newest ``next_row`` is at most ``max_ahead_rows`` ahead of every live
    consumer (those of ``streams``, or all); True then, False when ``timeout`` seconds passed
    first (with a warning naming the consumer waited for). A consumer whose cursor was not
    committed for ``dead_after`` seconds is not waited for, nor one this writer gave up on
    (``gave_up``: its name and the cursor it still had then) until it commits a new cursor; no
    consumer at all: True at once. ``known``: as for :func:`consumers`."""
    check_max_ahead(max_ahead_rows)
    if timeout is not None and not timeout >= 0:
        raise ArgumentError(f"timeout must be seconds >= 0 or None (wait for ever), got {timeout!r}")
    wanted = None if streams is None else {str(s) for s in streams}
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = min(poll, 0.005)
    while True:
        store.refresh()
        now = time.time()
        live = [c for name, c in consumers(store, known).items()
                if (wanted is None or name in wanted) and now - c.saved_at < dead_after
                and gave_up.get(name) != c.saved_at]
        slowest = min(live, key=lambda c: c.position, default=None)
        if slowest is None or slowest.behind(store.next_row) <= max_ahead_rows:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            gave_up[slowest.name] = slowest.saved_at
            warnings.warn(f"{store.path}: gave up waiting after {timeout} s for stream {slowest.name!r}, "
                          f"{slowest.behind(store.next_row)} rows behind (bound {max_ahead_rows}); its cursor was "
                          f"last committed {now - slowest.saved_at:.1f} s ago; not waiting for it again until it commits a new "
                          "one", RuntimeWarning, stacklevel=3)
            return False
        time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(poll, delay * 2)
