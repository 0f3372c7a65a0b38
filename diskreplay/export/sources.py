"""Readers of import sources: Parquet, JSONL rollout dumps, Hugging Face datasets, other stores.

Each yields ``(Arrow table, where)`` pairs of at most ``chunk_rows`` rows of the
kept source columns; ``where`` (a :class:`Where`) names the file and the row
(or line) of every table row for error messages. The Zarr reader lives with
the Zarr writer in ``zarr_archive``.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..schema import COMPLETION_IDS, PROMPT_IDS
from ..store import ReplayStore
from ._common import CHUNK_BYTES, META_KEY, check_metadata, column_to_arrow, export_metadata, plan_chunks, require
from .outputs import ExportError

@dataclass(frozen=True)
class Where:
    """Where the rows of one source table come from: per part, the file, the
    number of its first row (0-based) and the row count, or for JSONL the line
    of each row. ``row(i)`` names table row ``i`` exactly.

    >>> w = Where.rows("a.parquet", 4096, 10)
    >>> str(w), w.row(3)
    ('a.parquet, rows 4096-4105', 'a.parquet, row 4099')
    >>> Where.lines("d.jsonl", [3, 5]).row(1)
    'd.jsonl:5'
    """

    parts: Tuple[Tuple[str, int, int, Optional[Tuple[int, ...]]], ...]

    @classmethod
    def rows(cls, file: str, first: int, n: int) -> "Where":
        return cls(((file, first, n, None),))

    @classmethod
    def lines(cls, file: str, lines: Sequence[int]) -> "Where":
        return cls(((file, 0, len(lines), tuple(lines)),))

    def __add__(self, other: "Where") -> "Where":
        return Where(self.parts + other.parts)

    def _locate(self, i: int) -> Optional[Tuple[Tuple[str, int, int, Optional[Tuple[int, ...]]], int]]:
        """The part holding table row ``i`` and the row's index in it (None past the end)."""
        for part in self.parts:
            if i < part[2]:
                return part, i
            i -= part[2]
        return None

    def row(self, i: int) -> str:
        found = self._locate(i)
        if found is None:
            return str(self)
        (file, first, _, lines), j = found
        return f"{file}:{lines[j]}" if lines is not None else f"{file}, row {first + j}"

    def __str__(self) -> str:
        def one(part: Tuple[str, int, int, Optional[Tuple[int, ...]]]) -> str:
            file, first, n, lines = part
            if lines is not None:
                if len(lines) == 1:
                    return f"{file}:{lines[0]}"
                return f"{file}, lines {lines[0]}-{lines[-1]}" if lines else file
            return f"{file}, rows {first}-{first + n - 1}"
        if len(self.parts) > 2:
            return f"{one(self.parts[0])} .. {one(self.parts[-1])}"
        return " and ".join(one(p) for p in self.parts)

    def line(self, i: int) -> Optional[int]:
        """The line of table row ``i`` in its JSONL file (None for a file of rows)."""
        found = self._locate(i)
        return None if found is None or found[0][3] is None else found[0][3][found[1]]

    def without(self, i: int) -> "Where":
        """These lines but the one of table row ``i`` (a bad JSONL line skipped)."""
        part, j = self._locate(i)
        file, first, n, lines = part
        kept = (file, first, n - 1, lines[:j] + lines[j + 1:])
        return Where(tuple(kept if p is part else p for p in self.parts))

    @property
    def offset_note(self) -> str:
        """How a message that numbers rows of this table from 0 maps onto the source."""
        if len(self.parts) == 1 and (self.parts[0][3] is None and self.parts[0][1] == 0 or self.parts[0][2] == 1):
            return ""
        return f" (row numbers in this message count the rows of {self} from 0)"


#: Columns of token ids: a list of integers per row, whatever the source (as ``extend`` requires).
TOKEN_ID_COLUMNS = (PROMPT_IDS, COMPLETION_IDS)


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

    def batches(self, chunk_rows: int, kept: Sequence[str]) -> Iterator[Tuple[pa.Table, Where]]:
        for f in self.files:
            row = 0
            try:
                pf = pq.ParquetFile(f)
                missing = [c for c in kept if c not in pf.schema_arrow.names]
                if missing:
                    raise ExportError(f"{f} lacks column {missing[0]!r}, which {self.files[0]} has")
                for rb in pf.iter_batches(batch_size=chunk_rows, columns=list(kept)):
                    yield pa.Table.from_batches([rb]), Where.rows(f, row, rb.num_rows)
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

    def batches(self, chunk_rows: int, kept: Sequence[str]) -> Iterator[Tuple[pa.Table, Where]]:
        ds = self.ds.select_columns(list(kept)) if list(kept) != self.columns else self.ds
        row = 0
        for t in ds.with_format("arrow").iter(batch_size=chunk_rows):
            yield t, Where.rows(self.path, row, t.num_rows)
            row += t.num_rows


