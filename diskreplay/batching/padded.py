"""Turn sampled rows into padded torch batches in TRL's GRPO layout.

Two entry points:

* :func:`collate` pads the dict that ``ReplayStore.read`` returns (ragged
  columns as :class:`~diskreplay.ragged.RaggedColumn`, per-row columns as numpy
  arrays) on the host, optionally into caller-owned (pinned) buffers.
  :func:`collate_unpadded` and :func:`pad_on_device` split the same work in two
  so that a loader can ship only the unpadded bytes to a GPU and pad there;
  ``pad_on_device(collate_unpadded(b), pad)`` equals ``collate(b, pad)``.
* :func:`repad` re-pads per-row dicts of already padded tensors (TRL's buffered
  entries) to the common length of the rows it is given, in place, as TRL's
  ``repad`` does; :func:`repad_stacked` returns the same rows as one dict of
  [B, L] tensors.

The padding-free layout lives in :mod:`diskreplay.batching.packed`; reusable output
buffers for both layouts in :class:`diskreplay.batching.collator.Collator`.

Layout: prompts are LEFT-padded (``prompt_ids`` with the pad token,
``prompt_mask`` 1 on real tokens), completions and every per-token column
aligned with them are RIGHT-padded (``completion_ids`` with the pad token,
masks and floats with 0). The widths are the batch's own maxima.

How the host kernels pad (measured on 512 rows, ~600 tokens on average, 4096
at most, against the alternatives the design suggested): fill the output with
the pad value, then scatter the packed values through a boolean "is a token"
mask shared by every column of the same lengths. Writing the pad only through
the mask's complement (``np.copyto(where=~mask)``) is 1.5-1.8x slower than a
plain fill, because a masked write costs more per element than the memset it
avoids; a flat gather with a sentinel index is 4-9x slower (it reads an int64
index as large as the output); a per-row slice loop writes each byte once but
loses 10x on short rows. So the token positions are written twice, which
costs less than any way of writing them once.

One module: TRL's padded layout, on the host and on the device, sharing its width and
dtype rules.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from ..errors import ArgumentError, BatchError
from ..ragged import RaggedColumn
from ..store.reading import RowRanges
from .columns import (OFFSETS_SUFFIX, PRESENT_SUFFIX, TOKEN_IDS, batch_rows, check_batch_names, check_ids_dtype,
                      check_ids_fit, check_pad_fits, check_pad_token, checked_lengths, is_prompt_column,
                      output_buffer, output_dtype, pad_token_tensor, passthrough, per_row_tensor, presence_flags,
                      token_tensor_specs, unpadded_ragged_names, widened_dtype)

__all__ = ["collate", "collate_unpadded", "pad_on_device", "repad", "repad_stacked"]

#: Per-token columns that :func:`repad` treats as aligned with completions even
#: where their shape alone would not say so.
PER_TOKEN_COLUMNS = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")


# --------------------------------------------------------------------------
# host kernels (numpy, write into a caller-given array)
# --------------------------------------------------------------------------

def _right_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    """[B, width] bool, True on the first ``lengths[i]`` positions of row i."""
    return np.arange(width, dtype=np.int64) < lengths[:, None]


def _left_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    """[B, width] bool, True on the last ``lengths[i]`` positions of row i."""
    return np.arange(width, dtype=np.int64) >= (width - lengths)[:, None]


def _pad_right(values: np.ndarray, lengths: np.ndarray, pad_value, out: np.ndarray,
               mask: Optional[np.ndarray] = None) -> np.ndarray:
    """Right-pad packed rows into ``out`` [B, L]; return the token mask used.

    ``values`` is the concatenation of the rows (``lengths`` elements each).
    The True positions of a right (or left) mask, read in row-major order, are
    exactly the rows' elements in order, so one boolean scatter places them.
    """
    if mask is None:
        mask = _right_mask(lengths, out.shape[1])
    out.fill(pad_value)
    out[mask] = values
    return mask


def _pad_left(values: np.ndarray, lengths: np.ndarray, pad_value, out: np.ndarray,
              mask: Optional[np.ndarray] = None) -> np.ndarray:
    """Left-pad packed rows into ``out`` [B, L]; return the token mask used."""
    if mask is None:
        mask = _left_mask(lengths, out.shape[1])
    out.fill(pad_value)
    out[mask] = values
    return mask


# --------------------------------------------------------------------------
# device kernel (torch only, any device)
# --------------------------------------------------------------------------

def _pad_torch(values: torch.Tensor, offsets: torch.Tensor, width: int, pad_value,
               dtype: torch.dtype, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad packed rows to [B, width] with torch ops on ``values.device``.

    A gather with a sentinel rather than the host's fill-and-scatter: it has
    no data-dependent shapes, so on CUDA it runs without a host sync, and it
    writes every output element once. Returns (padded, bool token mask).
    """
    device = values.device
    offsets = offsets.to(device=device, dtype=torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    pos = torch.arange(width, device=device, dtype=torch.int64).expand(len(lengths), width)
    if left:
        # position j of a left-padded row holds element j - (width - length)
        pos = pos - (width - lengths)[:, None]
        mask = pos >= 0
    else:
        mask = pos < lengths[:, None]
    # index values.numel() is the sentinel: it points at the appended pad
    index = torch.where(mask, offsets[:-1, None] + pos, values.numel())
    source = torch.cat([values.reshape(-1).to(dtype),
                        torch.full((1,), pad_value, dtype=dtype, device=device)])
    return source[index], mask


# --------------------------------------------------------------------------
# batch inspection
# --------------------------------------------------------------------------


def _stored_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of the same width as ``dtype`` (unpadded values keep it)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _packed(name: str, col: RaggedColumn) -> tuple[np.ndarray, np.ndarray]:
    """(values of the present rows, concatenated; per-row lengths, 0 where
    the row is None)."""
    lengths, valid = checked_lengths(name, col)
    offsets = np.asarray(col.offsets, dtype=np.int64)
    values = np.asarray(col.values).reshape(-1)
    if offsets.size:
        values = values[offsets[0]:offsets[-1]]
    if valid is not None:
        if (lengths[~valid] > 0).any():
            values = values[np.repeat(valid, lengths)]
        lengths = np.where(valid, lengths, 0)
    return values, lengths


def _all_present(col: RaggedColumn) -> bool:
    return col.validity is None or bool(np.all(col.validity))


def _pad_value(name: str, pad_token_id: int):
    return pad_token_id if name in ("prompt_ids", "completion_ids") else 0


def _mask_name(name: str) -> Optional[str]:
    return {"prompt_ids": "prompt_mask", "completion_ids": "completion_mask"}.get(name)


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------

def collate(batch: Mapping[str, Any], pad_token_id: int, *,
            out: Optional[Mapping[str, torch.Tensor]] = None, ids_dtype: torch.dtype = torch.int64,
            schema: Any = None) -> dict[str, Any]:
    """Pad a batch read from the store into TRL's GRPOTrainer layout.

    ``batch`` maps column names to what ``ReplayStore.read`` returns:

    * a :class:`RaggedColumn`: ``prompt_ids`` becomes [B, P] int64, left-padded
      with ``pad_token_id``, plus ``prompt_mask`` [B, P] int64; every other
      column named ``prompt_*`` is left-padded with 0 to P. ``completion_ids``
      becomes [B, C] int64, right-padded with ``pad_token_id``, plus
      ``completion_mask``; every other ragged column (per-token log-probs...)
      is right-padded with 0 to C. P and C are the longest prompt-aligned and
      completion-aligned rows of this batch (0 gives a [B, 0] tensor).
      Integers become int64 (token ids: ``ids_dtype``, int64 as TRL has them,
      or ``torch.int32``), floats and bools keep their dtype. A row whose
      validity flag is False ("not computed": e.g. a row committed before the
      column was added to the store) comes out as all padding, and the batch
      then also holds ``name + "_present"``, a [B] bool tensor that is False
      at such rows (absent when every row has the column).
    * a numpy array [B] or [B, K]: a tensor of the same shape (bool stays
      bool, integers become int64, floats keep their width).
    * a list (strings): returned unchanged. ``None`` (no row of the batch
      has the column): stays ``None``.
    * a per-token tensor column (one that ``schema``, the store's
      ``store.schema``, declares with a ``shape``: MoE routed experts):
      ``[B, C, *shape]`` right-padded (``align="completion"``), ``[B, P, *shape]``
      left-padded (``"prompt"``) or ``[B, P + C, *shape]`` along
      ``cat([prompt_ids, completion_ids], 1)`` (``"sequence"``), in its stored
      dtype (uint8, uint16, int16), the column's declared ``fill`` where no
      token is. Without ``schema`` it is an ordinary ragged column of
      ``prod(shape)`` values a token.

    ``out`` optionally maps output names (including ``prompt_mask`` and
    ``completion_mask``) to preallocated contiguous CPU tensors of the output's
    dtype, pinned or not, holding at least as many elements as the output
    needs; the output is then written into the first elements of that buffer,
    and the returned tensor is a view that ALIASES it: the next call with the
    same ``out`` overwrites it. Names missing from ``out`` get fresh tensors.
    The views are contiguous, so ``.to(device, non_blocking=True)`` from a
    pinned buffer stays asynchronous.

    >>> b = {"prompt_ids": RaggedColumn.from_arrays([[5, 6], [7]], dtype=np.int32),
    ...      "completion_ids": RaggedColumn.from_arrays([[1], [2, 3, 4]], dtype=np.int32),
    ...      "advantages": np.array([0.5, -0.5], dtype=np.float32)}
    >>> t = collate(b, pad_token_id=0)
    >>> t["prompt_ids"].tolist(), t["prompt_mask"].tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    >>> t["completion_ids"].tolist(), t["completion_mask"].tolist()
    ([[1, 0, 0], [2, 3, 4]], [[1, 0, 0], [1, 1, 1]])
    >>> t["advantages"]
    tensor([ 0.5000, -0.5000])
    >>> collate(b, pad_token_id=0, ids_dtype=torch.int32)["prompt_ids"].dtype
    torch.int32
    """
    ids_dtype = check_ids_dtype(ids_dtype)
    pad_token_id = check_pad_fits(check_pad_token(pad_token_id), ids_dtype)
    check_batch_names(batch)
    B = batch_rows(batch)
    tensors = token_tensor_specs(batch, schema)
    packed = {name: _packed(name, col) for name, col in batch.items()
              if isinstance(col, RaggedColumn) and name not in tensors}
    width = {True: 0, False: 0}
    for name, (_, lengths) in packed.items():
        if lengths.size:
            width[is_prompt_column(name)] = max(width[is_prompt_column(name)], int(lengths.max()))

    masks: list[tuple[bool, np.ndarray, np.ndarray]] = []  # (left, lengths, mask)

    def mask_for(left: bool, lengths: np.ndarray, L: int) -> np.ndarray:
        # columns of one side usually share their lengths: build the mask once
        for l2, len2, m in masks:
            if l2 == left and np.array_equal(len2, lengths):
                return m
        m = _left_mask(lengths, L) if left else _right_mask(lengths, L)
        masks.append((left, lengths, m))
        return m

    result: dict[str, Any] = {}
    for name, col in batch.items():
        if col is None:
            result[name] = None
        elif name in tensors:
            result[name] = pad_token_tensor(name, col, tensors[name], batch, B, width, out)
            present = presence_flags(out, name, col, B)
            if present is not None:
                result[name + PRESENT_SUFFIX] = present
        elif isinstance(col, RaggedColumn):
            values, lengths = packed[name]
            left = is_prompt_column(name)
            L = width[left]
            if name in TOKEN_IDS and values.dtype.kind in "iu":
                check_ids_fit(name, values, ids_dtype)
                dtype = ids_dtype
            else:
                dtype = output_dtype(values.dtype)
            tensor = output_buffer(out, name, (B, L), dtype)
            mask = mask_for(left, lengths, L)
            kernel = _pad_left if left else _pad_right
            kernel(values, lengths, _pad_value(name, pad_token_id), tensor.numpy(), mask)
            result[name] = tensor
            mask_name = _mask_name(name)
            if mask_name is not None:
                mask_tensor = output_buffer(out, mask_name, (B, L), torch.int64)
                np.copyto(mask_tensor.numpy(), mask)
                result[mask_name] = mask_tensor
            present = presence_flags(out, name, col, B)
            if present is not None:
                result[name + PRESENT_SUFFIX] = present
        elif isinstance(col, np.ndarray) and col.dtype.kind in "biuf":
            result[name] = per_row_tensor(name, col, out)
        else:
            result[name] = passthrough(col)
    return result


def collate_unpadded(batch: Mapping[str, Any], *,
                     out: Optional[Mapping[str, torch.Tensor]] = None, schema: Any = None) -> dict[str, Any]:
    """The unpadded half of :func:`collate`: pack the batch for :func:`pad_on_device`.

    Each ragged column ``name`` becomes ``name`` (a 1-D tensor of the present
    rows' values, concatenated, in their stored dtype: int32 ids stay int32, so
    fewer bytes cross to the device) and ``name + ".offsets"`` ([B + 1] int64,
    starting at 0; a row that is None has length 0). Per-row arrays, lists and
    ``None`` are treated as in :func:`collate`. ``out`` works as there (the
    buffers for values must have the stored dtype). A per-token tensor column
    that ``schema`` declares is refused: the device path does not lay it out.

    >>> b = {"completion_ids": RaggedColumn.from_arrays([[1], [2, 3]], dtype=np.int32)}
    >>> u = collate_unpadded(b)
    >>> u["completion_ids"].tolist(), u["completion_ids.offsets"].tolist()
    ([1, 2, 3], [0, 1, 3])
    """
    tensors = token_tensor_specs(batch, schema)
    if tensors:
        name = next(iter(tensors))
        raise BatchError(f"column {name!r} is a per-token tensor column, which the device path (pad_on_device, "
                         "pack_on_device) does not lay out; collate on the host (pad_on_device=False) or leave the "
                         f"column out of the read (columns=[...] without {name!r})")
    check_batch_names(batch)
    B = batch_rows(batch)
    result: dict[str, Any] = {}
    for name, col in batch.items():
        if col is None:
            result[name] = None
        elif isinstance(col, RaggedColumn):
            ot = output_buffer(out, name + OFFSETS_SUFFIX, (B + 1,), torch.int64)
            o = ot.numpy()
            if isinstance(col, RowRanges) and _all_present(col):
                # rows still in the segments' maps (ReplayStore.read_ranges): copied once, run by run
                vt = output_buffer(out, name, (int(col.offsets[-1]),), _stored_dtype(col.dtype))
                col.plan.gather(col.sources, col.dtype, out=vt.numpy())
                np.copyto(o, col.offsets)
            else:
                values, lengths = _packed(name, col)
                vt = output_buffer(out, name, (values.size,), _stored_dtype(values.dtype))
                np.copyto(vt.numpy(), values)
                o[0] = 0
                np.cumsum(lengths, out=o[1:])
            result[name] = vt
            result[name + OFFSETS_SUFFIX] = ot
            present = presence_flags(out, name, col, B)
            if present is not None:
                result[name + PRESENT_SUFFIX] = present
        elif isinstance(col, np.ndarray) and col.dtype.kind in "biuf":
            result[name] = per_row_tensor(name, col, out)
        else:
            result[name] = passthrough(col)
    return result


def buffer_needs(batch: Mapping[str, Any], n: int, unpadded: bool,
                 ids_dtype: torch.dtype = torch.int64) -> dict[str, tuple]:
    """``{output name: (elements, torch dtype)}`` of what :func:`collate` (or, with
    ``unpadded``, :func:`collate_unpadded`) writes for ``batch`` of ``n`` rows:
    the sizes of reusable ``out`` buffers (a loader's pinned ring).

    Row lengths come from the raw offsets, an upper bound of what collate pads
    to (it zeroes rows flagged "not computed"): a buffer only has to be large
    enough.

    >>> b = {"completion_ids": RaggedColumn.from_arrays([[1], [2, 3]], dtype=np.int32)}
    >>> buffer_needs(b, 2, unpadded=False)
    {'completion_ids': (4, torch.int64), 'completion_mask': (4, torch.int64)}
    """
    needs: dict[str, tuple] = {}
    width = {True: 0, False: 0}
    ragged = []
    for name, col in batch.items():
        if isinstance(col, RaggedColumn):
            off = col.offsets
            if unpadded:
                needs[name] = (int(off[-1] - off[0]), _stored_dtype(col.values.dtype))
                needs[name + OFFSETS_SUFFIX] = (n + 1, torch.int64)
            else:
                ragged.append((name, col.values.dtype))
                if n:
                    width[is_prompt_column(name)] = max(width[is_prompt_column(name)], int(np.diff(off).max()))
        elif isinstance(col, np.ndarray) and col.dtype.kind in "biuf":
            needs[name] = (col.size, output_dtype(col.dtype))
    for name, dtype in ragged:
        numel = n * width[is_prompt_column(name)]
        needs[name] = (numel, ids_dtype if name in TOKEN_IDS and np.dtype(dtype).kind in "iu" else output_dtype(dtype))
        mask = _mask_name(name)
        if mask is not None:
            needs[mask] = (numel, torch.int64)
    return needs


def padded_widths(unpadded: Mapping[str, Any]) -> dict[bool, int]:
    """``{True: P, False: C}``: the widths :func:`pad_on_device` pads prompt-aligned
    (``True``) and completion-aligned columns to, from the offsets of
    :func:`collate_unpadded`'s output. Computed where the offsets are: on host
    offsets (before they are copied to a GPU) it costs no device sync.

    >>> b = {"completion_ids": RaggedColumn.from_arrays([[1], [2, 3, 4]], dtype=np.int32)}
    >>> padded_widths(collate_unpadded(b))
    {True: 0, False: 3}
    """
    ragged = unpadded_ragged_names(unpadded)
    width = {True: 0, False: 0}
    if ragged:
        longest = []
        device = unpadded[ragged[0] + OFFSETS_SUFFIX].device
        for name in ragged:
            offsets = unpadded[name + OFFSETS_SUFFIX].to(device=device, dtype=torch.int64)
            lengths = offsets[1:] - offsets[:-1]
            longest.append(lengths.max() if lengths.numel() else offsets.new_zeros(()))
        # one read of every column's longest row, not one sync per column
        for name, m in zip(ragged, torch.stack(longest).tolist()):
            width[is_prompt_column(name)] = max(width[is_prompt_column(name)], int(m))
    return width


def pad_on_device(unpadded: Mapping[str, Any], pad_token_id: int, *,
                  widths: Optional[Mapping[bool, int]] = None, ids_dtype: torch.dtype = torch.int64) -> dict[str, Any]:
    """Pad what :func:`collate_unpadded` made, with torch ops on its tensors' device.

    The result equals ``collate`` of the same batch, on whatever device the
    values and offsets live (no copy back to the host). Finding the widths
    costs one small device-to-host read of the maximum row lengths, unless
    ``widths`` (:func:`padded_widths` of the host offsets, taken before they
    were moved) is given: then nothing waits for the device. ``ids_dtype`` as
    in :func:`collate`.

    >>> b = {"prompt_ids": RaggedColumn.from_arrays([[5, 6], [7]], dtype=np.int32)}
    >>> t = pad_on_device(collate_unpadded(b), pad_token_id=0)
    >>> t["prompt_ids"].tolist(), t["prompt_mask"].tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    ids_dtype = check_ids_dtype(ids_dtype)
    pad_token_id = check_pad_fits(check_pad_token(pad_token_id), ids_dtype)
    ragged = unpadded_ragged_names(unpadded)
    width = padded_widths(unpadded) if widths is None else {True: int(widths[True]), False: int(widths[False])}

    offset_names = {name + OFFSETS_SUFFIX for name in ragged}
    result: dict[str, Any] = {}
    for name, value in unpadded.items():
        if name in offset_names:
            continue
        if name in ragged:
            left = is_prompt_column(name)
            dtype = widened_dtype(value.dtype)
            if name in TOKEN_IDS and dtype == torch.int64:
                dtype = ids_dtype
            padded, mask = _pad_torch(value, unpadded[name + OFFSETS_SUFFIX], width[left],
                                      _pad_value(name, pad_token_id), dtype, left)
            result[name] = padded
            mask_name = _mask_name(name)
            if mask_name is not None:
                result[mask_name] = mask.to(torch.int64)
        else:
            result[name] = value
    return result


# --------------------------------------------------------------------------
# repad: per-row dicts of padded tensors
# --------------------------------------------------------------------------

def _row_vector(name: str, i: int, value) -> torch.Tensor:
    """A row's token tensor as 1-D; accepts [L] and [1, L]."""
    if not isinstance(value, torch.Tensor):
        raise BatchError(f"column {name!r}, row {i}: expected a torch.Tensor, "
                         f"got {type(value).__name__}")
    if value.dim() == 1:
        return value
    if value.dim() == 2 and value.shape[0] == 1:
        return value[0]
    raise BatchError(f"column {name!r}, row {i}: shape {tuple(value.shape)}; "
                     "expected [L] or [1, L]")


class _Side:
    """The rows of one side (prompt or completion) after dropping padding."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], ids: str, mask: str, left: bool):
        self.ids, self.mask, self.left = ids, mask, left
        self.shapes = []
        id_rows, mask_rows = [], []
        for i, row in enumerate(rows):
            if row.get(ids) is None or row.get(mask) is None:
                raise BatchError(f"row {i} lacks {ids!r} or {mask!r}; "
                                 "every row needs both, as tensors")
            id_row, mask_row = _row_vector(ids, i, row[ids]), _row_vector(mask, i, row[mask])
            if row[mask].shape != row[ids].shape:
                raise BatchError(f"column {mask!r}, row {i}: shape {tuple(row[mask].shape)} "
                                 f"differs from {ids!r} shape {tuple(row[ids].shape)}; "
                                 "a mask must have the shape of its ids")
            self.shapes.append(row[ids].shape)
            id_rows.append(id_row)
            mask_rows.append(mask_row)
        masks = torch.cat(mask_rows)
        if masks.dtype != torch.bool:
            bad = (masks != 0) & (masks != 1)
            if bool(bad.any()):
                i = next(i for i, m in enumerate(mask_rows)
                         if bool(((m != 0) & (m != 1)).any()))
                raise BatchError(f"column {mask!r}, row {i}: values other than 0 and 1; "
                                 "a mask marks real tokens with 1 and padding with 0")
        self.mask_dtype = masks.dtype
        self.keep = masks.bool()
        device = self.keep.device
        in_lengths = torch.tensor([t.numel() for t in id_rows], dtype=torch.int64)
        in_offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(in_lengths, 0, out=in_offsets[1:])
        # tokens kept before each row boundary = kept offsets, no loop per row
        kept = torch.zeros(self.keep.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(self.keep, 0, out=kept[1:])
        self.offsets = kept[in_offsets.to(device)]
        lengths = self.offsets[1:] - self.offsets[:-1]
        self.width = int(lengths.max()) if lengths.numel() else 0
        self.id_rows = id_rows

    def _host_mask(self) -> np.ndarray:
        if getattr(self, "_mask", None) is None:
            lengths = np.diff(self.offsets.numpy())
            self._mask = (_left_mask if self.left else _right_mask)(lengths, self.width)
        return self._mask

    def _on_host(self, dtype: torch.dtype) -> bool:
        # CPU tensors of a numpy dtype use the host kernels (fill + one masked
        # scatter); the sentinel gather of _pad_torch is built for devices
        return self.keep.device.type == "cpu" and dtype not in (torch.bfloat16,)

    def pad(self, name: str, row_tensors: Sequence[torch.Tensor], pad_value) -> torch.Tensor:
        flat = torch.cat(row_tensors)
        kept = flat[self.keep]
        if self._on_host(flat.dtype):
            out = torch.empty((len(self.offsets) - 1, self.width), dtype=flat.dtype)
            arr = out.numpy()
            arr.fill(pad_value)
            arr[self._host_mask()] = kept.numpy()
            return out
        padded, _ = _pad_torch(kept, self.offsets, self.width, pad_value, flat.dtype, self.left)
        return padded

    def padded_mask(self) -> torch.Tensor:
        if self._on_host(self.mask_dtype):
            return torch.from_numpy(self._host_mask()).to(self.mask_dtype)
        ones = torch.ones(int(self.offsets[-1]), dtype=self.mask_dtype, device=self.keep.device)
        padded, _ = _pad_torch(ones, self.offsets, self.width, 0, self.mask_dtype, self.left)
        return padded


def _aligned(name: str, values: Sequence, side: Optional[_Side], known: bool) -> bool:
    """Whether a column is per-token on ``side``: a known per-token name, or a
    tensor shaped like that side's ids in every row."""
    if side is None:
        return False
    if known:
        return True
    return all(isinstance(v, torch.Tensor) and v.shape == shape
               for v, shape in zip(values, side.shapes))


def _stack_rows(name: str, values: Sequence):
    if all(isinstance(v, str) for v in values):
        return list(values)
    try:
        tensors = [torch.as_tensor(v) for v in values]
    except (TypeError, ValueError, RuntimeError):
        return list(values)
    if all(t.dim() >= 1 and t.shape[0] == 1 for t in tensors):
        # rows cut from a batch with t[i:i + 1]: join them back along dim 0
        stack = torch.cat
    else:
        stack = torch.stack
    try:
        return stack(tensors)
    except RuntimeError as e:
        raise BatchError(f"column {name!r}: the rows' values cannot be stacked ({e}); "
                         "a per-row column needs one same-shaped value per row") from None


def _padding_value(padding_value, pad_token_id) -> int:
    if (padding_value is None) == (pad_token_id is None):
        raise ArgumentError("pass the pad token once, as padding_value (or as pad_token_id, TRL's name); "
                            f"got padding_value={padding_value!r}, pad_token_id={pad_token_id!r}")
    return padding_value if pad_token_id is None else pad_token_id


def _repadded(rows: Sequence[Mapping[str, Any]], padding_value: int) -> tuple[dict[str, Any], list[str]]:
    """The re-padded [B, L] tensors of every per-token column (``None`` for a
    column that is ``None`` in every row), and the names of the per-row columns."""
    padding_value = check_pad_token(padding_value)
    if len(rows) == 0:
        raise BatchError("repad got no rows; pass a non-empty list of row dicts")
    names = list(rows[0])
    for i, row in enumerate(rows):
        if set(row) != set(names):
            raise BatchError(f"row {i} has columns {sorted(row)}, row 0 has {sorted(names)}; "
                             "every row needs the same columns (None where not computed)")
    sides = {}
    for ids, mask, left in (("prompt_ids", "prompt_mask", True),
                            ("completion_ids", "completion_mask", False)):
        if ids in names or mask in names:
            sides[ids] = _Side(rows, ids, mask, left)
    prompt, completion = sides.get("prompt_ids"), sides.get("completion_ids")

    result: dict[str, Any] = {}
    per_row: list[str] = []
    for name in names:
        values = [row[name] for row in rows]
        side = next((s for s in sides.values() if name in (s.ids, s.mask)), None)
        if side is not None:
            if name == side.ids:
                result[name] = side.pad(name, side.id_rows, padding_value)
            else:
                result[name] = side.padded_mask()
            continue
        missing = [v is None for v in values]
        if all(missing):
            result[name] = None
            continue
        if any(missing):
            raise BatchError(f"column {name!r} is None in row {missing.index(True)} but not in "
                             f"row {missing.index(False)}; a column must be computed for "
                             "every row or for none")
        known = name in PER_TOKEN_COLUMNS
        if known and completion is None:
            raise BatchError(f"column {name!r} is per-token but the rows have no "
                             "'completion_ids' to align it with")
        if _aligned(name, values, completion, known):
            side = completion
        elif is_prompt_column(name) and _aligned(name, values, prompt, False):
            side = prompt
        else:
            per_row.append(name)
            continue
        row_tensors = []
        for i, (v, ids) in enumerate(zip(values, side.id_rows)):
            t = _row_vector(name, i, v)
            if t.shape != ids.shape:
                raise BatchError(f"column {name!r}, row {i}: {t.numel()} values for "
                                 f"{ids.numel()} positions of {side.ids!r}; a per-token "
                                 "column must have its ids' length")
            row_tensors.append(t)
        result[name] = side.pad(name, row_tensors, 0)
    return result, per_row


def repad(rows: Sequence[Mapping[str, Any]], padding_value: Optional[int] = None, *,
          pad_token_id: Optional[int] = None) -> Sequence[Mapping[str, Any]]:
    """Drop the padding of per-row padded tensors and re-pad them to the rows' common
    lengths, in place: TRL's ``repad`` (its experimental GRPO replay buffer) as a drop-in.

    Each row is a dict like one of TRL's buffered entries: ``prompt_ids`` /
    ``prompt_mask`` and ``completion_ids`` / ``completion_mask`` tensors
    ([L] or [1, L]; a mask has its ids' shape and holds 0/1), per-token
    columns aligned with the completion (``old_per_token_logps``,
    ``ref_per_token_logps``, ``sampling_per_token_logps``, and any other
    column shaped like the row's ``completion_ids``; ``prompt_*`` columns
    shaped like ``prompt_ids`` go with the prompt), and per-row values.

    Positions whose mask is 0 are dropped (anywhere, not only at the edges);
    then prompts are re-padded on the LEFT and completions and their columns
    on the RIGHT, to the longest row here. Ids pad with the pad token
    (``padding_value``, or ``pad_token_id`` as TRL names it), masks and every
    other column with 0 (TRL fills log-probs with -10000 and documents the
    value as ignored; 0 makes the rows equal :func:`collate`'s); dtypes are
    kept. Every row's per-token entries are replaced by its row of the
    re-padded batch ([P] and [C] views of one [B, P] / [B, C] tensor each); a
    column that is ``None`` in every row stays ``None``; per-row values and
    other entries are left as they were. Returns ``rows`` itself. Works on
    any device; the rows' tensors must share one.

    :func:`repad_stacked` re-pads the same way and returns one dict of
    [B, L] tensors instead, leaving the rows alone.

    >>> rows = [{"completion_ids": torch.tensor([4, 0, 0]),
    ...          "completion_mask": torch.tensor([1, 0, 0]),
    ...          "old_per_token_logps": None, "advantages": 1.0},
    ...         {"completion_ids": torch.tensor([5, 6]),
    ...          "completion_mask": torch.tensor([1, 1]),
    ...          "old_per_token_logps": None, "advantages": -1.0}]
    >>> out = repad(rows, pad_token_id=0)
    >>> out is rows, [r["completion_ids"].tolist() for r in out]
    (True, [[4, 0], [5, 6]])
    >>> out[0]["completion_mask"].tolist(), out[0]["old_per_token_logps"], out[1]["advantages"]
    ([1, 0], None, -1.0)
    """
    padded, _ = _repadded(rows, _padding_value(padding_value, pad_token_id))
    for name, tensor in padded.items():
        for i, row in enumerate(rows):
            row[name] = None if tensor is None else tensor[i]
    return rows


def repad_stacked(rows: Sequence[Mapping[str, Any]], padding_value: Optional[int] = None, *,
                  pad_token_id: Optional[int] = None) -> dict[str, Any]:
    """:func:`repad`, returned as one batch: a dict of [B, L] tensors; the rows are not modified.

    Per-token columns are dropped and re-padded exactly as :func:`repad`
    does (prompts left, completions and their columns right, ids with the pad
    token, the rest with 0). Per-row values (``advantages``, ``rewards``:
    numbers, 0-d or [1] tensors) are stacked into [B] (or [B, K]); a list of
    strings stays a list; a column that is ``None`` in every row stays
    ``None``. To keep a per-row value from being taken for a per-token column
    when a completion has one token, pass it as a number or a 0-d tensor.

    >>> rows = [{"completion_ids": torch.tensor([4, 0, 0]),
    ...          "completion_mask": torch.tensor([1, 0, 0]),
    ...          "old_per_token_logps": None, "advantages": torch.tensor(1.0)},
    ...         {"completion_ids": torch.tensor([[5, 6]]),
    ...          "completion_mask": torch.tensor([[1, 1]]),
    ...          "old_per_token_logps": None, "advantages": torch.tensor(-1.0)}]
    >>> out = repad_stacked(rows, padding_value=0)
    >>> out["completion_ids"].tolist(), out["completion_mask"].tolist()
    ([[4, 0], [5, 6]], [[1, 0], [1, 1]])
    >>> out["old_per_token_logps"] is None, out["advantages"].tolist()
    (True, [1.0, -1.0])
    """
    padded, per_row = _repadded(rows, _padding_value(padding_value, pad_token_id))
    return {name: _stack_rows(name, [row[name] for row in rows]) if name in per_row else padded[name]
            for name in rows[0]}
