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
    Unsupported version 99 in FORMAT.json; expected 1 (this diskreplay reads format v1 only)
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


class MissingDependencyError(DiskReplayError, ImportError):
    """An optional library (zarr, datasets, tqdm, obstore, a tokenizer library) is missing.

    The message names the package and the extra that installs it.

    >>> issubclass(MissingDependencyError, ImportError)
    True
    """


class ObjectStoreError(DiskReplayError, OSError):
    """An object store (``s3://bucket/prefix``) cannot be used as asked.

    Raised for a bucket that does not exist, credentials the server refuses,
    an endpoint that cannot be reached within the retry bound, or a request
    the server rejects. The message is one line naming the URL and the fix.

    >>> from diskreplay.storage import S3Storage
    >>> try:
    ...     S3Storage("s3://")
    ... except ObjectStoreError as exc:
    ...     print(exc)
    s3:// names no bucket; expected s3://BUCKET or s3://BUCKET/PREFIX
    """


class ConditionalWriteError(ObjectStoreError):
    """The object store does not honour conditional writes (``If-None-Match: *``).

    Many writers commit by creating manifest N+1 only if it is absent; a
    server that ignores the condition would let two commits overwrite each
    other, so a store that needs it refuses to run there.

    >>> issubclass(ConditionalWriteError, ObjectStoreError)
    True
    """
