"""Padding-free ("packed") batches for variable-length attention.

A packed batch is one flat token stream: each row's prompt, then its
completion, row after row, with ``position_ids`` restarting at 0 for every row
and ``cu_seqlens`` marking where rows start. It is what flash-attention's
varlen kernels, verl's remove-padding, OpenRLHF's packing and transformers'
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` consume. The
store keeps rows unpadded, so building it costs O(total tokens) and writes no
padding at all.

Two entry points, as for padded batches (see :mod:`diskreplay.batching.padded`):

* :func:`collate_packed` builds the packed batch on the host from what
  ``ReplayStore.read`` returns.
* :func:`pack_on_device` builds the same batch with torch ops from
  :func:`~diskreplay.batching.padded.collate_unpadded`'s output, wherever its tensors
  live: a loader ships only the unpadded payload (int32 ids, completion-only
  log-probs) to a GPU and packs there. ``pack_on_device(collate_unpadded(b))``
  equals ``collate_packed(b)`` element for element.

How the host writes the stream (512 rows, ~820 tokens each, T ~418 k):

* With numba installed (``pip install diskreplay[fast]``), compiled kernels
  (:mod:`diskreplay._jit`) write each column in one pass over the rows,
  reading every row at its address in the segment's map (or the batch's
  values): each output byte is written once, at the machine's memory speed,
  with no per-row Python. ``DISKREPLAY_JIT=0`` switches them off.
* Without it, each token column is one ``np.concatenate`` of per-row views
  (prompt piece, completion piece, row after row) into the output buffer, int32
  ids widened on the way; zeros at the other side's positions and
  ``position_ids`` are views of small constant arrays, made once per length and
  kept (:class:`_Constants`: looking one up costs a tenth of slicing it);
  ``completion_mask`` is one ``np.repeat`` of a 0/1 pattern. Per-row work is a
  view and a piece of a C-level join; a fancy-index gather (``np.take`` over
  T) or a boolean-mask scatter is slower.

Both paths give the same bytes. From ``ReplayStore.read_ranges`` the rows
are read straight from the segments' memory maps, so a batch copies every
value once instead of twice (``read`` first concatenates the rows, then the
packing copies them again): what :meth:`Collator.read
<diskreplay.batching.collator.Collator.read>` does. Timings of both paths:
``tools/bench.py sample`` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np
import torch

from .. import _jit
from ..errors import BatchError
from ..ragged import RaggedColumn, data_address
from ..store.reading import RowRanges
from .columns import (OFFSETS_SUFFIX, PRESENT_SUFFIX, batch_rows, check_batch_names, check_ids_dtype, check_ids_fit,
                      checked_lengths, is_prompt_column, output_buffer, output_dtype, passthrough, per_row_tensor,
                      pack_token_tensor, presence_flags, token_tensor_specs, unpadded_ragged_names, widened_dtype)

__all__ = ["collate_packed", "pack_on_device", "packed_sizes", "PACKED_NAMES"]

#: The names :func:`collate_packed` writes besides the batch's own columns; a
#: batch column with one of these names is refused.
PACKED_NAMES = ("input_ids", "position_ids", "completion_mask", "cu_seqlens", "max_seqlen",
                "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                "prompt_lengths", "completion_lengths")

_TOKENS = ("prompt_ids", "completion_ids")


def _check_names(batch: Mapping[str, Any]) -> None:
    check_batch_names(batch)
    clash = [n for n in batch if n in PACKED_NAMES]
    if clash:
        raise BatchError(f"the batch has column(s) {clash}, names that collate_packed writes itself; "
                         "rename or drop them")
    if all(batch.get(n) is None for n in _TOKENS):
        raise BatchError("a packed batch needs 'prompt_ids' or 'completion_ids' (the token stream); "
                         "read them with the batch or use collate() for per-row columns only")


def _flat_shape(T: int, batch_dim: bool) -> tuple:
    return (1, T) if batch_dim else (T,)


#: longest row whose constant views (zeros, ones, positions) are kept between calls; longer rows
#: slice theirs per call, which costs nothing next to copying thousands of tokens
_KEEP_VIEWS = 1 << 13


class _Constants:
    """Read-only views ``fill[:n]`` of a constant stream (``0``, ``1``, or the positions
    ``0, 1, 2, ...``), one per length, made once and shared by every call.

    A packed batch joins one such view per row and side (zeros at the prompt positions of
    per-token columns, the 0/1 of ``completion_mask``, ``position_ids``): ~2,000 views for 512
    rows. Looking a prepared view up costs ~0.03 us, slicing a new one ~0.3 us."""

    def __init__(self) -> None:
        self._views: dict = {}

    def views(self, value: Any, dtype: np.dtype, lengths: list, longest: int) -> list:
        key = (value, dtype)
        views = self._views.get(key)
        if views is None or len(views) <= longest:
            size = max(longest + 1, 2 * len(views) if views else 1024)
            fill = np.arange(size, dtype=dtype) if value == "count" else np.full(size, value, dtype=dtype)
            fill.flags.writeable = False
            if longest >= _KEEP_VIEWS:
                return [fill[:n] for n in lengths]
            views = self._views[key] = [fill[:n] for n in range(min(size, _KEEP_VIEWS))]
        return list(map(views.__getitem__, lengths))


_CONSTANTS = _Constants()


class _Rows:
    """One ragged column of the batch, row by row: ``lengths`` (0 where a row has no value) and
    the rows as views (:meth:`views`), whether it came from ``ReplayStore.read`` (one values
    array and its offsets) or ``read_ranges`` (views straight into the segments' maps)."""

    __slots__ = ("col", "lengths", "valid", "dtype", "keep")

    def __init__(self, name: str, col: RaggedColumn) -> None:
        self.col = col
        if isinstance(col, RowRanges):
            lengths, self.dtype = col.lengths, col.dtype  # the store's: one flag per row
            valid = None if col.validity is None else np.asarray(col.validity, dtype=bool)
            self.valid = None if valid is None or valid.all() else valid
        else:
            lengths, self.valid = checked_lengths(name, col)
            self.dtype = np.asarray(col.values).dtype
        if self.valid is not None:
            lengths = np.where(self.valid, lengths, 0)
        self.lengths = lengths

    def views(self) -> list:
        col = self.col
        if isinstance(col, RowRanges):
            return col.row_views()
        values = np.asarray(col.values).reshape(-1)
        offsets = np.asarray(col.offsets, dtype=np.int64).tolist()
        return list(map(values.__getitem__, map(slice, offsets[:-1], offsets[1:])))

    def side(self, lengths: np.ndarray) -> Optional[tuple]:
        """The rows as the compiled kernel reads them: ``(kind, addresses, lengths)``, ``lengths``
        values read at each row's address, zeros in a row whose own length differs (the caller has
        checked that it has none: "not computed"); None when they cannot be read by address (a
        dtype the kernel does not handle, offsets outside the values). ``self`` keeps alive what
        the addresses point into."""
        if self.dtype not in _jit.SUPPORTED:
            return None
        col = self.col
        if isinstance(col, RowRanges):
            at = col.addresses()
            if at is None:
                return None
        else:
            values = np.ascontiguousarray(np.asarray(col.values).reshape(-1))
            offsets = np.asarray(col.offsets, dtype=np.int64)
            if values.dtype != self.dtype or (offsets.size and (offsets[0] < 0 or offsets[-1] > values.size)):
                return None
            self.keep = values
            at = offsets[:-1] * values.itemsize + data_address(values)
        bad = self.lengths != lengths
        if bad.any():
            at = np.where(bad, 0, at)
        return np.empty(0, dtype=self.dtype), at, lengths


def _interleave(first: Optional[list], second: Optional[list]) -> list:
    """Row 0's first piece, row 0's second piece, row 1's first piece, ...; a side that is
    None (no such column) is left out."""
    if first is None:
        return second or []
    if second is None:
        return first
    slots: list = [None] * (2 * len(first))
    slots[0::2], slots[1::2] = first, second
    return slots


def _join(pieces: list, out: np.ndarray) -> None:
    # one C loop writes every output byte once, casting (int32 ids to int64) on the way
    if pieces:
        np.concatenate(pieces, out=out, casting="unsafe")


@_jit.deferring
def collate_packed(batch: Mapping[str, Any], *, batch_dim: bool = True,
                   out: Optional[Mapping[str, torch.Tensor]] = None,
                   ids_dtype: torch.dtype = torch.int64, schema: Any = None) -> dict[str, Any]:
    """Pack a batch read from the store into one padding-free token stream.

    For B rows of prompt lengths p_i and completion lengths c_i (T = sum of
    p_i + c_i tokens):

    * ``input_ids``: int64 (or ``ids_dtype=torch.int32``: half the bytes),
      each row's prompt then its completion, row after row; shape [1, T] (a
      batch of one sequence, what transformers' packed path expects) or [T]
      with ``batch_dim=False``.
    * ``position_ids``: int64, same shape, restarting at 0 for every row.
    * ``cu_seqlens``: int32 [B + 1], where each row starts (``cu_seqlens[i]``)
      and ends (``cu_seqlens[i + 1]``) in the stream; ``max_seqlen``: the
      longest row, a Python int. The same values also under the names that
      transformers' flash-attention path reads (``cu_seq_lens_q``,
      ``cu_seq_lens_k``: the same tensor; ``max_length_q``, ``max_length_k``),
      laid out as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
      lays them out, so ``model(**{k: batch[k] for k in (...)}, use_cache=False)``
      works (only flash-attention reads ``cu_seq_lens_*``; sdpa and eager
      keep rows apart by the ``position_ids`` restarts, and only without a KV
      cache: ``use_cache=True``, the default, lets rows attend to each other).
    * ``completion_mask``: int64 [T], 1 at completion tokens.
    * ``prompt_lengths``, ``completion_lengths``: int64 [B]. Row i's
      completion is ``stream[cu[i] + prompt_lengths[i] : cu[i + 1]]``; to sum a
      per-token loss ``x`` [T] back to rows, ``torch.segment_reduce(x, "sum",
      lengths=cu_seqlens.diff())`` (or ``index_add_`` over
      ``torch.repeat_interleave(torch.arange(B), cu_seqlens.diff())``).
    * every other ragged column as a flat [T] stream aligned with
      ``input_ids``: completion-aligned columns (log-probs...) hold their
      values at the row's completion positions and 0 elsewhere, ``prompt_*``
      columns at the prompt positions. Integers become int64, floats and bools
      keep their dtype. A row flagged "not computed" holds zeros, and then
      ``name + "_present"`` ([B] bool) says which rows have the column, as
      in :func:`~diskreplay.batching.padded.collate`.
    * per-row arrays: [B] (or [B, K]) tensors as in
      :func:`~diskreplay.batching.padded.collate`; lists pass through; ``None`` stays
      ``None``.
    * a per-token tensor column (declared with a ``shape`` in ``schema``, as
      in :func:`~diskreplay.batching.padded.collate`): ``[1, T, *shape]`` (or
      ``[T, *shape]``) in its stored dtype, each row's tensors at its
      completion (``align="completion"``), prompt (``"prompt"``) or first
      ``p_i + c_i - 1`` (``"sequence"``) positions, its ``fill`` elsewhere.

    ``prompt_ids`` and ``completion_ids`` are consumed into ``input_ids`` and
    do not appear under their own names. A completion-aligned column must
    have, in every row where it is computed, as many values as the row has
    completion tokens (a ``BatchError`` names the column and row otherwise).

    ``batch`` is what ``ReplayStore.read`` returns, or ``read_ranges`` (then
    every value is copied once, from the segments' maps straight into the
    stream: what :meth:`Collator.read <diskreplay.batching.collator.Collator.read>`
    does). ``out`` works as in :func:`~diskreplay.batching.padded.collate`
    (caller-owned buffers the output aliases);
    :class:`~diskreplay.batching.collator.Collator` keeps such buffers for you across
    calls.

    >>> b = {"prompt_ids": RaggedColumn.from_arrays([[5, 6], [7]], dtype=np.int32),
    ...      "completion_ids": RaggedColumn.from_arrays([[1], [2, 3]], dtype=np.int32),
    ...      "old_per_token_logps": RaggedColumn.from_arrays([[-.5], [-.25, -1]], dtype=np.float32),
    ...      "advantages": np.array([0.5, -0.5], dtype=np.float32)}
    >>> p = collate_packed(b)
    >>> p["input_ids"].tolist(), p["position_ids"].tolist()
    ([[5, 6, 1, 7, 2, 3]], [[0, 1, 2, 0, 1, 2]])
    >>> p["cu_seqlens"].tolist(), p["max_seqlen"], p["completion_mask"].tolist()
    ([0, 3, 6], 3, [0, 0, 1, 0, 1, 1])
    >>> p["old_per_token_logps"].tolist(), p["advantages"].tolist()
    ([0.0, 0.0, -0.5, 0.0, -0.25, -1.0], [0.5, -0.5])
    >>> collate_packed(b, ids_dtype=torch.int32)["input_ids"].dtype
    torch.int32
    """
    ids_dtype = check_ids_dtype(ids_dtype)
    _check_names(batch)
    B = batch_rows(batch)
    tensors = token_tensor_specs(batch, schema)
    rows = {name: _Rows(name, col) for name, col in batch.items()
            if isinstance(col, RaggedColumn) and name not in tensors}
    prompt, completion = rows.get("prompt_ids"), rows.get("completion_ids")
    zero = np.zeros(B, dtype=np.int64)
    plen = zero if prompt is None else prompt.lengths
    clen = zero if completion is None else completion.lengths
    seq = plen + clen
    cu = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(seq, out=cu[1:])
    T = int(cu[-1])
    max_seqlen = int(seq.max()) if B else 0
    # per side: lengths as a list (indexes the constant views), the longest, and whether the batch
    # has that side at all (a side without its ids column adds no pieces)
    sides = {True: (plen.tolist(), int(plen.max()) if B else 0, prompt is not None),
             False: (clen.tolist(), int(clen.max()) if B else 0, completion is not None)}
    zeros: dict = {}

    def constant(value: Any, dtype: np.dtype, prompt_side: bool) -> Optional[list]:
        lengths, longest, present = sides[prompt_side]
        if not present:
            return None
        key = (value, dtype, prompt_side)
        hit = zeros.get(key)
        if hit is None:
            hit = zeros[key] = _CONSTANTS.views(value, dtype, lengths, longest)
        return hit

    def token_views(side: Optional[_Rows]) -> Optional[list]:
        if side is None:
            return None
        views = side.views()
        if side.valid is not None:  # a row without ids adds no tokens, whatever its stored range
            empty = np.zeros(0, dtype=side.dtype)
            for i in np.flatnonzero(~side.valid).tolist():
                views[i] = empty
        return views

    # None while numba starts in a new process (see _jit.kernels_now): this batch takes the numpy path
    kernels = _jit.kernels_now() if T else None
    nothing = np.zeros(B, dtype=np.int64)

    def compiled(target: np.ndarray, first: Optional[tuple], second: Optional[tuple]) -> bool:
        # one compiled pass writes the column (False: the numpy path must); callers ask only with
        # kernels, so that without them no addresses are computed
        if first is None or second is None or target.dtype not in _jit.SUPPORTED:
            return False
        kernels.stream(target, cu, *first, *second)
        return True

    def zeros_of(side_lengths: np.ndarray, dtype: np.dtype) -> tuple:
        return np.empty(0, dtype=dtype), nothing, side_lengths

    def kernel_side(side: Optional[_Rows], side_lengths: np.ndarray, dtype: np.dtype) -> Optional[tuple]:
        return zeros_of(side_lengths, dtype) if side is None else side.side(side_lengths)

    def per_token_sides(r: _Rows, is_prompt: bool, dtype: np.dtype) -> tuple:
        # the column's values on its own side (zeros if the batch has no ids there), zeros on the other
        mine = kernel_side(r if sides[is_prompt][2] else None, plen if is_prompt else clen, dtype)
        theirs = zeros_of(clen if is_prompt else plen, dtype)
        return (mine, theirs) if is_prompt else (theirs, mine)

    result: dict[str, Any] = {}
    for side in (prompt, completion):
        if side is not None and not isinstance(side.col, RowRanges):  # the store's ids are int32
            check_ids_fit("input_ids", np.asarray(side.col.values), ids_dtype)
    ids = output_buffer(out, "input_ids", _flat_shape(T, batch_dim), ids_dtype)
    ids_np = ids.numpy().reshape(-1)
    if kernels is None or not compiled(ids_np, kernel_side(prompt, plen, ids_np.dtype),
                                       kernel_side(completion, clen, ids_np.dtype)):
        _join(_interleave(token_views(prompt), token_views(completion)), ids_np)
    pos = output_buffer(out, "position_ids", _flat_shape(T, batch_dim), torch.int64)
    mask = output_buffer(out, "completion_mask", (T,), torch.int64)
    if kernels is not None:
        kernels.layout(pos.numpy().reshape(-1), mask.numpy(), cu, plen)
    else:
        _join(_CONSTANTS.views("count", np.dtype(np.int64), seq.tolist(), max_seqlen), pos.numpy().reshape(-1))
    if B and kernels is None:
        # 0 over each prompt, 1 over each completion: np.repeat of a 0/1 pattern makes the mask in
        # one C loop as int8, and one streaming copy widens it (half the time of joining 2 pieces
        # a row into the int64 buffer, measured with cold caches)
        pattern = np.zeros(2 * B, dtype=np.int8)
        pattern[1::2] = 1
        counts = np.empty(2 * B, dtype=np.int64)
        counts[0::2], counts[1::2] = plen, clen
        np.copyto(mask.numpy(), np.repeat(pattern, counts))
    cu_t = output_buffer(out, "cu_seqlens", (B + 1,), torch.int32)
    np.copyto(cu_t.numpy(), cu, casting="unsafe")
    lengths = {}
    for name, value in (("prompt_lengths", plen), ("completion_lengths", clen)):
        lengths[name] = output_buffer(out, name, (B,), torch.int64)
        np.copyto(lengths[name].numpy(), value)
    result.update(input_ids=ids, position_ids=pos, completion_mask=mask, cu_seqlens=cu_t,
                  max_seqlen=max_seqlen, cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t,
                  max_length_q=max_seqlen, max_length_k=max_seqlen, **lengths)

    for name, col in batch.items():
        if name in _TOKENS:
            # which rows hold their prompt (completion) at all: an uncomputed one packs as an empty one
            flag = presence_flags(out, name, col, B) if isinstance(col, RaggedColumn) else None
            if flag is not None:
                result[name + PRESENT_SUFFIX] = flag
            continue
        if col is None:
            result[name] = None
        elif name in tensors:
            result[name] = pack_token_tensor(name, col, tensors[name], batch, B, cu, batch_dim, out)
            flag = presence_flags(out, name, col, B)
            if flag is not None:
                result[name + PRESENT_SUFFIX] = flag
        elif isinstance(col, RaggedColumn):
            r = rows[name]
            is_prompt = is_prompt_column(name)
            side = plen if is_prompt else clen
            ok = r.lengths == side
            all_ok = np.count_nonzero(ok) == B
            if not all_ok:
                # rows "not computed" have length 0 here; any other mismatch is an error
                bad = np.flatnonzero(~ok & (r.lengths != 0))
                ids = "prompt_ids" if is_prompt else "completion_ids"
                if bad.size and ids not in batch:
                    raise BatchError(f"the packed layout lays {name!r} along the {ids[:-4]} tokens, and the batch "
                                     f"has no {ids!r}: read {ids!r} with it (columns=[..., {ids!r}])")
                if bad.size:
                    i = int(bad[0])
                    raise BatchError(
                        f"column {name!r}, row {i}: {int(r.lengths[i])} values for {int(side[i])} "
                        f"{'prompt' if is_prompt else 'completion'} tokens; a per-token column must have "
                        "one value per token of its side")
            t = output_buffer(out, name, (T,), output_dtype(r.dtype))
            target = t.numpy()
            if kernels is None or not compiled(target, *per_token_sides(r, is_prompt, target.dtype)):
                own = None
                if sides[is_prompt][2]:  # else no ids on this side: every row is empty there
                    own = r.views()
                    # zeros in rows without values, whatever their stored range
                    if not all_ok or r.valid is not None:
                        fix = ~ok if r.valid is None else ~ok | ~r.valid
                        filler = constant(0, r.dtype, is_prompt)
                        for i in np.flatnonzero(fix).tolist():
                            own[i] = filler[i]
                other = constant(0, r.dtype, not is_prompt)
                _join(_interleave(own, other) if is_prompt else _interleave(other, own), target)
            result[name] = t
            flag = presence_flags(out, name, col, B)
            if flag is not None:
                result[name + PRESENT_SUFFIX] = flag
        elif isinstance(col, np.ndarray) and col.dtype.kind in "biuf":
            result[name] = per_row_tensor(name, col, out)
        else:
            result[name] = passthrough(col)
    return result


# --------------------------------------------------------------------------
# device path
# --------------------------------------------------------------------------

def _lengths(unpadded: Mapping[str, Any], name: str, B: int, device) -> torch.Tensor:
    off = unpadded.get(name + OFFSETS_SUFFIX)
    if off is None:
        return torch.zeros(B, dtype=torch.int64, device=device)
    off = off.to(device=device, dtype=torch.int64)
    return off[1:] - off[:-1]


def _rows_of(unpadded: Mapping[str, Any]) -> int:
    for name in unpadded_ragged_names(unpadded):
        return unpadded[name + OFFSETS_SUFFIX].numel() - 1
    raise BatchError("a packed batch needs 'prompt_ids' or 'completion_ids' (the token stream); "
                     "pass what collate_unpadded returned for a batch that has them")


def packed_sizes(unpadded: Mapping[str, Any]) -> dict[str, int]:
    """``{"tokens": T, "max_seqlen": m}`` of the packed batch that
    :func:`pack_on_device` builds from ``unpadded`` (:func:`~diskreplay.batching.padded.collate_unpadded`'s
    output), and a check that every per-token column is aligned with its side.

    Called on the host offsets before they are moved, it lets
    :func:`pack_on_device` run without reading anything back from the device.

    >>> from diskreplay.batching.padded import collate_unpadded
    >>> b = {"prompt_ids": RaggedColumn.from_arrays([[5, 6], [7]], dtype=np.int32),
    ...      "completion_ids": RaggedColumn.from_arrays([[1], [2, 3]], dtype=np.int32)}
    >>> packed_sizes(collate_unpadded(b))
    {'tokens': 6, 'max_seqlen': 3}
    """
    _check_names(unpadded)
    B = _rows_of(unpadded)
    device = unpadded[unpadded_ragged_names(unpadded)[0] + OFFSETS_SUFFIX].device
    side = {True: _lengths(unpadded, "prompt_ids", B, device), False: _lengths(unpadded, "completion_ids", B, device)}
    for name in unpadded_ragged_names(unpadded):
        if name in _TOKENS:
            continue
        lens, want = _lengths(unpadded, name, B, device), side[is_prompt_column(name)]
        bad = torch.nonzero((lens != want) & (lens != 0))
        if bad.numel():
            i = int(bad[0, 0])
            raise BatchError(f"column {name!r}, row {i}: {int(lens[i])} values for {int(want[i])} "
                             f"{'prompt' if is_prompt_column(name) else 'completion'} tokens; a per-token column "
                             "must have one value per token of its side")
    seq = side[True] + side[False]
    return {"tokens": int(seq.sum()), "max_seqlen": int(seq.max()) if B else 0}


def _scatter_index(offsets: torch.Tensor, n: int, row_start: torch.Tensor) -> torch.Tensor:
    """Stream position of each of the ``n`` packed values: value j of row r goes
    to ``row_start[r] + (j - offsets[r])``. ``output_size`` keeps
    ``repeat_interleave`` free of a device sync."""
    offsets = offsets.to(device=row_start.device, dtype=torch.int64)
    B = row_start.numel()
    rows = torch.repeat_interleave(torch.arange(B, device=row_start.device), offsets[1:] - offsets[:-1],
                                   output_size=n)
    return torch.arange(n, device=row_start.device) + (row_start - offsets[:-1])[rows]


def pack_on_device(unpadded: Mapping[str, Any], *, sizes: Optional[Mapping[str, int]] = None,
                   batch_dim: bool = True, ids_dtype: torch.dtype = torch.int64) -> dict[str, Any]:
    """Build :func:`collate_packed`'s batch with torch ops on the device of
    ``unpadded`` (:func:`~diskreplay.batching.padded.collate_unpadded`'s output).

    The result equals ``collate_packed`` of the same batch (same names,
    dtypes, values). Without ``sizes`` (:func:`packed_sizes` of the host
    tensors, taken before they were moved) the total token count and the
    longest row are read back from the device once; with it nothing waits.
    ``ids_dtype`` as in :func:`collate_packed`.

    >>> from diskreplay.batching.padded import collate_unpadded
    >>> b = {"prompt_ids": RaggedColumn.from_arrays([[5, 6], [7]], dtype=np.int32),
    ...      "completion_ids": RaggedColumn.from_arrays([[1], [2, 3]], dtype=np.int32)}
    >>> p = pack_on_device(collate_unpadded(b))
    >>> p["input_ids"].tolist(), p["completion_mask"].tolist()
    ([[5, 6, 1, 7, 2, 3]], [0, 0, 1, 0, 1, 1])
    """
    ids_dtype = check_ids_dtype(ids_dtype)
    if sizes is None:
        sizes = packed_sizes(unpadded)
    else:
        _check_names(unpadded)
    T, max_seqlen = int(sizes["tokens"]), int(sizes["max_seqlen"])
    B = _rows_of(unpadded)
    device = unpadded[unpadded_ragged_names(unpadded)[0] + OFFSETS_SUFFIX].device
    plen = _lengths(unpadded, "prompt_ids", B, device)
    clen = _lengths(unpadded, "completion_ids", B, device)
    seq = plen + clen
    cu = torch.zeros(B + 1, dtype=torch.int64, device=device)
    torch.cumsum(seq, 0, out=cu[1:])
    starts = {True: cu[:-1], False: cu[:-1] + plen}
    token_row = torch.repeat_interleave(torch.arange(B, device=device), seq, output_size=T)
    pos = torch.arange(T, device=device) - cu[:-1][token_row]
    comp = pos >= plen[token_row]

    ids = torch.empty(T, dtype=ids_dtype, device=device)
    for name in _TOKENS:
        values = unpadded.get(name)
        if values is not None:
            index = _scatter_index(unpadded[name + OFFSETS_SUFFIX], values.numel(), starts[is_prompt_column(name)])
            ids[index] = values.to(ids_dtype)
    shape = _flat_shape(T, batch_dim)
    cu32 = cu.to(torch.int32)
    result: dict[str, Any] = {
        "input_ids": ids.view(shape), "position_ids": pos.view(shape), "completion_mask": comp.to(torch.int64),
        "cu_seqlens": cu32, "max_seqlen": max_seqlen, "cu_seq_lens_q": cu32, "cu_seq_lens_k": cu32,
        "max_length_q": max_seqlen, "max_length_k": max_seqlen, "prompt_lengths": plen, "completion_lengths": clen}
    ragged = set(unpadded_ragged_names(unpadded))
    for name, value in unpadded.items():
        if name in _TOKENS or name.endswith(OFFSETS_SUFFIX) and name[:-len(OFFSETS_SUFFIX)] in ragged:
            continue
        if name in ragged:
            col = torch.zeros(T, dtype=widened_dtype(value.dtype), device=device)
            index = _scatter_index(unpadded[name + OFFSETS_SUFFIX], value.numel(), starts[is_prompt_column(name)])
            col[index] = value.to(col.dtype)
            result[name] = col
        else:
            result[name] = value
    return result
