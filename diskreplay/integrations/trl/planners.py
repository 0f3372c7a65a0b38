"""Which stored rows a generation batch replays: planners as values, testable without TRL.

A planner gets the fresh batch as numpy arrays (prompt keys, TRL's row
rewards with NaN for unscorable rows, advantages) and the optimizer step, asks
a diskreplay sampler for row ids and returns a :class:`ReplayPlan`: the rows,
and the positions of the fresh rows they replace (``None``: appended). Nothing
here imports torch or TRL, and the store is used through its public API.

Rewards follow TRL's rule for a reward function that returns ``None``: the
row's reward is NaN when every function gave up on it, it is left out of its
group's mean and standard deviation, and its advantage is 0. So a group
carries gradient only with at least two scorable rows whose rewards differ
(:func:`zero_spread_groups`), and :func:`group_advantages` recomputes an
advantage exactly as TRL computes it.

Rows of a discarded timeline (committed after the checkpoint a run resumed
from) stay in the store but are never drawn: :class:`Timeline` records them
and the planners pass them to the sampler as ``exclude=`` (with
``min_policy_version=`` and ``min_row=``, one :class:`Draw`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from ...errors import FormatError, IntegrationError
from ...samplers import Ranges, in_ranges, live_column, merge_ranges

__all__ = ["GROUP_KEY", "REPLAY_MODES", "REWARD_KEY", "VERSION_KEY", "Draw", "RepoPlanner", "ReplayPlan",
           "SsrPlanner", "SwapZeroStdPlanner", "Timeline", "group_advantages", "prompt_key", "zero_spread_groups"]

REPLAY_MODES = ("off", "repo", "ssr", "swap_zero_std")
GROUP_KEY = "prompt_id"
VERSION_KEY = "policy_version"
REWARD_KEY = "rewards"
ADVANTAGE_KEY = "advantages"
_STD_EPS = 1e-4  # TRL's: advantages are divided by (std + 1e-4)


def prompt_key(token_ids: Any) -> int:
    """The store key of a prompt: a stable int64 hash (BLAKE2b) of its token ids, padding removed.

    The same prompt gets the same key in every run and process, whatever its
    padding, so past generations of a prompt are found across restarts.

    >>> prompt_key([5, 6, 7]) == prompt_key(np.array([5, 6, 7], dtype=np.int32))
    True
    >>> prompt_key([5, 6, 7]) == prompt_key([5, 6])
    False
    """
    a = np.ascontiguousarray(np.asarray(token_ids).astype("<i8", copy=False).reshape(-1))
    return int.from_bytes(hashlib.blake2b(a.tobytes(), digest_size=8).digest(), "little", signed=True)


# --------------------------------------------------------------------------- TRL's reward rules


def _nanstd(x: np.ndarray) -> float:
    """TRL's ``nanstd``: Bessel-corrected over the non-NaN values, NaN for fewer than two."""
    x = x[~np.isnan(x)]
    return float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")


