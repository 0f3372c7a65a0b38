"""``ReplayStore``: the crash-safe, unpadded, memory-mapped rollout store (the facade).

Rows get global ids that only grow. Live rows are ``[head, next_row)``;
capacity eviction moves ``head`` and drops segments wholly below it. Each
``extend`` is one commit: new segment files, then a new manifest, published by
the one commit path in ``committer.py`` (see ``docs/FORMAT.md`` for the
protocol and its guarantees). This module turns calls into operation values
(``ops.py``), keeps the segment cache and the group codes, and reads.

The facade: the public methods and their documented examples, each delegating to a part
of this package (opening, appending, merging, states, segment_cache, group_views).

One module: a store's whole public API, each method with its example; about a third of it
is those docstrings, the work is in the parts it delegates to.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import pyarrow as pa

from .. import format as fmt
from .._fileio import WriterLock, boot_clock, crc32c
from ..errors import (ArgumentError, ColumnNotFoundError, DiskReplayError, ReadOnlyError, SchemaError, StoreClosedError, StoreLockedError, StoreNotFoundError)
from ..groups import GroupIndex
from ..ingest import normalize_batch
from ..schema import Schema
from ..segment import PageChecksums, Segment
from ..format.sidecars import encode_group_index
from ..format.states import encode_state, read_state_file
from .states import write_state_file
from . import ops
from .committer import Committer
from .consumers import DEAD_AFTER_S, INCOMPLETE_AFTER_S, Consumer, consumers, wait_for_consumers
from .compaction import MergePolicy
from .reading import index_of_column
from .group_views import GroupIndexes
from .merging import Merger
from .appending import Appender, WriterContext
from .segment_cache import Column, ReadView, SegmentCache
from ..storage import LocalStorage, open_storage
from .tokens import TokenIndex, check_token
from .opening import UNSET, Requested, open_store, writer_id
from .writing import SegmentWriter, after_schema_race

_UNSET: Any = UNSET
T = TypeVar("T")
STALE_RETRIES = 20  # catch-ups a reader tries when the writer's clean-up outruns it
# A single writer persists the group index (docs/FORMAT.md, "Group index") once this many segments
# were committed past the rows it covers: a reopened store then reads one index file and at most
# this many sidecars, whatever its size, while the rewrites cost about one index per 16 commits.
INDEX_TAIL_SEGMENTS = 16


def _locked(method):
    """Run a method under the store's re-entrant lock (a loader thread reads while the trainer appends);
    refused once the store is closed."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            self._require_open()
            return method(self, *args, **kwargs)
    return wrapper


def _reopen(path: str, generation: Optional[int], verify_reads: bool, storage_args: Tuple[Any, ...] = (None, None, None)
            ) -> "ReplayStore":
    storage_options, cache_dir, cache_bytes = storage_args
    return ReplayStore(path, readonly=True, generation=generation, verify_reads=verify_reads,
                       storage_options=storage_options, cache_dir=cache_dir, cache_bytes=cache_bytes)


