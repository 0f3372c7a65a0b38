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
    """


class SchemaError(DiskReplayError, ValueError):
    """A batch, an option or a column disagrees with the store's schema."""


class FormatError(DiskReplayError, ValueError):
    """A file of the store is not in a format this version understands."""


class CorruptStoreError(DiskReplayError, OSError):
    """A file of the store is truncated, damaged, missing or hostile.

    The message names the file; the store never serves its contents as data.
    """


class StoreLockedError(DiskReplayError, OSError):
    """Another process holds the store's writer lock."""


class ReadOnlyError(DiskReplayError, PermissionError):
    """A write was attempted on a store opened with ``readonly=True``."""


class RowsEvictedError(DiskReplayError, IndexError):
    """Rows were asked for that are not (or no longer) in the store."""
