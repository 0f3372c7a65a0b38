"""Ray: rollout actors on any node append to one store exactly once; a trainer follows it.

The shape. Rollout actors (generation engines, environment workers) each hold
a :class:`RolloutWriter` on one **multi-writer** store: a directory every node
mounts, or an ``s3://`` URL (``storage_options`` go to
:class:`~diskreplay.ReplayStore` unchanged). The trainer holds a
:class:`StoreFollower`: a read-only view that loads new commits before each
draw and samples with any diskreplay sampler. Only acknowledgements (row ids)
travel through Ray; rollouts go to storage once, durably, and a finished run
can be replayed from there offline.

Exactly once across restarts. Ray re-runs an actor's constructor after its
process dies (``max_restarts``) and, with ``max_task_retries``, sends the calls
that were in flight again: at-least-once. A call may have committed its batch
just before the actor died, so the repeated call must not append it twice.
Every batch carries the token ``f"{worker_id}:{step}"``, from a worker id the
constructor is given (the same after a restart, unlike a pid or an actor id
in a resumed job) and the step the caller passes; the repeated call finds its
token committed and returns the rows of the first one. A regenerated batch
differs from the lost one (sampling is random), so :meth:`RolloutWriter.append`
takes a function that makes the batch and calls it only for a step that is not
committed yet.

What travels to actors. Samplers, read-only stores, snapshots and followers
pickle as their settings (path or URL, options, generation, the sampler's
``state_dict()``) and reopen where they land: no memory map or file handle is
pickled, and nothing in the store is ever a pickle. A store opened for writing
refuses to be pickled; open a :class:`RolloutWriter` inside the actor, or send
one (it pickles as its settings and reopens the store on arrival).

:class:`RolloutWriter` and :class:`StoreFollower` need no Ray at all (they are
plain objects an actor holds); :class:`RolloutActor` and
:func:`rollout_actor_class` are a ready-made actor. Ray itself is imported only
where a function needs it: ``pip install 'diskreplay[ray]'``.
``tools/ray_rollouts.py`` runs the whole loop on a local cluster.

>>> import tempfile
>>> from diskreplay import PromptGroupSampler
>>> from diskreplay.synthetic import make_rollouts
>>> path = tempfile.mkdtemp()
>>> with RolloutWriter(path, "actor-0") as writer:           # in each rollout actor
...     rows = writer.append(0, lambda: make_rollouts(2, 4, seed=0))
...     again = writer.append(0, lambda: make_rollouts(2, 4, seed=99))   # a restarted actor re-sending step 0
>>> rows.tolist() == again.tolist(), writer.stats()["replayed"]
(True, 1)
>>> with StoreFollower(path, PromptGroupSampler(samples_per_group=4, seed=0)) as trainer:
...     rows, batch = trainer.sample_batch(8, columns=["prompt_id"])
>>> sorted(set(batch["prompt_id"].tolist()))
[0, 1]
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import ArgumentError, MissingDependencyError, ReadOnlyError
from ..store import ReplayStore
from ..store.consumers import check_max_ahead

__all__ = ["RolloutActor", "RolloutWriter", "StoreFollower", "rollout_actor_class", "token_for_step"]

Batch = Mapping[str, Any]
PathLike = Union[str, "os.PathLike[str]"]


def _ray() -> Any:
    """Ray, imported on first use (importing this module never needs it)."""
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(f"diskreplay.integrations.ray needs Ray ({exc}); install it with "
                                     "pip install 'diskreplay[ray]'") from exc
    return ray


def _store_kwargs(storage_options: Optional[Mapping[str, Any]], options: Mapping[str, Any]) -> Dict[str, Any]:
    # passed on only when given, so the same call opens a local directory and an s3:// URL
    kwargs = dict(options)
    if storage_options is not None:
        kwargs["storage_options"] = dict(storage_options)
    return kwargs


def _check_worker_id(worker_id: Any) -> str:
    if not isinstance(worker_id, str) or not worker_id:
        raise ArgumentError(f"worker_id must be a non-empty str that stays the same when Ray restarts the actor "
                            f"(e.g. f'rollout-{{index}}', passed to its constructor), got {worker_id!r}")
    return worker_id


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ArgumentError(f"step must be a non-negative int (the producer's batch counter, the same when a "
                            f"call is sent again), got {step!r}")
    return int(step)


def token_for_step(worker_id: str, step: int) -> str:
    """The exactly-once token of ``worker_id``'s batch number ``step``.

    The step is an integer, so the last ``:`` separates it and no two
    ``(worker_id, step)`` pairs share a token.

    >>> token_for_step("rollout-3", 17)
    'rollout-3:17'
    """
    return f"{_check_worker_id(worker_id)}:{_check_step(step)}"


def _open_writer(path: PathLike, worker_id: str, storage_options: Optional[Mapping[str, Any]],
                 store_options: Dict[str, Any]) -> "RolloutWriter":
    return RolloutWriter(path, worker_id, storage_options=storage_options, **store_options)


class RolloutWriter:
    """Appends one producer's batches to a multi-writer store, each exactly once, across restarts.

    ``path`` is a directory every node sees or an ``s3://`` URL (with
    ``storage_options``, passed to :class:`~diskreplay.ReplayStore` unchanged).
    The store is created when absent (``multi_writer=True``, with
    ``store_options`` such as ``capacity`` or ``group_key``); create it once
    before starting the actors so that its options come from one place. An
    existing single-writer store is refused (convert it with
    ``diskreplay compact PATH --multi-writer``).

    ``worker_id`` must be unique among the producers of the store and stay the
    same when the actor restarts: pass it to the actor's constructor (Ray
    re-runs the constructor with the same arguments). A store that receives
    several runs needs the run in it (``f"{run}/rollout-{i}"``), or a later run
    would find the earlier run's steps committed.

    ``max_ahead_rows=N`` is back-pressure: before it makes and commits a
    batch, :meth:`append` waits until the store is at most ``N`` rows ahead of
    the slowest rollout stream reading it (a trainer's
    :class:`~diskreplay.stream.RolloutStream`, by its committed cursor), for
    at most ``wait_timeout`` seconds (then it goes on, with a warning: a dead
    trainer does not stop generation for ever).
    :meth:`ReplayStore.wait_for_consumers` has the details.

    The writer pickles as its settings and reopens the store where it lands,
    so a driver can build it and send it to an actor.

    >>> import tempfile
    >>> writer = RolloutWriter(tempfile.mkdtemp(), "rollout-0", capacity=1000)
    >>> writer.append(0, {"prompt_id": [5, 5, 5]}).tolist()
    [0, 1, 2]
    >>> writer.committed(0).tolist(), writer.committed(1), writer.token(1)
    ([0, 1, 2], None, 'rollout-0:1')
    >>> writer.close()
    """

    def __init__(self, path: PathLike, worker_id: str, *, storage_options: Optional[Mapping[str, Any]] = None,
                 max_ahead_rows: Optional[int] = None, wait_timeout: Optional[float] = 60.0,
                 **store_options: Any) -> None:
        self.worker_id = _check_worker_id(worker_id)
        self.max_ahead_rows, self.wait_timeout = check_max_ahead(max_ahead_rows, allow_none=True), wait_timeout
        if "multi_writer" in store_options or "readonly" in store_options:
            raise ArgumentError("RolloutWriter always opens a multi-writer store for writing; leave multi_writer "
                                "and readonly out")
        self.store = ReplayStore(path, multi_writer=True, **_store_kwargs(storage_options, store_options))
        # reopened by the store's own spelling of where it is (absolute, for a local directory)
        self._spec = (self.store.path, self.worker_id, None if storage_options is None else dict(storage_options),
                      {**store_options, "max_ahead_rows": max_ahead_rows, "wait_timeout": wait_timeout})
        #: batches this process committed / found already committed (a re-sent call after a restart)
        self.appended = 0
        self.replayed = 0
        self.rows = 0
        #: seconds spent waiting for the trainer (back-pressure)
        self.waited_s = 0.0

    def token(self, step: int) -> str:
        """The token of batch ``step`` of this worker (see :func:`token_for_step`)."""
        return token_for_step(self.worker_id, step)

    def committed(self, step: int) -> Optional[np.ndarray]:
        """The rows batch ``step`` was committed with, or None if it is not (or no longer remembered).

        Tokens are remembered while any of their rows is live and for at least
        the newest 100,000 commits (docs/FORMAT.md, "Exactly-once tokens").
        """
        return self.store.committed_rows(self.token(step))

    def append(self, step: int, batch: Union[Batch, Callable[[], Batch]]) -> np.ndarray:
        """Commit batch ``step`` once; returns its row ids (the first commit's, when it is a repeat).

        ``batch`` is a batch (anything :meth:`ReplayStore.extend` takes) or a
        function making one: it is called only when the step is not committed
        yet, so a restarted actor does not generate a batch it already
        delivered. Sending the same step again with a *different* batch is a
        :class:`~diskreplay.errors.BatchError`: a step names one batch.
        Errors propagate (an actor that fails is restarted by Ray and the call
        sent again; its token keeps the retry exact).
        """
        token = self.token(step)
        if callable(batch):
            rows = self.store.committed_rows(token)
            if rows is not None:
                self.replayed += 1
                return rows
            self._wait_for_consumers()
            batch = batch()
        else:
            self._wait_for_consumers()
        before = self.store.stats().get("commits", 0)
        rows = self.store.extend(batch, token=token)
        if self.store.stats().get("commits", 0) == before:
            self.replayed += 1
        else:
            self.appended += 1
            self.rows += len(rows)
        return rows

    def _wait_for_consumers(self) -> None:
        if self.max_ahead_rows is not None:
            t0 = time.monotonic()
            self.store.wait_for_consumers(self.max_ahead_rows, timeout=self.wait_timeout)
            self.waited_s += time.monotonic() - t0

    def stats(self) -> Dict[str, Any]:
        """``appended`` / ``replayed`` batches and ``rows`` appended by this process, seconds it
        ``waited_s`` for the trainer, with the store's commit counters (:meth:`ReplayStore.stats`)."""
        return {"worker_id": self.worker_id, "appended": self.appended, "replayed": self.replayed,
                "rows": self.rows, "waited_s": self.waited_s, **self.store.stats()}

    def close(self) -> None:
        """Close the store (makes owed durability good). Idempotent."""
        self.store.close()

    def __enter__(self) -> "RolloutWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> Any:
        return _open_writer, self._spec

    def __repr__(self) -> str:
        return f"RolloutWriter({self.store.path!r}, worker_id={self.worker_id!r})"


def _open_follower(source: Any, sampler: Any, storage_options: Optional[Mapping[str, Any]],
                   verify_reads: bool, follow: bool) -> "StoreFollower":
    return StoreFollower(source, sampler, storage_options=storage_options, verify_reads=verify_reads,
                         follow=follow)


class StoreFollower:
    """The trainer's side: a read-only store that loads new commits, and a sampler drawing from it.

    ``source`` is a path or ``s3://`` URL (opened read-only, with
    ``storage_options``), or an open read-only store or snapshot
    (:meth:`ReplayStore.snapshot`, pinned: it never moves). With ``follow``
    (the default) every draw first loads the newest commit of any writer, so
    fresh rollouts are eligible as soon as they are committed; the sampler's
    own settings (``min_policy_version=``, ``groups=``, ...) go through
    :meth:`sample`.

    A follower pickles as its source and its sampler (whose ``state_dict()``
    carries the stream position), so it can be created in a driver and sent to
    a trainer actor, or be an actor itself: ``ray.remote(StoreFollower)``.

    >>> import tempfile
    >>> from diskreplay import RandomSampler
    >>> path = tempfile.mkdtemp()
    >>> writer = RolloutWriter(path, "w0")
    >>> _ = writer.append(0, {"prompt_id": [1, 2]})
    >>> follower = StoreFollower(path, RandomSampler(seed=0))
    >>> len(follower.sample(2))
    2
    >>> _ = writer.append(1, {"prompt_id": [3, 4]})
    >>> sorted(follower.sample(4).tolist()), follower.stats()["rows"]
    ([0, 1, 2, 3], 4)
    >>> follower.close(); writer.close()
    """

    def __init__(self, source: Union[PathLike, ReplayStore], sampler: Any, *,
                 storage_options: Optional[Mapping[str, Any]] = None, verify_reads: bool = True,
                 follow: bool = True) -> None:
        if not callable(getattr(sampler, "sample", None)):
            raise ArgumentError(f"sampler must be a diskreplay sampler (PromptGroupSampler, RandomSampler, "
                                f"PrioritizedSampler), got {type(sampler).__name__}")
        if isinstance(source, ReplayStore):
            if not source.readonly:
                raise ReadOnlyError(f"StoreFollower needs a read-only store; {source.path} is open for writing: "
                                    f"pass its path, ReplayStore(path, readonly=True) or store.snapshot()")
            if storage_options is not None:
                raise ArgumentError("storage_options go with a path or URL; an open store already has its own")
            self.store = source
        else:
            self.store = ReplayStore(source, readonly=True,
                                     **_store_kwargs(storage_options, {"verify_reads": verify_reads}))
        self._spec = (source if isinstance(source, ReplayStore) else self.store.path,
                      None if storage_options is None else dict(storage_options), verify_reads, follow)
        self.sampler = sampler
        self.follow = follow
        self.refreshes = 0  # newer commits loaded
        self.draws = 0

    def refresh(self) -> bool:
        """Load the newest commit; True if there was one (a pinned snapshot never moves)."""
        moved = self.store.refresh()
        self.refreshes += moved
        return moved

    def wait_for_rows(self, rows: int, *, timeout: float, poll: float = 0.05) -> bool:
        """Refresh until the store has at least ``rows`` live rows; False if ``timeout`` seconds pass first.

        >>> import tempfile
        >>> from diskreplay import RandomSampler
        >>> path = tempfile.mkdtemp()
        >>> RolloutWriter(path, "w0").close()
        >>> StoreFollower(path, RandomSampler()).wait_for_rows(1, timeout=0.1)
        False
        """
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            if len(self.store) >= rows:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)

    def sample(self, batch_size: int, **sample_kwargs: Any) -> np.ndarray:
        """Row ids of the next draw (``sampler.sample(store, batch_size, **sample_kwargs)``), after
        loading the newest commit when following."""
        if self.follow:
            self.refresh()
        rows = self.sampler.sample(self.store, batch_size, **sample_kwargs)
        self.draws += 1
        return rows

    def sample_batch(self, batch_size: int, columns: Optional[Sequence[str]] = None,
                     **sample_kwargs: Any) -> Tuple[np.ndarray, Dict[str, Any]]:
        """``(rows, store.read(rows, columns))`` of the next draw: what ``collate`` takes."""
        rows = self.sample(batch_size, **sample_kwargs)
        return rows, self.store.read(rows, columns)

    def stats(self) -> Dict[str, Any]:
        """``generation`` and ``rows`` of the commit held, ``refreshes`` (newer commits loaded) and ``draws``."""
        return {"generation": self.store.generation, "rows": len(self.store), "refreshes": self.refreshes,
                "draws": self.draws}

    def close(self) -> None:
        """Release the memory maps. Idempotent."""
        self.store.close()

    def __enter__(self) -> "StoreFollower":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> Any:
        source, storage_options, verify_reads, follow = self._spec
        # an open store travels by its own pickling (path and generation); a follower that has
        # moved on reopens at the newest commit, which is never older than the one it held
        return _open_follower, (source, self.sampler, storage_options, verify_reads, follow)

    def __repr__(self) -> str:
        return f"StoreFollower({self.store!r}, {type(self.sampler).__name__})"


