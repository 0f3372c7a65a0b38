"""Shared machinery of the dataset tools: errors, the store an export reads, row selection,
chunks, Arrow conversion and tokenizers (the outputs they write: :mod:`.outputs`).

Everything here reads a store through its public API only (``read``,
``manifest.segments``, ``group_index``), one bounded chunk of rows at a time.

One module: every export and import tool starts from these same few steps.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

# the error classes live in diskreplay.errors; imported here so that
# ``from diskreplay.export import ExportError`` (the old home) keeps working
from ..errors import (DiskReplayError, ExportError, MissingDependencyError, OutputExistsError,  # noqa: F401
                      StoreNotFoundError)
from ..ragged import RaggedColumn
from ..schema import RAGGED, VECTOR, ColumnSpec, Schema
from ..store import ReplayStore
from .outputs import PathLike, check_interrupt

StoreLike = Union[ReplayStore, PathLike]

#: ``format`` of the metadata document every export carries (Parquet schema
#: metadata, the Zarr group's attributes, ``diskreplay.json`` beside a HF dataset).
EXPORT_FORMAT = "diskreplay.export"
EXPORT_VERSION = 1
META_KEY = b"diskreplay"
#: Rows are read and written in chunks of about this many bytes of store data
#: (consecutive small segments are merged, large ones split): one Parquet row
#: group / one HF record batch per chunk, memory bounded by a few chunks.
CHUNK_BYTES = 64 << 20
TEXT_COLUMNS = ("prompt", "completion")


def require(module: str, extra: str, what: str) -> Any:
    """Import an optional dependency or say which extra installs it.

    >>> require("json", "none", "JSON").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(f"{what} needs the {module!r} package, which is not installed "
                                     f"({exc}); install it with: pip install 'diskreplay[{extra}]'") from None


def missing_store(path: PathLike) -> StoreNotFoundError:
    """The error for a path that holds no store, with what is there instead.

    >>> import tempfile
    >>> print(missing_store(tempfile.gettempdir() + "/nope"))  # doctest: +ELLIPSIS
    no diskreplay store at .../nope (the path does not exist)
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.lexists(path):
        what = "the path does not exist"
    elif not os.path.isdir(path):
        what = "it is a file, not a directory"
    elif not os.listdir(path):
        what = "an empty directory"
    else:
        what = "a directory that holds no store; see docs/FORMAT.md"
    return StoreNotFoundError(f"no diskreplay store at {path} ({what})")


def require_store(path: PathLike) -> str:
    """``path`` made absolute, or :class:`StoreNotFoundError` when no store is there.

    Probes with a read-only open, which never creates anything. A store that
    is there but damaged passes (``verify`` and ``repair`` exist for it); only
    the absence of a store is refused.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> require_store(d)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    diskreplay.errors.StoreNotFoundError: no diskreplay store at ... (an empty directory)
    >>> ReplayStore(d).close(); require_store(d) == d
    True
    """
    path = os.path.abspath(os.fspath(path))
    if not is_store(path):
        raise missing_store(path)
    return path


def tree_size(path: str) -> int:
    """Bytes of the file at ``path``, or of every file under the directory ``path`` (a file removed
    meanwhile counts nothing)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def is_store(path: PathLike) -> bool:
    """Whether a store (possibly damaged) is at ``path``; probes with a read-only open, creating nothing.

    >>> import tempfile
    >>> is_store(tempfile.gettempdir() + "/no/such/store")
    False
    """
    try:
        ReplayStore(path, readonly=True).close()
    except FileNotFoundError:
        return False
    except DiskReplayError:
        pass  # a damaged store is still a store
    return True


