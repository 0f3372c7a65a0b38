"""The writing side of an open store: what each of ``ReplayStore``'s writing methods commits.

:class:`Writer` holds one writer's parts (its segment files: :class:`SegmentWriter`; an extend's
commit: :class:`Appender`; merges and ``compact``: :class:`Merger`). Each writing call builds a
commit as a value (:class:`~.commits.Commit`) and hands it to the one commit loop
(:meth:`Committer.commit`), whose result the store installs. The store's state reaches it as a
:class:`WriterContext` (the commit it is based on, how to install a new one); it never imports
the facade. The functions taking ``store`` are the bodies of the facade's writing methods; they
are handed the store and never import it either.

>>> import tempfile
>>> from diskreplay import ReplayStore
>>> store = ReplayStore(tempfile.mkdtemp())
>>> _ = store.extend({"prompt_id": [1]})
>>> store._writer.segments is store._segments, store.stats()["commits"]
(True, 1)
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, Mapping, Optional

import numpy as np
import pyarrow as pa

from .. import format as fmt
from ..errors import ArgumentError
from ..format.states import encode_state
from ..groups import GroupIndex
from ..schema import Schema
from ..segment import PageChecksums
from ..storage import Storage
from .appending import Appender, WriterContext, append_batch, catch_up
from .commits import Commit, group_index_commit, index_due, state_commit
from .committer import Committer
from .compaction import MergePolicy
from .merging import Merger
from .opening import switch_writers
from .patching import commit_patch, prepare_update
from .segment_cache import SegmentCache
from .tokens import TokenIndex, check_token
from .views import install, own_groups
from .writing import SegmentWriter


class Writer:
    """The commits of one writer of the store at ``path`` (see the module docstring)."""

    def __init__(self, path: str, storage: Storage, cache: SegmentCache, merge_policy: MergePolicy) -> None:
        self.path, self.storage = path, storage
        #: this writer's segment files: the ids it reserved, the bytes of its newest small segments
        self.segments = SegmentWriter(path, merge_policy)
        #: the merges of small segments after an append, and compact's rewrite
        self.merger = Merger(storage, self.segments, cache)
        #: an extend's segments written and committed
        self.appender = Appender(path, storage, self.segments, cache)
        #: a read-only store's token lookups (``committed_rows``; a writer asks its committer)
        self.read_tokens: Optional[TokenIndex] = None

    def append(self, context: Callable[[], WriterContext], record: pa.RecordBatch, schema: Schema,
               token: Optional[str], persist_index: Callable[[], None]) -> np.ndarray:
        """Commit an extend's validated ``record``; then the merges of small segments it made due
        and the persisted group index (``persist_index``), each an optimisation: a failure of one
        warns, and the append stands."""
        rows, appended = self.appender.commit(context(), record, schema, token)
        if not appended:
            return rows
        try:
            self.merger.merge_small_tail(context)
        except Exception as exc:
            # the append is committed: the merge is an optimisation, retried after the next one
            warnings.warn(f"{self.path}: merging small segments failed ({type(exc).__name__}: {exc}); the "
                          "store is intact and the merge is retried later", RuntimeWarning, stacklevel=5)
        try:
            persist_index()
        except Exception as exc:
            warnings.warn(f"{self.path}: writing the group index failed ({type(exc).__name__}: {exc}); the "
                          "store is intact (readers use the group sidecars) and it is retried after the next "
                          "append", RuntimeWarning, stacklevel=5)
        return rows

    def publish(self, at: WriterContext, commit: Commit) -> fmt.Manifest:
        """Hand ``commit`` to the commit loop, install what it published, then clean up."""
        result = at.committer.commit(commit, install=lambda new: at.install(new, at.options))
        at.collect()
        return result.manifest

    def persist_group_index(self, at: WriterContext, groups: Callable[[], GroupIndex],
                            page_checksums: Callable[[fmt.SegmentEntry], Optional[PageChecksums]],
                            key_type: Callable[[], pa.DataType], force: bool = False) -> None:
        """Write the group index of the live rows (``groups()``) to a file and name it in a commit,
        once ``INDEX_TAIL_SEGMENTS`` segments lie past the rows the current one covers (single
        writer; ``force``: whatever the tail)."""
        m = at.manifest
        # not on an object store: a second writer there (no lock) could write the same index name
        if at.group_key is None or at.multi_writer or not self.storage.exclusive_lock or not index_due(m, force):
            return
        gi = groups()
        pages = {}
        for s in m.segments:
            p = page_checksums(s)
            if p is not None:
                pages[s.id] = (s.bytes, s.crc32c, p)
        self.publish(at, group_index_commit(at.committer.storage, at.committer, m, gi.arrow_keys(key_type()),
                                            gi.offsets, gi.rows, pages))

    def collect(self, committer: Committer, generation: int) -> None:
        """Remove what no retained commit names; a failure warns (the commit stands: raising would
        invite a retry that appends the rows twice)."""
        try:
            committer.collect()
        except OSError as exc:
            warnings.warn(f"{self.path}: generation {generation} is committed, but removing files it no "
                          f"longer needs failed ({exc}); the next writer open removes them", RuntimeWarning,
                          stacklevel=5)


    def tokens_read(self, manifest: fmt.Manifest, token: str) -> Optional[np.ndarray]:
        """A read-only store's ``committed_rows``: the token looked up in what it reads (``manifest``)."""
        self.read_tokens = self.read_tokens or TokenIndex(self.storage)
        return token_rows(self.read_tokens.find(manifest, token))


