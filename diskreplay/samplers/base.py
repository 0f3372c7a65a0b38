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

One module: the parts every sampler shares (checks, live-row bookkeeping, ranks, the state
envelope), kept together so that each strategy's module holds only its draw.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterable, Optional, Tuple

import numpy as np

from ..errors import ArgumentError, DiskReplayError, FormatError, SamplerError, SettingError
from ..ragged import is_int as _is_int
from .kernels import Ranges, in_ranges, merge_ranges

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


def check_exclude(value: Any) -> Ranges:
    """``exclude=``: row-id ranges ``[(start, stop), ...]`` (stop exclusive), as canonical :data:`Ranges`."""
    if value is None:
        return ()
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise SamplerError(f"exclude must be a list of (start, stop) row-id ranges, got {value!r:.80}; pass e.g. "
                           "exclude=[(16, 32)] to never draw rows 16..31")
    pairs = []
    for i, pair in enumerate(value):
        if isinstance(pair, np.ndarray):
            pair = pair.tolist()
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(_is_int(v) for v in pair):
            raise SamplerError(f"exclude[{i}]={pair!r:.80} is not a (start, stop) pair of integer row ids; pass "
                               "e.g. exclude=[(16, 32)]")
        start, stop = int(pair[0]), int(pair[1])
        if start < 0 or stop < start:
            raise SamplerError(f"exclude[{i}]=({start}, {stop}) is not a row-id range: it needs 0 <= start <= "
                               "stop (stop is exclusive)")
        pairs.append((start, stop))
    return merge_ranges(pairs)


def check_min_row(value: Any) -> Optional[int]:
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise SamplerError(f"min_row must be a row id >= 0 or None, got {value!r}; rows below it are never drawn")
    return int(value)


@dataclass(frozen=True)
class RowFilter:
    """Which live rows a draw may take: ``policy_version >= bound`` and outside ``blocked``.

    ``blocked`` holds ``exclude`` and, for ``min_row``, the range ``[0, min_row)``,
    merged, so one canonical value says which rows are off limits (equal
    filters draw from equal rows, which is what the caches key on).
    """

    bound: Optional[float] = None
    exclude: Ranges = ()
    min_row: Optional[int] = None

    @property
    def blocked(self) -> Ranges:
        if not self.min_row:
            return self.exclude
        return merge_ranges(self.exclude + ((0, self.min_row),))

    def __bool__(self) -> bool:
        return self.bound is not None or bool(self.exclude) or bool(self.min_row)

    def describe(self, version_key: str) -> str:
        """The conditions, worded to follow "row" in error messages ("" when there are none)."""
        parts = []
        if self.bound is not None:
            parts.append(f"with {version_key} >= {self.bound}")
        if self.exclude:
            shown = ", ".join(f"[{a}, {b})" for a, b in self.exclude[:4]) + (", ..." if len(self.exclude) > 4 else "")
            parts.append(f"outside exclude={shown}")
        if self.min_row:
            parts.append(f"at or above min_row={self.min_row}")
        return (" " + ", ".join(parts)) if parts else ""

    def fix(self) -> str:
        """The ways to widen the filter, for error messages."""
        ways = [w for w, on in (("lower min_policy_version", self.bound is not None),
                                ("exclude fewer rows", bool(self.exclude)),
                                ("lower min_row", bool(self.min_row))) if on]
        return (" or " + " or ".join(ways)) if ways else ""


