"""The rollout stream of asynchronous RL: committed rows handed to a trainer once each, in commit
order, across ranks and restarts.

A store's row ids grow with its commits (every writer's rows get the next ids when they
commit), so a stream is a scan point over row ids plus the rows below it still waiting: the
rows of prompt groups not yet complete, and complete groups not yet handed out. Its cursor is
that, committed as the saved state ``stream.<name>`` (``save()``) or kept in the trainer's own
checkpoint (``state_dict()``); the writers' back-pressure reads the committed one
(:meth:`ReplayStore.wait_for_consumers`).

One module: the waiting rows with their groups, versions and readiness are one state that the
cursor saves and every method (scan, hand out, evict, give back, resume) keeps consistent.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._fileio import boot_clock
from .errors import ArgumentError, ColumnNotFoundError, CommitConflictError, SamplerError, StreamFencedError
from .ragged import RaggedColumn
from .samplers.distributed import broadcast_ints
from .schema import MAX_COLUMN_NAME
from .store.consumers import STREAM_KIND, stream_state_name

_FORMAT = 1
#: the per-row version a row without per-token versions is judged by, when the store has it
ROW_VERSION_KEY = "policy_version"
#: instances of one name claiming at the same moment: each lost race reads the newer epoch and tries again
_CLAIM_ATTEMPTS = 16
#: rows whose required columns one read asks for (bounds a poll's memory, not its count of reads)
_READY_CHUNK = 8192


def _required(require: Any) -> Tuple[str, ...]:
    names = (require,) if isinstance(require, str) else require
    try:
        names = tuple(names)
    except TypeError:
        raise ArgumentError(f"require must be column names (a list of str), got {require!r}") from None
    for name in names:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_COLUMN_NAME:
            raise ArgumentError(f"require names the columns a row must have values in before it is handed out; "
                                f"{name!r} cannot be a column name (a str of 1 to {MAX_COLUMN_NAME} characters)")
    return tuple(dict.fromkeys(names))


def _has_value(column: Any, n: int) -> np.ndarray:
    """Per row, whether ``column`` (as ``store.read`` returns it) holds a value: a float reads NaN where
    a row has none (a late column, a value not written yet), a ragged row is null where its validity is
    False, and a ragged column none of the rows has reads as None."""
    if column is None:
        return np.zeros(n, bool)
    if isinstance(column, RaggedColumn):
        return np.ones(n, bool) if column.validity is None else np.asarray(column.validity, bool).copy()
    if isinstance(column, np.ndarray):
        if column.dtype.kind == "f":
            return ~np.isnan(column.reshape(n, -1)).all(axis=1)
        return np.ones(n, bool)
    return np.fromiter((v is not None for v in column), bool, n)


def _non_negative_int(name: str, value: Any, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ArgumentError(f"{name} must be an integer >= 0{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


class RolloutStream:
    """Hands out a store's committed rows in commit order, each once per stream ``name``.

    ``next(batch_size)`` returns the row ids of the next batch (this rank's
    slice of a global batch of ``batch_size * world_size`` rows), waiting for
    writers to commit enough; read them with ``store.read`` or a
    :class:`~diskreplay.Collator`. Rows handed out are gone from the stream
    (sample them again for replay with the samplers); nothing is skipped
    silently: rows evicted before the stream reached them, rows older than
    ``max_policy_lag`` and dropped incomplete groups are counted in
    :meth:`stats`.

    ``group_size=n`` (required on a store with a group key; 1 streams single
    rows) hands out whole prompt groups: a group is ready when ``n`` rows of
    its key are committed, from any writers and commits, and groups go out in
    the order they completed. ``batch_size`` is then a multiple of ``n``. More
    than ``n`` rows of one key make further groups. :meth:`incomplete_groups`
    reports groups still waiting (with how long), ``drop_incomplete`` gives
    them up.

    ``require=["rewards", ...]``: a row (a group: all its rows) is handed out
    only once it has values in those columns (written with the row, or later
    by another process), in the order the stream saw units become ready
    (those of one poll in commit order); :meth:`incomplete_groups` says
    which rows still miss which column. A column the store does not have yet
    holds no values.

    ``max_policy_lag=L`` with ``next(..., policy_version=v)``: groups (rows)
    whose ``policy_version_key`` is below ``v - L`` are skipped and counted
    (a per-token version column counts by its oldest token).

    **Exactly once across restarts.** ``save(extra)`` commits the cursor
    (with ``extra``, a small state of the trainer's, in the same commit);
    a stream made again with the same name continues from it: no row handed
    out twice, none skipped, whatever was committed meanwhile. Rows handed out
    after the last ``save`` are handed out again (the training they fed was
    not saved either). A trainer that checkpoints elsewhere puts
    ``state_dict()`` in its checkpoint and ``load_state_dict`` on resume, and
    calls ``save()`` too so writers see how far it is. The consumer must be
    able to write the store: open a multi-writer store without
    ``readonly``, or use the writer's own store object.

    **One live instance per name.** Each new instance takes the next
    :attr:`epoch` (a commit); its saves commit only over the cursor it
    committed last, so an older instance still running gets
    :class:`~diskreplay.errors.StreamFencedError` from ``save`` and ``next``
    instead of moving the cursor back. A deliberate resume from an earlier
    checkpoint is a new instance given it with ``load_state_dict``.

    **Ranks.** With ``rank`` / ``world_size`` (and ``torch.distributed``
    initialised) every rank calls ``next`` at the same points; rank 0's view
    of the store is broadcast, so all ranks cut the same global batch and
    keep disjoint slices of it (whole groups each). Only rank 0's ``save``
    writes.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp(), multi_writer=True)
    >>> _ = store.extend({"prompt_id": [1, 2, 1], "policy_version": [0, 0, 0]})
    >>> stream = RolloutStream(store, "trainer", group_size=2)
    >>> stream.next(2, timeout=0).tolist()          # prompt 1 is complete; prompt 2 waits
    [0, 2]
    >>> stream.next(2, timeout=0) is None
    True
    >>> stream.save(extra={"step": 1})
    >>> _ = store.extend({"prompt_id": [2], "policy_version": [1]})
    >>> again = RolloutStream(store, "trainer", group_size=2)  # a restarted trainer
    >>> again.extra, again.next(2, timeout=0).tolist()
    ({'step': 1}, [1, 3])
    """

    def __init__(self, store: Any, name: str, *, group_size: Optional[int] = None,
                 max_policy_lag: Optional[int] = None, policy_version_key: str = "policy_version",
                 require: Sequence[str] = (), rank: int = 0, world_size: int = 1, resume: bool = True,
                 process_group: Any = None) -> None:
        self.store, self.name = store, name
        self.state_name = stream_state_name(name)
        self.group_key = getattr(store, "group_key", None)
        if group_size is None and self.group_key is not None:
            raise ArgumentError(f"{store.path} groups rows by {self.group_key!r}: pass group_size=n (the completions "
                                "of one prompt) to stream whole groups, or group_size=1 to stream single rows")
        self.group_size = 1 if group_size is None else _non_negative_int("group_size", group_size)
        if self.group_size < 1:
            raise ArgumentError(f"group_size must be >= 1, got {group_size!r}")
        self.max_policy_lag = _non_negative_int("max_policy_lag", max_policy_lag, allow_none=True)
        self.policy_version_key = policy_version_key
        self.require = _required(require)
        self.world_size = _non_negative_int("world_size", world_size)
        self.rank = _non_negative_int("rank", rank)
        if self.world_size < 1:
            raise ArgumentError(f"world_size must be >= 1 (torch.distributed.get_world_size()), got {world_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ArgumentError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        self.process_group = process_group
        self._next_row = 0
        self._pending = np.zeros(0, np.int64)      # scanned rows not dealt with, ascending
        self._since = np.zeros(0, np.float64)      # when this stream first saw each of them (boot clock)
        self._keys = np.zeros(0, object)          # their group keys (when grouped)
        self._versions = np.zeros(0, np.float64)   # their policy versions (NaN: none)
        # when each became ready: the stream's poll count then (units go out in that order), -1 while a
        # required column has no value for it; 0 without require, and for rows given back
        self._ready = np.zeros(0, np.int64)
        self._polls = 0                            # polls that found rows ready
        self._checked: Any = None                  # the generation whose values the not-ready rows were checked at
        self._layout: Any = None                   # _units() until the waiting rows or their marks change
        self._counts = {"handed_out": 0, "batches": 0, "stale": 0, "evicted": 0, "dropped_incomplete": 0}
        self.extra: Optional[Dict[str, Any]] = None
        self._warned: set = set()
        #: this instance's epoch: each new instance of a name takes the next one (rank 0, by a commit)
        self.epoch = 0
        self._entry: Any = None    # the cursor entry rank 0 committed last (its saves replace only that one)
        saved = self._claim(resume) if self.rank == 0 and self._writable() else None
        if resume:
            # every rank at least at rank 0's commit: the cursor rank 0 committed last is in it
            self._rank0_view(lambda: [self.store.generation], lambda agreed: self.store.generation < agreed[0])
            if self._entry is None:
                saved = store.load_state(self.state_name)
            if saved is not None:
                self.load_state_dict(saved)
                self.epoch = self.epoch or int(saved.get("epoch", 0))

    # ------------------------------------------------------------------ fencing

    def _writable(self) -> bool:
        return not getattr(self.store, "readonly", True) and not getattr(self.store, "pinned", False)

    def _claim(self, resume: bool) -> Optional[Dict[str, Any]]:
        """Take the next epoch of this stream name: commit the committed cursor again (or this fresh
        one) with it, only over the cursor read (a newer instance's claim in between: read it and
        try again). Every older instance's save (and ``next``) is refused from then on. Returns the
        committed cursor it found, checked against this stream's settings (to ``resume`` from it)
        before anything is written."""
        for _ in range(_CLAIM_ATTEMPTS):
            with self.store.lock:
                self.store.refresh()
                entry = self.store.manifest.states.get(self.state_name)
                saved = None if entry is None else self.store.load_state(self.state_name)
            if saved is not None and resume:
                self._check_cursor(saved)
            claim = dict(saved) if saved is not None else self.state_dict()
            claim["epoch"] = int(claim.get("epoch", 0)) + 1
            try:
                self._entry = self._commit(claim, entry)
            except CommitConflictError:
                if self._current_entry() == entry:
                    raise  # not a newer claim: lost races to other writers
                continue
            self.epoch = claim["epoch"]
            return saved
        raise self._fenced()

    def _commit(self, state: Mapping[str, Any], replaces: Any) -> Any:
        """Commit ``state`` as this stream's cursor only over the cursor entry ``replaces``; its entry."""
        with self.store.lock:
            self.store.save_state(self.state_name, state, replaces=replaces)
            return self.store.manifest.states[self.state_name]

    def _current_entry(self) -> Any:
        with self.store.lock:
            self.store.refresh()
            return self.store.manifest.states.get(self.state_name)

    def _fenced(self) -> StreamFencedError:
        newest = self.store.load_state(self.state_name) or {}
        return StreamFencedError(
            f"a newer instance of stream {self.name!r} took over at epoch {newest.get('epoch', '?')} (this one holds "
            f"epoch {self.epoch}) and committed its cursor to {self.store.path}: this instance may no longer save "
            "its cursor or hand out rows (both would hand rows out twice). Stop this trainer; give a second "
            "consumer of the store a stream name of its own; to resume from an earlier checkpoint, make a new "
            "RolloutStream and load_state_dict() the checkpoint's cursor (a new instance takes a new epoch)")

    def _rank0_view(self, view: Callable[[], List[int]], behind: Callable[[List[int]], bool]) -> List[int]:
        """``view()`` of the newest commit as rank 0 sees it, on every rank; a rank whose own store is
        ``behind`` that loads newer commits until it is not (one process: its own view)."""
        def newest() -> List[int]:
            self.store.refresh()
            return view()

        agreed = broadcast_ints(newest, len(view()), self.process_group) if self.world_size > 1 else None
        if agreed is None:
            return newest()
        while behind(agreed) and not self.store.pinned:
            self.store.refresh()
            time.sleep(0.001)
        return agreed

    # ------------------------------------------------------------------ the cursor

    @property
    def position(self) -> int:
        """Rows dealt with: every row below the scan point but those still waiting."""
        return self._next_row - len(self._pending)

    def state_dict(self, *, unconsumed: Any = None) -> Dict[str, Any]:
        """The cursor (and ``extra``) as a JSON-and-arrays dict (``ReplayStore.save_state`` takes it).

        ``unconsumed``: rows ``next`` handed out that the consumer has not used yet (read ahead, or
        taken by a step its checkpoint does not cover); the cursor has them waiting again, so a stream
        loading it hands them out first. Single-row streams only (``group_size=1``)."""
        if unconsumed is not None and len(unconsumed):
            return self._giving_back(unconsumed).state_dict()
        ready, incomplete = self._units()
        waited = np.maximum(boot_clock() - self._since, 0.0)  # ages, not timestamps: no clock of this host in it
        return {"kind": STREAM_KIND, "format": _FORMAT, "name": self.name, "group_size": self.group_size,
                "group_key": self.group_key, "next_row": self._next_row, "position": self._next_row - ready.size,
                "pending": self._pending.copy(), "waited": waited, "group_of": self._group_of(),
                "incomplete": self._pending[incomplete], "since": time.time() - waited,
                "require": list(self.require), "ready": self._ready.copy(), "ready_polls": self._polls,
                "counts": dict(self._counts), "epoch": self.epoch, "saved_at": time.time(), "extra": self.extra}

    def _group_of(self) -> np.ndarray:
        """For each waiting row, the first waiting row of its group key (itself without groups)."""
        if self.group_size == 1 or not self._pending.size:
            return self._pending.copy()
        _, first, inverse = np.unique(self._keys, return_index=True, return_inverse=True)
        return self._pending[first][inverse.reshape(-1)]

    def _check_cursor(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != STREAM_KIND or state.get("format") != _FORMAT:
            raise SamplerError(f"{self.state_name}: not a stream cursor this diskreplay reads "
                               f"(kind {state.get('kind')!r}, format {state.get('format')!r})")
        for field in ("group_size", "group_key"):
            if state[field] != getattr(self, field):
                raise SamplerError(f"stream {self.name!r} was saved with {field}={state[field]!r}, not "
                                   f"{getattr(self, field)!r}: use the saved setting, or another stream name to "
                                   "start a new stream from the first row")

    def _giving_back(self, rows: Any) -> "RolloutStream":
        """A copy of this stream with ``rows`` (handed out by it) waiting again, in row order."""
        rows = np.unique(np.asarray(rows, np.int64))
        if self.group_size != 1:
            raise ArgumentError(f"unconsumed rows go back only to a stream of single rows (group_size=1); stream "
                                f"{self.name!r} has group_size={self.group_size}")
        if rows[0] < 0 or rows[-1] >= self._next_row or np.isin(rows, self._pending).any():
            raise ArgumentError(f"unconsumed must be rows stream {self.name!r} handed out (below "
                                f"{self._next_row} and not waiting), got {rows.tolist()[:8]}")
        copy = object.__new__(RolloutStream)
        copy.__dict__.update(self.__dict__)
        order = np.argsort(np.concatenate([self._pending, rows]), kind="stable")
        copy._pending = np.concatenate([self._pending, rows])[order]
        copy._since = np.concatenate([self._since, np.full(rows.size, boot_clock())])[order]
        copy._versions = np.concatenate([self._versions, np.full(rows.size, np.nan)])[order]
        copy._ready = np.concatenate([self._ready, np.zeros(rows.size, np.int64)])[order]  # they were ready: first
        copy._layout = None
        copy._counts = {**self._counts, "handed_out": self._counts["handed_out"] - rows.size}
        return copy

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a cursor ``state_dict()`` gave (a trainer checkpoint's, or the committed one).
        The instance keeps its own :attr:`epoch`: loading an older cursor is a deliberate resume, and the
        next ``save()`` commits it."""
        self._check_cursor(state)
        pending = np.asarray(state["pending"], np.int64)
        # how long each row had waited when the cursor was saved (an older cursor has only timestamps of
        # another host's clock, which are not compared here: its rows start waiting now)
        waited = np.asarray(state.get("waited", np.zeros(pending.size)), np.float64)
        group_of = np.asarray(state.get("group_of", pending), np.int64)
        alive = pending >= self.store.head  # rows the store evicted since the cursor was saved
        for a, b in getattr(self.store, "holes", ()):  # or a repair dropped
            alive &= (pending < a) | (pending >= b)
        self._next_row = int(state["next_row"])
        self._counts = {**self._counts, **{k: int(v) for k, v in state["counts"].items()}}
        self.extra = state.get("extra")
        ready = np.asarray(state.get("ready", np.full(pending.size, -1)), np.int64)
        if ready.size != pending.size or list(state.get("require", ())) != list(self.require):
            ready = np.full(pending.size, -1 if self.require else 0, np.int64)  # checked again at the next poll
        self._polls = max(self._polls, int(state.get("ready_polls", 0)))
        self._pending, self._since = np.zeros(0, np.int64), np.zeros(0, np.float64)
        self._keys, self._versions = np.zeros(0, object), np.zeros(0, np.float64)
        self._ready, self._layout = np.zeros(0, np.int64), None
        self._counts["evicted"] += int(alive.size - np.count_nonzero(alive))
        self._adopt(pending[alive], boot_clock() - waited[alive], ready[alive])
        self._cut(np.isin(group_of[alive], group_of[~alive]))

    def _cut(self, hit: np.ndarray) -> None:
        """Count the waiting rows of incomplete groups that lost a row to eviction (``hit``: per waiting
        row, whether its group key did) as evicted: such a group never completes, and is not handed out short."""
        if self.group_size == 1 or not hit.any():
            return
        gone = np.zeros(len(self._pending), bool)
        gone[self._units()[1]] = True
        gone &= hit
        self._counts["evicted"] += int(gone.sum())
        self._remove(gone)

    def save(self, extra: Optional[Mapping[str, Any]] = None, *, unconsumed: Any = None) -> None:
        """Commit the cursor (and ``extra``: JSON values and arrays, read back as :attr:`extra`) in one
        commit of the store; on ranks other than 0 it does nothing. ``unconsumed``: as in
        :meth:`state_dict`."""
        if extra is not None:
            self.extra = dict(extra)
        if self.rank == 0:
            try:
                self._entry = self._commit(self.state_dict(unconsumed=unconsumed), self._entry)
            except CommitConflictError:
                if self._current_entry() == self._entry:
                    raise  # lost races to other writers, not a newer instance
                raise self._fenced() from None

    # ------------------------------------------------------------------ handing out

    def next(self, batch_size: int, *, policy_version: Optional[int] = None, timeout: Optional[float] = None,
             poll: float = 0.05) -> Optional[np.ndarray]:
        """The row ids of this rank's next ``batch_size`` rows (ascending within each group), waiting
        up to ``timeout`` seconds (None: for ever; 0: not at all) for writers to commit them;
        None when the time ran out (the stream is unchanged apart from rows it skipped)."""
        batch_size = _non_negative_int("batch_size", batch_size)
        if batch_size == 0 or batch_size % self.group_size:
            raise ArgumentError(f"batch_size must be a positive multiple of group_size={self.group_size}, "
                                f"got {batch_size}")
        if self.max_policy_lag is not None and policy_version is None:
            raise ArgumentError(f"stream {self.name!r} has max_policy_lag={self.max_policy_lag}: pass "
                                "next(..., policy_version=<the trainer's current version>)")
        units = batch_size // self.group_size * self.world_size
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = min(poll, 0.002)
        while True:
            self._scan()
            taken = self._take(units, policy_version)
            if taken is not None:
                share = units // self.world_size
                self._counts["batches"] += 1
                return taken[self.rank * share:(self.rank + 1) * share].ravel()
            if self._agreed_timeout(deadline):
                return None
            time.sleep(delay)
            delay = min(poll, delay * 2)

    def _agreed_timeout(self, deadline: Optional[float]) -> bool:
        out = broadcast_ints(lambda: [deadline is not None and time.monotonic() >= deadline], 1,
                             self.process_group) if self.world_size > 1 else None
        return bool(out[0]) if out is not None else deadline is not None and time.monotonic() >= deadline

    def _scan(self) -> None:
        """Take in the rows committed since the last scan (rank 0's view, on every rank)."""
        head, end, fenced = self._rank0_view(
            lambda: [self.store.head, self.store.next_row, self._entry is not None and
                     self.store.manifest.states.get(self.state_name) != self._entry],
            lambda agreed: self.store.next_row < agreed[1])
        if fenced:  # (every rank raises: rank 0 saw it)
            raise self._fenced()
        self._drop_evicted(head)
        if end > self._next_row:
            start = max(self._next_row, head)
            self._counts["evicted"] += start - self._next_row
            self._next_row = end
            rows = np.arange(start, end, dtype=np.int64)
            for a, b in getattr(self.store, "holes", ()):  # rows repair dropped: there is nothing to hand out
                rows = rows[(rows < a) | (rows >= b)]
            self._counts["evicted"] += end - start - rows.size
            self._adopt(rows, None)
        if self.require:
            self._check_ready()

    def _check_ready(self) -> None:
        """Mark the waiting rows whose required columns now all have values (rank 0's reads, on every
        rank): one poll's finds share one mark, so units go out in the order they became ready."""
        found = self._newly_ready() if self.rank == 0 or self.world_size == 1 else None
        if self.world_size > 1:
            seen = broadcast_ints(lambda: [found.size, self.store.generation], 2, self.process_group)
            if seen is not None:
                found = np.asarray(broadcast_ints(lambda: found.tolist(), seen[0], self.process_group)
                                   if seen[0] else [], np.int64)
                # a rank reads the values of the rows it is handed: at least the commit rank 0 saw them in
                while found.size and self.store.generation < seen[1] and not self.store.pinned:
                    self.store.refresh()
                    time.sleep(0.001)
        if found is None:  # (ranks without torch.distributed: each its own view)
            found = self._newly_ready()
        if found.size:
            self._polls += 1
            self._ready[found] = self._polls
            self._layout = None

    def _newly_ready(self) -> np.ndarray:
        """Indices of the waiting rows not ready before that have every required column now. Values
        only arrive with a commit, so a poll at the generation checked last reads nothing, and rows
        known ready are never read again."""
        waiting = np.flatnonzero(self._ready < 0)
        generation = self.store.generation
        if not waiting.size or generation == self._checked:
            return np.zeros(0, np.int64)
        self._checked = generation
        return waiting[self._have_all(self._pending[waiting])]

    def _have_all(self, rows: np.ndarray) -> np.ndarray:
        """Per row, whether every required column has a value for it; each column reads only the rows
        the columns before it found values for."""
        have = np.ones(rows.size, bool)
        for name in self.require:
            have[have] = self._has(name, rows[have])
        return have

    def _missing(self, rows: np.ndarray) -> Dict[str, np.ndarray]:
        """For each required column, those of ``rows`` without a value in it."""
        return {name: rows[~self._has(name, rows)] for name in self.require}

    def _has(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Per row, whether column ``name`` has a value for it (none: a column the store lacks yet)."""
        have = np.zeros(rows.size, bool)
        if name in self.store.columns:
            read = getattr(self.store, "read_ranges", self.store.read)  # a ragged column's values: not copied
            for start in range(0, rows.size, _READY_CHUNK):
                part = rows[start:start + _READY_CHUNK]
                have[start:start + part.size] = _has_value(read(part, columns=[name])[name], part.size)
        return have

    def _adopt(self, rows: np.ndarray, since: Optional[np.ndarray], ready: Optional[np.ndarray] = None) -> None:
        """Add ``rows`` (ascending, above the pending ones) to the waiting rows (``ready``: their marks
        from a saved cursor; new rows are checked at the next poll)."""
        if rows.size == 0:
            return
        columns = ([self.group_key] if self.group_size > 1 else []) + \
                  ([self.policy_version_key] if self.max_policy_lag is not None else [])
        if self.max_policy_lag is not None and self.policy_version_key != ROW_VERSION_KEY and \
                ROW_VERSION_KEY in self.store.columns:
            columns.append(ROW_VERSION_KEY)  # for rows without per-token versions
        data = self.store.read(rows, columns=columns) if columns else {}
        if self.max_policy_lag is not None and self.policy_version_key not in data:
            raise ColumnNotFoundError(f"{self.store.path} has no {self.policy_version_key!r} column for "
                                      f"max_policy_lag (columns: {self.store.columns}); pass policy_version_key=")
        self._pending = np.concatenate([self._pending, rows])
        now = np.full(rows.size, boot_clock()) if since is None else since
        self._since = np.concatenate([self._since, now])
        if self.group_size > 1:
            keys = data[self.group_key]
            # integer keys stay integers (their sort, at every change of the waiting rows, is ~10x cheaper)
            if not (isinstance(keys, np.ndarray) and keys.dtype == np.int64 and
                    (self._keys.dtype == np.int64 or not self._keys.size)):
                keys = np.empty(rows.size, object)
                keys[:] = list(data[self.group_key])
                self._keys = self._keys.astype(object, copy=False)
            self._keys = np.concatenate([self._keys, keys]) if self._keys.size else keys
        self._versions = np.concatenate([self._versions, self._row_versions(data, rows.size)])
        if ready is None:
            ready = np.full(rows.size, -1 if self.require else 0, np.int64)
        self._ready = np.concatenate([self._ready, ready])
        self._checked, self._layout = None, None

    def _row_versions(self, data: Dict[str, Any], n: int) -> np.ndarray:
        column = data.get(self.policy_version_key)
        if column is None:
            return np.full(n, np.nan)
        if isinstance(column, RaggedColumn):  # per token: the row is as old as its oldest token
            lengths = np.diff(column.offsets)
            values = column.values.astype(np.float64)
            if column.validity is not None:  # (per row: a row without the column has no tokens of it)
                values = np.where(np.repeat(column.validity, lengths), values, np.inf)
            out = np.full(n, np.inf)
            nonempty = lengths > 0
            if nonempty.any():
                out[nonempty] = np.minimum.reduceat(values, column.offsets[:-1][nonempty])
            out[np.isinf(out)] = np.nan
            # a row that left its per-token versions out (None: generated under one policy) is as old as its
            # per-row version; without one it is not old
            row = data.get(ROW_VERSION_KEY)
            if row is not None and not isinstance(row, RaggedColumn) and np.isnan(out).any():
                row = np.asarray(row, np.float64).reshape(n, -1).min(axis=1)
                out = np.where(np.isnan(out), row, out)
            return out
        return np.asarray(column, np.float64).reshape(n, -1).min(axis=1)

    def _drop_evicted(self, head: int) -> None:
        holes = [(a, b) for a, b in getattr(self.store, "holes", ()) if self._pending.size and a <= self._pending[-1]]
        if self._pending.size and (self._pending[0] < head or holes):
            keep = self._pending >= head
            for a, b in holes:
                keep &= (self._pending < a) | (self._pending >= b)
            lost = set(self._keys[~keep].tolist()) if self.group_size > 1 else set()
            self._counts["evicted"] += int((~keep).sum())
            self._remove(~keep)
            self._cut(np.fromiter((k in lost for k in self._keys.tolist()), bool, len(self._keys)))

    def _remove(self, gone: np.ndarray) -> None:
        if not gone.any():
            return
        keep = ~gone
        self._pending, self._since, self._versions = self._pending[keep], self._since[keep], self._versions[keep]
        self._ready, self._layout = self._ready[keep], None
        if self.group_size > 1:
            self._keys = self._keys[keep]

    def _units(self) -> Tuple[np.ndarray, np.ndarray]:
        """The ready units (rows of indices into the waiting rows, ascending) in the order they
        became ready, and the indices of the other waiting rows (groups short of rows, or units a
        required column has no value for yet). Kept while nothing changes: a poll that finds no new
        commit costs no sort of the waiting rows' keys (read-only arrays: callers index them)."""
        if self._layout is None:
            self._layout = self._ready_units()
        return self._layout

    def _ready_units(self) -> Tuple[np.ndarray, np.ndarray]:
        members, short = self._groups()
        if not self.require:
            return members, short
        marks = self._ready[members]
        ready = (marks >= 0).all(axis=1)
        members, waiting = members[ready], np.sort(np.concatenate([short, members[~ready].ravel()]))
        # by the poll that found a unit's last row ready, then (as without require) by its last row
        return members[np.lexsort((members[:, -1], marks[ready].max(axis=1)))], waiting

    def _groups(self) -> Tuple[np.ndarray, np.ndarray]:
        """The units complete in rows (rows of indices into the waiting rows, ascending) in the order
        they completed, and the indices of rows of groups still short of rows."""
        n = self.group_size
        if n == 1:
            return np.arange(len(self._pending)).reshape(-1, 1), np.zeros(0, np.int64)
        _, inverse = np.unique(self._keys, return_inverse=True)
        order = np.argsort(inverse, kind="stable")           # by key, rows ascending within a key
        sorted_keys = inverse[order]
        starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        rank_in_key = np.arange(order.size) - np.repeat(starts, np.diff(np.r_[starts, order.size]))
        count_of_key = np.bincount(inverse)[sorted_keys]
        complete = rank_in_key < count_of_key // n * n       # the first n*k rows of a key make k groups
        members = order[complete].reshape(-1, n)
        members.sort(axis=1)
        return members[np.argsort(members[:, -1], kind="stable")], np.sort(order[~complete])  # completion order

    def _take(self, units: int, policy_version: Optional[int]) -> Optional[np.ndarray]:
        """The next ``units`` fresh ready units as a (units, group_size) array of row ids (removed
        from the waiting rows), or None; stale units before them are skipped either way."""
        if len(self._pending) < units * self.group_size:
            return None
        ready = self._units()[0]
        old = np.zeros(len(ready), bool)
        stale_below = None if self.max_policy_lag is None else policy_version - self.max_policy_lag
        if stale_below is not None:  # a unit is as old as its oldest row; a row without a version is not old
            old = np.where(np.isnan(self._versions), np.inf, self._versions)[ready].min(axis=1) < stale_below
        fresh = np.flatnonzero(~old)[:units]
        end = fresh[-1] + 1 if fresh.size == units else len(ready)
        gone = np.zeros(len(self._pending), bool)
        gone[ready[:end][old[:end]].ravel()] = True
        if gone.any():
            self._counts["stale"] += int(gone.sum())
            self._warn_once("stale", f"stream {self.name!r} skipped rows older than policy version "
                                     f"{stale_below} (max_policy_lag={self.max_policy_lag}); stats()['stale'] "
                                     "counts them")
        if fresh.size < units:
            self._remove(gone)
            return None
        taken = self._pending[ready[fresh]]
        gone[ready[fresh].ravel()] = True
        self._remove(gone)
        self._counts["handed_out"] += taken.size
        return taken

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------ what is waiting

    def incomplete_groups(self, older_than: float = 0.0) -> List[Dict[str, Any]]:
        """Groups (rows, with ``group_size=1``) not ready that have waited ``older_than`` seconds or
        more, oldest first: ``{"key", "rows", "waiting_s", "missing"}`` each, ``missing`` naming, for
        each ``require`` column, the rows without a value in it; a group short of ``group_size`` rows
        has fewer ``rows`` (``key`` is None on a stream of single rows)."""
        out = self._waiting(older_than)
        for g in out:
            g["missing"] = self._missing(g["rows"])
        return out

    def _waiting(self, older_than: float) -> List[Dict[str, Any]]:
        members, short = self._groups()
        units: Dict[Any, List[int]] = {}
        for i in short.tolist():
            units.setdefault(("short", self._keys[i]), []).append(i)
        if self.require:
            for unit in members[(self._ready[members] < 0).any(axis=1)]:
                units[("columns", int(unit[0]))] = unit.tolist()
        now = boot_clock()  # this process's clock since it (or the cursor it loaded) first saw the rows
        out = [{"key": self._keys[idx[0]] if self.group_size > 1 else None, "rows": self._pending[idx],
                "waiting_s": now - float(self._since[idx].min())} for idx in map(np.asarray, units.values())]
        return sorted((g for g in out if g["waiting_s"] >= older_than), key=lambda g: -g["waiting_s"])

    def drop_incomplete(self, older_than: float) -> int:
        """Give up the groups (rows) not ready that waited ``older_than`` seconds or more (counted in
        ``stats()["dropped_incomplete"]``); returns how many rows were dropped."""
        dropped = {int(r) for g in self._waiting(older_than) for r in g["rows"]}
        if dropped:
            self._remove(np.isin(self._pending, np.fromiter(dropped, np.int64)))
            self._counts["dropped_incomplete"] += len(dropped)
        return len(dropped)

    def stats(self) -> Dict[str, int]:
        """Counts: rows ``handed_out`` and ``batches``; rows skipped as ``stale``, ``evicted`` before
        the stream reached them, ``dropped_incomplete``; rows ``waiting`` and the ``position``."""
        return {**self._counts, "waiting": int(len(self._pending)), "position": self.position,
                "next_row": self._next_row}

    def __repr__(self) -> str:
        return (f"RolloutStream({self.name!r}, group_size={self.group_size}, position={self.position}, "
                f"waiting={len(self._pending)})")
