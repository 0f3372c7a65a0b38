"""Dataset tools: exports, imports, preference pairs, best-of-n sets and store summaries.

Everything streams a store chunk by chunk through its public API, so a store
larger than RAM exports with memory bounded by one chunk (~64 MiB of store
data), and every output appears under its final name only once complete.

- :func:`export` / :func:`export_parquet` / :func:`export_jsonl` /
  :func:`export_hf` / :func:`export_zarr`: live rows to Parquet, JSONL, a
  Hugging Face dataset directory or a Zarr v3 archive.
- :func:`import_rollouts`: build a store from any of those, or from another
  framework's JSONL / Parquet rollout dump with a column mapping.
- :func:`preference_pairs`, :func:`best_of_n`: TRL-ready DPO pairs and SFT sets.
- :func:`store_info`: rows, groups, bytes, tokens, reward statistics.
- :func:`output_format`: the format an output name asks for; :func:`is_store`
  / :func:`require_store`: whether a path holds a store (never creating one).

zarr, datasets, tqdm and transformers/tokenizers are optional and imported
only when used (``pip install 'diskreplay[zarr]'``, ``[hf]``, ``[progress]``,
``[trl]``).

>>> from diskreplay.export import export_parquet, import_rollouts
"""

from ..errors import (EvictionRefusedError, ExportError, MissingDependencyError, OutputExistsError,
                      StoreNotFoundError)
from ._common import RowFilter, TextDecoder, VersionView, is_store, load_tokenizer, require_store
from .outputs import output_format
from .curate import best_of_n, preference_pairs
from .importer import ALIASES, import_rollouts
from .info import format_info, store_info
from .writers import export, export_hf, export_jsonl, export_parquet
from .zarr_archive import export_zarr

__all__ = [
    "ALIASES",
    "EvictionRefusedError",
    "ExportError",
    "MissingDependencyError",
    "OutputExistsError",
    "RowFilter",
    "StoreNotFoundError",
    "TextDecoder",
    "VersionView",
    "best_of_n",
    "export",
    "export_hf",
    "export_jsonl",
    "export_parquet",
    "export_zarr",
    "format_info",
    "import_rollouts",
    "is_store",
    "load_tokenizer",
    "output_format",
    "preference_pairs",
    "require_store",
    "store_info",
]
