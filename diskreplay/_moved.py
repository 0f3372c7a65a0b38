"""Old import paths kept for one more release: a module's ``__getattr__`` that gives a moved name
from its new home, with a ``DeprecationWarning`` that names the new path and the release that
removes the old one. Importing an old module alone warns nothing (pytest's ``--doctest-modules``
imports every module); taking a name from it does, pointing at the caller's line.

>>> import warnings
>>> getattr_ = moved("diskreplay.example", {"old_name": "diskreplay.errors:DiskReplayError"})
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     value = getattr_("old_name")
>>> value.__name__, caught[0].category.__name__
('DiskReplayError', 'DeprecationWarning')
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable, Mapping

REMOVED_IN = "0.3.0"


def moved(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of old module ``module``: ``names`` maps each old name to its new home,
    ``"package.module"`` (same name) or ``"package.module:new_name"``."""

    def __getattr__(name: str) -> Any:
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new_name = target.partition(":")
        new_name = new_name or name
        warnings.warn(f"{module}.{name} is deprecated and will be removed in diskreplay {REMOVED_IN}; "
                      f"import {new_name} from {home}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), new_name)

    return __getattr__
