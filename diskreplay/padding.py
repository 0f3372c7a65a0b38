"""Deprecated import path, removed in diskreplay 0.3.0: the padded layout lives in
:mod:`diskreplay.batching.padded` (its public functions also in :mod:`diskreplay`). Each name taken
from here still works, with a ``DeprecationWarning`` naming its new home.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from diskreplay.padding import collate
>>> print(caught[0].message)
diskreplay.padding.collate is deprecated and will be removed in diskreplay 0.3.0; import collate from diskreplay.batching.padded
>>> collate.__module__
'diskreplay.batching.padded'
"""

from ._moved import moved

_MOVED = {**dict.fromkeys(("PER_TOKEN_COLUMNS", "collate", "collate_unpadded", "pad_on_device", "padded_widths",
                           "repad", "repad_stacked"), "diskreplay.batching.padded"),
          **dict.fromkeys(("PRESENT_SUFFIX", "checked_lengths"), "diskreplay.batching.columns")}

__all__ = ["collate", "collate_unpadded", "pad_on_device", "repad", "repad_stacked"]


__getattr__ = moved(__name__, _MOVED)
