"""``RandomSampler``: single rows, uniformly (passes without replacement, or with replacement)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ..errors import SamplerError, StoreClosedError
from .base import Sampler, Setting, check_flag, no_groups, positive


class RandomSampler(Sampler):
    """Uniformly random rows: passes without replacement (default) or independent draws with replacement.

    Without replacement the sampler follows TorchRL's
    ``SamplerWithoutReplacement``: it walks one permutation of the live rows
    with a cursor, so no row repeats within a pass; ``shuffle=False`` walks
    them in row-id order (the order they were written). A pass ends with what
    is left of it: ``drop_last=False`` (the default) returns those rows as a
    shorter batch, ``drop_last=True`` drops them when they are fewer than the
    batch. The next draw starts a new pass, as does a draw after the live
    rows changed (an append or eviction); a saved state
    (``store.save_state``) does not count as a change. :attr:`ran_out` tells
    when the last draw ended its pass (TorchRL's flag, which
    ``ReplayBuffer``'s iteration stops on). So a store smaller than the batch
    gives all its rows with ``drop_last=False``, and an error with
    ``drop_last=True``. One deliberate difference: TorchRL decides a pass's
    end by the previous call's batch size, so a larger batch drawn next can
    come short under ``drop_last=True``; here it starts the new pass (every
    ``drop_last=True`` batch is whole). With ``replacement=True`` each row is
    drawn uniformly and independently.

    Rows below ``min_policy_version``, in ``exclude`` or below ``min_row`` are
    skipped (and not revisited in that pass). With ``rank`` / ``world_size`` every rank walks the same pass and
    takes its slice of each global batch of ``batch_size * world_size`` rows
    (of a pass's shorter last batch, an even share: ``numpy.array_split``).

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [0, 0, 1, 1], "completion_ids": [[1]] * 4})
    >>> s = RandomSampler(seed=0)
    >>> sorted(s.sample(store, 2).tolist() + s.sample(store, 2).tolist())
    [0, 1, 2, 3]
    >>> ordered = RandomSampler(shuffle=False)
    >>> [ordered.sample(store, 3).tolist() for _ in range(3)]
    [[0, 1, 2], [3], [0, 1, 2]]
    """

    _CONFIG = ("replacement", "drop_last", "shuffle", "policy_version_key", "rank", "world_size")

    replacement = Setting(check_flag)
    drop_last = Setting(check_flag)
    shuffle = Setting(check_flag)

    def __init__(self, replacement: bool = False, seed: Optional[int] = None,
                 policy_version_key: str = "policy_version", *, drop_last: bool = False, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__(seed, policy_version_key, rank, world_size)
        self.replacement = replacement
        self.drop_last = drop_last
        self.shuffle = shuffle
        self._perm: Optional[np.ndarray] = None  # never written in place once made: position() shares it
        self._cursor = 0
        self._live = (0, 0)  # (head, next_row) the pass was made for
        self._ran_out = False

    def __repr__(self) -> str:
        return f"RandomSampler(replacement={self.replacement}, drop_last={self.drop_last}, shuffle={self.shuffle})"

    def _position_extra(self) -> Dict[str, Any]:
        return {"pass": self._perm, "cursor": int(self._cursor),
                "pass_head": int(self._live[0]), "pass_next_row": int(self._live[1]), "ran_out": self._ran_out}

    def _load(self, position: Dict[str, Any], data: Dict[str, Any]) -> None:
        perm = position["pass"]
        self._perm = None if perm is None else np.array(perm, dtype=np.int64).reshape(-1)
        self._cursor = int(position["cursor"])
        self._live = (int(position["pass_head"]), int(position["pass_next_row"]))
        self._ran_out = bool(position.get("ran_out", False))  # (states saved before the flag lack it)

    @property
    def ran_out(self) -> bool:
        """Whether the last draw ended its pass (the next one starts a new pass), as TorchRL's sampler says.

        >>> import tempfile
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 1, 2], "completion_ids": [[1]] * 3})
        >>> s = RandomSampler(seed=0)
        >>> _ = s.sample(store, 2); s.ran_out
        False
        >>> len(s.sample(store, 2)), s.ran_out
        (1, True)
        """
        return self._ran_out

    def sample(self, store: Any, batch_size: int, *, groups: Any = None, min_policy_version: Optional[float] = None,
               exclude: Any = None, min_row: Optional[int] = None) -> np.ndarray:
        """Row ids of ``batch_size`` rows, fewer at the end of a pass (see the class docstring).

        ``min_policy_version``: rows whose ``policy_version_key`` is below it
        are never drawn. ``exclude``: row-id ranges ``[(start, stop), ...]``
        (stop exclusive) never drawn. ``min_row``: rows with a smaller id are
        never drawn (a window of the newest rows). Every rank must pass the
        same values.

        >>> import tempfile
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 1, 2, 3], "completion_ids": [[1]] * 4})
        >>> RandomSampler(replacement=True, seed=0).sample(store, 5).shape
        (5,)
        >>> sorted(RandomSampler(seed=0).sample(store, 2, exclude=[(1, 3)]).tolist())
        [0, 3]
        """
        batch_size = positive("batch_size", batch_size, "pass the number of rows to draw")
        no_groups(groups, type(self).__name__)
        if getattr(store, "closed", False):  # (it reads nothing from the store: no read would refuse)
            raise StoreClosedError(f"{store.path} is closed; open it again to sample it")
        need = self._global(batch_size)
        filt = self._filter(min_policy_version, exclude, min_row)
        head, nxt = store.head, store.next_row
        self._counts.sync(store)
        elig = self._eligible(store, filt)
        n_elig = nxt - head if elig is None else elig.count
        stale = filt.describe(self.policy_version_key)
        if n_elig == 0:
            empty = "rows" if not len(store) else f"row{stale} to draw"
            raise SamplerError(f"the store at {store.path} has no live {empty}; extend it first" + filt.fix())
        if self.replacement:
            pick = self._rng.integers(0, n_elig, need)
            rows = head + (pick if elig is None else elig.ids[pick])
        else:
            if self.drop_last and need > n_elig:
                ranks = "" if self.world_size == 1 else f" * world_size={self.world_size}"
                raise SamplerError(f"batch_size={batch_size}{ranks} exceeds the {n_elig} live rows{stale} of the "
                                   "store, and drop_last=True drops every batch short of it: lower batch_size, "
                                   "use RandomSampler(drop_last=False) for the shorter batch, or "
                                   "RandomSampler(replacement=True)" + filt.fix())
            rows = self._take(head, nxt, None if elig is None else elig.mask, need)
        return self._record(self._mine(rows.astype(np.int64, copy=False), batch_size))

    def pass_remaining(self, store: Any) -> int:
        """Rows this rank has left in the current pass (a new pass starts when it is used up or the store changed).

        ``ReplayBuffer`` iterates one pass with it: batches of at most this many rows.

        >>> import tempfile
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 1, 2], "completion_ids": [[1]] * 3})
        >>> s = RandomSampler(seed=0); _ = s.sample(store, 2)
        >>> s.pass_remaining(store)
        1
        """
        if self.replacement:
            raise SamplerError("RandomSampler(replacement=True) has no passes; build it with replacement=False")
        head, nxt = store.head, store.next_row
        if self._perm is None or self._live != (head, nxt) or self._cursor >= len(self._perm):
            self._new_pass(head, nxt)
        return (len(self._perm) - self._cursor) // self.world_size

    def _new_pass(self, head: int, nxt: int) -> None:
        order = self._rng.permutation(nxt - head) if self.shuffle else np.arange(nxt - head)
        self._perm = head + order.astype(np.int64)
        self._cursor = 0
        self._live = (head, nxt)

    def _take(self, head: int, nxt: int, elig: Optional[np.ndarray], need: int) -> np.ndarray:
        """The next ``need`` eligible rows of the pass (fewer at its end), TorchRL's rule for the pass's end."""
        if self._perm is None or self._live != (head, nxt):
            self._new_pass(head, nxt)
        idx = self._open(head, elig)
        if not len(idx) or (self.drop_last and len(idx) < need):
            self._new_pass(head, nxt)
            idx = self._open(head, elig)
        taken = idx[:need]
        rows = self._perm[self._cursor + taken]
        left = len(idx) - len(taken)
        self._cursor = len(self._perm) if not left else self._cursor + int(taken[-1]) + 1
        self._ran_out = not left or (self.drop_last and left < need)
        return rows

    def _open(self, head: int, elig: Optional[np.ndarray]) -> np.ndarray:
        """Positions, from the cursor, of the pass's rows a draw may take."""
        window = self._perm[self._cursor:]
        return np.arange(len(window)) if elig is None else np.flatnonzero(elig[window - head])
