"""Checking and mending a store: :func:`verify_store` and :func:`repair_store`.

* :mod:`.check`: ``verify_store``, read-only and thorough (every byte the newest intact commit
  references, against its checksums; every problem names its file);
* :mod:`.repair`: ``repair_store``, which rolls a damaged store back to its newest intact commit,
  moving what it sets aside into ``STORE/quarantine/`` (it never deletes);
* :mod:`.files`: the store's files as both see them, a directory or ``s3://bucket/prefix``.

>>> import tempfile
>>> from diskreplay import ReplayStore
>>> d = tempfile.mkdtemp()
>>> ReplayStore(d).close()
>>> verify_store(d)["ok"]
True
"""

from .check import verify_store
from .files import QUARANTINE_DIR
from .repair import LIVE_SECONDS, repair_store

__all__ = ["LIVE_SECONDS", "QUARANTINE_DIR", "repair_store", "verify_store"]
