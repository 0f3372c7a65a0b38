"""``ReplayBuffer``: the TorchRL-shaped ``extend`` / ``sample`` convenience over a store.

It runs everything on the caller's thread, one call at a time: ``sample``
draws row ids with the sampler, reads them, collates them and moves them to
``device``. For a prefetching pipeline use :class:`~diskreplay.loader.ReplayLoader`;
both hold :func:`~diskreplay.loader.store_lock` on the store they share, so
``ReplayBuffer.extend`` may append while a loader iterates the same store.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Union

import numpy as np
import torch

from .batching.collator import Collator
from .errors import ArgumentError, SamplerError
from .following import StoreFollowing, resolve_device, restore_state, state_key, store_lock

__all__ = ["ReplayBuffer"]


class ReplayBuffer:
    """A replay buffer on a :class:`~diskreplay.store.ReplayStore`, in the shape TorchRL users know.

    ``extend(batch)`` appends rollouts (``store.extend``: TRL's padded layout
    or lists of arrays) and returns their row ids. ``sample()`` draws
    ``batch_size`` rows with ``sampler`` (extra keyword arguments such as
    ``groups=`` or ``min_policy_version=`` go to ``sampler.sample``) and
    returns the rows collated by a :class:`~diskreplay.batching.collator.Collator`
    (``layout="padded"``: TRL's layout, per-row columns only when the store
    has no token columns; ``layout="packed"``: one padding-free token
    stream), plus ``"rows"``, the int64 row ids drawn, for
    :meth:`update_priorities`. A read-only store is refreshed before every
    draw, so the buffer follows a live writer; ranks (a sampler's
    ``world_size > 1``, ``torch.distributed`` initialised) move to rank 0's
    newest commit together at each draw (a collective), so their draws stay
    disjoint.

    **Validity**: every batch owns its memory, as TorchRL's do: a batch
    kept (``list(rb)``, a list of samples) never changes under a later
    ``sample()``. ``reuse_buffers=True`` trades that for speed: the batches
    are written into one set of reused host buffers (a
    :class:`~diskreplay.batching.collator.Collator`'s, ``"rows"`` among
    them), so with ``device`` None or CPU a batch stays valid until the next
    ``sample()``; ``.clone()`` what you keep longer (with a CUDA ``device``
    each batch is a fresh copy on it). ``collate_fn(batch, pad_token_id)``
    replaces the built-in collation (it gets ``store.read(rows)``; it cannot
    be combined with ``reuse_buffers``).

    The sampler's state lives in the store under ``state_name`` (``NAME.rankR``
    for a sampler of one rank of several): restored on construction when
    present, written by :meth:`save` and by :meth:`close` (on a writable
    store), so a restarted job continues the same stream.

    >>> import tempfile, torch
    >>> from diskreplay import ReplayStore, PromptGroupSampler
    >>> path = tempfile.mkdtemp()
    >>> rb = ReplayBuffer(ReplayStore(path, capacity=100, group_key="prompt"),
    ...                   sampler=PromptGroupSampler(num_groups=2, group_key="prompt"), batch_size=8)
    >>> rb.extend({"prompt": torch.tensor([0,0,0,0,1,1,1,1,2,2,2,2]), "reward": torch.arange(12.0)}).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    >>> s = rb.sample()   # 2 distinct prompts, 8 rows
    >>> sorted(s), s["reward"].shape, len(set(s["prompt"].tolist()))
    (['prompt', 'reward', 'rows'], torch.Size([8]), 2)
    >>> len(rb)
    12
    >>> rb.close()
    """

    def __init__(self, store: Any, sampler: Any, batch_size: int, pad_token_id: int = 0,
                 collate_fn: Optional[Callable[[Mapping[str, Any], int], Dict[str, Any]]] = None,
                 device: Union[None, str, torch.device] = None,
                 state_name: Optional[str] = "replay_buffer", *, layout: str = "padded",
                 reuse_buffers: bool = False) -> None:
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1:
            raise ArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not hasattr(sampler, "sample"):
            raise ArgumentError(f"sampler must have sample(store, batch_size), got {type(sampler).__name__}; "
                                "pass e.g. PromptGroupSampler(num_groups=8)")
        self.store, self.sampler = store, sampler
        self.batch_size, self.pad_token_id = int(batch_size), pad_token_id
        if not isinstance(reuse_buffers, bool):
            raise ArgumentError(f"reuse_buffers must be True or False, got {reuse_buffers!r}")
        if reuse_buffers and collate_fn is not None:
            raise ArgumentError("reuse_buffers=True reuses the built-in collator's buffers; a collate_fn owns its "
                                "outputs: pass one or the other")
        self.layout, self.reuse_buffers, self.collate_fn = layout, reuse_buffers, collate_fn
        self._collator = None if collate_fn is not None else Collator(pad_token_id, layout=layout)
        self.device = resolve_device(device, "sample() returns")
        self.state_name = state_name
        self._closed = False
        restore_state(store, state_name, sampler, "ReplayBuffer")
        self._following = StoreFollowing(store, sampler, "ReplayBuffer")

    def __len__(self) -> int:
        return len(self.store)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        """The rest of the sampler's pass, ``batch_size`` rows at a time (TorchRL's iteration).

        Needs a sampler with passes, ``RandomSampler(replacement=False)``:
        the batches walk the rest of its current pass (a whole new one when
        the last pass ended), so every live row comes once, in the sampler's
        order (``shuffle=False``: row-id order), and iteration stops when the
        sampler says it ran out (``sampler.ran_out``, as TorchRL's loop does).
        The last batch holds what is left of the pass, fewer rows, unless the
        sampler has ``drop_last=True`` (then it is left out). With ``rank`` /
        ``world_size`` each rank gets its slices of the same pass. An empty
        store gives no batch.

        >>> import tempfile
        >>> from diskreplay import ReplayStore, RandomSampler
        >>> rb = ReplayBuffer(ReplayStore(tempfile.mkdtemp()), RandomSampler(shuffle=False), batch_size=4,
        ...                   state_name=None)
        >>> _ = rb.extend({"prompt_id": list(range(10))})
        >>> [b["rows"].tolist() for b in rb]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        >>> rb.close()
        """
        if not hasattr(self.sampler, "pass_remaining"):
            raise SamplerError(f"iterating a ReplayBuffer walks one pass over the live rows, which "
                               f"{type(self.sampler).__name__} does not make; use RandomSampler(replacement=False), "
                               "or call sample() in a loop")
        view = self._view()
        with store_lock(view):
            self.sampler.pass_remaining(view)  # (a sampler drawing with replacement refuses here)
            if not len(view):
                return
        while True:
            yield self.sample()
            if self.sampler.ran_out:
                return

    def _view(self) -> Any:
        """The store the next draw reads: refreshed (a reader following a writer), or, for ranks
        following one together, the snapshot of the generation they agreed on (a collective)."""
        view = self._following.view(self._following.agree())
        self._following.keep_only(view)
        return view

    def __repr__(self) -> str:
        return f"ReplayBuffer({self.store!r}, sampler={self.sampler!r}, batch_size={self.batch_size})"

    def extend(self, batch: Mapping[str, Any]) -> np.ndarray:
        """Append rows in one durable commit; returns their int64 row ids."""
        with store_lock(self.store):
            return self.store.extend(batch)

    def sample(self, batch_size: Optional[int] = None, **sampler_kwargs: Any) -> Dict[str, Any]:
        """Draw, read and collate ``batch_size`` rows (default: the buffer's); see the class docstring."""
        view = self._view()
        with store_lock(view):
            rows = np.array(self.sampler.sample(view, self.batch_size if batch_size is None else batch_size,
                                                 **sampler_kwargs), dtype=np.int64)
            if self._collator is None:
                out = self.collate_fn(view.read(rows), self.pad_token_id)
            else:
                out = self._collator.read(view, rows, fresh=not self.reuse_buffers)
        if self.device is not None:
            out = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        ids = torch.from_numpy(rows)
        if self.reuse_buffers:
            ids = self._collator.buffers.take("rows", ids.shape, torch.int64).copy_(ids)
        out["rows"] = ids
        return out

    def update_priorities(self, rows: Any, values: Any) -> None:
        """Forward to ``sampler.update_priorities``; a no-op for samplers without priorities (as in TorchRL)."""
        update = getattr(self.sampler, "update_priorities", None)
        if update is None:
            return
        if isinstance(rows, torch.Tensor):
            rows = rows.detach().cpu().numpy()
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().numpy()
        update(rows, values)

    def state_dict(self) -> Dict[str, Any]:
        """The sampler's ``state_dict()``."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a sampler state; the next ``sample()`` continues that stream."""
        self.sampler.load_state_dict(dict(state))

    def save(self) -> None:
        """Persist the sampler's state in the store under ``state_name`` (a durable commit)."""
        if self.state_name is None:
            raise ArgumentError("save() needs a state_name; pass state_name='...' to ReplayBuffer")
        with store_lock(self.store):
            self.store.save_state(state_key(self.state_name, self.sampler), self.sampler.state_dict())

    def close(self, save: bool = True) -> None:
        """Save the sampler state (``save=True``, a writable store, a ``state_name``) and close the store.

        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if save and self.state_name is not None and not self.store.readonly:
                self.save()
        finally:
            self._following.keep_only()
            with store_lock(self.store):
                self.store.close()

    def __enter__(self) -> "ReplayBuffer":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # after an error the sampler may be mid-draw: keep the last saved state
        self.close(save=exc_type is None)
