"""Deprecated import path, removed in diskreplay 0.3.0: the storage backends live in
:mod:`diskreplay.storage`. Each name taken from here still works, with a ``DeprecationWarning``
naming its new home.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from diskreplay.store.storage import LocalStorage
>>> LocalStorage.__module__, caught[0].category.__name__
('diskreplay.storage.local', 'DeprecationWarning')
"""

from .._moved import moved

_MOVED = dict.fromkeys(("LocalStorage", "Storage", "open_storage"), "diskreplay.storage")

__all__ = ["LocalStorage", "Storage", "open_storage"]


__getattr__ = moved(__name__, _MOVED)
