"""Saved states: a state's file written for a commit (the codec, JSON + Arrow without pickle, and the
checked read are :mod:`diskreplay.format.states`)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from .. import format as fmt
from .._fileio import crc32c


def write_state_file(committer: Any, name: str, data: pa.Buffer, generation: int, reserves_ids: bool
                     ) -> fmt.StateEntry:
    """Write the state file of ``name`` for the commit of ``generation`` through ``committer``'s
    storage, durably; returns its manifest entry. ``reserves_ids`` (many writers, object
    storage): the first generation from ``generation`` on whose file name is free, created only if
    absent; else the file of ``generation``, replaced (a failed write removes it)."""
    storage = committer.storage
    if reserves_ids:
        gen, rel = storage.link_candidates(lambda g: fmt.state_file(name, g), data, generation, step="state")
        storage.sync_dir(fmt.STATE_DIR)
    else:
        gen, rel = generation, fmt.state_file(name, generation)
        try:
            storage.replace(rel, data, step="state")
        except BaseException:
            committer.remove_files([rel])
            raise
    return fmt.StateEntry(name, gen, data.size, crc32c(data))
