"""diskreplay: a persistent, on-disk replay store for group-relative LLM RL.

>>> import diskreplay
>>> sorted(diskreplay.__all__)[:3]
['BatchError', 'CorruptStoreError', 'DiskReplayError']
"""

from .errors import (BatchError, CorruptStoreError, DiskReplayError, FormatError, ReadOnlyError,
                     RowsEvictedError, SchemaError, StoreLockedError)
from .groups import GroupIndex
from .ragged import RaggedColumn
from .store import ReplayStore

__version__ = "0.1.0"

__all__ = [
    "BatchError",
    "CorruptStoreError",
    "DiskReplayError",
    "FormatError",
    "GroupIndex",
    "RaggedColumn",
    "ReadOnlyError",
    "ReplayStore",
    "RowsEvictedError",
    "SchemaError",
    "StoreLockedError",
]