class StoreSource:
    """Another diskreplay store (to copy or merge runs), read segment piece by piece."""

    format = "store"

    def __init__(self, path: str) -> None:
        self.path = path
        with ReplayStore(path, readonly=True) as follower:
            self.store = follower.snapshot()  # one commit, however long the copy takes
        if self.store.schema is None:
            self.store.close()
            raise ExportError(f"the store at {path} is empty; nothing to import")
        self.columns = list(self.store.columns)
        self.meta = check_metadata(export_metadata(self.store, self.columns), path)
        self.total: Optional[int] = len(self.store)
        self.skipped = 0

    def batches(self, chunk_rows: int, kept: Sequence[str]) -> Iterator[Tuple[pa.Table, Where]]:
        st, names = self.store, list(kept)
        for chunk in plan_chunks(st, CHUNK_BYTES):
            for lo, hi in chunk:
                for a in range(lo, hi, chunk_rows):
                    rows = np.arange(a, min(hi, a + chunk_rows), dtype=np.int64)
                    data = st.read(rows, names)
                    arrays = [column_to_arrow(st.schema[c], data[c], len(rows), late=c in st.schema.late)
                              for c in names]
                    # numbered by the source store's row ids, which its own tools show
                    yield pa.Table.from_arrays(arrays, names=names), Where.rows(self.path, a, len(rows))

    def close(self) -> None:
        self.store.close()


_NONE = object()


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


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


