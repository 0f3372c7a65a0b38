"""What one commit of a store looks like to this process, and following the newest one.

The schema of a commit (its first commit's columns and the late ones it adds), its live row ids,
the columns a read names, the newer commit a reader adopts on ``refresh``, and the retries of a
read that a writer's clean-up outran (:func:`following`): the reading side of ``ReplayStore``.
The functions taking ``store`` are the bodies of the facade's reading methods; they are handed the
store (its ``manifest``, ``options``, segment cache and group indexes) and never import it.

>>> live_rows(fmt.Manifest(head=2, next_row=6, holes=((3, 5),))).tolist()
[2, 5]
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .. import format as fmt
from ..errors import (ArgumentError, ColumnNotFoundError, DiskReplayError, ReadOnlyError, SchemaError,
                      StoreNotFoundError)
from ..format.states import read_state_file
from ..groups import GroupIndex
from ..schema import Schema
from ..storage import Storage
from .group_views import column_index

T = TypeVar("T")
STALE_RETRIES = 20  # catch-ups a reader tries when the writer's clean-up outruns it


def schema_of(manifest: fmt.Manifest, options: fmt.StoreOptions, readonly: bool, memo: List[Any]
              ) -> Optional[Schema]:
    """The columns of ``manifest``: those of the first commit (``options.schema``), then its late
    ones; ``memo`` holds the last one built (``[manifest, schema, store schema]``)."""
    if readonly and not manifest.next_row:
        # a reader of a commit before the first row (generation 0, pinned or not): a schema
        # on storage is a later commit's (or a first append's that crashed), not this one's
        return None
    if not manifest.late_columns:
        return options.schema
    if not memo or memo[0] is not manifest or memo[1] is not options.schema:
        memo[:] = [manifest, options.schema, fmt.store_schema(options.schema, manifest.late_columns, manifest.file)]
    return memo[2]


def live_rows(manifest: fmt.Manifest) -> np.ndarray:
    """Ids of ``manifest``'s live rows, oldest first (none of a hole)."""
    rows = np.arange(manifest.head, manifest.next_row, dtype=np.int64)
    for a, b in reversed(manifest.holes):
        rows = np.delete(rows, np.s_[a - manifest.head:b - manifest.head])
    return rows


def resolve_columns(names: List[str], columns: Optional[Sequence[str]]) -> List[str]:
    """The columns a read names (None: all of ``names``), each checked to be one of them."""
    if columns is None:
        return names
    if isinstance(columns, str):
        columns = [columns]
    for c in columns:
        if c not in names and not (isinstance(c, str) and c.rpartition("@")[0] in names):
            raise ColumnNotFoundError(f"column {c!r} is not in the store (columns: {names}; a named version of "
                                      "one's values reads as 'column@version')")
    return list(columns)


def groupable(key: Optional[str], schema: Optional[Schema], path: str) -> str:
    """``key``, checked to be a per-row column that ``group_index(key=...)`` can group by."""
    if key is None:
        raise no_group_key(path)
    columns = [] if schema is None else schema.names
    if key not in columns or schema[key].kind != "scalar":
        raise ColumnNotFoundError(f"cannot group by {key!r}: it is not a per-row column of the store "
                                  f"(columns: {columns})")
    return key


def no_group_key(path: str) -> SchemaError:
    """The error for a group index asked of a store without a write-time group key."""
    return SchemaError(f"the store at {path} has no write-time group index (group_key=None); "
                       "pass a column name to group_index(key=...)")