def no_groups(groups: Any, sampler: str) -> None:
    """``groups=`` is in every sampler's signature (one call shape); only group samplers can honour it."""
    if groups is not None:
        raise SamplerError(f"{sampler} draws single rows and cannot draw named groups (groups={groups!r:.60}); use "
                           "PromptGroupSampler for groups=, or pass groups=None")


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
    """Refuse ``name`` unless it is a per-row numeric column of ``store``, or ``column@version``: a
    named version of one that ``store.versions(column)`` lists (``ReplayStore.update(...,
    version=...)``; a read gives NaN where that version has no value)."""
    if name not in store.columns:
        column, at, version = name.rpartition("@")
        versions = store.versions(column) if at and column in store.columns and hasattr(store, "versions") else None
        if versions is not None and version not in versions:
            raise SamplerError(f"{arg}={name!r}: column {column!r} of the store at {store.path} has no version "
                               f"{version!r} (its versions: {sorted(versions)}); pass one of them as "
                               f"'{column}@VERSION', or {column!r} for the newest values")
        if versions is None:
            raise SamplerError(f"{arg}={name!r} is not a column of the store at {store.path} (columns: "
                               f"{store.columns}); pass the name of a per-row numeric column (or "
                               "'column@version' for a named version of one)")
        name = column
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
    A ``fill`` reading one store column (:class:`ColumnFill`) also reads again
    the rows a patch committed since wrote that column for (``store.update``).
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
        # dtype=None keeps what fill returns (promoted if later rows need more): an int64 column must
        # not round through float64, where every int64 above 2**53 in size collapses onto a neighbour
        self._adopt = dtype is None
        self._buf = np.zeros(0, dtype=np.float64 if dtype is None else dtype)
        self._start = self._n = 0
        self.epoch = 0  # counts restarts (another store, a restored state): values before it are gone
        self._patches: Any = ()  # the store's patches whose values are in

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
        self._buf = np.array(values, dtype=None if self._adopt else self._buf.dtype)
        self._start, self._n = 0, len(values)
        self.epoch += 1

    def _reset(self, base: int) -> None:
        self.base, self._start, self._n = base, 0, 0
        self.epoch += 1

    def _append(self, new: np.ndarray) -> None:
        if self._adopt:
            dtype = new.dtype if not self._n else np.result_type(self._buf.dtype, new.dtype)
            if dtype != self._buf.dtype:
                self._buf, self._start = self.values.astype(dtype), 0
        new = new.astype(self._buf.dtype, copy=False)
        n = len(new)
        if self._start + self._n + n > len(self._buf):
            size = max(16, 2 * (self._n + n))
            buf = np.empty(size, dtype=self._buf.dtype)
            buf[:self._n] = self.values
            self._buf, self._start = buf, 0
        self._buf[self._start + self._n:self._start + self._n + n] = new
        self._n += n

    def sync(self, store: Any) -> bool:
        """Cover ``store``'s live rows; True if the rows held changed.

        An older snapshot of the same store (fewer rows at the end, or rows at
        the front that a newer view evicted) keeps what is held: its rows are
        a subset, and rows never change, so the values of the rows after its
        end (sampler state: priorities, counts) stay for the newer view. Rows
        before ``head`` go: they are evicted in this view, and no later one
        brings them back.
        """
        head, nxt, end = store.head, store.next_row, self.end
        same_store = self.path is None or self.path == store.path
        self.path = store.path
        if same_store and head == self.base and nxt <= end:
            return self._read_patched(store)
        if not same_store or nxt < head or (self._n and head >= end):
            self._reset(head)
            end = head
        if head < self.base:  # an older view, where rows that a newer one evicted are live
            front = np.asarray(self.fill(store, head, self.base))
            values = self.values.copy()
            self._start, self._n, self.base = 0, 0, head
            self._append(front)
            self._append(values)
            self.epoch += 1
            end = self.end
        if head > self.base:
            drop = min(head - self.base, self._n)
            self._start, self._n = self._start + drop, self._n - drop
            self.base, end = head, max(end, head)
            if not self._n:
                self._start = 0
        if nxt > end:
            self._append(np.asarray(self.fill(store, end, nxt)))
        self._read_patched(store)
        return True

    def _read_patched(self, store: Any) -> bool:
        """Read again the rows that patches committed since the last call hold values of the
        column ``fill`` reads (a patch's span of rows, once per patch)."""
        column = getattr(self.fill, "column", None)
        patches = getattr(getattr(store, "manifest", None), "patches", ())
        if column is None or patches == self._patches:
            return False
        seen, self._patches = set(self._patches), patches
        for p in patches:
            lo, hi = max(p.first_row, self.base), min(p.end_row, self.end)
            # "rewards@judge-v2" reads the patches of "rewards" that name that version
            if p not in seen and (column in p.columns or column.rpartition("@")[0] in p.columns) and lo < hi:
                self.values[lo - self.base:hi - self.base] = np.asarray(self.fill(store, lo, hi))
        return True

    def live(self, store: Any) -> np.ndarray:
        """Values of rows ``[store.head, store.next_row)`` (a view)."""
        self.sync(store)
        return self.values[store.head - self.base:store.next_row - self.base]

    def get(self, rows: Any, default: Any = 0) -> np.ndarray:
        """Values of ``rows`` (``default`` for rows outside ``[base, end)``)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out = np.full(len(rows), default, dtype=self._buf.dtype)
        inside = self.covers(rows)
        out[inside] = self.values[rows[inside] - self.base]
        return out

    def covers(self, rows: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``rows`` have a value (lie in ``[base, end)``)."""
        return (rows >= self.base) & (rows < self.end)

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
        return read_around_holes(store, start, stop, lambda rows: np.asarray(store.read(rows, [self.column])[self.column]))