class RolloutActor:
    """A ready-made rollout actor: ``rollout(step)`` appends ``produce(step)`` exactly once.

    Made remote by :func:`rollout_actor_class` (or ``ray.remote(...)`` with
    your own options). ``produce`` is a picklable function of the step
    returning a batch (a module-level function, ``functools.partial`` of one,
    or a picklable object); it is not called for a step that is already
    committed. The driver decides the steps, so a call Ray sends again after
    a restart carries the same step and token. ``store_options`` open the
    store as in :class:`RolloutWriter`.

    >>> import tempfile
    >>> from diskreplay.synthetic import make_rollouts
    >>> def produce(step):
    ...     return make_rollouts(2, 4, seed=step, first_group=2 * step, policy_version=step)
    >>> actor = RolloutActor(tempfile.mkdtemp(), "w0", produce)
    >>> len(actor.rollout(0)), actor.run(range(3)), actor.info()["replayed"]
    (8, 24, 1)
    >>> actor.close()
    """

    def __init__(self, path: PathLike, worker_id: str, produce: Callable[[int], Batch], *,
                 storage_options: Optional[Mapping[str, Any]] = None, **store_options: Any) -> None:
        if not callable(produce):
            raise ArgumentError(f"produce must be a function of the step returning a batch, got {produce!r}")
        self.writer = RolloutWriter(path, worker_id, storage_options=storage_options, **store_options)
        self.produce = produce

    def rollout(self, step: int) -> np.ndarray:
        """Append batch ``step`` (made by ``produce(step)`` unless committed before); its row ids."""
        return self.writer.append(step, functools.partial(self.produce, _check_step(step)))

    def run(self, steps: Sequence[int]) -> int:
        """Append the batches of ``steps`` in order; the number of rows they have.

        Sent again after a restart, the call skips the committed steps without
        producing them, so one long call survives restarts too.
        """
        return sum(len(self.rollout(step)) for step in steps)

    def info(self) -> Dict[str, Any]:
        """This process: ``pid``, ``restarted`` (whether Ray re-created the actor after a failure;
        False outside Ray) and the writer's :meth:`RolloutWriter.stats`."""
        restarted = False
        ray = sys.modules.get("ray")  # imported in every Ray worker; not imported here means not in Ray
        if ray is not None and ray.is_initialized():
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        return {"pid": os.getpid(), "restarted": restarted, **self.writer.stats()}

    def close(self) -> None:
        """Close the writer's store."""
        self.writer.close()


