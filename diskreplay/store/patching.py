"""Values for committed rows: a patch file made from ``ReplayStore.update``'s arguments, and reads
through the patches a manifest names (docs/FORMAT.md, "Patches").

A patch is an immutable Arrow file beside the segments: the patched rows (``ROW``, ascending)
and their new values of a few columns. A read takes each row's value from the newest patch
holding it, else from its segment: :class:`PatchReader` keeps, per column, the rows the
manifest's patches hold (newest wins) and overlays them on what the segments gave. A merge or
``compact`` writes the overlaid values into the new segments and drops the patches it folded.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import pyarrow as pa

from .. import format as fmt
from .._fileio import boot_clock, crash_point, crc32c
from ..errors import ArgumentError, BatchError, ColumnNotFoundError
from ..ingest import normalize_batch
from ..ragged import RaggedColumn
from ..schema import COMPLETION_IDS, PROMPT_IDS, RAGGED, Schema, late_column_problem
from ..segment import encode_ipc
from . import ops
from .commits import Commit
from .writing import fresh_id

ROW = fmt.PATCH_ROW


# ------------------------------------------------------------------ writing


def prepare_update(cache: Any, view: Any, rows: Any, values: Mapping[str, Any], version: Optional[str] = None,
                   meta: Optional[Mapping[str, Any]] = None) -> Tuple[pa.RecordBatch, List[Any]]:
    """:func:`patch_record` of ``ReplayStore.update``'s arguments, read through ``cache`` (a
    ``SegmentCache``) at ``view``: the rows must be distinct and live; a ``version`` names
    columns whose rows may be "not computed" (float and per-token columns), with a small ``meta``."""
    check_version(version, meta)
    ids, _, _ = cache.locate(view, rows)  # (refuses evicted rows and those of holes, naming one)
    if not len(ids):
        raise ArgumentError("rows is empty: an update names the rows whose values it writes")
    check_distinct(ids)

    record, new = patch_record(ids, values, view.schema, view.group_key,
                               lambda of, column: cache.remapping(lambda: cache.row_lengths(view, of, column)))
    if version is not None:
        specs = {s.name: s for s in new}
        for name in record.schema.names[1:]:
            why = late_column_problem(specs.get(name) or view.schema[name])
            if why is not None:
                raise ArgumentError(f"update(version={version!r}) of column {name!r}: {why}; a version is read as "
                                    "'column@version', \"not computed\" in the rows it does not hold")
    return record, new


MAX_META_BYTES = 4096


def check_version(version: Optional[str], meta: Optional[Mapping[str, Any]]) -> None:
    """Refuse a version name or ``meta`` a manifest cannot hold (naming the rule)."""
    if version is None:
        if meta is not None:
            raise ArgumentError("meta describes a version: pass version='name' with it")
        return
    why = fmt.version_problem(version)
    if why is not None:
        raise ArgumentError(f"version: {why}")
    if meta is not None:
        try:
            size = len(fmt.canonical_json(dict(meta)))
        except (TypeError, ValueError) as exc:
            raise ArgumentError(f"meta must be a JSON object (str keys; str, number, bool, list values): {exc}") from None
        if size > MAX_META_BYTES:
            raise ArgumentError(f"meta is {size} bytes as JSON; a version's meta holds at most {MAX_META_BYTES}")


def patch_record(rows: np.ndarray, values: Mapping[str, Any], schema: Optional[Schema], group_key: Optional[str],
                 lengths: Any) -> Tuple[pa.RecordBatch, List[Any]]:
    """``(the patch file's record batch, the new columns it adds)`` for ``values`` of ``rows``
    (distinct live row ids, any order), validated before anything is written.

    ``lengths(rows, column)`` gives the rows' numbers of prompt or completion tokens (``column``
    ``prompt_ids`` / ``completion_ids``), which a per-token value must match.
    """
    if not isinstance(values, Mapping) or not values:
        raise ArgumentError(f"values must be a non-empty dict of column -> one value per row, got {values!r:.80}")
    if schema is None:
        raise ArgumentError("the store has no rows yet: update writes values for committed rows")
    for name in values:
        if name in (group_key, PROMPT_IDS, COMPLETION_IDS, ROW):
            raise ArgumentError(f"column {name!r} cannot be updated: "
                                + ("it is the group key, which the group index is built from" if name == group_key
                                   else f"{name!r} is reserved" if name == ROW
                                   else "a row's token ids are what the row is (append a new row instead)"))
    for name in values:
        if name in schema and schema[name].media:
            raise ArgumentError(f"column {name!r} cannot be updated: it is a media column, whose rows name blobs "
                                "stored once per content (append a new row with the new media instead)")
    existing = [c for c in values if c in schema]
    sub = Schema([schema[c] for c in existing], {c: schema.late[c] for c in existing if c in schema.late})
    try:
        record, got = normalize_batch(values, sub, None)
    except BatchError as exc:
        raise type(exc)(f"update: {exc}") from None
    if record.num_rows != len(rows):
        raise BatchError(f"update: the values hold {record.num_rows} rows but rows names {len(rows)}; give one value "
                         "per row of each column")
    specs = {c: got[c] for c in existing}
    new = []
    for spec in got.pending():  # a new per-token column aligns with the row's tokens, as in an append's batch
        if spec.kind == RAGGED and spec.align is None:
            ref = PROMPT_IDS if spec.name.startswith("prompt_") else COMPLETION_IDS
            if ref in schema:
                spec = dataclasses.replace(spec, align="prompt" if ref == PROMPT_IDS else "completion")
        new.append(spec)
        specs[spec.name] = spec
    for name in record.schema.names:
        spec = specs[name]
        arr = record.column(name)
        if spec.kind != RAGGED or spec.align is None:
            continue
        refs = {"prompt": (PROMPT_IDS,), "sequence": (PROMPT_IDS, COMPLETION_IDS)}.get(spec.align, (COMPLETION_IDS,))
        if any(ref not in schema for ref in refs):
            continue
        want = sum(np.asarray(lengths(rows, ref), dtype=np.int64) for ref in refs)
        if spec.align == "sequence":
            want = np.maximum(want - 1, 0)  # (vLLM's routed experts: the last token was never fed forward)
        values = np.diff(arr.offsets.to_numpy())
        size = spec.token_size if spec.shape is not None else 1
        have = values // size
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        bad = ((have != want) | (values % size != 0)) & valid
        if bad.any():
            i = int(np.argmax(bad))
            unit = f"tensors of {list(spec.shape)} ({size} values each)" if spec.shape is not None else "values"
            raise BatchError(f"update: column {name!r} row {int(rows[i])} has {values[i]} values ({have[i]} {unit}) "
                             f"but the row has {want[i]} {spec.align} tokens; a per-token value has one per token")
    order = np.argsort(rows, kind="stable")
    if not np.all(order[1:] > order[:-1]):
        record = record.take(pa.array(order))
    row_col = pa.array(rows[order], pa.int64())
    out = pa.RecordBatch.from_arrays([row_col, *record.columns], [ROW, *record.schema.names])
    return out, new


def patch_entry(patch_id: int, record: pa.RecordBatch, data: pa.Buffer, version: Optional[str] = None,
                meta: Optional[Mapping[str, Any]] = None) -> fmt.PatchEntry:
    """The manifest entry of ``record`` written as ``data`` under ``patch_id``."""
    rows = record.column(0)
    return fmt.PatchEntry(patch_id, rows[0].as_py(), rows[len(rows) - 1].as_py() + 1, len(rows), data.size,
                          crc32c(data), tuple(record.schema.names[1:]), version,
                          None if version is None or not meta else dict(meta))


def commit_patch(at: Any, record: pa.RecordBatch, new_columns: List[Any], token: Optional[str],
                 version: Optional[str] = None, meta: Optional[Mapping[str, Any]] = None) -> int:
    """Write ``record`` (from :func:`patch_record`) as a patch file and commit it through the
    writer state ``at`` (a ``WriterContext``), exactly once with ``token``; returns the number of
    rows patched (a retry of a committed token writes nothing and returns the same)."""
    committer, storage = at.committer, at.committer.storage
    n = record.num_rows
    dig = fmt.batch_digest(record) if token is not None else 0
    if token is not None and version is not None:  # a retry names the same version
        dig = (dig * 31 + crc32c(fmt.canonical_json([version, dict(meta or {})]))) % (1 << 63)
    if token is not None:
        rec = committer.find_token(token)
        if rec is not None:
            return _replayed(committer, rec, record, dig)
    options = at.options
    if not options.patches or (new_columns and not options.late_columns):
        options = mark_patches(at, bool(new_columns))
    data = encode_ipc(record)
    started = boot_clock()
    first = at.manifest.next_segment
    if at.reserves_ids:  # many writers, object storage: the first free name, created only if absent
        patch_id, rel = fresh_id(committer, at.manifest,
                                 lambda i: storage.link_candidates(fmt.patch_file, data, i, step="segments"))
        try:
            storage.sync_dir(fmt.SEGMENT_DIR)
            crash_point("segments.synced")
        except BaseException:
            committer.remove_files([rel])
            raise
        writes: Tuple[Any, ...] = ()
    else:  # one writer: written and made durable with the manifest's file, in one wait
        patch_id, rel = first, fmt.patch_file(first)
        writes = ((rel, data, "segments"),)
    entry = patch_entry(patch_id, record, data, version, meta)
    rec = fmt.TokenRecord(token, entry.first_row, entry.end_row - entry.first_row, dig, 1) if token else None
    op = ops.Patch(entry, rec, tuple(new_columns))
    result = committer.commit(Commit(op, (rel,), writes, (fmt.SEGMENT_DIR,) if writes else (), started),
                              install=lambda new: at.install(new, options))
    if result.duplicate is not None:
        if result.manifest.generation != at.manifest.generation:
            at.install(result.manifest, options)
        return _replayed(committer, result.duplicate, record, dig)
    at.collect()
    return n


def _replayed(committer: Any, rec: fmt.TokenRecord, record: pa.RecordBatch, dig: int) -> int:
    """A retry of a committed update: the same values, else an error naming the token's commit."""
    rows = record.column(0).to_numpy()
    if rec.digest != dig or rec.first_row != int(rows[0]) or rec.end_row != int(rows[-1]) + 1:
        raise BatchError(f"token {rec.token!r} is committed (generation {rec.generation}) for another batch or update "
                         "than this one: a retry must give the same rows and values, and a new update takes a "
                         "token of its own")
    committer.durable_replay(rows)
    return len(rows)


