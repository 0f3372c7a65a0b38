"""Sampled rows to tensors: TRL's padded layout, the packed (padding-free) layout, and a
:class:`Collator` that keeps its output buffers.

* :mod:`.columns`: what both layouts share (reading a batch's columns, output buffers);
* :mod:`.padded`: :func:`collate`, :func:`collate_unpadded`, :func:`pad_on_device`,
  :func:`repad`, :func:`repad_stacked`;
* :mod:`.packed`: :func:`collate_packed`, :func:`pack_on_device`, :func:`packed_sizes`;
* :mod:`.collator`: :class:`Collator`.

>>> import numpy as np
>>> from diskreplay.ragged import RaggedColumn
>>> from diskreplay.batching import collate
>>> collate({"completion_ids": RaggedColumn.from_arrays([[5, 6], [7]], dtype=np.int32)}, 0)["completion_ids"].tolist()
[[5, 6], [7, 0]]
"""

from .collator import LAYOUTS, Collator
from .packed import PACKED_NAMES, collate_packed, pack_on_device, packed_sizes
from .padded import collate, collate_unpadded, pad_on_device, padded_widths, repad, repad_stacked

__all__ = ["Collator", "LAYOUTS", "PACKED_NAMES", "collate", "collate_packed", "collate_unpadded", "pack_on_device",
           "packed_sizes", "pad_on_device", "padded_widths", "repad", "repad_stacked"]