def writer_context(store: Any) -> WriterContext:
    """What ``store``'s next commit starts from: its commit, options and committer; it installs what
    it publishes into ``store`` and then collects. New files reserve their ids with many writers and
    where the storage has no exclusive lock."""
    return WriterContext(store.manifest, store.options, store.schema, store.group_key, store._committer,
                         store.multi_writer or not store.storage.exclusive_lock, functools.partial(install, store),
                         lambda: store._writer.collect(store._committer, store.generation))


def extend(store: Any, batch: Mapping[str, Any], token: Optional[str]) -> np.ndarray:
    """``ReplayStore.extend``: :func:`.appending.append_batch` of ``batch`` from ``store``'s state,
    committed by :meth:`Writer.append` (then its merges and the group index)."""
    token = check_token(token)
    context = functools.partial(writer_context, store)
    persist = functools.partial(persist_group_index, store)
    return append_batch(context, store.storage, batch, token,
                        lambda *args: store._writer.append(context, *args, persist))


def persist_group_index(store: Any, force: bool = False) -> None:
    """:meth:`Writer.persist_group_index` of ``store``'s own group index, when due (``force``: whatever
    the tail)."""
    store._writer.persist_group_index(writer_context(store), lambda: own_groups(store), store._page_checksums,
                                      store._key_type, force)


def catch_up_store(store: Any) -> None:
    """Multi-writer: ``store`` adopts the newest commit of any writer before planning a new one."""
    catch_up(writer_context(store), store.storage)


def save_state(store: Any, name: str, state: Mapping[str, Any], replaces: Any) -> None:
    """``ReplayStore.save_state``: the state's file and its commit (over ``replaces`` only, where given)."""
    fmt.check_state_name(name)
    data = encode_state(dict(state))
    if store.multi_writer:
        catch_up_store(store)
    at = writer_context(store)
    store._writer.publish(at, state_commit(at.committer, name, data, at.manifest.generation + 1, at.reserves_ids,
                                           replaces))


def compact(store: Any, target_bytes: int, multi_writer: Optional[bool]) -> Dict[str, int]:
    """``ReplayStore.compact``: convert first where asked (:func:`.opening.switch_writers`), then
    :meth:`Merger.compact` from the newest commit."""
    if target_bytes <= 0:
        raise ArgumentError(f"target_bytes must be positive, got {target_bytes}")
    if multi_writer is not None and multi_writer != store.multi_writer:
        switch_writers(store, bool(multi_writer))
    if store.multi_writer:
        catch_up_store(store)
    store._cache.trim()
    return store._writer.merger.compact(lambda: writer_context(store), target_bytes)


def committed_rows_of(store: Any, token: Any) -> Optional[np.ndarray]:
    """``ReplayStore.committed_rows``: a reader answers from the commit it reads; a writer (of many:
    caught up first) through its committer, making the commit durable first."""
    token = checked_token(token)
    if store.readonly:
        return store._writer.tokens_read(store.manifest, token)
    if store.multi_writer:
        catch_up_store(store)
    return committed_rows(store._committer, token)


def update(store: Any, rows: Any, values: Mapping[str, Any], token: Optional[str], version: Optional[str],
           meta: Optional[Mapping[str, Any]]) -> int:
    """``ReplayStore.update``: the values checked against the rows they are for, then one patch commit."""
    token = check_token(token)
    if store.multi_writer:
        catch_up_store(store)
    record, new_columns = prepare_update(store._cache, store._view(), rows, values, version, meta)
    return commit_patch(writer_context(store), record, new_columns, token, version, meta)


def checked_token(token: Any) -> str:
    """``committed_rows``' token: the str an ``extend(..., token=...)`` was given."""
    if token is None:
        raise ArgumentError("token must be the str an extend(..., token=...) was given, got None")
    return check_token(token)


def token_rows(rec: Optional[fmt.TokenRecord]) -> Optional[np.ndarray]:
    """The rows of a token's commit (None: no remembered commit has it)."""
    return None if rec is None else np.arange(rec.first_row, rec.end_row, dtype=np.int64)


def committed_rows(committer: Committer, token: str) -> Optional[np.ndarray]:
    """A writer's answer to ``committed_rows``: the token's rows, made durable first (a producer
    skips the batch on this answer: it must hold)."""
    rows = token_rows(committer.find_token(token))
    if rows is not None:
        committer.durable_replay(rows)
    return rows