def mark_patches(at: Any, late: bool) -> fmt.StoreOptions:
    """Say in FORMAT.json, before the first commit that names a patch (or adds a column by one),
    that the store may have them, so that a diskreplay without them refuses the store rather than
    misreading it (every writer writes the same document: concurrent ones agree)."""
    storage = at.committer.storage
    marked = dataclasses.replace(at.options.with_stored_flags(storage), patches=True,
                                 late_columns=at.options.late_columns or late)
    doc = dataclasses.replace(marked, schema=None) if marked.multi_writer else marked
    storage.replace(fmt.FORMAT_FILE, fmt.signed_bytes(doc.body()), step="format")
    crash_point("format.done")
    return marked


# ------------------------------------------------------------------ reading


class _Hits:
    """Which rows of a read some patch holds a value of one column for: ``at`` (positions in the
    read), and for each the patch (``which``, an index into the manifest's patches) and the
    position in its file (``pos``)."""

    __slots__ = ("at", "which", "pos")

    def __init__(self, at: np.ndarray, which: np.ndarray, pos: np.ndarray) -> None:
        self.at, self.which, self.pos = at, which, pos

    def by_patch(self):
        """``(patch index, positions in the read, positions in its file)`` per patch."""
        if not len(self.at):
            return
        for w in np.unique(self.which).tolist():
            sel = self.which == w
            yield w, self.at[sel], self.pos[sel]


