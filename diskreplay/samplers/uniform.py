"""``RandomSampler``: single rows, uniformly (passes without replacement, or with replacement)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from ..errors import SamplerError, StoreClosedError
from .base import Sampler, Setting, check_flag, no_groups, positive


class RandomSampler(Sampler):
    """Uniformly random rows: passes without replacement (default) or independent draws with replacement.

    Without replacement (TorchRL's ``SamplerWithoutReplacement``) the sampler
    walks one permutation of the live rows with a cursor, so no row repeats
    within a pass; ``shuffle=False`` walks them in row-id order (the order they
    were written). A pass restarts (a new permutation) when it is used up, or
    when the live rows changed (an append or eviction) since it began; a saved
    state (``store.save_state``) does not count as a change. When a pass has
    fewer rows left than a batch needs, ``drop_last=False`` (the default)
    completes the batch from the next pass, skipping rows already in the batch
    (they come next in the new pass); ``drop_last=True`` drops the rest of the
    pass and takes the whole batch from the next one. Asking for more rows
    than are eligible is an error. With ``replacement=True`` each row is drawn
    uniformly and independently.

    Rows below ``min_policy_version``, in ``exclude`` or below ``min_row`` are
    skipped (and not revisited in that pass). With ``rank`` / ``world_size`` every rank walks the same pass and
    takes its slice of each global batch of ``batch_size * world_size`` rows.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [0, 0, 1, 1], "completion_ids": [[1]] * 4})
    >>> s = RandomSampler(seed=0)
    >>> sorted(s.sample(store, 2).tolist() + s.sample(store, 2).tolist())
    [0, 1, 2, 3]
    >>> RandomSampler(shuffle=False).sample(store, 3).tolist()
    [0, 1, 2]
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

    def __repr__(self) -> str:
        return f"RandomSampler(replacement={self.replacement}, drop_last={self.drop_last}, shuffle={self.shuffle})"

    def _position_extra(self) -> Dict[str, Any]:
        return {"pass": self._perm, "cursor": int(self._cursor),
                "pass_head": int(self._live[0]), "pass_next_row": int(self._live[1])}

    def _load(self, position: Dict[str, Any], data: Dict[str, Any]) -> None:
        perm = position["pass"]
        self._perm = None if perm is None else np.array(perm, dtype=np.int64).reshape(-1)
        self._cursor = int(position["cursor"])
        self._live = (int(position["pass_head"]), int(position["pass_next_row"]))

    def sample(self, store: Any, batch_size: int, *, groups: Any = None, min_policy_version: Optional[float] = None,
               exclude: Any = None, min_row: Optional[int] = None) -> np.ndarray:
        """Row ids of ``batch_size`` rows (see the class docstring).

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
        ranks = "" if self.world_size == 1 else f" * world_size={self.world_size}"
        if self.replacement:
            if n_elig == 0:
                raise SamplerError(f"the store at {store.path} has no live row{stale} to draw; extend it first"
                                   + filt.fix())
            if elig is None:
                rows = head + self._rng.integers(0, n_elig, need)
            else:
                rows = head + elig.ids[self._rng.integers(0, n_elig, need)]
        else:
            if need > n_elig and not len(store):
                raise SamplerError(f"the store at {store.path} has no live rows; extend it first")
            if need > n_elig:
                raise SamplerError(f"batch_size={batch_size}{ranks} exceeds the {n_elig} live rows{stale} of the "
                                   "store; a pass without replacement cannot repeat rows: lower batch_size or use "
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
                if not self.drop_last or out:
                    out.append(window[idx])
                    need -= len(idx)
                self._cursor = len(self._perm)
                continue
            idx = idx[:need]
            last = int(idx[-1]) + 1
            taken = window[idx]
            if dup is not None and dup[:last].any():
                # keep the pass a permutation: taken rows, then skipped stale rows, and the rows this
                # batch already holds right after the cursor, so they come first next time (on a copy:
                # position() may have handed the old array out)
                d = dup[:last]
                rest = window[:last][~ok[:last] & ~d]
                perm = self._perm.copy()
                perm[self._cursor:self._cursor + last] = np.concatenate([taken, rest, window[:last][d]])
                self._perm = perm
                self._cursor += last - int(d.sum())
            else:
                self._cursor += last
            out.append(taken)
            need = 0
        return np.concatenate(out)
