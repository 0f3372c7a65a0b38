"""What every sampler shares: argument checks, per-row bookkeeping, settings, ranks and the state envelope.

The state envelope (``state_dict()``) has two parts:

- ``position``: what decides the next draws (the RNG, a pass's cursor, the
  number of draws so far). It is small, and its arrays are never modified
  after :meth:`Sampler.position` hands them out, so a loader can keep one per
  prefetched batch without copying anything.
- ``data``: per-live-row values the sampler keeps (sample counts,
  priorities). A loader asks for them once, when it checkpoints:
  ``sampler.state_dict(position=p)`` combines the live data with the position
  ``p`` of the last batch the consumer received (counts of draws made after
  ``p`` are taken back out).

``config`` records the settings; a state loads only into a sampler built with
the same ones (the seed may differ).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Deque, Dict, Optional, Tuple

import numpy as np

from ..errors import DiskReplayError, FormatError, SamplerError, SettingError
from ..ragged import is_int as _is_int

STATE_FORMAT = "diskreplay.sampler"
STATE_VERSION = 2
# draws remembered so that state_dict(position=...) can take back the counts of draws made after a
# position: a loader's prefetched batches (a few) are far fewer
RECENT_DRAWS = 1024


# --------------------------------------------------------------------------- argument checks


def positive(name: str, value: Any, fix: str) -> int:
    if not _is_int(value) or value <= 0:
        raise SamplerError(f"{name} must be a positive integer, got {value!r}; {fix}")
    return int(value)


def check_seed(seed: Any) -> Optional[int]:
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise SamplerError(f"seed must be a non-negative integer or None, got {seed!r}; pass e.g. seed=0")
    return None if seed is None else int(seed)


def check_bound(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or np.isnan(value):
        raise SamplerError(f"min_policy_version must be a number or None, got {value!r}; pass the oldest "
                           "policy version a row may come from")
    return value


def check_number(name: str, value: Any, example: float, allow_none: bool = False) -> Optional[float]:
    """A finite number >= 0 (or None where allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value) or value < 0:
        extra = " or None" if allow_none else ""
        raise SamplerError(f"{name} must be a finite number >= 0{extra}, got {value!r}; pass e.g. {name}={example}")
    return float(value)


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise SamplerError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_column(name: str, value: Any, allow_none: bool = False) -> Optional[str]:
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or not value:
        extra = " or None (the store's key)" if allow_none else ""
        raise SamplerError(f"{name} must be a column name{extra}, got {value!r}")
    return value


def numeric_column(store: Any, name: str, arg: str, allow_vector: bool = True) -> None:
    if name not in store.columns:
        raise SamplerError(f"{arg}={name!r} is not a column of the store at {store.path} (columns: "
                           f"{store.columns}); pass the name of a per-row numeric column")
    spec = store.schema[name]
    if spec.kind == "ragged" or spec.dtype == "string" or (spec.kind == "vector" and not allow_vector):
        want = "per-row numeric" if allow_vector else "per-row scalar numeric"
        raise SamplerError(f"{arg}={name!r} is a {spec.kind} column of dtype {spec.dtype}; it must be a {want} "
                           f"column; pass another column as {arg}")