class PatchReader:
    """The patch files of one store (each opened, checked and parsed once) and, per column, which
    rows the newest manifest's patches hold."""

    def __init__(self, storage: Any, verify_reads: bool) -> None:
        self.storage, self.verify_reads = storage, verify_reads
        self._files: Dict[fmt.PatchEntry, pa.RecordBatch] = {}
        self._for: Tuple[fmt.PatchEntry, ...] = ()
        self._index: Dict[Any, Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._ragged: Dict[Tuple[fmt.PatchEntry, str], Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]] = {}
        self._numeric: Dict[Tuple[fmt.PatchEntry, str, np.dtype], np.ndarray] = {}

    def record(self, entry: fmt.PatchEntry) -> pa.RecordBatch:
        """The patch's rows and values (its file mapped, checked against its checksum once)."""
        got = self._files.get(entry)
        if got is None:
            got = self._files[entry] = read_patch(self.storage, entry, self.verify_reads)
        return got

    def ragged(self, entry: fmt.PatchEntry, name: str) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """``(values, offsets, validity)`` of a patch's ragged column (made once)."""
        key = (entry, name)
        got = self._ragged.get(key)
        if got is None:
            got = self._ragged[key] = _ragged_arrays(self.record(entry).column(name))
        return got

    def numeric(self, entry: fmt.PatchEntry, name: str, dtype: np.dtype) -> np.ndarray:
        """A patch's per-row column as numpy of ``dtype``, NaN where null (made once)."""
        key = (entry, name, np.dtype(dtype))
        got = self._numeric.get(key)
        if got is None:
            got = self._numeric[key] = numeric_values(self.record(entry).column(name), dtype)
        return got

    def _column_index(self, patches: Tuple[fmt.PatchEntry, ...], name: str, version: Optional[str] = None
                      ) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(rows ascending, patch index, position in its file)`` of every row a patch holds ``name``
        for, the newest patch's where several do; None when none does. ``version``: only the
        patches of that name, folded or not (else only those not folded)."""
        if patches is not self._for:
            if patches != self._for:
                self._index = {}
                live = set(patches)
                self._files = {e: r for e, r in self._files.items() if e in live}
                self._ragged = {k: v for k, v in self._ragged.items() if k[0] in live}
                self._numeric = {k: v for k, v in self._numeric.items() if k[0] in live}
            self._for = patches
        key = name if version is None else (name, version)
        if key in self._index:
            return self._index[key]
        holders = [i for i, p in enumerate(patches) if name in p.columns and (
            not p.folded if version is None else p.version == version)]
        if not holders:
            self._index[key] = None  # type: ignore[assignment]
            return None
        rows = [self.record(patches[i]).column(0).to_numpy() for i in holders]
        all_rows = np.concatenate(rows)
        which = np.repeat(np.array(holders, dtype=np.int64), [len(r) for r in rows])
        pos = np.concatenate([np.arange(len(r), dtype=np.int64) for r in rows])
        order = np.lexsort((which, all_rows))  # by row, then oldest patch first
        all_rows, which, pos = all_rows[order], which[order], pos[order]
        last = np.ones(len(all_rows), dtype=bool)  # the newest patch of each row
        last[:-1] = all_rows[1:] != all_rows[:-1]
        got = self._index[key] = (all_rows[last], which[last], pos[last])
        return got

    def hits(self, patches: Tuple[fmt.PatchEntry, ...], name: str, rows: np.ndarray,
             version: Optional[str] = None) -> Optional[_Hits]:
        """Where a patch holds ``name`` for some of ``rows`` (None: for none of them); ``version``:
        a patch of that name."""
        index = self._column_index(patches, name, version)
        if index is None or not len(rows):
            return None
        held, which, pos = index
        if rows.max() < held[0] or rows.min() > held[-1]:
            return None
        i = np.searchsorted(held, rows)
        i[i == len(held)] = 0
        hit = held[i] == rows
        if not hit.any():
            return None
        at = np.flatnonzero(hit)
        return _Hits(at, which[i[at]], pos[i[at]])

    def read_hits(self, manifest: fmt.Manifest, cols: List[str], rows: np.ndarray) -> Dict[str, _Hits]:
        """For each of ``cols`` that patches hold values of for some of ``rows``, where."""
        out = {}
        for name in cols:
            hits = self.hits(manifest.patches, name, rows)
            if hits is not None:
                out[name] = hits
        return out

    def overlay(self, manifest: fmt.Manifest, schema: Schema, rows: np.ndarray, out: Dict[str, Any],
                read_hits: Optional[Dict[str, _Hits]] = None) -> None:
        """Replace, in a read's columns ``out`` of ``rows``, the values that patches hold
        (``read_hits``: :meth:`read_hits` of that read, if known)."""
        patches = manifest.patches
        if read_hits is None:
            read_hits = self.read_hits(manifest, list(out), rows)
        for name, hits in read_hits.items():
            spec = schema[name]
            if spec.kind == RAGGED:
                arrays = {w: self.ragged(patches[w], name) for w in np.unique(hits.which).tolist()}
                out[name] = overlay_ragged(out[name], len(rows), hits, arrays, np.dtype(spec.dtype))
                continue
            if spec.dtype == "string":
                res = list(out[name])
                for w, at, pos in hits.by_patch():
                    vals = self.record(patches[w]).column(name).take(pa.array(pos)).to_pylist()
                    for i, v in zip(at.tolist(), vals):
                        res[i] = v
                out[name] = res
            else:
                arr = out[name]
                for w, at, pos in hits.by_patch():
                    arr[at] = self.numeric(patches[w], name, arr.dtype)[pos]

    def version_column(self, manifest: fmt.Manifest, schema: Schema, name: str, rows: np.ndarray) -> Any:
        """``"column@version"`` of ``rows``: the values the newest patch of that version holds for
        each row, "not computed" (NaN, a null row) where none does."""
        column, _, version = name.rpartition("@")
        have = versions_of(manifest, column)
        if version not in have:
            raise ColumnNotFoundError(f"column {column!r} has no version {version!r} (its versions: {sorted(have)})")
        spec = schema[column]
        hits = self.hits(manifest.patches, column, rows, version)
        if hits is None:
            hits = _Hits(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        if spec.kind == RAGGED:
            arrays = {w: self.ragged(manifest.patches[w], column) for w in np.unique(hits.which).tolist()}
            return overlay_ragged(None, len(rows), hits, arrays, np.dtype(spec.dtype))
        out = np.full((len(rows),) + ((spec.width,) if spec.width else ()), np.nan, dtype=np.dtype(spec.dtype))
        for w, at, pos in hits.by_patch():
            out[at] = self.numeric(manifest.patches[w], column, out.dtype)[pos]
        return out

    def fold(self, manifest: fmt.Manifest, schema: Schema, record: pa.RecordBatch, first_row: int) -> pa.RecordBatch:
        """``record`` (rows ``first_row, first_row + 1, ...`` of a merge, conformed to ``schema``)
        with the values the patches of ``manifest`` hold for its rows written in."""
        if not manifest.patches:
            return record
        rows = np.arange(first_row, first_row + record.num_rows, dtype=np.int64)
        arrays = list(record.columns)
        changed = False
        for k, name in enumerate(record.schema.names):
            hits = self.hits(manifest.patches, name, rows)
            if hits is None:
                continue
            changed = True
            spec = schema[name]
            arr = record.column(k)
            sources = {w: self.record(manifest.patches[w]).column(name) for w in np.unique(hits.which).tolist()}
            if spec.kind == RAGGED:
                parts = {w: self.ragged(manifest.patches[w], name) for w in sources}
                col = overlay_ragged(arrow_ragged(arr), len(rows), hits, parts, np.dtype(spec.dtype))
                arrays[k] = ragged_arrow(col, arr.type, len(rows))
            else:
                arrays[k] = _fold_per_row(arr, hits, sources)
        return pa.RecordBatch.from_arrays(arrays, schema=record.schema) if changed else record


def read_patch(storage: Any, entry: fmt.PatchEntry, check: bool = True) -> pa.RecordBatch:
    """A patch file's record batch, memory-mapped where the storage maps files (:func:`fmt.parse_patch`)."""
    path = storage.local_path(entry.file, entry.bytes)
    with pa.memory_map(path) as source:
        buf = source.read_buffer()
    return fmt.parse_patch(buf, entry, f"{storage.url}/{entry.file}", check)