def read_around_holes(store: Any, start: int, stop: int, read: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``read(rows)`` of the rows ``[start, stop)``, one value per row, with 0 for the rows of the
    store's holes (``store.holes``: rows a repair dropped, which no read serves and no draw takes)."""
    rows = np.arange(start, stop, dtype=np.int64)
    holes = tuple((a, b) for a, b in getattr(store, "holes", ()) if a < stop and b > start)
    if not holes:
        return read(rows)
    keep = ~in_ranges(rows, holes)
    got = read(rows[keep])
    out = np.zeros((len(rows),) + got.shape[1:], got.dtype)
    out[keep] = got
    return out


def live_column(column: str, arg: str = "column", allow_vector: bool = False, dtype: Any = np.float64) -> LiveRows:
    """A :class:`LiveRows` of one numeric per-row store column, read once per row.

    ``dtype=None`` keeps the column's own dtype (an int64 column stays exact).

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [1, 2], "score": [0.5, 1.5], "step": [2**62 + 1, 3]})
    >>> live_column("score").live(store).tolist()
    [0.5, 1.5]
    >>> live_column("step", dtype=None).live(store).tolist() == [2**62 + 1, 3]
    True
    """
    return LiveRows(ColumnFill(column, arg, allow_vector), dtype)


def _zeros(store: Any, start: int, stop: int) -> np.ndarray:
    return np.zeros(stop - start, dtype=np.int64)


def _copied(value: Any) -> Any:
    """A copy of a position (its arrays are shared with the sampler, which never writes them; callers may)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value.copy() if isinstance(value, np.ndarray) else value


class Eligible:
    """The live rows ``[head, next_row)`` a :class:`RowFilter` lets through.

    ``mask`` (read-only, aligned with the live rows), ``count``, and ``ids``
    (the positions of the eligible rows, from ``head``; computed once, when
    first asked for).
    """

    def __init__(self, mask: np.ndarray) -> None:
        mask.flags.writeable = False
        self.mask = mask
        self.count = int(np.count_nonzero(mask))
        self._ids: Optional[np.ndarray] = None

    @property
    def ids(self) -> np.ndarray:
        if self._ids is None:
            self._ids = np.flatnonzero(self.mask)
            self._ids.flags.writeable = False
        return self._ids


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
    what one sampler with ``world_size=1`` would draw for the global batch
    (for a ``PromptGroupSampler(num_groups=G)`` that one has ``num_groups=G *
    world_size``: ``G`` is per rank). Ranks follow a live writer only through
    an agreed generation (:func:`~diskreplay.samplers.agree_generation`): two
    ranks that refresh a reader on their own may sit on both sides of a commit.

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
    #: settings of ``_CONFIG`` that a saved state need not match (a run changes them as it goes)
    _TUNED: Tuple[str, ...] = ()

    seed = Setting(lambda n, v: check_seed(v), mutable=False,
                   why=" (it only seeds the RNG; load_state_dict() moves a stream)")
    rank = Setting(lambda n, v: v, mutable=False)
    world_size = Setting(lambda n, v: v, mutable=False)
    policy_version_key = Setting(lambda n, v: check_column(n, v), mutable=False)

    def __init__(self, seed: Any, policy_version_key: str, rank: Any = 0, world_size: Any = 1) -> None:
        # a value of the wrong type is also a TypeError (ArgumentError), one out of range a ValueError
        if not _is_int(world_size) or world_size < 1:
            raise (SamplerError if _is_int(world_size) else ArgumentError)(
                f"world_size must be a positive integer, got {world_size!r}; pass the number of trainer ranks "
                "(torch.distributed.get_world_size())")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise (SamplerError if _is_int(rank) else ArgumentError)(
                f"rank must be an integer in [0, world_size={world_size}), got {rank!r}; pass "
                "torch.distributed.get_rank()")
        self.rank, self.world_size = int(rank), int(world_size)
        self.seed = seed
        self.policy_version_key = policy_version_key
        # PCG64 explicitly (not default_rng) so the saved state names its generator
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._counts = LiveRows(_zeros, np.int64)  # how many times each live row was drawn (by this rank)
        # the column's own dtype: a bound compares exactly against int64 versions
        self._versions = live_column(policy_version_key, "policy_version_key", dtype=None)
        self._eligible_cache: Tuple[Any, Optional[Eligible]] = (None, None)
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
        """This rank's slice of a global batch (of a shorter one, the end of a pass: an even share)."""
        if self.world_size == 1:
            return rows
        if len(rows) < self._global(batch_size):
            return np.array_split(rows, self.world_size)[self.rank]
        return rows[self.rank * batch_size:(self.rank + 1) * batch_size]

    def _filter(self, min_policy_version: Any, exclude: Any, min_row: Any) -> RowFilter:
        """The checked keywords of a draw, as one value."""
        return RowFilter(check_bound(min_policy_version), check_exclude(exclude), check_min_row(min_row))

    def _eligible(self, store: Any, filt: RowFilter) -> Optional[Eligible]:
        """The live rows ``filt`` lets through (None: all of them).

        Kept while the store's live rows and the filter stay the same (rows
        never change after their commit), so repeated draws with an unchanged
        exclusion cost nothing here.
        """
        holes = getattr(store, "holes", ())  # rows a repair dropped: never drawn
        if not filt and not holes:
            return None
        head, nxt = store.head, store.next_row
        key = (store.path, head, nxt, filt, holes)
        if self._eligible_cache[0] == key:
            return self._eligible_cache[1]
        if filt.bound is None:
            mask = np.ones(nxt - head, dtype=bool)
        else:
            mask = self._versions.live(store) >= filt.bound
        for a, b in filt.blocked + holes:
            lo, hi = max(a, head), min(b, nxt)
            if lo < hi:
                mask[lo - head:hi - head] = False
        found = Eligible(mask)
        self._eligible_cache = (key, found)
        return found

    def eligible(self, store: Any, *, min_policy_version: Optional[float] = None, exclude: Any = None,
                 min_row: Optional[int] = None) -> Optional[np.ndarray]:
        """Which live rows ``[head, next_row)`` a draw with these keywords may take (None: every live row).

        The same rule :meth:`sample` applies (a boolean mask aligned with the
        live rows, read-only; a prioritized draw also skips rows of weight 0).
        Callers that plan around a draw (count a group's eligible rows, say)
        use it so that they and the sampler never disagree.

        >>> import tempfile
        >>> from diskreplay import ReplayStore, RandomSampler
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0] * 6, "policy_version": [0, 1, 2, 3, 4, 5]})
        >>> RandomSampler().eligible(store, min_policy_version=1, exclude=[(2, 4)]).tolist()
        [False, True, False, False, True, True]
        >>> RandomSampler().eligible(store) is None
        True
        """
        found = self._eligible(store, self._filter(min_policy_version, exclude, min_row))
        return None if found is None else found.mask

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
        ('RandomSampler', ['cursor', 'draws', 'pass', 'pass_head', 'pass_next_row', 'ran_out', 'rng'], ['counts', 'counts_base'])
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
        # the knobs a run turns as it goes (beta annealed) need not match: this sampler keeps its own
        fixed = {n: v for n, v in mine.items() if n not in self._TUNED}
        if not isinstance(saved, dict) or set(saved) != set(mine) or {n: saved[n] for n in fixed} != fixed:
            raise SamplerError(f"the state was saved by {type(self).__name__} with config {saved!r}, but this "
                               f"sampler has {mine!r}; build the sampler with the saved configuration"
                               + (f" ({', '.join(self._TUNED)} may differ)" if self._TUNED else ""))
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
