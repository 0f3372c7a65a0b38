"""Build a store from a Parquet file, a JSONL rollout dump, a Hugging Face
dataset saved to disk, or a Zarr archive written by ``export``.

Every source is read as Arrow tables of ``chunk_rows`` rows; each table is
renamed by the column mapping, turned into an ``extend`` batch (ragged columns
as lists of 1-D arrays, ``None`` for a missing row) and appended as one
commit. A new store is built under a temporary name and renamed into place
at the end, so a failed import leaves nothing under the final name.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DiskReplayError
from ..schema import RAGGED, SCALAR, VECTOR, ColumnSpec
from ..store import ReplayStore
from ._common import (META_KEY, ExportError, OutputExistsError, atomic_output, check_metadata, check_output,
                      progress_bar, require)

IMPORT_FORMATS = ("auto", "parquet", "jsonl", "hf", "zarr")
_AUTO: Any = object()

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
# Sources


class ParquetSource:
    """A Parquet file, or a directory of ``*.parquet`` files read in name order."""

    format = "parquet"

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.isdir(path):
            self.files = sorted(os.path.join(path, f) for f in os.listdir(path)
                                if f.endswith((".parquet", ".pq")) and not f.startswith("."))
            if not self.files:
                raise ExportError(f"directory {path} holds no .parquet files")
        else:
            self.files = [path]
        try:
            first = pq.ParquetFile(self.files[0])
            self.total: Optional[int] = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        except (pa.ArrowException, OSError) as exc:
            raise ExportError(f"{self.files[0]} is not a readable Parquet file ({exc})") from None
        md = first.schema_arrow.metadata or {}
        raw = md.get(META_KEY)
        try:
            doc = json.loads(raw) if raw is not None else None
        except ValueError:
            raise ExportError(f"{self.files[0]}: its {META_KEY.decode()!r} metadata is not JSON") from None
        self.meta = check_metadata(doc, self.files[0])
        self.columns = first.schema_arrow.names
        self.skipped = 0

    def batches(self, chunk_rows: int, kept: Sequence[str]) -> Iterator[Tuple[pa.Table, str]]:
        row = 0
        for f in self.files:
            try:
                pf = pq.ParquetFile(f)
                missing = [c for c in kept if c not in pf.schema_arrow.names]
                if missing:
                    raise ExportError(f"{f} lacks column {missing[0]!r}, which {self.files[0]} has")
                for rb in pf.iter_batches(batch_size=chunk_rows, columns=list(kept)):
                    yield pa.Table.from_batches([rb]), f"{f}: rows {row}-{row + rb.num_rows - 1}"
                    row += rb.num_rows
            except (pa.ArrowException, OSError) as exc:
                raise ExportError(f"{f} could not be read at row {row} ({exc})") from None


class HFSource:
    """A Hugging Face dataset saved with ``save_to_disk`` (a ``DatasetDict`` needs ``split``)."""

    format = "hf"

    def __init__(self, path: str, split: Optional[str] = None) -> None:
        datasets = require("datasets", "hf", "importing a Hugging Face dataset")
        self.path = path
        try:
            ds = datasets.load_from_disk(path)
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise ExportError(f"{path} is not a dataset saved with save_to_disk ({exc})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split is None and len(ds) == 1:
                split = next(iter(ds))
            if split not in ds:
                raise ExportError(f"{path} is a DatasetDict with splits {', '.join(ds)}; pass --split NAME")
            ds = ds[split]
        self.ds = ds
        self.columns = list(ds.column_names)
        self.total = len(ds)
        self.skipped = 0
        sidecar = os.path.join(path, "diskreplay.json")
        doc = None
        if split is None and os.path.exists(sidecar):
            try:
                with open(sidecar, encoding="utf-8") as fh:
                    doc = json.load(fh)
            except ValueError:
                raise ExportError(f"{sidecar} is not JSON") from None
        self.meta = check_metadata(doc, sidecar)

    def batches(self, chunk_rows: int, kept: Sequence[str]) -> Iterator[Tuple[pa.Table, str]]:
        ds = self.ds.select_columns(list(kept)) if list(kept) != self.columns else self.ds
        row = 0
        for t in ds.with_format("arrow").iter(batch_size=chunk_rows):
            yield t, f"{self.path}: rows {row}-{row + t.num_rows - 1}"
            row += t.num_rows


def _json_class(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "list"
    return "object"


def _aligned_with(name: str, present: Sequence[str]) -> Optional[str]:
    """The ids column a ragged column must match in length (the store's rule)."""
    if name in ("prompt_ids", "completion_ids") or "reward" in name.lower():
        return None
    if name.startswith("prompt_"):
        return "prompt_ids" if "prompt_ids" in present else None
    return "completion_ids" if "completion_ids" in present else None


class JsonlSource:
    """A JSONL rollout dump (``.gz`` allowed): one JSON object per line.

    Lines are validated one by one: a line that does not parse, is not an
    object, holds a nested object, changes a column's JSON type, lacks a
    per-row value, or has a per-token list whose length differs from its ids
    is reported as ``FILE:LINE`` or, with ``skip_bad``, skipped and counted.
    """

    format = "jsonl"
    meta = None

    def __init__(self, path: str, skip_bad: bool = False) -> None:
        self.path, self.skip_bad = path, skip_bad
        self.skipped = 0
        self.bad_examples: List[str] = []
        self.columns: Optional[List[str]] = None
        self.total = None if path.endswith(".gz") else os.path.getsize(path)
        self._classes: Dict[str, str] = {}
        self.bytes_read = 0

    def _bad(self, lineno: int, msg: str) -> None:
        text = f"{self.path}:{lineno}: {msg}"
        if not self.skip_bad:
            raise ExportError(f"{text} (pass --skip-bad to skip bad lines)")
        self.skipped += 1
        if len(self.bad_examples) < 5:
            self.bad_examples.append(text)

    def _open(self) -> Any:
        return gzip.open(self.path, "rb") if self.path.endswith(".gz") else open(self.path, "rb")

    def _lines(self) -> Iterator[Tuple[int, dict]]:
        try:
            fh = self._open()
        except OSError as exc:
            raise ExportError(f"cannot open {self.path}: {exc.strerror or exc}") from None
        with fh:
            try:
                for lineno, raw in enumerate(fh, 1):
                    self.bytes_read += len(raw)
                    if not raw.strip():
                        continue
                    try:
                        obj = json.loads(raw)
                    except ValueError as exc:
                        msg = getattr(exc, "msg", str(exc))
                        col = getattr(exc, "colno", None)
                        self._bad(lineno, f"not valid JSON ({msg}" + (f" at column {col})" if col else ")"))
                        continue
                    if not isinstance(obj, dict):
                        self._bad(lineno, f"is a JSON {_json_class(obj)}, not an object with one rollout")
                        continue
                    yield lineno, obj
            except (OSError, EOFError) as exc:
                raise ExportError(f"{self.path} could not be read ({exc})") from None

    def peek_columns(self, limit: int) -> List[str]:
        """Union of the keys of the first ``limit`` good lines (in order of appearance)."""
        seen: Dict[str, None] = {}
        skipped, examples = self.skipped, list(self.bad_examples)
        for i, (_, obj) in enumerate(self._lines()):
            for k in obj:
                seen.setdefault(k, None)
            if i + 1 >= limit:
                break
        self.skipped, self.bad_examples, self.bytes_read = skipped, examples, 0
        return list(seen)

    def batches(self, chunk_rows: int, kept: Sequence[str], rename: Mapping[str, str]
                ) -> Iterator[Tuple[pa.Table, str]]:
        keep = set(kept)
        rows: List[dict] = []
        lines: List[int] = []
        for lineno, obj in self._lines():
            row = {rename.get(k, k): v for k, v in obj.items() if k in keep}
            if not self._check_line(lineno, row):
                continue
            rows.append(row)
            lines.append(lineno)
            if len(rows) >= chunk_rows:
                yield from self._table(rows, lines)
                rows, lines = [], []
        if rows:
            yield from self._table(rows, lines)

    def _check_line(self, lineno: int, row: dict) -> bool:
        classes = self._classes
        for k, v in row.items():
            c = _json_class(v)
            if c == "object":
                self._bad(lineno, f"column {k!r} holds a JSON object; a store holds numbers, strings and lists "
                                  "of numbers (drop it with --columns)")
                return False
            if c == "null":
                continue
            known = classes.get(k)
            if known is None:
                classes[k] = c
            elif known != c:
                self._bad(lineno, f"column {k!r} is a {c} here but a {known} in earlier lines")
                return False
        for k, c in classes.items():
            if c != "list" and row.get(k) is None:
                self._bad(lineno, f"column {k!r} has no value; per-row columns need one in every line")
                return False
        present = [k for k, v in row.items() if v is not None]
        for k in present:
            if classes.get(k) != "list":
                continue
            ref = _aligned_with(k, present)
            if ref is not None and classes.get(ref) == "list" and len(row[k]) != len(row[ref]):
                self._bad(lineno, f"column {k!r} has {len(row[k])} values but {ref!r} has {len(row[ref])}; "
                                  "per-token columns must align with their ids")
                return False
        return True

    def _table(self, rows: List[dict], lines: List[int]) -> Iterator[Tuple[pa.Table, str]]:
        names = list(dict.fromkeys(k for r in rows for k in r))
        # a per-row column first seen after earlier lines lacked it cannot be filled in
        late = [k for k in names if self._classes.get(k) not in (None, "list") and k not in self.columns_seen]
        if late and self.columns_seen:
            raise ExportError(f"{self.path}:{lines[0]}: column {late[0]!r} first appears after line 1 of the "
                              "dump; a per-row column must be present in every line")
        self.columns_seen.update(names)
        bad_rows: set = set()
        arrays: Dict[str, pa.Array] = {}
        for k in names:
            values = [r.get(k) for r in rows]
            arr = None
            try:
                arr = pa.array(values)
            except (pa.ArrowException, OverflowError, TypeError):
                pass
            if arr is None or (_json_class(next((v for v in values if v is not None), None)) == "list"
                               and not _numeric_list(arr.type)):
                for i, v in enumerate(values):
                    if v is not None and not _numbers_only(v):
                        bad_rows.add(i)
                        self._bad(lines[i], f"column {k!r} holds a list with a non-number or a number "
                                            "outside int64/float64")
            arrays[k] = arr
        if bad_rows:
            keep = [i for i in range(len(rows)) if i not in bad_rows]
            if not keep:
                return
            rows = [rows[i] for i in keep]
            lines = [lines[i] for i in keep]
            arrays = {k: pa.array([r.get(k) for r in rows]) for k in names}
        table = pa.Table.from_arrays([arrays[k] for k in names], names=names)
        yield table, f"{self.path}: lines {lines[0]}-{lines[-1]}"

    columns_seen: set


def _numbers_only(v: Any) -> bool:
    return all(type(x) in (int, float) and (type(x) is float or -(1 << 63) <= x < (1 << 63)) for x in v)


def _numeric_list(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    vt = t.value_type
    return pa.types.is_integer(vt) or pa.types.is_floating(vt) or pa.types.is_null(vt) or pa.types.is_boolean(vt)


def detect_format(src: str) -> str:
    """Guess a source's format from its layout, name or first bytes.

    >>> detect_format(__file__)
    Traceback (most recent call last):
    ...
    diskreplay.export._common.ExportError: cannot tell the format of ...; pass --format parquet|jsonl|hf|zarr
    """
    if not os.path.exists(src):
        raise ExportError(f"{src} does not exist")
    if os.path.isdir(src):
        if os.path.exists(os.path.join(src, "zarr.json")):
            return "zarr"
        if any(os.path.exists(os.path.join(src, f)) for f in ("state.json", "dataset_dict.json")):
            return "hf"
        if any(f.endswith((".parquet", ".pq")) for f in os.listdir(src)):
            return "parquet"
    else:
        low = src.lower()
        if low.endswith((".parquet", ".pq")):
            return "parquet"
        if low.endswith((".jsonl", ".ndjson", ".json", ".jsonl.gz", ".ndjson.gz", ".json.gz")):
            return "jsonl"
        try:
            with open(src, "rb") as fh:
                head = fh.read(64)
        except OSError as exc:
            raise ExportError(f"cannot read {src}: {exc.strerror or exc}") from None
        if head.startswith(b"PAR1"):
            return "parquet"
        if head.lstrip().startswith(b"{"):
            return "jsonl"
    raise ExportError(f"cannot tell the format of {src}; pass --format parquet|jsonl|hf|zarr")


# ---------------------------------------------------------------------------
# Arrow tables -> extend batches


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _null_rows_error(name: str, arr: pa.Array, where: str) -> ExportError:
    i = int(np.flatnonzero(~arr.is_valid().to_numpy(zero_copy_only=False))[0])
    return ExportError(f"{where}: column {name!r} is null in row {i} of this chunk; per-row columns need a value "
                       "in every row")


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


def table_to_batch(table: pa.Table, hints: Mapping[str, ColumnSpec], first: bool, where: str) -> Dict[str, Any]:
    """One Arrow table as an ``extend`` batch (ragged columns as lists of arrays).

    ``hints`` are the expected column specs (the store's schema once it has
    one, else the export metadata); ``first`` marks the store's first append,
    which fixes its schema (an all-missing ragged column must then be given
    as a list of ``None`` rather than left out).

    >>> t = pa.table({"completion_ids": pa.array([[1, 2], None]), "rewards": pa.array([0.5, 1.0])})
    >>> b = table_to_batch(t, {}, True, "x"); [None if r is None else r.tolist() for r in b["completion_ids"]]
    [[1, 2], None]
    """
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
        if _is_list(t) and _numeric_list(t):
            n_valid = len(arr) - arr.null_count
            lengths = None
            as_vector = hint is not None and hint.kind == VECTOR
            if hint is None and "reward" in name.lower() and arr.null_count == 0 and len(arr):
                lengths = np.diff(arr.offsets.to_numpy(zero_copy_only=False))
                as_vector = bool(lengths.min() == lengths.max() and lengths[0] > 0)
            if as_vector:
                if arr.null_count:
                    raise _null_rows_error(name, arr, where)
                lengths = np.diff(arr.offsets.to_numpy(zero_copy_only=False)) if lengths is None else lengths
                width = int(lengths[0]) if len(lengths) else (hint.width if hint else 0)
                if len(lengths) and (lengths != width).any():
                    raise ExportError(f"{where}: column {name!r} is a per-row vector of width {width} but a row "
                                      f"holds {int(lengths[lengths != width][0])} values")
                flat = arr.flatten().to_numpy(zero_copy_only=False)
                batch[name] = flat.reshape(len(arr), width) if hint is None else \
                    flat.reshape(len(arr), width).astype(hint.dtype, copy=False)
                continue
            if hint is not None and hint.kind != RAGGED:
                raise ExportError(f"{where}: column {name!r} holds lists but the store holds a {hint.kind} "
                                  "column there")
            if n_valid == 0 and not first:
                batch[name] = None  # the store fills an absent ragged column with missing rows
                continue
            batch[name] = _ragged_rows(arr, hint.dtype if hint is not None else None)
        elif pa.types.is_fixed_size_list(t):
            if arr.null_count:
                raise _null_rows_error(name, arr, where)
            flat = arr.flatten().to_numpy(zero_copy_only=False)
            batch[name] = flat.reshape(len(arr), t.list_size)
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            if arr.null_count:
                raise _null_rows_error(name, arr, where)
            batch[name] = arr.to_pylist()
        elif pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            if arr.null_count:
                raise _null_rows_error(name, arr, where)
            v = arr.to_numpy(zero_copy_only=False)
            if hint is not None and hint.kind == SCALAR and hint.dtype != "string" and v.dtype.kind in "iuf" \
                    and (hint.dtype.startswith("float") or v.dtype.kind != "f"):
                v = v.astype(hint.dtype, copy=False)
            elif v.dtype.kind == "u":
                v = v.astype(np.int64)
            batch[name] = v
        elif pa.types.is_null(t):
            if hint is not None and hint.kind != RAGGED:
                raise _null_rows_error(name, pa.nulls(len(arr)), where)
            batch[name] = [None] * len(arr) if first else None
        else:
            raise ExportError(f"{where}: column {name!r} has type {t}, which a store cannot hold (it holds "
                              "numbers, strings, and lists of numbers); drop it with --columns")
    return batch


# ---------------------------------------------------------------------------
# The import


def _open_source(fmt: str, src: str, skip_bad: bool, split: Optional[str]) -> Any:
    if fmt == "parquet":
        return ParquetSource(src)
    if fmt == "jsonl":
        return JsonlSource(src, skip_bad)
    if fmt == "hf":
        return HFSource(src, split)
    from .zarr_archive import ZarrSource

    return ZarrSource(src)


def import_rollouts(src: Any, path: Any, *, format: str = "auto", mapping: Any = None, aliases: bool = False,
                    columns: Optional[Sequence[str]] = None, group_key: Any = _AUTO, capacity: Any = _AUTO,
                    skip_bad: bool = False, chunk_rows: int = 4096, append: bool = False,
                    overwrite: bool = False, split: Optional[str] = None, progress: bool = False) -> Dict[str, Any]:
    """Build a store at ``path`` from ``src`` (Parquet, JSONL, HF dataset dir or Zarr archive).

    ``format="auto"`` guesses from the layout and name. ``mapping``
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
    temporary name and appears whole. ``skip_bad`` skips and counts bad JSONL
    lines. Returns a summary dict.

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
    exists = os.path.exists(os.path.join(path, "FORMAT.json"))
    if append and not exists:
        raise ExportError(f"--append needs an existing store at {path}")
    if not append:
        check_output(path, overwrite)
    source = _open_source(fmt, src, skip_bad, split)
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
                hints[new] = ColumnSpec(new, s.kind, s.dtype, s.align, s.width)
    if group_key is _AUTO:
        mk = meta.get("group_key") if meta is not None else None
        mk = rename.get(mk, mk) if mk is not None else None
        group_key = mk if mk in final_names else ("prompt_id" if "prompt_id" in final_names else None)
    elif group_key is not None and group_key not in final_names and not append:
        raise ExportError(f"group key {group_key!r} is not a column of {src} (columns: {', '.join(final_names)})")
    if capacity is _AUTO:
        capacity = meta.get("capacity") if meta is not None else None
    capacity_bytes = meta.get("capacity_bytes") if meta is not None else None

    bar = progress_bar(source.total, f"import {fmt}", progress, unit="B" if fmt == "jsonl" else "rows")
    result: Dict[str, Any] = {}

    def fill(store: ReplayStore) -> None:
        nonlocal hints
        n = 0
        first = not len(store) and store.next_row == 0
        if store.schema is not None and len(store.columns):
            hints = dict(store.schema.columns)
        if fmt == "jsonl":
            source.columns_seen = set()
            batches = source.batches(chunk_rows, kept, rename)
        else:
            batches = ((t.rename_columns([rename.get(c, c) for c in t.column_names]), w)
                       for t, w in source.batches(chunk_rows, kept))
        last = 0
        for table, where in batches:
            if fmt != "jsonl":
                order = [c for c in final_names if c in table.column_names]
                table = table.select(order)
            batch = table_to_batch(table, hints, first, where)
            try:
                store.extend(batch)
            except DiskReplayError as exc:
                raise ExportError(f"{where}: {exc}") from None
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
        result.update(rows=n, columns=list(store.columns), group_key=store.group_key, store_rows=len(store))

    try:
        if append:
            kw = {} if group_key is _AUTO else {}
            with ReplayStore(path, **kw) as store:
                fill(store)
        else:
            with atomic_output(path, overwrite=overwrite, directory=True) as tmp:
                with ReplayStore(tmp, capacity=capacity, group_key=group_key, capacity_bytes=capacity_bytes) as store:
                    fill(store)
    finally:
        bar.close()
    out = {"path": path, "format": fmt, "skipped": source.skipped}
    out.update(result)
    if getattr(source, "bad_examples", None):
        out["bad_lines"] = list(source.bad_examples)
    return out


def _check_schema(store: ReplayStore, hints: Mapping[str, ColumnSpec], src: str) -> None:
    for name, want in hints.items():
        if name not in store.schema:
            continue
        got = store.schema[name]
        if (got.kind, got.dtype, got.width) != (want.kind, want.dtype, want.width):
            raise ExportError(f"column {name!r} of {src} is a {want.kind} column of {want.dtype} but was imported "
                              f"as a {got.kind} column of {got.dtype} (the store infers column kinds from the "
                              "first rows); rename the column or import it separately")
