"""TransferQueue's keys and values in a multi-writer store: one row per value written, the newest row wins.

TransferQueue's key-value layer names a value ``"{global_index}@{field}"``
and overwrites, reads and clears it. A store's rows are immutable, so
:class:`FieldTable` appends and never rewrites:

- ``put`` appends one row per key (its value's kind, dtype, shape, bytes or
  JSON text, and a digest of them) in one commit: every value of the call is
  durable together or none is;
- ``clear`` appends one *cleared* row per key that holds a value;
- a key's value is its newest row (row ids grow in commit order across all
  writers), absent when that row is a cleared one. Each cleared row bumps the
  key's *generation*, so the value put after a clear (TransferQueue reuses a
  global index once it is cleared) is a new generation of the key.

Exactly once. Before writing, the table loads the newest commit of every
writer. A key whose newest row already holds the same value (same digest) is
not written again: a put that landed and is sent again after a crash, or after
an error that hid its commit, adds nothing. The rest of the call commits
under a token derived from each key, the row it supersedes and the new
value's digest, so the same call sent twice is one commit even if the second
starts before the first is seen, while a value put again after a different
one (``A``, ``B``, ``A``) or after a clear is a new row, as it must be.

The table needs torch and numpy, not TransferQueue: the TransferQueue classes
in this package are thin wrappers over it.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

from ... import ReplayStore
from ...errors import ArgumentError, BatchError, IndexOutOfRangeError, RowsEvictedError
from .values import CLEARED, Encoded, decode, encode

KEY, INDEX, FIELD, GEN, KIND = "tq_key", "tq_index", "tq_field", "tq_gen", "tq_kind"
DTYPE, SHAPE, DIGEST, NBYTES, DATA, TEXT = "tq_dtype", "tq_shape", "tq_digest", "tq_nbytes", "tq_data", "tq_json"
_META = [KEY, GEN, KIND, DIGEST]
_VALUE = [KIND, DTYPE, SHAPE, NBYTES, DATA, TEXT]
_SYNC_CHUNK = 1 << 16  # rows of other writers indexed per read


@dataclass(frozen=True)
class Entry:
    """A key's newest row: where it is, its generation, what it holds."""

    row: int
    gen: int
    kind: str
    digest: str


