"""diskreplay: a persistent, on-disk replay store for group-relative LLM RL.

Rollouts stream into :class:`ReplayStore` (unpadded, memory-mapped, crash
safe); samplers pick row ids; :func:`collate` re-pads just those rows into
TRL's layout; :class:`ReplayLoader` prefetches them onto the device.

The names that need torch (``collate``, ``repad``, ``ReplayLoader``,
``ReplayBuffer``, ...) are imported on first use, so the command line and
read-only tools start without importing torch.

>>> import diskreplay
>>> "ReplayStore" in diskreplay.__all__
True
"""

import importlib
from typing import Any

from .errors import (BatchError, CorruptStoreError, DiskReplayError, FormatError, ReadOnlyError,
                     RowsEvictedError, SchemaError, StoreLockedError)
from .groups import GroupIndex
from .ragged import RaggedColumn
from .samplers import (PrioritizedSampler, PromptGroupSampler, RandomSampler, ReplacementWarning,
                       SamplerError)
from .store import ReplayStore
from .errors import CommitConflictError, CommitNotDurableError, UnsupportedFilesystemError  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    "collate": "padding",
    "collate_unpadded": "padding",
    "pad_on_device": "padding",
    "repad": "padding",
    "ReplayLoader": "loader",
    "ReplayBuffer": "buffer",
}

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
    "ReplayBuffer",
    "ReplayLoader",
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
__all__ += ["CommitConflictError", "CommitNotDurableError", "UnsupportedFilesystemError"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diskreplay' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