def zero_spread_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Indices of the groups TRL gives no gradient: fewer than two scorable rows, or all of them equal.

    ``rewards`` is TRL's per-row reward, NaN where every reward function
    returned ``None``; consecutive runs of ``group_size`` rows are one group.

    >>> zero_spread_groups(np.array([1, 1, np.nan, np.nan, 1, 0, np.nan, 1]), 4).tolist()
    [0]
    >>> zero_spread_groups(np.array([np.nan, np.nan, 2.0, np.nan]), 2).tolist()
    [0, 1]
    """
    grouped = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    scorable = ~np.isnan(grouped)
    hi = np.where(scorable, grouped, -np.inf).max(axis=1)
    lo = np.where(scorable, grouped, np.inf).min(axis=1)
    # max > min is exact where a variance would round; fewer than 2 scorable rows give hi <= lo or inf/nan
    return np.flatnonzero(~((scorable.sum(axis=1) >= 2) & (hi > lo)))


def group_advantages(rewards: np.ndarray, baseline: np.ndarray, scale: str) -> np.ndarray:
    """Advantages of ``rewards`` against the rewards ``baseline`` of their prompt, as TRL computes them.

    ``reward - nanmean(baseline)``, divided by ``nanstd(baseline) + 1e-4`` when
    ``scale == "group"``; a NaN result (an unscorable row, or a baseline with
    fewer than two scorable rows) becomes 0, as TRL's ``nan_to_num``.
    ``scale == "batch"`` is left to the caller (one std over the whole batch).

    >>> group_advantages(np.array([1, 1, np.nan, np.nan]), np.array([1, 1, np.nan, np.nan]), "group").tolist()
    [0.0, 0.0, 0.0, 0.0]
    >>> np.round(group_advantages(np.array([1.0, 0.0]), np.array([1.0, 0.0, np.nan]), "group"), 3).tolist()
    [0.707, -0.707]
    """
    r = np.asarray(rewards, dtype=np.float64)
    base = np.asarray(baseline, dtype=np.float64)
    scorable = base[~np.isnan(base)]
    mean = float(scorable.mean()) if len(scorable) else float("nan")
    adv = r - mean
    if scale == "group":
        adv = adv / (_nanstd(base) + _STD_EPS)
    return np.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0)


def batch_std(rewards: np.ndarray) -> float:
    """TRL's ``scale_rewards="batch"`` divisor: ``nanstd`` of the batch's rewards plus 1e-4.

    >>> round(batch_std(np.array([0.0, 2.0, np.nan])), 4)
    1.4143
    """
    return _nanstd(np.asarray(rewards, dtype=np.float64)) + _STD_EPS


# --------------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Timeline:
    """Row ranges excluded from replay: rows a resumed run's policies never descend from.

    When a run resumes from a checkpoint, the rows committed after that
    checkpoint were generated by policies the resumed run never had; they stay
    in the store (offline use, exports) but :meth:`resumed` adds them here and
    replay never draws them (the planners pass :attr:`excluded` to the sampler
    as ``exclude=``).

    >>> t = Timeline().resumed(checkpoint_rows=16, store_rows=32)
    >>> t.excluded, t.count(head=0, next_row=40)
    (((16, 32),), 16)
    >>> Timeline.from_list(t.to_list()) == t
    True
    """

    excluded: Ranges = ()

    def resumed(self, checkpoint_rows: int, store_rows: int) -> "Timeline":
        """This timeline plus the rows ``[checkpoint_rows, store_rows)`` committed after a checkpoint."""
        return Timeline(merge_ranges(list(self.excluded) + [(checkpoint_rows, store_rows)]))

    def live(self, head: int) -> "Timeline":
        """Without the ranges wholly evicted (below ``head``)."""
        return Timeline(tuple((a, b) for a, b in self.excluded if b > head))

    def count(self, head: int, next_row: int) -> int:
        """Excluded rows among the live rows ``[head, next_row)``."""
        return sum(max(0, min(b, next_row) - max(a, head)) for a, b in self.excluded)

    def contains(self, rows: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``rows`` are excluded."""
        return in_ranges(rows, self.excluded)

    def window_start(self, head: int, next_row: int, window: int) -> int:
        """The first row of the newest ``window`` kept (not excluded) live rows (``head`` if there are fewer).

        O(excluded ranges), not O(rows): it walks the kept runs between the
        excluded ranges down from the newest row.

        >>> Timeline(((8, 16),)).window_start(head=0, next_row=24, window=10)
        6
        """
        need, cursor = int(window), int(next_row)
        for a, b in reversed(self.excluded):
            a, b = max(a, head), min(b, next_row)
            if a >= b:
                continue
            if cursor - b >= need:  # the kept run [b, cursor) holds the rest of the window
                return cursor - need
            need -= cursor - b
            cursor = a
        return max(head, cursor - need)

    def to_list(self) -> List[List[int]]:
        return [[a, b] for a, b in self.excluded]

    @classmethod
    def from_list(cls, pairs: Any) -> "Timeline":
        if pairs is None:
            return cls()
        if not isinstance(pairs, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) for v in p) for p in pairs):
            raise FormatError(f"Unsupported excluded row ranges {pairs!r}; expected a list of [start, stop] "
                              "integer pairs")
        return cls(merge_ranges(pairs))


