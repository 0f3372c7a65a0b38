"""TRL's reward rules, as numpy: which groups give no gradient, and advantages as TRL computes them.

TRL's rule for a reward function that returns ``None``: the row's reward is
NaN when every function gave up on it, it is left out of its group's mean and
standard deviation, and its advantage is 0. So a group carries gradient only
with at least two scorable rows whose rewards differ
(:func:`zero_spread_groups`), and :func:`group_advantages` recomputes an
advantage exactly as TRL computes it. Nothing here imports torch or TRL.
"""

from __future__ import annotations

import numpy as np

__all__ = ["batch_std", "group_advantages", "zero_spread_groups"]

_STD_EPS = 1e-4  # TRL's: advantages are divided by (std + 1e-4)


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
