"""Kept for imports of earlier versions: the storage backends live in :mod:`diskreplay.storage`.

>>> from diskreplay.store.storage import LocalStorage
>>> LocalStorage.__module__
'diskreplay.storage.local'
"""

from ..storage import LocalStorage, Storage, open_storage  # noqa: F401

__all__ = ["LocalStorage", "Storage", "open_storage"]