@dataclass(frozen=True)
class Draw:
    """Which stored rows a planner may replay now, as the sampler keywords that say so.

    ``min_policy_version`` (from ``max_policy_lag``), ``exclude`` (the
    timeline's excluded ranges) and ``min_row`` (SSR's window of the newest
    rows); ``sampler.sample(store, n, **draw.kwargs())``.

    >>> Draw(min_policy_version=3, exclude=((16, 32),)).kwargs()
    {'min_policy_version': 3, 'exclude': ((16, 32),), 'min_row': None}
    """

    min_policy_version: Optional[int] = None
    exclude: Ranges = ()
    min_row: Optional[int] = None

    def kwargs(self) -> Dict[str, Any]:
        return {"min_policy_version": self.min_policy_version, "exclude": self.exclude, "min_row": self.min_row}


# --------------------------------------------------------------------------- plans and planners


@dataclass(frozen=True)
class ReplayPlan:
    """Rows to replay in one generation batch.

    ``rows``: store row ids in batch order. ``positions``: the fresh rows
    they replace, or ``None`` when they are appended after the fresh rows.
    ``group_size``: rows per replayed group (``swap_zero_std``), else 0.

    >>> ReplayPlan.empty().rows.tolist(), ReplayPlan.empty().positions
    ([], None)
    """

    rows: np.ndarray
    positions: Optional[np.ndarray]
    group_size: int = 0

    @classmethod
    def empty(cls) -> "ReplayPlan":
        return cls(np.zeros(0, dtype=np.int64), None)

    def __len__(self) -> int:
        return len(self.rows)

    def first(self, n: int) -> "ReplayPlan":
        """The first ``n`` appended rows (only for appended plans)."""
        return ReplayPlan(self.rows[:n], None, self.group_size)


@dataclass
class FreshBatch:
    """What a planner needs of this process's fresh generation batch.

    ``keys``: prompt key per row; ``rewards``: TRL's row reward (NaN:
    unscorable); ``advantages``: TRL's advantages ([n]).
    """

    keys: np.ndarray
    rewards: np.ndarray
    advantages: np.ndarray

    def group_keys(self, group_size: int) -> np.ndarray:
        """One key per prompt group; TRL lays a generation batch out group by group."""
        groups = np.asarray(self.keys).reshape(-1, group_size)
        if (groups != groups[:, :1]).any():
            raise IntegrationError("the generation batch does not hold its prompt groups as consecutive rows; "
                                   "this TRL version lays out batches differently than diskreplay expects")
        return groups[:, 0]


class Planner:
    """What the three replay planners share: which stored rows may be drawn now, and the timeline.

    ``max_policy_lag``: never draw rows generated more than that many
    optimizer steps ago. ``window``: draw only from the newest ``window``
    rows the timeline keeps (SSR's ``ssr_capacity_scalar``). ``timeline``:
    rows never drawn. All three reach the sampler as keywords of its
    ``sample()`` (:class:`Draw`), and the planner counts eligible rows with
    the sampler's own :meth:`~diskreplay.samplers.Sampler.eligible`, so the
    two never disagree.
    """

    def __init__(self, sampler: Any, *, num_generations: int, steps_per_generation: int = 1,
                 max_policy_lag: Optional[int] = None, min_generations: Optional[int] = None,
                 append: bool = False, window: Optional[int] = None, timeline: Timeline = Timeline()) -> None:
        self.sampler = sampler
        self.num_generations = num_generations
        self.steps_per_generation = steps_per_generation
        self.max_policy_lag = max_policy_lag
        self.min_generations = min_generations
        self.append = append
        self.window = window
        self.timeline = timeline
        self._rewards = live_column(REWARD_KEY, "the replay reward column")

    def set_timeline(self, timeline: Timeline) -> None:
        """Exclude other rows from now on."""
        self.timeline = timeline

    def draw(self, store: Any, step: int) -> Draw:
        """The rows that may be drawn at optimizer step ``step``."""
        head, nxt = store.head, store.next_row
        timeline = self.timeline.live(head)
        min_row = None
        if self.window is not None:
            start = timeline.window_start(head, nxt, self.window)
            min_row = start if start > head else None
        bound = None if self.max_policy_lag is None else step - self.max_policy_lag
        return Draw(bound, timeline.excluded, min_row)

    def eligible(self, store: Any, draw: Draw) -> Optional[np.ndarray]:
        """Mask over the live rows of rows that may be drawn (None: all)."""
        return self.sampler.eligible(store, **draw.kwargs())

    def rewards(self, store: Any) -> np.ndarray:
        """Row rewards of the live rows (NaN: unscorable)."""
        return self._rewards.live(store)

    def has_rows(self, store: Any, draw: Draw) -> bool:
        head, nxt = store.head, store.next_row
        if draw.min_policy_version is None:  # counted from the ranges: no pass over the rows
            lo = max(head, draw.min_row or 0)
            return nxt - lo - Timeline(draw.exclude).count(lo, nxt) > 0
        mask = self.eligible(store, draw)
        return nxt > head and (mask is None or bool(mask.any()))

    def whole_steps(self, rows: np.ndarray) -> np.ndarray:
        # TRL splits the batch into steps_per_generation equal parts and drops a remainder
        spg = self.steps_per_generation
        return rows[: len(rows) - len(rows) % spg]

    def plan(self, store: Any, fresh: FreshBatch, step: int) -> ReplayPlan:
        draw = self.draw(store, step)
        if not self.has_rows(store, draw):
            return ReplayPlan.empty()
        return self._plan(store, fresh, draw)

    def _plan(self, store: Any, fresh: FreshBatch, draw: Draw) -> ReplayPlan:
        raise NotImplementedError


