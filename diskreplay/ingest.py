"""Batch ingestion: whatever a training loop hands to ``extend``, as one Arrow record batch.

:func:`normalize_batch` turns TRL's padded tensors with masks, lists of 1-D
arrays, numpy arrays, Python lists or Arrow tables into one record batch of
unpadded columns of the store's schema (:mod:`diskreplay.schema`), or raises
``BatchError`` naming the column and row *before* anything touches the disk.

In the TRL layout a 2-D column is per-token when it has the shape of
``completion_ids`` (or, for ``prompt_*`` names, of ``prompt_ids``) or when its
name says so (contains ``logp``, ``logprob`` or ``token``); any other 2-D
column (and any whose name contains ``reward``) is a per-row vector. Once a
store has the column, its schema decides (a vector column stays one in a batch
whose completions happen to be as wide). Those are guesses for a caller who
does not say; a caller states a per-row vector by passing it as an Arrow
``fixed_size_list`` column, which is a vector whatever its name or shape
(``pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])``;
the TorchRL adapter passes every fixed-shape per-row tensor so).

>>> record, schema = normalize_batch({"completion_ids": [[1, 2], [3]]}, None, None)
>>> record.num_rows, schema.names
(2, ['completion_ids'])

One module: every input layout ``extend`` accepts (TRL's padded tensors, lists, numpy,
Arrow) is validated by the same checks into the same columns.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
import pyarrow as pa

from .errors import BatchError, BatchSchemaError
from .ragged import PerTokenTensor, arrow_array, dtype_range, numpy_view
from .schema import (COMPLETION_IDS, MASK_SUFFIX, MAX_COLUMN_NAME, PROMPT_IDS, RAGGED, SCALAR, VECTOR, ColumnSpec,
                     Media, Schema, check_late_column, media_spec, token_tensor_problem)

_INT32 = np.iinfo(np.int32)
_TOKEN_NAME_HINTS = ("logp", "logprob", "token")


# ---------------------------------------------------------------------------
# Input conversion


def _to_numpy(name: str, value: Any) -> Any:
    """A tensor or array as numpy; lists are returned as lists."""
    torch = sys.modules.get("torch")  # a tensor can only exist if torch was imported
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return t.cpu().numpy()
    if isinstance(value, (np.ndarray, _Ragged, PerTokenTensor, Media)):
        return value
    if isinstance(value, (list, tuple)):
        return list(value)
    if np.isscalar(value):
        raise BatchError(f"column {name!r} is a single {type(value).__name__}; expected one value per row")
    raise BatchError(f"column {name!r} has unsupported type {type(value).__name__}; expected a torch "
                     "tensor, numpy array or list")


def _is_sequence_row(x: Any) -> bool:
    return x is None or isinstance(x, (list, tuple, np.ndarray)) or hasattr(x, "detach")


def _has_sequence_rows(name: str, rows: list) -> bool:
    """Whether a list column is ragged (its rows are sequences, or None); raises if it mixes
    sequences with scalars. Decided per row type, not per row: a batch has thousands of rows."""
    kinds = {t: t is not type(None) and _is_sequence_row_type(t) for t in set(map(type, rows))}
    if not any(kinds.values()):
        return False
    if all(ok or t is type(None) for t, ok in kinds.items()):
        return True
    bad = next(i for i, x in enumerate(rows) if not _is_sequence_row(x))
    raise BatchError(f"column {name!r} row {bad} is a {type(rows[bad]).__name__} but other rows are "
                     "sequences; a ragged column needs a 1-D sequence (or None) in every row")


def _is_sequence_row_type(t: type) -> bool:
    return issubclass(t, (list, tuple, np.ndarray)) or hasattr(t, "detach")


@dataclass
class _Ragged:
    values: np.ndarray
    offsets: np.ndarray  # int64, starts at 0
    validity: Optional[np.ndarray]  # bool per row or None

    def __len__(self) -> int:
        return len(self.offsets) - 1


def _ragged_from_list(name: str, rows: list) -> _Ragged:
    # the common case (1-D numeric rows): one concatenate, no per-row Python work;
    # anything else (None rows, 2-D rows, strings, bf16 tensors) takes the checked path
    try:
        values = np.concatenate(rows) if rows else None
    except (ValueError, TypeError, RuntimeError):
        values = None
    if (values is not None and values.dtype.kind == "f" and list in set(map(type, rows))
            and any(type(r) is list and not r for r in rows)):
        values = None  # numpy makes [] float64, which would turn integer rows beside it into floats
    if values is not None and values.ndim == 1 and values.dtype.kind in "iubf":
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)), out=offsets[1:])
        if offsets[-1] == len(values):
            return _Ragged(values, offsets, None)
    arrays = []
    valid = np.ones(len(rows), dtype=bool)
    for i, r in enumerate(rows):
        if r is None:
            valid[i] = False
            arrays.append(None)
            continue
        a = _to_numpy(name, r)
        a = np.asarray(a)
        if a.ndim == 2 and a.shape[0] == 1:
            a = a[0]
        if a.ndim != 1:
            raise BatchError(f"column {name!r} row {i}: expected a 1-D sequence, got shape {a.shape}")
        if a.dtype == object:
            raise BatchError(f"column {name!r} row {i}: elements must be numbers")
        arrays.append(a)
    present = [a for a in arrays if a is not None]
    kinds = {a.dtype.kind for a in present if a.size}
    if "f" in kinds:
        dtype = np.result_type(*[a.dtype for a in present])
    elif kinds <= {"i", "u", "b"} and kinds:
        dtype = np.int64
    else:
        dtype = present[0].dtype if present else np.float32
    lengths = np.fromiter((0 if a is None else a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = (np.concatenate([a.astype(dtype, copy=False) for a in present])
              if present else np.zeros(0, dtype=dtype))
    return _Ragged(values, offsets, None if valid.all() else valid)


# ---------------------------------------------------------------------------
# Arrow input: a pyarrow Table / RecordBatch, or a mapping with pyarrow arrays as values


def _from_arrow(batch: Any) -> Any:
    """``batch`` with pyarrow tables and arrays turned into what the other layouts give: a
    table becomes a mapping of its columns; a list column a ragged column (its buffers, no row
    is visited in Python), a fixed-size list a 2-D array, any other column a 1-D array; a
    column that is null in every row is "not computed" (None)."""
    if isinstance(batch, (pa.Table, pa.RecordBatch)):
        names = batch.schema.names
        if len(set(names)) != len(names):
            twice = next(k for k in names if names.count(k) > 1)
            raise BatchError(f"column {twice!r} appears twice in the table; a batch has one column per name")
        batch = dict(zip(names, batch.columns))
    elif not isinstance(batch, Mapping) or not any(isinstance(v, _ARROW_VALUES) for v in batch.values()):
        return batch
    return {str(k): _arrow_column(str(k), v) if isinstance(v, _ARROW_VALUES) else v for k, v in batch.items()}


_ARROW_VALUES = (pa.Array, pa.ChunkedArray)


def _arrow_column(name: str, arr: Any) -> Any:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()
    if len(arr) and arr.null_count == len(arr):
        return None
    t = arr.type
    if pa.types.is_dictionary(t):
        return _arrow_column(name, arr.dictionary_decode())
    if pa.types.is_float16(t):  # as float32 whether or not it has nulls (the schema must not depend on them)
        return _arrow_column(name, arr.cast(pa.float32()))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _ragged_from_arrow(name, arr)
    if pa.types.is_fixed_size_list(t):
        if arr.null_count:
            raise BatchError(f"column {name!r} row {_first_null(arr)} is null; a per-row vector needs a value "
                             "in every row")
        child = arr.flatten()
        if child.null_count:
            raise BatchError(f"column {name!r} row {_first_null(child) // t.list_size} holds a null element; "
                             "a per-row vector holds numbers")
        return _arrow_numpy(name, child, t.value_type, numbers=True).reshape(len(arr), t.list_size)
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
            or pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise BatchError(f"column {name!r} has Arrow type {t}; a store holds numbers, bools, strings and "
                         "lists or fixed-size lists of numbers")
    if arr.null_count:
        if pa.types.is_floating(t):  # a late float column: a null (like NaN) is "not computed"
            return numpy_view(arr.fill_null(float("nan")))
        raise BatchError(f"column {name!r} row {_first_null(arr)} is null; per-row columns must hold a value "
                         "in every row")
    return _arrow_numpy(name, arr, t)


def _arrow_numpy(name: str, arr: pa.Array, t: pa.DataType, numbers: bool = False) -> np.ndarray:
    """``arr`` (no nulls) as numpy; strings as objects unless ``numbers`` (a list's elements)."""
    if not numbers and (pa.types.is_string(t) or pa.types.is_large_string(t)):
        try:
            return np.array(arr.to_pylist(), dtype=object)
        except UnicodeDecodeError as exc:
            raise BatchError(f"column {name!r} holds a string that is not UTF-8 ({exc.reason} at byte "
                             f"{exc.start})") from None
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise BatchError(f"column {name!r} holds Arrow {t} values; lists must hold numbers")
    if pa.types.is_float16(t):
        arr = arr.cast(pa.float32())
    return numpy_view(arr)  # not to_numpy, which imports pandas


def _first_null(arr: pa.Array) -> int:
    return int(np.argmax(numpy_view(arr.is_null())))


def _ragged_from_arrow(name: str, arr: pa.Array) -> _Ragged:
    """A list column's rows from its offsets and values (a null row: a row without a value)."""
    offsets = numpy_view(arr.offsets).astype(np.int64)  # of this (possibly sliced) array's rows
    start, end = int(offsets[0]), int(offsets[-1])
    child = arr.values.slice(start, end - start)
    values = _arrow_numpy(name, child, child.type, numbers=True)
    offsets = offsets - start
    child_valid = numpy_view(child.is_valid()) if child.null_count else None
    validity = None
    if arr.null_count:
        validity = numpy_view(arr.is_valid())
        lengths = np.diff(offsets)
        keep = np.repeat(validity, lengths)  # a null row may still span values: they are not its
        values = values[keep]
        if child_valid is not None:
            child_valid = child_valid[keep]
        lengths[~validity] = 0
        offsets = np.zeros(len(arr) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
    if child_valid is not None and not child_valid.all():
        bad = int(np.argmax(~child_valid))
        row = int(np.searchsorted(offsets, bad, side="right") - 1)
        raise BatchError(f"column {name!r} row {row} position {bad - int(offsets[row])} is null; the elements of "
                         "a row are numbers (a whole row may be null: not computed)")
    return _Ragged(values, offsets, validity)


def _one_record_batch(batch: Any) -> Optional[pa.RecordBatch]:
    """A pyarrow table of one chunk (or a record batch) with rows and columns, as a record batch;
    None for anything else."""
    if isinstance(batch, pa.Table):
        batches = batch.to_batches()
        batch = batches[0] if len(batches) == 1 else None
    if not isinstance(batch, pa.RecordBatch) or not batch.num_rows or not batch.num_columns:
        return None
    return batch


def _arrow_columns(batch: Any, schema: "Schema") -> Optional[Tuple[int, Dict[str, "_Column"]]]:
    """``_parse_columns`` for a record batch whose columns have exactly the store's types and no
    nulls: each column read from its buffers (:func:`_arrow_column`), its spec the schema's (no
    row visited, nothing inferred); None for anything else (the general path reads it).
    Validation and the arrays stored are the general path's, from these columns, so the file is
    the one a dict of the same rows gives."""
    batch = _one_record_batch(batch)
    if batch is None:
        return None
    names = batch.schema.names
    if len(set(names)) != len(names) or any(k.endswith(MASK_SUFFIX) and k[:-len(MASK_SUFFIX)] + "_ids" in names
                                           for k in names):
        return None  # the general path names the duplicate, or takes the mask for its ids
    cols: Dict[str, _Column] = {}
    for name, col in zip(names, batch.columns):
        spec = schema.columns.get(name)
        if spec is None or col.type != spec.arrow_type or col.null_count or spec.media:
            return None  # (a media column's rows come as Media, with their bytes)
        value = _arrow_column(name, col)  # its buffers read as the general path reads them
        cols[name] = _Column(spec, ragged=value) if spec.kind == RAGGED else _Column(spec, array=value)
    return batch.num_rows, cols


_PASSED_AS_IS = {pa.int64(), pa.float32(), pa.float64(), pa.large_list(pa.int32()), pa.large_list(pa.float32())}


def _arrow_record(batch: Any, schema: "Schema") -> Optional[pa.RecordBatch]:
    """The record batch stored for one that holds exactly the store's columns, of its numeric
    types, without nulls, slices or late columns: its own arrays (nothing read into numpy or
    built again), once float lists are checked for NaN and aligned lists for equal lengths.
    None for anything else (:func:`_arrow_columns`, then the general path, read it and name any
    problem). The same file bytes as the general path gives: Arrow's IPC writer writes no
    validity bitmap for an array without nulls, and lists from offset 0.

    Every check reads the arrays' buffers (one ``buffers()`` call a column): this runs on every
    small commit of Arrow input, where per-array accessors and numpy views would cost more than
    the commit's encoding.
    """
    batch = _one_record_batch(batch)
    if batch is None or schema.late:
        return None
    stored = schema.arrow_schema()
    types_match = batch.schema.equals(stored, check_metadata=True)  # the batch is then stored as it is
    if not types_match and batch.schema.names != list(schema.names):
        return None
    n = batch.num_rows
    offsets: Dict[str, pa.Buffer] = {}
    for spec, col in zip(schema.columns.values(), batch.columns):
        t = col.type
        if t not in _PASSED_AS_IS or not types_match and t != spec.arrow_type:
            return None
        if col.offset:
            return None
        # no validity bitmaps, buffers of exactly these rows (the IPC writer writes a buffer whole:
        # a slice of a longer table would give another file, and another exactly-once digest)
        bufs = col.buffers()
        if bufs[0] is not None:
            return None
        if spec.kind != RAGGED:
            if bufs[1].size != n * (t.bit_width // 8):
                return None
            continue
        off_buf, values_buf = bufs[1], bufs[3]
        if bufs[2] is not None or off_buf.size != 8 * (n + 1):
            return None
        off = np.frombuffer(off_buf, dtype=np.int64)
        total = int(off[-1])
        values = col.values
        if off[0] or values.offset or len(values) != total or values_buf.size != 4 * total:
            return None
        if spec.dtype == "float32" and total and np.isnan(
                np.add.reduce(np.frombuffer(values_buf, dtype=np.float32), dtype=np.float64)):
            return None  # (the general path names the row)
        offsets[spec.name] = off_buf
    for name, off_buf in offsets.items():
        align = schema[name].align
        ref = None if align is None else offsets.get(PROMPT_IDS if align == "prompt" else COMPLETION_IDS)
        if ref is not None and not off_buf.equals(ref):
            return None
    if types_match:
        return batch
    return pa.RecordBatch.from_arrays(batch.columns, schema=stored)


def _check_mask(name: str, mask: np.ndarray, ids_shape: Tuple[int, ...]) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.shape != ids_shape:
        raise BatchError(f"column {name!r} has shape {mask.shape} but its ids have shape {ids_shape}; "
                         "a mask must have exactly the shape of its ids")
    if mask.dtype == bool:
        return mask
    if mask.dtype.kind not in "iuf":
        raise BatchError(f"column {name!r} has dtype {mask.dtype}; expected 0/1 ints or bools")
    bad = (mask != 0) & (mask != 1)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise BatchError(f"column {name!r} row {r} position {c} holds {mask[r, c].item()!r}; "
                         "a mask must hold only 0 and 1")
    return mask.astype(bool)


def _ragged_from_padded(name: str, padded: np.ndarray, mask: Optional[np.ndarray]) -> _Ragged:
    b = padded.shape[0]
    if mask is None:
        lengths = np.full(b, padded.shape[1], dtype=np.int64)
        values = padded.reshape(-1)
    else:
        lengths = mask.sum(axis=1, dtype=np.int64)
        values = padded[mask]
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return _Ragged(np.ascontiguousarray(values), offsets, None)


def _name_says_token(name: str) -> bool:
    low = name.lower()
    return any(h in low for h in _TOKEN_NAME_HINTS)


def _infer_scalar_dtype(name: str, arr: np.ndarray) -> str:
    k = arr.dtype.kind
    if k == "b":
        return "bool"
    if k in "iu":
        return "int64"
    if k == "f":
        return "float32" if arr.dtype == np.float32 else "float64"
    if k in "UO":
        return "string"
    raise BatchError(f"column {name!r} has unsupported dtype {arr.dtype}")


def _scalar_array(name: str, values: Any) -> np.ndarray:
    if isinstance(values, list):
        if any(v is None for v in values):
            i = next(i for i, v in enumerate(values) if v is None)
            raise BatchError(f"column {name!r} row {i} is None; per-row columns must hold a value in every row")
        if values and all(isinstance(v, str) for v in values):
            return np.array(values, dtype=object)
        if any(isinstance(v, str) for v in values):
            i = next(i for i, v in enumerate(values) if not isinstance(v, str))
            raise BatchError(f"column {name!r} row {i} is {type(values[i]).__name__} but other rows are strings")
        try:
            arr = np.asarray([_to_numpy(name, v) if hasattr(v, "detach") else v for v in values])
        except ValueError as exc:
            raise BatchError(f"column {name!r}: rows have different shapes ({exc})") from None
    else:
        arr = values
    if arr.dtype == object:
        bad = next((i for i, v in enumerate(arr.reshape(len(arr), -1)[:, 0]) if not isinstance(v, str)), None)
        if bad is not None:
            raise BatchError(f"column {name!r} row {bad} holds {type(arr[bad]).__name__}; expected numbers or strings")
    return arr


class _Column:
    """One validated input column, before it is matched to a schema."""

    __slots__ = ("spec", "ragged", "array")

    def __init__(self, spec: ColumnSpec, ragged: Optional[_Ragged] = None,
                 array: Optional[np.ndarray] = None) -> None:
        self.spec, self.ragged, self.array = spec, ragged, array


def _lengths(r: _Ragged) -> np.ndarray:
    return np.diff(r.offsets)


def _arrow_vectors(batch: Any) -> frozenset:
    """Names of ``batch``'s Arrow ``fixed_size_list`` columns: the caller said they are per-row vectors
    (the type says it, where a 2-D array would leave the role to be guessed from the name and shape)."""
    if isinstance(batch, (pa.Table, pa.RecordBatch)):
        items = zip(batch.schema.names, batch.schema.types)
    elif isinstance(batch, Mapping):
        items = ((k, v.type) for k, v in batch.items() if isinstance(v, _ARROW_VALUES))
    else:
        return frozenset()
    return frozenset(str(k) for k, t in items if pa.types.is_fixed_size_list(t))


def _parse_columns(batch: Mapping[str, Any], schema: Optional["Schema"] = None) -> Tuple[int, Dict[str, _Column]]:
    vectors = _arrow_vectors(batch)
    batch = _from_arrow(batch)
    if not isinstance(batch, Mapping):
        kind = type(batch).__name__
        fix = {"Dataset": "; pass a datasets split as a pyarrow Table: ds.with_format('arrow')[:]",
               "DataFrame": "; pass a pandas DataFrame as pyarrow.Table.from_pandas(df, preserve_index=False)"
               }.get(kind, "")
        raise BatchError(f"a batch must be a mapping of column name to values (or a pyarrow Table), got {kind}{fix}")
    for k in batch:
        if not isinstance(k, str):  # str(5) and "5" would be one column, one of them silently dropped
            raise BatchError(f"column names are strings; the batch has {k!r} ({type(k).__name__}): name the "
                             f"column {str(k)!r}")
    # a column that is None, or None in every row, was "not computed"
    raw = {str(k): v for k, v in batch.items()
           if v is not None and not (isinstance(v, (list, tuple)) and v and all(x is None for x in v))}
    if not raw:
        raise BatchError("the batch is empty: it has no columns with values")
    arrays = {k: _to_numpy(k, v) for k, v in raw.items()}
    # masks belong to "<prefix>_ids"; anything else ending in _mask is data
    masks = {}
    for k in list(arrays):
        if k.endswith(MASK_SUFFIX) and (k[: -len(MASK_SUFFIX)] + "_ids") in arrays:
            masks[k[: -len(MASK_SUFFIX)] + "_ids"] = arrays.pop(k)
    for ids_name in (PROMPT_IDS, COMPLETION_IDS):  # TRL's masks: never data, even without their ids
        mask_name = ids_name[:-4] + MASK_SUFFIX
        if mask_name in arrays:
            raise BatchError(f"column {mask_name!r} is the padding mask of {ids_name!r}, which the batch lacks "
                             f"(columns given: {sorted(raw)})")
    if not arrays:
        raise BatchError("the batch holds only masks and no data columns")

    sizes = {k: len(v) for k, v in arrays.items()}
    n = next(iter(sizes.values()))
    for k, s in sizes.items():
        if s != n:
            first = next(iter(sizes))
            raise BatchError(f"column {k!r} has {s} rows but column {first!r} has {n}; "
                             "every column needs one entry per row")
    for ids_name, m in masks.items():
        if len(m) != n:
            raise BatchError(f"column {ids_name[:-4] + MASK_SUFFIX!r} has {len(m)} rows, expected {n}")
    if n == 0:
        raise BatchError("the batch is empty: it has 0 rows")

    cols: Dict[str, _Column] = {}
    ids_shape: Dict[str, Tuple[int, ...]] = {}
    bool_masks: Dict[str, np.ndarray] = {}
    for ids_name in (PROMPT_IDS, COMPLETION_IDS):
        v = arrays.get(ids_name)
        if isinstance(v, np.ndarray) and v.ndim == 2:
            ids_shape[ids_name] = v.shape
            if ids_name in masks:
                bool_masks[ids_name] = _check_mask(ids_name[:-4] + MASK_SUFFIX, _to_numpy("", masks[ids_name]), v.shape)
    for ids_name, m in masks.items():
        if ids_name not in bool_masks:
            v = arrays[ids_name]
            if isinstance(v, np.ndarray) and v.ndim == 2:
                bool_masks[ids_name] = _check_mask(ids_name[:-4] + MASK_SUFFIX, _to_numpy("", m), v.shape)
            else:
                raise BatchError(f"column {ids_name[:-4] + MASK_SUFFIX!r} is given but {ids_name!r} is not a "
                                 "padded 2-D tensor; masks only apply to the padded (TRL) layout")

    for name, v in arrays.items():
        known = schema.columns.get(name) if schema is not None else None
        if isinstance(v, Media) or (known is not None and known.media):
            if not isinstance(v, Media):
                raise BatchError(f"column {name!r} is a media column: pass its rows as diskreplay.Media(values, "
                                 "mime=...) (bytes or arrays), which stores each content once")
            cols[name] = _Column(media_spec(name), array=v.blobs(name)[0])
            continue
        if isinstance(v, PerTokenTensor) or (known is not None and known.shape is not None):
            cols[name] = _token_tensor_column(name, v, known)
            continue
        align = "prompt" if name.startswith("prompt_") else (
            "completion" if COMPLETION_IDS in arrays else None)
        if isinstance(v, np.ndarray) and v.ndim >= 2:
            if v.ndim > 2:
                raise BatchError(f"column {name!r} has shape {v.shape}; at most 2 dimensions are supported")
            ref = PROMPT_IDS if name.startswith("prompt_") else COMPLETION_IDS
            own_ids = name in (PROMPT_IDS, COMPLETION_IDS) or name in bool_masks
            known = schema.columns.get(name) if schema is not None else None
            if name in vectors and not own_ids:
                is_token = False  # stated by its type; a store holding it per-token refuses it below
            elif known is not None and not own_ids:
                is_token = known.kind == RAGGED  # the store settled it (a vector may be as wide as the ids)
            else:
                is_token = own_ids or _name_says_token(name) or (
                    ref in ids_shape and v.shape == ids_shape[ref] and "reward" not in name.lower())
            if is_token:
                if own_ids:
                    mask, col_align = bool_masks.get(name), None
                else:
                    if ref not in arrays:
                        raise BatchError(f"column {name!r} is a padded per-token tensor {tuple(v.shape)} but the "
                                         f"batch has no {ref!r} (with its mask) to strip the padding with; pass "
                                         f"{ref!r}, or the rows as a list of 1-D arrays")
                    if ref in ids_shape and v.shape != ids_shape[ref]:
                        raise BatchError(f"column {name!r} has shape {v.shape} but {ref!r} has shape "
                                         f"{ids_shape[ref]}; a per-token column must match its ids")
                    mask, col_align = bool_masks.get(ref), _align_for(name, align, arrays)
                r = _ragged_from_padded(name, v, mask)
                cols[name] = _Column(ColumnSpec(name, RAGGED, _ragged_dtype(name, r.values), align=col_align),
                                     ragged=r)
            else:
                arr = v
                dt = _infer_scalar_dtype(name, arr)
                if dt == "string":
                    raise BatchError(f"column {name!r}: a per-row vector must be numeric")
                cols[name] = _Column(ColumnSpec(name, VECTOR, dt, width=int(arr.shape[1])), array=arr)
        elif isinstance(v, _Ragged) or isinstance(v, list) and _has_sequence_rows(name, v):
            r = v if isinstance(v, _Ragged) else _ragged_from_list(name, v)
            cols[name] = _Column(ColumnSpec(name, RAGGED, _ragged_dtype(name, r.values),
                                            align=_align_for(name, align, arrays)), ragged=r)
        else:
            arr = _scalar_array(name, v)
            if arr.ndim == 2 and arr.dtype != object:
                dt = _infer_scalar_dtype(name, arr)
                cols[name] = _Column(ColumnSpec(name, VECTOR, dt, width=int(arr.shape[1])), array=arr)
            else:
                cols[name] = _Column(ColumnSpec(name, SCALAR, _infer_scalar_dtype(name, arr)), array=arr)
        if name in (PROMPT_IDS, COMPLETION_IDS) and cols[name].spec.kind != RAGGED:
            raise BatchError(f"column {name!r} holds one {cols[name].spec.dtype} per row; token ids are a "
                             "sequence of integers per row (a padded [B, L] tensor or a list of 1-D arrays)")
    return n, cols


def _token_tensor_column(name: str, v: Any, known: Optional[ColumnSpec]) -> "_Column":
    """A per-token tensor column (:class:`PerTokenTensor`, or rows of a column the store declared so)
    as flat values, ``prod(shape)`` per token; range and alignment are checked with the schema's."""
    if isinstance(v, _Ragged):  # Arrow input: the stored layout, flat already
        return _Column(known, ragged=v)
    if not isinstance(v, PerTokenTensor):
        v = PerTokenTensor(v, known.dtype, align=known.align, fill=known.fill, shape=known.shape)
    values = _to_numpy(name, v.values) if not isinstance(v.values, list) else v.values
    shape = v.shape
    if isinstance(values, np.ndarray):  # padded [B, T, *shape]
        if values.ndim < 3:
            raise BatchError(f"column {name!r} is a padded per-token tensor of shape {values.shape}; expected "
                             "[B, T, *shape] (one [*shape] tensor per token) or a list of [n_tokens, *shape] rows")
        b, t = values.shape[:2]
        lengths = (np.full(b, t, dtype=np.int64) if v.lengths is None
                   else np.asarray(_to_numpy(name + " lengths", v.lengths), dtype=np.int64).reshape(-1))
        if len(lengths) != b or (lengths < 0).any() or (lengths > t).any():
            raise BatchError(f"column {name!r}: lengths must give 0 to {t} tokens for each of its {b} rows, got "
                             f"{lengths.tolist()[:8]}")
        rows_shape = tuple(values.shape[2:])
        flat = values[np.arange(t) < lengths[:, None]]
        validity = None
    else:
        present = []
        lengths = np.zeros(len(values), dtype=np.int64)
        validity = np.ones(len(values), dtype=bool)
        rows_shape = shape
        for i, row in enumerate(values):
            if row is None:
                validity[i] = False
                continue
            a = np.asarray(_to_numpy(name, row) if not isinstance(row, list) else row)
            if rows_shape is None and a.ndim >= 2:
                rows_shape = tuple(a.shape[1:])
            if a.ndim < 2 or tuple(a.shape[1:]) != rows_shape:
                raise BatchError(f"column {name!r} row {i} has shape {a.shape}; a per-token tensor row is "
                                 f"[n_tokens, *{list(rows_shape or ('shape',))}]")
            lengths[i] = a.shape[0]
            present.append(a)
        if rows_shape is None:
            raise BatchError(f"column {name!r} has no row with a value; give shape= to PerTokenTensor")
        flat = np.concatenate(present) if present else np.zeros((0,) + rows_shape, dtype=np.int64)
        validity = None if validity.all() else validity
    if shape is not None and tuple(rows_shape) != shape:
        raise BatchError(f"column {name!r} holds tensors of shape {list(rows_shape)} per token but its declared "
                         f"shape is {list(shape)}")
    if flat.dtype.kind not in "iu" and flat.size:
        raise BatchError(f"column {name!r} holds {flat.dtype} values; a per-token tensor holds integers "
                         f"(stored as {v.dtype})")
    spec = ColumnSpec(name, RAGGED, v.dtype, align=v.align, shape=tuple(int(x) for x in rows_shape), fill=v.fill)
    why = token_tensor_problem(spec)
    if why is not None:
        raise BatchError(f"column {name!r} is not a valid per-token tensor: {why}")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths * spec.token_size, out=offsets[1:])
    return _Column(spec, ragged=_Ragged(np.ascontiguousarray(flat).reshape(-1), offsets, validity))


def _token_counts(spec: ColumnSpec, r: _Ragged) -> np.ndarray:
    """Tokens per row of a per-token tensor column (each row holds a whole number of tensors)."""
    per = spec.token_size
    lengths = _lengths(r)
    if per == 1:
        return lengths
    bad = lengths % per != 0
    if bad.any():
        i = int(np.argmax(bad))
        raise BatchError(f"column {spec.name!r} row {i} holds {int(lengths[i])} values, not a whole number of "
                         f"{list(spec.shape)} tensors ({per} values each)")
    return lengths // per


def _coerce_token_tensor(spec: ColumnSpec, r: _Ragged) -> np.ndarray:
    _token_counts(spec, r)
    v = r.values
    if not v.size:
        return v.astype(spec.dtype, copy=False)
    if v.dtype.kind not in "iu":
        raise BatchError(f"column {spec.name!r} holds {v.dtype} values; a per-token tensor holds integers "
                         f"(stored as {spec.dtype})")
    lo, hi = dtype_range(spec.dtype)
    if int(v.min()) < lo or int(v.max()) > hi:
        bad = int(np.argmax((v < lo) | (v > hi)))
        row, k = _value_at(r.offsets, bad)
        token, at = divmod(k, spec.token_size)
        where = list(np.unravel_index(at, spec.shape))
        raise BatchError(f"column {spec.name!r} row {row} token {token} holds {v[bad].item()} at {[int(x) for x in where]}, "
                         f"outside {spec.dtype} [{lo}, {hi}]; it would be stored as a different value: declare a "
                         "wider dtype (uint16 holds expert ids up to 65535) or check the values")
    return v.astype(spec.dtype, copy=False)


def _align_for(name: str, align: Optional[str], arrays: Mapping[str, Any]) -> Optional[str]:
    if name in (PROMPT_IDS, COMPLETION_IDS):
        return None
    if align == "prompt" and PROMPT_IDS not in arrays:
        return None
    return align


def _ragged_dtype(name: str, values: np.ndarray) -> str:
    k = values.dtype.kind
    ids = name in (PROMPT_IDS, COMPLETION_IDS)
    if k == "b" and ids and values.size:
        raise BatchError(f"column {name!r} holds booleans; token ids must be integers (a mask passed as the ids?)")
    if k in "iub" or (values.size == 0 and ids):  # [] is float64 to numpy
        return "int32"
    if ids:
        # float ids would be stored as float32 and come back from collate as floats
        what = "floats" if k == "f" else "strings" if k in "US" else f"values of type {values.dtype}"
        raise BatchError(f"column {name!r} holds {what} ({values.dtype}); token ids must be integers "
                         "(cast them, e.g. ids.long(); text is tokenized first)")
    if k == "f":
        return "float32"
    raise BatchError(f"column {name!r} has dtype {values.dtype}; ragged columns hold numbers")


# ---------------------------------------------------------------------------
# Matching against the schema and building Arrow arrays


def _coerce_ragged(spec: ColumnSpec, r: _Ragged) -> np.ndarray:
    if spec.shape is not None:
        return _coerce_token_tensor(spec, r)
    v = r.values
    if spec.dtype == "int32":
        if v.dtype.kind == "f" and v.size:
            what = ("a loss mask holds 0 and 1" if spec.name in LOSS_MASKS else "token ids must be integers"
                    if spec.name in (PROMPT_IDS, COMPLETION_IDS) else "the store holds integers there")
            raise BatchError(f"column {spec.name!r} holds floats ({v.dtype}); {what}")
        if v.size and v.dtype.itemsize > 4 or v.dtype.kind == "u" and v.dtype.itemsize >= 4:
            lo, hi = (int(v.min()), int(v.max())) if v.size else (0, 0)
            if lo < _INT32.min or hi > _INT32.max:
                bad = int(np.argmax((v < _INT32.min) | (v > _INT32.max)))
                row = int(np.searchsorted(r.offsets, bad, side="right") - 1)
                raise BatchError(f"column {spec.name!r} row {row} holds {v[bad]}, outside int32; token ids "
                                 "must fit in int32")
        return v.astype(np.int32, copy=False)
    if v.dtype.kind not in "f" and v.size:
        raise BatchError(f"column {spec.name!r} holds {v.dtype} values; expected floats (e.g. log-probs)")
    with np.errstate(over="ignore"):  # a float64 beyond float32 is refused below, by name
        out = v.astype(np.float32, copy=False)
    # a NaN anywhere makes the sum NaN, an infinity (or a float64 the cast made one) inf: then look closer
    if out.size and not np.isfinite(np.add.reduce(out)):
        nan = np.isnan(out)
        if nan.any():
            bad = int(np.argmax(nan))
            row = int(np.searchsorted(r.offsets, bad, side="right") - 1)
            raise BatchError(f"column {spec.name!r} row {row} position {bad - int(r.offsets[row])} is NaN; "
                             "per-token values must be numbers")
        if v.dtype.itemsize > 4:
            over = np.isinf(out) & np.isfinite(v)
            if over.any():
                bad = int(np.argmax(over))
                row = int(np.searchsorted(r.offsets, bad, side="right") - 1)
                raise BatchError(f"column {spec.name!r} row {row} position {bad - int(r.offsets[row])} holds "
                                 f"{v[bad].item()!r}, which float32 (the store's type there) cannot hold; it would "
                                 "be stored as a different value")
    return out


_TYPE_FIX = "; convert the column to the store's type (a column's type never changes once stored)"


def _coerce_array(spec: ColumnSpec, arr: np.ndarray) -> np.ndarray:
    want = spec.dtype
    k = arr.dtype.kind
    if want == "string":
        if arr.dtype != object and k != "U":
            raise BatchSchemaError(f"column {spec.name!r} holds {arr.dtype} but the store holds strings there"
                                   + _TYPE_FIX)
        return arr
    if k in "UO":
        raise BatchSchemaError(f"column {spec.name!r} holds strings but the store holds {want} there" + _TYPE_FIX)
    if want == "bool" and k != "b":
        raise BatchSchemaError(f"column {spec.name!r} holds {arr.dtype} but the store holds bools there" + _TYPE_FIX)
    if want == "int64" and k not in "iu":
        raise BatchSchemaError(f"column {spec.name!r} holds {arr.dtype} but the store holds integers there"
                               + _TYPE_FIX)
    if want in ("float32", "float64") and k not in "fiu":
        raise BatchSchemaError(f"column {spec.name!r} holds {arr.dtype} but the store holds floats there" + _TYPE_FIX)
    if want == "int64" and k == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > _INT64_MAX:
        _out_of_range(spec, arr, arr > _INT64_MAX, "int64")  # would wrap to a negative key or version
    if want == "float32" and arr.dtype.itemsize > 4 and arr.size:
        with np.errstate(invalid="ignore"):
            big = np.abs(arr) > _FLOAT32_MAX  # NaN compares False; inf stays inf
        if big.any():
            _out_of_range(spec, arr, big & np.isfinite(arr), "float32")
    return arr.astype(want, copy=False)


_INT64_MAX = np.iinfo(np.int64).max
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _out_of_range(spec: ColumnSpec, arr: np.ndarray, bad: np.ndarray, dtype: str) -> None:
    if not bad.any():
        return
    flat = int(np.argmax(bad.reshape(-1)))
    row = flat // (arr.size // len(arr)) if arr.ndim > 1 else flat
    raise BatchError(f"column {spec.name!r} row {row} holds {arr.reshape(-1)[flat].item()!r}, which {dtype} (the store's "
                     f"type there) cannot hold; it would be stored as a different value")


def _arrow_array(spec: ColumnSpec, col: Optional[_Column], n: int, late: bool = False) -> pa.Array:
    t = spec.arrow_type
    if col is None:
        return pa.nulls(n, type=t)
    if spec.kind == RAGGED:
        r = col.ragged
        values = _coerce_ragged(spec, r)
        offsets = np.ascontiguousarray(r.offsets, dtype=np.int64)
        # from the buffers: the offsets were made here (a cumsum from 0 ending at len(values)), so
        # from_arrays' checks of them cost a third of converting a small batch for nothing
        validity = None if r.validity is None else pa.py_buffer(np.packbits(r.validity, bitorder="little"))
        # the values are the item type now (int32 or float32): their buffer as it is
        items = pa.Array.from_buffers(t.value_type, len(values), [None, pa.py_buffer(np.ascontiguousarray(values))])
        return pa.Array.from_buffers(t, n, [validity, pa.py_buffer(offsets)], children=[items],
                                     null_count=-1 if validity is None else int(n - r.validity.sum()))
    arr = _coerce_array(spec, col.array)
    # a late float column reads NaN in rows without a value, so NaN given for a row is stored as "not computed"
    missing = _late_missing(arr) if late else None
    if spec.kind == SCALAR and missing is None and arr.dtype.kind in "if" and arr.ndim == 1:
        return pa.Array.from_buffers(t, n, [None, pa.py_buffer(np.ascontiguousarray(arr))])  # arr is t's dtype
    if spec.kind == VECTOR:
        return pa.FixedSizeListArray.from_arrays(arrow_array(arr), spec.width,
                                                 mask=None if missing is None else arrow_array(missing))
    out = arrow_array(list(arr) if spec.dtype == "string" else arr, mask=missing)
    return out if out.type == t else out.cast(t)


def _late_missing(arr: np.ndarray) -> Optional[np.ndarray]:
    """Rows of a late per-row float column that are NaN (a vector's: all NaN), or None if there are none."""
    if arr.dtype.kind != "f":
        return None
    nan = np.isnan(arr) if arr.ndim == 1 else np.isnan(arr).all(axis=1)
    return nan if nan.any() else None


#: per-token loss masks inside a completion (TRL's ``tool_mask``, verl's ``loss_mask``): 1 where the
#: token is the policy's, 0 where a tool or the environment wrote it
LOSS_MASKS = ("tool_mask", "loss_mask")


def _check_loss_masks(record: pa.RecordBatch) -> None:
    """A loss mask (:data:`LOSS_MASKS`) holds only 0 and 1."""
    for name in LOSS_MASKS:
        i = record.schema.get_field_index(name)
        if i < 0 or not pa.types.is_large_list(record.schema.field(i).type):
            continue
        col = record.column(i)
        values = col.flatten().to_numpy(zero_copy_only=False)
        bad = (values != 0) & (values != 1)
        if bad.any():
            offsets = np.asarray(col.offsets)
            at = int(np.argmax(bad))
            row, token = _value_at(offsets, at + int(offsets[0]))
            raise BatchError(f"column {name!r} row {row} token {token} holds {values[at].item()!r}; "
                             "a loss mask holds 1 for the policy's tokens and 0 for tool or environment tokens")


def _value_at(offsets: np.ndarray, k: int) -> Tuple[int, int]:
    """(row, position in the row) of value ``k`` of a list column with these ``offsets``."""
    row = int(np.searchsorted(offsets, k, side="right") - 1)
    return row, k - int(offsets[row])


def _check_alignment(n: int, cols: Mapping[str, _Column], schema: Schema) -> None:
    for name, col in cols.items():
        spec = schema[name]
        if spec.kind != RAGGED or spec.align is None:
            continue
        if spec.shape is not None:
            _check_token_tensor_alignment(spec, col.ragged, cols)
            continue
        ref = PROMPT_IDS if spec.align == "prompt" else COMPLETION_IDS
        if ref not in cols:
            continue
        if np.array_equal(col.ragged.offsets, cols[ref].ragged.offsets):  # both from 0: the same lengths
            continue
        a, b = _lengths(col.ragged), _lengths(cols[ref].ragged)
        va = col.ragged.validity
        mismatch = (a != b) if va is None else ((a != b) & va)
        if mismatch.any():
            i = int(np.argmax(mismatch))
            raise BatchError(f"column {name!r} row {i} has {a[i]} values but {ref!r} has {b[i]} tokens; "
                             "per-token columns must align with their ids")


def _check_token_tensor_alignment(spec: ColumnSpec, r: _Ragged, cols: Mapping[str, _Column]) -> None:
    refs = {"prompt": (PROMPT_IDS,), "completion": (COMPLETION_IDS,), "sequence": (PROMPT_IDS, COMPLETION_IDS)}
    names = refs[spec.align]
    if any(n not in cols for n in names):
        return
    tokens = _token_counts(spec, r)
    want = sum(_lengths(cols[n].ragged) for n in names)
    if spec.align == "sequence":
        want = np.maximum(want - 1, 0)  # the last token was never fed forward
    mismatch = tokens != want
    if r.validity is not None:
        mismatch &= r.validity
    if mismatch.any():
        i = int(np.argmax(mismatch))
        what = " + ".join(repr(n) for n in names) + (" - 1" if spec.align == "sequence" else "")
        raise BatchError(f"column {spec.name!r} row {i} has {int(tokens[i])} tokens but {what} gives {int(want[i])}; "
                         f"a per-token tensor aligned with the {spec.align} has one tensor per token")


def infer_schema(cols: Mapping[str, _Column]) -> Schema:
    return Schema([c.spec for c in cols.values()])


def normalize_batch(batch: Mapping[str, Any], schema: Optional[Schema],
                    group_key: Optional[str]) -> Tuple[pa.RecordBatch, Schema]:
    """Validate ``batch`` and return it as an unpadded Arrow record batch.

    ``schema`` is the store's (``None`` for an empty store, in which case the
    batch defines it). A column the schema lacks is added as a pending late
    column if it may be (:func:`late_column_problem`; the returned schema's
    ``pending()``), and late columns may be left out. Raises
    ``BatchError`` naming the column and row (a ``BatchSchemaError``, also a ``SchemaError``, for a
    column the schema refuses); never has side effects.

    >>> rb, schema = normalize_batch({"prompt_id": [0, 0], "completion_ids": [[5, 6], [7]]}, None, "prompt_id")
    >>> rb.num_rows, schema["completion_ids"].kind
    (2, 'ragged')
    """
    arrow = _one_record_batch(batch) if schema is not None else None
    if arrow is not None:
        record = _arrow_record(arrow, schema)
        if record is not None:
            _check_token_ids(record)
            _check_loss_masks(record)
            return record, schema
    parsed = _arrow_columns(arrow, schema) if arrow is not None else None
    n, cols = parsed if parsed is not None else _parse_columns(batch, schema)
    for name in cols:  # what a reader accepts (ColumnSpec.from_dict): checked before anything is written
        if not name or len(name) > MAX_COLUMN_NAME:
            raise BatchError(f"column name {name[:40]!r}{'...' if len(name) > 40 else ''} is "
                             f"{'empty' if not name else f'{len(name)} characters long'}; a column name has 1 to "
                             f"{MAX_COLUMN_NAME} characters")
    if group_key is not None:
        if group_key not in cols:
            raise BatchError(f"the batch has no group key column {group_key!r}; every row needs its "
                             f"prompt/group key (columns given: {sorted(cols)})")
        gspec = cols[group_key].spec
        if gspec.kind != SCALAR or gspec.dtype not in ("int64", "string"):
            raise BatchError(f"group key column {group_key!r} must hold one int or string per row, "
                             f"got a {gspec.kind} column of {gspec.dtype}")
    if schema is None:
        schema = infer_schema(cols)
    else:
        extra = [c for c in cols if c not in schema]
        for name in extra:  # a late column: nullable, so rows committed before it read "not computed"
            check_late_column(cols[name].spec, schema)
        if extra:
            schema = schema.with_late([cols[name].spec for name in extra])
        for name, col in cols.items():
            spec, got = schema[name], col.spec
            if spec.shape is not None or got.shape is not None:
                if (spec.shape, spec.dtype, spec.align, spec.fill) != (got.shape, got.dtype, got.align, got.fill):
                    raise BatchSchemaError(f"column {name!r} is {got.to_dict()} in this batch but {spec.to_dict()} in "
                                           "the store's schema" + _TYPE_FIX)
                continue
            if spec.kind != got.kind or (spec.kind == VECTOR and spec.width != got.width) or spec.media != got.media:
                desc = f"{got.kind}" + (f"[{got.width}]" if got.width else "")
                want = f"{spec.kind}" + (f"[{spec.width}]" if spec.width else "")
                raise BatchSchemaError(f"column {name!r} is a {desc} column in this batch but a {want} column in "
                                       "the store's schema" + _TYPE_FIX)
        missing = [c for c in schema.names if c not in cols and schema[c].kind != RAGGED and c not in schema.late]
        if missing:
            raise BatchError(f"the batch lacks column {missing[0]!r}, which the store holds for every row")
    _check_alignment(n, cols, schema)
    arrays = [_arrow_array(spec, cols.get(spec.name), n, spec.name in schema.late) for spec in schema.columns.values()]
    record = pa.RecordBatch.from_arrays(arrays, schema=schema.arrow_schema())
    _check_token_ids(record)
    _check_loss_masks(record)
    return record, schema


def _check_token_ids(record: pa.RecordBatch) -> None:
    """No negative token id is stored: one is a label's ignore index (-100) or a padding value at a
    position the mask kept, and an embedding lookup fails on it far from here (the store's ids are
    int32 lists, starting at offset 0: the record is the normalized one)."""
    for name in (PROMPT_IDS, COMPLETION_IDS):
        i = record.schema.get_field_index(name)
        if i < 0:
            continue
        col = record.column(i)
        bufs = col.buffers()
        if bufs[1] is None or bufs[3] is None:  # no row has ids (all "not computed")
            continue
        offsets = np.frombuffer(bufs[1], dtype=np.int64, count=len(col) + 1, offset=8 * col.offset)
        values = np.frombuffer(bufs[3], dtype=np.int32, count=int(offsets[-1]))[int(offsets[0]):]
        if values.size and values.min() < 0:
            k = int(np.argmax(values < 0)) + int(offsets[0])
            row, position = _value_at(offsets, k)
            raise BatchError(f"column {name!r} row {row} position {position} holds token id "
                             f"{int(values[k - int(offsets[0])])}; token ids are >= 0 (a negative one is a label's "
                             "ignore index or a padding value the mask kept: check the mask)")