# ------------------------------------------------------------------ values


def numeric_values(arr: pa.Array, dtype: np.dtype) -> np.ndarray:
    """A per-row (scalar or fixed-width vector) Arrow column as numpy, NaN where null (floats)."""
    if pa.types.is_fixed_size_list(arr.type):
        flat = arr.flatten().to_numpy(zero_copy_only=False)
        out = flat.reshape(len(arr), arr.type.list_size).astype(dtype, copy=False)
    else:
        out = arr.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    if arr.null_count:
        out = out.astype(dtype, copy=True)
        out[~arr.is_valid().to_numpy(zero_copy_only=False)] = np.nan
    return out


def _fold_per_row(arr: pa.Array, hits: _Hits, sources: Mapping[int, pa.Array]) -> pa.Array:
    """A segment's per-row column with the patched rows' values (nulls kept as nulls)."""
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        res = arr.to_pylist()
        for w, at, pos in hits.by_patch():
            for i, v in zip(at.tolist(), sources[w].take(pa.array(pos)).to_pylist()):
                res[i] = v
        return pa.array(res, arr.type)
    valid = arr.is_valid().to_numpy(zero_copy_only=False).copy()
    if pa.types.is_fixed_size_list(arr.type):
        item = arr.type.value_type.to_pandas_dtype()
        vals = np.array(numeric_values(arr, np.dtype(item)))
    else:
        vals = np.array(numeric_values(arr, np.dtype(arr.type.to_pandas_dtype())))
    for w, at, pos in hits.by_patch():
        src = sources[w]
        vals[at] = numeric_values(src, vals.dtype)[pos]
        valid[at] = src.is_valid().to_numpy(zero_copy_only=False)[pos]
    mask = None if valid.all() else pa.array(~valid)
    if pa.types.is_fixed_size_list(arr.type):
        flat = pa.array(np.nan_to_num(vals).reshape(-1), arr.type.value_type)
        out = pa.FixedSizeListArray.from_arrays(flat, arr.type.list_size)
        return out if mask is None else pa.array(out.to_pylist(), arr.type, mask=~valid)
    return pa.array(vals, arr.type, mask=None if mask is None else ~valid)


