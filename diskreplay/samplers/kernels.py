"""Pure array kernels of the samplers: no store, no I/O, testable on their own.

- :func:`reward_scalar`: one reward per row, ignoring NaN components.
- :func:`group_spread`: per-group sample standard deviation of the finite rewards.
- :func:`variance_ranking`: each group's maximum-variance subset of a given size.
- :class:`SumTree`: weights of a sliding window of row ids, with O(log N)
  vectorised updates and weighted draws (the prioritized sampler's index).
- :func:`merge_ranges`, :func:`in_ranges`, :func:`changed_ranges`: sets of
  row ids as sorted ``[start, stop)`` ranges (the rows a draw excludes).
"""

from __future__ import annotations

import warnings
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np
from .. import _ranges
from ..errors import IndexOutOfRangeError

__all__ = ["Ranges", "SumTree", "changed_ranges", "group_spread", "in_ranges", "merge_ranges", "reward_scalar",
           "variance_ranking"]

#: a set of row ids as sorted, disjoint, non-adjacent, non-empty ``(start, stop)`` ranges (stop exclusive)
Ranges = Tuple[Tuple[int, int], ...]


def merge_ranges(pairs: Iterable[Sequence[int]]) -> Ranges:
    """``[start, stop)`` pairs as :data:`Ranges`: sorted, overlapping or touching ones merged, empty ones dropped.

    The canonical form makes two descriptions of the same rows compare equal,
    which is what lets a sampler keep its index when the exclusion is unchanged.

    >>> merge_ranges([(8, 12), (0, 4), (4, 6), (10, 16), (20, 20)])
    ((0, 6), (8, 16))
    """
    return tuple(_ranges.merge_ranges(pairs))


def in_ranges(rows: np.ndarray, ranges: Ranges) -> np.ndarray:
    """Boolean mask: which of ``rows`` lie in one of ``ranges`` (O(n log k) for n rows and k ranges).

    >>> in_ranges(np.array([0, 3, 4, 9, 12]), ((3, 5), (10, 20))).tolist()
    [False, True, True, False, True]
    """
    rows = np.asarray(rows, dtype=np.int64)
    if not ranges:
        return np.zeros(rows.shape, dtype=bool)
    bounds = np.asarray(ranges, dtype=np.int64).reshape(-1)  # start0, stop0, start1, ...: ascending
    # a row is inside exactly when an odd number of bounds lie at or below it
    return (np.searchsorted(bounds, rows, side="right") & 1).astype(bool)


def changed_ranges(old: Ranges, new: Ranges) -> Ranges:
    """The rows in exactly one of ``old`` and ``new`` (their symmetric difference), as :data:`Ranges`.

    O(k log k) in the number of ranges, independent of how many rows they span:
    a sampler re-weights only these rows when an exclusion moves.

    >>> changed_ranges(((0, 10),), ((0, 12), (20, 30)))
    ((10, 12), (20, 30))
    """
    points = sorted({p for r in old + new for p in r})
    if len(points) < 2:
        return ()
    starts = np.asarray(points[:-1], dtype=np.int64)
    differ = in_ranges(starts, old) != in_ranges(starts, new)  # constant between consecutive points
    return merge_ranges((a, b) for a, b, d in zip(points[:-1], points[1:], differ.tolist()) if d)


def reward_scalar(values: np.ndarray) -> np.ndarray:
    """One float64 per row; a ``[n, K, ...]`` reward is the mean of its non-NaN components.

    TRL stores NaN for a reward function that could not score a completion and
    averages with ``nanmean``; a row whose components are all NaN stays NaN.

    >>> reward_scalar(np.array([[1.0, np.nan], [np.nan, np.nan], [0.0, 2.0]])).tolist()
    [1.0, nan, 1.0]
    >>> reward_scalar(np.array([1, 2], dtype=np.int32)).dtype.name
    'float64'
    """
    values = np.asarray(values)
    if values.ndim <= 1:
        return values.astype(np.float64, copy=False)
    flat = values.reshape(len(values), -1).astype(np.float64)
    with warnings.catch_warnings():  # "Mean of empty slice" for an all-NaN row: NaN is the answer
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(flat, axis=1) if flat.shape[1] else np.full(len(flat), np.nan)


