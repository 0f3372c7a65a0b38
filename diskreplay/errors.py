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


class BatchSchemaError(BatchError, SchemaError):
    """A column of a batch given to ``extend`` disagrees with the store's schema (another type or
    kind, or a column that cannot be added after the first commit); nothing was written.

    A bad batch, so a ``BatchError``; and a ``SchemaError``, which it was before.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> with ReplayStore(tempfile.mkdtemp()) as store:
    ...     _ = store.extend({"prompt_id": [1], "rewards": [1.0]})
    ...     try:
    ...         store.extend({"prompt_id": [2], "rewards": ["high"]})
    ...     except BatchError as exc:
    ...         print(str(exc).split(";")[0], isinstance(exc, SchemaError))
    column 'rewards' holds strings but the store holds float64 there True
    """


class FormatError(DiskReplayError, ValueError):
    """A file of the store is not in a format this version understands.

    >>> from diskreplay.format import StoreOptions
    >>> try:
    ...     StoreOptions.from_dict({"format": "diskreplay", "version": 99})
    ... except FormatError as exc:
    ...     print(exc)
    Unsupported version 99 in FORMAT.json; this diskreplay reads version 1 to 7 only (a newer diskreplay wrote it? upgrade to read it)
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


class StoreClosedError(ReadOnlyError, ValueError):
    """The store was used after ``close()`` (like a closed file: a ``ValueError``; and, for a
    write, the ``ReadOnlyError`` it always was). Open it again to use it.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> store.close()
    >>> try:
    ...     store.read([0])
    ... except StoreClosedError as exc:
    ...     print("refused:", str(exc).endswith("is closed; open it again to use it"))
    refused: True
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


class StoreNotFoundError(DiskReplayError, FileNotFoundError):
    """A path that should hold a store does not (it is missing, a file, or a
    directory without a store in it). Nothing was created there.

    >>> import tempfile
    >>> from diskreplay.export import store_info
    >>> try:
    ...     store_info(tempfile.gettempdir() + "/no/such/store")
    ... except StoreNotFoundError as exc:
    ...     print(str(exc).split(" (")[0].startswith("no diskreplay store at"))
    True
    """


class ManifestBaseMissingError(DiskReplayError, FileNotFoundError):
    """A manifest generation is an append delta, but a manifest it applies to (``filename``) is
    gone: collected by a clean-up (a generation older than ``retain_seconds`` of a multi-writer
    store, whose delta goes next) or lost. Open a newer generation (or the newest), or run
    ``diskreplay verify`` where it should be there.

    >>> issubclass(ManifestBaseMissingError, FileNotFoundError)
    True
    """


class ExportError(DiskReplayError, ValueError):
    """Bad input to an export, import or curation: an unknown column, a bad
    mapping, an unparsable line, a tokenizer that does not load, an output
    name whose extension names another format.

    >>> issubclass(ExportError, ValueError)
    True
    """


class OutputExistsError(DiskReplayError, FileExistsError):
    """The output path exists and ``overwrite`` was not given (or it exists
    and is not something an export may replace).

    >>> issubclass(OutputExistsError, FileExistsError)
    True
    """


class MissingDependencyError(DiskReplayError, ImportError):
    """An optional library (zarr, datasets, tqdm, a tokenizer library) is missing;
    the message names the extra that installs it.

    >>> issubclass(MissingDependencyError, ImportError)
    True
    """


class EvictionRefusedError(ExportError):
    """An append (``import --append``) would evict rows the target store
    already holds because of its capacity; nothing was written. The message
    says how many; pass ``allow_evict=True`` (``--allow-evict``) to append anyway.

    >>> issubclass(EvictionRefusedError, ExportError)
    True
    """


class ReplayConfigError(DiskReplayError, ValueError):
    """A replay option of the TRL integration, or the store it was given, cannot serve the replay mode.

    Raised when a ``DiskReplayGRPOConfig`` or ``DiskReplayGRPOTrainer`` is
    built, before any training step.

    >>> issubclass(ReplayConfigError, ValueError)
    True
    """


class IntegrationError(DiskReplayError, RuntimeError):
    """A training library does not behave as the integration was built for (another version of TRL?).

    The message names the method or the layout that differs, and the version range that works.

    >>> issubclass(IntegrationError, RuntimeError)
    True
    """


class ColumnNotFoundError(DiskReplayError, KeyError):
    """A column was asked for that the store does not hold; the message lists the columns it has.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [1]})
    >>> try:
    ...     store.read([0], columns=["rewards"])
    ... except ColumnNotFoundError:
    ...     print("no such column")
    no such column
    >>> store.close()
    """

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class IndexOutOfRangeError(DiskReplayError, IndexError):
    """A position outside a column, a tree or a storage's slots (not an evicted row: see RowsEvictedError).

    >>> from diskreplay import RaggedColumn
    >>> import numpy as np
    >>> try:
    ...     RaggedColumn(np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64))[3]
    ... except IndexOutOfRangeError as exc:
    ...     print(exc)
    row 3 out of range for a ragged column of 0 rows
    """