def arrow_ragged(arr: pa.Array) -> Optional[RaggedColumn]:
    """A large-list Arrow column as a :class:`RaggedColumn` (None when every row is null)."""
    if arr.null_count == len(arr):
        return None
    vals, offs, valid = _ragged_arrays(arr)
    return RaggedColumn(vals[int(offs[0]):int(offs[-1])], offs - offs[0], valid)


def ragged_arrow(col: Optional[RaggedColumn], arrow_type: pa.DataType, n: int) -> pa.Array:
    """:func:`arrow_ragged`'s inverse."""
    if col is None:
        return pa.nulls(n, arrow_type)
    mask = None if col.validity is None else pa.array(~np.asarray(col.validity, dtype=bool))
    return pa.LargeListArray.from_arrays(pa.array(np.asarray(col.offsets, dtype=np.int64)),
                                         pa.array(col.values, arrow_type.value_type), mask=mask)


def _ragged_arrays(arr: pa.Array) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """``(values, offsets, validity or None)`` of a large-list Arrow column, zero-copy where it can."""
    offs = arr.offsets.to_numpy()
    vals = arr.values.to_numpy(zero_copy_only=False)
    return vals, offs, (arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else None)


def overlay_ragged(col: Any, n: int, hits: _Hits, sources: Mapping[int, Tuple[np.ndarray, np.ndarray, Any]],
                   dtype: np.dtype) -> Optional[RaggedColumn]:
    """A read's ragged column (a :class:`RaggedColumn`, or None: no row had a value, or the
    segments were not read because every row is patched) with the patched rows' values in
    place, as a new column: one copy of each row's values, in runs of rows that follow each
    other in one source (``sources``: each patch's ``(values, offsets, validity)``)."""
    if col is None:
        base_vals, base_offs = np.zeros(0, dtype=dtype), np.zeros(n + 1, dtype=np.int64)
        valid = np.zeros(n, dtype=bool)
    else:
        base_vals, base_offs = np.asarray(col.values), np.asarray(col.offsets, dtype=np.int64)
        valid = np.ones(n, dtype=bool) if col.validity is None else np.array(col.validity, dtype=bool)
    src = np.zeros(n, dtype=np.int64)  # 0: the segments' values, k: the k-th patch of `order`
    starts, ends = base_offs[:-1].copy(), base_offs[1:].copy()
    arrays = [base_vals]
    for w, at, pos in hits.by_patch():
        vals, offs, pvalid = sources[w]
        arrays.append(vals)
        src[at] = len(arrays) - 1
        starts[at], ends[at] = offs[pos], offs[pos + 1]
        valid[at] = True if pvalid is None else pvalid[pos]
    ends[~valid] = starts[~valid]
    if not valid.any():
        return None
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(ends - starts, out=offsets[1:])
    # runs: a row that starts where the previous one ended, in the same source, joins its run
    follows = np.zeros(n, dtype=bool)
    follows[1:] = (starts[1:] == ends[:-1]) & (src[1:] == src[:-1])
    first = np.flatnonzero(~follows)
    last = np.append(first[1:] - 1, n - 1)
    pieces = [arrays[k][a:b] for k, a, b in zip(src[first].tolist(), starts[first].tolist(), ends[last].tolist())]
    values = np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype=dtype)
    return RaggedColumn(values, offsets, None if valid.all() else valid)


