"""One TransferQueue value as the columns of one row, and back: tensors as bytes, other values as JSON.

A value is one sample's field (``KVStorageManager`` unbinds nested tensors and
``NonTensorStack`` columns into one value per sample). It is kept as:

- a ``torch.Tensor`` (any dtype torch has, bfloat16 and bool included, any
  shape, jagged samples of different lengths): its raw bytes, its dtype name
  and its shape; it comes back as a CPU tensor equal to it;
- a numpy array or scalar of a numeric or bool dtype: the same, as numpy;
- ``None``, ``bool``, ``int``, ``float``, ``str`` and lists and dicts (with
  str keys) of those: JSON text.

Anything else (a tuple, an object, a numpy array of objects) is refused with an
error naming the key: nothing is ever pickled, so a store opened from anywhere
never runs code.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, List

import numpy as np
import torch

from ...errors import BatchError

TENSOR, NUMPY, JSON, CLEARED = "tensor", "numpy", "json", "cleared"

_NUMPY_KINDS = "biufc"  # bool, signed and unsigned ints, floats, complex: raw bytes with a dtype
_NO_BYTES = np.zeros(0, dtype=np.uint8)
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@dataclass(frozen=True)
class Encoded:
    """A value as one row's columns: its kind, dtype and shape, its bytes (tensors) or text (JSON)."""

    kind: str
    dtype: str
    shape: str  # JSON list of ints ("" for JSON values)
    data: np.ndarray  # uint8, a view of the value's memory where it allows one
    text: str

    @property
    def digest(self) -> str:
        """What the value is, for equality (128 bits of SHA-256 over kind, dtype, shape and contents)."""
        h = hashlib.sha256()
        h.update(f"{self.kind}\0{self.dtype}\0{self.shape}\0".encode())
        h.update(memoryview(self.data))
        h.update(self.text.encode())
        return h.hexdigest()[:32]


def encode(key: str, value: Any) -> Encoded:
    """``value`` as a row's columns; a value that cannot be kept without pickle raises naming ``key``.

    >>> e = encode("3@responses", torch.tensor([[1, 2, 3]], dtype=torch.int32))
    >>> e.kind, e.dtype, e.shape, e.data.nbytes
    ('tensor', 'int32', '[1, 3]', 12)
    >>> encode("3@uid", {"uid": "a", "n": [1, 2]}).text
    '{"uid": "a", "n": [1, 2]}'
    """
    if isinstance(value, torch.Tensor):
        if value.is_nested or value.layout != torch.strided:
            raise BatchError(f"TransferQueue value {key!r} is a {value.layout} tensor"
                             f"{' (nested)' if value.is_nested else ''}; only dense tensors are stored (the "
                             "KVStorageManager unbinds a nested field into one dense tensor per sample)")
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else _NO_BYTES
        return Encoded(TENSOR, str(t.dtype).removeprefix("torch."), json.dumps(list(t.shape)), raw, "")
    if isinstance(value, (np.ndarray, np.generic)):
        a = np.asarray(value)
        if a.dtype.kind not in _NUMPY_KINDS:
            raise BatchError(f"TransferQueue value {key!r} is a numpy {type(value).__name__} of dtype {a.dtype}; "
                             "only numeric and bool numpy values are stored (as bytes); pass strings and lists "
                             "as plain Python values (stored as JSON): nothing is pickled")
        shape = list(a.shape) if isinstance(value, np.ndarray) else None  # None: a numpy scalar
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8) if a.size else _NO_BYTES
        return Encoded(NUMPY, a.dtype.str, json.dumps(shape), raw, "")
    _check_json(key, value)
    return Encoded(JSON, "", "", _NO_BYTES, json.dumps(value, ensure_ascii=False))


def _check_json(key: str, value: Any) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for item in value:
            _check_json(key, item)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise BatchError(f"TransferQueue value {key!r} is a dict with the key {k!r} of type "
                                 f"{type(k).__name__}; JSON keys are str: use str keys (nothing is pickled)")
            _check_json(key, item)
        return
    what = type(value).__name__
    fix = "a list" if isinstance(value, tuple) else "a tensor, a numeric numpy array, or JSON values"
    raise BatchError(f"TransferQueue value {key!r} holds a {what} ({_short(value)}), which cannot be stored "
                     f"without pickle; store {fix} instead (tensors as bytes, None/bool/int/float/str and lists "
                     "and dicts of them as JSON)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def decode(kind: str, dtype: str, shape: str, data: np.ndarray, text: str, *, owned: bool = False) -> Any:
    """The value :func:`encode` made these columns from (``data`` a uint8 array: copied, unless ``owned``
    says the value may keep viewing it).

    >>> e = encode("0@x", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    >>> decode(e.kind, e.dtype, e.shape, e.data, e.text).tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    if kind == TENSOR:
        dims: List[int] = json.loads(shape)
        torch_dtype = _TORCH_DTYPES[dtype]
        if not len(data):
            return torch.empty(dims, dtype=torch_dtype)
        t = torch.from_numpy(data if owned else data.copy())
        try:
            return t.view(torch_dtype).reshape(dims)
        except RuntimeError:  # a view at an offset that is not a multiple of the element size
            return t.clone().view(torch_dtype).reshape(dims)
    if kind == NUMPY:
        dims = json.loads(shape)
        a = data.copy().view(np.dtype(dtype)) if len(data) else np.zeros(0, dtype=np.dtype(dtype))  # aligned
        return a[0] if dims is None else a.reshape(dims)
    return json.loads(text)
