"""diskreplay: a persistent, on-disk replay store for group-relative LLM RL.

Rollouts stream into :class:`ReplayStore` (unpadded, memory-mapped, crash
safe); samplers pick row ids; :func:`collate` re-pads just those rows into
TRL's layout; :class:`ReplayLoader` prefetches them onto the device.

>>> import diskreplay
>>> "ReplayStore" in diskreplay.__all__
True
"""

from .collate import collate, collate_unpadded, pad_on_device, repad
from .errors import (BatchError, CorruptStoreError, DiskReplayError, FormatError, ReadOnlyError,
                     RowsEvictedError, SchemaError, StoreLockedError)
from .groups import GroupIndex
from .ragged import RaggedColumn
from .samplers import (PrioritizedSampler, PromptGroupSampler, RandomSampler, ReplacementWarning,
                       SamplerError)
from .store import ReplayStore

__version__ = "0.1.0"

__all__ = [
    "BatchError",
    "CorruptStoreError",
    "DiskReplayError",
    "FormatError",
    "GroupIndex",
    "PrioritizedSampler",
    "PromptGroupSampler",
    "RaggedColumn",
    "RandomSampler",
    "ReadOnlyError",
    "ReplacementWarning",
    "ReplayStore",
    "RowsEvictedError",
    "SamplerError",
    "SchemaError",
    "StoreLockedError",
    "collate",
    "collate_unpadded",
    "pad_on_device",
    "repad",
]