def versions_of(manifest: fmt.Manifest, column: str) -> Dict[str, Dict[str, Any]]:
    """The named versions of ``column`` in ``manifest``: for each, the newest patch's ``meta``, the
    number of patches and of rows they hold (a row in two counts twice).

    >>> m = fmt.Manifest(patches=(fmt.PatchEntry(1, 0, 4, 2, 9, 0, ("rewards",), "judge-v2", {"by": "f"}),))
    >>> versions_of(m, "rewards")
    {'judge-v2': {'meta': {'by': 'f'}, 'patches': 1, 'rows': 2}}
    """
    out: Dict[str, Dict[str, Any]] = {}
    for p in manifest.patches:
        if p.version is not None and column in p.columns:
            v = out.setdefault(p.version, {"meta": {}, "patches": 0, "rows": 0})
            v["meta"], v["patches"], v["rows"] = dict(p.meta or {}), v["patches"] + 1, v["rows"] + p.num_rows
    return out


def foldable(manifest: fmt.Manifest, first_row: int, end_row: int) -> Optional[Tuple[int, ...]]:
    """Ids of the patches a rewrite of rows ``[first_row, end_row)`` folds: every patch holding one
    of those rows, provided each holds no live row outside them (else None: folding one and not
    another could let an older value win; the rewrite then copies the segments' values and the
    patches stay)."""
    touching = [p for p in manifest.patches if p.first_row < end_row and p.end_row > first_row and not p.folded]
    # rows below first_row are live unless it is at or below head
    if any(p.end_row > end_row or (p.first_row < first_row and first_row > manifest.head) for p in touching):
        return None
    return tuple(p.id for p in touching)


def check_distinct(rows: np.ndarray) -> None:
    """Refuse a row named twice in one update (which value would win is not defined)."""
    if len(rows) > 1:
        s = np.sort(rows)
        dup = s[1:] == s[:-1]
        if dup.any():
            raise ArgumentError(f"rows names row {int(s[1:][dup][0])} twice; an update gives one value per row")