class RepoPlanner(Planner):
    """RePO: for each prompt of the batch with ``min_generations`` eligible stored rows, ``k`` of them.

    The sampler (a ``PromptGroupSampler(samples_per_group=k)``) picks the rows
    by its strategy. Replacing, they take the place of the last ``k`` fresh rows
    of their group (fresh rows of a prompt are exchangeable).
    """

    def __init__(self, sampler: Any, k: int, **kwargs: Any) -> None:
        super().__init__(sampler, **kwargs)
        self.k = k

    def _plan(self, store: Any, fresh: FreshBatch, draw: Draw) -> ReplayPlan:
        g, k = self.num_generations, self.k
        need = self.min_generations or k
        group_keys = fresh.group_keys(g)
        mask = self.eligible(store, draw)
        chosen = []
        for j, key in enumerate(group_keys.tolist()):
            rows = store.group_rows(key)
            count = len(rows) if mask is None else int(np.count_nonzero(mask[rows - store.head]))
            if count >= need:
                chosen.append(j)
        if not chosen:
            return ReplayPlan.empty()
        rows = self.sampler.sample(store, len(chosen) * k, groups=[group_keys[j].item() for j in chosen],
                                   **draw.kwargs())
        if self.append:
            return ReplayPlan(self.whole_steps(rows), None)
        positions = np.concatenate([j * g + g - k + np.arange(k) for j in chosen]).astype(np.int64)
        return ReplayPlan(rows, positions)


class SsrPlanner(Planner):
    """SSR: ``fraction`` of the batch drawn row by row by ``|advantage|`` priority.

    Replacing, the replayed rows take the place of the fresh rows of smallest
    ``|advantage|`` (they carry the least gradient).
    """

    def __init__(self, sampler: Any, fraction: float, **kwargs: Any) -> None:
        super().__init__(sampler, **kwargs)
        self.fraction = fraction

    def _plan(self, store: Any, fresh: FreshBatch, draw: Draw) -> ReplayPlan:
        n_fresh = len(fresh.keys)
        n = max(1, int(round(self.fraction * n_fresh)))
        if self.append:
            n -= n % self.steps_per_generation
            if n == 0:
                return ReplayPlan.empty()
        rows = self.sampler.sample(store, n, **draw.kwargs())
        if self.append:
            return ReplayPlan(rows, None)
        adv = np.abs(np.asarray(fresh.advantages, dtype=np.float64))
        positions = np.sort(np.argsort(adv, kind="stable")[:n]).astype(np.int64)
        return ReplayPlan(rows, positions)