def as_array(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


# --------------------------------------------------------------------------- settings


class Setting:
    """A validated sampler setting: ``mutable`` ones take effect on the next draw, the others refuse assignment.

    ``changed`` names a method called after a mutable setting changes (to drop
    a cache that depends on it).
    """

    def __init__(self, check: Callable[[str, Any], Any], mutable: bool = True, changed: Optional[str] = None,
                 why: str = "") -> None:
        self.check, self.mutable, self.changed, self.why = check, mutable, changed, why

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        return obj.__dict__[self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        first = self.name not in obj.__dict__
        if not first and not self.mutable:
            raise SettingError(f"{type(obj).__name__}.{self.name} is fixed at construction{self.why}; build a new "
                               f"sampler with {self.name}={value!r}")
        obj.__dict__[self.name] = self.check(self.name, value)
        if not first and self.changed is not None:
            getattr(obj, self.changed)()


# --------------------------------------------------------------------------- per-row bookkeeping


class LiveRows:
    """Per-row values aligned with a store's live rows ``[head, next_row)``.

    Rows never change after their commit, so :meth:`sync` only drops evicted
    rows from the front and appends ``fill(store, start, stop)`` for rows
    committed since the last call; both are amortised O(rows changed) (the
    values sit in a buffer with room at the back, compacted when it fills).
    Another store (or one that went back) starts over. A cache of the store,
    or sampler state where ``fill`` makes it so (counts, priorities).

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp(), capacity=3)
    >>> _ = store.extend({"prompt_id": [0, 1]})
    >>> seen = LiveRows(lambda store, start, stop: np.arange(start, stop) * 10.0)
    >>> seen.live(store).tolist()
    [0.0, 10.0]
    >>> _ = store.extend({"prompt_id": [2, 3]})   # row 0 is evicted, rows 2 and 3 arrive
    >>> seen.base, seen.live(store).tolist()
    (0, [10.0, 20.0, 30.0])
    """

    def __init__(self, fill: Callable[[Any, int, int], np.ndarray], dtype: Any = np.float64) -> None:
        self.fill = fill
        self.path: Optional[str] = None
        self.base = 0
        self._buf = np.zeros(0, dtype=dtype)
        self._start = self._n = 0
        self.epoch = 0  # counts restarts (another store, a restored state): values before it are gone

    @property
    def values(self) -> np.ndarray:
        """The values of rows ``[base, end)``: a view, writable in place."""
        return self._buf[self._start:self._start + self._n]

    @property
    def end(self) -> int:
        return self.base + self._n

    def restore(self, base: int, values: np.ndarray) -> None:
        """Take saved values of rows ``[base, base + len(values))`` (from a state dict)."""
        self.path, self.base = None, int(base)
        self._buf, self._start, self._n = np.array(values, dtype=self._buf.dtype), 0, len(values)
        self.epoch += 1

    def _reset(self, base: int) -> None:
        self.base, self._start, self._n = base, 0, 0
        self.epoch += 1

    def _append(self, new: np.ndarray) -> None:
        n = len(new)
        if self._start + self._n + n > len(self._buf):
            size = max(16, 2 * (self._n + n))
            buf = np.empty(size, dtype=self._buf.dtype)
            buf[:self._n] = self.values
            self._buf, self._start = buf, 0
        self._buf[self._start + self._n:self._start + self._n + n] = new
        self._n += n

    def sync(self, store: Any) -> bool:
        """Align with ``store``'s live rows; True if the rows changed."""
        head, nxt, end = store.head, store.next_row, self.end
        same_store = self.path is None or self.path == store.path
        self.path = store.path
        if same_store and head == self.base and nxt == end:
            return False
        if not same_store or head < self.base or nxt < end:
            self._reset(head)
            end = head
        if head > self.base:
            drop = min(head - self.base, self._n)
            self._start, self._n = self._start + drop, self._n - drop
            self.base, end = head, max(end, head)
            if not self._n:
                self._start = 0
        if nxt > end:
            self._append(np.asarray(self.fill(store, end, nxt), dtype=self._buf.dtype))
        return True

    def live(self, store: Any) -> np.ndarray:
        """Values of rows ``[store.head, store.next_row)``."""
        self.sync(store)
        return self.values

    def get(self, rows: Any, default: Any = 0) -> np.ndarray:
        """Values of ``rows`` (``default`` for rows outside ``[base, end)``)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out = np.full(len(rows), default, dtype=self._buf.dtype)
        inside = (rows >= self.base) & (rows < self.end)
        out[inside] = self.values[rows[inside] - self.base]
        return out

    def add(self, rows: np.ndarray, amount: np.ndarray) -> None:
        """Add ``amount`` to the values of ``rows`` that are inside ``[base, end)`` (repeats add up)."""
        inside = (rows >= self.base) & (rows < self.end)
        np.add.at(self.values, rows[inside] - self.base, amount if np.ndim(amount) == 0 else amount[inside])


class ColumnFill:
    """``fill`` of a :class:`LiveRows` reading one numeric per-row store column (a picklable callable)."""

    def __init__(self, column: str, arg: str = "column", allow_vector: bool = False) -> None:
        self.column, self.arg, self.allow_vector = column, arg, allow_vector

    def __call__(self, store: Any, start: int, stop: int) -> np.ndarray:
        numeric_column(store, self.column, self.arg, allow_vector=self.allow_vector)
        return np.asarray(store.read(np.arange(start, stop, dtype=np.int64), [self.column])[self.column])


def live_column(column: str, arg: str = "column", allow_vector: bool = False) -> LiveRows:
    """A :class:`LiveRows` of one numeric per-row store column, read once per row.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [1, 2], "score": [0.5, 1.5]})
    >>> live_column("score").live(store).tolist()
    [0.5, 1.5]
    """
    return LiveRows(ColumnFill(column, arg, allow_vector))


def _zeros(store: Any, start: int, stop: int) -> np.ndarray:
    return np.zeros(stop - start, dtype=np.int64)


def _copied(value: Any) -> Any:
    """A copy of a position (its arrays are shared with the sampler, which never writes them; callers may)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value.copy() if isinstance(value, np.ndarray) else value


def _restore(cls: type, kwargs: Dict[str, Any], state: Dict[str, Any]) -> "Sampler":
    sampler = cls(**kwargs)
    sampler.load_state_dict(state)
    return sampler


