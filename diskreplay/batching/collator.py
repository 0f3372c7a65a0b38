"""``Collator``: collate batch after batch into the same buffers.

A padded GRPO batch of 512 rows is ~56 MB. Allocating it afresh on every call
(``collate(store.read(rows), pad)``) makes the kernel hand out and zero new
pages each time, which on the machines we measured costs about as much again
as the padding itself; a collator writes every batch into buffers it keeps,
grown (with headroom) only when a batch needs more.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from .. import _jit
from ..errors import ArgumentError
from .columns import GrowingBuffers, check_ids_dtype, check_pad_fits, check_pad_token
from .packed import collate_packed
from .padded import collate, collate_unpadded

__all__ = ["Collator", "LAYOUTS"]

#: What a :class:`Collator` (and ``ReplayLoader(layout=...)``) can build.
LAYOUTS = ("padded", "packed")


class Collator:
    """Collate batches read from the store into reused output buffers.

    ``layout="padded"`` gives :func:`~diskreplay.batching.padded.collate`'s result
    (TRL's layout, padded with ``pad_token_id``), ``layout="packed"``
    :func:`~diskreplay.batching.packed.collate_packed`'s (one padding-free token
    stream; ``pad_token_id`` is not needed; ``batch_dim`` as there).
    ``pin_memory=True`` keeps the buffers in pinned memory (needs CUDA), so
    ``.to("cuda", non_blocking=True)`` of the outputs is asynchronous.
    ``ids_dtype``: the dtype of the token ids (``prompt_ids``, ``completion_ids``;
    ``input_ids`` packed): ``torch.int64`` as TRL has them, or ``torch.int32``,
    half their bytes to write and to copy to a device (``nn.Embedding`` takes
    int32; the store keeps ids as int32, so nothing is lost).
    ``schema``: the store's schema (``store.schema``), which declares its
    per-token tensor columns (routed experts: see ``collate``); :meth:`read`
    takes the store's own.
    ``media``: for a media column (docs/media.md), ``{column: process}``: :meth:`read` serves
    the batch's blobs (``MediaReader.batch``: one value per row, the rows naming one blob
    sharing one object, decoded once by ``media_decode[column](value, entry)`` where given) and
    adds what ``process(values)`` returns (a VLM processor's ``pixel_values``,
    ``image_grid_thw``, ...) to the batch, which keeps the column's hashes.

    **Validity**: the tensors a call returns are views of the collator's
    buffers; the NEXT call on the same collator overwrites them (or, when the
    batch is larger, moves to larger buffers and leaves them stale).
    ``.clone()`` what must outlive the next call, or use one collator per
    batch you keep. Lists and ``None`` values are never reused.

    >>> import numpy as np
    >>> from diskreplay import RaggedColumn
    >>> collator = Collator(pad_token_id=0)
    >>> b = {"completion_ids": RaggedColumn.from_arrays([[1], [2, 3]], dtype=np.int32)}
    >>> first = collator(b)
    >>> first["completion_ids"].tolist()
    [[1, 0], [2, 3]]
    >>> second = collator({"completion_ids": RaggedColumn.from_arrays([[4, 5], [6]], dtype=np.int32)})
    >>> first["completion_ids"].data_ptr() == second["completion_ids"].data_ptr()  # the same memory
    True
    >>> Collator(layout="packed")(b)["input_ids"].tolist()
    [[1, 2, 3]]
    >>> Collator(0, ids_dtype=torch.int32)(b)["completion_ids"].dtype
    torch.int32
    """

    def __init__(self, pad_token_id: Optional[int] = None, *, layout: str = "padded",
                 batch_dim: bool = True, pin_memory: bool = False, ids_dtype: torch.dtype = torch.int64,
                 schema: Any = None, media: Optional[Mapping[str, Callable[[List[Any]], Mapping[str, Any]]]] = None,
                 media_decode: Optional[Mapping[str, Callable[[Any, Any], Any]]] = None) -> None:
        if layout not in LAYOUTS:
            raise ArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if layout == "padded":
            if pad_token_id is None:
                raise ArgumentError("a padded Collator needs pad_token_id (the token that pads ids), got None")
            pad_token_id = check_pad_fits(check_pad_token(pad_token_id), check_ids_dtype(ids_dtype))
        if pin_memory and not torch.cuda.is_available():
            raise ArgumentError("pin_memory=True needs CUDA, which this machine lacks; pass pin_memory=False")
        self.pad_token_id, self.layout, self.batch_dim = pad_token_id, layout, bool(batch_dim)
        self.ids_dtype = check_ids_dtype(ids_dtype)
        self.buffers = GrowingBuffers(pin_memory=bool(pin_memory))
        self.read_buffers: dict = {}  # ReplayStore.read(..., out=) buffers of Collator.read
        self.schema = schema
        self.media, self.media_decode = dict(media or {}), dict(media_decode or {})
        if set(self.media_decode) - set(self.media):
            raise ArgumentError(f"media_decode names {sorted(set(self.media_decode) - set(self.media))}, which media= "
                                "does not process; give each decoded column a process function in media=")
        self._readers: Dict[int, Any] = {}  # MediaReader per store read

    @_jit.deferring
    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Collate ``batch`` (what ``ReplayStore.read`` returns) into this collator's buffers."""
        return self._collate(batch, self.buffers, self.schema)

    def _collate(self, batch: Mapping[str, Any], out: Optional[GrowingBuffers], schema: Any) -> dict[str, Any]:
        if self.layout == "packed":
            return collate_packed(batch, batch_dim=self.batch_dim, out=out, ids_dtype=self.ids_dtype, schema=schema)
        return collate(batch, self.pad_token_id, out=out, ids_dtype=self.ids_dtype, schema=schema)

    @_jit.deferring
    def read(self, store: Any, rows: Any, columns: Optional[Any] = None, *, fresh: bool = False) -> dict[str, Any]:
        """``self(store.read(rows, columns))``, the read's value buffers reused too (they belong to
        this collator): a batch of 512 rows copies into warm memory at every step, not into
        ~4 MB of fresh pages. The packed layout skips that copy: it reads with
        ``store.read_ranges`` and copies every value once, straight from the segments' memory maps
        into its stream. Valid as the outputs of a call (see the class docstring); ``fresh=True``
        collates into new tensors instead (a batch to keep: only the read's buffers are reused).

        >>> import tempfile
        >>> from diskreplay import ReplayStore
        >>> store = ReplayStore(tempfile.mkdtemp())
        >>> _ = store.extend({"prompt_id": [1, 1], "completion_ids": [[5, 6], [7]]})
        >>> collator = Collator(pad_token_id=0)
        >>> collator.read(store, [1, 0])["completion_ids"].tolist()
        [[7, 0], [5, 6]]
        >>> kept = collator.read(store, [0], fresh=True)
        >>> _ = collator.read(store, [1]); kept["completion_ids"].tolist()
        [[5, 6]]
        """
        out = None if fresh else self.buffers
        schema = self.schema if self.schema is not None else getattr(store, "schema", None)
        if self.layout == "packed" and hasattr(store, "read_ranges"):
            # each value is copied once, from the segments' maps into the stream
            data = store.read_ranges(rows, columns)
        else:
            data = store.read(rows, columns, out=self.read_buffers)
        batch = self._collate(data, out, schema)
        if self.media:
            batch.update(self._media(store, data))
        return batch

    def _media(self, store: Any, data: Mapping[str, Any]) -> Dict[str, Any]:
        """What the ``media`` processors make of the batch's blobs."""
        reader = self._readers.get(id(store))
        if reader is None or reader.store is not store:
            from ..store.media import MediaReader

            reader = self._readers[id(store)] = MediaReader(store)
        added: Dict[str, Any] = {}
        for name, process in self.media.items():
            if name not in data:
                raise ArgumentError(f"media= names column {name!r}, which this read does not hold (columns: "
                                    f"{sorted(data)})")
            added.update(process(reader.batch(data[name], decode=self.media_decode.get(name))))
        return added

    def unpadded(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """:func:`~diskreplay.batching.padded.collate_unpadded` into this collator's buffers
        (the payload that ``pad_on_device`` / ``pack_on_device`` finish on a device). Given
        ``store.read_ranges(rows)``, every value is copied once from the segments' maps, the rows of
        a group (neighbours in their segment) as one piece: what ``ReplayLoader(pad_on_device=True)``
        does."""
        return collate_unpadded(batch, out=self.buffers)

    @property
    def nbytes(self) -> int:
        """Bytes held in buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def __repr__(self) -> str:
        pad = "" if self.layout == "packed" else f"pad_token_id={self.pad_token_id}, "
        ids = "" if self.ids_dtype == torch.int64 else f"ids_dtype={self.ids_dtype}, "
        return (f"Collator({pad}layout={self.layout!r}, {ids}pin_memory={self.buffers.pin_memory}, "
                f"holding {self.nbytes / 2**20:.1f} MiB)")
