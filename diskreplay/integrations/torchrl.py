"""TorchRL on a diskreplay store: :class:`DiskReplayStorage`, a ``torchrl.data`` ``Storage``, and its writer.

``torchrl.data.ReplayBuffer(storage=DiskReplayStorage(path, max_size), writer=DiskReplayWriter(),
sampler=..., batch_size=...)`` keeps its rows in a :class:`~diskreplay.ReplayStore`: every ``extend`` is one
durable commit, the rows outlive the process (reopen the path and they are
all there), and the store's capacity is the buffer's ``max_size`` (FIFO, like
TorchRL's round-robin writer). TorchRL's own samplers (``PromptGroupSampler``,
``RandomSampler``, ``SamplerWithoutReplacement``, ...) run unchanged on it.

Layout. A TensorDict's nested keys are stored as flat columns joined with
``"."`` (``("next", "reward")`` is column ``"next.reward"``) and come back
nested, so the keys TorchRL's GRPO tools read (``("tokens", "full")``,
``("log_probs", "full")``, ``"advantage"``, ``("next", "reward")``, ...) are
where they were written. A tensor of one value per row is a scalar column; a
fixed-shape tensor per row a vector column, whatever its key (``("tokens",
"full")`` padded to ``[B, 128]`` too: it is passed to ``extend`` as an Arrow
fixed-size list, which states the role; only TRL's padded layout, ``*_ids``
with their ``*_mask`` and the columns of their shape, is stripped of its
padding as ``extend`` strips it); strings (``NonTensorStack``) a
string column; rows of different lengths (a lazy stack of TensorDicts, the
way TorchRL keeps token sequences) a ragged column, returned as a lazy stack
again (``sample.get(("tokens", "full"), as_padded_tensor=True)`` pads them).
The store holds ints as int32/int64 and floats as float32/float64, at most
one dimension per row; each column's torch dtype and per-row shape are kept
beside the rows (the saved state ``torchrl.layout``, one commit when a column
first appears), so tensors come back as they went in: bool masks, uint8 ids,
float16, bfloat16, ``[B, 2, 2]`` per-row tensors.

Positions. TorchRL addresses a storage of ``max_size`` slots written
round-robin; slot ``p`` holds the live row ``r`` with ``r % max_size == p``
(row ids only grow; the oldest rows are evicted as new ones arrive), which is
exactly where TorchRL's round-robin writer puts them. With
:class:`DiskReplayWriter` (``ReplayBuffer(storage=DiskReplayStorage(path),
writer=DiskReplayWriter())``, the recommended form) the store places the rows
and the writer returns their slots: a reopened store, a buffer state older
than the store's rows and another process appending all continue at the
store's next row. A buffer built with TorchRL's default writer gets the same
round-robin writer made to follow the store (through ``set_writer``, as the
buffer registers the storage): it starts at the store's next row, and loading
a buffer state (``load_state_dict``, ``loads``: a checkpoint older than the
store's last rows) moves it there again. A round-robin writer whose cursor is
not the store's next row anyway (another process appended, or the cursor was
set) writes nothing: ``extend`` raises and the writer follows the store.
``dumps`` writes the store's path and next row (``storage.json``): the rows
are in the store, durable already.

A repaired store's holes (rows ``repair`` dropped with a damaged segment) hold
no slot: there the slots ``0 .. len(storage) - 1`` are its live rows in the
order above (by ``r % max_size``), so TorchRL's samplers, which draw slots
below ``len(storage)``, never draw a hole, and :class:`DiskReplayWriter`
returns the slots of the rows it wrote in that order. TorchRL's round-robin
writer still returns ``row % max_size`` there, which samplers that keep
per-slot state (``PrioritizedSampler``) would misread: use
:class:`DiskReplayWriter` with them.

Needs the ``[torchrl]`` extra (``pip install diskreplay[torchrl]``). TorchRL's
compiled extension is not needed: its pure-Python samplers are enough.

One module: the storage and its writer keep one position contract between them (above).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, List, Optional, Union

import numpy as np
import pyarrow as pa

from .. import RaggedColumn, ReplayStore
from ..errors import (BatchError, IndexOutOfRangeError, MissingDependencyError, OutputExistsError, SchemaError,
                      UnsupportedError)
from ..schema import COMPLETION_IDS, MASK_SUFFIX, PROMPT_IDS

try:
    import torch
    from tensordict import (LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase,
                            is_tensor_collection, lazy_stack)
    from torchrl.data.replay_buffers.storages import StoreStorage as _TorchRLStoreStorage
    from torchrl.data.replay_buffers.writers import RoundRobinWriter, TensorDictRoundRobinWriter, Writer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(f"diskreplay.integrations.torchrl needs torchrl and tensordict ({exc}); install them with "
                      "pip install 'diskreplay[torchrl]'") from exc

__all__ = ["DiskReplayStorage", "DiskReplayWriter", "tensordict_to_columns", "columns_to_tensordict"]

SEP = "."
LAYOUT_STATE = "torchrl.layout"  # the saved state with each column's torch dtype and per-row shape
# TorchRL keeps its writer cursor in a 32-bit shared integer: an unbounded store is addressed modulo this
_UNBOUNDED_SLOTS = 2 ** 31 - 1


def _as_positions(index: Any) -> np.ndarray:
    if isinstance(index, torch.Tensor):
        return index.detach().cpu().numpy().astype(np.int64).reshape(-1)
    if isinstance(index, range):
        return np.arange(index.start, index.stop, index.step, dtype=np.int64)
    return np.asarray(index, dtype=np.int64).reshape(-1)


def _checkpoint_dir(path: Any) -> None:
    """Make the directory ``dumps(path)`` writes into; a file on the way is refused by name (os.makedirs
    would raise a bare NotADirectoryError or FileExistsError)."""
    above = os.path.abspath(path)
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise OutputExistsError(f"dumps(path={os.fspath(path)!r}): {above} is a file, so the checkpoint directory "
                                "cannot be made there; pass a path whose parents are directories")
    os.makedirs(path, exist_ok=True)


def _as_batch(data: Any) -> Any:
    """``data`` as a batch of rows: a TensorDict with a batch dimension (one row gets one)."""
    if not is_tensor_collection(data):
        raise UnsupportedError(f"DiskReplayStorage stores TensorDicts, got {type(data).__name__}; wrap the "
                               "data in a TensorDict")
    if data.batch_dims == 0:
        data = lazy_stack([data]) if isinstance(data, LazyStackedTensorDict) else data.unsqueeze(0)
    return data


class DiskReplayStorage(_TorchRLStoreStorage):
    """A ``torchrl.data`` ``Storage`` whose rows live in a :class:`~diskreplay.ReplayStore` (see the module).

    ``store`` is a path (opened, or created with ``capacity=max_size``) or an
    open ``ReplayStore``. ``max_size`` defaults to the store's capacity (an
    unbounded store holds up to 2**31 - 1 rows for TorchRL). ``group_key``
    (a key, nested keys as tuples) makes the store index that column at write
    time, for diskreplay's own samplers; TorchRL's samplers build their own
    index. Other keyword arguments go to ``ReplayStore``.

    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ReplayBuffer
    >>> from torchrl.data.replay_buffers.samplers import PromptGroupSampler
    >>> path = tempfile.mkdtemp()
    >>> rb = ReplayBuffer(storage=DiskReplayStorage(path, 100),
    ...                   sampler=PromptGroupSampler(num_groups=2, group_key="prompt"), batch_size=8)
    >>> _ = rb.extend(TensorDict({"prompt": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]),
    ...                           "reward": torch.arange(12.0)}, batch_size=[12]))
    >>> sample = rb.sample()
    >>> int(sample["prompt"].unique().numel()), int(sample.shape[0])
    (2, 8)
    >>> rb.storage.close()
    >>> len(DiskReplayStorage(path))  # the rows outlive the buffer
    12
    """

    def __init__(self, store: Union[str, Any, ReplayStore], max_size: Optional[int] = None, *,
                 group_key: Any = None, **store_options: Any) -> None:
        if isinstance(store, ReplayStore):
            if group_key is not None or store_options:
                raise SchemaError("group_key and store options apply only when DiskReplayStorage opens the store "
                                  "itself; pass a path, or set them when opening the ReplayStore")
        else:
            key = SEP.join(group_key) if isinstance(group_key, tuple) else group_key
            if max_size is not None:
                store_options.setdefault("capacity", max_size)
            store = ReplayStore(store, group_key=key, **store_options)
        capacity = store.capacity
        if max_size is None:
            max_size = capacity if capacity is not None else _UNBOUNDED_SLOTS
        if capacity is not None and capacity != max_size:
            raise SchemaError(f"max_size={max_size} but the store at {store.path} has capacity={capacity}; a "
                              "TorchRL storage's slots must be the store's rows: pass max_size=None or "
                              f"max_size={capacity}")
        if store.capacity_bytes is not None:
            raise SchemaError(f"the store at {store.path} has a byte capacity; TorchRL addresses a storage by "
                              "slots, which only a row capacity keeps aligned: open a store without "
                              "capacity_bytes")
        self.store = store
        self._buffers: List[Any] = []  # the buffers attached to this storage, whose writers follow the store
        # StoreStorage's own constructor connects to a key-value server: only the base Storage applies
        super(_TorchRLStoreStorage, self).__init__(max_size=int(max_size))
        self.initialized = True
        self._last_cursor = None
        self._layout: Dict[str, Any] = {}
        self._by_slot: Any = None  # (manifest, max_size, live rows in slot order) of a store with holes
        self._load_layout()

    # -- TorchRL's Storage interface
    def __len__(self) -> int:
        if self.store.readonly:
            self.store.refresh()
        return len(self.store)

    def __repr__(self) -> str:
        return f"DiskReplayStorage({self.store.path!r}, max_size={self.max_size}, rows={len(self.store)})"

    def close(self) -> None:
        """Close the store (releases its writer lock)."""
        self.store.close()

    def attach(self, buffer: Any) -> None:
        """Register a buffer that reads this storage (a TorchRL buffer does as it starts): its
        round-robin writer is kept at the store's next row (see the module, "Positions")."""
        super().attach(buffer)
        if not any(b is buffer for b in self._buffers):
            self._buffers.append(buffer)

    @property
    def checkpointer(self) -> Any:
        """TorchRL's storage checkpointer (unused here: :meth:`dumps` names the store instead)."""
        return _TorchRLStoreStorage.checkpointer.fget(self)

    @checkpointer.setter
    def checkpointer(self, value: Any) -> None:
        _TorchRLStoreStorage.checkpointer.fset(self, value)
        # a TorchRL buffer sets it once its writer is registered: the first moment that writer can be
        # made to start at the store's next row (a reopened store) and to follow the store on a load
        self._follow_writers(adopt=True)

    def _next_slots(self, n: int) -> np.ndarray:
        return (self.store.next_row + np.arange(n, dtype=np.int64)) % self.max_size

    def _follow_writers(self, adopt: bool = False) -> None:
        """Move the cursor of every round-robin writer on this storage to the store's next row, through
        the writer's public ``load_state_dict``. ``adopt``: first give a buffer whose writer is one of
        TorchRL's defaults (a ``RoundRobinWriter`` or ``TensorDictRoundRobinWriter`` itself, not a
        subclass) the same writer, made to follow the store after a buffer state is loaded too
        (``set_writer``; its write count and slot generations carry over)."""
        for buffer in self._buffers:
            writer = getattr(buffer, "writer", None)  # None while the buffer is still being built
            follower = _FOLLOWERS.get(type(writer)) if adopt else None
            if follower is not None:
                replacement = follower(track_generations=writer.tracks_generations)
                buffer.set_writer(replacement)
                replacement.load_state_dict(writer.state_dict())  # the cursor then follows the store
            elif isinstance(writer, RoundRobinWriter):
                writer.load_state_dict({"_cursor": int(self._next_slots(1)[0])})

    def _load_layout(self) -> None:
        """The tensors' dtypes and shapes, kept in the store (a saved state) beside the rows."""
        saved = self.store.load_state(LAYOUT_STATE)
        self._layout = dict(saved.get("columns", {})) if isinstance(saved, dict) else {}

    def _live_by_slot(self) -> Optional[np.ndarray]:
        """A store with holes: its live rows in slot order (slot ``p`` is the ``p``-th); None without holes."""
        m = self.store.manifest
        if not m.holes:
            return None
        hit = self._by_slot
        if hit is None or hit[0] is not m or hit[1] != self.max_size:
            rows = self.store.row_ids()
            hit = self._by_slot = (m, self.max_size, rows[np.argsort(rows % self.max_size, kind="stable")])
        return hit[2]

    def _slots(self, rows: np.ndarray) -> np.ndarray:
        """The TorchRL slots of live ``rows``."""
        by_slot = self._live_by_slot()
        if by_slot is None:
            return rows % self.max_size
        order = np.argsort(by_slot)
        return order[np.searchsorted(by_slot, rows, sorter=order)]

    def _rows(self, positions: np.ndarray) -> np.ndarray:
        """Live row ids of TorchRL slots."""
        by_slot = self._live_by_slot()
        if by_slot is not None:  # slots are the live rows only: a hole has none
            n = len(by_slot)
            if len(positions) and (positions.min() < -n or positions.max() >= n):
                raise IndexOutOfRangeError(f"index {positions.tolist()[:10]} is outside the storage's {n} slots "
                                           f"(the live rows of {self.store.path}, which has holes)")
            return by_slot[np.where(positions < 0, positions + n, positions)]
        head, n = self.store.head, len(self.store)
        if len(positions) and (positions.min() < -n or positions.max() >= self.max_size):
            raise IndexOutOfRangeError(f"index {positions.tolist()[:10]} is outside the storage's {self.max_size} slots")
        positions = np.where(positions < 0, positions + n, positions)  # TorchRL's negative = from the end
        rows = head + (positions - head) % self.max_size
        if len(rows) and rows.max() >= head + n:
            raise IndexOutOfRangeError(f"slot {int(positions[rows >= head + n][0])} holds no row yet (the storage has "
                             f"{n} rows)")
        return rows

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Append ``data`` at the slots a round-robin writer chose: they must be the store's next ones
        (rows are written once). A writer behind the store writes nothing: this raises, and the writers
        on this storage follow the store."""
        if isinstance(cursor, slice):
            cursor = range(*cursor.indices(self.max_size))
        positions = _as_positions(cursor)
        data = _as_batch(data)
        n = data.shape[0]
        if len(positions) != n:
            raise SchemaError(f"{len(positions)} slots for {n} rows; pass one slot per row")
        if self.store.multi_writer:
            self.store.refresh()  # another process's rows move the next slots
        expected = self._next_slots(n)
        if not np.array_equal(positions, expected):
            if not set_cursor:
                raise UnsupportedError(f"DiskReplayStorage rows are written once, at the end (slots "
                                       f"{expected.tolist()[:5]}...); overwriting slots {positions.tolist()[:5]} "
                                       "in place is not supported")
            # writing would make the writer return the slots of other rows
            self._follow_writers()
            raise UnsupportedError(f"the buffer's writer chose slots {positions.tolist()[:5]}... but the next rows of "
                                   f"{self.store.path} go to slots {expected.tolist()[:5]}... (another process "
                                   "appended, or the writer's cursor was set); nothing was written and the writer "
                                   "now follows the store: extend again")
        slots = self._commit(data, by_row=True)
        if not np.array_equal(slots, expected):
            raise UnsupportedError(f"another writer of {self.store.path} appended while these {n} rows were "
                                   f"committed: they went to slots {slots.tolist()[:5]}..., not to the slots "
                                   f"{positions.tolist()[:5]}... the buffer's writer returns, and the writer now "
                                   "follows the store; DiskReplayWriter returns the slots the store gives")

    def append(self, data: Any) -> torch.Tensor:
        """Commit ``data`` (a TensorDict: a batch, or one row) as the store's next rows; returns their slots.

        :class:`DiskReplayWriter` writes with it: the slots are those of the
        rows the store committed (row id modulo ``max_size``), whatever
        another writer of a multi-writer store appended before.

        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> storage = DiskReplayStorage(tempfile.mkdtemp(), 4)
        >>> storage.append(TensorDict({"x": torch.arange(6)}, [6])).tolist()  # rows 0..5, 2..5 live
        [0, 1, 2, 3, 0, 1]
        >>> storage.get([0, 1, 2, 3])["x"].tolist()
        [4, 5, 2, 3]
        >>> storage.close()
        """
        return torch.from_numpy(self._commit(_as_batch(data)))

    def _commit(self, data: Any, by_row: bool = False) -> np.ndarray:
        """Extend the store with the batch ``data``; the slots of its rows (``by_row``: ``row % max_size``,
        a round-robin writer's, which a store with holes does not use for reads)."""
        if not data.shape[0]:
            raise BatchError("nothing to write: the batch has no rows")
        layout: Dict[str, Any] = {}
        rows = np.asarray(self.store.extend(tensordict_to_columns(data, layout)), dtype=np.int64)
        changed = {k: v for k, v in layout.items() if self._layout.get(k) != v}
        if changed:  # a new column, or another dtype: one more commit, once
            self._layout.update(changed)
            self.store.save_state(LAYOUT_STATE, {"columns": self._layout})
        slots = rows % self.max_size if by_row else self._slots(rows)
        self._set_last_cursor(int(slots[-1]))
        self._bump_mutation_revision()  # TorchRL's samplers drop what they derived from the old rows
        self._follow_writers()  # the round-robin writers on this storage continue after these rows
        return slots

    def get(self, index: Any) -> Any:
        """The rows at TorchRL slots ``index`` as a TensorDict (a lazy stack when a column is ragged)."""
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if self.store.readonly:
            self.store.refresh()
        single = isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0)
        if isinstance(index, slice):
            index = range(*index.indices(len(self.store)))
        rows = self._rows(_as_positions(index))
        batch = self.store.read(rows)
        if any(name not in self._layout for name in batch):  # another process wrote a new column
            self._load_layout()
        td = columns_to_tensordict(batch, len(rows), self._layout)
        return td[0] if single else td

    def contains(self, item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            pos = _as_positions(item)
            n = len(self.store)
            ok = (pos >= 0) & (pos < min(n, self.max_size))
            return torch.as_tensor(ok.reshape(item.shape))
        return 0 <= int(item) < min(len(self.store), self.max_size)

    def _empty(self) -> None:
        raise UnsupportedError(f"DiskReplayStorage keeps every committed row of {self.store.path}; empty() would "
                               "delete them: open a new path instead")

    def state_dict(self) -> Dict[str, Any]:
        return {"path": self.store.path, "next_row": int(self.store.next_row)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Keep this store's rows: they are persistent, and a state never carries rows to copy.

        TorchRL's in-memory storages copy the saved rows back; a store already
        holds its own. A state saved from another path changes nothing here and
        says so with a warning.
        """
        path = state_dict.get("path") if isinstance(state_dict, dict) else None
        if path is not None and path != self.store.path:
            warnings.warn(f"the storage state is of the store at {path!r}; this storage keeps the rows of "
                          f"{self.store.path!r} (open that path to use its rows)", stacklevel=2)
        self._bump_mutation_revision()

    def dumps(self, path: Any) -> None:
        """Write ``storage.json`` (the store's path and next row) into the directory ``path``: the rows
        are in the store, durable already, and a checkpoint names them instead of copying them."""
        _checkpoint_dir(path)
        with open(os.path.join(path, "storage.json"), "w") as f:
            json.dump(self.state_dict(), f)

    def loads(self, path: Any) -> None:
        """Read what :meth:`dumps` wrote (:meth:`load_state_dict`: a checkpoint of another store warns)."""
        where = os.path.join(path, "storage.json")
        try:
            with open(where) as f:
                state = json.load(f)
        except FileNotFoundError:
            raise SchemaError(f"{where} is missing: {path} is not a checkpoint of a DiskReplayStorage") from None
        self.load_state_dict(state)

    def __getstate__(self) -> Dict[str, Any]:
        raise UnsupportedError("a DiskReplayStorage holds an open store; send its path and reopen it (read-only "
                               "for readers) instead of pickling it")


class DiskReplayWriter(Writer):
    """A ``torchrl.data`` writer for a :class:`DiskReplayStorage` that keeps no cursor: the store places the rows.

    ``add`` and ``extend`` commit the rows as the store's next rows and
    return their slots (row id modulo ``max_size``: where a round-robin
    writer puts them). So a reopened store, a buffer state older than the
    store's rows and another process appending all continue at the store's
    next row. Its state is what a round-robin writer reads (the next slot
    and the rows written), so a checkpoint loads into a buffer with either
    writer; loading one changes nothing here.

    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ReplayBuffer
    >>> path = tempfile.mkdtemp()
    >>> rb = ReplayBuffer(storage=DiskReplayStorage(path, 4), writer=DiskReplayWriter(), batch_size=2)
    >>> rb.extend(TensorDict({"x": torch.arange(3)}, [3])).tolist()
    [0, 1, 2]
    >>> state = rb.state_dict()
    >>> rb.extend(TensorDict({"x": torch.arange(3, 5)}, [2])).tolist()  # row 4 evicts row 0
    [3, 0]
    >>> rb.storage.close()
    >>> rb = ReplayBuffer(storage=DiskReplayStorage(path), writer=DiskReplayWriter(), batch_size=2)
    >>> rb.load_state_dict(state)  # older than the store's rows: the writer still continues at row 5
    >>> rb.add(TensorDict({"x": torch.tensor(5)}, []))
    1
    >>> rb.storage.get([0, 1, 2, 3])["x"].tolist(), rb.write_count
    ([4, 5, 2, 3], 6)
    >>> rb.storage.close()
    """

    def register_storage(self, storage: Any) -> None:
        """Write to ``storage`` (a buffer calls it as it starts); it must be a :class:`DiskReplayStorage`."""
        if not isinstance(storage, DiskReplayStorage):
            raise UnsupportedError(f"DiskReplayWriter writes to a DiskReplayStorage, got {type(storage).__name__}; "
                                   "use TorchRL's RoundRobinWriter with other storages")
        super().register_storage(storage)

    @property
    def _write_count(self) -> int:  # what TorchRL's ReplayBuffer.write_count and stats() read
        return int(self._storage.store.next_row) if self._storage is not None else 0

    def add(self, data: Any) -> int:
        """Commit one row (a TensorDict without a batch dimension); returns its slot."""
        slot = int(self._write(data)[0])
        self._mark_updated(slot)
        return slot

    def extend(self, data: Any) -> torch.Tensor:
        """Commit a batch of rows (one commit); returns their slots."""
        slots = self._write(data)
        self._mark_updated(slots)
        return slots

    def _write(self, data: Any) -> torch.Tensor:
        if self._storage is None:
            raise UnsupportedError("this DiskReplayWriter has no storage yet; give it to a ReplayBuffer "
                                   "(writer=DiskReplayWriter()) with a DiskReplayStorage")
        return self._storage.append(data)

    def _mark_updated(self, index: Any) -> None:
        # what TorchRL's writers do after a write: the buffers' samplers register the new slots
        for buffer in self._storage._buffers:
            buffer.mark_update(index)

    def _empty(self, empty_write_count: bool = True) -> None:
        self._storage._empty()  # refuses (the store keeps its rows) before the buffer empties its sampler

    def state_dict(self) -> Dict[str, Any]:
        """The next slot and the rows written, as a round-robin writer would load them."""
        if self._storage is None:
            return {"_cursor": 0, "_write_count": 0}
        return {"_cursor": int(self._storage._next_slots(1)[0]), "_write_count": self._write_count}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Change nothing: the writer always continues at the store's next row."""

    def dumps(self, path: Any) -> None:
        """Write :meth:`state_dict` into the directory ``path`` (``metadata.json``, as a round-robin writer does)."""
        state = self.state_dict()
        _checkpoint_dir(path)
        with open(os.path.join(path, "metadata.json"), "w") as f:
            json.dump({"cursor": state["_cursor"], "write_count": state["_write_count"]}, f)

    def loads(self, path: Any) -> None:
        """Change nothing (as :meth:`load_state_dict`)."""


class _FollowsStore:
    """A TorchRL round-robin writer whose cursor gives way to the store's next row after a buffer state
    is loaded: a checkpoint older than the store's last rows (the usual resume after a preemption)
    would make ``extend`` return the slots of other rows. DiskReplayStorage gives it to a buffer that
    was built with TorchRL's default writer."""

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._follow_store()

    def loads(self, path: Any) -> None:
        super().loads(path)
        self._follow_store()

    def _follow_store(self) -> None:
        storage = self._storage
        if isinstance(storage, DiskReplayStorage):
            super().load_state_dict({"_cursor": int(storage._next_slots(1)[0])})


class _FollowingRoundRobinWriter(_FollowsStore, RoundRobinWriter):
    """``ReplayBuffer``'s default writer, following the store (see :class:`_FollowsStore`)."""


class _FollowingTensorDictRoundRobinWriter(_FollowsStore, TensorDictRoundRobinWriter):
    """``TensorDictReplayBuffer``'s default writer, following the store (see :class:`_FollowsStore`)."""


# TorchRL's default writers and the same writers following the store
_FOLLOWERS = {RoundRobinWriter: _FollowingRoundRobinWriter,
              TensorDictRoundRobinWriter: _FollowingTensorDictRoundRobinWriter}


def _numpy(t: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16: its values are exactly float32 ones (the layout casts them back)
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def tensordict_to_columns(data: Any, layout: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A batched TensorDict as the column mapping ``ReplayStore.extend`` takes (nested keys joined with ".").

    ``layout``, when given, receives each tensor column's torch dtype and per-row shape
    (``[dtype, shape]``, shape None for a ragged column): the store keeps ints as int32/int64,
    floats as float32/float64 and at most one dimension per row, and :func:`columns_to_tensordict`
    with the same layout gives the tensors back as they were (bool masks, int8 ids, bfloat16, ...).

    >>> import torch
    >>> from tensordict import TensorDict
    >>> layout = {}
    >>> cols = tensordict_to_columns(TensorDict({"next": {"done": torch.ones(2, 1, dtype=torch.bool)}},
    ...                                         batch_size=[2]), layout)
    >>> list(cols), cols["next.done"].tolist(), layout
    (['next.done'], [[True], [True]], {'next.done': ['torch.bool', [1]]})
    """
    out: Dict[str, Any] = {}
    for key in data.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
        name = SEP.join(key) if isinstance(key, tuple) else key
        if isinstance(data, LazyStackedTensorDict) and issubclass(data.entry_class(key), torch.Tensor):
            parts = data.get(key, as_list=True)
            if any(p.shape != parts[0].shape for p in parts) or parts[0].ndim == 1:
                if any(p.ndim != 1 for p in parts):
                    raise SchemaError(f"{key!r}: rows of different shapes {tuple(parts[0].shape)}, ... must be "
                                      "1-D sequences (one value per token) to be stored")
                out[name] = [_numpy(p) for p in parts]  # one sequence per row: ragged
                if layout is not None:
                    layout[name] = [str(parts[0].dtype), None]
                continue
            value = torch.stack(parts)
        else:
            value = data.get(key)
        if isinstance(value, torch.Tensor):
            if layout is not None:
                layout[name] = [str(value.dtype), list(value.shape[1:])]
            if value.ndim > 2:  # a per-row tensor of several dimensions: stored flat, a vector
                value = value.reshape(value.shape[0], -1)
            out[name] = _numpy(value)
        else:
            out[name] = list(value.tolist() if hasattr(value, "tolist") else value)
    _state_vectors(out)
    return out


def _state_vectors(out: Dict[str, Any]) -> None:
    """Pass the dense per-row tensors of ``out`` as Arrow fixed-size lists: the type tells ``extend``
    they are vectors, where a 2-D array would have its role guessed from its name (``("tokens",
    "full")`` padded to [B, 128] would be taken for a per-token column without ids to strip it with).
    TRL's padded layout is left as ``extend`` reads it: ``prompt_ids`` / ``completion_ids``, ``*_ids``
    with their ``*_mask``, and the columns of their ids' shape (per-token ones, stripped with the mask)."""
    ids = {k: out[k].shape for k in (PROMPT_IDS, COMPLETION_IDS)
           if isinstance(out.get(k), np.ndarray) and out[k].ndim == 2}
    for name, v in out.items():
        if not isinstance(v, np.ndarray) or v.ndim != 2 or not v.shape[1]:
            continue
        if (name.endswith(MASK_SUFFIX) and name[:-len(MASK_SUFFIX)] + "_ids" in out
                or name.endswith("_ids") and name[:-len("_ids")] + MASK_SUFFIX in out):
            continue
        ref = PROMPT_IDS if name.startswith("prompt_") else COMPLETION_IDS
        if name in ids or ids.get(ref) == v.shape:
            continue
        out[name] = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(v).reshape(-1)), v.shape[1])


def _restore(t: torch.Tensor, spec: Any, n: int) -> torch.Tensor:
    """``t`` as ``layout`` recorded it: its torch dtype, and (dense columns) its per-row shape."""
    if not spec:
        return t
    dtype = getattr(torch, str(spec[0]).replace("torch.", ""), None)
    if isinstance(dtype, torch.dtype) and t.dtype != dtype:
        t = t.to(dtype)
    shape = spec[1] if len(spec) > 1 else None
    if shape is not None and tuple(t.shape[1:]) != tuple(shape):
        t = t.reshape(n, *shape)
    return t


def _is_leaf(cls: type) -> bool:
    return not issubclass(cls, TensorDictBase) or issubclass(cls, (NonTensorData, NonTensorStack))


def columns_to_tensordict(batch: Dict[str, Any], n: int, layout: Optional[Dict[str, Any]] = None) -> Any:
    """``store.read(rows)`` as a TensorDict of ``n`` rows: nested keys back, a lazy stack when a column is ragged;
    with a ``layout`` (:func:`tensordict_to_columns`) each tensor's dtype and per-row shape back. A row
    without a value in a ragged column (extended before the column was, or with ``None``) comes back
    without that key, as it was extended.

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp(), group_key=None)
    >>> _ = store.extend({"next.reward": [1.0, 2.0], "tokens.full": [[1, 2], [3]]})
    >>> td = columns_to_tensordict(store.read([1, 0]), 2)
    >>> td["next", "reward"].tolist(), [t.tolist() for t in td.get(("tokens", "full"), as_list=True)]
    ([2.0, 1.0], [[3], [1, 2]])
    """
    dense: Dict[Any, Any] = {}
    ragged: Dict[Any, RaggedColumn] = {}
    for name, col in batch.items():
        key = tuple(name.split(SEP)) if SEP in name else name
        if isinstance(col, RaggedColumn):
            ragged[key] = col
        elif isinstance(col, list):
            dense[key] = NonTensorStack.from_list(col)
        else:
            dense[key] = _restore(torch.from_numpy(np.ascontiguousarray(col)), (layout or {}).get(name), n)
    td = TensorDict(batch_size=[n])
    for key, value in dense.items():
        td.set(key, value)
    if not ragged:
        return td
    specs = {key: (layout or {}).get(SEP.join(key) if isinstance(key, tuple) else key) for key in ragged}
    rows = []
    for i in range(n):
        one = td[i]
        for key, col in ragged.items():
            v = col[i]
            if v is None:  # not computed for this row: no key, as it was extended
                continue
            v = np.asarray(v)
            # token ids come back as int64 (what embeddings index with) unless the layout says otherwise
            t = torch.from_numpy(v.astype(np.int64) if v.dtype.kind in "iu" else v.copy())
            spec = specs[key]
            one.set(key, _restore(t, spec[:1], 1) if spec else t)
        rows.append(one)
    return lazy_stack(rows)