class VersionView:
    """A store whose reads return named versions of some columns under the columns' own names.

    ``VersionView(store, {"rewards": "judge-v2"}).read(rows, ["rewards"])["rewards"]`` is
    ``store.read(rows, ["rewards@judge-v2"])["rewards@judge-v2"]`` ("not computed", NaN or null,
    where that version has no value); everything else is the store's. Exports, ``info`` and the
    curation tools take one wherever they take a store (:func:`open_store` pins it).

    >>> import tempfile
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [0, 0], "completion_ids": [[5], [7]], "rewards": [0.0, 1.0]})
    >>> _ = store.update([0], {"rewards": [0.5]}, version="judge-v2")
    >>> _ = store.update([0, 1], {"rewards": [0.25, 0.75]})
    >>> VersionView(store, {"rewards": "judge-v2"}).read([0, 1], ["rewards"])["rewards"].tolist()
    [0.5, nan]
    >>> VersionView(store, {"rewards": "nope"})
    Traceback (most recent call last):
    ...
    diskreplay.errors.ExportError: versions={'rewards': 'nope'}: column 'rewards' has no version 'nope' (its versions: ['judge-v2']); pass one of them ('diskreplay info' lists each column's versions)
    """

    def __init__(self, store: ReplayStore, versions: Mapping[str, str]) -> None:
        if not isinstance(versions, Mapping):
            raise ExportError(f"versions must map a column to a version name (e.g. {{'rewards': 'judge-v2'}}), got "
                              f"{versions!r}")
        for column, version in versions.items():
            if column not in store.columns:
                raise ExportError(f"versions={dict(versions)!r}: {column!r} is not a column of the store at "
                                  f"{store.path} (columns: {store.columns}); name a column that has versions")
            have = store.versions(column)
            if version not in have:
                raise ExportError(f"versions={dict(versions)!r}: column {column!r} has no version {version!r} (its "
                                  f"versions: {sorted(have)}); pass one of them ('diskreplay info' lists each "
                                  "column's versions)")
        self.store, self.versions = store, dict(versions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def __len__(self) -> int:
        return len(self.store)

    def _mapped(self, read: Any, rows: Any, columns: Optional[Sequence[str]], **kw: Any) -> Dict[str, Any]:
        names = list(self.store.columns if columns is None else columns)
        got = read(rows, list(dict.fromkeys(self._name(c) for c in names)), **kw)
        return {c: got[self._name(c)] for c in names}

    def _name(self, column: str) -> str:
        version = self.versions.get(column)
        return column if version is None else f"{column}@{version}"

    def read(self, rows: Any, columns: Optional[Sequence[str]] = None, **kw: Any) -> Dict[str, Any]:
        return self._mapped(self.store.read, rows, columns, **kw)

    def read_ranges(self, rows: Any, columns: Optional[Sequence[str]] = None) -> Dict[str, Any]:
        return self._mapped(self.store.read_ranges, rows, columns)

    def close(self) -> None:
        self.store.close()


@contextmanager
def open_store(store: Union[StoreLike, VersionView], versions: Optional[Mapping[str, str]] = None
               ) -> Iterator[ReplayStore]:
    """Yield a snapshot of ``store`` (a store or a path): pinned at its current commit, closed after.

    An export reads one commit from start to end, however long it takes and
    whatever a live writer does meanwhile (its files stay while they are
    retained). A path without a store raises :class:`StoreNotFoundError`;
    nothing is created. ``versions`` (column -> version name) yields a
    :class:`VersionView` of the snapshot, as does a ``VersionView`` given.
    """
    if isinstance(store, VersionView):
        versions, store = {**store.versions, **(versions or {})}, store.store
    if isinstance(store, ReplayStore):
        s = store.snapshot()
    else:
        try:
            with ReplayStore(store, readonly=True) as follower:
                s = follower.snapshot()
        except FileNotFoundError:
            raise missing_store(store) from None
    try:
        yield VersionView(s, versions) if versions else s
    finally:
        s.close()


# ---------------------------------------------------------------------------
# Row selection


def parse_version_range(text: Optional[str]) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """``"A:B"`` (inclusive; either end may be empty) or ``"A"`` as a (low, high) pair.

    >>> parse_version_range("3:7"), parse_version_range(":7"), parse_version_range("5")
    ((3, 7), (None, 7), (5, 5))
    """
    if text is None:
        return None
    text = str(text).strip()
    try:
        if ":" not in text:
            v = int(text)
            return (v, v)
        lo, hi = text.split(":", 1)
        out = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise ExportError(f"policy-version range must look like A:B, A: or :B with integers A <= B, got "
                          f"{text!r}") from None
    if out[0] is not None and out[1] is not None and out[0] > out[1]:
        raise ExportError(f"policy-version range {text!r} is empty: {out[0]} > {out[1]}")
    return out


@dataclass(frozen=True)
class RowFilter:
    """Which live rows an export keeps (all conditions must hold).

    ``policy_versions`` is an inclusive ``(low, high)`` range (``None`` ends
    are open) on ``version_key``; ``min_reward`` keeps rows whose reward
    (averaged over reward functions for a vector column) is ``>=`` it;
    ``limit`` keeps the first that many matching rows, oldest first.

    >>> RowFilter(min_reward=0.5).active
    True
    """

    policy_versions: Optional[Tuple[Optional[int], Optional[int]]] = None
    min_reward: Optional[float] = None
    limit: Optional[int] = None
    reward_key: str = "rewards"
    version_key: str = "policy_version"

    @property
    def active(self) -> bool:
        return self.policy_versions is not None or self.min_reward is not None

    def columns(self) -> List[str]:
        out = []
        if self.policy_versions is not None:
            out.append(self.version_key)
        if self.min_reward is not None:
            out.append(self.reward_key)
        return out

    def check(self, store: ReplayStore) -> None:
        if self.limit is not None and self.limit < 0:
            raise ExportError(f"limit must be a non-negative number of rows, got {self.limit}")
        for name in self.columns():
            if name not in store.columns:
                raise ExportError(f"cannot filter on column {name!r}: the store has no such column "
                                  f"(columns: {store.columns})")
            spec = store.schema[name]
            if spec.kind == RAGGED or spec.dtype in ("string", "bool"):
                raise ExportError(f"cannot filter on column {name!r}: it is a {spec.kind} column of "
                                  f"{spec.dtype}, not a number per row")

    def mask(self, data: Mapping[str, Any], n: int) -> np.ndarray:
        keep = np.ones(n, dtype=bool)
        if self.policy_versions is not None:
            v = per_row_value(data[self.version_key])
            lo, hi = self.policy_versions
            if lo is not None:
                keep &= v >= lo
            if hi is not None:
                keep &= v <= hi
        if self.min_reward is not None:
            keep &= per_row_value(data[self.reward_key]) >= self.min_reward
        return keep


def make_filter(policy_versions: Any = None, min_reward: Optional[float] = None, limit: Optional[int] = None,
                reward_key: str = "rewards") -> RowFilter:
    """A :class:`RowFilter` from user-facing options (``policy_versions`` as ``"A:B"`` or a pair).

    >>> make_filter("2:", 0.5).policy_versions
    (2, None)
    """
    if policy_versions is None or isinstance(policy_versions, str):
        pv = parse_version_range(policy_versions)
    else:
        lo, hi = policy_versions
        pv = (None if lo is None else int(lo), None if hi is None else int(hi))
    return RowFilter(pv, None if min_reward is None else float(min_reward),
                     None if limit is None else int(limit), reward_key)


def per_row_value(arr: np.ndarray) -> np.ndarray:
    """One float per row: a vector column (one value per reward function) is the mean of the values
    that are not NaN, as TRL and the samplers take it (a row no function scored stays NaN).

    >>> per_row_value(np.array([[1.0, 3.0], [0.0, 0.0], [1.0, np.nan]])).tolist()
    [2.0, 0.0, 1.0]
    """
    from ..samplers.kernels import reward_scalar  # the samplers' reduction: one rule for every reader

    return reward_scalar(arr)


def check_chunk_bytes(chunk_bytes: Any) -> int:
    """``chunk_bytes`` as a positive int, or :class:`ExportError` naming the option.

    >>> check_chunk_bytes(1 << 20)
    1048576
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)) or chunk_bytes <= 0:
        raise ExportError(f"chunk_bytes (--chunk-mb) must be a positive number of bytes, got {chunk_bytes!r}")
    return int(chunk_bytes)


def plan_chunks(store: ReplayStore, chunk_bytes: int = CHUNK_BYTES) -> List[List[Tuple[int, int]]]:
    """The live rows as chunks of about ``chunk_bytes``, each a list of ``[lo, hi)`` pieces.

    Every piece lies inside one segment (a read inside one segment is a
    single gather from one memory map, several times faster than one across
    segments); consecutive small segments share a chunk (a training loop
    commits many small ones) and a large one is split. Sizes come from the
    manifest, so planning reads no data. Pieces are contiguous, oldest first.
    """
    pieces: List[Tuple[int, int, float]] = []
    head = store.head
    for s in store.manifest.segments:
        lo, hi = max(s.first_row, head), s.end_row
        if hi <= lo:
            continue
        per_row = s.bytes / max(s.num_rows, 1)
        size = per_row * (hi - lo)
        k = max(1, int(-(-size // chunk_bytes)))
        step = -(-(hi - lo) // k)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            pieces.append((a, b, per_row * (b - a)))
    out: List[List[Tuple[int, int]]] = []
    acc = 0.0
    for a, b, size in pieces:
        if out and acc + size <= chunk_bytes:
            out[-1].append((a, b))
            acc += size
        else:
            out.append([(a, b)])
            acc = size
    return out


def recorded_exclusions(store: ReplayStore) -> Tuple[Tuple[int, int], ...]:
    """The live row ranges ``store`` records as excluded: the rows of a timeline a resumed run discarded.

    ``DiskReplayGRPOTrainer`` keeps them in the store's ``"trl.replay"`` state
    (rows committed after the checkpoint a run resumed from, by policies the
    resumed run never had); nothing else records any. Clipped to the live
    rows ``[head, next_row)``; empty when none are recorded.

    >>> import tempfile
    >>> with ReplayStore(tempfile.mkdtemp()) as s:
    ...     _ = s.extend({"prompt_id": [0, 0, 1, 1]})
    ...     recorded_exclusions(s)
    ()
    """
    from ..integrations.trl.checkpoint import STATE_NAME, ReplayState  # no TRL: the state's one reader

    raw = store.load_state(STATE_NAME)
    if raw is None:
        return ()
    try:
        timeline = ReplayState.from_dict(raw, f"{store.path} state {STATE_NAME!r}").timeline
    except DiskReplayError as exc:
        raise ExportError(f"{exc}; it records which rows a resumed run excluded: pass --include-excluded "
                          "(include_excluded=True) to use every row without reading it") from None
    head, end = store.head, store.next_row
    return tuple((max(a, head), min(b, end)) for a, b in timeline.excluded if min(b, end) > max(a, head))


class Exclusions:
    """The rows an export leaves out for a store's :func:`recorded_exclusions`, and how many it left out.

    ``include=True`` (``--include-excluded``) leaves nothing out; the ranges
    are still reported. ``left_out`` counts the rows :meth:`drop` removed.

    >>> e = Exclusions(((2, 4),))
    >>> e.drop(np.arange(6)).tolist(), e.left_out
    ([0, 1, 4, 5], 2)
    """

    def __init__(self, ranges: Tuple[Tuple[int, int], ...] = (), include: bool = False) -> None:
        self.ranges, self.include, self.left_out = tuple(ranges), bool(include), 0

    @classmethod
    def of(cls, store: ReplayStore, include: bool = False) -> "Exclusions":
        return cls(recorded_exclusions(store), include)

    def mask(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` are left out (none when included)."""
        from ..samplers import in_ranges

        return in_ranges(rows, () if self.include else self.ranges)

    def drop(self, rows: np.ndarray) -> np.ndarray:
        if self.include or not self.ranges or not len(rows):
            return rows
        out = self.mask(rows)
        self.left_out += int(out.sum())
        return rows[~out]

    def report(self) -> Dict[str, Any]:
        """What an export's result says: the live excluded ranges, their rows, whether they were included,
        and how many rows the export left out for them."""
        return {"ranges": [[a, b] for a, b in self.ranges], "rows": sum(b - a for a, b in self.ranges),
                "included": self.include, "left_out": self.left_out}


def iter_rows(store: ReplayStore, flt: Optional[RowFilter] = None, chunk_bytes: int = CHUNK_BYTES,
              bar: Any = None, excluded: Optional[Exclusions] = None) -> Iterator[List[np.ndarray]]:
    """Yield the ids of the selected live rows, oldest first: per chunk, one array per piece.
    ``excluded`` leaves its rows out (before ``limit`` counts) and counts the ones the filter kept."""
    flt = flt or RowFilter()
    flt.check(store)
    left = flt.limit
    for chunk in plan_chunks(store, chunk_bytes):
        check_interrupt()
        out = []
        for lo, hi in chunk:
            if left is not None and left <= 0:
                break
            rows = np.arange(lo, hi, dtype=np.int64)
            if flt.active:
                data = store.read(rows, flt.columns())
                rows = rows[flt.mask(data, len(rows))]
            if excluded is not None:
                rows = excluded.drop(rows)
            if left is not None:
                rows = rows[:left]
                left -= len(rows)
            if bar is not None:
                bar.update(hi - lo)
            if len(rows):
                out.append(rows)
        if out:
            yield out
        if left is not None and left <= 0:
            return


# ---------------------------------------------------------------------------
# Columns as Arrow


def column_to_arrow(spec: ColumnSpec, value: Any, n: int, large: bool = True, *, late: bool = False) -> pa.Array:
    """One column as returned by ``store.read`` as an Arrow array of the store's type.

    Ragged columns become ``large_list`` (``list`` when ``large`` is False),
    with null for a row that holds no value; strings ``large_string``. A
    ``late`` per-row column (added after the store's first commit: ``name in
    store.schema.late``) reads NaN where a row has no value; that is null here.

    >>> col = RaggedColumn.from_arrays([[1, 2], [3]], dtype=np.int32)
    >>> column_to_arrow(ColumnSpec("completion_ids", "ragged", "int32"), col, 2).to_pylist()
    [[1, 2], [3]]
    """
    t = spec.arrow_type
    if spec.kind == RAGGED:
        if not large:
            t = pa.list_(t.value_type)
        if value is None:
            return pa.nulls(n, type=t)
        col: RaggedColumn = value
        offsets = np.asarray(col.offsets, dtype=np.int64)
        if offsets[0] != 0:
            offsets = offsets - offsets[0]
            values = col.values[int(col.offsets[0]):int(col.offsets[-1])]
        else:
            values = col.values[:int(offsets[-1])]
        mask = None if col.validity is None else pa.array(~np.asarray(col.validity, dtype=bool))
        values = pa.array(np.ascontiguousarray(values), type=t.value_type)
        if large:
            return pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), values, mask=mask)
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), type=pa.int32()), values, mask=mask)
    if spec.dtype == "string":
        return pa.array(list(value), type=pa.large_string() if large else pa.string())
    arr = np.ascontiguousarray(value)
    missing = None
    if late and arr.dtype.kind == "f":
        nan = np.isnan(arr) if arr.ndim == 1 else np.isnan(arr).all(axis=1)
        missing = pa.array(nan) if nan.any() else None
    if spec.kind == VECTOR:
        return pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1), type=t.value_type), spec.width,
                                                 mask=missing)
    return pa.array(arr, type=t, mask=None if missing is None else np.asarray(missing))


