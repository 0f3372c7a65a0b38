"""Table writers (Parquet, JSONL, Hugging Face ``datasets``) and the row exports built on them.

A *sink* receives Arrow tables chunk by chunk and writes them to a temporary
path; :func:`export` streams a store into one, segment range by segment
range, so memory stays bounded by a chunk however large the store is.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..ragged import numpy_view

from ._common import (CHUNK_BYTES, META_KEY, TEXT_COLUMNS, Exclusions, StoreLike, arrow_type, check_chunk_bytes,
                      check_columns, column_to_arrow, export_metadata, iter_rows, make_filter, open_store, require,
                      resolve_tokenizer, tree_size, Retokenized)
from .outputs import (ExportError, temporary_sibling, atomic_output, check_interrupt, output_format, progress_bar,
                      remove_path, replaceable_dir, replaceable_file)
from .media import MediaColumns
from .sources import SkipDamaged

FORMATS = ("parquet", "jsonl", "hf", "zarr")
#: Parquet codecs ``compression`` accepts (``none``: uncompressed); those this
#: pyarrow build lacks are refused up front with the list of what it has.
PARQUET_CODECS = ("snappy", "zstd", "gzip", "brotli", "lz4", "none")
JSONL_ROWS_PER_WRITE = 256
HF_META_FILE = "diskreplay.json"


class ParquetSink:
    """Writes tables to one Parquet file; small tables are merged into row groups of ~``row_group_bytes``."""

    directory = False

    def __init__(self, path: str, schema: pa.Schema, metadata: Optional[dict] = None,
                 compression: str = "snappy", row_group_bytes: int = CHUNK_BYTES) -> None:
        if metadata is not None:
            schema = schema.with_metadata({META_KEY: json.dumps(metadata).encode()})
        self.schema = schema
        self.row_group_bytes = row_group_bytes
        self._pending: List[pa.Table] = []
        self._pending_bytes = 0
        self.rows = 0
        self._writer = pq.ParquetWriter(path, schema, compression=check_compression(compression))

    def write(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_bytes += table.nbytes
        self.rows += table.num_rows
        if self._pending_bytes >= self.row_group_bytes // 2:  # row groups of 0.5 to 1.5 chunks
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        t = self._pending[0] if len(self._pending) == 1 else pa.concat_tables(self._pending)
        self._pending, self._pending_bytes = [], 0
        self._writer.write_table(t.replace_schema_metadata(self.schema.metadata), row_group_size=max(1, t.num_rows))

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:
            pass


class JsonlSink:
    """Writes one JSON object per row and line (``null`` for a missing value, and for NaN and
    ±Infinity, which JSON lacks: the standard library would write ``NaN``, which is not JSON).

    With ``orjson`` installed (``pip install 'diskreplay[jsonl]'``) token and
    log-prob lists are serialised straight from the Arrow buffers, about 14x
    faster than the standard library, which is the fallback. Either way a
    float32 read back and cast to float32 is bit-exact (orjson writes a
    float32's shortest float32 repr, ``json`` the shortest repr of its double).
    """

    directory = False

    def __init__(self, path: str, schema: pa.Schema, metadata: Optional[dict] = None) -> None:
        self.schema = schema
        self.rows = 0
        self.nonfinite = 0  # NaN and ±Infinity values written as null
        self._orjson = _orjson()
        self._fh = open(path, "wb")

    @property
    def notes(self) -> List[str]:
        """What the file does not hold as the store does (an export's ``warnings``)."""
        if not self.nonfinite:
            return []
        return [f"{self.nonfinite:,} NaN or infinite value(s) were written as null (JSON has no such numbers); "
                "importing the file back refuses a null inside a list (e.g. a -inf log-prob): export to Parquet "
                "to keep them"]

    def write(self, table: pa.Table) -> None:
        # a few hundred rows at a time: the text is ~2x the Arrow bytes, and memory
        # must stay bounded by the export's chunk, not grow with it
        for start in range(0, table.num_rows, JSONL_ROWS_PER_WRITE):
            part = table.slice(start, JSONL_ROWS_PER_WRITE)
            names = part.column_names
            self.nonfinite += sum(_count_nonfinite(part.column(i)) for i in range(part.num_columns))
            if self._orjson is not None:
                dumps, option = self._orjson.dumps, self._orjson.OPT_SERIALIZE_NUMPY
                cols = [_rows_for_json(part.column(i)) for i in range(part.num_columns)]
                lines = [dumps(dict(zip(names, vals)), option=option) for vals in zip(*cols)]
            else:
                cols = [_finite_or_null(part.column(i)) for i in range(part.num_columns)]
                lines = [json.dumps(dict(zip(names, vals)), ensure_ascii=False).encode("utf-8")
                         for vals in zip(*cols)]
            lines.append(b"")
            self._fh.write(b"\n".join(lines))
        self.rows += table.num_rows

    def close(self) -> None:
        self._fh.flush()
        self._fh.close()

    def abort(self) -> None:
        self._fh.close()


def check_compression(codec: Any) -> str:
    """``codec`` if this pyarrow writes Parquet with it, else :class:`ExportError` listing those it does.

    >>> check_compression("zstd")
    'zstd'
    >>> check_compression("brotli2")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    diskreplay.errors.ExportError: unknown Parquet compression 'brotli2'; choose one of snappy, zstd, ...
    """
    valid = [c for c in PARQUET_CODECS if c == "none" or pa.Codec.is_available(c)]
    if not isinstance(codec, str) or codec.lower() not in valid:
        missing = isinstance(codec, str) and codec.lower() in PARQUET_CODECS
        raise ExportError(f"{'this pyarrow build lacks' if missing else 'unknown'} Parquet compression "
                          f"{codec!r}; choose one of {', '.join(valid)}")
    return codec.lower()


def _count_nonfinite(column: pa.ChunkedArray) -> int:
    """NaN and ±Infinity values in a float column, or a list column of floats."""
    t = column.type
    nested = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if not pa.types.is_floating(t.value_type if nested else t):
        return 0
    arr = column.combine_chunks()
    values = arr.flatten() if nested else arr
    if values.null_count:
        values = values.drop_null()
    return len(values) - int(pc.sum(pc.is_finite(values)).as_py() or 0)


def _finite_or_null(column: pa.ChunkedArray) -> List[Any]:
    """A column's Python values with NaN and ±Infinity as None, as orjson writes them (the standard
    library writes ``NaN``/``Infinity``, which no strict JSON parser reads)."""
    rows = column.to_pylist()
    t = column.type
    scalar = pa.types.is_floating(t)
    if not (scalar or (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
            and pa.types.is_floating(t.value_type)):
        return rows
    if scalar:
        return [v if v is None or math.isfinite(v) else None for v in rows]
    return [r if r is None or all(map(math.isfinite, r)) else [v if math.isfinite(v) else None for v in r]
            for r in rows]


def _orjson() -> Any:
    try:
        import orjson
    except ImportError:
        return None
    return orjson


_JSON_NUMPY = {np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                     "float32", "float64")}


def _rows_for_json(column: pa.ChunkedArray) -> List[Any]:
    """Per-row values for orjson: a list column of numbers as numpy slices of its Arrow
    values (no Python objects per element), anything else as Python values."""
    arr = column.combine_chunks()
    t = arr.type
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and arr.values.null_count == 0:
        values = numpy_view(arr.values)
        if values.dtype in _JSON_NUMPY:
            offsets = numpy_view(arr.offsets).tolist()
            rows = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
            if arr.null_count:  # rows "not computed": null, the others as the rows without any are
                for i in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)).tolist():
                    rows[i] = None
            return rows
    return arr.to_pylist()


