"""Kept for imports of earlier versions: the packed layout lives in :mod:`diskreplay.batching.packed`.

>>> from diskreplay.packing import collate_packed
>>> collate_packed.__module__
'diskreplay.batching.packed'
"""

from .batching.packed import PACKED_NAMES, collate_packed, pack_on_device, packed_sizes  # noqa: F401

__all__ = ["collate_packed", "pack_on_device", "packed_sizes", "PACKED_NAMES"]