def arrow_type(spec: ColumnSpec, large: bool = True) -> pa.DataType:
    t = spec.arrow_type
    if not large:
        if spec.kind == RAGGED:
            return pa.list_(t.value_type)
        if spec.dtype == "string":
            return pa.string()
    return t


def check_columns(store: ReplayStore, columns: Optional[Sequence[str]]) -> List[str]:
    """The store columns to export, in the order asked (default: all, schema order)."""
    if store.schema is None:
        raise ExportError(f"the store at {store.path} is empty (nothing was ever appended); nothing to export")
    if columns is None:
        return list(store.columns)
    if isinstance(columns, str):
        columns = [c for c in columns.split(",") if c]
    seen = []
    for c in columns:
        if c not in store.columns:
            raise ExportError(f"column {c!r} is not in the store (columns: {', '.join(store.columns)})")
        if c not in seen:
            seen.append(c)
    if not seen:
        raise ExportError("no columns selected; name at least one column")
    return seen


def export_metadata(store: ReplayStore, names: Sequence[str], **extra: Any) -> Dict[str, Any]:
    """The JSON document that lets ``import_rollouts`` rebuild an identical store."""
    schema: Schema = store.schema
    gk = store.group_key if store.group_key in names else None
    doc = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION,
           "schema": [schema[n].to_dict() for n in names], "group_key": gk,
           "capacity": store.capacity, "capacity_bytes": store.capacity_bytes,
           "source": store.path}
    doc.update(extra)
    return doc