def _reward_like(name: str) -> bool:
    """A list column named like a reward: per-row (a vector per reward function), never per-token."""
    return "reward" in name.lower() and name not in TOKEN_ID_COLUMNS


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
        self._peeked: Dict[str, str] = {}
        self._peeked_vectors: Dict[str, int] = {}
        self._peeked_lists: set = set()  # list columns with a value in the lines peek_columns read
        self._lists_decided: set = set()  # list columns whose kind (vector or per-token) is fixed
        self._vectors: Dict[str, int] = {}  # list columns read as per-row vectors: their width
        self._order: List[str] = []  # every table carries these columns (missing values are null)
        self._started = False
        self.bytes_read = 0

    def bad_line(self, lineno: int, msg: str) -> None:
        """Line ``lineno`` does not fit: an error naming it, or (``skip_bad``) counted and skipped."""
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
                        self.bad_line(lineno, f"not valid JSON ({msg}" + (f" at column {col})" if col else ")"))
                        continue
                    if not isinstance(obj, dict):
                        self.bad_line(lineno, f"is a JSON {_json_class(obj)}, not an object with one rollout")
                        continue
                    yield lineno, obj
            except (OSError, EOFError) as exc:
                raise ExportError(f"{self.path} could not be read ({exc})") from None

    def peek_columns(self, limit: int) -> List[str]:
        """Union of the keys of the first ``limit`` good lines (in order of appearance).

        Also notes each key's JSON type there, so the first lines can already be
        checked for a missing per-row value.
        """
        seen: Dict[str, str] = {}
        widths: Dict[str, set] = {}  # lengths of each list column
        unaligned: set = set()  # list columns whose length differs from their ids' in some line
        skipped, examples, strict = self.skipped, list(self.bad_examples), self.skip_bad
        self.skip_bad = True  # bad lines are reported by the real pass, with their line numbers
        try:
            for i, (_, obj) in enumerate(self._lines()):
                present = [k for k, v in obj.items() if v is not None]
                for k, v in obj.items():
                    c = _json_class(v)
                    if seen.get(k, "null") == "null":
                        seen[k] = c
                    if c == "list":
                        widths.setdefault(k, set()).add(len(v))
                        ref = _aligned_with(k, present)
                        if ref is not None and isinstance(obj.get(ref), list) and len(obj[ref]) != len(v):
                            unaligned.add(k)
                if i + 1 >= limit:
                    break
        finally:
            self.skipped, self.bad_examples, self.bytes_read, self.skip_bad = skipped, examples, 0, strict
        self._peeked = {k: c for k, c in seen.items() if c not in ("null", "object")}
        self._peek_order = list(seen)
        # a per-row vector (a store's fixed-width column, exported as a list per line): one width in
        # every line, and not the length of its ids (a per-token column would be)
        # (a reward column is never per-token: TRL's per-function rewards are a vector, null where not computed)
        self._peeked_vectors = {k: next(iter(w)) for k, w in widths.items()
                                if (k in unaligned or _reward_like(k)) and len(w) == 1 and next(iter(w)) > 0}
        self._peeked_lists = set(widths)
        return list(seen)

    def batches(self, chunk_rows: int, kept: Sequence[str], rename: Mapping[str, str]
                ) -> Iterator[Tuple[pa.Table, Where]]:
        keep = set(kept)
        self._classes = {rename.get(k, k): c for k, c in self._peeked.items() if k in keep}
        self._vectors = {rename.get(k, k): w for k, w in self._peeked_vectors.items() if k in keep}
        self._lists_decided = {rename.get(k, k) for k in self._peeked_lists if k in keep}
        self._order = [rename.get(k, k) for k in self._peek_order if k in keep]
        self._started = False
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
                self.bad_line(lineno, f"column {k!r} holds a JSON object; a store holds numbers, strings and lists "
                                  "of numbers (drop it with --columns)")
                return False
            if c == "null":
                continue
            known = classes.get(k)
            if known is None:
                classes[k] = c
            elif known != c:
                self.bad_line(lineno, f"column {k!r} is a {c} here but a {known} in earlier lines")
                return False
        for k in TOKEN_ID_COLUMNS:
            v = row.get(k)
            if v is None:
                continue
            if not isinstance(v, list):
                self.bad_line(lineno, f"column {k!r} holds a {_json_class(v)} ({_short(v)}); token ids are a list of "
                                  "integers per row")
                return False
            bad = next((x for x in v if type(x) is not int), _NONE)
            if bad is not _NONE:
                self.bad_line(lineno, f"column {k!r} holds {_short(bad)} at position {v.index(bad)}; token ids must be "
                                  "integers")
                return False
        for k, c in classes.items():
            # a number may be null: a float column added after the store's first commit ("not computed")
            if c not in ("list", "number") and row.get(k) is None:
                self.bad_line(lineno, f"column {k!r} has no value; per-row columns need one in every line")
                return False
        present = [k for k, v in row.items() if v is not None]
        for k, width in self._vectors.items():
            v = row.get(k)  # None: "not computed" (a column the store added after its first commit)
            if v is not None and len(v) != width:
                self.bad_line(lineno, f"column {k!r} has {len(v)} values; other lines hold a per-row vector of "
                                  f"{width} there")
                return False
        for k in present:
            if classes.get(k) != "list" or k in self._vectors:
                continue
            ref = _aligned_with(k, present)
            if k not in self._lists_decided:
                # its first value comes after the lines peek_columns read (a column the store added late):
                # a per-row vector if it cannot be a per-token one (a reward, or not its ids' length)
                self._lists_decided.add(k)
                if row[k] and (_reward_like(k) or ref is not None and classes.get(ref) == "list"
                               and len(row[k]) != len(row[ref])):
                    self._vectors[k] = len(row[k])
                    continue
            if ref is not None and classes.get(ref) == "list" and len(row[k]) != len(row[ref]):
                self.bad_line(lineno, f"column {k!r} has {len(row[k])} values but {ref!r} has {len(row[ref])}; "
                                  "per-token columns must align with their ids")
                return False
        return True

    def _table(self, rows: List[dict], lines: List[int]) -> Iterator[Tuple[pa.Table, Where]]:
        known = set(self._order)
        late = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in known]
        if late and self._started:
            # the store's columns were fixed by its first append
            i = next(i for i, r in enumerate(rows) if late[0] in r)
            raise ExportError(f"{self.path}:{lines[i]}: column {late[0]!r} first appears here, after the first "
                              "rows were imported; drop it with --columns or import with a larger --chunk-rows")
        self._order += late
        self._started = True
        names = list(self._order)
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
                               and not is_numeric_list(arr.type)):
                for i, v in enumerate(values):
                    if v is not None and not _numbers_only(v):
                        bad_rows.add(i)
                        self.bad_line(lines[i], f"column {k!r} holds a list with a non-number or a number "
                                            "outside int64/float64")
            arrays[k] = arr
        if bad_rows:
            keep = [i for i in range(len(rows)) if i not in bad_rows]
            if not keep:
                return
            rows = [rows[i] for i in keep]
            lines = [lines[i] for i in keep]
            arrays = {k: pa.array([r.get(k) for r in rows]) for k in names}
        for k, width in self._vectors.items():
            if k in arrays:
                col = arrays[k]
                if col.null_count == len(col):  # not computed in every row of this chunk
                    arrays[k] = pa.nulls(len(col), pa.list_(pa.float64(), width))
                    continue
                arrays[k] = col.cast(pa.list_(col.type.value_type, width))  # every row checked: that width
        table = pa.Table.from_arrays([arrays[k] for k in names], names=names)
        yield table, Where.lines(self.path, lines)


