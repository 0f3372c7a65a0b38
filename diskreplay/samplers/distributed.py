"""Ranks agreeing on the store generation they sample from.

Samplers with ``rank`` / ``world_size`` draw disjoint slices of one global
batch only if every rank sees the same rows: the same store generation. A
writer may commit between two ranks' draws, so each rank samples from a
pinned snapshot of one generation that rank 0 chooses and broadcasts.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ..errors import SamplerError


def _open_generation(store: Any, generation: int) -> Any:
    """``generation`` of ``store`` pinned, opened with the store's own options (an ``s3://`` store's
    storage options, its cache, ``verify_reads``): ``store.snapshot(generation)``."""
    snapshot = getattr(store, "snapshot", None)
    if snapshot is None:
        raise SamplerError(f"agree_generation needs pinned snapshots (ReplayStore(path, readonly=True, "
                           f"generation=N) and store.snapshot()), which this {type(store).__name__} does not "
                           "offer; upgrade diskreplay, or make every rank sample from one read-only store that "
                           "no writer changes")
    return snapshot(generation)


def agree_generation(store: Any, group: Optional[Any] = None) -> Any:
    """A read-only snapshot of ``store`` at rank 0's current generation, the same on every rank.

    With ``torch.distributed`` initialised, rank 0 (of ``group``) loads the
    newest commit (``store.refresh()``), broadcasts its generation, and every
    rank opens that generation pinned
    (``store.snapshot(N)``: with ``store``'s own options), so samplers built
    with the same seed and settings and ``rank=dist.get_rank()``,
    ``world_size=dist.get_world_size()`` draw disjoint slices of one global
    batch even while a writer keeps appending. Without ``torch.distributed``
    (one process) it pins the current generation. Close the snapshot when
    done (it is a context manager); call again to move to a newer generation.
    A snapshot reads its generation's files while the writer's clean-up
    retains them: an hour in a multi-writer store, and in a single-writer
    store only the newest 4 generations unless it was created with
    ``retain_seconds`` (held longer, a read raises ``StoreNotFoundError``
    saying so).

    A :class:`PrioritizedSampler`'s ranks stay one global draw only while
    their priorities agree: give every rank's ``update_priorities`` the
    rows and values of all ranks (``dist.all_gather`` them), not its own.

    >>> import tempfile
    >>> from diskreplay import ReplayStore, PromptGroupSampler
    >>> store = ReplayStore(tempfile.mkdtemp())  # in a torchrun job: ReplayStore(path, readonly=True)
    >>> _ = store.extend({"prompt_id": [1, 1, 2, 2]})
    >>> with agree_generation(store) as snap:
    ...     _ = store.extend({"prompt_id": [3, 3]})  # a writer goes on; the ranks' draws do not move
    ...     rows = PromptGroupSampler(num_groups=1, rank=0, world_size=2, seed=0).sample(snap, 2)
    ...     len(snap), sorted(set(snap.read(rows)["prompt_id"].tolist())) in ([1], [2])
    (4, True)
    >>> store.close()
    """
    generation = agreed_newest(store, group)
    return _open_generation(store, _newest(store) if generation is None else generation)


def agreed_newest(store: Any, group: Optional[Any] = None) -> Optional[int]:
    """Rank 0's newest generation of ``store``, on every rank of ``group`` (a collective: every
    rank calls it at the same point); None without ``torch.distributed`` (one process)."""
    agreed = broadcast_ints(lambda: [_newest(store)], 1, group)
    return None if agreed is None else agreed[0]


def broadcast_ints(source: Any, count: int, group: Optional[Any] = None) -> Optional[List[int]]:
    """``source()`` (``count`` ints) as rank 0 of ``group`` computes it, on every rank (a collective:
    every rank calls it at the same point; only rank 0 calls ``source``); None without
    ``torch.distributed`` (one process).

    >>> broadcast_ints(lambda: [3, 4], 2) is None  # not in a torchrun job
    True
    """
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a core dependency
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    src = dist.get_global_rank(group, 0) if group is not None else 0
    values = [int(v) for v in source()] if dist.get_rank() == src else [0] * count  # only the source's count
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=src, group=group)
    return [int(v) for v in tensor.tolist()]


def _newest(store: Any) -> int:
    """The newest generation ``store`` can read now: a reader (a read-only store, another writer's
    commits) loads the newest commit first (``refresh``; a pinned one stays where it is)."""
    refresh = getattr(store, "refresh", None)
    if refresh is not None:
        refresh()
    return int(store.generation)