class StoreIOError(DiskReplayError, OSError):
    """An operating-system error on a file of the store, with the file named (``errno`` kept).

    >>> issubclass(StoreIOError, OSError)
    True
    """


class OutputIOError(DiskReplayError, OSError):
    """An operating-system error writing an export's output (a full disk, a quota, a read-only
    filesystem, a failing device). The message names the output and its format (``errno`` is
    kept); nothing is left under the output's name.

    >>> err = OutputIOError("cannot write the parquet export out.parquet: No space left on device", errno=28)
    >>> isinstance(err, OSError), err.errno, str(err)
    (True, 28, 'cannot write the parquet export out.parquet: No space left on device')
    """

    def __init__(self, message: str, *, errno: "int | None" = None) -> None:
        super().__init__(message)  # one argument: str() is the message, not "[Errno 28] ..."
        self.errno = errno


class CommitTimeoutError(DiskReplayError, TimeoutError):
    """A multi-writer commit took more than half of ``retain_seconds`` and was abandoned (other
    writers may collect files that old); nothing was committed, so retrying it is safe.

    >>> issubclass(CommitTimeoutError, TimeoutError)
    True
    """


def _rebuild_not_durable(args, rows):
    """Unpickling CommitNotDurableError (its ``rows`` is not in ``args``)."""
    return CommitNotDurableError(*args, rows=rows)



# every class above, exported from ``diskreplay`` too (kept last: new classes join it by themselves)


class SamplerError(DiskReplayError, ValueError):
    """A sampler was built or called with arguments it cannot honour.

    >>> issubclass(SamplerError, ValueError)
    True
    """


class SettingError(DiskReplayError, AttributeError):
    """A sampler setting that only takes effect at construction was assigned afterwards.

    Settings that can change mid-run (``alpha``, ``eps``, ``strategy``, ...)
    are plain assignments; the others (``seed``, ``rank``, ``group_key``, ...)
    raise this instead of being silently ignored.

    >>> from diskreplay import RandomSampler
    >>> try:
    ...     RandomSampler(seed=0).seed = 1
    ... except SettingError as exc:
    ...     print(type(exc).__name__, "AttributeError" in [c.__name__ for c in type(exc).__mro__])
    SettingError True
    """


class ReplacementWarning(UserWarning):
    """A group draw had to repeat rows or groups (too few eligible ones).

    :class:`~diskreplay.PromptGroupSampler` issues it at most once per sampler instance.

    >>> issubclass(ReplacementWarning, UserWarning)
    True
    """


class UnsupportedError(DiskReplayError, NotImplementedError):
    """An operation a peer library's interface has that a diskreplay store cannot honour.

    For example emptying a TorchRL storage backed by a persistent store, or
    overwriting a committed row in place.

    >>> issubclass(UnsupportedError, NotImplementedError)
    True
    """


class ArgumentError(DiskReplayError, ValueError, TypeError):
    """An argument of a diskreplay call has a wrong type or value.

    It is both a ``ValueError`` and a ``TypeError``, so code written against
    either builtin keeps catching it. The message names the argument, what it
    got and what it needs.

    >>> from diskreplay.loader import ReplayLoader
    >>> try:
    ...     ReplayLoader(None, None, batch_size=0, pad_token_id=0)
    ... except ArgumentError as exc:
    ...     print(exc)
    batch_size must be an integer >= 1, got 0
    """


class LoaderError(DiskReplayError, RuntimeError):
    """The loader's worker thread ended without delivering a batch or an error,
    or a batch cannot be built as the loader was asked to (a group larger than
    ``max_tokens``).

    >>> issubclass(LoaderError, RuntimeError)
    True
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


class UnsupportedFilesystemError(DiskReplayError, OSError):
    """The filesystem lacks what a store option needs (a multi-writer store needs an
    atomic create-if-absent: ``link()`` that fails with EEXIST).

    >>> issubclass(UnsupportedFilesystemError, OSError)
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


class CommitConflictError(DiskReplayError, RuntimeError):
    """A commit of a multi-writer store cannot be applied on top of a newer commit of another
    writer (see the conflict table in docs/FORMAT.md, "Many writers"): e.g. a ``compact`` whose
    segments another writer merged meanwhile. Nothing was committed; run it again.

    >>> issubclass(CommitConflictError, RuntimeError)
    True
    """


class StreamFencedError(DiskReplayError, RuntimeError):
    """A newer instance of a rollout stream took over its name (it committed a newer epoch of the
    cursor): this older one may no longer save or hand out rows. Nothing was committed.

    >>> issubclass(StreamFencedError, RuntimeError)
    True
    """


__all__ = sorted(name for name, value in list(globals().items())
                 if isinstance(value, type) and issubclass(value, (DiskReplayError, Warning))
                 and value.__module__ == __name__)
