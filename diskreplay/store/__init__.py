"""The replay store: the facade (:class:`ReplayStore`) and the parts it delegates to.

Modules, bottom up: ``compaction`` (splitting, eviction, the merge policy),
``ops`` (commits as values, with their conflict rules), ``tokens``
(exactly-once records), ``committer`` (publishing, rebasing),
``reading`` (read planning), ``collector`` (garbage collection), ``remote`` (page-fetched object-storage segments),
``opening`` (options, foreign-path refusal, layout, lock, the start manifest),
``writing`` (a writer's segment files: ids reserved ahead, sidecars, small segments, the first schema),
``segment_cache`` (open segments, page checks, reads), ``group_views`` (the
group indexes served), ``replay_store`` (the facade users hold). The storage
backends live in :mod:`diskreplay.storage` (``store.LocalStorage``, ``store.Storage`` and
``store.storage`` are deprecated paths to them, removed in diskreplay 0.3.0).
"""

from .._moved import moved
from .compaction import MAX_SEGMENT_BYTES, MERGE_CAPACITY_SHARE, MERGE_FANIN, MERGE_MAX_BYTES, MERGE_RATIO, MergePolicy  # noqa: F401
from .committer import CommitStats
from .ops import Conflict
from .replay_store import STALE_RETRIES, ReplayStore  # noqa: F401
from .segment_cache import MAX_OPEN_SEGMENTS  # noqa: F401

__all__ = ["ReplayStore", "MergePolicy", "CommitStats", "Conflict", "convert_store"]


# their earlier import path
__getattr__ = moved(__name__, dict.fromkeys(("LocalStorage", "Storage"), "diskreplay.storage"))


def convert_store(path, multi_writer: bool) -> dict:
    """Convert the store at ``path`` to a multi-writer (``True``) or single-writer store, and
    compact it. Stop every other writer first. Returns what ``compact`` returns.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> ReplayStore(d).close()
    >>> _ = convert_store(d, True)
    >>> ReplayStore(d, readonly=True).multi_writer
    True
    """
    with ReplayStore(path) as store:
        return store.compact(multi_writer=multi_writer)