class HFSink:
    """Builds a Hugging Face dataset (``Dataset.save_to_disk`` layout) from tables.

    Tables go to one Arrow stream file through ``datasets``' own ``ArrowWriter``
    (a memory-mapped build file next to the output), which ``close`` turns into
    the saved dataset; the build file is removed. ``datasets.load_from_disk``
    reads the result, token columns as ``List(Value('int32'))`` sequences.
    """

    directory = True

    def __init__(self, path: str, schema: pa.Schema, metadata: Optional[dict] = None) -> None:
        self.datasets = require("datasets", "hf", "the Hugging Face export")
        from datasets.arrow_writer import ArrowWriter

        self.path, self.metadata = path, metadata
        self.schema = schema
        self.rows = 0
        self.features = self.datasets.Features.from_arrow_schema(schema)
        for f in schema:  # media columns of images (or audio) only: HF's Image (Audio) feature
            kind = (f.metadata or {}).get(b"diskreplay.media")
            if kind is not None:
                self.features[f.name] = self.datasets.Image() if kind == b"image" else self.datasets.Audio()
        self._build = temporary_sibling(path, "build") + ".arrow"
        self._writer = ArrowWriter(features=self.features, path=self._build)

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        datasets = self.datasets
        try:
            self._writer.finalize()
            self._writer.close()
            ds = datasets.Dataset.from_file(self._build)
            with _quiet_datasets(datasets):
                ds.save_to_disk(self.path)
            del ds
            if not self.rows:
                _give_an_empty_dataset_a_shard(self.path, self.features.arrow_schema)
            if self.metadata is not None:
                with open(os.path.join(self.path, HF_META_FILE), "w", encoding="utf-8") as fh:
                    json.dump(self.metadata, fh, indent=1)
        finally:
            remove_path(self._build)

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:
            pass
        remove_path(self._build)