def newer_commit(storage: Storage, manifest: fmt.Manifest, options: fmt.StoreOptions
                 ) -> Optional[Tuple[fmt.Manifest, fmt.StoreOptions]]:
    """The newest commit on ``storage`` and its options, if it is newer than ``manifest`` (never an
    older one)."""
    if not storage.reliable_listing:
        # commits present above a present one are contiguous: if the next one is
        # absent and ours is still there, nothing is newer (one or two HEADs)
        gen = manifest.generation
        if not storage.exists(fmt.manifest_file(gen + 1)) and gen and storage.exists(fmt.manifest_file(gen)):
            return None
    m, _ = fmt.load_newest_manifest(storage, known=manifest, options=options)
    if m.generation <= manifest.generation:
        return None
    # the schema is fixed by the first committed row: until then a writer may rewrite FORMAT.json
    fixed = options.schema is not None and manifest.next_row > 0
    return m, options if fixed else fmt.StoreOptions.read(storage)


def locked(method: Callable[..., T]) -> Callable[..., T]:
    """Run a store's method under its re-entrant lock (a loader thread reads while the trainer
    appends); refused once the store is closed."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            self._require_open()
            return method(self, *args, **kwargs)
    return wrapper


def following(action: Callable[[], T], pinned: bool, may_catch_up: bool, refresh: Callable[[], bool],
              collected: Callable[[FileNotFoundError], Exception]) -> T:
    """Run ``action``; in a reader that fell more than ``KEEP_MANIFESTS`` commits behind its writer
    (whose clean-up removed a file the held commit names), catch up to the newest commit
    (``refresh``, where ``may_catch_up``) and run it again. A ``pinned`` reader cannot: it raises
    ``collected(exc)``."""
    for _ in range(STALE_RETRIES):
        try:
            return action()
        except FileNotFoundError as exc:
            if pinned and not isinstance(exc, DiskReplayError):
                raise collected(exc) from exc
            if not may_catch_up or not refresh():
                raise
    return action()


def collected_under_snapshot(path: str, generation: int, retain: Optional[int],
                             exc: FileNotFoundError) -> StoreNotFoundError:
    """A pinned generation whose files the writer's clean-up removed: what to do about it."""
    if retain:
        kept = f"this store keeps a superseded commit {retain} s; hold a snapshot for less than that"
    else:
        kept = (f"a single-writer store keeps only its newest {fmt.KEEP_MANIFESTS} commits unless created with "
                "retain_seconds=S; to read one commit for longer (an export, a pinned snapshot) while a writer "
                "goes on, stop the writer meanwhile, or convert the store to many writers, which keep "
                f"superseded commits an hour (`diskreplay compact --multi-writer {path}`)")
    return StoreNotFoundError(
        f"generation {generation} of {path}, which this reader is pinned at, is no longer retained: "
        f"the writer's clean-up removed {exc.filename or exc} ({kept})")


def stats(counters: Optional[Dict[str, Any]], manifest: fmt.Manifest, multi_writer: bool,
          storage: Storage) -> Dict[str, Any]:
    """``ReplayStore.stats()``: a writer's commit ``counters``, and the store's size."""
    out: Dict[str, Any] = dict(counters) if counters is not None else {}
    out.update(generation=manifest.generation, segments=len(manifest.segments), multi_writer=multi_writer)
    if storage.cached:
        out["cache"] = storage.cache_stats().to_dict()
    return out


# ---------------------------------------------------------------- the facade's reading methods


def describe(store: Any) -> str:
    """``repr(store)``: its path, rows, group key, generation and mode."""
    mode = "readonly" if store.readonly else ("multi-writer" if store.multi_writer else "writer")
    if store.pinned:
        mode = "snapshot"
    return (f"ReplayStore({store.path!r}, rows={len(store)}, group_key={store.group_key!r}, "
            f"generation={store.generation}, {mode})")


def require_writer(store: Any) -> None:
    """Refuse a write to a closed or read-only ``store``, or by a writer whose last commit is in doubt."""
    store._require_open()
    if store.readonly:
        raise ReadOnlyError(f"{store.path} is open read-only; open it without readonly=True to write")
    if store._committer is not None:
        store._committer.require_known_state()