def check_metadata(doc: Any, where: str) -> Optional[Dict[str, Any]]:
    """A validated export metadata document, or None when ``doc`` is None."""
    if doc is None:
        return None
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ExportError(f"Unsupported metadata in {where}: format {doc.get('format') if isinstance(doc, dict) else doc!r}; "
                          f"expected {EXPORT_FORMAT!r}")
    if doc.get("version") != EXPORT_VERSION:
        raise ExportError(f"Unsupported {EXPORT_FORMAT} version {doc.get('version')!r} in {where}; expected "
                          f"{EXPORT_VERSION} (written by a newer diskreplay?)")
    try:
        doc["schema_obj"] = Schema.from_list(doc["schema"])
    except (KeyError, ValueError) as exc:
        raise ExportError(f"Unsupported schema in {where}: {exc}") from None
    return doc


# ---------------------------------------------------------------------------
# Tokenizers (local directories only; never the hub)


class TextDecoder:
    """Decodes token-id rows to text with a tokenizer loaded from a local directory.

    Use :func:`load_tokenizer` to build one. :meth:`texts` is what a training
    set needs: prompt and completion text that the same tokenizer, as TRL's
    trainers call it (``tokenizer(prompt)``, ``tokenizer(prompt + completion)``),
    turns back into the stored ids.
    """

    def __init__(self, tokenizer: Any, kind: str, path: str, skip_special_tokens: bool = False) -> None:
        self.tokenizer, self.kind, self.path = tokenizer, kind, path
        self.skip_special_tokens = skip_special_tokens
        self.vocab = self._vocab_size()
        self._added: Optional[Tuple[List[int], List[int]]] = None
        # a fast transformers tokenizer encodes and decodes with its tokenizers backend: called directly it
        # does the same, without transformers' per-token conversions (5x the time of the work itself)
        backend = getattr(tokenizer, "backend_tokenizer", None) if kind == "transformers" else tokenizer
        self._backend = backend if hasattr(backend, "encode_batch") and hasattr(backend, "decode_batch") else None

    def _vocab_size(self) -> Optional[int]:
        """How many token ids the tokenizer knows, added tokens included (None if it does not say)."""
        try:
            if self.kind == "transformers":
                return len(self.tokenizer)
            return int(self.tokenizer.get_vocab_size(with_added_tokens=True))
        except Exception:  # noqa: BLE001 - a tokenizer object of another kind: no check
            return None

    def _check_ids(self, col: Optional[RaggedColumn], column: str) -> None:
        """An id the tokenizer does not know is an error: another model's tokenizer decodes them to empty text."""
        if col is None:
            return
        values = np.asarray(col.values)
        vocab = self.vocab
        if vocab is not None and values.size and int(values.max()) >= vocab:
            raise ExportError(f"column {column!r} holds token id {int(values.max())}, but the tokenizer at {self.path} knows "
                              f"{vocab} tokens: it is not the tokenizer these rollouts were made with; pass the "
                              "policy model's tokenizer directory")

    def _decode(self, rows: List[List[int]]) -> List[str]:
        if not rows:
            return []
        if self._backend is not None:
            return self._backend.decode_batch(rows, skip_special_tokens=self.skip_special_tokens)
        if self.kind == "transformers":
            return self.tokenizer.batch_decode(rows, skip_special_tokens=self.skip_special_tokens,
                                               clean_up_tokenization_spaces=False)
        return self.tokenizer.decode_batch(rows, skip_special_tokens=self.skip_special_tokens)

    def _encode(self, texts: List[str], special: bool) -> List[List[int]]:
        if not texts:
            return []
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=special)]
        if self.kind == "transformers":
            return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=special)["input_ids"]]
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=special)]

    def added_tokens(self) -> Tuple[List[int], List[int]]:
        """The ids the tokenizer puts before and after a text's own when it encodes (a BOS, say).

        A prompt's stored BOS left in its text would come back twice; these
        are left out of the text, and the tokenizer puts them back.
        """
        if self._added is None:
            self._added = ([], [])
            for probe in ("a", "0", "hello", " "):
                try:
                    body = self._encode([probe], False)[0]
                    full = self._encode([probe], True)[0]
                except Exception:  # noqa: BLE001 - a tokenizer that cannot encode the probe: try another
                    continue
                at = next((i for i in range(len(full) - len(body) + 1) if full[i:i + len(body)] == body), None)
                if body and at is not None:
                    self._added = (full[:at], full[at + len(body):])
                    break
        return self._added

    def decode(self, col: Optional[RaggedColumn], n: int, column: str = "token ids") -> List[Optional[str]]:
        """Text of each row of a ragged id column on its own (``None`` where the row has no value)."""
        if col is None:
            return [None] * n
        self._check_ids(col, column)
        rows = col.to_list()
        it = iter(self._decode([r for r in rows if r is not None]))
        return [None if r is None else next(it) for r in rows]

    def texts(self, prompt: Optional[RaggedColumn], completions: Sequence[Optional[RaggedColumn]], n: int,
              names: Sequence[str] = ()) -> Tuple[List[Optional[str]], List[List[Optional[str]]], np.ndarray]:
        """``(prompt texts, texts of each completion column, rows whose text does not give the ids back)``.

        A completion is decoded together with its prompt and its text is what
        the prompt's text leaves of the whole, so ``prompt + completion`` has
        the boundary the ids had (decoded apart, "w1" + "w2" became the unknown
        word "w1w2", and a BPE's leading space went missing). Special tokens
        stay (chat markers are part of what the model saw), except those the
        tokenizer adds itself when encoding (:meth:`added_tokens`: the prompt's
        BOS), which would come back twice. Then each row is encoded as a
        trainer does; the mask flags rows whose prompt, or prompt + a
        completion, does not give back the stored ids (the policy sampled a
        split the tokenizer never makes; ``skip_special_tokens`` drops tokens).
        A row without a prompt has its completion decoded alone and checked
        without added tokens.

        >>> from diskreplay.synthetic import char_tokenizer
        >>> dec = TextDecoder(char_tokenizer(), "transformers", "<char>")
        >>> p = RaggedColumn.from_arrays([[68, 69]], dtype=np.int32)
        >>> c = RaggedColumn.from_arrays([[70, 1]], dtype=np.int32)
        >>> dec.texts(p, [c], 1)
        (['ab'], [['c<eos>']], array([False]))
        """
        names = list(names) or ["prompt_ids"] + ["completion_ids"] * len(completions)
        self._check_ids(prompt, names[0])
        for col, name in zip(completions, names[1:]):
            self._check_ids(col, name)

        def listed(col: Optional[RaggedColumn]) -> List[Optional[List[int]]]:
            return [None] * n if col is None else col.to_list()

        head, tail = self.added_tokens()
        ps = listed(prompt)
        cs = [listed(c) for c in completions]
        bodies = [None if p is None else p[len(head):] if head and p[:len(head)] == head else p for p in ps]

        def drop_tail(c: List[int]) -> List[int]:
            return c[:-len(tail)] if tail and len(c) >= len(tail) and c[-len(tail):] == tail else c

        # one batch of decodes: each distinct prompt (a group's rows share theirs), then each completion
        # with its prompt (or alone)
        distinct = list(dict.fromkeys(tuple(b) for b in bodies if b is not None))
        wanted: List[List[int]] = [list(b) for b in distinct]
        for col in cs:
            for b, c in zip(bodies, col):
                if c is not None:
                    wanted.append(drop_tail(c) if b is None else b + drop_tail(c))
        it = iter(self._decode(wanted))
        decoded = {b: next(it) for b in distinct}
        prompt_text = [None if b is None else decoded[tuple(b)] for b in bodies]
        out: List[List[Optional[str]]] = []
        for col in cs:
            texts: List[Optional[str]] = []
            for b, c, p in zip(bodies, col, prompt_text):
                if c is None:
                    texts.append(None)
                    continue
                whole = next(it)
                if p is None:
                    texts.append(whole)
                elif whole.startswith(p):
                    texts.append(whole[len(p):])
                else:  # the prompt's text changes when a completion follows: decode the completion alone
                    texts.append(self._decode([drop_tail(c)])[0])
            out.append(texts)
        return prompt_text, out, self._mismatches(ps, cs, prompt_text, out, n)

    def _mismatches(self, ps: List[Optional[List[int]]], cs: List[List[Optional[List[int]]]],
                    prompt_text: List[Optional[str]], texts: List[List[Optional[str]]], n: int) -> np.ndarray:
        bad = np.zeros(n, dtype=bool)
        with_prompt = [i for i in range(n) if ps[i] is not None]
        # a group's rows share their prompt: each prompt text is encoded once
        unique = list(dict.fromkeys(prompt_text[i] for i in with_prompt))
        encoded = dict(zip(unique, self._encode(unique, True)))
        for i in with_prompt:
            bad[i] |= encoded[prompt_text[i]] != ps[i]
        for col, text in zip(cs, texts):
            both = [i for i in range(n) if col[i] is not None and ps[i] is not None]
            for i, ids in zip(both, self._encode([prompt_text[i] + text[i] for i in both], True)):
                bad[i] |= ids != ps[i] + col[i]
            alone = [i for i in range(n) if col[i] is not None and ps[i] is None]
            for i, ids in zip(alone, self._encode([text[i] for i in alone], False)):
                bad[i] |= ids != col[i]
        return bad


