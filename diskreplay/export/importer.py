"""Build a store from a Parquet file, a JSONL rollout dump, a Hugging Face
dataset saved to disk, a Zarr archive written by ``export``, or another store.

Every source is read as Arrow tables of ``chunk_rows`` rows; each table is
renamed by the column mapping, turned into an ``extend`` batch (ragged columns
as lists of 1-D arrays, ``None`` for a missing row) and appended as one
commit. A new store is built under a temporary name and renamed into place
at the end, so a failed import leaves nothing under the final name.

One module: each source is read as Arrow chunks and appended through the same column
mapping, checks and resumable progress.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from ..errors import DiskReplayError, EvictionRefusedError
from ..schema import RAGGED, SCALAR, VECTOR, ColumnSpec, Media, media_spec
from ..store import ReplayStore
from ._common import is_store
from .outputs import (ExportError, atomic_output, check_interrupt, check_output, interrupts_deferred, progress_bar,
                      replaceable_dir)
from .sources import (TOKEN_ID_COLUMNS, HFSource, JsonlSource, ParquetSource, StoreSource, Where, is_numeric_list,
                      detect_format)

IMPORT_FORMATS = ("auto", "parquet", "jsonl", "hf", "zarr", "store")
AUTO_FORMAT: Any = object()

#: Names other frameworks' rollout dumps use, renamed when ``aliases=True``
#: (first match wins; never when the diskreplay name is present or mapped).
ALIASES: Dict[str, Tuple[str, ...]] = {
    "prompt_ids": ("prompt_token_ids", "prompt_input_ids", "query_token_ids"),
    "completion_ids": ("response_tokens", "response_ids", "response_token_ids", "completion_token_ids",
                       "output_token_ids"),
    "old_per_token_logps": ("logprobs", "old_logprobs", "old_log_probs", "response_logprobs",
                            "rollout_log_probs"),
    "rewards": ("reward", "score", "scores"),
    "advantages": ("advantage",),
    "policy_version": ("step", "global_step", "policy_step"),
    "prompt_id": ("prompt_idx", "prompt_index", "group_id", "uid"),
}


# ---------------------------------------------------------------------------
# Column mapping


def parse_mapping(mapping: Union[None, Mapping[str, str], Sequence[str]]) -> Dict[str, str]:
    """``{"new": "old"}`` from a dict or from ``["new=old", ...]`` strings.

    >>> parse_mapping(["completion_ids=response_tokens", "rewards=reward"])
    {'completion_ids': 'response_tokens', 'rewards': 'reward'}
    """
    if mapping is None:
        return {}
    if isinstance(mapping, Mapping):
        items = list(mapping.items())
    else:
        items = []
        for m in mapping:
            if not isinstance(m, str) or m.count("=") != 1 or not all(p.strip() for p in m.split("=")):
                raise ExportError(f"a column mapping must look like NEW=OLD (e.g. completion_ids=response_tokens), "
                                  f"got {m!r}")
            new, old = (p.strip() for p in m.split("="))
            items.append((new, old))
    out: Dict[str, str] = {}
    for new, old in items:
        if new in out:
            raise ExportError(f"the column mapping names {new!r} twice ({out[new]!r} and {old!r})")
        out[str(new)] = str(old)
    return out


def resolve_columns(src: str, available: Sequence[str], mapping: Dict[str, str], aliases: bool,
                    columns: Optional[Sequence[str]]) -> Tuple[Dict[str, str], List[str]]:
    """``(rename old -> new, kept source columns)`` for a source with ``available`` columns.

    >>> resolve_columns("x", ["reward", "tokens"], {"completion_ids": "tokens"}, True, None)
    ({'tokens': 'completion_ids', 'reward': 'rewards'}, ['reward', 'tokens'])
    """
    have = list(available)
    rename: Dict[str, str] = {}
    for new, old in mapping.items():
        if old not in have:
            raise ExportError(f"column {old!r} named in the mapping {new}={old} is not in {src} "
                              f"(its columns: {', '.join(have) or 'none'})")
        if old in rename:
            raise ExportError(f"column {old!r} is mapped twice ({rename[old]!r} and {new!r})")
        rename[old] = new
    targets = set(rename.values())
    for new in targets:
        if new in have and new not in rename:
            raise ExportError(f"mapping a column to {new!r} clashes with the column {new!r} already in {src}; "
                              f"map that one away too or drop it with --columns")
    if aliases:
        for canon, names in ALIASES.items():
            if canon in have or canon in targets:
                continue
            for a in names:
                if a in have and a not in rename:
                    rename[a] = canon
                    targets.add(canon)
                    break
    final = {c: rename.get(c, c) for c in have}
    if columns is None:
        kept = have
    else:
        inverse = {v: k for k, v in final.items()}
        missing = [c for c in columns if c not in inverse]
        if missing:
            raise ExportError(f"column {missing[0]!r} is not in {src} after mapping (columns: "
                              f"{', '.join(final.values())})")
        kept = [inverse[c] for c in dict.fromkeys(columns)]
    return rename, kept


# ---------------------------------------------------------------------------
# Arrow tables -> extend batches


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _at(where: Union[Where, str], i: int) -> str:
    return where.row(i) if isinstance(where, Where) else f"{where}, row {i}"


def _null_values_error(name: str, arr: pa.Array, where: Union[Where, str]) -> ExportError:
    """A null inside a row of a list column (a row's own null is "not computed"): JSON has no NaN
    or Infinity, so a JSONL export writes null for a non-finite value, e.g. a -inf log-prob."""
    child_nulls = ~arr.values.is_valid().to_numpy(zero_copy_only=False)
    k = int(np.flatnonzero(child_nulls)[0])
    offsets = arr.offsets.to_numpy(zero_copy_only=False)
    i = int(np.searchsorted(offsets, k, side="right") - 1)
    return ExportError(f"{_at(where, i)}: column {name!r} position {k - int(offsets[i])} is null; a value inside a "
                       "row cannot be missing (JSON has no NaN or Infinity, so a JSONL export writes null for "
                       "them: export to Parquet to keep non-finite values)")


def _null_rows_error(name: str, arr: pa.Array, where: Union[Where, str]) -> ExportError:
    i = int(np.flatnonzero(~arr.is_valid().to_numpy(zero_copy_only=False))[0])
    return ExportError(f"{_at(where, i)}: column {name!r} is null; per-row columns need a value in every row "
                       "(only float ones may be null: \"not computed\", as a column added after a store's first "
                       "commit exports its older rows)")


def _float_rows(arr: pa.Array, width: Optional[int] = None) -> Optional[np.ndarray]:
    """A float per-row column (``width``: a vector's) with NaN for null rows, or None if it is not float.

    A store's late float columns read NaN where a row has no value and export
    null there; importing turns null back into NaN.
    """
    vt = arr.type.value_type if width is not None else arr.type
    if not pa.types.is_floating(vt):
        return None
    if width is None:
        return arr.fill_null(float("nan")).to_numpy(zero_copy_only=False)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    out = np.full((len(arr), width), np.nan, dtype=vt.to_pandas_dtype())
    if valid.any():
        out[valid] = arr.filter(arr.is_valid()).flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
    return out


def check_token_ids(table: pa.Table, where: Union[Where, str]) -> None:
    """Refuse token-id columns that are not a list of integers per row, naming the first bad row.

    ``extend`` stores ``prompt_ids`` / ``completion_ids`` as int32 and refuses
    floats once the store has them; a first batch of floats or strings would
    otherwise fix the column's type wrongly (and ``collate`` would hand float
    ids to a model), so an import checks before anything is written.

    >>> check_token_ids(pa.table({"completion_ids": [[1.0, 2.5]]}), Where.rows("f.parquet", 0, 1))
    Traceback (most recent call last):
    ...
    diskreplay.errors.ExportError: f.parquet, row 0: column 'completion_ids' holds double values (1.0); token ids must be integers: write them as integers (pyarrow: cast the column to list<int32>) or map another column to it
    """
    for name in TOKEN_ID_COLUMNS:
        if name not in table.column_names:
            continue
        arr = table.column(name).combine_chunks()
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        t = arr.type
        if pa.types.is_null(t) or arr.null_count == len(arr):
            continue
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        if not (_is_list(t) or pa.types.is_fixed_size_list(t)):
            i = int(np.flatnonzero(valid)[0])
            raise ExportError(f"{_at(where, i)}: column {name!r} holds a {t} per row ({arr[i].as_py()!r}); token "
                              "ids are a list of integers per row")
        vt = t.value_type
        if pa.types.is_integer(vt) or pa.types.is_null(vt):
            continue
        lengths = arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(valid & (lengths > 0))
        if not len(rows):
            continue  # only empty rows: nothing of the wrong type is stored
        i = int(rows[0])
        raise ExportError(f"{_at(where, i)}: column {name!r} holds {vt} values ({arr[i].as_py()[0]!r}); token ids "
                          "must be integers: write them as integers (pyarrow: cast the column to list<int32>) or "
                          "map another column to it")


def _ragged_rows(arr: pa.Array, dtype: Optional[str]) -> List[Optional[np.ndarray]]:
    """A list array as one numpy view per row (``None`` for a null row)."""
    offsets = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    child = arr.values
    if pa.types.is_null(child.type):
        values = np.zeros(len(child), dtype=np.float32 if dtype != "int32" else np.int32)
    else:
        values = child.to_numpy(zero_copy_only=False)
    if dtype == "float32" and values.dtype.kind != "f":
        values = values.astype(np.float32)
    valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else None
    starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
    if valid is None:
        return [values[a:b] for a, b in zip(starts, ends)]
    return [values[a:b] if ok else None for a, b, ok in zip(starts, ends, valid.tolist())]


_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"RIFF", "audio/wav"), (b"fLaC", "audio/flac"), (b"OggS", "audio/ogg"), (b"ID3", "audio/mpeg"))


def _media_rows(name: str, arr: pa.Array, descriptors: Optional[Mapping[str, Any]], where: Union[Where, str]) -> Any:
    """A ``{"bytes", "path"}`` struct column (a media column of a Parquet or HF export, or HF's
    ``Image``/``Audio`` storage) as :class:`~diskreplay.Media`: each row's bytes with the descriptor
    the export's metadata records for its hash (``path``), so the same blobs are stored again
    bit-exact; without one, the media type is taken from the bytes' signature."""
    from ..schema import ARRAY_MIME

    if arr.null_count:
        raise _null_rows_error(name, arr, where)
    data, paths = arr.field("bytes"), arr.field("path")
    if data.null_count:
        raise _null_rows_error(name, data, where)
    values, mimes = [], []
    for raw, path in zip(data.to_pylist(), paths.to_pylist()):
        desc = (descriptors or {}).get(path) if isinstance(path, str) else None
        if desc is not None and desc.get("mime") == ARRAY_MIME:
            values.append(np.frombuffer(raw, dtype=np.dtype(desc["dtype"])).reshape(desc["shape"]))
            mimes.append(ARRAY_MIME)
            continue
        mime = desc.get("mime") if desc is not None else next(
            (m for magic, m in _MAGIC if raw.startswith(magic)), "application/octet-stream")
        values.append(raw)
        mimes.append(mime)
    return Media(values, mime=mimes)


def _is_media(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) and sorted(t.field(i).name for i in range(t.num_fields)) == ["bytes", "path"]


def table_to_batch(table: pa.Table, hints: Mapping[str, ColumnSpec], where: Union[Where, str],
                   media: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """One Arrow table as an ``extend`` batch (ragged columns as lists of arrays).

    ``hints`` are the expected column specs (the store's schema once it has
    one, else the export metadata). Token ids are checked first
    (:func:`check_token_ids`). A ragged column with no value in any row
    is given as ``None`` (the store then records every row as missing).

    >>> t = pa.table({"completion_ids": pa.array([[1, 2], None]), "rewards": pa.array([0.5, 1.0])})
    >>> b = table_to_batch(t, {}, "x"); [None if r is None else r.tolist() for r in b["completion_ids"]]
    [[1, 2], None]
    """
    check_token_ids(table, where)
    batch: Dict[str, Any] = {}
    for name in table.column_names:
        col = table.column(name)
        arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        if isinstance(arr, pa.ChunkedArray):  # pragma: no cover - empty chunked arrays
            arr = pa.concat_arrays(arr.chunks) if arr.num_chunks else pa.array([], type=arr.type)
        hint = hints.get(name)
        t = arr.type
        if pa.types.is_dictionary(t):
            arr = arr.dictionary_decode()
            t = arr.type
        if name in TOKEN_ID_COLUMNS and pa.types.is_fixed_size_list(t):  # equal lengths are still token rows
            arr = arr.cast(pa.large_list(t.value_type))
            t = arr.type
        if name in TOKEN_ID_COLUMNS and _is_list(t) and not pa.types.is_integer(t.value_type):
            # check_token_ids let it through, so no row holds a value: only the declared type is wrong
            arr = arr.cast(pa.large_list(pa.int32()))
            t = arr.type
        if _is_media(t):
            batch[name] = _media_rows(name, arr, media, where)
            continue
        if pa.types.is_struct(t) and (hint is not None and hint.media or t.get_field_index("hash") >= 0):
            raise ExportError(f"{where}: column {name!r} holds media by reference (a JSONL export); import a "
                              "Parquet or HF export, which carries the bytes")
        if _is_list(t) and is_numeric_list(t):
            n_valid = len(arr) - arr.null_count
            lengths = None
            as_vector = hint is not None and hint.kind == VECTOR
            if hint is None and "reward" in name.lower() and arr.null_count == 0 and len(arr):
                lengths = np.diff(arr.offsets.to_numpy(zero_copy_only=False))
                as_vector = bool(lengths.min() == lengths.max() and lengths[0] > 0)
            if as_vector:
                if arr.null_count:
                    width = hint.width if hint is not None else 0
                    filled = _float_rows(arr.cast(pa.list_(t.value_type, width)), width) if width else None
                    if filled is None:
                        raise _null_rows_error(name, arr, where)
                    batch[name] = filled.astype(hint.dtype, copy=False)
                    continue
                lengths = np.diff(arr.offsets.to_numpy(zero_copy_only=False)) if lengths is None else lengths
                width = int(lengths[0]) if len(lengths) else (hint.width if hint else 0)
                if len(lengths) and (lengths != width).any():
                    i = int(np.flatnonzero(lengths != width)[0])
                    raise ExportError(f"{_at(where, i)}: column {name!r} is a per-row vector of width {width} but "
                                      f"this row holds {int(lengths[i])} values")
                flat = arr.flatten().to_numpy(zero_copy_only=False)
                batch[name] = flat.reshape(len(arr), width) if hint is None else \
                    flat.reshape(len(arr), width).astype(hint.dtype, copy=False)
                continue
            if hint is not None and hint.kind != RAGGED:
                raise ExportError(f"{where}: column {name!r} holds lists but the store holds a {hint.kind} "
                                  "column there")
            if n_valid == 0:
                batch[name] = None  # the store fills an absent ragged column with missing rows
                continue
            dtype = hint.dtype if hint is not None else ("int32" if name in TOKEN_ID_COLUMNS else None)
            if arr.values.null_count:
                raise _null_values_error(name, arr, where)
            batch[name] = _ragged_rows(arr, dtype)
            if hint is not None and getattr(hint, "shape", None) is not None:  # a per-token tensor, exported flat
                from ..ingest import PerTokenTensor
                batch[name] = PerTokenTensor([None if r is None else r.reshape((-1,) + tuple(hint.shape))
                                              for r in batch[name]], dtype=hint.dtype, align=hint.align,
                                             fill=hint.fill, shape=tuple(hint.shape))
        elif pa.types.is_fixed_size_list(t):
            if arr.null_count:
                filled = _float_rows(arr, t.list_size)
                if filled is None:
                    raise _null_rows_error(name, arr, where)
                batch[name] = filled
                continue
            flat = arr.flatten().to_numpy(zero_copy_only=False)
            batch[name] = flat.reshape(len(arr), t.list_size)
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            if arr.null_count:
                raise _null_rows_error(name, arr, where)
            batch[name] = arr.to_pylist()
        elif pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            if arr.null_count and (_float_rows(arr) is None or (hint is not None and hint.dtype in ("int64", "bool"))):
                raise _null_rows_error(name, arr, where)
            v = _float_rows(arr) if arr.null_count else arr.to_numpy(zero_copy_only=False)
            if hint is not None and hint.kind == SCALAR and hint.dtype != "string" and v.dtype.kind in "iuf" \
                    and (hint.dtype.startswith("float") or v.dtype.kind != "f"):
                v = v.astype(hint.dtype, copy=False)
            elif hint is None and v.dtype.kind in "iu" and ("reward" in name.lower() or "advantage" in name.lower()):
                v = v.astype(np.float64)  # a JSON dump writes a reward of 1.0 as 1
            elif v.dtype.kind == "u":
                v = v.astype(np.int64)
            batch[name] = v
        elif pa.types.is_null(t):
            if hint is not None and hint.kind != RAGGED and hint.dtype in ("float32", "float64"):
                shape = (len(arr),) + ((hint.width,) if hint.width else ())
                batch[name] = np.full(shape, np.nan, dtype=hint.dtype)  # a float column no row has
                continue
            if hint is not None and hint.kind != RAGGED:
                raise _null_rows_error(name, pa.nulls(len(arr)), where)
            batch[name] = None
        else:
            raise ExportError(f"{where}: column {name!r} has type {t}, which a store cannot hold (it holds "
                              "numbers, strings, and lists of numbers); drop it with --columns")
    return batch


# ---------------------------------------------------------------------------
# The import


def _open_source(fmt: str, src: str, skip_bad: bool, split: Optional[str]) -> Any:
    if split is not None and fmt != "hf":
        raise ExportError(f"a split (--split {split}) picks one of a saved Hugging Face DatasetDict's; {src} is "
                          f"{fmt}, which has none")
    if fmt == "parquet":
        return ParquetSource(src)
    if fmt == "jsonl":
        return JsonlSource(src, skip_bad)
    if fmt == "hf":
        return HFSource(src, split)
    if fmt == "store":
        return StoreSource(src)
    from .zarr_archive import ZarrSource

    return ZarrSource(src)


def import_rollouts(src: Any, path: Any, *, format: str = "auto", mapping: Any = None, aliases: bool = False,
                    columns: Optional[Sequence[str]] = None, group_key: Any = AUTO_FORMAT, capacity: Any = AUTO_FORMAT,
                    skip_bad: bool = False, chunk_rows: int = 4096, append: bool = False,
                    overwrite: bool = False, split: Optional[str] = None, progress: bool = False,
                    allow_evict: bool = False, fill_missing: bool = False) -> Dict[str, Any]:
    """Build a store at ``path`` from ``src`` (Parquet, JSONL, HF dataset dir, Zarr archive or another store).

    ``format="auto"`` guesses from the layout and name (``store`` copies or,
    with ``append``, merges another diskreplay store). ``mapping``
    (``{"new": "old"}`` or ``["new=old", ...]``) renames source columns;
    ``aliases=True`` also renames well-known names of other frameworks
    (:data:`ALIASES`: ``prompt_token_ids``, ``response_tokens``, ``logprobs``,
    ``reward``, ``step``, ...). ``columns`` keeps only these (names after
    mapping). ``group_key`` defaults to the exported store's key, else
    ``prompt_id`` when present, else no index; ``capacity`` to the exported
    store's. Rows are appended ``chunk_rows`` at a time. A file written by
    ``export`` (Parquet, HF, Zarr) restores the store bit-exactly. ``path``
    must not exist (unless ``overwrite``, or ``append`` to add to an existing
    store, where each chunk is its own commit); a new store is built under a
    temporary name and appears whole; ``overwrite`` replaces only a store or
    an empty directory (never a file: the output is a directory). An ``append`` that would evict rows the store
    already holds (because of its row or byte capacity) raises
    :class:`EvictionRefusedError` saying how many, before writing anything,
    unless ``allow_evict``. An ``append`` from a source that lacks some of the
    store's columns (merging two runs' stores) gives a ragged column "not
    computed" (null) rows; a float per-row column needs ``fill_missing=True``
    (its rows read NaN, "not computed"), since NaN rewards or advantages
    would reach samplers unnoticed; int, bool and string columns cannot be
    filled. A source column the store lacks is added if it may be late
    (ragged or float, see docs/FORMAT.md); any other is refused, before
    anything is written. Token ids (``prompt_ids``, ``completion_ids``) must
    be lists of integers in every source. ``skip_bad`` skips and counts bad
    JSONL lines. Ctrl-C stops between chunks: a new store is then removed, an
    ``append`` keeps the chunks committed before it. Returns a summary dict:
    ``rows`` the source's rows now in the store, ``already_imported`` how
    many of them an earlier, interrupted run of the same ``append`` had
    committed (recognised by their chunk tokens and not written again),
    ``filled_columns`` the columns ``fill_missing`` filled.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); src = os.path.join(d, "dump.jsonl")
    >>> with open(src, "w") as f:
    ...     _ = f.write('{"uid": "q1", "response_tokens": [5, 6], "reward": 1.0, "step": 3}\\n')
    ...     _ = f.write('{"uid": "q1", "response_tokens": [7], "reward": 0.0, "step": 3}\\n')
    >>> info = import_rollouts(src, os.path.join(d, "store"), aliases=True)
    >>> info["rows"], info["columns"], info["group_key"]
    (2, ['prompt_id', 'completion_ids', 'rewards', 'policy_version'], 'prompt_id')
    """
    if format not in IMPORT_FORMATS:
        raise ExportError(f"format must be one of {', '.join(IMPORT_FORMATS)}, got {format!r}")
    if not isinstance(chunk_rows, int) or chunk_rows <= 0:
        raise ExportError(f"chunk_rows must be a positive number of rows, got {chunk_rows!r}")
    src = os.path.abspath(os.fspath(src))
    path = os.path.abspath(os.fspath(path))
    fmt = detect_format(src) if format == "auto" else format
    if not os.path.exists(src):
        raise ExportError(f"{src} does not exist")
    if src == path:
        raise ExportError("the source and the store are the same path")
    if append and overwrite:
        raise ExportError("append and overwrite exclude each other")
    if fill_missing and not append:
        raise ExportError("fill_missing (--fill-missing) applies to append (a new store takes the columns the source "
                          "has)")
    exists = is_store(path)
    if append and not exists:
        raise ExportError(f"--append needs an existing store at {path}")
    if not append:
        check_output(path, overwrite, _replaceable_by_store)
        if exists:  # never replace a store a writer has open: this raises StoreLockedError then
            ReplayStore(path).close()
    source = _open_source(fmt, src, skip_bad, split)
    try:
        return _import(source, src, path, fmt, mapping, aliases, columns, group_key, capacity, chunk_rows,
                       append, overwrite, progress, allow_evict, fill_missing)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def _replaceable_by_store(path: str) -> bool:
    """``overwrite`` may replace a store or an empty directory: never a file, nor a
    directory of other things, which the replaced store's removal would delete."""
    return replaceable_dir()(path) or is_store(path)


def _tables(source: Any, fmt: str, chunk_rows: int, kept: Sequence[str], rename: Mapping[str, str]
            ) -> Iterator[Tuple[pa.Table, Where]]:
    """The source's tables with store column names."""
    if fmt == "jsonl":
        return source.batches(chunk_rows, kept, rename)
    return ((t.rename_columns([rename.get(c, c) for c in t.column_names]), w)
            for t, w in source.batches(chunk_rows, kept))


def _incoming(source: Any, fmt: str, chunk_rows: int, kept: Sequence[str], rename: Mapping[str, str],
              need_bytes: bool) -> Tuple[int, Optional[int]]:
    """``(rows, Arrow bytes or None)`` the import would append, before anything is written.

    Parquet, HF, Zarr and store sources know their row count; a JSONL dump
    (and any source when bytes are needed) is read once without writing,
    with the same checks as the real pass, so its count is exact.
    """
    if fmt != "jsonl" and not need_bytes and source.total is not None:
        return int(source.total), None
    skipped, examples = source.skipped, list(getattr(source, "bad_examples", []))
    rows = nbytes = 0
    for table, _ in _tables(source, fmt, chunk_rows, kept, rename):
        check_interrupt()
        rows += table.num_rows
        # a segment is about its Arrow bytes plus ~1 KiB of schema and footer; its group
        # sidecar ~16 bytes a row plus ~2 KiB (measured); err on the large side
        nbytes += table.nbytes + 16 * table.num_rows + 4096
    source.skipped = skipped  # the real pass counts the skipped lines (and the bytes read) again
    if hasattr(source, "bytes_read"):
        source.bytes_read = 0
    if hasattr(source, "bad_examples"):
        source.bad_examples = examples
    return rows, nbytes


def _check_eviction(store: ReplayStore, src: str, n: int, nbytes: Optional[int]) -> None:
    """Refuse an append of ``n`` rows (about ``nbytes``) that would evict rows ``store`` holds now."""
    live = len(store)
    if not live:
        return
    by_rows = 0 if store.capacity is None else min(live, max(0, live + n - store.capacity))
    by_bytes = 0
    if store.capacity_bytes is not None and nbytes:
        # the store drops its oldest segments while its files exceed the byte
        # capacity; the new rows' files are estimated by their Arrow size
        segs = [s for s in store.manifest.segments if s.end_row > store.head]
        total = sum(s.bytes + s.groups_bytes for s in segs) + nbytes
        for s in segs:
            if total <= store.capacity_bytes:
                break
            total -= s.bytes + s.groups_bytes
            by_bytes += s.end_row - max(s.first_row, store.head)
    evicted = max(by_rows, by_bytes)
    if not evicted:
        return
    limits = []
    if store.capacity is not None:
        limits.append(f"{store.capacity:,} rows")
    if store.capacity_bytes is not None:
        limits.append(f"{store.capacity_bytes:,} bytes")
    about = "" if by_rows >= by_bytes else "about "
    raise EvictionRefusedError(
        f"appending {n:,} rows from {src} to the store at {store.path} would evict {about}{evicted:,} of the "
        f"{live:,} rows it holds (its capacity is {' and '.join(limits)}); nothing was written. Pass --allow-evict "
        "(allow_evict=True) to append anyway, or import into a new store with a larger --capacity")


def _import(source: Any, src: str, path: str, fmt: str, mapping: Any, aliases: bool,
            columns: Optional[Sequence[str]], group_key: Any, capacity: Any, chunk_rows: int, append: bool,
            overwrite: bool, progress: bool, allow_evict: bool, fill_missing: bool = False) -> Dict[str, Any]:
    mapping = parse_mapping(mapping)
    available = source.columns if source.columns is not None else source.peek_columns(max(chunk_rows, 1000))
    rename, kept = resolve_columns(src, available, mapping, aliases, columns)
    final_names = [rename.get(c, c) for c in kept]
    meta = source.meta
    hints: Dict[str, ColumnSpec] = {}
    if meta is not None:
        specs = meta["schema_obj"].columns
        for old in kept:
            if old in specs:
                s = specs[old]
                new = rename.get(old, old)
                hints[new] = ColumnSpec(new, s.kind, s.dtype, s.align, s.width, shape=s.shape, fill=s.fill,
                                        media=s.media)
    explicit_key = group_key is not AUTO_FORMAT
    if group_key is AUTO_FORMAT:
        mk = meta.get("group_key") if meta is not None else None
        mk = rename.get(mk, mk) if mk is not None else None
        group_key = mk if mk in final_names else ("prompt_id" if "prompt_id" in final_names else None)
    elif group_key is not None and group_key not in final_names and not append:
        raise ExportError(f"group key {group_key!r} is not a column of {src} (columns: {', '.join(final_names)})")
    if capacity is AUTO_FORMAT:
        capacity = meta.get("capacity") if meta is not None else None
    capacity_bytes = meta.get("capacity_bytes") if meta is not None else None

    bar = progress_bar(source.total, f"import {fmt}", progress, unit="B" if fmt == "jsonl" else "rows")
    result: Dict[str, Any] = {}

    # an append commits each chunk with a token naming the source and the chunk, so that running the
    # same import again after an interruption (or a crash) skips the chunks already committed
    resume = _resume_key(src, fmt, mapping, aliases, columns, chunk_rows) if append else None

    def fill(store: ReplayStore) -> None:
        nonlocal hints
        n = resumed = 0
        first = not len(store) and store.next_row == 0
        before = store.next_row  # a chunk an earlier run committed has rows below it
        source_hints = dict(hints)
        nan_columns: Dict[str, ColumnSpec] = {}
        if store.schema is not None and len(store.columns):
            hints = dict(store.schema.columns)
            nan_columns = _missing_columns(store, final_names, src, fill_missing)
            _check_new_columns(store, source_hints, src)
        batches = _tables(source, fmt, chunk_rows, kept, rename)
        last = 0
        # (an append merges the leading chunks whatever the store holds: its chunks, and so their
        # tokens, depend on the source alone)
        for i, (table, where) in enumerate(_first_rows_with_values(batches, source_hints if append else hints)
                                           if first or append else batches):
            check_interrupt()  # between commits: an append keeps whole chunks only
            if fmt != "jsonl":
                order = [c for c in final_names if c in table.column_names]
                table = table.select(order)
            token = None if resume is None else f"import:{resume}:{i}"
            while True:
                batch = table_to_batch(table, hints, where, meta.get("media") if meta is not None else None)
                if i == 0 and append and len(store.columns):
                    _check_new_columns(store, _specs_of(batch), src)
                for name, spec in nan_columns.items():
                    batch[name] = np.full((table.num_rows,) + ((spec.width,) if spec.kind == VECTOR else ()),
                                          np.nan, dtype=spec.dtype)
                try:
                    # committed by an earlier run: extend writes nothing (and refuses other rows under its token)
                    rows = store.extend(batch, token=token)
                    break
                except DiskReplayError as exc:
                    if token is not None and store.committed_rows(token) is not None:
                        raise ExportError(f"{where}: an earlier import --append of {src} into {path} committed "
                                          f"this chunk (chunk {i}) with other rows: the source changed since; "
                                          "import what it has new from a file of its own") from None
                    row = _row_of(exc, table.num_rows) if isinstance(where, Where) else None
                    if row is None:
                        note = where.offset_note if isinstance(where, Where) else ""
                        raise ExportError(f"{where}: {exc}{note}") from None
                    line = where.line(row)
                    if line is None or not source.skip_bad or table.num_rows == 1:
                        hint = " (pass --skip-bad to skip bad lines)" if line is not None else ""
                        raise ExportError(f"{where.row(row)}: {_without_row(exc)}{hint}") from None
                    # a line whose values do not fit (a negative token id, NaN log-probs): skipped as one
                    # that does not parse is
                    source.bad_line(line, _without_row(exc))
                    table = table.take([k for k in range(table.num_rows) if k != row])
                    where = where.without(row)
            if len(rows) and rows[0] < before:
                resumed += table.num_rows
            if first:
                _check_schema(store, hints, src)
                hints = dict(store.schema.columns)
                first = False
            n += table.num_rows
            if fmt == "jsonl":
                bar.update(source.bytes_read - last)
                last = source.bytes_read
            else:
                bar.update(table.num_rows)
        result.update(rows=n, columns=list(store.columns), group_key=store.group_key, store_rows=len(store),
                      already_imported=resumed, filled_columns=list(nan_columns))
        if n == 0 and (not append or source.skipped):
            bad = f": all {source.skipped:,} lines were bad" if source.skipped else " (it holds no rows)"
            raise ExportError(f"nothing to import from {src}{bad}; nothing was written")
        # a column with no value in any row imported (JSONL writes NaN as null: a reward column TRL left
        # unscored everywhere) has no type to give it: it is left out, and the result says so
        result["empty_columns"] = [c for c in final_names if c not in store.columns]

    try:
        if append:
            key_option = {"group_key": group_key} if explicit_key else {}
            with interrupts_deferred(), ReplayStore(path, **key_option) as store:
                if not allow_evict and (store.capacity is not None or store.capacity_bytes is not None):
                    n, nbytes = _incoming(source, fmt, chunk_rows, kept, rename, store.capacity_bytes is not None)
                    _check_eviction(store, src, n, nbytes)
                fill(store)
        else:
            with atomic_output(path, overwrite=overwrite, directory=True, replaceable=_replaceable_by_store) as tmp:
                with ReplayStore(tmp, capacity=capacity, group_key=group_key, capacity_bytes=capacity_bytes) as store:
                    fill(store)
                    if store.head and not allow_evict:
                        # the export's capacity (rows, or bytes: the new store's files are not the source's
                        # size) dropped rows this import wrote: "imported N rows" would hide it
                        limits = [f"{c:,} rows" for c in (store.capacity,) if c is not None] + \
                            [f"{c:,} bytes" for c in (store.capacity_bytes,) if c is not None]
                        raise EvictionRefusedError(
                            f"importing {src} into a new store with its capacity ({' and '.join(limits)}) "
                            f"evicted {store.head:,} of the {store.next_row:,} rows imported (a store's files "
                            f"are not the same size as another's); nothing was written. Pass --allow-evict "
                            "(allow_evict=True) to keep the newest rows only, or create the store with a larger "
                            "capacity (ReplayStore(path, capacity=..., capacity_bytes=...)) and import --append")
    finally:
        bar.close()
    out = {"path": path, "format": fmt, "skipped": source.skipped}
    out.update(result)
    if getattr(source, "bad_examples", None):
        out["bad_lines"] = list(source.bad_examples)
    return out


_ROW = re.compile(r"\brow (\d+)\b")


def _row_of(exc: BaseException, n: int) -> Optional[int]:
    """The table row a batch error names (``... row 2 ...``), if it names one."""
    m = _ROW.search(str(exc))
    return int(m.group(1)) if m is not None and int(m.group(1)) < n else None


def _without_row(exc: BaseException) -> str:
    """The message without its table-row number (the caller says FILE:LINE instead)."""
    return re.sub(r"\s*\brow \d+\b", "", str(exc), count=1)


def _resume_key(src: str, fmt: str, mapping: Any, aliases: bool, columns: Optional[Sequence[str]],
                chunk_rows: int) -> str:
    """What names an import's chunks in their tokens: the source and everything that shapes its chunks."""
    doc = [src, fmt, sorted(mapping.items()) if isinstance(mapping, Mapping) else mapping, bool(aliases),
           list(columns) if columns is not None else None, chunk_rows]
    return hashlib.sha256(json.dumps(doc, default=str).encode()).hexdigest()[:20]


def _empty_ragged(table: pa.Table, hints: Mapping[str, ColumnSpec]) -> List[str]:
    """Ragged (or untyped) columns of ``table`` without a value in any row."""
    out = []
    for name in table.column_names:
        col = table.column(name)
        hint = hints.get(name)
        ragged = (hint.kind == RAGGED) if hint is not None else (
            pa.types.is_null(col.type) or (_is_list(col.type) and "reward" not in name.lower()))
        if ragged and col.null_count == len(col):
            out.append(name)
    return out


def _first_rows_with_values(batches: Iterator[Tuple[pa.Table, Where]], hints: Mapping[str, ColumnSpec]
                            ) -> Iterator[Tuple[pa.Table, Where]]:
    """Merge leading tables until every ragged column has a value somewhere.

    The first ``extend`` fixes a store's columns and a ragged column with no
    value in it would be left out, so the first table handed on reaches to
    the first row where each ragged column holds a value (or to the end).
    """
    pending: List[Tuple[pa.Table, Where]] = []
    for table, where in batches:
        pending.append((table, where))
        merged = pa.concat_tables([t for t, _ in pending], promote_options="permissive") \
            if len(pending) > 1 else table
        if not _empty_ragged(merged, hints):
            break
    else:
        if not pending:
            return
    if len(pending) == 1:
        yield pending[0]
    else:
        where = pending[0][1]
        for _, w in pending[1:]:
            where = where + w
        yield merged, where
    yield from batches


def _may_be_null(spec: ColumnSpec) -> bool:
    """Whether a column has a "not computed" value for rows without one (docs/FORMAT.md, "Late columns")."""
    return spec.kind == RAGGED or spec.dtype in ("float32", "float64")


def _missing_columns(store: ReplayStore, names: Sequence[str], src: str, fill_missing: bool) -> Dict[str, ColumnSpec]:
    """The float per-row columns of ``store`` that an append of ``names`` must fill with NaN, or the
    refusal (before anything is written) when some cannot be filled or ``fill_missing`` is not given.

    A ragged column the source lacks needs nothing (its rows are "not computed", as in any append),
    nor does a late column (a batch may leave one out).
    """
    missing = [store.schema[c] for c in store.columns if c not in names and c not in store.schema.late]
    unfillable = [c for c in missing if not _may_be_null(c)]
    floats = {c.name: c for c in missing if c.kind != RAGGED and _may_be_null(c)}
    if unfillable:
        what = ", ".join(f"{c.name!r} ({c.kind} {c.dtype})" for c in unfillable)
        raise ExportError(f"{src} has no column{'s' if len(unfillable) > 1 else ''} {what}, which the store at "
                          f"{store.path} holds in every row and "
                          "which has no \"not computed\" value (only ragged and float columns do); give it one "
                          "of the source's columns with --map NEW=OLD, or import into a new store; nothing was "
                          "written")
    if floats and not fill_missing:
        raise ExportError(f"{src} has no column{'s' if len(floats) > 1 else ''} {', '.join(map(repr, floats))}, "
                          f"which the store at {store.path} "
                          "holds in every row; pass --fill-missing (fill_missing=True) to append its rows with "
                          "NaN there (\"not computed\"; samplers and exports then see NaN), or --map one of the "
                          "source's columns to it; nothing was written")
    return floats


def _specs_of(batch: Mapping[str, Any]) -> Dict[str, ColumnSpec]:
    """The column kind an ``extend`` batch gives each column, as far as "may it be null" goes."""
    specs = {}
    for name, value in batch.items():
        if isinstance(value, Media):
            specs[name] = media_spec(name)
            continue
        if value is None or isinstance(value, list) and (not value or not isinstance(value[0], str)):
            specs[name] = ColumnSpec(name, RAGGED, "float32")
        else:
            arr = np.asarray(value)
            kind = VECTOR if arr.ndim == 2 else SCALAR
            dtype = "string" if arr.dtype.kind in "OUS" else str(arr.dtype)
            specs[name] = ColumnSpec(name, kind, dtype, None, arr.shape[1] if arr.ndim == 2 else None)
    return specs


def _check_new_columns(store: ReplayStore, specs: Mapping[str, ColumnSpec], src: str) -> None:
    """Refuse a source column the store lacks that cannot be added to a store with rows (an int,
    bool or string one has no "not computed" value for the rows before it), naming the fix."""
    new = [s for name, s in specs.items() if name not in store.schema and not _may_be_null(s)]
    if new:
        keep = [c for c in specs if c in store.schema or _may_be_null(specs[c])]
        raise ExportError(f"{src} has column(s) {', '.join(f'{s.name!r} ({s.kind} {s.dtype})' for s in new)}, "
                          f"which the store at {store.path} lacks, and a store with rows can only gain ragged or "
                          "float columns (its earlier rows need a \"not computed\" value); leave "
                          f"{'it' if len(new) == 1 else 'them'} out with --columns {','.join(keep)}, or import "
                          "into a new store; nothing was written")


def _check_schema(store: ReplayStore, hints: Mapping[str, ColumnSpec], src: str) -> None:
    for name, want in hints.items():
        if name not in store.schema:
            continue
        got = store.schema[name]
        if (got.kind, got.dtype, got.width) != (want.kind, want.dtype, want.width):
            raise ExportError(f"column {name!r} of {src} is a {want.kind} column of {want.dtype} but was imported "
                              f"as a {got.kind} column of {got.dtype} (the store infers column kinds from the "
                              "first rows); rename the column or import it separately")
