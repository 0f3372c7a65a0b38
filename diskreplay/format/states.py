"""Saved states (a sampler's or a trainer's ``state_dict()``) as Arrow IPC files, without pickle:
JSON for the structure in the schema metadata, one Arrow column per numeric array (docs/FORMAT.md,
"Saved states"). Writing a state's file as part of a commit is the store's (``store/states.py``)."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import numpy as np
import pyarrow as pa

from .._fileio import crc32c
from ..errors import ArgumentError, CorruptStoreError
from ..ragged import arrow_array, numpy_view
from ..segment import encode_ipc
from ..storage.base import Storage
from .entries import StateEntry

STATE_META = b"diskreplay.state"


def encode_state(state: Dict[str, Any]) -> pa.Buffer:
    """Serialise a state dict (JSON values, numpy arrays, torch tensors) without pickle.

    >>> buf = encode_state({"step": 3, "prio": np.array([0.5, 1.0], dtype=np.float32)})
    >>> d = decode_state(buf, "x"); d["step"], d["prio"].dtype.name
    (3, 'float32')
    """
    arrays: List[np.ndarray] = []

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                if not isinstance(k, str):
                    raise ArgumentError(f"state keys must be strings, got {k!r}")
                out[k] = walk(v)
            return {"__dict__": out} if "__array__" in out or "__dict__" in out else out
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor
            x = x.detach().cpu().numpy()
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in "biuf":
                raise ArgumentError(f"state arrays must be numeric, got dtype {x.dtype}")
            arrays.append(np.ascontiguousarray(x))
            return {"__array__": len(arrays) - 1, "shape": list(x.shape), "dtype": x.dtype.str}
        if isinstance(x, np.generic):
            return x.item()
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise ArgumentError(f"cannot store a {type(x).__name__} in a state; use JSON values and arrays")

    doc = walk(state)
    # (pa.array would import pandas on a writer's first save: ~0.2 s; see arrow_array)
    cols = [pa.LargeListArray.from_arrays(arrow_array(np.array([0, a.size], dtype=np.int64)),
                                          arrow_array(a.reshape(-1)))
            for a in arrays]
    names = [f"a{i}" for i in range(len(arrays))]
    schema = pa.schema([pa.field(n, c.type) for n, c in zip(names, cols)],
                       metadata={STATE_META: json.dumps(doc).encode()})
    rb = pa.RecordBatch.from_arrays(cols, schema=schema) if cols else pa.RecordBatch.from_pylist([], schema=schema)
    return encode_ipc(rb)


def decode_state(buf: Any, path: str) -> Dict[str, Any]:
    """The state :func:`encode_state` made of ``buf``; ``CorruptStoreError`` naming ``path`` for anything else."""
    try:
        reader = pa.ipc.open_file(pa.py_buffer(buf) if not isinstance(buf, pa.Buffer) else buf)
        batch = reader.read_all()
        doc = json.loads(reader.schema.metadata[STATE_META])
    except (pa.ArrowException, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CorruptStoreError(f"{path} is not a readable state file ({exc})") from None

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if "__array__" in x:
                i = x["__array__"]
                if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < batch.num_columns:
                    raise CorruptStoreError(f"{path}: bad array reference {i!r}")
                try:
                    dtype = np.dtype(x["dtype"])
                    if dtype.kind not in "biuf":
                        raise TypeError(f"non-numeric dtype {dtype}")
                    flat = numpy_view(batch.column(i).chunk(0).values)
                    return flat.astype(dtype, copy=False).reshape(x["shape"]).copy()
                except (KeyError, TypeError, ValueError) as exc:
                    raise CorruptStoreError(f"{path}: bad array {x!r} ({exc})") from None
            if "__dict__" in x:
                inner = x["__dict__"]
                if not isinstance(inner, dict):
                    raise CorruptStoreError(f"{path}: bad object {inner!r}")
                return {k: walk(v) for k, v in inner.items()}
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    try:
        return walk(doc)
    except RecursionError:
        raise CorruptStoreError(f"{path}: state nested too deeply") from None


def read_state_file(storage: Storage, root: str, entry: StateEntry) -> Dict[str, Any]:
    """The state a manifest's ``entry`` names, checked against its size and CRC-32C (``root``: the
    store's location, for messages)."""
    path = f"{root}/{entry.file}"
    raw = storage.read_bytes(entry.file, entry.bytes)
    if len(raw) != entry.bytes or crc32c(raw) != entry.crc32c:
        raise CorruptStoreError(f"{path} fails its checksum; the saved state {entry.name!r} is damaged")
    return decode_state(raw, path)