class ReplayStore:
    """A persistent replay store of rollouts in one directory.

    Creates the store when ``path`` holds none, else reopens it; options given
    must agree with those stored (leave them out to use the stored ones).
    ``capacity`` bounds the live rows (exact FIFO), ``capacity_bytes`` the
    bytes of live segments (whole oldest segments are evicted). ``group_key``
    names the per-row column indexed at write time (``None``: no index).
    Options shown as ``<stored>`` in the signature take the stored value on a
    reopen; a new store gets no capacities, ``group_key="prompt_id"`` and one
    writer (``multi_writer=False``).
    ``readonly=True`` never writes, works on a read-only directory, and can
    follow a live writer with :meth:`refresh`; with ``generation=N`` it is
    pinned to that commit (a snapshot: it never refreshes) while its files are
    retained. ``verify_reads`` checks every
    page of a segment against its checksum the first time this process reads
    from it, so damaged data is never served; turn it off only on storage you
    trust, and run ``diskreplay verify`` instead.

    ``multi_writer=True`` creates a store any number of processes (on any
    hosts sharing the directory) may append to at once; files of superseded
    commits are kept ``retain_seconds`` (default 3600) for pinned readers. The
    default is one writer at a time, holding an exclusive lock.
    ``merge_policy`` says when small segments are merged (:class:`MergePolicy`).

    ``fsync=False`` makes this process's commits without ``fsync``: they stay
    atomic and survive the process's death (SIGKILL, the OOM killer: the kernel
    holds the bytes), but a power loss or kernel crash may lose the newest
    commits or leave them naming data that never reached the disk
    (``diskreplay verify`` finds it, ``diskreplay repair`` drops the rows of
    files that are missing or damaged and keeps the rest). It is not stored: each writer chooses. Lance's and
    Delta's appends make no fsync either; ``tools/bench.py writers`` measures
    both settings against them. Object stores ignore it (a PUT is durable).

    ``path`` may be ``s3://bucket/prefix`` (``pip install 'diskreplay[s3]'``):
    the same format in an S3-compatible object store. ``storage_options``
    configure its client (``endpoint``, ``access_key_id``,
    ``secret_access_key``, ``region``, ...; the ``AWS_*`` environment
    variables are used for what is not given); segments are read through a
    local cache of at most ``cache_bytes`` in ``cache_dir`` (default: a
    private temporary directory, removed on close; the ones of processes
    killed before closing are removed by the next private cache made),
    fetching only the pages a read needs.
    There is no lock on an object store: every commit is a conditional PUT,
    so a second writer of a single-writer store fails at its commit instead
    of overwriting (docs/FORMAT.md, "Object storage").

    >>> import tempfile, numpy as np
    >>> with ReplayStore(tempfile.mkdtemp(), capacity=100) as store:
    ...     rows = store.extend({"prompt_id": [7, 7], "completion_ids": [[1, 2, 3], [4]],
    ...                          "rewards": np.array([1.0, 0.0], dtype=np.float32)})
    ...     batch = store.read(rows)
    >>> rows.tolist(), batch["completion_ids"][0].tolist(), batch["rewards"].tolist()
    ([0, 1], [1, 2, 3], [1.0, 0.0])
    """

    def __init__(self, path: Union[str, os.PathLike], capacity: Optional[int] = _UNSET,
                 group_key: Optional[str] = _UNSET, *, readonly: bool = False,
                 capacity_bytes: Optional[int] = _UNSET, verify_reads: bool = True,
                 multi_writer: bool = _UNSET, retain_seconds: Optional[int] = _UNSET,
                 generation: Optional[int] = None, merge_policy: Optional[MergePolicy] = None,
                 storage_options: Optional[Mapping[str, Any]] = None, cache_dir: Optional[str] = None,
                 cache_bytes: Optional[int] = None, fsync: bool = True) -> None:
        #: the storage every file of the store is read and written through (a directory or a bucket)
        self.storage = open_storage(path, storage_options, cache_dir=cache_dir, cache_bytes=cache_bytes)
        self._storage_args = (dict(storage_options) if storage_options else None, cache_dir, cache_bytes)
        self.path = self.storage.url
        self.readonly = readonly
        if not isinstance(fsync, bool):
            raise ArgumentError(f"fsync must be True or False, got {fsync!r}")
        #: whether this process's commits fsync their files and directories (see the class docstring)
        self.fsync = fsync
        #: check segment pages against their checksums the first time they are read (docs/FORMAT.md)
        self.verify_reads = verify_reads
        #: re-entrant lock held by every method; hold it yourself to make several calls atomic
        self.lock = threading.RLock()
        self._writer_lock: Optional[WriterLock] = None
        self._committer: Optional[Committer] = None
        self._read_tokens: Optional[TokenIndex] = None  # readonly: committed_rows' lookups
        self._gave_up_on: Dict[str, float] = {}  # wait_for_consumers: streams it stopped waiting for
        self._cursors_read: Dict[str, Any] = {}  # consumers: the stream cursors read, by state entry
        self._closed = False
        self._pinned = generation is not None
        #: the segments this store has open and the reads through them
        self._cache = SegmentCache(self.storage, self.path, verify_reads)
        #: the group indexes this store serves (its own key's, brought forward commit by commit)
        self._groups = GroupIndexes(self._cache)
        #: this writer's segment files: the ids it reserved, the bytes of its newest small segments
        self._segments = SegmentWriter(self.path, merge_policy if merge_policy is not None else MergePolicy())
        #: the merges of small segments after an append, and compact's rewrite
        self._merger = Merger(self.storage, self._segments, self._cache)
        #: an extend's segments written and committed
        self._appender = Appender(self.path, self.storage, self._segments, self._cache)
        self.recovered_from: List[str] = []
        requested = Requested(capacity, group_key, capacity_bytes, multi_writer, retain_seconds)
        try:
            opened = open_store(self.storage, requested, readonly=readonly, generation=generation)
        except BaseException:
            self.close()
            raise
        self.options, self.manifest, self.recovered_from = opened.options, opened.manifest, opened.recovered_from
        self._writer_lock = opened.writer_lock
        try:
            if self.recovered_from:
                warnings.warn(f"{self.path}: newest manifest(s) unusable, opened generation "
                              f"{self.manifest.generation}: {'; '.join(self.recovered_from)}", RuntimeWarning,
                              stacklevel=2)
            if not readonly:
                self._committer = self._make_committer(self.options)
                self._committer.collect(full=True)
        except BaseException:
            self.close()
            raise

    def _make_committer(self, options: fmt.StoreOptions) -> Committer:
        if not self.storage.exclusive_lock:
            committer = Committer(self.storage, options, self.manifest)
        else:
            storage = LocalStorage(self.path, writer_id() if options.multi_writer else "", fsync=self.fsync,
                                   leases=options.multi_writer)
            committer = Committer(storage, options, self.manifest)
        committer.ensure_floor()
        return committer

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
            self._close()

    def _close(self) -> None:
        committer, self._committer = self._committer, None
        try:
            if committer is not None:
                committer.close()
        finally:
            if self._writer_lock is not None:
                self._writer_lock.release()
                self._writer_lock = None
            self._closed = True
            self._cache.close()
            self._segments.clear()
            if self.storage.cached:
                self.storage.close()

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
        """True for a store pinned at one generation (a :meth:`snapshot`, or ``generation=``): it never
        refreshes.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> store.pinned, store.snapshot().pinned
        (False, True)
        """
        return self._pinned

    def __len__(self) -> int:
        return self.manifest.num_rows

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else ("multi-writer" if self.multi_writer else "writer")
        if self._pinned:
            mode = "snapshot"
        return (f"ReplayStore({self.path!r}, rows={len(self)}, group_key={self.group_key!r}, "
                f"generation={self.generation}, {mode})")

    @property
    def _reserves_ids(self) -> bool:
        """Whether new files take the first free id (created only if absent) rather than the
        next one in the manifest: with many writers, and on an object store, where a second
        writer of a single-writer store is not kept out and must not overwrite a file."""
        return self.multi_writer or not self.storage.exclusive_lock

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
        return self._schema_of(self.manifest, self.options)

    def _schema_of(self, manifest: fmt.Manifest, options: fmt.StoreOptions) -> Optional[Schema]:
        if self.readonly and not manifest.next_row:
            # a reader of a commit before the first row (generation 0, pinned or not): a schema
            # on storage is a later commit's (or a first append's that crashed), not this one's
            return None
        if not manifest.late_columns:
            return options.schema
        hit = getattr(self, "_late_schema", None)
        if hit is None or hit[0] is not manifest or hit[1] is not options.schema:
            hit = self._late_schema = (manifest, options.schema,
                                       fmt.store_schema(options.schema, manifest.late_columns, manifest.file))
        return hit[2]

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
        m = self.manifest
        rows = np.arange(m.head, m.next_row, dtype=np.int64)
        for a, b in reversed(m.holes):
            rows = np.delete(rows, np.s_[a - m.head:b - m.head])
        return rows

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
        out: Dict[str, Any] = self._committer.stats.as_dict() if self._committer is not None else {}
        out.update(generation=self.generation, segments=len(self.manifest.segments), multi_writer=self.multi_writer)
        if self.storage.cached:
            out["cache"] = self.storage.cache_stats().to_dict()
        return out

    def snapshot(self, generation: Optional[int] = None) -> "ReplayStore":
        """A read-only store pinned at the current generation (or at ``generation``, while it is
        retained), opened with this store's options (storage options, cache, ``verify_reads``):
        it never refreshes, so every read is of this commit (while its files are retained:
        ``retain_seconds`` in a multi-writer store, ``KEEP_MANIFESTS`` commits otherwise).
        Picklable; a context manager.

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

    @_locked
    def refresh(self) -> bool:
        """Load the newest commit (for a reader following a writer); True if it changed.

        Never goes back: a commit older than the one held is ignored. A pinned
        store (``snapshot()``, ``generation=N``) never refreshes.
        """
        if self._pinned:
            return False
        if not self.storage.reliable_listing:
            # commits present above a present one are contiguous: if the next one is
            # absent and ours is still there, nothing is newer (one or two HEADs)
            gen = self.manifest.generation
            if not self.storage.exists(fmt.manifest_file(gen + 1)) and gen and \
                    self.storage.exists(fmt.manifest_file(gen)):
                return False
        m, _ = fmt.load_newest_manifest(self.storage, known=self.manifest, options=self.options)
        if m.generation <= self.manifest.generation:
            return False
        # the schema is fixed by the first committed row: until then a writer may rewrite FORMAT.json
        fixed = self.options.schema is not None and self.manifest.next_row > 0
        self._install(m, self.options if fixed else fmt.StoreOptions.read(self.storage))
        if self._committer is not None:
            self._committer.manifest = m
        return True

    def _following(self, action: Callable[[], T]) -> T:
        """Run ``action``; in a reader that fell more than ``KEEP_MANIFESTS`` commits
        behind its writer (whose clean-up removed a file the held commit names),
        catch up to the newest commit and run it again."""
        for _ in range(STALE_RETRIES):
            try:
                return action()
            except FileNotFoundError as exc:
                if self._pinned and not isinstance(exc, DiskReplayError):
                    raise self._collected_under_snapshot(exc) from exc
                if not (self.readonly or self.multi_writer) or not self.refresh():
                    raise
        return action()

    def _collected_under_snapshot(self, exc: FileNotFoundError) -> StoreNotFoundError:
        """A pinned generation whose files the writer's clean-up removed: what to do about it."""
        retain = self.options.retain_seconds
        if retain:
            kept = f"this store keeps a superseded commit {retain} s; hold a snapshot for less than that"
        else:
            kept = (f"a single-writer store keeps only its newest {fmt.KEEP_MANIFESTS} commits unless created with "
                    "retain_seconds=S; to read one commit for longer (an export, a pinned snapshot) while a writer "
                    "goes on, stop the writer meanwhile, or convert the store to many writers, which keep "
                    f"superseded commits an hour (`diskreplay compact --multi-writer {self.path}`)")
        return StoreNotFoundError(
            f"generation {self.generation} of {self.path}, which this reader is pinned at, is no longer retained: "
            f"the writer's clean-up removed {exc.filename or exc} ({kept})")

    def _install(self, manifest: fmt.Manifest, options: fmt.StoreOptions) -> None:
        self._cache.forget_dead(manifest)
        self.manifest, self.options = manifest, options
        # the group index of rows still live stays valid; new rows are indexed lazily
        self._groups.keep_valid(manifest.next_row)

    # ------------------------------------------------------------------ writing

    def _require_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.path} is closed; open it again to use it")

    def _require_writer(self) -> None:
        self._require_open()
        if self.readonly:
            raise ReadOnlyError(f"{self.path} is open read-only; open it without readonly=True to write")
        if self._committer is not None:
            self._committer.require_known_state()

    def _catch_up(self) -> None:
        """Multi-writer: adopt the newest commit of any writer before planning a new one."""
        m = self._committer.newest()
        options = self.options
        if options.schema is None:
            options = fmt.StoreOptions.read(self.storage)
        if m.generation != self.manifest.generation or options is not self.options:
            self._install(m, options)

    @_locked
    def extend(self, batch: Mapping[str, Any], *, token: Optional[str] = None) -> np.ndarray:
        """Append a batch of rows in one atomic, durable commit; returns their row ids.

        Accepts TRL's padded layout (``prompt_ids``/``prompt_mask`` left-padded,
        ``completion_ids``/``completion_mask`` and per-token columns right-padded,
        per-row columns ``[B]``), the ragged layout (lists of 1-D arrays), or Arrow:
        a ``pyarrow.Table``/``RecordBatch`` or a mapping of pyarrow arrays (list
        columns are ragged, null rows "not computed"; fixed-size lists are vectors).
        Padding is stripped with the masks; ``None`` columns mean "not computed".
        A nullable column the store lacks (ragged, or per-row float) is added
        in this commit; older rows read "not computed" there (docs/FORMAT.md,
        "Late columns"). Bad input raises ``ValueError`` naming the column and
        row and writes nothing.

        ``token`` (a non-empty str the caller makes unique per logical batch, e.g.
        ``f"{worker}:{step}"``) makes the append exactly-once: an ``extend`` whose
        token is already committed writes nothing and returns the rows it got
        first (across processes, restarts and writers; while any of its rows is
        live and for at least the newest 100,000 commits). Reusing a token for a
        different batch is a ``ValueError``. An error after the commit point is
        :class:`~diskreplay.errors.CommitNotDurableError` (its ``.rows`` are
        committed): retry with the same token, never without one.

        >>> import tempfile, torch
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> store.extend({"prompt_id": torch.tensor([3, 3]),
        ...               "completion_ids": torch.tensor([[5, 6], [7, 0]]),
        ...               "completion_mask": torch.tensor([[1, 1], [1, 0]]),
        ...               "ref_per_token_logps": None}, token="worker0:step0").tolist()
        [0, 1]
        >>> store.read([1])["completion_ids"][0].tolist()
        [7]
        >>> store.extend({"prompt_id": torch.tensor([3, 3]),
        ...               "completion_ids": torch.tensor([[5, 6], [7, 0]]),
        ...               "completion_mask": torch.tensor([[1, 1], [1, 0]]),
        ...               "ref_per_token_logps": None}, token="worker0:step0").tolist(), len(store)
        ([0, 1], 2)
        """
        self._require_writer()
        token = check_token(token)
        if self.multi_writer:
            self._catch_up()
            schema = self.schema
        else:
            # Until a row is committed the schema is not fixed: FORMAT.json may hold
            # one from a first append that crashed before its manifest.
            schema = self.schema if self.next_row else None
        record, schema = normalize_batch(batch, schema, self.group_key)
        def again() -> np.ndarray:
            # another writer's first append fixed the schema first: this batch must fit it
            self.options = fmt.StoreOptions.read(self.storage)
            fitted, fixed = normalize_batch(batch, self.schema, self.group_key)
            return self._append(fitted, fixed, token)

        return after_schema_race(lambda: self._append(record, schema, token), again)

    def _append(self, record: pa.RecordBatch, schema: Schema, token: Optional[str]) -> np.ndarray:
        rows, appended = self._appender.commit(self._writer_context(), record, schema, token)
        if not appended:
            return rows
        try:
            self._merger.merge_small_tail(self._writer_context)
        except Exception as exc:
            # the append is committed: the merge is an optimisation, retried after the next one
            warnings.warn(f"{self.path}: merging small segments failed ({type(exc).__name__}: {exc}); the "
                          "store is intact and the merge is retried later", RuntimeWarning, stacklevel=3)
        try:
            self._persist_group_index()
        except Exception as exc:
            warnings.warn(f"{self.path}: writing the group index failed ({type(exc).__name__}: {exc}); the "
                          "store is intact (readers use the group sidecars) and it is retried after the next "
                          "append", RuntimeWarning, stacklevel=3)
        return rows

    def _collect(self) -> None:
        try:
            self._committer.collect()
        except OSError as exc:
            # the commit stands: raising would invite a retry that appends the rows twice
            warnings.warn(f"{self.path}: generation {self.generation} is committed, but removing files it no "
                          f"longer needs failed ({exc}); the next writer open removes them", RuntimeWarning,
                          stacklevel=4)


    @_locked
    def compact(self, target_bytes: int = 64 << 20, *, multi_writer: Optional[bool] = None) -> Dict[str, int]:
        """Rewrite the live rows into fewer, larger segments in one commit.

        Row ids, groups and states are unchanged; rows below ``head`` are
        dropped from the first segment. The old files stay until no retained
        manifest names them, so readers keep working throughout. Returns the
        segment counts and bytes before and after; a store of one segment
        without evicted rows is left as it is (no commit).

        ``multi_writer=True`` (or ``False``) first converts the store to a
        multi-writer (single-writer) store: stop every other writer first.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> for i in range(3): _ = store.extend({"prompt_id": [i], "completion_ids": [[i]]})
        >>> store.compact()["segments_after"]
        1
        """
        self._require_writer()
        if target_bytes <= 0:
            raise ArgumentError(f"target_bytes must be positive, got {target_bytes}")
        if multi_writer is not None and multi_writer != self.multi_writer:
            self._convert(bool(multi_writer))
        if self.multi_writer:
            self._catch_up()
        self._trim_cache()
        m = self.manifest
        before = {"segments_before": len(m.segments), "bytes_before": m.nbytes}
        new = m
        # a rewrite holds consecutive rows: a store with holes (repair) is rewritten run by run between them
        for run in _runs(m.segments):
            segs = self.manifest.segments
            ids = [s.id for s in segs]
            if run[0] not in ids:
                continue  # another writer merged it meanwhile
            start = ids.index(run[0])
            stop = start + len(run)
            # one segment without evicted rows is as compact as it gets: rewriting it is a copy for nothing
            if stop - start == 1 and segs[start].first_row >= self.manifest.head:
                continue
            new = self._merger.rewrite(self._writer_context(), start, stop, target_bytes)
        return {**before, "segments_after": len(new.segments), "bytes_after": new.nbytes}

    def _writer_context(self) -> WriterContext:
        return WriterContext(self.manifest, self.options, self.schema, self.group_key, self._committer,
                             self._reserves_ids, self._install, self._collect)

    @property
    def remote(self) -> bool:
        """Deprecated, removed in diskreplay 0.3.0: ``not store.storage.can_map`` (the store's files are
        fetched into a local cache, not mapped where they lie)."""
        warnings.warn("ReplayStore.remote is deprecated and removed in diskreplay 0.3.0; use "
                      "`not store.storage.can_map`", DeprecationWarning, stacklevel=2)
        return not self.storage.can_map

    def _convert(self, multi_writer: bool) -> None:
        """Switch the store between one writer (exclusive lock) and many (create-if-absent commits)."""
        storage = self.storage.writer(writer_id() if multi_writer else "", fsync=self.fsync)
        if multi_writer:
            storage.probe_create_if_absent(fmt.MANIFEST_DIR)
        else:
            self._lock(shared=False)
        o = self.options
        # inline groups stay once a store has them (its manifests may name some); converting to many
        # writers turns them on, as for a store created multi-writer
        options = dataclasses.replace(o, multi_writer=multi_writer, append_deltas=multi_writer,
                                      inline_groups=o.inline_groups or multi_writer)
        options.write(storage)
        if multi_writer:
            self._lock(shared=True)
        self.options = options
        self._committer = self._make_committer(options)

    def _lock(self, shared: bool) -> None:
        """Hold LOCK shared (a writer of many) or exclusively (the one writer). Going exclusive is
        refused while any other writer holds it: converting a store under live writers would let
        their commits and this one's replace each other, and their reserved names collide. Nothing
        where the storage has no lock (every commit is create-if-absent there)."""
        lock = self.storage.lock(fmt.LOCK_FILE, shared=shared)
        if lock is None:
            return
        held, self._writer_lock = self._writer_lock, None
        if held is not None:
            held.release()
        try:
            lock.acquire()
        except StoreLockedError:
            if held is not None:  # keep what this writer had
                held.acquire()
                self._writer_lock = held
            if shared:
                raise
            raise StoreLockedError(f"{self.path} is open for writing by other processes (they hold LOCK); "
                                   "converting it needs every other writer stopped (and closed)") from None
        self._writer_lock = lock

    # ------------------------------------------------------------------ states

    @_locked
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
        self._require_writer()
        fmt.check_state_name(name)
        data = encode_state(dict(state))
        if self.multi_writer:
            self._catch_up()
        # its file's write time: a commit naming an unleased file older than the others' retention
        # (a saver stopped mid-save, on object storage) is abandoned, never published over a collected file
        started = boot_clock()
        entry = write_state_file(self._committer, name, data, self.manifest.generation + 1, self._reserves_ids)
        conditional = replaces is not ...
        self._committer.commit(lambda base: ops.SaveState(entry, replaces if conditional else None, conditional),
                               [entry.file], started=started,
                               install=lambda new: self._install(new, self.options))
        self._collect()

    @_locked
    def load_state(self, name: str) -> Optional[Dict[str, Any]]:
        """The state saved under ``name`` in the current commit, or None."""
        def load() -> Optional[Dict[str, Any]]:
            entry = self.manifest.states.get(name)
            return None if entry is None else read_state_file(self.storage, self.path, entry)

        return self._following(load)

    @_locked
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
        return self._following(lambda: consumers(self, self._cursors_read))

    def wait_for_consumers(self, max_ahead_rows: int, *, timeout: Optional[float] = 60.0,
                           streams: Optional[Sequence[str]] = None, dead_after: float = DEAD_AFTER_S,
                           poll: float = 0.1, incomplete_after: float = INCOMPLETE_AFTER_S) -> bool:
        """Back-pressure for a writer: wait until this store's newest commit is at most
        ``max_ahead_rows`` rows ahead of the slowest stream reading it (of ``streams``, or all).

        A stream is as far as its committed cursor (``RolloutStream.save()``); a writer that
        calls this before each ``extend`` stays within the bound plus one commit. Returns True
        when within the bound (at once when no stream reads the store), False after ``timeout``
        seconds (None: no limit) with a ``RuntimeWarning`` naming the stream waited for; this
        store object then does not wait for that stream again until it commits a new cursor,
        so a dead trainer costs a writer one ``timeout``, not one per batch. A stream whose cursor
        this writer has not seen change for ``dead_after`` seconds (default 600, on this host's boot
        clock) is not waited for. Rows of a stream's incomplete groups count as reached until they
        waited ``incomplete_after`` seconds (60), then against the bound. Checks every ``poll``
        seconds at most (a few ms at first): on an object store each check lists and reads the
        newest commit.

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

    def _trim_cache(self) -> None:
        self._cache.trim()

    def _read(self, rows: Any, cols: List[str], buffers: Optional[Dict[str, np.ndarray]] = None,
              ranges: bool = False) -> Dict[str, Column]:
        return self._cache.remapping(lambda: self._cache.read(self._view(), rows, cols, buffers, ranges))

    @_locked
    def read(self, rows: Any, columns: Optional[Sequence[str]] = None, *,
             out: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, Column]:
        """Read rows (any order, repeats allowed) into a dict of columns.

        A ragged column comes back as a :class:`RaggedColumn` (``values``,
        ``offsets``, ``[i]``), or ``None`` when none of the rows has a value; a
        per-row column as a numpy array (``[n, width]`` for vectors) or a list
        of str. Only the bytes of the returned rows are touched.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp(), group_key=None)
        >>> _ = store.extend({"completion_ids": [[1], [2, 3]], "score": [0.5, 1.5]})
        >>> out = store.read([1, 0], columns=["score"]); out["score"].tolist()
        [1.5, 0.5]

        ``out``: a dict you keep (start with ``{}``) in which the read keeps
        the buffers of the ragged columns' values, reused and grown as
        needed: a batch of 512 rows then copies into warm memory instead of
        ~4 MB of fresh pages (half the copy's time, measured). The columns
        returned view those buffers and stay valid until the next read with
        the same ``out``. (A run of consecutive rows of one segment is
        returned as views of the memory map, copying nothing.)

        >>> buffers = {}
        >>> first = store.read([1, 0], out=buffers)["completion_ids"]
        >>> second = store.read([1, 1], out=buffers)["completion_ids"]
        >>> np.shares_memory(first.values, second.values), second[0].tolist()
        (True, [2, 3])
        """
        cols = self._resolve_columns(columns)
        if out is not None and not isinstance(out, dict):
            raise ArgumentError(f"out must be a dict the caller keeps between reads (start with {{}}), got "
                                f"{type(out).__name__}")
        self._trim_cache()
        return self._following(lambda: self._read(rows, cols, out))

    @_locked
    def read_ranges(self, rows: Any, columns: Optional[Sequence[str]] = None) -> Dict[str, Column]:
        """:meth:`read`, except that ragged columns come back as
        :class:`~diskreplay.store.reading.RowRanges`: where each row's values
        lie in the segments' memory maps (their pages checked as ``read``
        checks them), not yet copied. A consumer that lays rows out its own
        way copies them once, straight into its output:
        ``Collator(layout="packed").read`` does. Anything else may use them as
        the ``RaggedColumn`` they are (gathered on first access of ``values``).

        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> store = ReplayStore(tmp.name, group_key=None)
        >>> _ = store.extend({"completion_ids": [[1], [2, 3]], "score": [0.5, 1.5]})
        >>> got = store.read_ranges([1, 0])
        >>> got["completion_ids"].lengths.tolist(), got["completion_ids"][0].tolist(), got["score"].tolist()
        ([2, 1], [2, 3], [1.5, 0.5])
        >>> store.close(); tmp.cleanup()
        """
        cols = self._resolve_columns(columns)
        self._trim_cache()
        return self._following(lambda: self._read(rows, cols, ranges=True))

    def _resolve_columns(self, columns: Optional[Sequence[str]]) -> List[str]:
        names = self.columns
        if columns is None:
            return names
        if isinstance(columns, str):
            columns = [columns]
        for c in columns:
            if c not in names:
                raise ColumnNotFoundError(f"column {c!r} is not in the store (columns: {names})")
        return list(columns)

    @_locked
    def prefetch(self, rows: Any, columns: Optional[Sequence[str]] = None) -> None:
        """Hint the kernel to read the pages these rows need (``madvise(WILLNEED)``).

        Cheap and asynchronous: a loader calls it for the next batch while the
        current one trains, so cold reads do not serialise on page faults.
        """
        cols = self._resolve_columns(columns)
        self._trim_cache()
        if not self.storage.can_map:
            return  # nothing to hint: an object store's pages are fetched (and checked) by the read itself

        self._following(lambda: self._cache.prefetch(self._view(), rows, cols))

    # ------------------------------------------------------------------ groups

    def _own_groups(self) -> GroupIndex:
        """The index of the store's group key over the live rows (see :mod:`.group_views`)."""
        if self.group_key is None:
            raise SchemaError(f"the store at {self.path} has no write-time group index (group_key=None); "
                              "pass a column name to group_index(key=...)")
        return self._following(lambda: self._groups.bring_forward(self._view()))

    def _persist_group_index(self, force: bool = False) -> None:
        """Write the group index of the live rows to a file and name it in a commit, once
        ``INDEX_TAIL_SEGMENTS`` segments lie past the rows the current one covers (single writer;
        ``force``: whatever the tail)."""
        m = self.manifest
        # not on an object store: a second writer there (no lock) could write the same index name
        if self.group_key is None or self.multi_writer or not self.storage.exclusive_lock or not m.segments:
            return
        covered = m.group_index.end_row if m.group_index is not None else m.head
        if not force and sum(1 for s in m.segments if s.end_row > covered) < INDEX_TAIL_SEGMENTS:
            return
        gi = self._own_groups()
        pages = {}
        for s in m.segments:
            p = self._page_checksums(s)
            if p is not None:
                pages[s.id] = (s.bytes, s.crc32c, p)
        data, frame = encode_group_index(gi.arrow_keys(self._key_type()), gi.offsets, gi.rows, m.head, m.next_row,
                                         pages)
        entry = fmt.GroupIndexEntry(m.generation + 1, m.head, m.next_row, data.size, crc32c(data), frame)
        storage = self._committer.storage
        try:
            storage.write_new(entry.file, data, step="groups")
            storage.sync_dir(fmt.GROUPS_DIR)
        except BaseException:
            self._committer.remove_files([entry.file])
            raise
        self._committer.commit(lambda base: ops.IndexGroups(entry), [entry.file],
                               install=lambda new: self._install(new, self.options))
        self._collect()

    @_locked
    def group_index(self, key: Optional[str] = None) -> GroupIndex:
        """Live rows grouped by ``key`` (default: the store's group key), oldest first.

        For the store's own key this comes from the sidecars without reading
        any segment; for another per-row column it is built from that column
        and cached until the next commit. A read-only store that fell more than
        ``KEEP_MANIFESTS`` commits behind its writer (whose clean-up removed the
        sidecars it wanted) catches up to the newest commit first.
        """
        key = self.group_key if key is None else key
        hit = self._groups.by_key.get(key)
        if hit is not None and hit[0] == self.generation:
            return hit[1]
        if key is not None and key == self.group_key:
            gi = self._own_groups()
        else:
            if key is None:
                raise SchemaError(f"the store at {self.path} has no write-time group index (group_key=None); "
                                  "pass a column name to group_index(key=...)")
            if key not in self.columns or self.schema[key].kind != "scalar":
                raise ColumnNotFoundError(f"cannot group by {key!r}: it is not a per-row column of the store "
                               f"(columns: {self.columns})")
            gi = self._following(lambda: self._index_of_column(key))
        self._groups.by_key[key] = (self.generation, gi)
        return gi

    def _index_of_column(self, key: str) -> GroupIndex:
        ids = self.row_ids()
        gi = index_of_column(self._read(ids, [key])[key], self.head)
        if not self.manifest.holes:
            return gi
        # the index counts positions from head; the rows after a hole have larger ids
        return GroupIndex(gi.keys, ids[gi.rows - self.head], gi.offsets, min_row=self.head)

    @property
    def num_groups(self) -> int:
        """Number of groups with at least one live row."""
        return len(self.group_index())

    def group_keys(self) -> List[Any]:
        """Keys of the groups with live rows, in order of first appearance."""
        return list(self.group_index().keys)

    def group_rows(self, key: Any) -> np.ndarray:
        """Row ids of the group ``key``, oldest first (empty if it has no live rows)."""
        gi = self.group_index()
        g = gi.position(key)
        return gi.group(g).copy() if g is not None else np.zeros(0, dtype=np.int64)

    @_locked
    def committed_rows(self, token: str) -> Optional[np.ndarray]:
        """The rows ``extend(..., token=token)`` committed, or None if no remembered commit has it.

        A producer restarted after a crash asks this before making a batch again
        (a regenerated batch differs, so ``extend`` would refuse its token). In a
        multi-writer store a writer first adopts the newest commit. A
        ``readonly=True`` store (an audit) answers from the generation it reads
        (``refresh()`` for newer commits); it writes nothing, so it cannot make a
        commit durable first as a writer does: a producer deciding to skip a batch
        asks through its writer.

        >>> import tempfile
        >>> store = ReplayStore(tempfile.mkdtemp(), multi_writer=True)
        >>> _ = store.extend({"prompt_id": [1, 1]}, token="worker0:3")
        >>> store.committed_rows("worker0:3").tolist(), store.committed_rows("worker0:4")
        ([0, 1], None)
        >>> ReplayStore(store.path, readonly=True).committed_rows("worker0:3").tolist()
        [0, 1]
        """
        if self.readonly:
            self._require_open()
        else:
            self._require_writer()
        if token is None:
            raise ArgumentError("token must be the str an extend(..., token=...) was given, got None")
        token = check_token(token)
        if self.readonly:  # a lookup in what this reader sees: its own index (it has no committer)
            if self._read_tokens is None:
                self._read_tokens = TokenIndex(self.storage)
            rec = self._read_tokens.find(self.manifest, token)
            return None if rec is None else np.arange(rec.first_row, rec.end_row, dtype=np.int64)
        if self.multi_writer:
            self._catch_up()
        rec = self._committer.find_token(token)
        if rec is None:
            return None
        rows = np.arange(rec.first_row, rec.end_row, dtype=np.int64)
        self._committer.durable_replay(rows)  # a producer skips the batch on this answer: it must hold
        return rows


def _runs(segments: Sequence[fmt.SegmentEntry]) -> List[List[int]]:
    """The ids of ``segments`` in runs of consecutive rows (one run unless the store has holes)."""
    runs: List[List[int]] = []
    end = None
    for s in segments:
        if end is None or s.first_row != end:
            runs.append([])
        runs[-1].append(s.id)
        end = s.end_row
    return runs