def install(store: Any, manifest: fmt.Manifest, options: fmt.StoreOptions) -> None:
    """Make ``manifest`` (with its ``options``) the commit ``store`` reads: the segments it no longer
    names are let go; the group index of rows still live stays valid (new rows are indexed lazily)."""
    store._cache.forget_dead(manifest)
    store.manifest, store.options = manifest, options
    store._groups.keep_valid(manifest.next_row)


def refresh(store: Any) -> bool:
    """``ReplayStore.refresh``: install the newest commit if it is newer than the one held (never
    for a pinned store); True if it changed."""
    newer = None if store.pinned else newer_commit(store.storage, store.manifest, store.options)
    if newer is None:
        return False
    install(store, *newer)
    if store._committer is not None:
        store._committer.manifest = newer[0]
    return True


def follow(store: Any, action: Callable[[], T]) -> T:
    """:func:`following` for ``store``: a reader (or one of many writers) catches up by refreshing;
    a pinned one says its generation is no longer retained."""
    return following(action, store.pinned, store.readonly or store.multi_writer, store.refresh,
                     lambda exc: collected_under_snapshot(store.path, store.generation,
                                                          store.options.retain_seconds, exc))


def read_rows(store: Any, rows: Any, columns: Optional[Sequence[str]], out: Optional[Dict[str, np.ndarray]] = None,
              ranges: bool = False) -> Dict[str, Any]:
    """``ReplayStore.read`` (``ranges``: ``read_ranges``): the columns named, read at the newest
    commit this store can follow, ragged values into ``out``'s buffers where given."""
    cols = resolve_columns(store.columns, columns)
    if out is not None and not isinstance(out, dict):
        raise ArgumentError(f"out must be a dict the caller keeps between reads (start with {{}}), got "
                            f"{type(out).__name__}")
    store._cache.trim()
    return follow(store, lambda: store._read(rows, cols, out, ranges))


def prefetch(store: Any, rows: Any, columns: Optional[Sequence[str]]) -> None:
    """``ReplayStore.prefetch``: ``madvise(WILLNEED)`` of the pages the rows need, where the storage
    maps its files in place (an object store's pages are fetched, and checked, by the read itself)."""
    cols = resolve_columns(store.columns, columns)
    store._cache.trim()
    if store.storage.can_map:
        follow(store, lambda: store._cache.prefetch(store._view(), rows, cols))


def own_groups(store: Any) -> GroupIndex:
    """The index of ``store``'s group key over its live rows, brought forward from the sidecars."""
    if store.group_key is None:
        raise no_group_key(store.path)
    return follow(store, lambda: store._groups.bring_forward(store._view()))


def group_index(store: Any, key: Optional[str]) -> GroupIndex:
    """``ReplayStore.group_index``: the store's own key's index (:func:`own_groups`), or one built
    from another per-row column's values; served from cache until the next commit."""
    key = store.group_key if key is None else key

    def of_column() -> GroupIndex:
        ids = store.row_ids()
        return column_index(store._read(ids, [key])[key], ids, store.head, bool(store.manifest.holes))

    def build() -> GroupIndex:
        if key is not None and key == store.group_key:
            return own_groups(store)
        groupable(key, store.schema, store.path)
        return follow(store, of_column)

    return store._groups.served(key, lambda: store.generation, build)


def group_rows(groups: GroupIndex, key: Any) -> np.ndarray:
    """``ReplayStore.group_rows``: the row ids of ``key``'s group in ``groups`` (a copy), oldest first."""
    g = groups.position(key)
    return groups.group(g).copy() if g is not None else np.zeros(0, dtype=np.int64)


def saved_state(store: Any, name: str) -> Optional[Dict[str, Any]]:
    """``ReplayStore.load_state``: the state saved under ``name`` in the commit ``store`` reads, or None."""
    def load() -> Optional[Dict[str, Any]]:
        entry = store.manifest.states.get(name)
        return None if entry is None else read_state_file(store.storage, store.path, entry)

    return follow(store, load)
