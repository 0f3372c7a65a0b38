"""Exactly-once token logs and the fingerprints token records hold (docs/FORMAT.md, "Exactly-once tokens").

A sealed log (``tokens/<id>.json``) is a signed JSON document of token records
(:class:`~diskreplay.format.entries.TokenRecord`); a record's ``digest`` is
:func:`batch_digest` of the batch it committed (records written before it hold
:func:`digest` of the batch's encoded segments). When a writer seals and merges
logs, and its in-memory index of them, are the store's (``store/tokens.py``).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, List, Sequence, Tuple

from .._fileio import crc32c
from ..errors import FormatError
from .names import FORMAT_VERSION, TOKENS_FORMAT
from .jsondoc import check_header, check_signature, parse_json, signature_in_bytes, signed_bytes
from .entries import TokenRecord

if TYPE_CHECKING:
    import pyarrow as pa


def token_log_bytes(records: Sequence[TokenRecord]) -> bytes:
    """The file form of a token log: a signed JSON document of its records."""
    return signed_bytes({"format": TOKENS_FORMAT, "version": FORMAT_VERSION,
                         "records": [r.to_list() for r in records]})


def parse_token_log(raw: bytes, where: str) -> List[TokenRecord]:
    """The records of a token log's file (``FormatError`` naming ``where`` unless it is one)."""
    doc = parse_json(raw, where)
    doc = check_header(doc, TOKENS_FORMAT, where)
    if not signature_in_bytes(raw):
        check_signature(doc, where)
    records = doc.get("records")
    if not isinstance(records, list):
        raise FormatError(f"Unsupported records in {where}; expected a list")
    return [TokenRecord.from_list(r, where) for r in records]


def digest(num_rows: int, pieces: Sequence[Tuple[int, int]]) -> int:
    """Fingerprint of a batch from its encoded pieces' ``(bytes, crc32c)``: a token reused
    for a different batch differs here (or in its row count)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"%d" % num_rows)
    for size, crc in pieces:
        h.update(b";%d,%d" % (size, crc))
    return int.from_bytes(h.digest(), "little") >> 1


def batch_digest(record: "pa.RecordBatch") -> int:
    """Fingerprint of a batch as its caller gave it (after padding is stripped): its row count and,
    by name, every column holding a value in some row, with its type and values. A column no row
    of the batch has is left out: it is what a late column another writer added meanwhile looks
    like in a batch that never named it, so a token's retry matches across that change (the
    digest of the encoded segments, :func:`digest`, did not).

    >>> import pyarrow as pa
    >>> a = pa.record_batch({"x": pa.array([1, 2])})
    >>> b = pa.record_batch({"x": pa.array([1, 2]), "late": pa.array([None, None], pa.float32())})
    >>> batch_digest(a) == batch_digest(b), batch_digest(a) == batch_digest(pa.record_batch({"x": pa.array([1, 3])}))
    (True, False)
    """
    h = hashlib.blake2b(digest_size=8, person=b"diskreplay.b2")
    h.update(b"%d" % record.num_rows)
    for name in sorted(record.schema.names):
        column = record.column(name)
        if column.null_count == len(column) and len(column):
            continue
        h.update(b";%s:%s=" % (name.encode("utf-8"), str(column.type).encode("utf-8")))
        _hash_array(h, column)
    return int.from_bytes(h.digest(), "little") >> 1


def _hash_array(h: "hashlib._Hash", arr: "pa.Array") -> None:
    """Feed ``arr``'s rows (not its buffers' layout: a slice hashes as the same rows copied) to ``h``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if arr.null_count:
        h.update(b"n" + np.packbits(np.asarray(arr.is_null())).tobytes())
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        offsets = np.asarray(arr.offsets, dtype=np.int64)
        h.update(b"o%d," % crc32c((offsets - offsets[0]).tobytes()))
        _hash_array(h, arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])))
    elif pa.types.is_fixed_size_list(t):
        _hash_array(h, arr.values.slice(arr.offset * t.list_size, len(arr) * t.list_size))
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        for v in arr.to_pylist():
            raw = b"" if v is None else (v.encode("utf-8") if isinstance(v, str) else v)
            h.update(b"%d:" % len(raw) + raw)
    else:
        values = pc.fill_null(arr, pa.scalar(0, t) if not pa.types.is_boolean(t) else False) if arr.null_count else arr
        h.update(b"v%d," % crc32c(np.ascontiguousarray(values.to_numpy(zero_copy_only=False)).tobytes()))
