"""``PrioritizedSampler``: single rows by priority (SSR), on a sum tree over the live rows."""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import numpy as np

from ..errors import SamplerError
from .base import (LiveRows, RowFilter, Sampler, Setting, as_array, check_column, check_number, no_groups,
                   numeric_column, positive, read_around_holes)
from .kernels import SumTree, changed_ranges, in_ranges, reward_scalar

NEW_PRIORITIES = ("column", "max")


def _check_new_priority(name: str, value: Any) -> str:
    if value not in NEW_PRIORITIES:
        raise SamplerError(f"new_priority must be one of {NEW_PRIORITIES}, got {value!r}: 'column' reads "
                           "|priority_key| of each new row, 'max' gives new rows the largest priority seen so far")
    return value


class PrioritizedSampler(Sampler):
    """Rows drawn with replacement, ``P(i)`` proportional to ``(|priority_i| + eps) ** alpha`` (SSR).

    ``eps`` is always added, so a row of priority 0 keeps a small chance. A
    new row's priority is ``|priority_key|`` as stored (``new_priority="column"``,
    the default; a vector column is averaged first, NaN counts as 0), read
    lazily for rows appended since the last call, or the largest priority seen
    so far (``new_priority="max"``, TorchRL's rule; 1.0 before any), so a new
    row is drawn soon. Evicted rows drop out. :meth:`update_priorities`
    overrides priorities, also of rows not read yet.

    The weights live in a :class:`~diskreplay.samplers.SumTree` over the live
    rows: a draw and an update of k rows cost O(k log N), vectorised; appends
    and evictions touch only the rows that come or go. ``alpha``, ``eps`` and
    ``beta`` may be changed at any time (a change of ``alpha`` or ``eps``
    re-weights every live row once, at the next draw), and a saved state loads
    into a sampler built with other values of them (it keeps its own).

    ``sample(..., min_policy_version=, exclude=, min_row=)`` never draws rows
    below the version bound, in the excluded row-id ranges or below
    ``min_row``: they weigh 0 in the tree. A changed ``exclude`` or ``min_row``
    re-weights only the rows whose status changed (O(k log N)), so a window
    that advances with the store, or an exclusion that stays, costs no pass
    over the live rows; a changed ``min_policy_version`` re-weights them all.

    :meth:`importance_weights` gives the correction
    ``w_i = (N * P(i)) ** -beta / max_j w_j`` for drawn rows.

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

    _CONFIG = ("priority_key", "alpha", "eps", "beta", "new_priority", "policy_version_key", "rank", "world_size")
    _TUNED = ("alpha", "eps", "beta")  # a restarted run builds them as it did; its schedule sets them again

    priority_key = Setting(lambda n, v: check_column(n, v), mutable=False,
                           why=" (the priorities already read and updated came from it)")
    alpha = Setting(lambda n, v: check_number(n, v, 1.0), changed="_reweight")
    eps = Setting(lambda n, v: check_number(n, v, 1e-4), changed="_reweight")
    beta = Setting(lambda n, v: check_number(n, v, 1.0))
    new_priority = Setting(_check_new_priority)

    def __init__(self, priority_key: str = "advantages", alpha: float = 1.0, eps: float = 1e-4,
                 seed: Optional[int] = None, policy_version_key: str = "policy_version", *, beta: float = 1.0,
                 new_priority: str = "column", rank: int = 0, world_size: int = 1) -> None:
        super().__init__(seed, policy_version_key, rank, world_size)
        self.priority_key = priority_key
        self.alpha, self.eps, self.beta = alpha, eps, beta
        self.new_priority = new_priority
        self._prio = LiveRows(self._new_priorities)  # |priority| of the live rows
        self._pending_rows = np.zeros(0, dtype=np.int64)  # overrides for rows not read yet
        self._pending_values = np.zeros(0, dtype=np.float64)
        self._max_priority: Optional[float] = None
        self._tree = SumTree()
        self._tree_filter = RowFilter()  # the rows the tree's weights let through
        self._tree_epoch = -1  # the _prio.epoch the tree was built from
        self._tree_valid = False

    def __repr__(self) -> str:
        return (f"PrioritizedSampler(priority_key={self.priority_key!r}, alpha={self.alpha}, eps={self.eps}, "
                f"beta={self.beta}, new_priority={self.new_priority!r})")

    def _reweight(self) -> None:
        self._tree_valid = False

    def _data_extra(self) -> Dict[str, Any]:
        return {"prio_base": int(self._prio.base), "priorities": self._prio.values.copy(),
                "pending_rows": self._pending_rows.copy(), "pending_values": self._pending_values.copy(),
                "max_priority": self._max_priority}

    def _load(self, position: Dict[str, Any], data: Dict[str, Any]) -> None:
        self._prio.restore(int(data["prio_base"]), np.asarray(data["priorities"], dtype=np.float64).reshape(-1))
        self._pending_rows = np.array(data["pending_rows"], dtype=np.int64).reshape(-1)
        self._pending_values = np.array(data["pending_values"], dtype=np.float64).reshape(-1)
        top = data["max_priority"]
        self._max_priority = None if top is None else float(top)
        self._tree_valid = False

    def _new_priorities(self, store: Any, start: int, stop: int) -> np.ndarray:
        """|priority| of rows ``[start, stop)`` newly seen, with pending updates applied."""
        if self.new_priority == "max":
            new = np.full(stop - start, 1.0 if self._max_priority is None else self._max_priority)
        else:
            numeric_column(store, self.priority_key, "priority_key")
            new = np.abs(read_around_holes(store, start, stop, lambda rows: reward_scalar(
                store.read(rows, [self.priority_key])[self.priority_key])))
            bad = ~np.isfinite(new)
            if bad.any():
                if np.isinf(new).any():
                    row = start + int(np.argmax(np.isinf(new)))
                    warnings.warn(f"column {self.priority_key!r} row {row} is infinite: it is sampled as a NaN "
                                  f"priority is, with weight eps ** alpha (a priority must be finite; "
                                  "update_priorities refuses one that is not)", RuntimeWarning, stacklevel=5)
                new[bad] = 0.0
        if len(self._pending_rows):
            pr, pv = self._pending_rows, self._pending_values
            hit = (pr >= start) & (pr < stop)
            new[pr[hit] - start] = pv[hit]
            keep = pr >= stop
            self._pending_rows, self._pending_values = pr[keep], pv[keep]
        return new

    def _weights(self, store: Any, filt: RowFilter, rows: np.ndarray) -> np.ndarray:
        """Tree weights of live ``rows``: ``(|p| + eps) ** alpha``, 0 where ``filt`` keeps a row out."""
        w = (self._prio.values[rows - self._prio.base] + self.eps) ** self.alpha
        if filt.bound is not None:
            w = np.where(self._versions.live(store)[rows - store.head] >= filt.bound, w, 0.0)
        if filt.exclude or filt.min_row:
            w = np.where(in_ranges(rows, filt.blocked), 0.0, w)
        holes = getattr(store, "holes", ())
        if holes:  # rows a repair dropped
            w = np.where(in_ranges(rows, holes), 0.0, w)
        return w

    def _sync(self, store: Any, filt: RowFilter) -> SumTree:
        """The sum tree of the store's live rows for ``filt``; only rows that came, went or changed are touched."""
        self._prio.sync(store)
        # the store's live rows: the rows held may go further (an older snapshot of the same store)
        tree, base, end = self._tree, max(self._prio.base, store.head), min(self._prio.end, store.next_row)
        if not self._tree_valid or self._tree_filter.bound != filt.bound or self._tree_epoch != self._prio.epoch \
                or tree.base > base or tree.end > end:
            tree.reset(base)
            tree.append(self._weights(store, filt, np.arange(base, end, dtype=np.int64)))
            self._tree_filter, self._tree_valid, self._tree_epoch = filt, True, self._prio.epoch
            return tree
        tree.evict(base)
        old = self._tree_filter.blocked
        self._tree_filter = filt
        if old != filt.blocked:
            # only the rows whose exclusion changed: a window moving up by one batch, an exclusion added
            spans = [(max(a, tree.base), min(b, tree.end)) for a, b in changed_ranges(old, filt.blocked)]
            spans = [(a, b) for a, b in spans if a < b]
            if spans:
                rows = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans])
                tree.update(rows, self._weights(store, filt, rows))
        if end > tree.end:
            tree.append(self._weights(store, filt, np.arange(tree.end, end, dtype=np.int64)))
        return tree

    def probabilities(self, store: Any, rows: Any, *, min_policy_version: Optional[float] = None,
                      exclude: Any = None, min_row: Optional[int] = None) -> np.ndarray:
        """The probability that one draw picks each of ``rows`` (live rows of the store).

        The keywords are :meth:`sample`'s: pass the same ones to get the
        probabilities of that draw.

        >>> import tempfile, numpy as np
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 0], "completion_ids": [[1], [2]],
        ...                   "advantages": np.array([1.0, -3.0], dtype=np.float32)})
        >>> PrioritizedSampler(eps=0.0).probabilities(store, [1, 0]).tolist()
        [0.75, 0.25]
        """
        tree = self._sync(store, self._filter(min_policy_version, exclude, min_row))
        rows = self._live_rows(store, rows)
        total = tree.total
        if not total > 0:
            return np.zeros(len(rows))
        return tree.weights(rows) / total

    def importance_weights(self, store: Any, rows: Any, *, beta: Optional[float] = None,
                           min_policy_version: Optional[float] = None, exclude: Any = None,
                           min_row: Optional[int] = None) -> np.ndarray:
        """Importance-sampling weights ``w_i = (N * P(i)) ** -beta / max_j w_j`` of drawn ``rows``.

        ``N`` is the number of live rows and ``j`` runs over every row that can
        be drawn, so the weights lie in ``(0, 1]`` (the least likely row has
        1). ``beta`` defaults to the sampler's ``beta`` (1.0: full correction;
        PER anneals it from about 0.4 to 1). Multiply each row's loss by its
        weight to undo the bias of drawing by priority. A row that cannot be
        drawn (probability 0) is an error. ``min_policy_version``,
        ``exclude`` and ``min_row`` are :meth:`sample`'s (pass the same ones).

        >>> import tempfile, numpy as np
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 0, 0], "completion_ids": [[1]] * 3,
        ...                   "advantages": np.array([1.0, 2.0, 4.0], dtype=np.float32)})
        >>> PrioritizedSampler(eps=0.0).importance_weights(store, [0, 1, 2], beta=1.0).tolist()
        [1.0, 0.5, 0.25]
        """
        beta = self.beta if beta is None else check_number("beta", beta, 1.0)
        tree = self._sync(store, self._filter(min_policy_version, exclude, min_row))
        rows = self._live_rows(store, rows)
        w = tree.weights(rows)
        if len(w) and not (w > 0).all():
            bad = int(rows[np.flatnonzero(~(w > 0))[0]])
            raise SamplerError(f"row {bad} has probability 0 (priority 0 with eps=0, or below min_policy_version, "
                               "in exclude or below min_row) and cannot have been drawn; pass rows returned by "
                               "sample() and the keywords it was called with")
        # (N * P(i)) ** -beta / (N * P_min) ** -beta: N and the total cancel
        return (w / tree.min_positive()) ** -beta

    def _live_rows(self, store: Any, rows: Any) -> np.ndarray:
        rows = as_array(rows).astype(np.int64).reshape(-1)
        if len(rows) and (rows.min() < store.head or rows.max() >= store.next_row):
            raise SamplerError(f"rows must be live rows of the store [{store.head}, {store.next_row}), got "
                               f"{rows.tolist()[:20]}")
        return rows

    def sample(self, store: Any, batch_size: int, *, groups: Any = None, min_policy_version: Optional[float] = None,
               exclude: Any = None, min_row: Optional[int] = None) -> np.ndarray:
        """Row ids of ``batch_size`` rows drawn with replacement by priority.

        ``min_policy_version``: rows whose ``policy_version_key`` is below it
        are never drawn. ``exclude``: row-id ranges ``[(start, stop), ...]``
        (stop exclusive) never drawn. ``min_row``: rows with a smaller id are
        never drawn (SSR's window of the newest rows). The probabilities of the
        other rows keep their ratios. Every rank must pass the same values.

        >>> import tempfile, numpy as np
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 0, 0], "completion_ids": [[1], [2], [3]],
        ...                   "advantages": np.array([0.0, 1.0, 2.0], dtype=np.float32)})
        >>> PrioritizedSampler(eps=0.0, seed=0).sample(store, 4, exclude=[(2, 3)]).tolist()
        [1, 1, 1, 1]
        """
        batch_size = positive("batch_size", batch_size, "pass the number of rows to draw")
        no_groups(groups, type(self).__name__)
        filt = self._filter(min_policy_version, exclude, min_row)
        self._counts.sync(store)
        tree = self._sync(store, filt)
        total = tree.total
        if not len(store):
            raise SamplerError(f"the store at {store.path} has no live rows; extend it first")
        if not total > 0 or not np.isfinite(total):
            raise SamplerError(f"no live row{filt.describe(self.policy_version_key)} has a positive sampling weight "
                               f"(total {total!r}); extend the store or raise eps above 0" + filt.fix())
        rows = tree.find(self._rng.random(self._global(batch_size)) * total)
        return self._record(self._mine(rows, batch_size))

    def update_priorities(self, rows: Any, values: Any) -> None:
        """Set the priorities of ``rows`` to ``|values|`` (a repeated row keeps its last value).

        Rows already evicted are ignored; rows the sampler has not read yet keep
        the override until they are. O(k log N) for k rows.

        With ranks (``rank=``/``world_size=``), every rank must make the same
        updates, or their priorities, and so their draws, part ways: pass each
        rank the rows and values of all ranks (``torch.distributed.all_gather``
        of what each rank drew and computed), not only its own.

        >>> s = PrioritizedSampler(seed=0)
        >>> s.update_priorities([0, 1], [-2.0, 0.5])
        """
        rows = as_array(rows).astype(np.int64).reshape(-1)
        vals = as_array(values).astype(np.float64).reshape(-1)
        if len(rows) != len(vals):
            raise SamplerError(f"update_priorities got {len(rows)} rows but {len(vals)} values; pass one value "
                               "per row")
        if len(rows) and rows.min() < 0:
            raise SamplerError(f"rows must be row ids >= 0, got {int(rows.min())}")
        if not np.isfinite(vals).all():
            bad = int(np.flatnonzero(~np.isfinite(vals))[0])
            raise SamplerError(f"values[{bad}]={vals[bad].item()!r} is not finite; priorities must be finite numbers")
        if not len(rows):
            return
        # keep the last value of a repeated row (fancy assignment leaves that order unspecified)
        _, last = np.unique(rows[::-1], return_index=True)
        last = len(rows) - 1 - last
        rows, vals = rows[last], np.abs(vals[last])
        top = float(vals.max())
        self._max_priority = top if self._max_priority is None else max(self._max_priority, top)
        base, end = self._prio.base, self._prio.end
        known = (rows >= base) & (rows < end)
        if known.any():
            kr = rows[known]
            self._prio.values[kr - base] = vals[known]
            tree = self._tree
            if self._tree_valid:
                inside = (kr >= tree.base) & (kr < tree.end)
                kr = kr[inside]
                w = (vals[known][inside] + self.eps) ** self.alpha
                filt = self._tree_filter
                if filt.bound is not None:
                    # the tree was built with these rows' versions read (they are inside it)
                    ok = self._versions.covers(kr) & (self._versions.get(kr) >= filt.bound)
                    w = np.where(ok, w, 0.0)
                if filt.exclude or filt.min_row:
                    w = np.where(in_ranges(kr, filt.blocked), 0.0, w)
                tree.update(kr, w)
        later = rows >= end
        if later.any():
            pr = np.concatenate([self._pending_rows, rows[later]])
            pv = np.concatenate([self._pending_values, vals[later]])
            _, last = np.unique(pr[::-1], return_index=True)
            last = len(pr) - 1 - last
            self._pending_rows, self._pending_values = pr[last], pv[last]