def rollout_actor_class(*, max_restarts: int = 3, max_task_retries: int = -1, **actor_options: Any) -> Any:
    """:class:`RolloutActor` as a Ray actor class that survives ``max_restarts`` process deaths.

    ``max_task_retries=-1`` makes Ray send the calls that were in flight again
    to the restarted actor (at-least-once); the tokens make each of them count
    once. ``actor_options`` go to ``ray.remote`` (``num_cpus``, ``resources``,
    ``runtime_env``, ...). Needs Ray (``pip install 'diskreplay[ray]'``).

    >>> import ray                                           # doctest: +SKIP
    >>> Actor = rollout_actor_class(max_restarts=5, num_cpus=1)  # doctest: +SKIP
    >>> actors = [Actor.remote(path, f"rollout-{i}", produce) for i in range(4)]  # doctest: +SKIP
    >>> ray.get([a.rollout.remote(step) for a in actors for step in range(10)])  # doctest: +SKIP

    (Skipped in the doctests: it needs a running Ray cluster, which takes
    seconds to start; ``tests/test_ray.py`` starts one and runs exactly this.)
    """
    for name, value in (("max_restarts", max_restarts), ("max_task_retries", max_task_retries)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ArgumentError(f"{name} must be an int >= -1 (-1: without limit), got {value!r}")
    return _ray().remote(max_restarts=max_restarts, max_task_retries=max_task_retries,
                         **actor_options)(RolloutActor)
