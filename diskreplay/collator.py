"""Kept for imports of earlier versions: :class:`Collator` lives in :mod:`diskreplay.batching.collator`.

>>> from diskreplay.collator import Collator
>>> Collator.__module__
'diskreplay.batching.collator'
"""

from .batching.collator import LAYOUTS, Collator  # noqa: F401

__all__ = ["Collator", "LAYOUTS"]
