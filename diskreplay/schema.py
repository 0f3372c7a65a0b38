"""The column model: column roles, :class:`ColumnSpec` and :class:`Schema`.

Column kinds:

``ragged``  one variable-length 1-D array per row, stored as ``large_list``;
            ints as int32 (token ids), floats as float32 (log-probs). Aligned
            with ``prompt_ids`` (names starting ``prompt_``) or with
            ``completion_ids`` (every other ragged column when completions are
            present): each row must then have the same length as its ids.
``scalar``  one value per row: int64, float32/float64, bool or string.
``vector``  a fixed-width float/int vector per row (e.g. one reward per reward
            function), stored as ``fixed_size_list``.

A ragged column with a ``shape`` is a *per-token tensor* column: each token
holds a fixed-shape small tensor (MoE routed experts: ``[num_layers, top_k]``),
stored as uint8, uint16 or int16 (:data:`TOKEN_TENSOR_DTYPES`), the token's
elements one after another in the same ``large_list`` (a row of ``n`` tokens
holds ``n * prod(shape)`` values). ``align`` may then also be ``"sequence"``:
one tensor per token of the prompt and completion but the last (what vLLM
returns, ``[seq_len - 1, num_layers, top_k]``). ``fill`` is the value that
pads it in a batch.

A vector column with ``media`` is a *media* column (:class:`Media`): each row
names one image, video, audio clip or array stored once per content in the
store; the row holds its SHA-256 content hash (four int64), not its bytes.

Turning a batch into columns of these kinds is :mod:`diskreplay.ingest`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from ._moved import moved
from .errors import BatchSchemaError, FormatError
from .ragged import TOKEN_TENSOR_ALIGNS, TOKEN_TENSOR_DTYPES, dtype_range

PROMPT_IDS = "prompt_ids"
COMPLETION_IDS = "completion_ids"
MASK_SUFFIX = "_mask"

#: the longest column name (a reader refuses a longer one, so a writer does too)
MAX_COLUMN_NAME = 256
RAGGED, SCALAR, VECTOR = "ragged", "scalar", "vector"
_SCALAR_DTYPES = ("int64", "float32", "float64", "bool", "string")
_MAX_TOKEN_TENSOR = 1 << 16  # elements per token



_ARROW_TYPES: Dict[Tuple[str, str, Optional[int]], pa.DataType] = {}


@dataclass(frozen=True)
class ColumnSpec:
    """One column of a store's schema.

    >>> ColumnSpec("completion_ids", "ragged", "int32", align="completion").arrow_type
    LargeListType(large_list<item: int32>)
    """

    name: str
    kind: str  # ragged | scalar | vector
    dtype: str  # numpy dtype name, or "string"
    align: Optional[str] = None  # "prompt" | "completion" | None (ragged only)
    width: Optional[int] = None  # vector only
    shape: Optional[Tuple[int, ...]] = None  # a per-token tensor's shape (ragged only)
    fill: Optional[int] = None  # a per-token tensor's padding value
    media: bool = False  # a media column: each row holds a content hash (docs/FORMAT.md, "Media")

    @property
    def token_size(self) -> int:
        """Values per token: ``prod(shape)`` for a per-token tensor, else 1."""
        return 1 if self.shape is None else int(np.prod(self.shape))

    @property
    def arrow_type(self) -> pa.DataType:
        key = (self.kind, self.dtype, self.width)
        t = _ARROW_TYPES.get(key)  # asked for per column of every batch and segment: built once
        if t is None:
            t = _ARROW_TYPES[key] = self._make_arrow_type()
        return t

    def _make_arrow_type(self) -> pa.DataType:
        if self.dtype == "string":
            return pa.large_string()
        item = pa.from_numpy_dtype(np.dtype(self.dtype))
        if self.kind == RAGGED:
            return pa.large_list(item)
        if self.kind == VECTOR:
            return pa.list_(item, self.width)
        return item

    def to_dict(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "dtype": self.dtype}
        if self.align is not None:
            d["align"] = self.align
        if self.width is not None:
            d["width"] = self.width
        if self.shape is not None:
            d["shape"] = list(self.shape)
            d["fill"] = self.fill
        if self.media:
            d["media"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ColumnSpec":
        try:
            shape = d.get("shape")
            spec = cls(name=str(d["name"]), kind=str(d["kind"]), dtype=str(d["dtype"]),
                       align=d.get("align"), width=d.get("width"),
                       shape=None if shape is None else tuple(shape), fill=d.get("fill"),
                       media=d.get("media", False))
        except (KeyError, TypeError) as exc:
            raise FormatError(f"Unsupported column description {d!r}; expected "
                              "name, kind and dtype") from exc
        ok = (
            (spec.kind == RAGGED and spec.dtype in ("int32", "float32") and spec.shape is None
             and spec.fill is None and spec.align in (None, "prompt", "completion") and spec.width is None)
            or (spec.kind == RAGGED and token_tensor_problem(spec) is None)
            or (spec.kind == SCALAR and spec.dtype in _SCALAR_DTYPES and spec.width is None)
            or (spec.kind == VECTOR and spec.dtype in ("int64", "float32", "float64", "bool")
                and isinstance(spec.width, int) and 0 < spec.width < 1 << 20 and spec.media is False)
            or (spec.kind == VECTOR and spec.dtype == "int64" and spec.width == MEDIA_WIDTH and spec.media is True
                and spec.align is None and spec.shape is None and spec.fill is None)
        )
        if not ok or not spec.name or len(spec.name) > MAX_COLUMN_NAME:
            raise FormatError(f"Unsupported column description {d!r}; expected a ragged "
                              "int32/float32, per-token tensor, scalar or vector column")
        return spec


#: a media column's width: a SHA-256 content hash as four little-endian int64
MEDIA_WIDTH = 4
#: the media type of an array stored as raw bytes with its dtype and shape
ARRAY_MIME = "application/x-array"
_MEDIA_MAX_BYTES = 1 << 40


def media_spec(name: str) -> ColumnSpec:
    """The column description of a media column.

    >>> media_spec("image").to_dict()
    {'name': 'image', 'kind': 'vector', 'dtype': 'int64', 'width': 4, 'media': True}
    """
    return ColumnSpec(name, VECTOR, "int64", width=MEDIA_WIDTH, media=True)


def media_hash(descriptor: Mapping[str, Any], payload: Any) -> bytes:
    """The 32-byte content hash of a blob: SHA-256 of its descriptor (canonical JSON) and its bytes
    (docs/FORMAT.md, "Media").

    >>> media_hash({"mime": "image/png"}, b"x").hex()[:16]
    '1dce71f46c7587c5'
    """
    import hashlib
    import json

    h = hashlib.sha256(json.dumps(dict(descriptor), sort_keys=True, separators=(",", ":")).encode() + b"\n")
    h.update(payload)
    return h.digest()


def hash_words(digest: bytes) -> np.ndarray:
    """A 32-byte hash as the four int64 a media column's row holds (and back: ``words.tobytes()``).

    >>> hash_words(bytes(range(32))).tobytes() == bytes(range(32))
    True
    """
    return np.frombuffer(digest, dtype="<i8").copy()


_MIME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$&^_.+-/")

def mime_problem(mime: Any) -> Optional[str]:
    """Why ``mime`` is not a media type a store records (``type/subtype``, at most 127 characters), or None.

    >>> mime_problem("image/png"), mime_problem("png")
    (None, "'png' is not a media type like 'image/png'")
    """
    if (not isinstance(mime, str) or not 3 <= len(mime) <= 127 or mime.count("/") != 1
            or not set(mime) <= _MIME_CHARS or mime.startswith("/") or mime.endswith("/")):
        return f"{mime!r} is not a media type like 'image/png'"
    return None


class Media:
    """A media column for ``extend``: one image, video, audio clip or array per row, stored once
    per content (docs/media.md). A row is ``bytes`` (encoded media, ``mime`` says what they are:
    one type for the column or one per row) or a numpy array (stored as its raw C-order bytes with
    its dtype and shape, mime ``application/x-array``; a torch tensor as its numpy array; object
    arrays are refused: nothing is pickled). Rows with equal content (a group's samples sharing their prompt's image) name one
    blob; the column reads back as the content hashes, ``[n, 4]`` int64, which
    :class:`~diskreplay.MediaReader` turns into bytes.

    >>> import numpy as np
    >>> m = Media([b"PNG 1", b"PNG 1", np.zeros((2, 2), np.uint8)], mime="image/png")
    >>> len(m), len(set(h.tobytes() for h in m.hashes()[0]))
    (3, 2)
    """

    __slots__ = ("values", "mime", "_blobs")

    def __init__(self, values: Sequence[Any], mime: Any = None) -> None:
        from .errors import ArgumentError

        if isinstance(values, (bytes, bytearray, memoryview, np.ndarray)) and not (
                isinstance(values, np.ndarray) and values.dtype == object):
            raise ArgumentError("Media(values=...) takes one value per row (a list of bytes or arrays), got a single "
                                f"{type(values).__name__}; wrap it in a list")
        self.values, self.mime, self._blobs = list(values), mime, None
        if isinstance(mime, (list, tuple)) and len(mime) != len(self.values):
            raise ArgumentError(f"Media mime= has {len(mime)} entries for {len(self.values)} rows; give one type for "
                                "the column or one per row")

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"Media(rows={len(self)}, mime={self.mime!r})"

    def blobs(self, name: str) -> Tuple[np.ndarray, Dict[bytes, Tuple[dict, Any]]]:
        """``(hashes [n, 4] int64, {hash: (descriptor, payload)})``, each distinct content once;
        raises ``BatchError`` naming the column and row of a value that is not media. Hashed once
        per instance (the writer and the validation both ask)."""
        from .errors import BatchError

        if self._blobs is not None:
            return self._blobs

        words = np.empty((len(self.values), MEDIA_WIDTH), dtype=np.int64)
        out: Dict[bytes, Tuple[dict, Any]] = {}
        # a group's samples usually pass the same object: hashed once (the list keeps each alive)
        same: Dict[Tuple[int, Any], np.ndarray] = {}
        for i, v in enumerate(self.values):
            mime = self.mime[i] if isinstance(self.mime, (list, tuple)) else self.mime
            known = same.get((id(v), mime))
            if known is not None:
                words[i] = known
                continue
            if hasattr(v, "detach") and hasattr(v, "numpy"):  # a torch tensor (bfloat16 has no numpy dtype)
                t = v.detach().cpu()
                v = (t.float() if str(t.dtype) == "torch.bfloat16" else t).numpy()
            if isinstance(v, np.ndarray):
                if v.dtype.hasobject or v.dtype.fields is not None:
                    raise BatchError(f"column {name!r} row {i} is an array of {v.dtype}; media arrays hold numbers "
                                     "(nothing is pickled)")
                v = v if v.flags.c_contiguous else v.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
                desc: dict = {"mime": ARRAY_MIME, "dtype": v.dtype.str, "shape": [int(x) for x in v.shape]}
                payload: Any = memoryview(v).cast("B") if v.size else b""
            elif isinstance(v, (bytes, bytearray, memoryview)):
                if mime is None:
                    raise BatchError(f"column {name!r} row {i} holds bytes without a media type; give "
                                     "Media(..., mime='image/png') (or one per row)")
                why = mime_problem(mime)
                if why is not None:
                    raise BatchError(f"column {name!r} row {i}: mime {why}")
                desc, payload = {"mime": mime}, v
            else:
                raise BatchError(f"column {name!r} row {i} is a {type(v).__name__}; a media row is bytes (with a "
                                 "mime type) or a numpy array")
            if len(payload) > _MEDIA_MAX_BYTES:
                raise BatchError(f"column {name!r} row {i} holds {len(payload)} bytes, more than a blob may hold "
                                 f"({_MEDIA_MAX_BYTES})")
            digest = media_hash(desc, payload)
            words[i] = same[(id(v), mime)] = np.frombuffer(digest, dtype="<i8")
            out.setdefault(digest, (desc, payload))
        self._blobs = (words, out)
        return words, out

    def hashes(self) -> Tuple[np.ndarray, int]:
        """``(hashes [n, 4] int64, distinct contents)`` without keeping the payloads."""
        words, blobs = self.blobs("media")
        return words, len(blobs)


def token_tensor_problem(spec: ColumnSpec) -> Optional[str]:
    """Why ``spec`` is not a valid per-token tensor column, or None.

    >>> token_tensor_problem(ColumnSpec("routed_experts", "ragged", "uint8", "completion", shape=(48, 8), fill=0))
    >>> token_tensor_problem(ColumnSpec("r", "ragged", "int32", "completion", shape=(2,), fill=0))
    "dtype 'int32' is not one of ('uint8', 'uint16', 'int16')"
    """
    if spec.dtype not in TOKEN_TENSOR_DTYPES:
        return f"dtype {spec.dtype!r} is not one of {TOKEN_TENSOR_DTYPES}"
    if spec.align not in TOKEN_TENSOR_ALIGNS:
        return f"align {spec.align!r} is not one of {TOKEN_TENSOR_ALIGNS}"
    shape = spec.shape
    if (not isinstance(shape, tuple) or not 1 <= len(shape) <= 4
            or not all(type(x) is int and 0 < x for x in shape) or int(np.prod(shape)) > _MAX_TOKEN_TENSOR):
        return (f"shape {shape!r} is not 1 to 4 positive ints of at most {_MAX_TOKEN_TENSOR} elements "
                "in all")
    lo, hi = dtype_range(spec.dtype)
    if type(spec.fill) is not int or not lo <= spec.fill <= hi:
        return f"fill {spec.fill!r} is not an int in [{lo}, {hi}] ({spec.dtype})"
    if spec.width is not None:
        return f"width {spec.width!r} is given (a vector's)"
    return None


class Schema:
    """The ordered columns of a store: those fixed by the first ``extend``, then the late ones.

    A *late* column was added by a commit after the first (see
    :func:`check_late_column` for which columns may be); ``late`` maps its
    name to ``(since_row, since_generation)``, the first row that could hold it
    and the commit that added it, or to ``None`` while the batch that adds it
    is not yet committed. Rows older than a late column read as "not computed".

    >>> s = Schema([ColumnSpec("rewards", "scalar", "float32")])
    >>> s.names, "rewards" in s
    (['rewards'], True)
    >>> s = s.with_late([ColumnSpec("sampling_per_token_logps", "ragged", "float32")])
    >>> s.names, s.initial().names, s.pending()[0].name
    (['rewards', 'sampling_per_token_logps'], ['rewards'], 'sampling_per_token_logps')
    """

    def __init__(self, columns: Sequence[ColumnSpec],
                 late: Optional[Mapping[str, Optional[Tuple[int, int]]]] = None) -> None:
        self.columns: Dict[str, ColumnSpec] = {c.name: c for c in columns}
        self.late: Dict[str, Optional[Tuple[int, int]]] = dict(late or {})

    @property
    def names(self) -> List[str]:
        return list(self.columns)

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def __getitem__(self, name: str) -> ColumnSpec:
        return self.columns[name]

    def __len__(self) -> int:
        return len(self.columns)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Schema) and list(self.columns.values()) == list(other.columns.values())
                and self.late == other.late)

    def arrow_schema(self) -> pa.Schema:
        # built once per schema: every segment open compares against it (~30 us to build)
        cached = self.__dict__.get("_arrow")
        if cached is None or len(cached) != len(self.columns):
            cached = self._arrow = pa.schema([pa.field(c.name, c.arrow_type) for c in self.columns.values()])
        return cached

    def to_list(self) -> List[dict]:
        """The columns fixed by the first ``extend`` (what ``FORMAT.json`` records; late ones are in manifests)."""
        return [c.to_dict() for c in self.columns.values() if c.name not in self.late]

    def initial(self) -> "Schema":
        """The columns fixed by the first ``extend``, without the late ones."""
        return Schema([c for c in self.columns.values() if c.name not in self.late])

    def pending(self) -> List[ColumnSpec]:
        """Late columns added by a batch that is not committed yet."""
        return [self.columns[n] for n, since in self.late.items() if since is None]

    def with_late(self, specs: Sequence[ColumnSpec],
                  since: Optional[Sequence[Optional[Tuple[int, int]]]] = None) -> "Schema":
        """This schema plus the late columns ``specs`` (``since``: as in ``late``; default pending)."""
        since = [None] * len(specs) if since is None else list(since)
        return Schema(list(self.columns.values()) + list(specs),
                      {**self.late, **{s.name: w for s, w in zip(specs, since)}})

    def segment_problem(self, arrow_schema: pa.Schema) -> Optional[str]:
        """Why a segment with ``arrow_schema`` cannot belong to a store of this schema, or None.

        Without late columns a segment's schema equals the store's exactly. A
        late column may be missing from a segment (its rows were committed
        before the column existed, or by a writer that did not know it yet);
        every column a segment holds has exactly the store's type.
        """
        if not self.late:
            want = self.arrow_schema()
            return None if arrow_schema.equals(want) else f"schema {arrow_schema.types} disagrees with {want.types}"
        names = arrow_schema.names
        if len(set(names)) != len(names):
            return f"column names {names} repeat"
        for f in arrow_schema:
            spec = self.columns.get(f.name)
            if spec is None:
                return f"column {f.name!r} is not in the store's schema ({self.names})"
            if f.type != spec.arrow_type:
                return f"column {f.name!r} is {f.type}, the store's schema says {spec.arrow_type}"
        missing = [n for n in self.columns if n not in self.late and n not in names]
        if missing:
            return f"column {missing[0]!r} is missing"
        return None

    def conform(self, record: pa.RecordBatch) -> pa.RecordBatch:
        """``record`` with every column of this schema, in order: late ones it lacks as nulls.

        >>> s = Schema([ColumnSpec("x", "scalar", "int64")]).with_late([ColumnSpec("y", "scalar", "float32")])
        >>> s.conform(pa.record_batch({"x": pa.array([1, 2])})).column("y").null_count
        2
        """
        if record.schema.names == self.names:
            return record
        arrays = [record.column(n) if n in record.schema.names else pa.nulls(record.num_rows, c.arrow_type)
                  for n, c in self.columns.items()]
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema())

    @classmethod
    def from_list(cls, items: Any) -> "Schema":
        if not isinstance(items, list) or len(items) > 4096:
            raise FormatError(f"Unsupported schema {type(items).__name__}; expected a list of columns")
        for d in items:
            if not isinstance(d, Mapping):
                raise FormatError(f"Unsupported column description {d!r}; expected an object")
        specs = [ColumnSpec.from_dict(d) for d in items]
        if len({s.name for s in specs}) != len(specs):
            raise FormatError("Unsupported schema: duplicate column names")
        return cls(specs)

    def __repr__(self) -> str:
        return f"Schema({', '.join(f'{c.name}:{c.kind}<{c.dtype}>' + (str(list(c.shape)) if c.shape else '') for c in self.columns.values())})"


def late_column_problem(spec: ColumnSpec) -> Optional[str]:
    """Why ``spec`` cannot be added to a store after its first commit, or None.

    Rows committed before a late column exist without it, so it must have a
    "not computed" value: a ragged (per-token) column, whose rows may be null,
    or a floating-point per-row column (scalar or vector), whose missing rows
    read as NaN.

    >>> late_column_problem(ColumnSpec("sampling_per_token_logps", "ragged", "float32")) is None
    True
    >>> late_column_problem(ColumnSpec("policy_version", "scalar", "int64"))[:28]
    'a scalar column of int64 has'
    """
    if spec.media:
        return "a media column names a blob in every row, so it is given in the store's first extend"
    if spec.kind == RAGGED or spec.dtype in ("float32", "float64"):
        return None
    return (f"a {spec.kind} column of {spec.dtype} has no \"not computed\" value for the rows committed "
            "before it (only ragged columns and float per-row columns do)")


def check_late_column(spec: ColumnSpec, schema: "Schema") -> None:
    """Raise ``BatchSchemaError`` unless ``spec`` may be added to a store whose schema is ``schema``.

    >>> check_late_column(ColumnSpec("judge_score", "scalar", "float32"), Schema([]))
    >>> check_late_column(ColumnSpec("step", "scalar", "int64"), Schema([]))
    Traceback (most recent call last):
    ...
    diskreplay.errors.BatchSchemaError: column 'step' is not in the store's schema (columns: []) and cannot be added after the first commit: a scalar column of int64 has no "not computed" value for the rows committed before it (only ragged columns and float per-row columns do); store it as float (e.g. .float()), or start a new store with it in the first extend
    """
    why = late_column_problem(spec)
    if why is not None:
        raise BatchSchemaError(f"column {spec.name!r} is not in the store's schema (columns: {schema.names}) and "
                               f"cannot be added after the first commit: {why}; store it as float (e.g. .float()), "
                               "or start a new store with it in the first extend")


# ``normalize_batch`` and ``infer_schema`` under their earlier import path (they live in diskreplay.ingest)
__getattr__ = moved(__name__, dict.fromkeys(("normalize_batch", "infer_schema"), "diskreplay.ingest"))
