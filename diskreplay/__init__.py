"""diskreplay: a persistent, on-disk replay store for group-relative LLM RL.

Rollouts stream into :class:`ReplayStore` (unpadded, memory-mapped, crash
safe); samplers pick row ids; :func:`collate` re-pads just those rows into
TRL's layout; :class:`ReplayLoader` prefetches them onto the device;
:class:`RolloutStream` hands an asynchronous trainer every committed rollout once.

The names that need torch (``collate``, ``repad``, ``ReplayLoader``,
``ReplayBuffer``, ...) are imported on first use, so the command line and
read-only tools start without importing torch.

>>> import diskreplay
>>> "ReplayStore" in diskreplay.__all__
True
"""

import importlib
from typing import Any

from . import errors as _errors
from .errors import *  # noqa: F401,F403  (every error class; errors.__all__ lists them)
from .groups import GroupIndex  # noqa: F401  (public)
from .ragged import PerTokenTensor, RaggedColumn  # noqa: F401  (public)
from .schema import Media  # noqa: F401  (public: a media column for extend, stored once per content)
from .samplers import PrioritizedSampler, PromptGroupSampler, RandomSampler  # noqa: F401  (public)
from .store import ReplayStore  # noqa: F401  (public)

__version__ = "0.1.0"

_LAZY = {
    "collate": "batching.padded",
    "collate_unpadded": "batching.padded",
    "pad_on_device": "batching.padded",
    "repad": "batching.padded",
    "ReplayLoader": "loader",
    "ReplayBuffer": "buffer",
    "RolloutStream": "stream",
    "repad_stacked": "batching.padded",
    "collate_packed": "batching.packed",
    "pack_on_device": "batching.packed",
    "Collator": "batching.collator",
    "MediaReader": "store.media",
}

__all__ = sorted([
    "Collator",
    "GroupIndex",
    "Media",
    "MediaReader",
    "PerTokenTensor",
    "PrioritizedSampler",
    "PromptGroupSampler",
    "RaggedColumn",
    "RandomSampler",
    "ReplayBuffer",
    "ReplayLoader",
    "ReplayStore",
    "RolloutStream",
    "collate",
    "collate_packed",
    "collate_unpadded",
    "pack_on_device",
    "pad_on_device",
    "repad",
    "repad_stacked",
] + _errors.__all__)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diskreplay' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
