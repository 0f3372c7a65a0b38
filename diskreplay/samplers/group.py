"""``PromptGroupSampler``: whole prompt groups (GRPO, RLOO, DAPO, RePO)."""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..errors import ReplacementWarning, SamplerError
from ..ragged import gather_ranges
from .base import (ColumnFill, LiveRows, Sampler, Setting, as_array, check_column, check_number,
                   numeric_column, positive)
from .kernels import group_spread, reward_scalar, variance_ranking

STRATEGIES = ("random", "recency", "reward", "variance")


def _check_strategy(name: str, value: Any) -> str:
    if value not in STRATEGIES:
        raise SamplerError(f"strategy must be one of {STRATEGIES}, got {value!r}")
    return value


def _check_size(name: str, value: Any) -> Optional[int]:
    return None if value is None else positive(name, value, "pass e.g. 8, or None to infer it from batch_size")


class RewardFill(ColumnFill):
    """Reads a reward column as one NaN-aware scalar per row (:func:`~diskreplay.samplers.reward_scalar`)."""

    def __init__(self, column: str) -> None:
        super().__init__(column, "reward_key", allow_vector=True)

    def __call__(self, store: Any, start: int, stop: int) -> np.ndarray:
        return reward_scalar(super().__call__(store, start, stop))


class PromptGroupSampler(Sampler):
    """Draw whole prompt groups: ``num_groups`` groups x ``samples_per_group`` rows.

    Give exactly one of ``num_groups`` / ``samples_per_group``; the other is
    ``batch_size // given`` (a batch size that does not divide is an error).
    The batch is laid out group by group: ``samples_per_group`` consecutive
    rows per group. Groups are chosen uniformly at random without replacement
    among groups with at least one eligible row, unless ``sample(...,
    groups=[keys])`` names them (RePO). ``group_key=None`` groups by the
    store's own key; any other per-row column name groups by that column.

    Within a group, ``strategy`` picks the rows:

    - ``"random"``: uniform without replacement, laid out in row-id order
      (a group's rows are usually neighbours on disk: one copy per group);
    - ``"recency"``: the most recently inserted (largest row ids), newest first;
    - ``"reward"``: the highest ``reward_key`` values, highest first, ties
      newest first; a NaN reward ranks lowest (like ``-inf``);
    - ``"variance"``: the subset with the largest (population) reward
      variance, ties broken by the larger total reward, output highest reward
      first. Rows whose reward is not finite (NaN, +-inf) are only used when a
      group has fewer finite rewards than ``samples_per_group`` (newest first).

    NaN rewards mean "not scored" (TRL writes NaN for a reward function that
    does not apply): a reward column with trailing dimensions (``[n, K]``) is
    averaged to one scalar per row over its non-NaN components, and the
    strategies above and ``min_reward_std`` leave NaN rewards out, as
    ``nanmean`` / ``nanstd`` do.

    ``min_reward_std``: a group is drawn only when the sample standard
    deviation (ddof=1, TRL's ``nanstd``) of its eligible rows' finite rewards is
    above this bound; ``0.0`` keeps only groups with any spread ("only groups
    with signal"), and a group with fewer than two finite rewards never
    qualifies. Rows whose ``policy_version_key`` is below ``min_policy_version``,
    rows in ``exclude`` (row-id ranges) and rows below ``min_row`` are never
    drawn; a group's eligible rows are the rest.

    A group with fewer eligible rows than asked for gives all of them and is
    completed with replacement: with uniform draws from the group for
    ``strategy="random"``, by repeating the ranking in order for the other
    strategies. Too few eligible groups are completed by drawing groups again,
    uniformly with replacement. Either issues one :class:`ReplacementWarning`
    per sampler. ``seed=None`` takes fresh entropy from the OS; the stream is
    still captured by ``state_dict()``.

    ``rank`` / ``world_size``: the ranks draw ``num_groups * world_size``
    groups together and rank ``r`` keeps the ``r``-th block of ``num_groups``
    whole groups (named ``groups=`` are each rank's own and are not split).

    >>> import tempfile, numpy as np
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [0, 0, 0, 1, 1, 1], "completion_ids": [[1]] * 6,
    ...                   "rewards": np.array([0, 1, 0, 1, 1, 1], dtype=np.float32)})
    >>> PromptGroupSampler.recency(num_groups=2, seed=0).sample(store, 4, groups=[1, 0]).tolist()
    [5, 4, 2, 1]
    >>> rows = PromptGroupSampler(samples_per_group=3, seed=0).sample(store, 6)
    >>> sorted(rows.tolist())
    [0, 1, 2, 3, 4, 5]
    >>> sorted(PromptGroupSampler(num_groups=1, min_reward_std=0.0, seed=0).sample(store, 3).tolist())
    [0, 1, 2]
    """

    _CONFIG = ("num_groups", "samples_per_group", "group_key", "strategy", "reward_key", "min_reward_std",
               "policy_version_key", "rank", "world_size")

    num_groups = Setting(_check_size, mutable=False, why=" (it fixes the batch layout)")
    samples_per_group = Setting(_check_size, mutable=False, why=" (it fixes the batch layout)")
    group_key = Setting(lambda n, v: check_column(n, v, allow_none=True), mutable=False)
    strategy = Setting(_check_strategy)
    reward_key = Setting(lambda n, v: check_column(n, v), changed="_drop_reward_cache")
    min_reward_std = Setting(lambda n, v: check_number(n, v, 0.0, allow_none=True), changed="_drop_spread_cache")

    def __init__(self, num_groups: Optional[int] = None, samples_per_group: Optional[int] = None,
                 group_key: Optional[str] = None, strategy: str = "random", reward_key: str = "rewards",
                 seed: Optional[int] = None, policy_version_key: str = "policy_version", *,
                 min_reward_std: Optional[float] = None, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(seed, policy_version_key, rank, world_size)
        if (num_groups is None) == (samples_per_group is None):
            raise SamplerError(f"give exactly one of num_groups / samples_per_group, got num_groups={num_groups!r} "
                               f"and samples_per_group={samples_per_group!r}; the other one is batch_size // given")
        self.num_groups = num_groups
        self.samples_per_group = samples_per_group
        self.group_key = group_key
        self.strategy = strategy
        self.reward_key = reward_key
        self.min_reward_std = min_reward_std
        self._warned = False
        self._canon: Tuple[Any, Optional[np.ndarray]] = (None, None)
        self._rewards = LiveRows(RewardFill(self.reward_key))
        self._spread: Tuple[Any, Optional[np.ndarray]] = (None, None)
        self._by_group: Tuple[Any, Any] = (None, None)

    def _drop_reward_cache(self) -> None:
        self._rewards = LiveRows(RewardFill(self.reward_key))
        self._drop_spread_cache()

    def _drop_spread_cache(self) -> None:
        self._spread = (None, None)

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

    def _position_extra(self) -> Dict[str, Any]:
        return {"warned": self._warned}

    def _load(self, position: Dict[str, Any], data: Dict[str, Any]) -> None:
        self._warned = bool(position["warned"])

    def _split(self, batch_size: int, named: Optional[int]) -> Tuple[int, int]:
        """(number of groups, rows per group) of this rank's batch."""
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

    def _group_eligible(self, gi: Any, elig: Any, head: int) -> Tuple[np.ndarray, np.ndarray]:
        """The eligibility mask aligned with ``gi.rows`` and the eligible rows per group (kept while both stay)."""
        cached, found = self._by_group
        if cached is not None and cached[0] is gi and cached[1] is elig:
            return found
        emask = elig.mask[gi.rows - head]
        ecounts = (np.add.reduceat(emask.astype(np.int64), gi.offsets[:-1]) if len(gi)
                   else np.zeros(0, dtype=np.int64))
        self._by_group = ((gi, elig), (emask, ecounts))
        return emask, ecounts

    def _spread_ok(self, store: Any, gi: Any, emask: Optional[np.ndarray], filt: Any) -> np.ndarray:
        """Per group position: is the reward spread of its eligible rows above ``min_reward_std``?"""
        # (values written for committed rows change the rewards of rows already seen)
        key = (gi, filt, self.reward_key, self.min_reward_std, getattr(getattr(store, "manifest", None), "patches", ()))
        cached, ok = self._spread
        if cached is not None and len(cached) == len(key) and all(a is b or a == b for a, b in zip(cached, key)):
            return ok
        r = self._rewards.live(store)[gi.rows - store.head]
        if emask is not None:
            r = np.where(emask, r, np.nan)
        spread = group_spread(np.repeat(np.arange(len(gi)), gi.counts), r, len(gi))
        with np.errstate(invalid="ignore"):
            ok = spread > self.min_reward_std  # NaN (no spread at all) is never above a bound
        self._spread = (key, ok)
        return ok

    def sample(self, store: Any, batch_size: int, *, groups: Any = None,
               min_policy_version: Optional[float] = None, exclude: Any = None,
               min_row: Optional[int] = None) -> np.ndarray:
        """Row ids of ``batch_size`` rows, group by group (see the class docstring).

        ``groups`` names the groups to draw, in order (RePO: the prompts of the
        current batch); a key may repeat. With ``num_groups`` set it must name
        exactly ``num_groups`` groups; with ``samples_per_group`` set,
        ``batch_size`` must be ``len(groups) * samples_per_group``.

        ``min_policy_version``: rows whose ``policy_version_key`` is below it
        are never drawn. ``exclude``: row-id ranges ``[(start, stop), ...]``
        (stop exclusive) never drawn (rows of a discarded timeline, say).
        ``min_row``: rows with a smaller id are never drawn. A group is drawn
        from its remaining rows only; every rank must pass the same values.

        >>> import tempfile, numpy as np
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": ["a", "a", "a", "a"], "completion_ids": [[1]] * 4,
        ...                   "rewards": np.array([0.0, 1.0, 0.5, 1.0], dtype=np.float32)})
        >>> PromptGroupSampler.variance(num_groups=1).sample(store, 2, groups=["a"]).tolist()
        [3, 0]
        >>> PromptGroupSampler.recency(num_groups=1).sample(store, 2, groups=["a"], exclude=[(2, 4)]).tolist()
        [1, 0]

        A call that raises leaves the sampler's stream where it was (a caller
        that falls back to another draw gets the stream of a sampler that
        never made the failed call).
        """
        position = self._rng.bit_generator.state
        try:
            return self._draw(store, batch_size, groups, min_policy_version, exclude, min_row)
        except BaseException:
            self._rng.bit_generator.state = position
            raise

    def _draw(self, store: Any, batch_size: int, groups: Any, min_policy_version: Optional[float], exclude: Any,
              min_row: Optional[int]) -> np.ndarray:
        batch_size = positive("batch_size", batch_size, "pass the number of rows to draw")
        filt = self._filter(min_policy_version, exclude, min_row)
        key = self.group_key if self.group_key is not None else store.group_key
        if key is None:
            raise SamplerError(f"group_key=None, but the store at {store.path} has no group key; pass "
                               "group_key=<column> to PromptGroupSampler")
        gi = store.group_index(key)
        head = store.head
        self._counts.sync(store)

        elig = self._eligible(store, filt)
        if elig is None:
            emask, ecounts = None, gi.counts
        else:
            emask, ecounts = self._group_eligible(gi, elig, head)  # emask is aligned with gi.rows
        stale = filt.describe(self.policy_version_key)
        signal = ""
        spread_ok = None
        if self.min_reward_std is not None:
            spread_ok = self._spread_ok(store, gi, emask, filt)
            signal = f" and a {self.reward_key} spread above min_reward_std={self.min_reward_std}"
        # the within-group randomness comes from a generator seeded by one draw of the main one, so the
        # main stream advances by the same amount on every rank whatever the groups hold
        sub = np.random.Generator(np.random.PCG64(int(self._rng.integers(2 ** 63))))

        replaced = False
        if groups is not None:
            if isinstance(groups, (str, bytes)) or np.ndim(groups) == 0:
                raise SamplerError(f"groups must be a list of group keys, got {groups!r}; wrap one key in a list")
            if hasattr(groups, "tolist") and np.ndim(groups) != 1:
                raise SamplerError(f"groups must be a 1-D list of group keys, got shape {tuple(np.shape(groups))}; "
                                   "flatten it (e.g. groups.reshape(-1))")
            keys = as_array(groups).tolist() if hasattr(groups, "tolist") else list(groups)
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
                    raise SamplerError(f"groups[{i}]={g!r} has no live row{stale}; name other groups"
                                       + filt.fix())
                if spread_ok is not None and not spread_ok[pos]:
                    raise SamplerError(f"groups[{i}]={g!r} has no {self.reward_key} spread above min_reward_std="
                                       f"{self.min_reward_std}{stale}; name other groups or lower min_reward_std")
                chosen[i] = pos
            rows, short = self._pick(store, gi, chosen, k, emask, sub)
            mine = rows
        else:
            n_groups, k = self._split(batch_size, None)
            want = n_groups * self.world_size
            canon = self._canonical(gi)
            ok = ecounts[canon] > 0 if emask is not None else None
            if spread_ok is not None:
                ok = spread_ok[canon] if ok is None else ok & spread_ok[canon]
            eligible = canon if ok is None else canon[ok]
            if len(eligible) == 0:
                raise SamplerError(f"the store at {store.path} has no group with a live row{stale}{signal}; extend "
                                   "it first" + filt.fix() + ("" if spread_ok is None else " or lower min_reward_std"))
            if len(eligible) >= want:
                chosen = eligible[self._rng.choice(len(eligible), want, replace=False)]
            else:
                extra = self._rng.integers(0, len(eligible), want - len(eligible))
                chosen = np.concatenate([eligible[self._rng.permutation(len(eligible))], eligible[extra]])
                replaced = True
            rows, short = self._pick(store, gi, chosen, k, emask, sub)
            mine = self._mine(rows, batch_size)

        if (replaced or short) and not self._warned:
            self._warned = True
            if replaced:
                what = (f"only {len(np.unique(chosen))} eligible groups{stale}{signal} for {len(chosen)} groups"
                        + (f" (the global batch of {self.world_size} ranks)" if self.world_size > 1 else "")
                        + "; the draw was completed by drawing groups again, uniformly with replacement"
                        + (" (ranks then share groups)" if self.world_size > 1 else ""))
            elif self.strategy == "random":
                what = (f"a group has fewer than samples_per_group={k} eligible rows{stale}; the draw was "
                        "completed with uniform draws from the group with replacement")
            else:
                what = (f"a group has fewer than samples_per_group={k} eligible rows{stale}; the draw was "
                        f"completed with replacement, repeating the {self.strategy} ranking")
            warnings.warn(f"{what} (warned once per sampler)", ReplacementWarning, stacklevel=2)
        return self._record(mine)

    def _pick(self, store: Any, gi: Any, chosen: np.ndarray, k: int, emask: Optional[np.ndarray],
              rng: np.random.Generator) -> Tuple[np.ndarray, bool]:
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
            ranked = cand[np.lexsort((rng.random(len(cand)), seg))]
            t = np.arange(k)[None, :]
            # past a short group's end: uniform draws from the whole group, with replacement
            extra = np.minimum((rng.random((n_groups, k)) * n[:, None]).astype(np.int64), n[:, None] - 1)
            pos = first[:-1, None] + np.where(t < n[:, None], t, extra)
            # the subset is random, its layout need not be: in row-id order a group's rows are
            # neighbours on disk (a generation step appends them together), so a read copies one run
            # per group and column instead of one per row
            return np.sort(ranked[pos], axis=1).reshape(-1), bool((n < k).any())
        else:
            numeric_column(store, self.reward_key, "reward_key")
            r = reward_scalar(store.read(cand, [self.reward_key])[self.reward_key])
            if self.strategy == "reward":
                key = np.where(np.isnan(r), -np.inf, r)
                ranked = cand[np.lexsort((-cand, -key, seg))]
                pos = first[:-1, None] + q
            else:
                ranked, pos = variance_ranking(cand, seg, r, n, first, k)
        return ranked[pos].reshape(-1), bool((n < k).any())
