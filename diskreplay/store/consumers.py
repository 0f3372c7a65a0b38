"""Where a store's consumers are: the committed cursors of its rollout streams, and the writers'
wait for the slowest of them (back-pressure).

A stream (:class:`diskreplay.stream.RolloutStream`) commits its cursor as the saved state
``stream.<name>``. Its ``position`` is every row below its scan point except those of complete
groups it has not handed out yet: a writer is ``next_row - position`` rows ahead of it, plus the
rows of incomplete groups that have waited ``incomplete_after`` seconds. Younger rows of incomplete
groups count as reached, because there the stream waits for the writers: if they waited for it in
turn (the writer of a group's last samples held back by the others' rows), neither would move;
once the group is that old its other writers are taken for dead or stuck, and the bound holds
for its rows too.

Ages are the observer's: a writer measures how long a cursor has not changed, and how long the
rows of incomplete groups have waited, from when it first saw that cursor, on its own boot clock
(plus the waits the stream measured on its own clock before it committed the cursor). Wall-clock
timestamps written by other hosts are never compared: a host whose clock runs ahead would take a
live trainer for dead.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .. import format as fmt
from .._fileio import boot_clock
from ..errors import ArgumentError

STREAM_PREFIX = "stream."
STREAM_KIND = "diskreplay.stream"
#: a stream whose cursor a writer has not seen change for this long is taken for dead by its wait
DEAD_AFTER_S = 600.0
#: rows of an incomplete group count against the writers' bound once they waited this long
INCOMPLETE_AFTER_S = 60.0


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
    """One stream's committed cursor as the writers see it. ``seen_at``: this process's boot clock
    when it first saw this cursor; ``waited``: how long each row of an incomplete group had waited
    when the stream committed the cursor (the stream's clock); ``generation``: its state file's
    (a new one with every commit of the cursor); ``saved_at``: the stream host's wall clock (shown,
    never compared).

    >>> Consumer("trainer", position=96, saved_at=0.0, next_row=128).behind(160)
    64
    >>> c = Consumer("trainer", 96, 0.0, 128, waited=np.array([70.0, 5.0]))
    >>> c.behind(160, incomplete_after=60, now=c.seen_at)   # the row that waited 70 s counts
    65
    """

    name: str
    position: int
    saved_at: float
    next_row: int
    epoch: int = 0
    generation: int = 0
    waited: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0), compare=False, repr=False)
    seen_at: float = dataclasses.field(default_factory=boot_clock, compare=False)

    def age(self, now: Optional[float] = None) -> float:
        """Seconds since this process first saw this cursor (its boot clock)."""
        return max(0.0, (boot_clock() if now is None else now) - self.seen_at)

    def behind(self, next_row: int, incomplete_after: Optional[float] = None, now: Optional[float] = None) -> int:
        """How many of the store's ``next_row`` rows this consumer has not dealt with; with
        ``incomplete_after``, the rows of incomplete groups that have waited that long count too."""
        ahead = max(0, int(next_row) - self.position)
        if incomplete_after is not None and self.waited.size:
            ahead += int(np.count_nonzero(self.waited + self.age(now) >= incomplete_after))
        return ahead


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
                pending = np.asarray(saved["pending"], np.int64)
                waited = np.asarray(saved.get("waited", np.zeros(pending.size)), np.float64)
                incomplete = np.isin(pending, np.asarray(saved.get("incomplete", []), np.int64))
                consumer = Consumer(state[len(STREAM_PREFIX):], int(saved["position"]), float(saved["saved_at"]),
                                    int(saved["next_row"]), int(saved.get("epoch", 0)), entry.generation,
                                    waited[incomplete] if waited.size == pending.size else np.zeros(0))
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
                       streams: Optional[Sequence[str]], poll: float, gave_up: Dict[str, Any],
                       known: Optional[Dict[str, Tuple[Any, Optional[Consumer]]]] = None,
                       incomplete_after: float = INCOMPLETE_AFTER_S) -> bool:
    """Block until the store's newest ``next_row`` is at most ``max_ahead_rows`` ahead of every live
    consumer (those of ``streams``, or all), counting the rows of its incomplete groups that have
    waited ``incomplete_after`` seconds; True then, False when ``timeout`` seconds passed first
    (with a warning naming the consumer waited for). A consumer whose cursor this writer has not
    seen change for ``dead_after`` seconds is not waited for, nor one this writer gave up on
    (``gave_up``: its name and the cursor it still had then) until it commits a new cursor; no
    consumer at all: True at once. ``known``: as for :func:`consumers`."""
    check_max_ahead(max_ahead_rows)
    if timeout is not None and not timeout >= 0:
        raise ArgumentError(f"timeout must be seconds >= 0 or None (wait for ever), got {timeout!r}")
    if not incomplete_after >= 0:
        raise ArgumentError(f"incomplete_after must be seconds >= 0, got {incomplete_after!r}")
    known = {} if known is None else known
    wanted = None if streams is None else {str(s) for s in streams}
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = min(poll, 0.005)
    while True:
        store.refresh()
        now = boot_clock()
        live = [c for name, c in consumers(store, known).items()
                if (wanted is None or name in wanted) and c.age(now) < dead_after
                and gave_up.get(name) != c.generation]
        behind = {c.name: c.behind(store.next_row, incomplete_after, now) for c in live}
        slowest = max(live, key=lambda c: behind[c.name], default=None)
        if slowest is None or behind[slowest.name] <= max_ahead_rows:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            gave_up[slowest.name] = slowest.generation
            warnings.warn(f"{store.path}: gave up waiting after {timeout} s for stream {slowest.name!r}, "
                          f"{behind[slowest.name]} rows behind (bound {max_ahead_rows}); this writer has not seen its "
                          f"cursor change for {slowest.age(now):.1f} s; not waiting for it again until it commits a "
                          "new one", RuntimeWarning, stacklevel=3)
            return False
        time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(poll, delay * 2)