def group_spread(group_of_row: np.ndarray, rewards: np.ndarray, n_groups: int) -> np.ndarray:
    """Sample standard deviation (ddof=1, TRL's ``nanstd``) of each group's finite rewards.

    Non-finite rewards (NaN: unscored; +-inf) are left out; a group with fewer
    than two finite rewards has no spread (NaN), so no bound accepts it. A
    group whose finite rewards are all equal has a spread of exactly 0 (its
    mean, a rounded sum over a count, can differ from them by one rounding
    step, which left ~1e-17 for ``min_reward_std=0.0`` to accept).

    >>> group_spread(np.array([0, 0, 1, 1, 1, 2]), np.array([0.0, 1.0, 2.0, np.nan, 2.0, 5.0]), 3).round(4).tolist()
    [0.7071, 0.0, nan]
    >>> group_spread(np.zeros(8, dtype=int), np.full(8, 0.1), 1).tolist()
    [0.0]
    """
    ok = np.isfinite(rewards)
    x = np.where(ok, rewards, 0.0)
    count = np.bincount(group_of_row, weights=ok, minlength=n_groups)
    total = np.bincount(group_of_row, weights=x, minlength=n_groups)
    ref = np.zeros(n_groups)
    ref[group_of_row[ok]] = x[ok]  # one of each group's finite rewards (whichever write lands last)
    differ = np.bincount(group_of_row, weights=ok & (x != ref[group_of_row]), minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count
        # two passes: sum of squares minus square of sums loses the digits of a small spread
        dev = np.where(ok, x - mean[group_of_row], 0.0)
        var = np.bincount(group_of_row, weights=dev * dev, minlength=n_groups) / (count - 1)
    return np.where(count >= 2, np.where(differ == 0, 0.0, np.sqrt(var)), np.nan)


def variance_ranking(cand: np.ndarray, seg: np.ndarray, r: np.ndarray, n: np.ndarray, first: np.ndarray,
                     k: int) -> Tuple[np.ndarray, np.ndarray]:
    """Maximum-variance subsets of size ``k``, one per group, as (ranked rows, [G, k] positions).

    ``cand`` holds candidate rows grouped by ``seg`` (group ``j`` owns
    ``cand[first[j]:first[j+1]]``, ``n[j]`` of them) and ``r`` their rewards.
    Non-finite rewards are used only when a group has fewer than ``k`` finite
    ones. Output per group: highest reward first.

    Why only k + 1 candidates: for a fixed mean, variance is a sum of squared
    distances, so swapping a chosen value for an unchosen one further from the
    mean never lowers it; an optimal subset therefore is "the i lowest and the
    k - i highest" of the sorted rewards for some i in 0..k. With per-group
    prefix sums of x and x**2, each candidate's sum S1 and sum of squares S2
    cost O(1), and ``k * S2 - S1**2 = k**2 * var``.

    >>> cand = np.arange(4); ranked, pos = variance_ranking(cand, np.zeros(4, int), np.array([0., 1., .5, 1.]),
    ...                                                     np.array([4]), np.array([0, 4]), 2)
    >>> ranked[pos].tolist()
    [[3, 0]]
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
        # candidates within rounding of the best variance tie; among them the larger total wins. The
        # rounding of the prefix sums grows with the group's width: a fixed 1e-9 relative bound took a
        # strictly smaller variance (rewards 0, 1e-6, 1000, k=2: 249999.9995 for 250000) for a tie
        tol = 64 * np.finfo(np.float64).eps * width * k * k * spread * spread
        s1 = np.where(score >= best - tol, s1, -np.inf)
        lo = np.argmax(s1, axis=1)[:, None]  # how many of the lowest rewards to take
        u = np.arange(k)[None, :]
        chosen = np.where(u < lo, sf[:, None] + u, sf[:, None] + mf[:, None] - k + u)
        pos[full] = chosen[:, ::-1]  # highest reward first
    return ranked, pos


class SumTree:
    """Non-negative weights of the rows ``[base, end)`` of a sliding window, as a binary sum tree.

    The rows live in a ring of ``capacity`` leaves (a power of two; row ``r``
    sits in leaf ``r mod capacity``), so evicting rows from the front and
    appending at the back touch only those leaves and their ancestors: O(k log N)
    for k rows, vectorised over the k rows one tree level at a time. The ring
    doubles (one O(N) re-layout, amortised O(1) per row) only when the window
    outgrows it. Each inner node is recomputed as the sum of its two children,
    never adjusted by a difference, so rounding errors do not accumulate over
    millions of updates.

    :meth:`find` maps uniform numbers in ``[0, total)`` to rows with
    probability ``weight / total``, and never to a row of weight 0.

    Why the top levels are special: a numpy call costs about the same for 1
    or 1024 values, so the levels of at most ``_TOP`` nodes are handled as
    whole arrays (a draw starts with one cumulative sum and binary search
    there; an update ends with ~10 contiguous sums), which leaves ~14 rounds
    of gathers per batch at 10 M rows instead of ~24. Measured by
    ``tools/bench.py priorities``.

    >>> t = SumTree()
    >>> t.append(np.array([1.0, 0.0, 3.0]))           # rows 0, 1, 2
    >>> t.total, t.find(np.array([0.5, 1.0, 3.9])).tolist()
    (4.0, [0, 2, 2])
    >>> t.evict(1); t.append(np.array([2.0])); t.update(np.array([2]), np.array([1.0]))
    >>> (t.base, t.end, t.total, t.weights(np.array([1, 2, 3])).tolist())
    (1, 4, 3.0, [0.0, 1.0, 2.0])
    """

    # above this share of the leaves, one bottom-up rebuild beats per-level updates
    _BULK = 8
    # levels of at most this many nodes are handled as whole arrays (a cumulative sum to start a
    # descent, contiguous sums after an update): a numpy call costs the same for 1 or 1024 values
    _TOP = 1024

    def __init__(self, capacity: int = 1024, base: int = 0) -> None:
        self._cap = 1 << max(0, int(capacity) - 1).bit_length()
        self._tree = np.zeros(2 * self._cap)
        self.base = self.end = int(base)
        self._min: Optional[float] = None  # cached smallest positive weight, None: unknown

    @property
    def capacity(self) -> int:
        """Leaves in the ring (rows it holds before it grows)."""
        return self._cap

    @property
    def total(self) -> float:
        """Sum of all weights."""
        return float(self._tree[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the tree."""
        return self._tree.nbytes

    def __len__(self) -> int:
        return self.end - self.base

    def reset(self, base: int) -> None:
        """Drop every row; the window restarts empty at ``base``."""
        self._tree[:] = 0.0
        self.base = self.end = int(base)
        self._min = None

    def _leaves(self, rows: np.ndarray) -> np.ndarray:
        return (rows & (self._cap - 1)) + self._cap

    def _check(self, rows: np.ndarray) -> None:
        if len(rows) and (rows.min() < self.base or rows.max() >= self.end):
            bad = rows[(rows < self.base) | (rows >= self.end)][0]
            raise IndexOutOfRangeError(f"row {int(bad)} is outside the tree's rows [{self.base}, {self.end})")

    def _set(self, leaves: np.ndarray, weights: np.ndarray) -> None:
        if not len(leaves):
            return
        if self._min is not None and len(leaves):
            old = self._tree[leaves]
            if (old[weights != old] == self._min).any():
                self._min = None  # the smallest weight changed: find it again when asked
            else:
                pos = weights[weights > 0]
                if len(pos):
                    self._min = min(self._min, float(pos.min()))
        self._tree[leaves] = weights
        if len(leaves) * self._BULK > self._cap:
            self._rebuild()
            return
        t, i, m = self._tree, leaves, self._cap
        # the wide lower levels node by node (a repeated parent is just written twice with the same
        # sum); the top _TOP nodes and their ancestors in a few contiguous sums, cheaper than ~10
        # more rounds of gathers and scatters
        while m > self._TOP:
            i, m = i >> 1, m >> 1
            t[i] = t[2 * i] + t[2 * i + 1]
        self._rebuild(m)

    def _rebuild(self, lo: int = 0) -> None:
        """Recompute every level above the one of ``lo`` nodes (default: above the leaves)."""
        t, lo = self._tree, lo or self._cap
        while lo > 1:
            hi, lo = lo, lo >> 1
            np.add(t[2 * lo:2 * hi:2], t[2 * lo + 1:2 * hi:2], out=t[lo:hi])

    def _grow(self, need: int) -> None:
        rows = np.arange(self.base, self.end, dtype=np.int64)
        old = self._tree[self._leaves(rows)]
        self._cap = 1 << (need - 1).bit_length()
        self._tree = np.zeros(2 * self._cap)
        self._tree[self._leaves(rows)] = old
        self._rebuild()

    def append(self, weights: np.ndarray) -> None:
        """Add rows ``[end, end + len(weights))`` with these weights."""
        weights = np.asarray(weights, dtype=np.float64).reshape(-1)
        n = len(weights)
        if not n:
            return
        if len(self) + n > self._cap:
            self._grow(len(self) + n)
        rows = np.arange(self.end, self.end + n, dtype=np.int64)
        self.end += n
        self._set(self._leaves(rows), weights)

    def evict(self, head: int) -> None:
        """Drop the rows below ``head`` (the window then starts at ``head``)."""
        head = int(head)
        if head <= self.base:
            return
        stop = min(head, self.end)
        rows = np.arange(self.base, stop, dtype=np.int64)
        if len(rows):
            leaves = self._leaves(rows)
            if self._min is not None and (self._tree[leaves] == self._min).any():
                self._min = None
            self._set(leaves, np.zeros(len(rows)))
        self.base, self.end = head, max(self.end, head)

    def update(self, rows: np.ndarray, weights: np.ndarray) -> None:
        """Set the weights of ``rows`` (inside ``[base, end)``; distinct rows)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        self._check(rows)
        self._set(self._leaves(rows), np.asarray(weights, dtype=np.float64).reshape(-1))

    def weights(self, rows: np.ndarray) -> np.ndarray:
        """The weights of ``rows`` (inside ``[base, end)``)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        self._check(rows)
        return self._tree[self._leaves(rows)]

    def all_weights(self) -> np.ndarray:
        """The weights of rows ``[base, end)``, in row order (a copy)."""
        return self._tree[self._leaves(np.arange(self.base, self.end, dtype=np.int64))]

    def min_positive(self) -> float:
        """The smallest positive weight (``inf`` when none), cached between changes that cannot raise it."""
        if self._min is None:
            w = self.all_weights()
            w = w[w > 0]
            self._min = float(w.min()) if len(w) else float("inf")
        return self._min

    def find(self, u: np.ndarray) -> np.ndarray:
        """Rows drawn by the numbers ``u`` in ``[0, total)``: row ``r`` takes a share ``weight_r / total``."""
        t, cap = self._tree, self._cap
        u0 = np.minimum(np.asarray(u, dtype=np.float64).reshape(-1), np.nextafter(t[1], 0.0))
        # start at the level of (at most) _TOP nodes: one cumulative sum and binary search there
        m = min(cap, self._TOP)
        cum = np.cumsum(t[m:2 * m])
        j = np.minimum(np.searchsorted(cum, u0, side="right"), m - 1)
        u = u0 - np.where(j > 0, cum[np.maximum(j - 1, 0)], 0.0)
        i = m + j
        while m < cap:
            i *= 2
            lw = t[i]
            right = u >= lw
            np.subtract(u, lw, out=u, where=right)
            i += right
            m *= 2
        # rounding (a running sum or a difference a last bit off) can walk into a subtree of weight 0;
        # those few numbers take the careful descent
        bad = np.flatnonzero(~(t[i] > 0))
        if len(bad):
            i[bad] = self._find_careful(u0[bad])
        slots = i - cap
        return self.base + ((slots - self.base) & (cap - 1))

    def _find_careful(self, u: np.ndarray) -> np.ndarray:
        """The descent from the root that keeps each number strictly below the node it enters."""
        t = self._tree
        i = np.ones(len(u), dtype=np.int64)
        for _ in range(self._cap.bit_length() - 1):
            left = 2 * i
            lw = t[left]
            right = u >= lw
            u = np.where(right, np.minimum(u - lw, np.nextafter(t[left + 1], 0.0)), u)
            i = left + right
        return i
