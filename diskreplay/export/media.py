"""How an export writes a store's media columns (docs/media.md, "Exports")."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pyarrow as pa

from ..errors import CorruptStoreError, RowsEvictedError
from ..store.media import MediaReader, hash_rows, hex_of


class MediaColumns:
    """How an export writes a store's media columns (docs/media.md, "Exports"): Parquet and HF hold
    each row's bytes as ``{"bytes", "path"}`` (the layout of HF's ``Image``/``Audio`` features,
    which an HF export declares where every blob is an image, or every one audio), with the
    content hash as ``path``; JSONL holds ``{"hash", "mime"}`` by reference. The export's metadata
    carries each blob's descriptor (media type, an array's dtype and shape) by hash, so that
    ``import_rollouts`` stores the same blobs again, bit-exact."""

    def __init__(self, store: Any, names: Sequence[str], format: str, large: bool) -> None:
        schema = store.schema
        self.names = [n for n in names if schema[n].media]
        self.format, self.large = format, large
        self.entries = {e.hash: e for e in store.manifest.media} if self.names else {}
        self.reader = None
        self.store = store
        self.bad: Dict[str, str] = {}  # hash -> why its blob is not served (--skip-damaged)
        self.good: set = set()
        self.skipped_rows = 0
        self._skipped: Dict[str, List[int]] = {}
        if self.names:
            self.reader = MediaReader(store)

    def _feature(self) -> Optional[bytes]:
        mimes = {e.mime.split("/")[0] for e in self.entries.values()}
        return {"image": b"image", "audio": b"audio"}.get(mimes.pop()) if len(mimes) == 1 else None

    def field(self, name: str) -> pa.Field:
        if self.format == "jsonl":
            return pa.field(name, pa.struct([("hash", pa.string()), ("mime", pa.string())]))
        t = pa.struct([("bytes", pa.large_binary() if self.large else pa.binary()),
                       ("path", pa.large_string() if self.large else pa.string())])
        feature = self._feature() if self.format == "hf" else None
        return pa.field(name, t, metadata=None if feature is None else {b"diskreplay.media": feature})

    def metadata(self) -> Dict[str, Any]:
        if not self.names:
            return {}
        return {"media": {h: e.descriptor for h, e in sorted(self.entries.items())}}

    def servable(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` less those naming a blob that is damaged, missing or no longer named (what
        ``--skip-damaged`` leaves out; each such blob is checked once)."""
        data = self.store.read(rows, self.names)
        keep = np.ones(len(rows), dtype=bool)
        for name in self.names:
            for i, w in enumerate(hash_rows(data[name])):
                h = hex_of(w)
                if h not in self.good and h not in self.bad:
                    try:
                        self.reader.get(h)
                        self.good.add(h)
                    except (CorruptStoreError, RowsEvictedError) as exc:
                        self.bad[h] = str(exc)
                if h in self.bad:
                    keep[i] = False
                    self._skipped.setdefault(h, []).append(int(rows[i]))
        self.skipped_rows += int((~keep).sum())
        return rows[keep]

    def split(self, pieces: Sequence[np.ndarray], chunk_bytes: int, skip_damaged: bool) -> List[np.ndarray]:
        """The rows of ``pieces`` (less those naming a damaged blob, with ``skip_damaged``) cut so that each
        piece's media bytes stay within about ``chunk_bytes`` (one row at least): a chunk planned by
        the rows' own bytes (32 a media row) would otherwise hold the bytes of every blob they name."""
        out: List[np.ndarray] = []
        for rows in pieces:
            if skip_damaged:
                rows = self.servable(rows)
            if not len(rows):
                continue
            if self.format == "jsonl":  # (by reference: no bytes)
                out.append(rows)
                continue
            data = self.store.read(rows, self.names)
            sizes = np.zeros(len(rows), dtype=np.int64)
            for name in self.names:
                for i, w in enumerate(hash_rows(data[name])):
                    e = self.entries.get(hex_of(w))
                    sizes[i] += e.bytes if e is not None else 0
            ends = np.cumsum(sizes)
            start = 0
            while start < len(rows):
                before = int(ends[start - 1]) if start else 0
                stop = max(start + 1, int(np.searchsorted(ends, before + chunk_bytes, side="right")))
                out.append(rows[start:stop])
                start = stop
        return out

    def skipped(self) -> List[Dict[str, Any]]:
        """The damaged blobs ``--skip-damaged`` left rows out for: file, rows, damage."""
        out = []
        for h, rows in self._skipped.items():
            e = self.entries.get(h)
            out.append({"file": e.file if e is not None else None, "hash": h, "row_ids": rows, "why": self.bad[h]})
        return out

    def column(self, refs: Any) -> pa.Array:
        words = hash_rows(refs)
        hashes = [hex_of(w) for w in words]
        if self.format == "jsonl":
            mimes = [self.reader.entry(h).mime for h in hashes]
            return pa.StructArray.from_arrays([pa.array(hashes, pa.string()), pa.array(mimes, pa.string())],
                                              names=["hash", "mime"])
        values = self.reader.batch(words, decode=lambda v, e: v.tobytes() if isinstance(v, np.ndarray) else bytes(v))
        return pa.StructArray.from_arrays(
            [pa.array(values, pa.large_binary() if self.large else pa.binary()),
             pa.array(hashes, pa.large_string() if self.large else pa.string())], names=["bytes", "path"])
