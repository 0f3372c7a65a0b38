"""A patch file's contents (docs/FORMAT.md, "Patches"): parsed and checked against its manifest
entry and the store's schema."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pyarrow as pa

from .._fileio import crc32c
from ..errors import CorruptStoreError
from .entries import PatchEntry

#: the patched rows' ids in a patch file (a store column cannot take this name)
PATCH_ROW = "__row__"


def parse_patch(buf: Any, entry: PatchEntry, where: str, check: bool = True, schema: Optional[Any] = None
                ) -> pa.RecordBatch:
    """The record batch of a patch file's bytes ``buf``, checked against ``entry``: size and
    CRC-32C (``check``), one record batch of ``PATCH_ROW`` ascending within the entry's rows, then
    exactly its columns (each of ``schema``'s type, when given). ``where`` names the file in errors.

    >>> import pyarrow as pa
    >>> from diskreplay.segment import encode_ipc
    >>> rb = pa.record_batch({PATCH_ROW: pa.array([2, 5]), "rewards": pa.array([1.0, 0.5])})
    >>> data = encode_ipc(rb)
    >>> e = PatchEntry(1, 2, 6, 2, data.size, crc32c(data), ("rewards",))
    >>> parse_patch(data, e, "p").column("rewards").to_pylist()
    [1.0, 0.5]
    """
    damaged = "; the patch is damaged (run `diskreplay verify`, then `diskreplay repair`)"
    if buf.size != entry.bytes:
        raise CorruptStoreError(f"{where} holds {buf.size} bytes but its manifest says {entry.bytes}{damaged}")
    if check and crc32c(buf) != entry.crc32c:
        raise CorruptStoreError(f"{where} fails its checksum{damaged}")
    try:
        reader = pa.ipc.open_file(buf)
        record = reader.get_batch(0) if reader.num_record_batches == 1 else None
    except (OSError, pa.ArrowInvalid) as exc:
        raise CorruptStoreError(f"{where} cannot be read as a patch ({exc}){damaged}") from None
    names = tuple(record.schema.names) if record is not None else ()
    if (record is None or names[:1] != (PATCH_ROW,) or names[1:] != entry.columns or record.num_rows != entry.num_rows
            or record.schema.field(0).type != pa.int64()):
        raise CorruptStoreError(f"{where} does not hold what its manifest entry says (int64 {PATCH_ROW!r}, then "
                                f"columns {list(entry.columns)}, {entry.num_rows} rows){damaged}")
    rows = record.column(0).to_numpy()
    if rows[0] != entry.first_row or rows[-1] != entry.end_row - 1 or (len(rows) > 1 and not np.all(rows[1:] > rows[:-1])):
        raise CorruptStoreError(f"{where}: its rows are not ascending within [{entry.first_row}, {entry.end_row})"
                                f"{damaged}")
    if schema is not None:
        for name in entry.columns:
            want = schema[name].arrow_type if name in schema else None
            if record.schema.field(name).type != want:
                raise CorruptStoreError(f"{where}: column {name!r} is {record.schema.field(name).type}, the store's "
                                        f"schema says {want}{damaged}")
    return record
