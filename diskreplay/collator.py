"""Deprecated import path, removed in diskreplay 0.3.0: :class:`Collator` lives in
:mod:`diskreplay.batching.collator` (and in :mod:`diskreplay`). Each name taken from here still
works, with a ``DeprecationWarning`` naming its new home.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from diskreplay.collator import Collator
>>> Collator.__module__, caught[0].category.__name__
('diskreplay.batching.collator', 'DeprecationWarning')
"""

from ._moved import moved

_MOVED = dict.fromkeys(("Collator", "LAYOUTS"), "diskreplay.batching.collator")

__all__ = ["Collator", "LAYOUTS"]


__getattr__ = moved(__name__, _MOVED)