class Retokenized:
    """Counts the rows of a text export whose text does not give back their stored ids, and names a few.

    >>> r = Retokenized()
    >>> r.add(np.array([False, True]), ["row 7", "row 8"])
    >>> r.bad, r.total, r.warning("rows", "<dir>")[:40]
    (1, 2, '1 of 2 rows do not tokenize back to thei')
    """

    SHOWN = 5

    def __init__(self) -> None:
        self.bad, self.total, self.names = 0, 0, []  # type: ignore[var-annotated]

    def add(self, mask: np.ndarray, names: Sequence[str]) -> None:
        self.total += len(mask)
        hits = np.flatnonzero(mask)
        self.bad += len(hits)
        self.names += [names[i] for i in hits[:max(0, self.SHOWN - len(self.names))]]

    def warning(self, unit: str, path: str, skip_special_tokens: bool = False) -> Optional[str]:
        """The warning an export gives (None when every row gives its ids back)."""
        if not self.bad:
            return None
        more = ", ..." if self.bad > len(self.names) else ""
        why = ("--skip-special-tokens (skip_special_tokens) drops tokens the ids hold" if skip_special_tokens else
               "the policy sampled a split of the text the tokenizer does not make")
        return (f"{self.bad:,} of {self.total:,} {unit} do not tokenize back to their stored ids with the tokenizer at "
                f"{path} ({', '.join(self.names)}{more}): {why}, so a trainer tokenizing this text trains on "
                "other tokens there; the ids layout (no --tokenizer) keeps them exact")


