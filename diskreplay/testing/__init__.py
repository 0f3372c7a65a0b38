"""Test support shipped with the package, as zarr-python ships ``zarr.testing`` for its stores.

* :class:`StorageTests` (:mod:`.storage`): the storage contract as a pytest test class; a backend
  (in the tree or a third party's) subclasses it with a fixture giving a fresh storage;
* :mod:`.stateful`: a store-vs-model state machine (hypothesis), run on every backend;
* :mod:`.workload`: batches whose content is a function of ``(writer, step)``, checked bit-exact.

``StorageTests`` needs pytest and the state machines hypothesis; they are imported when first used,
so ``import diskreplay.testing`` needs neither.

>>> import diskreplay.testing
>>> diskreplay.testing.StorageTests.__name__
'StorageTests'
"""

from typing import Any

_LAZY = {"StorageTests": "storage", "WritersMachine": "stateful", "SingleWriterMachine": "stateful"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