# --------------------------------------------------------------------------- the base class


class Sampler:
    """Seeded RNG, sample counts, ranks, settings and the state envelope every sampler shares.

    ``rank`` / ``world_size``: every rank draws the same global batch of
    ``batch_size * world_size`` rows (same seed, settings and store
    generation give the same draw) and keeps the ``rank``-th slice of
    ``batch_size`` rows, so ranks never overlap and together they see exactly
    what one sampler with ``world_size=1`` would draw for the global batch.

    Pickling (or ``copy.deepcopy``) goes through the settings and
    ``state_dict()``: the copy continues the same stream (caches of store
    data are not carried; they are re-read).

    >>> import copy, tempfile
    >>> from diskreplay import ReplayStore, RandomSampler
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": list(range(8))})
    >>> ranks = [RandomSampler(seed=3, rank=r, world_size=2) for r in range(2)]
    >>> parts = [s.sample(store, 2) for s in ranks]          # two disjoint halves of one batch of 4
    >>> sorted(parts[0].tolist() + parts[1].tolist()) == sorted(RandomSampler(seed=3).sample(store, 4).tolist())
    True
    >>> twin = copy.deepcopy(ranks[0])
    >>> twin.sample(store, 2).tolist() == ranks[0].sample(store, 2).tolist()
    True
    """

    # settings that are constructor arguments, in the order state_dict()'s "config" lists them
    _CONFIG: Tuple[str, ...] = ()

    seed = Setting(lambda n, v: check_seed(v), mutable=False,
                   why=" (it only seeds the RNG; load_state_dict() moves a stream)")
    rank = Setting(lambda n, v: v, mutable=False)
    world_size = Setting(lambda n, v: v, mutable=False)
    policy_version_key = Setting(lambda n, v: check_column(n, v), mutable=False)

    def __init__(self, seed: Any, policy_version_key: str, rank: Any = 0, world_size: Any = 1) -> None:
        if not _is_int(world_size) or world_size < 1:
            raise SamplerError(f"world_size must be a positive integer, got {world_size!r}; pass the number of "
                               "trainer ranks (torch.distributed.get_world_size())")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise SamplerError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}; pass "
                               "torch.distributed.get_rank()")
        self.rank, self.world_size = int(rank), int(world_size)
        self.seed = seed
        self.policy_version_key = policy_version_key
        # PCG64 explicitly (not default_rng) so the saved state names its generator
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._counts = LiveRows(_zeros, np.int64)  # how many times each live row was drawn (by this rank)
        self._versions = live_column(policy_version_key, "policy_version_key")
        self._draws = 0
        self._recent: Deque[Tuple[int, np.ndarray]] = collections.deque(maxlen=RECENT_DRAWS)

    # -- hooks a sampler overrides
    def _position_extra(self) -> Dict[str, Any]:
        return {}

    def _data_extra(self) -> Dict[str, Any]:
        return {}

    def _load(self, position: Dict[str, Any], data: Dict[str, Any]) -> None:
        pass

    # -- pickling: settings + state_dict, the same JSON + arrays a store keeps (no pickle in the store)
    def config(self) -> Dict[str, Any]:
        """The settings (constructor arguments except ``seed``), as ``state_dict()["config"]`` records them.

        >>> from diskreplay import RandomSampler
        >>> RandomSampler(seed=0).config()["replacement"]
        False
        """
        return {name: getattr(self, name) for name in self._CONFIG}

    def __reduce__(self) -> Any:
        return _restore, (type(self), {**self.config(), "seed": self.seed}, self.state_dict())

    # -- shared
    def _global(self, batch_size: int) -> int:
        """The global batch every rank draws."""
        return batch_size * self.world_size

    def _mine(self, rows: np.ndarray, batch_size: int) -> np.ndarray:
        """This rank's slice of a global batch."""
        if self.world_size == 1:
            return rows
        return rows[self.rank * batch_size:(self.rank + 1) * batch_size]

    def _eligible(self, store: Any, bound: Optional[float]) -> Optional[np.ndarray]:
        """Mask over the live rows ``[head, next_row)`` of rows new enough for ``bound`` (None: all)."""
        if bound is None:
            return None
        return self._versions.live(store) >= bound

    def _record(self, rows: np.ndarray) -> np.ndarray:
        """Count a draw of ``rows`` (this rank's) and remember it for ``state_dict(position=...)``."""
        self._counts.add(rows, 1)
        self._draws += 1
        self._recent.append((self._draws, rows))
        return rows

    def sample_counts(self, rows: Any) -> np.ndarray:
        """How many times each of ``rows`` was drawn (0 for rows never drawn or evicted).

        >>> from diskreplay import RandomSampler
        >>> RandomSampler(seed=0).sample_counts([0, 1]).tolist()
        [0, 0]
        """
        return self._counts.get(rows)

    def position(self) -> Dict[str, Any]:
        """The stream position alone (RNG, cursor, draws): small, and never modified afterwards.

        >>> from diskreplay import RandomSampler
        >>> s = RandomSampler(seed=0); p = s.position()
        >>> p["draws"], p["rng"]["bit_generator"]
        (0, 'PCG64')
        """
        st = self._rng.bit_generator.state
        return {"rng": {"bit_generator": st["bit_generator"], "state": dict(st["state"]),
                        "has_uint32": int(st["has_uint32"]), "uinteger": int(st["uinteger"])},
                "draws": self._draws, **self._position_extra()}

    def state_dict(self, position: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Everything that decides the future stream: JSON values and numpy arrays only.

        ``position`` (from :meth:`position`, taken earlier) replaces the current
        position: the state then resumes right after that draw, with the live
        data (priorities) as they are now and the counts of later draws taken
        back out.

        >>> from diskreplay import RandomSampler
        >>> s = RandomSampler(seed=1); d = s.state_dict()
        >>> d["type"], sorted(d["position"]), sorted(d["data"])
        ('RandomSampler', ['cursor', 'draws', 'pass', 'pass_head', 'pass_next_row', 'rng'], ['counts', 'counts_base'])
        """
        counts = self._counts.values.copy()
        if position is None:
            position = self.position()
        else:
            at = position.get("draws") if isinstance(position, dict) else None
            if not isinstance(at, int) or at > self._draws:
                raise SamplerError(f"position must come from this sampler's position(), got {position!r:.80}")
            later = [rows for n, rows in self._recent if n > at]
            if self._draws - at > len(later):
                raise SamplerError(f"position is {self._draws - at} draws old; only the last {RECENT_DRAWS} "
                                   "draws are remembered: checkpoint more often")
            if later:
                undo = np.concatenate(later)
                undo = undo[(undo >= self._counts.base) & (undo < self._counts.end)]
                np.subtract.at(counts, undo - self._counts.base, 1)
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "type": type(self).__name__,
                "config": self.config(), "position": _copied(position),
                "data": {"counts_base": int(self._counts.base), "counts": counts, **self._data_extra()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a ``state_dict()``; the sampler then continues the saved stream exactly.

        The sampler must be built with the same settings (strategy, sizes,
        column names, rank, ...) as the one that saved the state; the seed may
        differ. The state is copied: changing it afterwards changes nothing here.

        >>> from diskreplay import RandomSampler
        >>> a, b = RandomSampler(replacement=True, seed=1), RandomSampler(replacement=True, seed=2)
        >>> b.load_state_dict(a.state_dict())
        >>> b.state_dict()["position"]["rng"] == a.state_dict()["position"]["rng"]
        True
        """
        if not isinstance(state, dict):
            raise SamplerError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        fmt, ver = state.get("format"), state.get("version")
        if fmt != STATE_FORMAT or ver != STATE_VERSION:
            raise FormatError(f"Unsupported sampler state format={fmt!r} version={ver!r}; expected "
                              f"format={STATE_FORMAT!r} version={STATE_VERSION}")
        if state.get("type") != type(self).__name__:
            raise SamplerError(f"the state was saved by a {state.get('type')!r}, not a {type(self).__name__!r}; "
                               "load it into a sampler of the same class")
        saved, mine = state.get("config"), self.config()
        if saved != mine:
            raise SamplerError(f"the state was saved by {type(self).__name__} with config {saved!r}, but this "
                               f"sampler has {mine!r}; build the sampler with the saved configuration")
        try:
            position, data = state["position"], state["data"]
            rng = position["rng"]
            if rng["bit_generator"] != "PCG64":
                raise SamplerError(f"the saved RNG is {rng['bit_generator']!r}; expected 'PCG64'")
            bitgen = np.random.PCG64()
            bitgen.state = {"bit_generator": "PCG64",
                            "state": {"state": int(rng["state"]["state"]), "inc": int(rng["state"]["inc"])},
                            "has_uint32": int(rng["has_uint32"]), "uinteger": int(rng["uinteger"])}
            counts = np.asarray(data["counts"], dtype=np.int64).reshape(-1)
            base = int(data["counts_base"])
            draws = int(position["draws"])
            self._load(position, data)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DiskReplayError):
                raise
            raise FormatError(f"Unsupported sampler state: {exc!r}; expected a dict from "
                              f"{type(self).__name__}.state_dict()") from None
        self._rng = np.random.Generator(bitgen)
        self._counts.restore(base, counts)
        self._draws = draws
        self._recent.clear()
