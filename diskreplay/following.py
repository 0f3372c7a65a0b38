"""What :class:`~diskreplay.loader.ReplayLoader` and :class:`~diskreplay.buffer.ReplayBuffer` share:
the device they yield to, the sampler state they resume and save, the live store they follow
(across ranks), and the lock of the store object they draw from."""

from __future__ import annotations

import operator
import re
import threading
import warnings
import weakref
from typing import Any, Dict, Optional

import torch

from .errors import ArgumentError, SamplerError

_STORE_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_STORE_LOCKS_GUARD = threading.Lock()


def resolve_device(device: Any, who: str = "it yields") -> Optional[torch.device]:
    """``device`` as a ``torch.device`` (None: CPU). An integer is a CUDA device index (a
    ``local_rank``); a CUDA device on a machine without CUDA warns and gives CPU tensors
    (so the same training script runs on a laptop or a CPU CI machine).

    >>> resolve_device(None) is None, resolve_device("cpu")
    (True, device(type='cpu'))
    """
    if device is None:
        return None
    index = None
    if not isinstance(device, (str, torch.device, bool)) and hasattr(device, "__index__"):
        try:
            index = operator.index(device)  # an int, a numpy integer, a 0-d integer tensor: a CUDA index
        except TypeError:
            pass
    if index is not None:
        device = index
        if device < 0:
            raise ArgumentError(f"device={device}: a CUDA device index is >= 0")
        dev = torch.device("cuda", device)
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ArgumentError(f"device={device!r} is not a torch device ({exc}); pass e.g. 'cuda', 'cuda:0', "
                                "0 or 'cpu'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"device={device!r}: this machine has no CUDA, so {who} CPU tensors", RuntimeWarning,
                      stacklevel=3)
        return None
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def state_key(state_name: str, sampler: Any) -> str:
    """Where ``state_name``'s state of ``sampler`` is kept: a sampler of one rank of several keeps its
    own (``NAME.rankR``), so that ranks sharing a store and a name do not overwrite each other's.

    >>> from diskreplay import RandomSampler
    >>> state_key("ssr", RandomSampler()), state_key("ssr", RandomSampler(rank=1, world_size=2))
    ('ssr', 'ssr.rank1')
    """
    world = getattr(sampler, "world_size", 1)
    return state_name if not world or world <= 1 else f"{state_name}.rank{getattr(sampler, 'rank', 0)}"


def restore_state(store: Any, state_name: Optional[str], sampler: Any, owner: str) -> None:
    """Load the sampler state the store keeps under ``state_name`` (if any) into ``sampler``; a state
    this sampler cannot take is an error that says how to start afresh instead."""
    if state_name is None:
        return
    key = state_key(state_name, sampler)
    saved = store.load_state(key)
    if saved is None:
        _refuse_other_layouts(store, state_name, key, sampler, owner)
        return
    try:
        sampler.load_state_dict(saved)
    except SamplerError as exc:
        raise SamplerError(f"{store.path} keeps a sampler state under state_name={key!r} that this "
                           f"{type(sampler).__name__} cannot take ({exc}); pass {owner} another state_name, or "
                           "state_name=None to start without it") from None


def _refuse_other_layouts(store: Any, state_name: str, key: str, sampler: Any, owner: str) -> None:
    """No state under ``key``, but states of ``state_name`` saved by ranks of another ``world_size``:
    every rank refuses alike (some starting afresh while the others resume, or raise, would break
    the one global batch, or hang the job in its next collective)."""
    manifest = getattr(store, "manifest", None)
    world = getattr(sampler, "world_size", 1) or 1
    pattern = re.compile(re.escape(state_name) + r"(?:\.rank(\d+))?")
    saved_ranks = {}  # the other states of this name: the rank each was saved by (None: one process)
    for name in sorted(getattr(manifest, "states", None) or ()):
        m = pattern.fullmatch(name)
        if m is not None and name != key:
            saved_ranks[name] = None if m.group(1) is None else int(m.group(1))
    if not saved_ranks:
        return
    # one save's ranks share a world size: the names tell most cases (a state saved by one process, or a
    # rank this world does not have); else one state says the world size it was saved under
    if world > 1 and None not in saved_ranks.values() and max(saved_ranks.values()) < world:
        saved = store.load_state(next(iter(saved_ranks)))
        config = saved.get("config") if isinstance(saved, dict) else None
        if ((config.get("world_size") if isinstance(config, dict) else None) or 1) == world:
            return  # this rank's own state is missing (it never saved): it starts afresh, as before
    raise SamplerError(f"{store.path} keeps sampler states under state_name={state_name!r} saved by ranks of "
                       f"another world size ({', '.join(saved_ranks)}), and none for this rank "
                       f"{getattr(sampler, 'rank', 0)} of world_size={world} ({key!r}): resume with the world size "
                       f"they were saved under, or pass {owner} another state_name (or state_name=None) to start afresh")


