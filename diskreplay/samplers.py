"""Samplers: which rows of a store to train on next.

A sampler is a small object holding an RNG and a little bookkeeping (cursor,
priorities, sample counts). ``sampler.sample(store, batch_size, ...)`` returns
an int64 array of global row ids; the caller reads them with ``store.read``.
Sampling never writes to the store. ``state_dict()`` / ``load_state_dict()``
carry everything that decides the future stream (JSON values and numpy arrays
only, no pickle), so ``store.save_state(name, sampler.state_dict())`` and a
restart resume exactly the same stream.

- :class:`PromptGroupSampler` draws whole prompt groups (GRPO, RLOO, DAPO,
  RePO): ``num_groups`` groups of ``samples_per_group`` rows, laid out group by
  group, with a within-group strategy (``random``, ``recency``, ``reward``,
  ``variance``).
- :class:`RandomSampler` draws single rows: shuffled passes without
  replacement, or uniform with replacement.
- :class:`PrioritizedSampler` draws single rows with probability
  ``(|priority| + eps) ** alpha`` (SSR).

Everything that depends on the store is canonical (rows in id order, groups
ordered by their oldest live row), so a store reopened in another process, even
after eviction renumbered its internal group codes, yields the same stream.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .errors import DiskReplayError, FormatError
from .ragged import gather_ranges, is_int as _is_int

__all__ = ["PrioritizedSampler", "PromptGroupSampler", "RandomSampler", "ReplacementWarning", "SamplerError",
           "STRATEGIES"]

STATE_FORMAT = "diskreplay.sampler"
STATE_VERSION = 1
STRATEGIES = ("random", "recency", "reward", "variance")


class SamplerError(DiskReplayError, ValueError):
    """A sampler was built or called with arguments it cannot honour.

    >>> issubclass(SamplerError, ValueError)
    True
    """


class ReplacementWarning(UserWarning):
    """A group draw had to repeat rows or groups (too few eligible ones).

    :class:`PromptGroupSampler` issues it at most once per sampler instance.

    >>> issubclass(ReplacementWarning, UserWarning)
    True
    """


# --------------------------------------------------------------------------- argument checks


def _positive(name: str, value: Any, fix: str) -> int:
    if not _is_int(value) or value <= 0:
        raise SamplerError(f"{name} must be a positive integer, got {value!r}; {fix}")
    return int(value)


def _check_seed(seed: Any) -> Optional[int]:
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise SamplerError(f"seed must be a non-negative integer or None, got {seed!r}; pass e.g. seed=0")
    return None if seed is None else int(seed)


def _check_bound(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or np.isnan(value):
        raise SamplerError(f"min_policy_version must be a number or None, got {value!r}; pass the oldest "
                           "policy version a row may come from")
    return value


def _numeric_column(store: Any, name: str, arg: str, allow_vector: bool = True) -> None:
    if name not in store.columns:
        raise SamplerError(f"{arg}={name!r} is not a column of the store at {store.path} (columns: "
                           f"{store.columns}); pass the name of a per-row numeric column")
    spec = store.schema[name]
    if spec.kind == "ragged" or spec.dtype == "string" or (spec.kind == "vector" and not allow_vector):
        want = "per-row numeric" if allow_vector else "per-row scalar numeric"
        raise SamplerError(f"{arg}={name!r} is a {spec.kind} column of dtype {spec.dtype}; it must be a {want} "
                           f"column; pass another column as {arg}")


def _as_scalar(values: np.ndarray) -> np.ndarray:
    """One float64 per row: a ``[n, K]`` vector column is averaged over its trailing axes."""
    values = np.asarray(values)
    if values.ndim > 1:
        return values.reshape(len(values), -1).astype(np.float64).mean(axis=1)
    return values.astype(np.float64, copy=False)


def _as_array(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


# --------------------------------------------------------------------------- bookkeeping shared by samplers


class _LiveRows:
    """Per-row values aligned with a store's live rows ``[head, next_row)``.

    Rows never change after their commit, so :meth:`sync` only drops evicted
    rows from the front and appends ``fill(store, start, stop)`` for rows
    committed since the last call. Another store (or one that went back)
    starts over. A cache of the store, or sampler state where ``fill`` makes it
    so (counts, priorities).
    """

    def __init__(self, fill: Callable[[Any, int, int], np.ndarray], dtype: Any = np.float64) -> None:
        self.fill = fill
        self.path: Optional[str] = None
        self.base = 0
        self.values = np.zeros(0, dtype=dtype)

    @property
    def end(self) -> int:
        return self.base + len(self.values)

    def restore(self, base: int, values: np.ndarray) -> None:
        """Take saved values of rows ``[base, base + len(values))`` (from a state dict)."""
        self.path, self.base, self.values = None, int(base), values

    def sync(self, store: Any) -> bool:
        """Align with ``store``'s live rows; True if the values changed."""
        head, nxt, end = store.head, store.next_row, self.end
        same_store = self.path is None or self.path == store.path
        self.path = store.path
        if same_store and head == self.base and nxt == end:
            return False
        if not same_store or head < self.base or nxt < end:
            self.base, self.values, end = head, self.values[:0], head
        if head > self.base:
            self.values = self.values[min(head - self.base, len(self.values)):]
            self.base, end = head, max(end, head)
        if nxt > end:
            new = self.fill(store, end, nxt)
            self.values = np.concatenate([self.values, new]) if len(self.values) else new
        return True

    def live(self, store: Any) -> np.ndarray:
        """Values of rows ``[store.head, store.next_row)``."""
        self.sync(store)
        return self.values

    def get(self, rows: Any, default: Any = 0) -> np.ndarray:
        """Values of ``rows`` (``default`` for rows outside ``[base, end)``)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out = np.full(len(rows), default, dtype=self.values.dtype)
        inside = (rows >= self.base) & (rows < self.end)
        out[inside] = self.values[rows[inside] - self.base]
        return out


def live_column(column: str, arg: str = "column", allow_vector: bool = False) -> _LiveRows:
    """A :class:`_LiveRows` of one numeric per-row store column, read once per row."""

    def fill(store: Any, start: int, stop: int) -> np.ndarray:
        _numeric_column(store, column, arg, allow_vector=allow_vector)
        return np.asarray(store.read(np.arange(start, stop, dtype=np.int64), [column])[column])

    return _LiveRows(fill)


def _zeros(store: Any, start: int, stop: int) -> np.ndarray:
    return np.zeros(stop - start, dtype=np.int64)


class _SamplerBase:
    """Seeded RNG, sample counts and the state-dict envelope every sampler shares."""

    def __init__(self, seed: Any, policy_version_key: str) -> None:
        self.seed = _check_seed(seed)
        if not isinstance(policy_version_key, str) or not policy_version_key:
            raise SamplerError(f"policy_version_key must be a column name, got {policy_version_key!r}")
        self.policy_version_key = policy_version_key
        # PCG64 explicitly (not default_rng) so the saved state names its generator
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._counts = _LiveRows(_zeros, np.int64)  # how many times each live row was drawn
        self._versions = live_column(policy_version_key, "policy_version_key")

    # -- hooks
    def _config(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _extra_state(self) -> Dict[str, Any]:
        return {}

    def _load_extra(self, state: Dict[str, Any]) -> None:
        pass

    # -- shared
    def _eligible(self, store: Any, bound: Optional[float]) -> Optional[np.ndarray]:
        """Mask over the live rows ``[head, next_row)`` of rows new enough for ``bound`` (None: all)."""
        if bound is None:
            return None
        return self._versions.live(store) >= bound

    def sample_counts(self, rows: Any) -> np.ndarray:
        """How many times each of ``rows`` was drawn (0 for rows never drawn or evicted).

        >>> RandomSampler(seed=0).sample_counts([0, 1]).tolist()
        [0, 0]
        """
        return self._counts.get(rows)

    def state_dict(self) -> Dict[str, Any]:
        """Everything that decides the future stream: JSON values and numpy arrays only.

        >>> s = RandomSampler(seed=1); d = s.state_dict()
        >>> d["type"], d["rng"]["bit_generator"]
        ('RandomSampler', 'PCG64')
        """
        st = self._rng.bit_generator.state
        state = {"format": STATE_FORMAT, "version": STATE_VERSION, "type": type(self).__name__,
                 "config": self._config(),
                 "rng": {"bit_generator": st["bit_generator"], "state": dict(st["state"]),
                         "has_uint32": int(st["has_uint32"]), "uinteger": int(st["uinteger"])},
                 "counts_base": int(self._counts.base), "counts": self._counts.values.copy()}
        state.update(self._extra_state())
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a ``state_dict()``; the sampler then continues the saved stream exactly.

        The sampler must be built with the same configuration (strategy, sizes,
        column names) as the one that saved the state; the seed may differ.

        >>> a, b = RandomSampler(replacement=True, seed=1), RandomSampler(replacement=True, seed=2)
        >>> b.load_state_dict(a.state_dict())
        >>> b.state_dict()["rng"] == a.state_dict()["rng"]
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
        saved, mine = state.get("config"), self._config()
        if saved != mine:
            raise SamplerError(f"the state was saved by {type(self).__name__} with config {saved!r}, but this "
                               f"sampler has {mine!r}; build the sampler with the saved configuration")
        try:
            rng = state["rng"]
            if rng["bit_generator"] != "PCG64":
                raise SamplerError(f"the saved RNG is {rng['bit_generator']!r}; expected 'PCG64'")
            bitgen = np.random.PCG64()
            bitgen.state = {"bit_generator": "PCG64",
                            "state": {"state": int(rng["state"]["state"]), "inc": int(rng["state"]["inc"])},
                            "has_uint32": int(rng["has_uint32"]), "uinteger": int(rng["uinteger"])}
            counts = np.asarray(state["counts"], dtype=np.int64).reshape(-1)
            base = int(state["counts_base"])
            self._load_extra(state)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DiskReplayError):
                raise
            raise FormatError(f"Unsupported sampler state: {exc!r}; expected a dict from "
                              f"{type(self).__name__}.state_dict()") from None
        self._rng = np.random.Generator(bitgen)
        self._counts.restore(base, counts.copy())


# --------------------------------------------------------------------------- prompt groups


class PromptGroupSampler(_SamplerBase):
    """Draw whole prompt groups: ``num_groups`` groups x ``samples_per_group`` rows.

    Give exactly one of ``num_groups`` / ``samples_per_group``; the other is
    ``batch_size // given`` (a batch size that does not divide is an error).
    The batch is laid out group by group: ``samples_per_group`` consecutive
    rows per group. Groups are chosen uniformly at random without replacement
    among groups with at least one eligible row, unless ``sample(...,
    groups=[keys])`` names them (RePO). ``group_key=None`` groups by the
    store's own key; any other per-row column name groups by that column.

    Within a group, ``strategy`` picks the rows:

    - ``"random"``: uniform without replacement (output in draw order);
    - ``"recency"``: the most recently inserted (largest row ids), newest first;
    - ``"reward"``: the highest ``reward_key`` values, highest first, ties
      newest first; a NaN reward ranks lowest (like ``-inf``);
    - ``"variance"``: the subset with the largest (population) reward
      variance, ties broken by the larger total reward, output highest reward
      first. Rows whose reward is not finite (NaN, +-inf) are only used when a
      group has fewer finite rewards than ``samples_per_group`` (newest first).

    A reward column with trailing dimensions (``[n, K]``) is averaged to one
    scalar per row. Rows whose ``policy_version_key`` is below
    ``min_policy_version`` are never drawn. A group with fewer eligible rows
    than asked for gives all of them and then repeats them in the strategy's
    order (cyclically); too few eligible groups are completed by repeating
    randomly chosen ones. Either issues one :class:`ReplacementWarning` per
    sampler. ``seed=None`` takes fresh entropy from the OS; the stream is still
    captured by ``state_dict()``.

    >>> import tempfile, numpy as np
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [0, 0, 0, 1, 1, 1], "completion_ids": [[1]] * 6,
    ...                   "rewards": np.array([0, 1, 0, 1, 1, 0], dtype=np.float32)})
    >>> PromptGroupSampler.recency(num_groups=2, seed=0).sample(store, 4, groups=[1, 0]).tolist()
    [5, 4, 2, 1]
    >>> rows = PromptGroupSampler(samples_per_group=3, seed=0).sample(store, 6)
    >>> sorted(rows.tolist())
    [0, 1, 2, 3, 4, 5]
    """

    def __init__(self, num_groups: Optional[int] = None, samples_per_group: Optional[int] = None,
                 group_key: Optional[str] = None, strategy: str = "random", reward_key: str = "rewards",
                 seed: Optional[int] = None, policy_version_key: str = "policy_version") -> None:
        super().__init__(seed, policy_version_key)
        if (num_groups is None) == (samples_per_group is None):
            raise SamplerError(f"give exactly one of num_groups / samples_per_group, got num_groups={num_groups!r} "
                               f"and samples_per_group={samples_per_group!r}; the other one is batch_size // given")
        fix = "pass e.g. 8, or None to infer it from batch_size"
        self.num_groups = None if num_groups is None else _positive("num_groups", num_groups, fix)
        self.samples_per_group = (None if samples_per_group is None
                                  else _positive("samples_per_group", samples_per_group, fix))
        if group_key is not None and (not isinstance(group_key, str) or not group_key):
            raise SamplerError(f"group_key must be a column name or None (the store's key), got {group_key!r}")
        self.group_key = group_key
        if strategy not in STRATEGIES:
            raise SamplerError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.strategy = strategy
        if not isinstance(reward_key, str) or not reward_key:
            raise SamplerError(f"reward_key must be a column name, got {reward_key!r}")
        self.reward_key = reward_key
        self._warned = False
        self._canon: Tuple[Any, Optional[np.ndarray]] = (None, None)

    @classmethod
    def recency(cls, num_groups: Optional[int] = None, samples_per_group: Optional[int] = None,
                **kwargs: Any) -> "PromptGroupSampler":
        """A sampler taking the newest rows of each group (``strategy="recency"``).

        >>> PromptGroupSampler.recency(num_groups=4).strategy
        'recency'
        """
        return cls(num_groups, samples_per_group, strategy="recency", **kwargs)

    @classmethod
    def reward(cls, num_groups: Optional[int] = None, samples_per_group: Optional[int] = None,
               **kwargs: Any) -> "PromptGroupSampler":
        """A sampler taking the highest-reward rows of each group (``strategy="reward"``).

        >>> PromptGroupSampler.reward(samples_per_group=8, reward_key="score").reward_key
        'score'
        """
        return cls(num_groups, samples_per_group, strategy="reward", **kwargs)

    @classmethod
    def variance(cls, num_groups: Optional[int] = None, samples_per_group: Optional[int] = None,
                 **kwargs: Any) -> "PromptGroupSampler":
        """A sampler taking each group's maximum-reward-variance subset (``strategy="variance"``).

        >>> PromptGroupSampler.variance(num_groups=2).strategy
        'variance'
        """
        return cls(num_groups, samples_per_group, strategy="variance", **kwargs)

    def __repr__(self) -> str:
        size = (f"num_groups={self.num_groups}" if self.num_groups is not None
                else f"samples_per_group={self.samples_per_group}")
        return f"PromptGroupSampler({size}, strategy={self.strategy!r}, group_key={self.group_key!r})"

    def _config(self) -> Dict[str, Any]:
        return {"num_groups": self.num_groups, "samples_per_group": self.samples_per_group,
                "group_key": self.group_key, "strategy": self.strategy, "reward_key": self.reward_key,
                "policy_version_key": self.policy_version_key}

    def _extra_state(self) -> Dict[str, Any]:
        return {"warned": self._warned}

    def _load_extra(self, state: Dict[str, Any]) -> None:
        self._warned = bool(state["warned"])

    def _split(self, batch_size: int, named: Optional[int]) -> Tuple[int, int]:
        """(number of groups, rows per group) for this call."""
        if named is not None:
            if self.num_groups is not None:
                if self.num_groups != named:
                    raise SamplerError(f"groups names {named} groups but the sampler was built with num_groups="
                                       f"{self.num_groups}; name {self.num_groups} groups or build the sampler with "
                                       "samples_per_group instead")
                given, name = named, "num_groups"
            else:
                if batch_size != named * self.samples_per_group:
                    raise SamplerError(f"batch_size={batch_size} must equal len(groups) * samples_per_group = "
                                       f"{named} * {self.samples_per_group} = {named * self.samples_per_group}; "
                                       "pass that batch size or name other groups")
                return named, self.samples_per_group
        else:
            given, name = ((self.num_groups, "num_groups") if self.num_groups is not None
                           else (self.samples_per_group, "samples_per_group"))
        if batch_size % given:
            raise SamplerError(f"batch_size={batch_size} is not divisible by {name}={given}; pass a multiple of "
                               f"{given}")
        other = batch_size // given
        return (given, other) if name == "num_groups" else (other, given)

    def _canonical(self, gi: Any) -> np.ndarray:
        """Group positions ordered by each group's oldest live row.

        Group codes depend on the store's history (a reopened store numbers the
        groups of its live rows afresh), the oldest live row does not; random
        picks are made in this order so a resumed sampler repeats the stream.
        """
        if self._canon[0] is not gi:
            firsts = gi.rows[gi.offsets[:-1]]
            self._canon = (gi, np.argsort(firsts, kind="stable"))
        return self._canon[1]

    def sample(self, store: Any, batch_size: int, *, groups: Any = None,
               min_policy_version: Optional[float] = None) -> np.ndarray:
        """Row ids of ``batch_size`` rows, group by group (see the class docstring).

        ``groups`` names the groups to draw, in order (RePO: the prompts of the
        current batch); a key may repeat. With ``num_groups`` set it must name
        exactly ``num_groups`` groups; with ``samples_per_group`` set,
        ``batch_size`` must be ``len(groups) * samples_per_group``.

        >>> import tempfile, numpy as np
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": ["a", "a", "a", "a"], "completion_ids": [[1]] * 4,
        ...                   "rewards": np.array([0.0, 1.0, 0.5, 1.0], dtype=np.float32)})
        >>> PromptGroupSampler.variance(num_groups=1).sample(store, 2, groups=["a"]).tolist()
        [3, 0]
        """
        batch_size = _positive("batch_size", batch_size, "pass the number of rows to draw")
        bound = _check_bound(min_policy_version)
        key = self.group_key if self.group_key is not None else store.group_key
        if key is None:
            raise SamplerError(f"group_key=None, but the store at {store.path} has no group key; pass "
                               "group_key=<column> to PromptGroupSampler")
        gi = store.group_index(key)
        head = store.head
        self._counts.sync(store)

        emask = self._eligible(store, bound)
        if emask is None:
            ecounts = gi.counts
        else:
            emask = emask[gi.rows - head]  # now aligned with gi.rows
            ecounts = (np.add.reduceat(emask.astype(np.int64), gi.offsets[:-1]) if len(gi)
                       else np.zeros(0, dtype=np.int64))
        stale = "" if bound is None else f" with {self.policy_version_key} >= {bound}"

        replaced = False
        if groups is not None:
            if isinstance(groups, (str, bytes)) or np.ndim(groups) == 0:
                raise SamplerError(f"groups must be a list of group keys, got {groups!r}; wrap one key in a list")
            keys = _as_array(groups).tolist() if hasattr(groups, "tolist") else list(groups)
            if not keys:
                raise SamplerError("groups=[] names no group; pass None to draw groups at random")
            n_groups, k = self._split(batch_size, len(keys))
            chosen = np.empty(len(keys), dtype=np.int64)
            for i, g in enumerate(keys):
                pos = gi.position(g)
                if pos is None:
                    raise SamplerError(f"groups[{i}]={g!r} is not a group of the store (no live row has "
                                       f"{key}={g!r}); name only groups that have live rows")
                if ecounts[pos] == 0:
                    raise SamplerError(f"groups[{i}]={g!r} has no live row{stale}; name other groups or lower "
                                       "min_policy_version")
                chosen[i] = pos
        else:
            n_groups, k = self._split(batch_size, None)
            canon = self._canonical(gi)
            eligible = canon[ecounts[canon] > 0] if emask is not None else canon
            if len(eligible) == 0:
                raise SamplerError(f"the store at {store.path} has no group with a live row{stale}; extend it "
                                   "first" + ("" if bound is None else " or lower min_policy_version"))
            if len(eligible) >= n_groups:
                chosen = eligible[self._rng.choice(len(eligible), n_groups, replace=False)]
            else:
                extra = self._rng.integers(0, len(eligible), n_groups - len(eligible))
                chosen = np.concatenate([eligible[self._rng.permutation(len(eligible))], eligible[extra]])
                replaced = True

        rows, short = self._pick(store, gi, chosen, k, emask)
        if (replaced or short) and not self._warned:
            self._warned = True
            what = (f"only {len(np.unique(chosen))} eligible groups for num_groups={n_groups}" if replaced
                    else f"a group has fewer than samples_per_group={k} eligible rows")
            warnings.warn(f"{what}{stale}; the draw was completed by repeating "
                          f"{'groups' if replaced else 'rows'} (warned once per sampler)", ReplacementWarning,
                          stacklevel=2)
        np.add.at(self._counts.values, rows - self._counts.base, 1)
        return rows

    def _pick(self, store: Any, gi: Any, chosen: np.ndarray, k: int,
              emask: Optional[np.ndarray]) -> Tuple[np.ndarray, bool]:
        """Rows of the chosen groups by strategy: ``[G * k]`` row ids and whether any group was short."""
        n_groups = len(chosen)
        starts, lens = gi.offsets[chosen], gi.counts[chosen]
        cand = gather_ranges(gi.rows, starts, lens)  # rows of each chosen group, oldest first
        seg = np.repeat(np.arange(n_groups), lens)
        if emask is not None:
            keep = gather_ranges(emask, starts, lens)
            cand, seg = cand[keep], seg[keep]
        n = np.bincount(seg, minlength=n_groups)
        first = np.zeros(n_groups + 1, dtype=np.int64)
        np.cumsum(n, out=first[1:])
        # slot t of group j takes the (t mod n_j)-th ranked row: a short group repeats its ranking
        q = np.arange(k)[None, :] % n[:, None]
        if self.strategy == "recency":
            ranked, pos = cand, first[1:, None] - 1 - q  # oldest first inside a group, so count from its end
        elif self.strategy == "random":
            ranked = cand[np.lexsort((self._rng.random(len(cand)), seg))]
            pos = first[:-1, None] + q
        else:
            _numeric_column(store, self.reward_key, "reward_key")
            r = _as_scalar(store.read(cand, [self.reward_key])[self.reward_key])
            if self.strategy == "reward":
                key = np.where(np.isnan(r), -np.inf, r)
                ranked = cand[np.lexsort((-cand, -key, seg))]
                pos = first[:-1, None] + q
            else:
                ranked, pos = _variance_ranking(cand, seg, r, n, first, k)
        return ranked[pos].reshape(-1), bool((n < k).any())


def _variance_ranking(cand: np.ndarray, seg: np.ndarray, r: np.ndarray, n: np.ndarray, first: np.ndarray,
                      k: int) -> Tuple[np.ndarray, np.ndarray]:
    """Maximum-variance subsets of size ``k``, one per group, as (ranked rows, [G, k] positions).

    Why only k + 1 candidates: for a fixed mean, variance is a sum of squared
    distances, so swapping a chosen value for an unchosen one further from the
    mean never lowers it; an optimal subset therefore is "the i lowest and the
    k - i highest" of the sorted rewards for some i in 0..k. With per-group
    prefix sums of x and x**2, each candidate's sum S1 and sum of squares S2
    cost O(1), and ``k * S2 - S1**2 = k**2 * var``.
    """
    n_groups = len(n)
    finite = np.isfinite(r)
    rf = np.where(finite, r, 0.0)
    # inside each group: finite rewards ascending (ties: older first), then non-finite ones by row id
    order = np.lexsort((cand, rf, ~finite, seg))
    ranked, rs = cand[order], rf[order]
    m = np.bincount(seg[finite], minlength=n_groups)
    s, nn, mm = first[:-1, None], n[:, None], m[:, None]
    q = np.arange(k)[None, :] % nn
    # groups without k finite rewards: all finite ones (highest first), then the rest newest first, cycled
    pos = np.where(q < mm, s + mm - 1 - q, s + nn - 1 - (q - mm))
    full = np.flatnonzero(m >= k)
    if len(full):
        sf, mf = first[full], m[full]
        width = int(mf.max())
        # per-group rows of a zero-padded matrix keep each prefix sum local to its group (a global
        # running sum would bury a small-reward group's digits under the big groups before it)
        lane = np.arange(width)[None, :]
        idx = np.minimum(sf[:, None] + lane, len(rs) - 1)
        x = np.where(lane < mf[:, None], rs[idx] - rs[sf][:, None], 0.0)  # shift by the group minimum
        c1 = np.zeros((len(full), width + 1))
        c2 = np.zeros((len(full), width + 1))
        np.cumsum(x, axis=1, out=c1[:, 1:])
        np.cumsum(x * x, axis=1, out=c2[:, 1:])
        i = np.arange(k + 1)[None, :]
        rows_ = np.arange(len(full))[:, None]
        mcol = mf[:, None]
        top1, top2 = c1[rows_, mcol], c2[rows_, mcol]
        s1 = c1[rows_, i] + top1 - c1[rows_, mcol - k + i]
        s2 = c2[rows_, i] + top2 - c2[rows_, mcol - k + i]
        score = k * s2 - s1 * s1
        best = score.max(axis=1, keepdims=True)
        spread = x[rows_, mcol - 1]  # max - min of the group's finite rewards
        # candidates within rounding of the best variance tie; among them the larger total wins
        tol = 1e-9 * k * k * spread * spread
        s1 = np.where(score >= best - tol, s1, -np.inf)
        lo = np.argmax(s1, axis=1)[:, None]  # how many of the lowest rewards to take
        u = np.arange(k)[None, :]
        chosen = np.where(u < lo, sf[:, None] + u, sf[:, None] + mf[:, None] - k + u)
        pos[full] = chosen[:, ::-1]  # highest reward first
    return ranked, pos


# --------------------------------------------------------------------------- single rows


class RandomSampler(_SamplerBase):
    """Uniformly random rows: shuffled passes (default) or with replacement.

    Without replacement the sampler walks one random permutation of the live
    rows with a cursor, so no row repeats within a pass. A pass restarts (a new
    permutation) when it is used up, or when the live rows changed (an append
    or eviction) since it began; a saved state (``store.save_state``) does not
    count as a change. A batch that crosses the end of a pass is completed from
    the next pass, skipping rows already in the batch (they come next in the new
    pass). Asking for more rows than are eligible is an error. With
    ``replacement=True`` each row is drawn uniformly and independently.
    Rows below ``min_policy_version`` are skipped (and not revisited in that pass).

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [0, 0, 1, 1], "completion_ids": [[1]] * 4})
    >>> s = RandomSampler(seed=0)
    >>> sorted(s.sample(store, 2).tolist() + s.sample(store, 2).tolist())
    [0, 1, 2, 3]
    """

    def __init__(self, replacement: bool = False, seed: Optional[int] = None,
                 policy_version_key: str = "policy_version") -> None:
        super().__init__(seed, policy_version_key)
        if not isinstance(replacement, (bool, np.bool_)):
            raise SamplerError(f"replacement must be True or False, got {replacement!r}")
        self.replacement = bool(replacement)
        self._perm: Optional[np.ndarray] = None
        self._cursor = 0
        self._live = (0, 0)  # (head, next_row) the permutation was made for

    def __repr__(self) -> str:
        return f"RandomSampler(replacement={self.replacement})"

    def _config(self) -> Dict[str, Any]:
        return {"replacement": self.replacement, "policy_version_key": self.policy_version_key}

    def _extra_state(self) -> Dict[str, Any]:
        return {"perm": None if self._perm is None else self._perm.copy(), "cursor": int(self._cursor),
                "perm_head": int(self._live[0]), "perm_next_row": int(self._live[1])}

    def _load_extra(self, state: Dict[str, Any]) -> None:
        perm = state["perm"]
        self._perm = None if perm is None else np.asarray(perm, dtype=np.int64).reshape(-1).copy()
        self._cursor = int(state["cursor"])
        self._live = (int(state["perm_head"]), int(state["perm_next_row"]))

    def sample(self, store: Any, batch_size: int, *, min_policy_version: Optional[float] = None) -> np.ndarray:
        """Row ids of ``batch_size`` rows (see the class docstring).

        >>> import tempfile
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 1], "completion_ids": [[1], [2]]})
        >>> RandomSampler(replacement=True, seed=0).sample(store, 5).shape
        (5,)
        """
        batch_size = _positive("batch_size", batch_size, "pass the number of rows to draw")
        bound = _check_bound(min_policy_version)
        head, nxt = store.head, store.next_row
        self._counts.sync(store)
        elig = self._eligible(store, bound)
        n_elig = nxt - head if elig is None else int(np.count_nonzero(elig))
        stale = "" if bound is None else f" with {self.policy_version_key} >= {bound}"
        if self.replacement:
            if n_elig == 0:
                raise SamplerError(f"the store at {store.path} has no live row{stale} to draw; extend it first"
                                   + ("" if bound is None else " or lower min_policy_version"))
            if elig is None:
                rows = head + self._rng.integers(0, n_elig, batch_size)
            else:
                rows = head + np.flatnonzero(elig)[self._rng.integers(0, n_elig, batch_size)]
        else:
            if batch_size > n_elig:
                raise SamplerError(f"batch_size={batch_size} exceeds the {n_elig} live rows{stale} of the store; "
                                   "a pass without replacement cannot repeat rows: lower batch_size or use "
                                   "RandomSampler(replacement=True)")
            rows = self._take(head, nxt, elig, batch_size)
        rows = rows.astype(np.int64, copy=False)
        np.add.at(self._counts.values, rows - self._counts.base, 1)
        return rows

    def _new_pass(self, head: int, nxt: int) -> None:
        self._perm = head + self._rng.permutation(nxt - head).astype(np.int64)
        self._cursor = 0
        self._live = (head, nxt)

    def _take(self, head: int, nxt: int, elig: Optional[np.ndarray], need: int) -> np.ndarray:
        if self._perm is None or self._live != (head, nxt):
            self._new_pass(head, nxt)
        out: List[np.ndarray] = []
        while need:
            if self._cursor >= len(self._perm):
                self._new_pass(head, nxt)
            window = self._perm[self._cursor:]
            ok = np.ones(len(window), dtype=bool) if elig is None else elig[window - head]
            dup = None
            if out:  # a new pass may start with rows this batch already took from the old one
                dup = np.isin(window, np.concatenate(out))
                ok &= ~dup
            idx = np.flatnonzero(ok)
            if len(idx) < need:
                out.append(window[idx])
                need -= len(idx)
                self._cursor = len(self._perm)
                continue
            idx = idx[:need]
            last = int(idx[-1]) + 1
            taken = window[idx]
            if dup is not None and dup[:last].any():
                # keep the pass a permutation: taken rows, then skipped stale rows, and the rows
                # this batch already holds right after the cursor, so they come first next time
                d = dup[:last]
                rest = window[:last][~ok[:last] & ~d]
                self._perm[self._cursor:self._cursor + last] = np.concatenate([taken, rest, window[:last][d]])
                self._cursor += last - int(d.sum())
            else:
                self._cursor += last
            out.append(taken)
            need = 0
        return np.concatenate(out)


class PrioritizedSampler(_SamplerBase):
    """Rows drawn with replacement, ``p_i`` proportional to ``(|priority_i| + eps) ** alpha`` (SSR).

    ``eps`` is always added, so a row of priority 0 keeps a small chance. A
    row's priority defaults to ``|priority_key|`` as stored (a vector column is
    averaged first; NaN counts as 0), read lazily for rows appended since the
    last call; evicted rows drop out. :meth:`update_priorities` overrides them.

    >>> import tempfile, numpy as np
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [0, 0], "completion_ids": [[1], [2]],
    ...                   "advantages": np.array([0.0, 3.0], dtype=np.float32)})
    >>> s = PrioritizedSampler(alpha=1.0, eps=1.0, seed=0)
    >>> s.probabilities(store, [0, 1]).tolist()
    [0.2, 0.8]
    >>> s.sample(store, 3).shape
    (3,)
    """

    def __init__(self, priority_key: str = "advantages", alpha: float = 1.0, eps: float = 1e-4,
                 seed: Optional[int] = None, policy_version_key: str = "policy_version") -> None:
        super().__init__(seed, policy_version_key)
        if not isinstance(priority_key, str) or not priority_key:
            raise SamplerError(f"priority_key must be a column name, got {priority_key!r}")
        for name, v in (("alpha", alpha), ("eps", eps)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(v) or v < 0:
                raise SamplerError(f"{name} must be a finite number >= 0, got {v!r}; pass e.g. {name}="
                                   f"{1.0 if name == 'alpha' else 1e-4}")
        self.priority_key = priority_key
        self.alpha, self.eps = float(alpha), float(eps)
        self._prio = _LiveRows(self._read_priorities)  # |priority| of the live rows
        self._pending_rows = np.zeros(0, dtype=np.int64)  # overrides for rows not read yet
        self._pending_values = np.zeros(0, dtype=np.float64)
        self._cdf_key: Any = None
        self._cdf = np.zeros(0)
        self._last = -1

    def __repr__(self) -> str:
        return f"PrioritizedSampler(priority_key={self.priority_key!r}, alpha={self.alpha}, eps={self.eps})"

    def _config(self) -> Dict[str, Any]:
        return {"priority_key": self.priority_key, "alpha": self.alpha, "eps": self.eps,
                "policy_version_key": self.policy_version_key}

    def _extra_state(self) -> Dict[str, Any]:
        return {"prio_base": int(self._prio.base), "priorities": self._prio.values.copy(),
                "pending_rows": self._pending_rows.copy(), "pending_values": self._pending_values.copy()}

    def _load_extra(self, state: Dict[str, Any]) -> None:
        self._prio.restore(int(state["prio_base"]),
                           np.asarray(state["priorities"], dtype=np.float64).reshape(-1).copy())
        self._pending_rows = np.asarray(state["pending_rows"], dtype=np.int64).reshape(-1).copy()
        self._pending_values = np.asarray(state["pending_values"], dtype=np.float64).reshape(-1).copy()
        self._cdf_key = None

    def _read_priorities(self, store: Any, start: int, stop: int) -> np.ndarray:
        """|priority| of rows ``[start, stop)`` newly seen, with pending updates applied."""
        _numeric_column(store, self.priority_key, "priority_key")
        new = np.abs(_as_scalar(store.read(np.arange(start, stop, dtype=np.int64),
                                           [self.priority_key])[self.priority_key]))
        new[np.isnan(new)] = 0.0
        if len(self._pending_rows):
            pr, pv = self._pending_rows, self._pending_values
            hit = (pr >= start) & (pr < stop)
            new[pr[hit] - start] = pv[hit]
            keep = pr >= stop
            self._pending_rows, self._pending_values = pr[keep], pv[keep]
        return new

    def _weights_cdf(self, store: Any, bound: Optional[float]) -> np.ndarray:
        if self._prio.sync(store):
            self._cdf_key = None
        if self._cdf_key is not None and self._cdf_key == (bound,):
            return self._cdf
        w = (self._prio.values + self.eps) ** self.alpha
        elig = self._eligible(store, bound)
        if elig is not None:
            w = np.where(elig, w, 0.0)
        self._cdf = np.cumsum(w)
        nz = np.flatnonzero(w)
        self._last = int(nz[-1]) if len(nz) else -1
        self._cdf_key = (bound,)
        return self._cdf

    def probabilities(self, store: Any, rows: Any, *, min_policy_version: Optional[float] = None) -> np.ndarray:
        """The probability that one draw picks each of ``rows`` (for importance weights).

        >>> import tempfile, numpy as np
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 0], "completion_ids": [[1], [2]],
        ...                   "advantages": np.array([1.0, -3.0], dtype=np.float32)})
        >>> PrioritizedSampler(eps=0.0).probabilities(store, [1, 0]).tolist()
        [0.75, 0.25]
        """
        bound = _check_bound(min_policy_version)
        cdf = self._weights_cdf(store, bound)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        total = cdf[-1] if len(cdf) else 0.0
        if not total > 0:
            return np.zeros(len(rows))
        i = rows - self._prio.base
        if len(i) and (i.min() < 0 or i.max() >= len(cdf)):
            raise SamplerError(f"rows must be live rows of the store [{store.head}, {store.next_row}), got "
                               f"{rows.tolist()}")
        prev = np.where(i > 0, cdf[np.maximum(i - 1, 0)], 0.0)
        return (cdf[i] - prev) / total

    def sample(self, store: Any, batch_size: int, *, min_policy_version: Optional[float] = None) -> np.ndarray:
        """Row ids of ``batch_size`` rows drawn with replacement by priority.

        >>> import tempfile, numpy as np
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 0], "completion_ids": [[1], [2]],
        ...                   "advantages": np.array([0.0, 1.0], dtype=np.float32)})
        >>> PrioritizedSampler(eps=0.0, seed=0).sample(store, 4).tolist()
        [1, 1, 1, 1]
        """
        batch_size = _positive("batch_size", batch_size, "pass the number of rows to draw")
        bound = _check_bound(min_policy_version)
        self._counts.sync(store)
        cdf = self._weights_cdf(store, bound)
        total = float(cdf[-1]) if len(cdf) else 0.0
        if not total > 0 or not np.isfinite(total):
            stale = "" if bound is None else f" with {self.policy_version_key} >= {bound}"
            raise SamplerError(f"no live row{stale} has a positive sampling weight (total {total!r}); extend the "
                               "store, raise eps above 0, or lower min_policy_version")
        u = self._rng.random(batch_size) * total
        # side="right" skips zero-weight rows (an empty [cdf[i-1], cdf[i]) interval); u can round up
        # to total, so clip to the last row that has weight
        idx = np.minimum(np.searchsorted(cdf, u, side="right"), self._last)
        rows = (idx + self._prio.base).astype(np.int64)
        np.add.at(self._counts.values, rows - self._counts.base, 1)
        return rows

    def update_priorities(self, rows: Any, values: Any) -> None:
        """Set the priorities of ``rows`` to ``|values|`` (a repeated row keeps its last value).

        Rows already evicted are ignored; rows the sampler has not read yet keep
        the override until they are.

        >>> s = PrioritizedSampler(seed=0)
        >>> s.update_priorities([0, 1], [-2.0, 0.5])
        """
        rows = _as_array(rows).astype(np.int64).reshape(-1)
        vals = _as_array(values).astype(np.float64).reshape(-1)
        if len(rows) != len(vals):
            raise SamplerError(f"update_priorities got {len(rows)} rows but {len(vals)} values; pass one value "
                               "per row")
        if len(rows) and rows.min() < 0:
            raise SamplerError(f"rows must be row ids >= 0, got {int(rows.min())}")
        if not np.isfinite(vals).all():
            bad = int(np.flatnonzero(~np.isfinite(vals))[0])
            raise SamplerError(f"values[{bad}]={vals[bad]!r} is not finite; priorities must be finite numbers")
        if not len(rows):
            return
        # keep the last value of a repeated row (fancy assignment leaves that order unspecified)
        _, last = np.unique(rows[::-1], return_index=True)
        last = len(rows) - 1 - last
        rows, vals = rows[last], np.abs(vals[last])
        end = self._prio.end
        known = (rows >= self._prio.base) & (rows < end)
        self._prio.values[rows[known] - self._prio.base] = vals[known]
        later = rows >= end
        if later.any():
            pr = np.concatenate([self._pending_rows, rows[later]])
            pv = np.concatenate([self._pending_values, vals[later]])
            _, last = np.unique(pr[::-1], return_index=True)
            last = len(pr) - 1 - last
            self._pending_rows, self._pending_values = pr[last], pv[last]
        self._cdf_key = None
