"""TransferQueue on a diskreplay store: every ``put`` TransferQueue acknowledges survives a crash.

TransferQueue (verl's data plane) keeps the fields of its samples in a pluggable
storage backend. Importing this module registers one:

- ``DiskReplay``, a storage manager (``backend.storage_backend: DiskReplay``),
  TransferQueue's own ``KVStorageManager`` over
- ``DiskReplayStorageClient``, a ``StorageKVClient`` that keeps every value in
  a multi-writer :class:`~diskreplay.ReplayStore` (:class:`FieldTable`).

Why a key-value client under TransferQueue's ``KVStorageManager`` rather than
a whole ``StorageManager``: the manager calls ``put`` with every value of one
``put_data`` (all its fields and samples) and notifies the controller only
after ``put`` returns, so one durable commit per ``put_data`` happens before
any consumer can learn of the data; that is all a whole manager could offer.
The manager's handshake, notification and TensorDict reassembly (nested and
jagged fields, non-tensor columns) stay TransferQueue's own, tested upstream,
and this backend owns only what it adds: durability and exactly-once writes.

Every process that calls ``transfer_queue.init`` imports this module first
(the registration is per process), then:

>>> conf = {"backend": {"storage_backend": "DiskReplay",
...                     "DiskReplay": {"path": "/data/run1/tq-store"}}}
>>> import transfer_queue as tq                                # doctest: +SKIP
>>> tq.init(OmegaConf.create(conf))                            # doctest: +SKIP

Options under ``backend.DiskReplay``: ``path`` (a directory every process
mounts, or ``s3://...`` with ``storage_options``), ``capacity`` (rows, exact
FIFO; none by default) and ``fsync`` (default true). See docs/transferqueue.md.
Values are kept without pickle (tensors as bytes with dtype and shape, other
values as JSON): a value that JSON cannot hold is refused with an error naming
its key. ``pip install 'diskreplay[transferqueue]'``.
"""

from __future__ import annotations

import json
import os
from typing import Any, List, Mapping, Optional

from ...errors import ArgumentError, FormatError, MissingDependencyError
from .table import FieldTable

try:
    from transfer_queue.storage.bootstrap import StorageBootstrapProvider
    from transfer_queue.storage.clients.base import StorageClientFactory, StorageKVClient
    from transfer_queue.storage.managers.base import KVStorageManager, StorageManagerFactory
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(f"diskreplay.integrations.transferqueue needs TransferQueue ({exc}); install it "
                                 "with pip install 'diskreplay[transferqueue]'") from exc

__all__ = ["BACKEND", "CLIENT", "DiskReplayStorageClient", "DiskReplayStorageManager", "FieldTable", "register"]

#: the name to put in TransferQueue's ``backend.storage_backend``
BACKEND = "DiskReplay"
#: the ``StorageKVClient`` name (``client_name``) the manager uses
CLIENT = "DiskReplayStorageClient"
#: the file a storage checkpoint is (in TransferQueue's checkpoint directory)
CHECKPOINT_FILE = "diskreplay_storage.json"
CHECKPOINT_FORMAT = "diskreplay.transferqueue.checkpoint"


def register() -> None:
    """Register the backend in this process: importing this module did it, so this does nothing more.

    Its name is what Ray's ``runtime_env={"worker_process_setup_hook":
    "diskreplay.integrations.transferqueue.register"}`` wants, so that every Ray worker that calls
    ``transfer_queue.init()`` (verl's agent-loop workers) finds the backend.

    >>> register()
    """


def _options(config: Any) -> Mapping[str, Any]:
    """The table's options from TransferQueue's backend config (a dict or an OmegaConf node)."""
    if config is None or not hasattr(config, "get"):
        raise ArgumentError(f"the {BACKEND} backend needs a config with 'path' (backend.{BACKEND}.path in "
                            f"TransferQueue's config), got {config!r}")
    path = config.get("path", None)
    if not path:
        raise ArgumentError(f"backend.{BACKEND}.path must name the store's directory (or s3:// URL), shared by every "
                            f"process that calls transfer_queue.init; got {path!r}")
    options = {"capacity": config.get("capacity", None), "fsync": bool(config.get("fsync", True))}
    storage_options = config.get("storage_options", None)
    if storage_options is not None:
        options["storage_options"] = dict(storage_options)
    return {"path": str(path), **options}


