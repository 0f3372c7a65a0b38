"""Deprecated import path, removed in diskreplay 0.3.0: the packed layout lives in
:mod:`diskreplay.batching.packed` (its public functions also in :mod:`diskreplay`). Each name taken
from here still works, with a ``DeprecationWarning`` naming its new home.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from diskreplay.packing import collate_packed
>>> collate_packed.__module__, caught[0].category.__name__
('diskreplay.batching.packed', 'DeprecationWarning')
"""

from ._moved import moved

_MOVED = dict.fromkeys(("PACKED_NAMES", "collate_packed", "pack_on_device", "packed_sizes"),
                       "diskreplay.batching.packed")

__all__ = ["collate_packed", "pack_on_device", "packed_sizes", "PACKED_NAMES"]


__getattr__ = moved(__name__, _MOVED)
