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

import importlib
import warnings
from typing import Any

_MOVED = dict.fromkeys(("Collator", "LAYOUTS"), "diskreplay.batching.collator")

__all__ = ["Collator", "LAYOUTS"]


def __getattr__(name: str) -> Any:
    new = _MOVED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__} is deprecated and will be removed in diskreplay 0.3.0; import {name} from {new}",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(new), name)
