"""The Zarr v3 archive of a store: export, and reading it back for import.

Layout (all arrays zstd-compressed and sharded; ``N`` exported rows)::

    OUT/                          group; attrs["diskreplay"] = export metadata
      columns/<name>/values       ragged: flat values (int32 / float32)
      columns/<name>/offsets      ragged: int64 [N + 1], row i = values[offsets[i]:offsets[i+1]]
      columns/<name>/validity     ragged: bool [N], False where the row holds no value
      columns/<name>              per-row: [N] (numbers, bool, or zarr strings) or [N, K] (vectors)
      index/keys                  group keys in order of first appearance ([G], int64 or strings)
      index/offsets               int64 [G + 1]
      index/rows                  int64 [N]: rows[offsets[g]:offsets[g+1]] are group g's rows

The metadata's ``columns`` list names each column's ``path`` and ``encoding``
(``ragged`` or ``array``), so a column name that is not a valid Zarr node
name is stored under ``col<i>``. Writes are shard-aligned: each column buffers
at most one shard before writing it whole.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from ..schema import RAGGED, VECTOR, ColumnSpec
from ._common import (CHUNK_BYTES, Exclusions, StoreLike, check_chunk_bytes, check_columns, check_metadata,
                      column_to_arrow, export_metadata, iter_rows, make_filter, open_store, require, tree_size)
from .outputs import ExportError, atomic_output, output_format, progress_bar, replaceable_dir
from .sources import Where

ZARR_ATTR = "diskreplay"
# Elements per inner chunk / per shard of flat value arrays, and rows per
# chunk / shard of per-row arrays: a shard of 4 Mi float32 is 16 MiB.
VALUE_CHUNK, VALUE_SHARD = 1 << 18, 1 << 22
ROW_CHUNK, ROW_SHARD = 1 << 16, 1 << 20
_NODE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}$")


def _zarr() -> Any:
    return require("zarr", "zarr", "the Zarr archive")


class _Appender:
    """Appends to a 1-D (or [n, K]) zarr array in whole shards."""

    def __init__(self, group: Any, path: str, dtype: Any, width: Optional[int], chunk: int, shard: int) -> None:
        zarr = _zarr()
        tail = () if width is None else (width,)
        kw: Dict[str, Any] = {}
        if dtype is not str:
            kw["compressors"] = zarr.codecs.ZstdCodec(level=3)
        self.array = group.create_array(path, shape=(0,) + tail, dtype=dtype, chunks=(chunk,) + tail,
                                        shards=(shard,) + tail, **kw)
        self.shard = shard
        self.parts: List[np.ndarray] = []
        self.buffered = 0
        self.written = 0

    def append(self, a: Any) -> None:
        if len(a) == 0:
            return
        self.parts.append(a)
        self.buffered += len(a)
        if self.buffered >= self.shard:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        if not self.parts:
            return
        data = self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts)
        k = len(data) if final else (len(data) // self.shard) * self.shard
        if k:
            end = self.written + k
            self.array.resize((end,) + self.array.shape[1:])
            self.array[self.written:end] = data[:k]
            self.written = end
        rest = data[k:]
        self.parts = [rest] if len(rest) else []
        self.buffered = len(rest)

    def close(self) -> None:
        self._flush(final=True)


class _ColumnWriter:
    def __init__(self, group: Any, spec: ColumnSpec, path: str) -> None:
        self.spec = spec
        self.path = path
        if spec.kind == RAGGED:
            self.values = _Appender(group, f"{path}/values", np.dtype(spec.dtype), None, VALUE_CHUNK, VALUE_SHARD)
            self.offsets = _Appender(group, f"{path}/offsets", np.dtype(np.int64), None, ROW_CHUNK, ROW_SHARD)
            self.validity = _Appender(group, f"{path}/validity", np.dtype(bool), None, ROW_CHUNK, ROW_SHARD)
            self.offsets.append(np.zeros(1, dtype=np.int64))
            self.total = 0
        else:
            dtype = str if spec.dtype == "string" else np.dtype(spec.dtype)
            self.values = _Appender(group, path, dtype, spec.width if spec.kind == VECTOR else None,
                                    ROW_CHUNK, ROW_SHARD)

    def append(self, value: Any, n: int) -> None:
        spec = self.spec
        if spec.kind == RAGGED:
            if value is None:
                self.offsets.append(np.full(n, self.total, dtype=np.int64))
                self.validity.append(np.zeros(n, dtype=bool))
                return
            off = np.asarray(value.offsets, dtype=np.int64)
            self.values.append(np.ascontiguousarray(value.values[int(off[0]):int(off[-1])]))
            self.offsets.append(off[1:] - off[0] + self.total)
            self.total += int(off[-1] - off[0])
            self.validity.append(np.ones(n, dtype=bool) if value.validity is None
                                 else np.asarray(value.validity, dtype=bool))
        elif spec.dtype == "string":
            self.values.append(np.array(value, dtype=object))
        else:
            self.values.append(np.ascontiguousarray(value))

    def close(self) -> None:
        self.values.close()
        if self.spec.kind == RAGGED:
            self.offsets.close()
            self.validity.close()


_RESERVED_NODES = frozenset({"values", "offsets", "validity", "zarr.json"})


def _column_paths(names: Sequence[str]) -> Dict[str, str]:
    """A node per column, named after it where zarr allows that name; otherwise, and for a name
    another column's node took, ``col<i>`` (the archive's attributes map names to nodes).

    >>> _column_paths(["a", "a b", "col1", "zarr.json"])
    {'a': 'columns/a', 'col1': 'columns/col1', 'a b': 'columns/col1_1', 'zarr.json': 'columns/col3'}
    """
    paths: Dict[str, str] = {}
    taken = set()
    named = [n for n in names if _NODE_NAME.match(n) and n not in _RESERVED_NODES]
    for n in named:  # the names first: an unnamed column's col<i> never takes a column's own name
        paths[n] = f"columns/{n}"
        taken.add(n)
    for i, n in enumerate(names):
        if n in paths:
            continue
        node, k = f"col{i}", 0
        while node in taken:
            k += 1
            node = f"col{i}_{k}"
        paths[n] = f"columns/{node}"
        taken.add(node)
    return paths


def export_zarr(store: StoreLike, out: Any, *, columns: Optional[Sequence[str]] = None,
                policy_versions: Any = None, min_reward: Optional[float] = None, limit: Optional[int] = None,
                reward_key: str = "rewards", overwrite: bool = False, progress: bool = False,
                chunk_bytes: int = CHUNK_BYTES, force: bool = False,
                include_excluded: bool = False, skip_damaged: bool = False) -> Dict[str, Any]:
    """Export to a Zarr v3 archive (zstd, sharded) from which ``import_rollouts`` restores an identical store.

    Per ragged column flat ``values`` + int64 ``offsets`` + bool ``validity``;
    per-row arrays; the group index (``index/keys``, ``index/offsets``,
    ``index/rows``); the store schema and options in the group attributes
    (key ``diskreplay``). Written chunk by chunk into a temporary directory
    renamed at the end. Needs ``pip install 'diskreplay[zarr]'``. Rows the store
    records as excluded are left out unless ``include_excluded``, and damaged segments fail the
    export unless ``skip_damaged`` (both as for :func:`export`).

    >>> import tempfile, os, zarr
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(os.path.join(d, "s")) as s:
    ...     _ = s.extend({"prompt_id": [4, 4], "completion_ids": [[7, 8], [9]]})
    >>> _ = export_zarr(os.path.join(d, "s"), os.path.join(d, "a.zarr"))
    >>> g = zarr.open_group(os.path.join(d, "a.zarr"), mode="r")
    >>> g["columns/completion_ids/values"][:].tolist(), g["columns/completion_ids/offsets"][:].tolist()
    ([7, 8, 9], [0, 2, 3])
    """
    output_format(out, "zarr", force=force)
    chunk_bytes = check_chunk_bytes(chunk_bytes)
    zarr = _zarr()
    flt = make_filter(policy_versions, min_reward, limit, reward_key)
    with open_store(store) as st:
        names = check_columns(st, columns)
        media = [n for n in names if st.schema[n].media]
        if media:  # its rows hold hashes: an archive of them alone would lose the media
            raise ExportError(f"column {media[0]!r} is a media column, whose bytes a zarr archive does not hold; "
                              "export it to parquet or hf (each row's bytes), or leave it out with --columns")
        flt.check(st)
        excluded = Exclusions.of(st, include_excluded)
        if skip_damaged:
            from .sources import SkipDamaged

            excluded = SkipDamaged.of(st, excluded)
        paths = _column_paths(names)
        gk = st.group_key if st.group_key in names else None
        bar = progress_bar(len(st), "export zarr", progress)
        try:
            with atomic_output(out, overwrite=overwrite, directory=True, replaceable=replaceable_dir("zarr.json"),
                               what="zarr export") as tmp:
                root = zarr.open_group(tmp, mode="w", zarr_format=3)
                writers = [_ColumnWriter(root, st.schema[n], paths[n]) for n in names]
                keys: List[Any] = []
                rows_total = 0
                for pieces in iter_rows(st, flt, chunk_bytes, bar, excluded):
                    for rows in pieces:
                        data = st.read(rows, names) if names else {}
                        for w, n in zip(writers, names):
                            w.append(data[n], len(rows))
                        if gk is not None:
                            keys.append(column_to_arrow(st.schema[gk], data[gk], len(rows)))
                        rows_total += len(rows)
                for w in writers:
                    w.close()
                if gk is not None:
                    _write_index(root, st.schema[gk], keys)
                meta = export_metadata(st, names, rows=rows_total,
                                       columns=[{"name": n, "path": paths[n],
                                                 "encoding": "ragged" if st.schema[n].kind == RAGGED else "array"}
                                                for n in names])
                root.attrs.update({ZARR_ATTR: meta})
        finally:
            bar.close()
    out = os.path.abspath(os.fspath(out))
    res = {"path": out, "format": "zarr", "rows": rows_total, "columns": names, "bytes": tree_size(out),
           "excluded_rows": excluded.left_out, "excluded_ranges": excluded.report()["ranges"]}
    if skip_damaged:
        res.update(skipped_damaged=excluded.skipped_segments(), skipped_rows=excluded.skipped)
    return res


def _write_index(root: Any, spec: ColumnSpec, keys: List[pa.Array]) -> None:
    arr = pa.chunked_array(keys, type=spec.arrow_type).combine_chunks() if keys else pa.array([], spec.arrow_type)
    enc = arr.dictionary_encode()
    codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    counts = np.bincount(codes, minlength=len(enc.dictionary)).astype(np.int64)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    order = np.argsort(codes, kind="stable").astype(np.int64)
    dict_values = enc.dictionary.to_pylist()
    key_arr = np.array(dict_values, dtype=object) if spec.dtype == "string" else np.asarray(dict_values,
                                                                                           dtype=np.int64)
    for name, data, dtype in (("index/keys", key_arr, str if spec.dtype == "string" else np.dtype(np.int64)),
                              ("index/offsets", offsets, np.dtype(np.int64)),
                              ("index/rows", order, np.dtype(np.int64))):
        app = _Appender(root, name, dtype, None, ROW_CHUNK, ROW_SHARD)
        app.append(data)
        app.close()


# ---------------------------------------------------------------------------
# Reading an archive back (for import)


class ZarrSource:
    """Reads a Zarr archive written by :func:`export_zarr` as Arrow tables of ``chunk_rows`` rows."""

    format = "zarr"

    def __init__(self, path: str) -> None:
        zarr = _zarr()
        self.path = path
        try:
            self.root = zarr.open_group(path, mode="r")
            doc = dict(self.root.attrs).get(ZARR_ATTR)
        except Exception as exc:  # zarr raises several kinds for a non-archive
            raise ExportError(f"{path} is not a readable Zarr archive ({type(exc).__name__}: {exc})") from None
        if doc is None:
            raise ExportError(f"{path} is a Zarr group but not a diskreplay archive (no {ZARR_ATTR!r} attribute)")
        self.meta = check_metadata(dict(doc), path)
        self.schema = self.meta["schema_obj"]
        self.columns = [c["name"] for c in self.meta.get("columns", [])]
        if self.columns != self.schema.names:
            raise ExportError(f"Unsupported archive {path}: its column list disagrees with its schema")
        self.paths = {c["name"]: c["path"] for c in self.meta["columns"]}
        self.total: Optional[int] = int(self.meta.get("rows", 0))
        self.skipped = 0

    def batches(self, chunk_rows: int, kept: Sequence[str]) -> Iterator[Tuple[pa.Table, Where]]:
        n = self.total or 0
        names = list(kept)
        for lo in range(0, n, chunk_rows):
            hi = min(n, lo + chunk_rows)
            arrays = []
            for name in names:
                spec, path = self.schema[name], self.paths[name]
                try:
                    arrays.append(self._read(spec, path, lo, hi))
                except KeyError:
                    raise ExportError(f"archive {self.path} lacks the arrays of column {name!r} ({path})") from None
            yield pa.Table.from_arrays(arrays, names=names), Where.rows(self.path, lo, hi - lo)

    def _read(self, spec: ColumnSpec, path: str, lo: int, hi: int) -> pa.Array:
        g = self.root
        if spec.kind == RAGGED:
            off = np.asarray(g[f"{path}/offsets"][lo:hi + 1], dtype=np.int64)
            values = np.asarray(g[f"{path}/values"][int(off[0]):int(off[-1])])
            valid = np.asarray(g[f"{path}/validity"][lo:hi], dtype=bool)
            if len(off) != hi - lo + 1 or len(valid) != hi - lo or len(values) != off[-1] - off[0]:
                raise ExportError(f"archive {self.path}: column {spec.name!r} is shorter than its {self.total} rows")
            return pa.LargeListArray.from_arrays(pa.array(off - off[0]), pa.array(values),
                                                 mask=None if valid.all() else pa.array(~valid))
        data = g[path][lo:hi]
        if len(data) != hi - lo:
            raise ExportError(f"archive {self.path}: column {spec.name!r} is shorter than its {self.total} rows")
        if spec.dtype == "string":
            return pa.array([str(x) for x in data.tolist()], type=pa.large_string())
        return column_to_arrow(spec, np.asarray(data, dtype=np.dtype(spec.dtype)), hi - lo)