def _numbers_only(v: Any) -> bool:
    return all(type(x) in (int, float) and (type(x) is float or -(1 << 63) <= x < (1 << 63)) for x in v)


def is_numeric_list(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    vt = t.value_type
    return pa.types.is_integer(vt) or pa.types.is_floating(vt) or pa.types.is_null(vt) or pa.types.is_boolean(vt)


def detect_format(src: str) -> str:
    """Guess a source's format from its layout, name or first bytes.

    >>> detect_format(__file__)
    Traceback (most recent call last):
    ...
    diskreplay.errors.ExportError: cannot tell the format of ...; pass --format parquet|jsonl|hf|zarr|store
    """
    if not os.path.exists(src):
        raise ExportError(f"{src} does not exist")
    if os.path.isdir(src):
        if os.path.exists(os.path.join(src, "FORMAT.json")):
            return "store"
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
    raise ExportError(f"cannot tell the format of {src}; pass --format parquet|jsonl|hf|zarr|store")


class SkipDamaged:
    """An export's row filter (``--skip-damaged``) that also leaves out the rows of a store's damaged
    segments, and says which it left out; everything else is ``excluded``'s (an ``Exclusions``).

    A live segment is damaged when its file is missing or its size or CRC-32C is not what the
    manifest records: the segments ``diskreplay repair`` would drop, whose rows the store refuses
    to serve. Finding them reads every live segment once. Nothing in the store changes.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> from diskreplay.export._common import Exclusions
    >>> with ReplayStore(tempfile.mkdtemp()) as s:
    ...     _ = s.extend({"prompt_id": [0, 0], "completion_ids": [[1], [2]]})
    ...     skip = SkipDamaged.of(s, Exclusions())
    >>> skip.segments, skip.drop(np.arange(2)).tolist()
    ((), [0, 1])
    """

    def __init__(self, segments: Sequence[Tuple[str, int, int, str]], excluded: Any) -> None:
        #: ``(file, first live row, end row, why)`` of each damaged segment, oldest first
        self.segments = tuple(segments)
        self.excluded = excluded
        self.skipped = 0

    @classmethod
    def of(cls, store: ReplayStore, excluded: Any) -> "SkipDamaged":
        from .._fileio import file_crc32c

        found = []
        for s in store.manifest.segments:
            try:
                local = store.storage.local_path(s.file, size=s.bytes)
                size = os.path.getsize(local)
                why = (f"it has {size} bytes, the manifest records {s.bytes}" if size != s.bytes else
                       "it fails its checksum (crc32c)" if file_crc32c(local) != s.crc32c else None)
            except FileNotFoundError:
                why = "it is missing"
            except OSError as exc:  # (a CorruptStoreError too: a symlink, a short download)
                why = f"it cannot be read ({exc})"
            if why is not None:
                found.append((s.file, max(s.first_row, store.head), s.end_row, why))
        return cls(found, excluded)

    @property
    def left_out(self) -> int:
        return self.excluded.left_out

    def report(self) -> Dict[str, Any]:
        return self.excluded.report()

    def mask(self, rows: np.ndarray) -> np.ndarray:
        out = self.excluded.mask(rows)
        for _, a, b, _ in self.segments:
            out |= (rows >= a) & (rows < b)
        return out

    def drop(self, rows: np.ndarray) -> np.ndarray:
        if self.segments and len(rows):
            hit = np.zeros(len(rows), bool)
            for _, a, b, _ in self.segments:
                hit |= (rows >= a) & (rows < b)
            self.skipped += int(hit.sum())
            rows = rows[~hit]
        return self.excluded.drop(rows)

    def skipped_segments(self) -> List[Dict[str, Any]]:
        """What an export's result says of each damaged segment: its file, its live rows, why."""
        return [{"file": f, "rows": [a, b], "why": why} for f, a, b, why in self.segments]
