"""``ReplayStore``: the crash-safe, unpadded, memory-mapped rollout store (the facade).

Rows get global ids that only grow; live rows are ``[head, next_row)``. Each ``extend`` is one
commit (docs/FORMAT.md): the writing side (``writer``) builds it as a value (``commits``) and the
one commit loop (``committer``) publishes it. This module holds the public methods with their
examples; each delegates to a part of this package (``opening``, ``writer``, ``views``,
``segment_cache``, ``group_views``, ``consumers``, ``patching``), and no part imports it.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from .. import format as fmt
from ..errors import ArgumentError, StoreClosedError
from ..groups import GroupIndex
from ..schema import Schema
from ..segment import PageChecksums, Segment
from ..storage import open_storage
from ..storage.base import Lock
from .commits import INDEX_TAIL_SEGMENTS  # noqa: F401 (the store's constant)
from .committer import Committer
from .consumers import DEAD_AFTER_S, INCOMPLETE_AFTER_S, Consumer, consumers, wait_for_consumers
from .compaction import MergePolicy
from .group_views import GroupIndexes
from .appending import WriterContext
from .segment_cache import Column, ReadView, SegmentCache
from .patching import versions_of
from .opening import UNSET, Requested, close_store, open_store
from . import views, writer
from .views import STALE_RETRIES, follow, live_rows, locked, schema_of  # noqa: F401 (STALE_RETRIES: re-exported)
from .writer import Writer

_UNSET: Any = UNSET


def _reopen(path: str, generation: Optional[int], verify_reads: bool, storage_args: Tuple[Any, ...] = (None, None, None)
            ) -> "ReplayStore":
    storage_options, cache_dir, cache_bytes = storage_args
    return ReplayStore(path, readonly=True, generation=generation, verify_reads=verify_reads,
                       storage_options=storage_options, cache_dir=cache_dir, cache_bytes=cache_bytes)


class ReplayStore:
    """A persistent replay store of rollouts in one directory.

    Creates the store when ``path`` holds none, else reopens it; options given must agree with those stored (leave
    them out to use the stored ones). ``capacity`` bounds the live rows (exact FIFO), ``capacity_bytes`` the bytes
    of live segments (whole oldest segments are evicted). ``group_key`` names the per-row column indexed at write
    time (``None``: no index). Options shown as ``<stored>`` in the signature take the stored value on a reopen; a
    new store gets no capacities, ``group_key="prompt_id"`` and one writer (``multi_writer=False``).
    ``readonly=True`` never writes, works on a read-only directory, and can follow a live writer with
    :meth:`refresh`; with ``generation=N`` it is pinned to that commit (a snapshot: it never refreshes) while its
    files are retained. ``verify_reads`` checks every page of a segment against its checksum the first time this
    process reads from it, so damaged data is never served; turn it off only on storage you trust, and run
    ``diskreplay verify`` instead.

    ``multi_writer=True`` creates a store any number of processes (on any hosts sharing the directory) may append
    to at once; files of superseded commits are kept ``retain_seconds`` (default 3600) for pinned readers. The
    default is one writer at a time, holding an exclusive lock. ``merge_policy`` says when small segments are
    merged (:class:`MergePolicy`).

    ``fsync=False`` makes this process's commits without ``fsync``: atomic and safe against the process's death,
    not against a power loss (not stored: each writer chooses; docs/FORMAT.md, "Writers without fsync").

    ``path`` may be ``s3://bucket/prefix`` (``pip install 'diskreplay[s3]'``): ``storage_options`` configure its
    client, segments are read through a local cache of at most ``cache_bytes`` in ``cache_dir``, and every commit
    is a conditional PUT (docs/scale-out.md; docs/FORMAT.md, "Object storage").

    >>> import tempfile, numpy as np
    >>> with ReplayStore(tempfile.mkdtemp(), capacity=100) as store:
    ...     rows = store.extend({"prompt_id": [7, 7], "completion_ids": [[1, 2, 3], [4]],
    ...                          "rewards": np.array([1.0, 0.0], dtype=np.float32)})
    ...     batch = store.read(rows)
    >>> rows.tolist(), batch["completion_ids"][0].tolist(), batch["rewards"].tolist()
    ([0, 1], [1, 2, 3], [1.0, 0.0])
    """

    def __init__(self, path: Union[str, os.PathLike], capacity: Optional[int] = _UNSET,
                 group_key: Optional[str] = _UNSET, *, readonly: bool = False, capacity_bytes: Optional[int] = _UNSET,
                 verify_reads: bool = True, multi_writer: bool = _UNSET, retain_seconds: Optional[int] = _UNSET,
                 generation: Optional[int] = None, merge_policy: Optional[MergePolicy] = None,
                 storage_options: Optional[Mapping[str, Any]] = None, cache_dir: Optional[str] = None,
                 cache_bytes: Optional[int] = None, fsync: bool = True) -> None:
        #: the storage every file of the store is read and written through (a directory or a bucket)
        self.storage = open_storage(path, storage_options, cache_dir=cache_dir, cache_bytes=cache_bytes)
        self._storage_args = (dict(storage_options) if storage_options else None, cache_dir, cache_bytes)
        self.path, self.readonly = self.storage.url, readonly
        #: whether this process's commits fsync their files and directories (see the class docstring)
        self.fsync = fsync
        #: check segment pages against their checksums the first time they are read (docs/FORMAT.md)
        self.verify_reads = verify_reads
        #: re-entrant lock held by every method; hold it yourself to make several calls atomic
        self.lock = threading.RLock()
        self._writer_lock: Optional[Lock] = None
        self._committer: Optional[Committer] = None
        self._gave_up_on: Dict[str, float] = {}  # wait_for_consumers: streams it stopped waiting for
        self._cursors_read: Dict[str, Any] = {}  # consumers: the stream cursors read, by state entry
        self._closed, self._pinned = False, generation is not None
        #: the segments this store has open and the reads through them
        self._cache = SegmentCache(self.storage, self.path, verify_reads)
        #: the group indexes this store serves (its own key's, brought forward commit by commit)
        self._groups = GroupIndexes(self._cache)
        #: the commits this store writes (appends, merges, states, group indexes), and its segment files
        self._writer = Writer(self.path, self.storage, self._cache,
                              merge_policy if merge_policy is not None else MergePolicy())
        self._segments = self._writer.segments
        self._late_schema: List[Any] = []  # the schema of the last commit with late columns (views.schema_of)
        try:
            opened = open_store(self.storage, Requested(capacity, group_key, capacity_bytes, multi_writer,
                                                        retain_seconds), readonly=readonly, generation=generation,
                                fsync=fsync)
        except BaseException:
            self.close()
            raise
        self.options, self.manifest = opened.options, opened.manifest
        #: the unusable newer manifests this open passed over (each warned about)
        self.recovered_from: List[str] = opened.recovered_from
        self._writer_lock, self._committer = opened.writer_lock, opened.committer

    # ------------------------------------------------------------------ basics

    def __enter__(self) -> "ReplayStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self):
        # a read-only store travels (to a Ray actor, a spawn worker) as its path and generation
        if not self.readonly:
            raise ArgumentError(f"a writer of {self.path} cannot be pickled; send store.snapshot() or open the "
                            "store where it is needed")
        return _reopen, (self.path, self.generation if self._pinned else None, self.verify_reads, self._storage_args)

    def close(self) -> None:
        """Make owed durability good, release the writer lock and the memory maps. Idempotent; a
        closed store refuses further use (:class:`~diskreplay.errors.StoreClosedError`)."""
        with self.lock:
            committer, lock, self._committer, self._writer_lock = self._committer, self._writer_lock, None, None
            self._closed = True
            close_store(committer, lock, self._cache, self._segments, self.storage)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (like a file's ``closed``).

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> store.close(); store.closed
        True
        """
        return self._closed

    @property
    def pinned(self) -> bool:
        """True for a store pinned at one generation (a :meth:`snapshot`, or ``generation=``): it never refreshes.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> store.pinned, store.snapshot().pinned
        (False, True)
        """
        return self._pinned

    def __len__(self) -> int:
        return self.manifest.num_rows

    def __repr__(self) -> str:
        return views.describe(self)

    @property
    def merge_policy(self) -> MergePolicy:
        """When small segments are merged (:class:`MergePolicy`); assign another to change it."""
        return self._segments.merge_policy

    @merge_policy.setter
    def merge_policy(self, policy: MergePolicy) -> None:
        self._segments.merge_policy = policy

    @property
    def multi_writer(self) -> bool:
        """Whether many processes may append at once (fixed at creation; see ``compact(multi_writer=...)``)."""
        return self.options.multi_writer

    @property
    def schema(self) -> Optional[Schema]:
        """The stored columns (None until the first row is committed): those of the first
        commit, then the late ones of the current commit (``schema.late``)."""
        return schema_of(self.manifest, self.options, self.readonly, self._late_schema)

    @property
    def columns(self) -> List[str]:
        """Column names, in schema order (empty before the first ``extend``)."""
        return [] if self.schema is None else self.schema.names

    @property
    def group_key(self) -> Optional[str]:
        """The column the write-time group index is kept for (None: no index)."""
        return self.options.group_key

    @property
    def capacity(self) -> Optional[int]:
        """The most rows kept (FIFO), or None for no bound."""
        return self.options.capacity_rows

    @property
    def capacity_bytes(self) -> Optional[int]:
        """The most bytes of segments and sidecars kept (whole oldest segments go first), or None."""
        return self.options.capacity_bytes

    @property
    def generation(self) -> int:
        """The committed generation; it changes with every commit."""
        return self.manifest.generation

    @property
    def head(self) -> int:
        """Id of the oldest live row."""
        return self.manifest.head

    @property
    def next_row(self) -> int:
        """Id the next appended row will get."""
        return self.manifest.next_row

    def row_ids(self) -> np.ndarray:
        """Ids of all live rows, oldest first (none of a hole: see :attr:`holes`)."""
        return live_rows(self.manifest)

    @property
    def holes(self) -> Tuple[Tuple[int, int], ...]:
        """``[start, stop)`` ranges of row ids inside ``[head, next_row)`` that hold no rows: ``repair``
        dropped them with their damaged segment. Reads of them raise ``RowsEvictedError``; samplers,
        streams and exports skip them. Usually empty.

        >>> import tempfile
        >>> ReplayStore(tempfile.mkdtemp()).holes
        ()
        """
        return self.manifest.holes

    @property
    def nbytes(self) -> int:
        """Bytes on disk of the committed data (segments, sidecars, states)."""
        return self.manifest.nbytes

    def stats(self) -> Dict[str, Any]:
        """This writer's commit counters: ``commits``, ``conflicts`` (lost races, each one retried),
        ``rebases``, ``dropped_rewrites``, ``commit_seconds``, ``manifest_seconds``, ``retry_seconds``,
        ``not_durable``; plus ``generation``, ``segments`` and ``multi_writer``.

        >>> import tempfile
        >>> with ReplayStore(tempfile.mkdtemp()) as store:
        ...     _ = store.extend({"prompt_id": [1]})
        ...     store.stats()["commits"], store.stats()["conflicts"]
        (1, 0)
        """
        counters = self._committer.stats.as_dict() if self._committer is not None else None
        return views.stats(counters, self.manifest, self.multi_writer, self.storage)

    def snapshot(self, generation: Optional[int] = None) -> "ReplayStore":
        """A read-only store pinned at the current generation (or at ``generation``), opened with
        this store's options: it never refreshes (docs/FORMAT.md, "Snapshots"). Picklable; a context manager.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [1, 2]})
        >>> with store.snapshot() as snap:
        ...     _ = store.extend({"prompt_id": [3]})
        ...     len(snap), snap.refresh(), len(store)
        (2, False, 3)
        """
        self._require_open()
        return _reopen(self.path, self.generation if generation is None else generation, self.verify_reads,
                       self._storage_args)

    @locked
    def refresh(self) -> bool:
        """Load the newest commit (for a reader following a writer); True if it changed.

        Never goes back: a commit older than the one held is ignored. A pinned
        store (``snapshot()``, ``generation=N``) never refreshes.
        """
        return views.refresh(self)

    # ------------------------------------------------------------------ writing

    def _require_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.path} is closed; open it again to use it")

    def _catch_up(self) -> None:
        """Multi-writer: adopt the newest commit of any writer before planning a new one."""
        writer.catch_up_store(self)

    @locked
    def extend(self, batch: Mapping[str, Any], *, token: Optional[str] = None) -> np.ndarray:
        """Append a batch of rows in one atomic, durable commit; returns their row ids.

        Accepts TRL's padded layout, the ragged layout (lists of 1-D arrays) or Arrow; padding
        is stripped with the masks, ``None`` columns mean "not computed", and a nullable column
        the store lacks is added in this commit (docs/batches.md, "What goes in"; docs/FORMAT.md,
        "Late columns"). Bad input raises ``ValueError`` naming the column and row and writes nothing.

        ``token`` (a str unique per logical batch, e.g. ``f"{worker}:{step}"``) makes the append
        exactly-once: an ``extend`` whose token is committed writes nothing and returns the rows
        it got first (docs/FORMAT.md, "Exactly-once tokens"). An error after the commit point is
        :class:`~diskreplay.errors.CommitNotDurableError` (its ``.rows`` are committed): retry
        with the same token, never without one.

        >>> import tempfile, torch
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> batch = {"prompt_id": torch.tensor([3, 3]), "completion_ids": torch.tensor([[5, 6], [7, 0]]),
        ...          "completion_mask": torch.tensor([[1, 1], [1, 0]]), "ref_per_token_logps": None}
        >>> store.extend(batch, token="worker0:step0").tolist(), store.read([1])["completion_ids"][0].tolist()
        ([0, 1], [7])
        >>> store.extend(batch, token="worker0:step0").tolist(), len(store)  # the token is committed: no rows added
        ([0, 1], 2)
        """
        views.require_writer(self)
        return writer.extend(self, batch, token)

    @locked
    def compact(self, target_bytes: int = 64 << 20, *, multi_writer: Optional[bool] = None) -> Dict[str, int]:
        """Rewrite the live rows into fewer, larger segments in one commit.

        Row ids, groups and states are unchanged; rows below ``head`` are dropped from the first segment. The old
        files stay until no retained manifest names them, so readers keep working throughout. Returns the segment
        counts and bytes before and after; a store of one segment without evicted rows is left as it is (no
        commit).

        ``multi_writer=True`` (or ``False``) first converts the store to a
        multi-writer (single-writer) store: stop every other writer first.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> for i in range(3): _ = store.extend({"prompt_id": [i], "completion_ids": [[i]]})
        >>> store.compact()["segments_after"]
        1
        """
        views.require_writer(self)
        return writer.compact(self, target_bytes, multi_writer)

    def _writer_context(self) -> WriterContext:
        return writer.writer_context(self)

    @property
    def remote(self) -> bool:
        """Deprecated, removed in diskreplay 0.3.0: ``not store.storage.can_map`` (the store's files are
        fetched into a local cache, not mapped where they lie)."""
        warnings.warn("ReplayStore.remote is deprecated and removed in diskreplay 0.3.0; use "
                      "`not store.storage.can_map`", DeprecationWarning, stacklevel=2)
        return not self.storage.can_map

    # ------------------------------------------------------------------ states

    @locked
    def save_state(self, name: str, state: Mapping[str, Any], *, replaces: Any = ...) -> None:
        """Durably store a sampler's ``state_dict()`` under ``name`` (JSON + Arrow, committed).
        ``replaces``: commit only over this entry of ``manifest.states`` (None: none saved), else
        ``CommitConflictError`` and nothing committed (a compare-and-set); default: over any.

        >>> import tempfile, numpy as np
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> store.save_state("sampler", {"cursor": 4, "weights": np.ones(3)})
        >>> store.load_state("sampler")["cursor"]
        4
        """
        views.require_writer(self)
        writer.save_state(self, name, state, replaces)

    @locked
    def load_state(self, name: str) -> Optional[Dict[str, Any]]:
        """The state saved under ``name`` in the current commit, or None."""
        return views.saved_state(self, name)

    @locked
    def consumers(self) -> Dict[str, Consumer]:
        """The committed cursors of the rollout streams reading this store (by stream name), as of
        its newest commit (loaded first, unless this store is pinned to a generation).

        >>> import tempfile
        >>> from diskreplay.stream import RolloutStream
        >>> store = ReplayStore(tempfile.mkdtemp(), group_key=None)
        >>> _ = store.extend({"rewards": [0.0, 1.0, 2.0]})
        >>> stream = RolloutStream(store, "trainer")
        >>> stream.next(2).tolist(); stream.save()
        [0, 1]
        >>> store.consumers()["trainer"].behind(store.next_row)
        1
        """
        self._require_open()
        self.refresh()
        return follow(self, lambda: consumers(self, self._cursors_read))

    def wait_for_consumers(self, max_ahead_rows: int, *, timeout: Optional[float] = 60.0,
                           streams: Optional[Sequence[str]] = None, dead_after: float = DEAD_AFTER_S,
                           poll: float = 0.1, incomplete_after: float = INCOMPLETE_AFTER_S) -> bool:
        """Back-pressure for a writer: wait until this store's newest commit is at most
        ``max_ahead_rows`` rows ahead of the slowest stream reading it (of ``streams``, or all).

        A stream is as far as its committed cursor (``RolloutStream.save()``). Returns True when within the bound
        (at once when no stream reads the store), False after ``timeout`` seconds (None: no limit) with a
        ``RuntimeWarning`` naming the stream waited for; streams unchanged for ``dead_after`` seconds are not
        waited for, and rows of incomplete groups count as reached for ``incomplete_after`` seconds
        (docs/streams.md, "Back-pressure"). Checks every ``poll`` seconds at most.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> store.wait_for_consumers(max_ahead_rows=1024)  # nobody reads it yet
        True
        """
        self._require_open()
        return wait_for_consumers(self, max_ahead_rows, timeout, dead_after, streams, poll, self._gave_up_on,
                                  self._cursors_read, incomplete_after)

    # ------------------------------------------------------------------ reading

    def _view(self) -> ReadView:
        return ReadView(self.manifest, self.schema, self.group_key)

    def _key_type(self) -> pa.DataType:
        return self._view().key_type

    def _segment(self, entry: fmt.SegmentEntry) -> Segment:
        return self._cache.segment(entry, self._view())

    def _sidecar(self, entry: fmt.SegmentEntry):
        """``(keys, counts, rows, page checksums)`` of a segment's group sidecar, checked."""
        return self._cache.sidecar(entry, self._view())

    def _page_checksums(self, entry: fmt.SegmentEntry) -> Optional[PageChecksums]:
        return self._cache.page_checksums(entry, self._view())

    def _read(self, rows: Any, cols: List[str], buffers: Optional[Dict[str, np.ndarray]] = None,
              ranges: bool = False) -> Dict[str, Column]:
        return self._cache.remapping(lambda: self._cache.read(self._view(), rows, cols, buffers, ranges))

    @locked
    def read(self, rows: Any, columns: Optional[Sequence[str]] = None, *,
             out: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, Column]:
        """Read rows (any order, repeats allowed) into a dict of columns.

        A ragged column comes back as a :class:`RaggedColumn` (``values``, ``offsets``, ``[i]``), or ``None`` when
        none of the rows has a value; a per-row column as a numpy array (``[n, width]`` for vectors) or a list of
        str. Only the bytes of the returned rows are touched.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp(), group_key=None)
        >>> _ = store.extend({"completion_ids": [[1], [2, 3]], "score": [0.5, 1.5]})
        >>> out = store.read([1, 0], columns=["score"]); out["score"].tolist()
        [1.5, 0.5]

        ``out``: a dict you keep (start with ``{}``) in which the read keeps the buffers of the ragged columns'
        values, reused and grown as needed (docs/batches.md); the columns returned view them and stay valid until
        the next read with the same ``out``.

        >>> buffers = {}
        >>> first = store.read([1, 0], out=buffers)["completion_ids"]
        >>> second = store.read([1, 1], out=buffers)["completion_ids"]
        >>> np.shares_memory(first.values, second.values), second[0].tolist()
        (True, [2, 3])
        """
        return views.read_rows(self, rows, columns, out)

    @locked
    def read_ranges(self, rows: Any, columns: Optional[Sequence[str]] = None) -> Dict[str, Column]:
        """:meth:`read`, except that ragged columns come back as
        :class:`~diskreplay.store.reading.RowRanges`: where each row's values lie in the segments' memory maps
        (their pages checked as ``read`` checks them), not yet copied. A consumer that lays rows out its own way
        copies them once, straight into its output: ``Collator(layout="packed").read`` does. Anything else may use
        them as the ``RaggedColumn`` they are (gathered on first access of ``values``).

        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> store = ReplayStore(tmp.name, group_key=None)
        >>> _ = store.extend({"completion_ids": [[1], [2, 3]], "score": [0.5, 1.5]})
        >>> got = store.read_ranges([1, 0])
        >>> got["completion_ids"].lengths.tolist(), got["completion_ids"][0].tolist(), got["score"].tolist()
        ([2, 1], [2, 3], [1.5, 0.5])
        >>> store.close(); tmp.cleanup()
        """
        return views.read_rows(self, rows, columns, ranges=True)

    @locked
    def prefetch(self, rows: Any, columns: Optional[Sequence[str]] = None) -> None:
        """Hint the kernel to read the pages these rows need (``madvise(WILLNEED)``).

        Cheap and asynchronous: a loader calls it for the next batch while the
        current one trains, so cold reads do not serialise on page faults.
        """
        views.prefetch(self, rows, columns)

    # ------------------------------------------------------------------ groups

    def _persist_group_index(self, force: bool = False) -> None:
        """Write the group index of the live rows and name it in a commit, when due (single writer;
        ``force``: whatever the tail): :meth:`Writer.persist_group_index`."""
        writer.persist_group_index(self, force)

    @locked
    def group_index(self, key: Optional[str] = None) -> GroupIndex:
        """Live rows grouped by ``key`` (default: the store's group key), oldest first.

        For the store's own key this comes from the sidecars without reading any segment; for another per-row
        column it is built from that column and cached until the next commit. A read-only store that fell more
        than ``KEEP_MANIFESTS`` commits behind its writer (whose clean-up removed the sidecars it wanted) catches
        up to the newest commit first.
        """
        return views.group_index(self, key)

    @property
    def num_groups(self) -> int:
        """Number of groups with at least one live row."""
        return len(self.group_index())

    def group_keys(self) -> List[Any]:
        """Keys of the groups with live rows, in order of first appearance."""
        return list(self.group_index().keys)

    def group_rows(self, key: Any) -> np.ndarray:
        """Row ids of the group ``key``, oldest first (empty if it has no live rows)."""
        return views.group_rows(self.group_index(), key)

    @locked
    def committed_rows(self, token: str) -> Optional[np.ndarray]:
        """The rows ``extend(..., token=token)`` committed, or None if no remembered commit has it.

        A producer restarted after a crash asks this before making a batch again (a
        regenerated batch differs, so ``extend`` would refuse its token). A ``readonly=True``
        store answers from the generation it reads, and cannot make the commit durable first as
        a writer does: a producer deciding to skip a batch asks through its writer.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp(), multi_writer=True)
        >>> _ = store.extend({"prompt_id": [1, 1]}, token="worker0:3")
        >>> store.committed_rows("worker0:3").tolist(), store.committed_rows("worker0:4")
        ([0, 1], None)
        >>> ReplayStore(store.path, readonly=True).committed_rows("worker0:3").tolist()
        [0, 1]
        """
        self._require_open() if self.readonly else views.require_writer(self)
        return writer.committed_rows_of(self, token)

    @locked
    def update(self, rows: Any, values: Mapping[str, Any], *, token: Optional[str] = None,
               version: Optional[str] = None, meta: Optional[Mapping[str, Any]] = None) -> int:
        """Write values of some columns for rows already committed: rewards scored after the rollout, reference
        log-probs or advantages added by a later stage. One commit, exactly once with ``token`` (a retry with the
        same rows and values returns without writing); returns the number of rows updated.

        ``values`` maps each column to one value per row of ``rows`` (distinct live row ids, any order). A
        per-token value must have one value per token of its row; a column the store lacks is added (earlier rows
        read "not computed" unless updated); the group key and the token ids cannot be updated. Every read
        afterwards (``read``, the collators, loaders, samplers, exports) returns the newest value; segments are
        not rewritten (a merge or ``compact`` folds the values in later). See docs/FORMAT.md, "Patches".

        ``version`` names the values written (``meta``: a small JSON object saying which scorer, when): they stay
        readable as ``"column@version"`` in any read after newer values of the column are written, and after
        ``compact`` (``store.versions(column)`` lists them).

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 0], "completion_ids": [[5, 6], [7]], "rewards": [0.0, 0.0]})
        >>> store.update([1, 0], {"rewards": [1.0, 0.5], "ref_logps": [[-0.75], [-0.25, -0.5]]}, token="judge:0")
        2
        >>> store.read([0, 1], ["rewards"])["rewards"].tolist(), store.read([0], ["ref_logps"])["ref_logps"][0].tolist()
        ([0.5, 1.0], [-0.25, -0.5])
        """
        views.require_writer(self)
        return writer.update(self, rows, values, token, version, meta)

    def versions(self, column: str) -> Dict[str, Dict[str, Any]]:
        """The named versions of ``column``'s values (``update(..., version=...)``): for each, its
        ``meta``, how many updates and rows wrote it. Read one as ``"column@version"``.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [0, 0], "completion_ids": [[5], [7]], "rewards": [0.0, 1.0]})
        >>> _ = store.update([0, 1], {"rewards": [0.0, 1.0]}, version="exact-match", meta={"scorer": "em"})
        >>> _ = store.update([0, 1], {"rewards": [0.5, 0.75]}, version="judge-v2")
        >>> sorted(store.versions("rewards")), store.read([0, 1], ["rewards", "rewards@exact-match"])["rewards@exact-match"].tolist()
        (['exact-match', 'judge-v2'], [0.0, 1.0])
        """
        self._require_open()
        return versions_of(self.manifest, column)