def _give_an_empty_dataset_a_shard(path: str, schema: pa.Schema) -> None:
    """``save_to_disk`` of a dataset without rows lists no data file, and ``load_from_disk`` of it
    fails (IndexError): list one Arrow stream of the schema and no batches, which loads as 0 rows."""
    state_file = os.path.join(path, "state.json")
    with open(state_file, encoding="utf-8") as fh:
        state = json.load(fh)
    if state.get("_data_files"):
        return
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(os.path.join(path, name), "wb") as sink:
        pa.ipc.new_stream(sink, schema).close()
    state["_data_files"] = [{"filename": name}]
    with open(state_file, "w", encoding="utf-8") as fh:
        json.dump(state, fh, indent=2, sort_keys=True)


@contextmanager
def _quiet_datasets(datasets: Any) -> Iterator[None]:
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def hf_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with 64-bit-offset lists and strings narrowed to the types HF users expect."""
    fields = []
    for f in schema:
        t = f.type
        if pa.types.is_large_list(t):
            t = pa.list_(t.value_type)
        elif pa.types.is_large_string(t):
            t = pa.string()
        fields.append(pa.field(f.name, t, metadata=f.metadata))
    return pa.schema(fields)


def open_sink(fmt: str, path: str, schema: pa.Schema, metadata: Optional[dict] = None, **kw: Any) -> Any:
    if fmt == "parquet":
        return ParquetSink(path, schema, metadata, **kw)
    if fmt == "jsonl":
        return JsonlSink(path, schema, metadata)
    if fmt == "hf":
        return HFSink(path, hf_schema(schema), metadata)
    raise ExportError(f"format must be one of parquet, jsonl, hf here, got {fmt!r}")


#: what ``overwrite`` may replace, per format: a Parquet/JSONL export replaces
#: a file, an HF / Zarr export an earlier one of its kind (or an empty directory)
REPLACEABLE = {"parquet": replaceable_file, "jsonl": replaceable_file,
               "hf": replaceable_dir("state.json", "dataset_dict.json", HF_META_FILE),
               "zarr": replaceable_dir("zarr.json")}


def write_tables(fmt: str, out: str, schema: pa.Schema, tables: Iterator[pa.Table], *,
                 metadata: Optional[dict] = None, overwrite: bool = False, notes: Optional[List[str]] = None,
                 what: Optional[str] = None, **kw: Any) -> int:
    """Write a stream of tables to ``out`` atomically; returns the number of rows, and adds to
    ``notes`` what the output does not hold as the store does. ``what`` names the output in an
    error writing it (default: ``"<fmt> output"``)."""
    directory = fmt == "hf"
    with atomic_output(out, overwrite=overwrite, directory=directory, replaceable=REPLACEABLE[fmt],
                       what=what or f"{fmt} output") as tmp:
        sink = open_sink(fmt, tmp, schema, metadata, **kw)
        try:
            for t in tables:
                check_interrupt()
                if t.schema != sink.schema:
                    t = t.cast(sink.schema)
                sink.write(t)
            sink.close()
        except BaseException:
            sink.abort()
            raise
        if notes is not None:
            notes.extend(getattr(sink, "notes", ()))
        return sink.rows


def export(store: StoreLike, out: Any, format: Optional[str] = None, *, columns: Optional[Sequence[str]] = None,
           policy_versions: Any = None, min_reward: Optional[float] = None, limit: Optional[int] = None,
           tokenizer: Any = None, skip_special_tokens: bool = False, reward_key: str = "rewards",
           overwrite: bool = False, progress: bool = False, compression: Optional[str] = None,
           chunk_bytes: int = CHUNK_BYTES, force: bool = False, include_excluded: bool = False,
           skip_damaged: bool = False, versions: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Export a store's live rows to ``out`` as ``parquet``, ``jsonl``, ``hf`` or ``zarr``.

    ``format=None`` takes the format from ``out``'s name (:func:`output_format`:
    ``.parquet``/``.pq``, ``.jsonl``/``.ndjson``/``.json``, ``.zarr``, no
    extension for ``hf``); a ``format`` that contradicts the extension is
    refused unless ``force``. ``compression`` is Parquet's codec (default
    snappy; see :data:`PARQUET_CODECS`).

    Streams chunk by chunk (memory bounded by ~``chunk_bytes`` of store data)
    into a temporary name beside ``out`` and renames it at the end, so an
    interrupted export leaves nothing under ``out``; an existing ``out`` is
    refused unless ``overwrite``. ``columns`` picks columns; ``policy_versions``
    (``"A:B"`` or ``(A, B)``, inclusive), ``min_reward`` and ``limit`` pick
    rows; ``tokenizer`` (a local directory) adds decoded ``prompt`` and
    ``completion`` text columns. Ragged columns are ``large_list`` in Parquet,
    ``List`` sequences in HF, arrays in JSONL (``null`` for a missing row).
    Rows the store records as excluded (a resumed TRL run's discarded
    timeline, :func:`recorded_exclusions`) are left out unless
    ``include_excluded``. Returns a summary dict (``excluded_rows``: how many
    rows the exclusions left out; ``excluded_ranges``: the live ones recorded).
    A full disk (or quota, read-only filesystem, device error) raises
    :class:`~diskreplay.errors.OutputIOError` naming ``out`` and the format.
    A damaged segment fails the export (``CorruptStoreError`` naming it) unless
    ``skip_damaged``: then its rows are left out (the store is not changed) and
    ``skipped_damaged`` lists each one's file, rows and damage, ``skipped_rows``
    counts them (:class:`~diskreplay.export.sources.SkipDamaged`).
    A media column (docs/media.md, "Exports") holds each row's bytes in Parquet and HF, its
    hash by reference in JSONL; ``skip_damaged`` also leaves out the rows naming a damaged blob.
    ``versions`` (``{"rewards": "judge-v2"}``) exports a named version of a
    column's values (``ReplayStore.update(..., version=...)``) under the
    column's own name, null/NaN where that version has none (``min_reward``
    then filters on it too); the default is the newest values.

    >>> import tempfile, os, pyarrow.parquet as pq
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(os.path.join(d, "store")) as s:
    ...     _ = s.extend({"prompt_id": [0, 0], "completion_ids": [[1, 2], [3]], "rewards": [1.0, 0.0]})
    ...     info = export(s, os.path.join(d, "out.parquet"))
    >>> info["rows"], pq.read_table(os.path.join(d, "out.parquet"))["completion_ids"].to_pylist()
    (2, [[1, 2], [3]])
    """
    format = output_format(out, format, formats=FORMATS, force=force)
    chunk_bytes = check_chunk_bytes(chunk_bytes)
    if compression is not None and format != "parquet":
        raise ExportError(f"compression (--compression) applies to parquet exports, not {format}")
    compression = check_compression("snappy" if compression is None else compression)
    if format == "zarr":
        from .zarr_archive import export_zarr

        if tokenizer is not None:
            raise ExportError("a zarr export holds the store's columns only; --tokenizer applies to parquet, "
                              "jsonl and hf")
        if versions:
            with open_store(store, versions) as view:  # checks the versions; export_zarr pins the view again
                res = export(view, out, format, columns=columns, policy_versions=policy_versions,
                             min_reward=min_reward, limit=limit, reward_key=reward_key, overwrite=overwrite,
                             progress=progress, chunk_bytes=chunk_bytes, force=force,
                             include_excluded=include_excluded, skip_damaged=skip_damaged)
            return {**res, "versions": dict(versions)}
        return export_zarr(store, out, columns=columns, policy_versions=policy_versions, min_reward=min_reward,
                           limit=limit, reward_key=reward_key, overwrite=overwrite, progress=progress,
                           chunk_bytes=chunk_bytes, force=True,  # the name was checked above
                           include_excluded=include_excluded, skip_damaged=skip_damaged)
    flt = make_filter(policy_versions, min_reward, limit, reward_key)
    with open_store(store, versions) as st:
        names = check_columns(st, columns)
        flt.check(st)
        excluded = Exclusions.of(st, include_excluded)
        if skip_damaged:
            excluded = SkipDamaged.of(st, excluded)
        decoder = resolve_tokenizer(tokenizer, skip_special_tokens)
        text_cols: List[str] = []
        if decoder is not None:
            for c in TEXT_COLUMNS:
                ids = f"{c}_ids"
                if ids not in st.columns:
                    continue
                if c in names:
                    raise ExportError(f"the store already has a column {c!r}; drop it with --columns to add "
                                      "decoded text")
                text_cols.append(c)
            if not text_cols:
                raise ExportError(f"--tokenizer decodes prompt_ids / completion_ids, but the store has neither "
                                  f"(columns: {st.columns})")
        read_cols = list(dict.fromkeys(names + [f"{c}_ids" for c in text_cols]))
        large = format != "hf"
        media = MediaColumns(st, names, format, large)
        fields = [media.field(n) if n in media.names else pa.field(n, arrow_type(st.schema[n], large)) for n in names]
        fields += [pa.field(c, pa.large_string() if large else pa.string()) for c in text_cols]
        schema = pa.schema(fields)
        meta = export_metadata(st, names, **({"versions": dict(versions)} if versions else {}), **media.metadata())
        bar = progress_bar(len(st), f"export {format}", progress)
        checked = Retokenized()

        def tables() -> Iterator[pa.Table]:
            for pieces in iter_rows(st, flt, chunk_bytes, bar, excluded):
                if media.names:  # a chunk's rows may name far more media bytes than their own: cut it
                    pieces = media.split(pieces, chunk_bytes, skip_damaged)
                    for rows in pieces[:-1]:
                        yield table_of(rows)
                    pieces = pieces[-1:]
                parts = [table_of(rows) for rows in pieces if len(rows)]
                if parts:
                    yield parts[0] if len(parts) == 1 else pa.concat_tables(parts)

        def table_of(rows: np.ndarray) -> pa.Table:
            data = st.read(rows, read_cols) if read_cols else {}
            n = len(rows)
            arrays = [media.column(data[c]) if c in media.names
                      else column_to_arrow(st.schema[c], data[c], n, large, late=c in st.schema.late)
                      for c in names]
            if text_cols:
                ids = {c: data[f"{c}_ids"] for c in text_cols}
                prompt, completions, bad = decoder.texts(
                    ids.get("prompt"), [ids[c] for c in text_cols if c != "prompt"], n,
                    [f"{c}_ids" for c in TEXT_COLUMNS])
                checked.add(bad, [f"row {i}" for i in rows])
                texts = ([prompt] if "prompt" in ids else []) + completions
                arrays += [pa.array(t, type=pa.large_string() if large else pa.string()) for t in texts]
            return pa.Table.from_arrays(arrays, schema=schema)

        try:
            kw = {"compression": compression, "row_group_bytes": chunk_bytes} if format == "parquet" else {}
            notes: List[str] = []
            rows = write_tables(format, out, schema, tables(), metadata=meta, overwrite=overwrite, notes=notes,
                                what=f"{format} export",
                                **kw)
        finally:
            bar.close()
    out = os.path.abspath(os.fspath(out))
    res = {"path": out, "format": format, "rows": rows, "columns": names + text_cols, "bytes": tree_size(out),
           "excluded_rows": excluded.left_out, "excluded_ranges": excluded.report()["ranges"]}
    if versions:
        res["versions"] = dict(versions)
    if skip_damaged:
        res.update(skipped_damaged=excluded.skipped_segments() + media.skipped(),
                   skipped_rows=excluded.skipped + media.skipped_rows)
    if decoder is not None:
        res["retokenize_mismatches"] = checked.bad
        notes += filter(None, [checked.warning("rows", decoder.path, decoder.skip_special_tokens)])
    if notes:
        res["warnings"] = notes
    return res