class FieldTable:
    """TransferQueue's key-value storage in a multi-writer :class:`~diskreplay.ReplayStore` at ``path``.

    Every process (or Ray actor) that puts or gets opens its own table on the
    same path; ``put`` returns once its values are durable. ``capacity`` (rows,
    exact FIFO) bounds the store: every put and clear appends rows, so give a
    capacity well above the rows written while a value is still needed, or
    leave it out to keep every row.

    >>> import tempfile, torch
    >>> table = FieldTable(tempfile.mkdtemp())
    >>> table.put(["0@ids", "0@uid"], [torch.tensor([5, 6, 7]), "prompt-a"])
    >>> table.get(["0@ids", "0@uid"])
    [tensor([5, 6, 7]), 'prompt-a']
    >>> table.clear(["0@ids"]); table.contains("0@ids"), table.generation("0@ids")
    (False, 1)
    >>> table.close()
    """

    def __init__(self, path: Any, *, capacity: Optional[int] = None, fsync: bool = True,
                 storage_options: Optional[Mapping[str, Any]] = None) -> None:
        kwargs: Dict[str, Any] = {"group_key": None, "multi_writer": True, "fsync": fsync}
        if capacity is not None:
            kwargs["capacity"] = capacity
        if storage_options is not None:
            kwargs["storage_options"] = dict(storage_options)
        #: the store the values live in (one row per value written)
        self.store = ReplayStore(path, **kwargs)
        self.path = self.store.path
        self._lock = threading.RLock()  # TransferQueue puts from a thread pool: one call at a time per table
        self._index: Dict[str, Entry] = {}
        self._upto = 0  # rows below this are in _index
        try:
            self._sync()
        except BaseException:
            self.store.close()
            raise

    # ------------------------------------------------------------------ reading the commits of every writer

    def _sync(self) -> None:
        """Index the rows committed since the last look, by any writer, oldest first (the newest wins)."""
        self.store.refresh()
        if self.store.next_row <= self._upto:
            return
        rows = self.store.row_ids()
        rows = rows[rows >= self._upto]
        for start in range(0, len(rows), _SYNC_CHUNK):
            chunk = rows[start:start + _SYNC_CHUNK]
            cols = self.store.read(chunk, columns=_META)
            self._apply(chunk, cols[KEY], cols[GEN], cols[KIND], cols[DIGEST])
        self._upto = self.store.next_row

    def _apply(self, rows: Sequence[int], keys: Sequence[str], gens: Sequence[int], kinds: Sequence[str],
               digests: Sequence[str]) -> None:
        index = self._index
        for row, key, gen, kind, digest in zip(rows, keys, gens, kinds, digests):
            index[key] = Entry(int(row), int(gen), kind, digest)

    def contains(self, key: str) -> bool:
        """Whether ``key`` holds a value (put and not cleared since), as of the newest commit."""
        with self._lock:
            self._sync()
            entry = self._index.get(key)
            return entry is not None and entry.kind != CLEARED

    def generation(self, key: str) -> int:
        """How many times ``key`` was cleared: the value put after the n-th clear is generation n."""
        with self._lock:
            self._sync()
            entry = self._index.get(key)
            return 0 if entry is None else entry.gen

    def keys(self) -> List[str]:
        """The keys that hold a value, as of the newest commit."""
        with self._lock:
            self._sync()
            return [k for k, e in self._index.items() if e.kind != CLEARED]

    # ------------------------------------------------------------------ the three operations

    def put(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        """Store ``values[i]`` under ``keys[i]``, all in one durable commit (nothing of it on a bad value)."""
        keys = _check_keys(keys, "keys")
        if not isinstance(values, (list, tuple)) or len(values) != len(keys):
            raise ArgumentError(f"values must be a list of one value per key ({len(keys)}), got "
                                f"{len(values) if isinstance(values, (list, tuple)) else type(values).__name__}")
        encoded = [encode(k, v) for k, v in zip(keys, values)]
        last = {k: i for i, k in enumerate(keys)}  # a key given twice keeps its last value, as a dict would
        with self._lock:
            self._sync()
            todo = []
            for i, (key, enc) in enumerate(zip(keys, encoded)):
                if last[key] != i:
                    continue
                digest = enc.digest
                cur = self._index.get(key)
                if cur is not None and cur.kind != CLEARED and cur.digest == digest:
                    continue  # holds exactly this value already: a put sent again
                todo.append((key, enc, digest, cur))
            if todo:
                self._commit("put", [(key, -1 if cur is None else cur.row, 0 if cur is None else cur.gen,
                                      enc, digest) for key, enc, digest, cur in todo])

    def get(self, keys: Sequence[str], shapes: Optional[Sequence[Any]] = None,
            dtypes: Optional[Sequence[Any]] = None) -> List[Any]:
        """The values of ``keys``, in order. ``shapes``/``dtypes`` (one per key, ``None`` for any), when
        given, are checked against what was stored (the dtype, and a shape's element count); a key
        without a value raises naming it."""
        keys = _check_keys(keys, "keys")
        for name, given in (("shapes", shapes), ("dtypes", dtypes)):
            if given is not None and len(given) != len(keys):
                raise ArgumentError(f"{name} must have one entry per key ({len(keys)}), got {len(given)}")
        if not keys:
            return []
        with self._lock:
            self._sync()
            entries = [self._index.get(k) for k in keys]
            missing = [k for k, e in zip(keys, entries) if e is None or e.kind == CLEARED]
            if missing:
                raise IndexOutOfRangeError(
                    f"no value is stored under TransferQueue key(s) {_names(missing)} in {self.path}: never put, "
                    "or cleared since; get only the global indexes and fields the controller reports produced")
            rows = np.fromiter((e.row for e in entries), dtype=np.int64, count=len(entries))
            try:
                cols = self.store.read(rows, columns=_VALUE)
            except RowsEvictedError as exc:
                gone = [k for k, e in zip(keys, entries) if e.row < self.store.head]
                raise RowsEvictedError(
                    f"the values of TransferQueue key(s) {_names(gone)} were evicted from {self.path} by its "
                    f"capacity of {self.store.capacity} rows ({exc}); open it with a larger capacity (or none) so "
                    "that values live until they are read and cleared") from exc
        data = cols[DATA]
        # one copy of all the bytes (the read may view the store's memory map); each value a view of it
        whole = np.array(data.values, copy=True).view(np.uint8)
        starts = (np.asarray(data.offsets, dtype=np.int64) * 4).tolist()
        nbytes = cols[NBYTES].tolist()
        out = []
        for i, key in enumerate(keys):
            raw = whole[starts[i]:starts[i] + nbytes[i]]
            value = decode(cols[KIND][i], cols[DTYPE][i], cols[SHAPE][i], raw, cols[TEXT][i], owned=True)
            _check_expected(key, value, None if shapes is None else shapes[i], None if dtypes is None else dtypes[i])
            out.append(value)
        return out

    def clear(self, keys: Sequence[str]) -> None:
        """Remove the values of ``keys`` (durably, in one commit); a key without a value is left as it is."""
        keys = _check_keys(keys, "keys")
        with self._lock:
            self._sync()
            todo, seen = [], set()
            for key in keys:
                cur = self._index.get(key)
                if key in seen or cur is None or cur.kind == CLEARED:
                    continue
                seen.add(key)
                todo.append((key, cur.row, cur.gen + 1, None, ""))
            if todo:
                self._commit("clear", todo)

    # ------------------------------------------------------------------ checkpoints: a row number

    def mark(self) -> int:
        """A checkpoint of every value: the store's next row, as of the newest commit of any writer.

        :meth:`restore` brings the values back to what they were at this point, so a checkpoint of the
        storage is one integer, whatever the values weigh.
        """
        with self._lock:
            self._sync()
            return self._upto

    def restore(self, mark: int) -> int:
        """Make every key hold what it held at ``mark`` (a :meth:`mark`), in one commit; returns the keys changed.

        Nothing is rewritten: a key changed since ``mark`` gets a new row, its value at ``mark`` copied
        (or a cleared row, when it had none then). Restoring twice, or again after a crash, changes nothing
        more.
        """
        if not isinstance(mark, int) or isinstance(mark, bool) or mark < 0:
            raise ArgumentError(f"mark must be a row number from FieldTable.mark(), got {mark!r}")
        with self._lock:
            self._sync()
            store = self.store
            if mark > self._upto:
                raise ArgumentError(f"mark {mark} is past the newest row of {self.path} ({self._upto}): the "
                                    "checkpoint belongs to another store (check backend.DiskReplay.path)")
            rows = store.row_ids()
            later = rows[rows >= mark]
            touched = {k for k in self._keys_of(later)}
            if not touched:
                return 0
            if mark < store.head:
                raise RowsEvictedError(
                    f"the values held at mark {mark} were evicted from {self.path} by its capacity of "
                    f"{store.capacity} rows (oldest live row: {store.head}); give the store a capacity above the "
                    "rows written between two checkpoints, or none")
            then: Dict[str, int] = {}
            earlier = rows[rows < mark]
            for start in range(0, len(earlier), _SYNC_CHUNK):
                chunk = earlier[start:start + _SYNC_CHUNK]
                for row, key in zip(chunk.tolist(), store.read(chunk, columns=[KEY])[KEY]):
                    if key in touched:
                        then[key] = row
            items = []
            copies = sorted((row, key) for key, row in then.items())
            values = store.read([r for r, _ in copies], columns=[GEN, DIGEST] + _VALUE) if copies else None
            was = {key: i for i, (_, key) in enumerate(copies)}
            for key in sorted(touched):
                cur = self._index[key]
                i = was.get(key)
                if i is None or values[KIND][i] == CLEARED:
                    if cur.kind != CLEARED:
                        items.append((key, cur.row, cur.gen + 1, None, ""))
                    continue
                digest = values[DIGEST][i]
                if cur.kind != CLEARED and cur.digest == digest:
                    continue
                col = values[DATA]
                raw = col.values[col.offsets[i]:col.offsets[i + 1]].view(np.uint8)[:int(values[NBYTES][i])]
                enc = Encoded(values[KIND][i], values[DTYPE][i], values[SHAPE][i], raw.copy(), values[TEXT][i])
                items.append((key, cur.row, int(values[GEN][i]), enc, digest))
            if items:
                self._commit(f"restore@{mark}", items)
            return len(items)

    def _keys_of(self, rows: np.ndarray) -> List[str]:
        out: List[str] = []
        for start in range(0, len(rows), _SYNC_CHUNK):
            out += self.store.read(rows[start:start + _SYNC_CHUNK], columns=[KEY])[KEY]
        return out

    # ------------------------------------------------------------------ one commit

    def _commit(self, op: str, items: List[Any]) -> None:
        """Append one row per ``(key, superseded row, generation, encoded value or None, digest)``."""
        n = len(items)
        h = hashlib.sha256(op.encode())  # a restore's token names its mark: two restores differ
        keys, fields, indexes, kinds, dtypes, shapes, texts, data = [], [], [], [], [], [], [], []
        nbytes = np.zeros(n, dtype=np.int64)
        gens = np.zeros(n, dtype=np.int64)
        digests = []
        for i, (key, base, gen, enc, digest) in enumerate(items):
            h.update(f"\n{key}\0{base}\0{digest}".encode())
            index, _, field = key.partition("@")
            keys.append(key)
            fields.append(field)
            indexes.append(int(index) if index.isdigit() else -1)
            gens[i] = gen
            digests.append(digest)
            if enc is None:
                kinds.append(CLEARED), dtypes.append(""), shapes.append(""), texts.append("")
                data.append(_NO_WORDS)
                continue
            kinds.append(enc.kind), dtypes.append(enc.dtype), shapes.append(enc.shape), texts.append(enc.text)
            nbytes[i] = enc.data.nbytes
            data.append(_words(enc.data))
        batch = {KEY: keys, INDEX: np.asarray(indexes, dtype=np.int64), FIELD: fields, GEN: gens, KIND: kinds,
                 DTYPE: dtypes, SHAPE: shapes, DIGEST: digests, NBYTES: nbytes, DATA: data, TEXT: texts}
        rows = self.store.extend(batch, token=f"tq-{op.partition('@')[0]}:{h.hexdigest()[:40]}")
        if len(rows) and int(rows[0]) == self._upto:
            # nobody else committed in between: index these rows without reading them back
            self._apply(rows, keys, gens, kinds, digests)
            self._upto = int(rows[-1]) + 1
        else:
            self._sync()

    def close(self) -> None:
        """Close the store (its writer's files are flushed; a put already returned is durable anyway)."""
        self.store.close()

    def __enter__(self) -> "FieldTable":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_NO_WORDS = np.zeros(0, dtype=np.int32)


def _words(raw: np.ndarray) -> np.ndarray:
    """Bytes as the int32 words of a ragged column (the store's ragged ints), the tail zero-padded."""
    if raw.nbytes % 4 == 0:
        return raw.view(np.int32)
    padded = np.zeros((raw.nbytes + 3) // 4 * 4, dtype=np.uint8)
    padded[:raw.nbytes] = raw
    return padded.view(np.int32)


def _check_keys(keys: Any, name: str) -> List[str]:
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k for k in keys):
        raise ArgumentError(f"{name} must be a list of non-empty str (TransferQueue's '{{global_index}}@{{field}}'), "
                            f"got {_short(keys)}")
    return list(keys)


def _names(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_expected(key: str, value: Any, shape: Any, dtype: Any) -> None:
    """A tensor whose stored dtype or element count is not what TransferQueue's metadata says is a mix-up.

    Only the element count of a shape is checked: TransferQueue's metadata gives a sample of a dense
    ``[B]`` field the shape ``(1,)`` where the value stored is the 0-d tensor ``KVStorageManager`` unbound.
    """
    if not isinstance(value, torch.Tensor):
        return
    if isinstance(dtype, torch.dtype) and value.dtype != dtype:
        raise BatchError(f"TransferQueue key {key!r} holds a {value.dtype} tensor but {dtype} was asked for; the "
                         "controller's metadata and the stored value disagree (was the index reused without a clear?)")
    if isinstance(shape, (torch.Size, tuple, list)) and all(isinstance(d, int) for d in shape) \
            and value.numel() != int(np.prod(shape, dtype=np.int64)):
        raise BatchError(f"TransferQueue key {key!r} holds a tensor of shape {tuple(value.shape)} but "
                         f"{tuple(shape)} was asked for; the controller's metadata and the stored value disagree")


__all__ = ["FieldTable", "Entry"]