@StorageClientFactory.register(CLIENT)
class DiskReplayStorageClient(StorageKVClient):
    """TransferQueue's ``StorageKVClient`` over a :class:`FieldTable` (one per process, opened here).

    >>> import tempfile, torch
    >>> client = DiskReplayStorageClient({"path": tempfile.mkdtemp()})
    >>> client.put(["7@responses", "7@uid"], [torch.tensor([1, 2]), "a"])
    >>> client.get(["7@responses", "7@uid"], shapes=[torch.Size([2]), None], dtypes=[torch.int64, str])
    [tensor([1, 2]), 'a']
    >>> client.clear(["7@responses", "7@uid"]); client.close()
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        options = dict(_options(config))
        #: the values, in a multi-writer store every process opens
        self.table = FieldTable(options.pop("path"), **options)

    def put(self, keys: List[str], values: List[Any]) -> None:
        """Store the values in one durable commit; returns after it (no backend metadata)."""
        self.table.put(keys, values)
        return None

    def get(self, keys: List[str], shapes: Any = None, dtypes: Any = None,
            custom_backend_meta: Optional[List[Any]] = None) -> List[Any]:
        """The values of ``keys`` as stored (CPU tensors, numpy values, JSON values), checked against
        the controller's ``shapes``/``dtypes``."""
        return self.table.get(keys, shapes=shapes, dtypes=dtypes)

    def clear(self, keys: List[str], custom_backend_meta: Optional[List[Any]] = None) -> None:
        """Remove the values of ``keys`` durably; their global indexes may then be reused."""
        self.table.clear(keys)

    def close(self) -> None:
        """Close the store."""
        self.table.close()


@StorageManagerFactory.register(BACKEND)
class DiskReplayStorageManager(KVStorageManager):
    """``backend.storage_backend: DiskReplay``: TransferQueue's ``KVStorageManager`` with this client."""

    def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None) -> None:
        options = dict(config) if config is not None else {}
        if options.get("client_name") not in (None, CLIENT):
            raise ArgumentError(f"backend.{BACKEND}.client_name must be {CLIENT!r} or left out, got "
                                f"{options.get('client_name')!r}")
        super().__init__(controller_info, {**options, "client_name": CLIENT}, zmq_context=zmq_context)

    async def save_checkpoint(self, checkpoint_dir: str) -> None:
        """TransferQueue's storage checkpoint: the store's path and row number (a few bytes, fsync'd).

        The values are in the store already; :meth:`load_checkpoint` brings them back to this point.
        """
        state = {"format": CHECKPOINT_FORMAT, "version": 1, "path": self.storage_client.table.path,
                 "mark": self.storage_client.table.mark()}
        os.makedirs(checkpoint_dir, exist_ok=True)
        target = os.path.join(checkpoint_dir, CHECKPOINT_FILE)
        with open(target + ".tmp", "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(target + ".tmp", target)

    async def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Make the store's values what they were at :meth:`save_checkpoint` (one commit of what changed)."""
        target = os.path.join(checkpoint_dir, CHECKPOINT_FILE)
        try:
            with open(target) as f:
                state = json.load(f)
        except FileNotFoundError as exc:
            raise FormatError(f"{target} is missing: {checkpoint_dir} was not saved by the {BACKEND} backend; "
                              f"load it with the backend that saved it") from exc
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT or state.get("version") != 1:
            raise FormatError(f"Unsupported storage checkpoint {target}; expected format {CHECKPOINT_FORMAT!r} "
                              "version 1")
        table = self.storage_client.table
        if os.path.abspath(str(state.get("path"))) != os.path.abspath(table.path):
            raise ArgumentError(f"the checkpoint {target} is of the store {state.get('path')!r}, but this "
                                f"TransferQueue uses {table.path!r}; set backend.{BACKEND}.path to the checkpoint's")
        table.restore(state["mark"])

    def close(self) -> None:
        """Close TransferQueue's sockets and the store."""
        try:
            super().close()
        finally:
            client = getattr(self, "storage_client", None)
            if client is not None:
                client.close()


@StorageBootstrapProvider.register_provider(BACKEND)
def _bootstrap(conf: Any) -> Mapping[str, Any]:
    """At ``transfer_queue.init``: create (or check) the store once, so a bad path fails there."""
    options = dict(_options(conf.backend[BACKEND]))
    FieldTable(options.pop("path"), **options).close()
    return {"path": _options(conf.backend[BACKEND])["path"]}