def export_parquet(store: StoreLike, out: Any, **kw: Any) -> Dict[str, Any]:
    """Export to one Parquet file (pyarrow ``ParquetWriter``; a row group per ~64 MiB chunk).

    Ragged columns are ``large_list<int32|float32>`` (null where a row has no
    value); the file's schema metadata (key ``diskreplay``) carries the store
    schema so :func:`import_rollouts` rebuilds an identical store. Readable by
    pyarrow, polars and duckdb. Options as for :func:`export`.

    >>> import tempfile, os, polars as pl
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(os.path.join(d, "s")) as s:
    ...     _ = s.extend({"prompt_id": [5], "completion_ids": [[7, 8]]})
    >>> _ = export_parquet(os.path.join(d, "s"), os.path.join(d, "o.parquet"))
    >>> pl.read_parquet(os.path.join(d, "o.parquet"))["completion_ids"].to_list()
    [[7, 8]]
    """
    return export(store, out, "parquet", **kw)


def export_jsonl(store: StoreLike, out: Any, **kw: Any) -> Dict[str, Any]:
    """Export one JSON object per rollout and line, streaming. Options as for :func:`export`.

    >>> import tempfile, os, json
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(os.path.join(d, "s")) as s:
    ...     _ = s.extend({"prompt_id": ["q1", "q1"], "completion_ids": [[7, 8], [9]],
    ...                   "old_per_token_logps": [None, [-0.5]]})
    >>> _ = export_jsonl(os.path.join(d, "s"), os.path.join(d, "o.jsonl"))
    >>> json.loads(open(os.path.join(d, "o.jsonl")).readline())
    {'prompt_id': 'q1', 'completion_ids': [7, 8], 'old_per_token_logps': None}
    """
    return export(store, out, "jsonl", **kw)


def export_hf(store: StoreLike, out: Any, **kw: Any) -> Dict[str, Any]:
    """Export as a Hugging Face dataset directory (``save_to_disk`` layout).

    Token and log-prob columns are ``List(Value(...))`` sequences;
    ``datasets.load_from_disk(out)`` reads it. A ``diskreplay.json`` beside the
    data carries the store schema for :func:`import_rollouts`. Needs
    ``pip install 'diskreplay[hf]'``. Options as for :func:`export`.

    >>> import tempfile, os, datasets
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(os.path.join(d, "s")) as s:
    ...     _ = s.extend({"prompt_id": [5], "completion_ids": [[7, 8]]})
    >>> _ = export_hf(os.path.join(d, "s"), os.path.join(d, "ds"))
    >>> datasets.load_from_disk(os.path.join(d, "ds"))[0]["completion_ids"]
    [7, 8]
    """
    return export(store, out, "hf", **kw)