def load_tokenizer(path: PathLike, skip_special_tokens: bool = False) -> TextDecoder:
    """Load a tokenizer from a local directory (no hub access).

    Uses ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``
    when transformers is installed, else ``tokenizers.Tokenizer.from_file(path/tokenizer.json)``.
    Raises ``ExportError`` when the directory does not load.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ExportError(f"tokenizer directory {path} does not exist; pass a local directory holding "
                          "tokenizer.json or a saved transformers tokenizer")
    errors = []
    have_tf = importlib.util.find_spec("transformers") is not None
    if have_tf:
        from transformers import AutoTokenizer

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            return TextDecoder(tok, "transformers", path, skip_special_tokens)
        except Exception as exc:  # transformers raises many kinds for a bad directory
            errors.append(f"transformers: {type(exc).__name__}: {exc}")
    tj = os.path.join(path, "tokenizer.json")
    try:
        tokenizers = importlib.import_module("tokenizers")
    except ImportError:
        if not have_tf:
            raise MissingDependencyError("decoding tokens needs transformers or tokenizers: pip install "
                                         "'diskreplay[trl]' (or pip install tokenizers)") from None
        tokenizers = None
    if tokenizers is not None:
        if os.path.exists(tj):
            try:
                return TextDecoder(tokenizers.Tokenizer.from_file(tj), "tokenizers", path, skip_special_tokens)
            except Exception as exc:
                errors.append(f"tokenizers: {exc}")
        else:
            errors.append(f"tokenizers: no tokenizer.json in {path}")
    raise ExportError(f"tokenizer directory {path} does not load ({'; '.join(errors)})")


def resolve_tokenizer(tokenizer: Any, skip_special_tokens: bool = False) -> Optional[TextDecoder]:
    """``None``, a :class:`TextDecoder`, a directory, or a loaded tokenizer object."""
    if tokenizer is None or isinstance(tokenizer, TextDecoder):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer, skip_special_tokens)
    if hasattr(tokenizer, "batch_decode"):
        return TextDecoder(tokenizer, "transformers", "<object>", skip_special_tokens)
    if hasattr(tokenizer, "decode_batch"):
        return TextDecoder(tokenizer, "tokenizers", "<object>", skip_special_tokens)
    raise ExportError(f"tokenizer must be a directory or a tokenizer object, got {type(tokenizer).__name__}")