class StoreFollowing:
    """How a loader or buffer on a read-only store keeps up with a live writer.

    One rank: the store is ``refresh()``-ed before every draw. Ranks of one job
    (``world_size > 1``): ranks refreshing on their own sit on both sides of a
    commit now and then and draw overlapping rows, so they move together: rank
    0's newest generation is broadcast (:func:`~diskreplay.samplers.distributed.agreed_newest`,
    a collective each rank makes at the same batch) and every rank draws from
    a pinned snapshot of it. Without ``torch.distributed`` ranks cannot agree,
    and the store is left where it is (a warning says so, once).
    """

    def __init__(self, store: Any, sampler: Any, owner: str) -> None:
        self.store = store
        world = getattr(sampler, "world_size", 1) or 1
        follows = bool(getattr(store, "readonly", False)) and not getattr(store, "pinned", False)
        self.mode = "none" if not follows else "refresh" if world <= 1 else "agreed"
        self.snapshots: Dict[int, Any] = {}
        if self.mode == "agreed" and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            self.mode = "none"
            warnings.warn(f"{owner} with world_size={world} on a read-only store, without torch.distributed: the "
                          "ranks cannot agree on a generation, so it stays on the one the store holds (ranks "
                          "refreshing on their own would draw overlapping rows); initialise torch.distributed, or "
                          "refresh the store where every rank does", RuntimeWarning, stacklevel=3)

    def agree(self) -> Optional[int]:
        """The generation every rank draws from next (a collective); None when not following as ranks."""
        if self.mode != "agreed":
            return None
        from .samplers.distributed import agreed_newest

        return agreed_newest(self.store)  # (refresh takes the store's lock, not the broadcast)

    def view(self, generation: Optional[int]) -> Any:
        """What the next draw reads: the refreshed store, or the pinned snapshot of ``generation``."""
        if self.mode == "refresh":
            self.store.refresh()
        if generation is None or self.mode != "agreed":
            return self.store
        snap = self.snapshots.get(generation)
        if snap is None:
            snap = self.snapshots[generation] = self.store.snapshot(generation)
        return snap

    def keep_only(self, *views: Any) -> None:
        """Close the snapshots no draw in flight reads any more."""
        for g in [g for g, snap in self.snapshots.items() if not any(snap is v for v in views)]:
            self.snapshots.pop(g).close()


def store_lock(store: Any) -> threading.RLock:
    """The lock that serialises loaders and buffers using one ``ReplayStore`` object.

    It is the store's own re-entrant ``lock`` (every ``ReplayStore`` method
    takes it). The loader's worker holds it while it samples and again while
    it reads, so the training loop can append in between; rows evicted in that
    gap are drawn again (``RowsEvictedError`` is retried).

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> with store_lock(store):  # e.g. while a loader iterates this store object
    ...     rows = store.extend({"prompt_id": [1], "completion_ids": [[2, 3]]})
    >>> store_lock(store) is store_lock(store)
    True
    """
    lock = getattr(store, "lock", None)
    if lock is not None:
        return lock
    with _STORE_LOCKS_GUARD:
        lock = _STORE_LOCKS.get(store)
        if lock is None:
            lock = _STORE_LOCKS[store] = threading.RLock()
        return lock