class SwapZeroStdPlanner(Planner):
    """Every fresh group TRL gives no gradient is replaced by a stored group that has reward spread.

    A stored group qualifies with ``min_generations`` eligible rows of which at
    least two are scorable with different rewards; which rows of it are
    replayed is the sampler's strategy (``variance`` by default). With
    ``stored_advantages`` (the trainer's ``recompute_advantages=False``: the
    replayed rows keep the advantages they were stored with), at least two of
    those rows must also have a non-zero advantage: a prompt's rows come from
    several generation batches, and rows of batches without spread (solved
    4/4, later 0/4) were stored with advantage 0, so such a group has reward
    spread but swapped in, gave no gradient either.
    """

    def __init__(self, sampler: Any, rng: np.random.Generator, stored_advantages: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(sampler, **kwargs)
        self.rng = rng
        self._advantages = live_column(ADVANTAGE_KEY, "the replay advantage column") if stored_advantages else None

    def candidates(self, store: Any, draw: Draw = Draw()) -> List[Any]:
        """Keys of stored groups that qualify (see the class docstring) among the rows ``draw`` allows."""
        gi = store.group_index()
        if not len(gi):
            return []
        idx = gi.rows - store.head
        r = self.rewards(store)[idx]
        mask = self.eligible(store, draw)
        ok = np.ones(len(idx), dtype=bool) if mask is None else mask[idx]
        scorable = ok & ~np.isnan(r)
        starts = gi.offsets[:-1]
        count = np.add.reduceat(ok.astype(np.int64), starts)
        hi = np.maximum.reduceat(np.where(scorable, r, -np.inf), starts)
        lo = np.minimum.reduceat(np.where(scorable, r, np.inf), starts)
        need = self.min_generations or self.num_generations
        qualifies = (count >= need) & (hi > lo) & np.isfinite(hi) & np.isfinite(lo)
        if self._advantages is not None:
            a = self._advantages.live(store)[idx]
            moving = ok & np.isfinite(a) & (a != 0)
            qualifies &= np.add.reduceat(moving.astype(np.int64), starts) >= 2
        good = np.flatnonzero(qualifies)
        return [gi.keys[i] for i in good.tolist()]

    def _plan(self, store: Any, fresh: FreshBatch, draw: Draw) -> ReplayPlan:
        g = self.num_generations
        zero = zero_spread_groups(fresh.rewards, g)
        if not len(zero):
            return ReplayPlan.empty()
        candidates = self.candidates(store, draw)
        if not candidates:
            return ReplayPlan.empty()
        picks = self.rng.choice(len(candidates), size=len(zero), replace=len(candidates) < len(zero))
        rows = self.sampler.sample(store, len(zero) * g, groups=[candidates[i] for i in picks], **draw.kwargs())
        positions = np.concatenate([j * g + np.arange(g) for j in zero]).astype(np.int64)
        return ReplayPlan(rows, positions, group_size=g)


def recompute_advantages(plan: ReplayPlan, replay_rewards: np.ndarray, replay_keys: np.ndarray,
                         fresh: FreshBatch, planner: Planner, store: Any, step: int, scale: str) -> np.ndarray:
    """Advantages of the replayed rows from their stored rewards, against a baseline of their prompt.

    The baseline is the replayed group itself (``swap_zero_std``), else the
    prompt's fresh rows in this batch with the replayed row among them (as in
    TRL, a row's reward is in its group's std: against fresh rewards without
    spread, 1, 1, 1, 1, a replayed 0 got (0 - 1) / 1e-4 = -10,000), else the
    prompt's eligible stored rows; normalised as TRL does
    (:func:`group_advantages`; ``scale="batch"``: by the std of the fresh and
    replayed rewards together).
    """
    r = np.asarray(replay_rewards, dtype=np.float64)
    g = planner.num_generations
    fresh_by_key = {int(k): np.asarray(fresh.rewards, dtype=np.float64).reshape(-1, g)[j]
                    for j, k in enumerate(fresh.group_keys(g).tolist())}
    mask = planner.eligible(store, planner.draw(store, step))
    adv = np.zeros(len(r))
    per_row_scale = "group" if scale == "group" else "none"
    for i in range(len(r)):
        if plan.group_size:
            s = (i // plan.group_size) * plan.group_size
            ref = r[s:s + plan.group_size]
        elif int(replay_keys[i]) in fresh_by_key:
            ref = np.append(fresh_by_key[int(replay_keys[i])], r[i])
        else:
            rows = store.group_rows(int(replay_keys[i]))
            if mask is not None:
                rows = rows[mask[rows - store.head]]
            ref = planner.rewards(store)[rows - store.head]
        adv[i] = group_advantages(r[i:i + 1], ref, per_row_scale)[0]
    if scale == "batch":
        adv = adv / batch_std(np.concatenate([np.asarray(fresh.rewards, dtype=np.float64), r]))
    return adv


def is_number(x: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)) \
        and math.isfinite(x)


def is_int(x: Any) -> bool:
    """An int (numpy ints too), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
