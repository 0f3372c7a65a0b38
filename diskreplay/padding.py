"""Kept for imports of earlier versions: the padded layout lives in :mod:`diskreplay.batching.padded`.

>>> from diskreplay.padding import collate
>>> collate.__module__
'diskreplay.batching.padded'
"""

from .batching.padded import (PER_TOKEN_COLUMNS, collate, collate_unpadded, pad_on_device,  # noqa: F401
                              padded_widths, repad, repad_stacked)
from .batching.columns import PRESENT_SUFFIX, checked_lengths  # noqa: F401

__all__ = ["collate", "collate_unpadded", "pad_on_device", "repad", "repad_stacked"]
