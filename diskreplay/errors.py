"""The exceptions diskreplay raises.

Every error derives from :class:`DiskReplayError` and also from the builtin a
caller would naturally catch (``ValueError`` for bad input, ``OSError`` for a
damaged or locked store), so ``except ValueError`` keeps working. Decide what
to do from the class, never from the message text.
"""

from __future__ import annotations


class DiskReplayError(Exception):
    """Base class of every error raised by diskreplay.

    >>> issubclass(BatchError, DiskReplayError)
    True
    """


class BatchError(DiskReplayError, ValueError):
    """A batch given to ``extend`` is malformed; nothing was written.

    The message names the column and, where it applies, the row.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> try:
    ...     ReplayStore(tempfile.mkdtemp()).extend({"prompt_id": [1, 2], "rewards": [1.0]})
    ... except BatchError as exc:
    ...     print(exc)
    column 'rewards' has 1 rows but column 'prompt_id' has 2; every column needs one entry per row
    """


class SchemaError(DiskReplayError, ValueError):
    """A batch, an option or a column disagrees with the store's schema.

    >>> issubclass(SchemaError, ValueError)
    True
    """


class FormatError(DiskReplayError, ValueError):
    """A file of the store is not in a format this version understands.

    >>> from diskreplay.format import StoreOptions
    >>> try:
    ...     StoreOptions.from_dict({"format": "diskreplay", "version": 99})
    ... except FormatError as exc:
    ...     print(exc)
    Unsupported version 99 in FORMAT.json; expected 1 or 2 (this diskreplay reads format v1 and v2 only)
    """


class CorruptStoreError(DiskReplayError, OSError):
    """A file of the store is truncated, damaged, missing or hostile.

    The message names the file; the store never serves its contents as data.

    >>> issubclass(CorruptStoreError, OSError)
    True
    """


class StoreLockedError(DiskReplayError, OSError):
    """Another process holds the store's writer lock.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> path = tempfile.mkdtemp()
    >>> writer = ReplayStore(path)
    >>> try:
    ...     ReplayStore(path)
    ... except StoreLockedError:
    ...     print("refused; open it with readonly=True instead")
    refused; open it with readonly=True instead
    >>> writer.close()
    """


class ReadOnlyError(DiskReplayError, PermissionError):
    """A write was attempted on a store opened with ``readonly=True``.

    >>> issubclass(ReadOnlyError, PermissionError)
    True
    """


class RowsEvictedError(DiskReplayError, IndexError):
    """Rows were asked for that are not (or no longer) in the store.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp(), capacity=1)
    >>> _ = store.extend({"prompt_id": [1, 2]})
    >>> try:
    ...     store.read([0])
    ... except RowsEvictedError as exc:
    ...     print(exc)
    row 0 is not in the store: live rows are [1, 2) (it was evicted)
    """


class CommitNotDurableError(DiskReplayError, OSError):
    """A commit happened, but making it durable failed afterwards (e.g. EIO on the
    ``fsync`` of ``manifests/`` after the manifest appeared).

    The rows are committed and visible (``.rows`` holds their ids, or is None
    for a commit without rows); do **not** append them again. Durability is
    re-attempted by the next commit and by ``close()``. With a ``token``, a
    retried ``extend`` returns these same rows and writes nothing.

    >>> issubclass(CommitNotDurableError, OSError)
    True
    >>> CommitNotDurableError(5, "fsync of manifests/ failed", rows=[0, 1]).rows
    [0, 1]
    """

    def __init__(self, *args, rows=None) -> None:
        super().__init__(*args)
        self.rows = rows

    def __reduce__(self):
        return (_rebuild_not_durable, (self.args, self.rows))


def _rebuild_not_durable(args, rows):
    return CommitNotDurableError(*args, rows=rows)


class UnsupportedFilesystemError(DiskReplayError, OSError):
    """The filesystem lacks what a store option needs (a multi-writer store needs an
    atomic create-if-absent: ``link()`` that fails with EEXIST).

    >>> issubclass(UnsupportedFilesystemError, OSError)
    True
    """


class CommitConflictError(DiskReplayError, RuntimeError):
    """A commit of a multi-writer store cannot be applied on top of a newer commit of another
    writer (see the conflict table in docs/FORMAT.md, "Many writers"): e.g. a ``compact`` whose
    segments another writer merged meanwhile. Nothing was committed; run it again.

    >>> issubclass(CommitConflictError, RuntimeError)
    True
    """
