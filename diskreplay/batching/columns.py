"""What both batch layouts share: reading a batch's columns and the output buffers.

The padded layout (:mod:`diskreplay.batching.padded`) and the packed one
(:mod:`diskreplay.batching.packed`) take the same input, the dict that
``ReplayStore.read`` returns, and write into the same kind of output buffers
(fresh tensors, caller-owned ones, or :class:`GrowingBuffers` that a
:class:`~diskreplay.batching.collator.Collator` keeps).

>>> import numpy as np
>>> from diskreplay.ragged import RaggedColumn
>>> batch_rows({"prompt_ids": RaggedColumn.from_arrays([[1, 2], [3]], dtype=np.int32)})
2
"""

from __future__ import annotations

import ctypes
import math
import mmap
import operator
import sys
from typing import Any, Mapping, Optional

import numpy as np
import torch

from ..errors import ArgumentError, BatchError
from ..ragged import RaggedColumn

OFFSETS_SUFFIX = ".offsets"


def output_dtype(dtype: np.dtype) -> torch.dtype:
    """The output dtype of a column: bools stay bool, integers become int64,
    floats keep their width."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return torch.bool
    if dtype.kind in "iu":
        return torch.int64
    if dtype.kind == "f":
        return {2: torch.float16, 4: torch.float32, 8: torch.float64}[dtype.itemsize]
    raise BatchError(f"cannot turn a column of dtype {dtype} into a tensor; "
                     "expected bool, integer or float values")


NUMPY_DTYPES = {torch.bool: np.bool_, torch.int64: np.int64, torch.float16: np.float16,
                torch.float32: np.float32, torch.float64: np.float64}

#: the token id columns whose dtype ``ids_dtype`` sets (``input_ids`` of the packed layout is made of them)
TOKEN_IDS = ("prompt_ids", "completion_ids")
#: what ``ids_dtype`` may be: TRL's int64 (the default), or int32, half the bytes to build and to copy
#: to a device (``nn.Embedding`` and transformers' models take either; the store keeps ids as int32)
IDS_DTYPES = (torch.int64, torch.int32)


def check_ids_dtype(ids_dtype: Any) -> torch.dtype:
    """``ids_dtype`` if it is one of :data:`IDS_DTYPES`, else an ``ArgumentError``.

    >>> check_ids_dtype(torch.int32)
    torch.int32
    """
    if not isinstance(ids_dtype, torch.dtype) or ids_dtype not in IDS_DTYPES:
        raise ArgumentError(f"ids_dtype must be torch.int64 (TRL's layout, the default) or torch.int32 (half the "
                            f"bytes; nn.Embedding takes it), got {ids_dtype!r}")
    return ids_dtype


def check_ids_fit(name: str, values: np.ndarray, ids_dtype: torch.dtype) -> None:
    """Refuse token ids that ``ids_dtype`` cannot hold (only ids given as a wider integer type,
    never the store's int32, need the look)."""
    if ids_dtype != torch.int32 or not values.size or values.dtype.kind not in "iu" \
            or np.can_cast(values.dtype, np.int32):
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < -2**31 or hi >= 2**31:
        raise BatchError(f"column {name!r} holds token ids in [{lo}, {hi}], outside int32; "
                         "collate with ids_dtype=torch.int64")


def check_pad_fits(pad_token_id: int, ids_dtype: torch.dtype) -> int:
    if ids_dtype == torch.int32 and not -2**31 <= pad_token_id < 2**31:
        raise ArgumentError(f"pad_token_id={pad_token_id} does not fit ids_dtype=torch.int32; "
                            "pass a token id of the vocabulary, or ids_dtype=torch.int64")
    return pad_token_id


def batch_rows(batch: Mapping[str, Any]) -> int:
    sizes = {}
    for name, col in batch.items():
        if col is None:
            continue
        if isinstance(col, RaggedColumn):
            sizes[name] = len(col)
        elif isinstance(col, np.ndarray):
            if col.ndim == 0:
                raise BatchError(f"column {name!r} is a 0-d array; expected one value per row")
            sizes[name] = col.shape[0]
        else:
            sizes[name] = len(col)
    if len(set(sizes.values())) > 1:
        raise BatchError(f"columns disagree on the number of rows: {sizes}; "
                         "every column of a batch must hold one entry per row")
    return next(iter(sizes.values()), 0)


def checked_lengths(name: str, col: RaggedColumn) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """A ragged column's per-row lengths and its validity (None when every row is present),
    checked: offsets non-decreasing, one flag per row."""
    lengths = np.diff(np.asarray(col.offsets, dtype=np.int64))
    if lengths.size and lengths.min() < 0:
        raise BatchError(f"column {name!r} has decreasing offsets; "
                         "offsets of a ragged column must be non-decreasing")
    if col.validity is None:
        return lengths, None
    valid = np.asarray(col.validity, dtype=bool)
    if valid.shape != lengths.shape:
        raise BatchError(f"column {name!r} has {valid.size} validity flags for "
                         f"{lengths.size} rows; expected one flag per row")
    return lengths, None if valid.all() else valid


#: suffix of the per-row flag collate adds for a ragged column that some rows of the batch lack
PRESENT_SUFFIX = "_present"


def presence_flags(out: Optional[Mapping[str, torch.Tensor]], name: str, col: RaggedColumn,
              B: int) -> Optional[torch.Tensor]:
    """``[B]`` bool: which rows hold ``col`` ("computed"); None when every row does.

    A column added to a store after its first commit (a late column, e.g.
    ``sampling_per_token_logps``) is "not computed" in older rows: their
    positions hold zeros, which for a log-prob would mean probability 1, so
    the batch says which rows are real under ``name + "_present"``.
    """
    if col.validity is None:
        return None
    valid = np.asarray(col.validity, dtype=bool)
    if valid.all():
        return None
    t = output_buffer(out, name + PRESENT_SUFFIX, (B,), torch.bool)
    np.copyto(t.numpy(), valid)
    return t


def is_prompt_column(name: str) -> bool:
    return name.startswith("prompt_")


def check_pad_token(pad_token_id) -> int:
    try:
        return operator.index(pad_token_id)
    except TypeError:
        raise BatchError(f"pad_token_id must be an integer token id, got {pad_token_id!r}") from None


def check_batch_names(batch: Mapping[str, Any]) -> None:
    if not isinstance(batch, Mapping):
        raise BatchError(f"a batch is one mapping of column to values, as store.read(rows) gives it, got a "
                         f"{type(batch).__name__}; read the rows together (store.read([r0, r1, ...])) instead of "
                         "collating rows read one by one")
    for ids, mask in (("prompt_ids", "prompt_mask"), ("completion_ids", "completion_mask")):
        if batch.get(ids) is not None and mask in batch:
            raise BatchError(f"the batch has both {ids!r} and a column {mask!r}; "
                             f"{mask!r} is built from the lengths of {ids!r}, drop that column")


#: transparent huge pages for large host buffers, where the kernel has them (Linux)
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _libc_madvise():
    if _MADV_HUGEPAGE is None or not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise()


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask the kernel to back a new, untouched host tensor with transparent huge pages (the whole
    2 MiB pages inside it; a no-op where THP is off or unsupported).

    Why: a collator's first batch writes ~56 MB of fresh buffers, a page fault per 4 KiB page;
    measured on a VM with THP in ``madvise`` mode, the first fill of 56 MB took 140 ms with 4 KiB
    pages and 20-26 ms with 2 MiB ones (the next fills ~10 ms either way). A restarted trainer's
    first batch pays it.

    >>> advise_huge_pages(torch.empty(3 << 20, dtype=torch.uint8))
    """
    if _madvise is None:
        return
    start = t.data_ptr()
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + t.numel() * t.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice: a refusal (EINVAL without THP) changes nothing


class GrowingBuffers(dict):
    """Host buffers that grow on demand: an ``out`` that :func:`collate` and its
    siblings may reallocate instead of refusing a batch that does not fit.

    Maps output names to flat tensors. A buffer grows with headroom (widths
    change from batch to batch, and allocating pinned memory costs far more
    than a few spare bytes); the outputs are views of its first elements.
    """

    GROW = 1.25

    def __init__(self, pin_memory: bool = False) -> None:
        super().__init__()
        self.pin_memory = pin_memory

    def take(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        need = math.prod(shape)
        buf = self.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < need:
            buf = self[name] = torch.empty(max(1, math.ceil(need * self.GROW)), dtype=dtype,
                                           pin_memory=self.pin_memory)
            if not self.pin_memory:  # (pinned memory is the CUDA driver's, locked in place already)
                advise_huge_pages(buf)
        return buf[:need].view(shape)


def output_buffer(out: Optional[Mapping[str, torch.Tensor]], name: str, shape: tuple,
            dtype: torch.dtype) -> torch.Tensor:
    """A contiguous [shape] tensor: a fresh one, or the first elements of
    ``out[name]`` (which then aliases that buffer)."""
    if isinstance(out, GrowingBuffers):
        return out.take(name, shape, dtype)
    buf = None if out is None else out.get(name)
    if buf is None:
        return torch.empty(shape, dtype=dtype)
    need = math.prod(shape)
    if not isinstance(buf, torch.Tensor):
        raise BatchError(f"out[{name!r}] must be a torch.Tensor, got {type(buf).__name__}")
    if buf.device.type != "cpu" or buf.dtype != dtype or not buf.is_contiguous():
        raise BatchError(f"out[{name!r}] is a {buf.dtype} tensor on {buf.device} "
                         f"(contiguous={buf.is_contiguous()}); expected a contiguous "
                         f"{dtype} tensor on the CPU")
    if buf.numel() < need:
        raise BatchError(f"out[{name!r}] holds {buf.numel()} elements, this batch needs "
                         f"{need} for shape {tuple(shape)}; allocate a larger buffer")
    return buf.view(-1)[:need].view(shape)


def per_row_tensor(name: str, col: np.ndarray, out) -> torch.Tensor:
    dtype = output_dtype(col.dtype)
    if isinstance(out, GrowingBuffers) or (out is not None and out.get(name) is not None):
        t = output_buffer(out, name, col.shape, dtype)
        np.copyto(t.numpy(), col, casting="unsafe")
        return t
    # a copy: the batch's array may be a read-only view of a memory map
    return torch.from_numpy(np.array(col, dtype=NUMPY_DTYPES[dtype], order="C"))


def passthrough(col):
    if isinstance(col, np.ndarray):
        return col.tolist()
    return col


def unpadded_ragged_names(unpadded: Mapping[str, Any]) -> list[str]:
    ragged = [name for name in unpadded
              if not name.endswith(OFFSETS_SUFFIX) and name + OFFSETS_SUFFIX in unpadded]
    for name in ragged:
        if unpadded[name] is None or unpadded[name + OFFSETS_SUFFIX] is None:
            raise BatchError(f"column {name!r} has values and offsets of which one is None; "
                             "pass what collate_unpadded returned")
    return ragged


def widened_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch twin of :func:`output_dtype`."""
    if dtype == torch.bool or dtype.is_floating_point:
        return dtype
    return torch.int64


# --------------------------------------------------------------------------
# per-token tensor columns (a ragged column with a shape: MoE routed experts)
# --------------------------------------------------------------------------

def token_tensor_specs(batch: Mapping[str, Any], schema: Any) -> dict:
    """``{name: ColumnSpec}`` of the batch's per-token tensor columns, as ``schema`` (a store's
    ``Schema``, or a mapping of name to ``ColumnSpec``) declares them; {} without a schema."""
    if schema is None:  # a store's read says it on the column itself
        return {name: col.token_spec for name, col in batch.items()
                if isinstance(col, RaggedColumn) and getattr(col, "token_spec", None) is not None}
    specs = getattr(schema, "columns", schema)
    if not isinstance(specs, Mapping):
        raise ArgumentError(f"schema must be a store's schema (store.schema) or a mapping of column name to "
                            f"ColumnSpec, got {type(schema).__name__}")
    return {name: specs[name] for name, col in batch.items()
            if isinstance(col, RaggedColumn) and name in specs and getattr(specs[name], "shape", None) is not None}


def _token_rows(name: str, col: RaggedColumn, spec: Any) -> tuple:
    """(the present rows' tensors as ``[tokens, prod(shape)]``, tokens per row (0 where not computed))."""
    per = spec.token_size
    offsets = np.asarray(col.offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    valid = None if col.validity is None else np.asarray(col.validity, dtype=bool)
    values = np.asarray(col.values).reshape(-1)
    if offsets.size:
        values = values[offsets[0]:offsets[-1]]
    if valid is not None and not valid.all():
        if (lengths[~valid] > 0).any():
            values = values[np.repeat(valid, lengths)]
        lengths = np.where(valid, lengths, 0)
    if (lengths % per).any():
        i = int(np.argmax(lengths % per != 0))
        raise BatchError(f"column {name!r} row {i} holds {int(lengths[i])} values, not a whole number of "
                         f"{list(spec.shape)} tensors: the schema given does not describe this column")
    return values.reshape(-1, per), lengths // per


def _token_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _scatter_tokens(out_np: np.ndarray, dest: np.ndarray, values: np.ndarray, fill: int) -> None:
    # fill everything, then one fancy-index write of whole per-token tensors (prod(shape) values each)
    flat = out_np.reshape(-1, values.shape[1])
    flat.fill(fill)
    if dest.size:
        flat[dest] = values


def _token_positions(counts: np.ndarray) -> tuple:
    """(row of each token, its position in the row), tokens of all rows one after another."""
    total = int(counts.sum())
    row = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    return row, np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def _side_lengths(batch: Mapping[str, Any], name: str, B: int) -> Optional[np.ndarray]:
    col = batch.get(name)
    if not isinstance(col, RaggedColumn):
        return None
    lengths = np.diff(np.asarray(col.offsets, dtype=np.int64))
    if col.validity is not None:
        lengths = np.where(np.asarray(col.validity, dtype=bool), lengths, 0)
    return lengths


def _need_ids(name: str, spec: Any, batch: Mapping[str, Any], B: int) -> tuple:
    """(prompt lengths, completion lengths) a tensor aligned with ``spec.align`` is laid along."""
    want = {"prompt": ("prompt_ids",), "completion": ("completion_ids",),
            "sequence": ("prompt_ids", "completion_ids")}[spec.align]
    got = {n: _side_lengths(batch, n, B) for n in ("prompt_ids", "completion_ids")}
    missing = [n for n in want if got[n] is None]
    if missing and spec.align == "sequence":
        raise BatchError(f"column {name!r} is aligned with the prompt and completion tokens (align='sequence'), "
                         f"and the batch has no {missing[0]!r}: read it with the batch (columns=[..., {missing[0]!r}])")
    return got["prompt_ids"], got["completion_ids"]


def pad_token_tensor(name: str, col: RaggedColumn, spec: Any, batch: Mapping[str, Any], B: int,
                     widths: Mapping[bool, int], out: Optional[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """A per-token tensor column in the padded layout, ``spec.fill`` where no token is: ``[B, C, *shape]``
    right-padded with the completions (``align='completion'``), ``[B, P, *shape]`` left-padded with the
    prompts (``'prompt'``), or ``[B, P + C, *shape]`` along ``cat([prompt_ids, completion_ids], 1)``
    (``'sequence'``: a row's last token has no tensor). No Python loop over rows."""
    values, counts = _token_rows(name, col, spec)
    plen, clen = _need_ids(name, spec, batch, B)
    row, t = _token_positions(counts)
    longest = int(counts.max()) if B else 0
    if spec.align == "completion":
        W = max(widths[False], longest)
        dest = row * W + t
    elif spec.align == "prompt":
        W = max(widths[True], longest)
        dest = row * W + (W - counts)[row] + t
    else:
        P, C = widths[True], widths[False]
        W = P + C
        if (counts > np.maximum(plen + clen - 1, 0)).any():
            i = int(np.argmax(counts > np.maximum(plen + clen - 1, 0)))
            raise BatchError(f"column {name!r} row {i} has {int(counts[i])} tokens for {int(plen[i])} prompt and "
                             f"{int(clen[i])} completion tokens; align='sequence' holds at most one per token but "
                             "the last")
        p = plen[row]
        dest = row * W + np.where(t < p, P - p + t, P + t - p)
    tensor = output_buffer(out, name, (B, W) + tuple(spec.shape), _token_dtype(values.dtype))
    _scatter_tokens(tensor.numpy(), dest, values, spec.fill)
    return tensor


def pack_token_tensor(name: str, col: RaggedColumn, spec: Any, batch: Mapping[str, Any], B: int,
                      cu: np.ndarray, batch_dim: bool, out: Optional[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """A per-token tensor column along the packed stream (``[1, T, *shape]``, or ``[T, *shape]``): each
    row's tensors at its prompt (``'prompt'``), completion (``'completion'``) or first ``p + c - 1``
    (``'sequence'``) positions, ``spec.fill`` elsewhere."""
    values, counts = _token_rows(name, col, spec)
    plen, clen = _need_ids(name, spec, batch, B)
    zero = np.zeros(B, dtype=np.int64)
    plen = zero if plen is None else plen
    clen = zero if clen is None else clen
    side = {"prompt": plen, "completion": clen, "sequence": np.maximum(plen + clen - 1, 0)}[spec.align]
    over = counts > side
    if over.any():
        i = int(np.argmax(over))
        raise BatchError(f"column {name!r} row {i}: {int(counts[i])} tensors for {int(side[i])} {spec.align} "
                         "tokens; a per-token tensor has one per token of its side (read its ids with it)")
    row, t = _token_positions(counts)
    dest = cu[:-1][row] + t + (plen[row] if spec.align == "completion" else 0)
    T = int(cu[-1])
    shape = ((1, T) if batch_dim else (T,)) + tuple(spec.shape)
    tensor = output_buffer(out, name, shape, _token_dtype(values.dtype))
    _scatter_tokens(tensor.numpy(), dest, values, spec.fill)
    return tensor
