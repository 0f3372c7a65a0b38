"""A durable rollout buffer for TRL's ``AsyncGRPOTrainer``: the queue between its rollout worker and
its trainer, kept in a store, so rollouts survive the trainer's death and a resumed trainer
consumes each one once.

``AsyncGRPOTrainer`` drains ``rollout_worker.rollout_buffer`` (a ``queue.Queue`` or
``multiprocessing.Queue``: ``put_nowait``, ``get(timeout=)``, ``qsize``); what is in it when the
trainer dies is gone. :class:`DurableRolloutQueue` has the same methods over a multi-writer
:class:`~diskreplay.ReplayStore`:

- ``put_nowait(sample)`` commits one ``RolloutSample`` (``put_many``: several in one commit) with
  a token derived from its content, so a put retried after an error or a crash commits it once;
  it returns when the commit is durable. Workers in other processes write to the same store (the
  queue pickles to its path and settings: a spawned worker gets a handle of its own).
- ``get(timeout=)`` hands the committed samples out in commit order, each once, through a
  :class:`~diskreplay.RolloutStream` (its cursor fences an older trainer still running).
- ``state_dict()`` / ``load_state_dict()`` carry the cursor in a checkpoint; :meth:`attach` puts
  it in the trainer's own checkpoints (``trainer_state.json``) and restores it on
  ``train(resume_from_checkpoint=...)``. Samples read ahead, or taken into a micro-batch that the
  checkpoint's steps did not train (the data loader prefetches), wait again in that cursor, so
  the resumed trainer gets them first: none lost, none repeated.

A sample's fields become columns, nothing is pickled: ``input_ids``, ``completion_mask`` (as
``completion_token_mask``: ``completion_mask`` names TRL's padding mask in a store) and
``old_log_probs`` ragged (int32, int32, float32; read back as TRL's int64, int64, float32);
``advantage`` → ``advantages``, ``model_version`` → ``policy_version`` (what staleness bounds
read), ``group_id`` (the store's group key: the prompt), ``enqueued_at`` (NaN for None) per row;
``prompt``, ``completion`` and ``metrics`` as JSON text, and ``metrics["reward"]`` also as
``rewards`` for the samplers. A field that cannot be stored is refused, naming it.

>>> import tempfile
>>> from types import SimpleNamespace
>>> import numpy as np
>>> queue = DurableRolloutQueue(tempfile.mkdtemp())
>>> sample = SimpleNamespace(prompt=[{"role": "user", "content": "2+2?"}], completion=[{"role": "assistant",
...     "content": "4"}], input_ids=np.array([5, 6, 7]), completion_mask=np.array([0, 0, 1]),
...     old_log_probs=np.array([0, 0, -0.5], np.float32), advantage=1.0, model_version=0, group_id=3,
...     metrics={"reward": 1.0}, enqueued_at=None)
>>> queue.put_nowait(sample)
>>> queue.put_nowait(sample)                 # the same rollout once more: a second row
>>> queue.qsize()
2
>>> queue.close()
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import queue as queue_module
import time
import warnings
import weakref
from typing import Any, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ... import ReplayStore
from ...errors import ArgumentError, BatchError, FormatError, IntegrationError, MissingDependencyError
from ...ragged import RaggedColumn
from ...store.consumers import stream_state_name
from ...stream import RolloutStream

__all__ = ["DurableRolloutQueue", "STATE_FORMAT"]

STATE_FORMAT = "diskreplay.trl_async_buffer"
STATE_VERSION = 1
GROUP_KEY = "group_id"

#: RolloutSample's fields and the columns they become (``None``: derived on read)
_RAGGED = {"input_ids": ("input_ids", np.int64), "completion_mask": ("completion_token_mask", np.int64),
           "old_log_probs": ("old_log_probs", np.float32)}
_JSON = {"prompt": "prompt", "completion": "completion", "metrics": "metrics"}
_SCALARS = {"advantage": "advantages", "model_version": "policy_version", "group_id": GROUP_KEY,
            "enqueued_at": "enqueued_at"}
FIELDS = tuple(_RAGGED) + tuple(_JSON) + tuple(_SCALARS)
COLUMNS = [c for c, _ in _RAGGED.values()] + list(_JSON.values()) + list(_SCALARS.values()) + ["rewards"]
_INT32 = np.iinfo(np.int32)
#: identical samples (one prompt, one completion) are told apart by their order among the last this many puts
_RECENT = 4096
#: how stale qsize's view of the store may be (TRL asks for it once per sample it consumes)
_QSIZE_REFRESH_S = 0.5
#: queues attached to a trainer in this process, for a callback TRL rebuilds from its saved args
_ATTACHED: "weakref.WeakValueDictionary[Tuple[str, str], DurableRolloutQueue]" = weakref.WeakValueDictionary()


def _json_text(field: str, value: Any) -> str:
    def refuse(obj: Any) -> Any:
        raise BatchError(f"RolloutSample.{field} holds a {type(obj).__name__}, which is not JSON (str, number, "
                         "bool, None, list, dict with str keys): a durable rollout buffer stores it as JSON text, "
                         "and pickles nothing. Convert it (an image to a path or bytes' base64, a tensor to a "
                         "list) before the put")

    try:
        return json.dumps(value, default=refuse, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:  # keys that are not str, circular references
        raise BatchError(f"RolloutSample.{field} cannot be stored as JSON ({exc}); give it str keys and no "
                         "cycles") from None


def _ragged(field: str, value: Any, n: Optional[int]) -> np.ndarray:
    arr = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)
    floating = field == "old_log_probs"
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.floating) if floating else
                             np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
        raise BatchError(f"RolloutSample.{field} must be a 1-D {'float' if floating else 'integer'} array, got "
                         f"shape {arr.shape} of {arr.dtype}")
    if n is not None and arr.size != n:
        raise BatchError(f"RolloutSample.{field} has {arr.size} values but input_ids has {n}: give one per token")
    if not floating and arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise BatchError(f"RolloutSample.{field} holds values outside int32 ({arr.min()}..{arr.max()}), which "
                         "token columns store; token ids of a vocabulary fit")
    return arr.astype(np.float32 if floating else np.int32, copy=False)


def _number(field: str, value: Any, integer: bool, allow_none: bool = False) -> float:
    if value is None and allow_none:
        return math.nan
    kind = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BatchError(f"RolloutSample.{field} must be {'an int' if integer else 'a number'}"
                         f"{' or None' if allow_none else ''}, got {value!r}")
    return int(value) if integer else float(value)


def sample_columns(samples: Sequence[Any]) -> Dict[str, Any]:
    """The store columns of ``samples`` (``RolloutSample`` objects, or any object with its fields),
    checked; a field that cannot be stored is a :class:`~diskreplay.errors.BatchError` naming it.

    >>> from types import SimpleNamespace
    >>> s = SimpleNamespace(prompt="2+2?", completion="4", input_ids=[1, 2], completion_mask=[0, 1],
    ...                     old_log_probs=np.zeros(2, np.float32), advantage=0.5, model_version=1,
    ...                     group_id=7, metrics={"reward": float("nan")}, enqueued_at=None)
    >>> cols = sample_columns([s])
    >>> cols["group_id"], cols["policy_version"], cols["metrics"], cols["rewards"]
    ([7], [1], ['{"reward":NaN}'], [nan])
    """
    cols: Dict[str, List[Any]] = {c: [] for c in COLUMNS}
    for sample in samples:
        if dataclasses.is_dataclass(sample):
            extra = [f.name for f in dataclasses.fields(sample) if f.name not in FIELDS]
            if extra:
                raise BatchError(f"RolloutSample has fields {extra} a durable rollout buffer does not know (it "
                                 f"stores {list(FIELDS)}): this TRL is newer than diskreplay's mapping; store them "
                                 "in metrics, or update diskreplay")
        missing = [f for f in FIELDS if not hasattr(sample, f)]
        if missing:
            raise BatchError(f"a rollout sample needs the fields of TRL's RolloutSample; "
                             f"{type(sample).__name__} lacks {missing}")
        ids = _ragged("input_ids", sample.input_ids, None)
        cols["input_ids"].append(ids)
        cols["completion_token_mask"].append(_ragged("completion_mask", sample.completion_mask, ids.size))
        cols["old_log_probs"].append(_ragged("old_log_probs", sample.old_log_probs, None))
        for field, column in _JSON.items():
            cols[column].append(_json_text(field, getattr(sample, field)))
        metrics = sample.metrics
        if not isinstance(metrics, Mapping):
            raise BatchError(f"RolloutSample.metrics must be a dict of str to float, got {type(metrics).__name__}")
        cols["advantages"].append(_number("advantage", sample.advantage, False))
        cols["policy_version"].append(_number("model_version", sample.model_version, True))
        cols[GROUP_KEY].append(_number("group_id", sample.group_id, True))
        cols["enqueued_at"].append(_number("enqueued_at", sample.enqueued_at, False, allow_none=True))
        reward = metrics.get("reward")
        cols["rewards"].append(_number("metrics['reward']", reward, False) if reward is not None else math.nan)
    return cols


def _digest(cols: Mapping[str, List[Any]]) -> str:
    """A fingerprint of the samples' content (not ``enqueued_at``, which a retried put renews)."""
    h = hashlib.blake2b(digest_size=16)
    for name in COLUMNS:
        if name == "enqueued_at":
            continue
        h.update(name.encode())
        for v in cols[name]:
            h.update(v.tobytes() if isinstance(v, np.ndarray) else repr(v).encode())
            h.update(b"\x00")
    return h.hexdigest()


def _rollout_sample_class() -> Any:
    try:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
    except ImportError as exc:
        raise MissingDependencyError("DurableRolloutQueue.get builds TRL's RolloutSample; install TRL with "
                                     "pip install 'diskreplay[trl]' (TRL >= 1.16 has AsyncGRPOTrainer)") from exc
    return RolloutSample


class DurableRolloutQueue:
    """The rollout queue of TRL's ``AsyncGRPOTrainer`` (``rollout_worker.rollout_buffer``), durable.

    ``path``: a store directory (created multi-writer, grouped by ``group_id``, when it holds none).
    ``name``: the consumer's stream name (its cursor is the store's saved state ``stream.<name>``).
    ``maxsize`` > 0: ``put_nowait`` raises ``queue.Full`` while that many committed samples are not
    consumed (as of the trainer's committed cursor, which ``get`` commits at most every
    ``cursor_every`` seconds then), and ``put`` waits; TRL's worker retries on ``queue.Full``.
    ``read_ahead``: samples ``get`` reads from the store at once. ``fsync=False``: commits survive
    the death of any process but not of the machine (``ReplayStore``'s ``fsync``).
    ``acknowledge=True``: a sample ``get`` handed out is consumed only once :meth:`acknowledge`
    says so (:meth:`attach` turns it on); otherwise when ``get`` hands it out.

    The first ``get``, ``state_dict``, ``load_state_dict`` or ``save`` in a process makes it the
    consumer (a :class:`~diskreplay.RolloutStream` that continues from the committed cursor);
    ``put_nowait``, ``qsize`` and pickling do not, so a worker holding a copy never takes the
    trainer's place. See the module docstring for the columns.

    >>> import tempfile
    >>> from types import SimpleNamespace
    >>> q = DurableRolloutQueue(tempfile.mkdtemp())
    >>> for g in range(3):
    ...     q.put_nowait(SimpleNamespace(prompt="p", completion="c", input_ids=np.arange(4) + g,
    ...                  completion_mask=np.array([0, 1, 1, 1]), old_log_probs=np.zeros(4, np.float32),
    ...                  advantage=0.0, model_version=0, group_id=g, metrics={}, enqueued_at=None))
    >>> q.get(timeout=1).group_id                 # doctest: +SKIP
    0
    """

    def __init__(self, path: str, *, name: str = "trainer", maxsize: int = 0, read_ahead: int = 64,
                 cursor_every: float = 1.0, fsync: bool = True, poll: float = 0.02, acknowledge: bool = False) -> None:
        for arg, value, low in (("maxsize", maxsize, 0), ("read_ahead", read_ahead, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ArgumentError(f"{arg} must be an integer >= {low}, got {value!r}")
        for arg, value in (("cursor_every", cursor_every), ("poll", poll)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ArgumentError(f"{arg} must be a number of seconds > 0, got {value!r}")
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"name must be a non-empty str (the consumer's stream name), got {name!r}")
        self.path, self.name, self.maxsize = str(path), name, int(maxsize)
        self.read_ahead, self.cursor_every, self.fsync, self.poll = int(read_ahead), float(cursor_every), fsync, poll
        self._reset()
        self._acks = bool(acknowledge)
        self._open()  # create the store now: a worker and the trainer may open it at once later

    def _reset(self) -> None:
        self._store: Optional[ReplayStore] = None
        self._stream: Optional[RolloutStream] = None
        self._ahead: Deque[Tuple[int, Any]] = collections.deque()  # read from the store, not handed out yet
        self._acks = False                     # attached: handed-out samples are consumed when acknowledged
        self._handed: "collections.OrderedDict[int, Any]" = collections.OrderedDict()  # row -> sample, unacked
        self._row_of: Dict[int, int] = {}      # id(sample.input_ids) -> row, for the unacked samples
        self._recent: "collections.OrderedDict[str, int]" = collections.OrderedDict()  # digest -> puts of it
        self._qsize_at, self._qsize_base = -math.inf, 0
        self._saved_at = time.monotonic()

    # ------------------------------------------------------------------ processes

    def __getstate__(self) -> Dict[str, Any]:
        """The path and settings only: a copy in another process opens the store itself."""
        return {"path": self.path, "name": self.name, "maxsize": self.maxsize, "read_ahead": self.read_ahead,
                "cursor_every": self.cursor_every, "fsync": self.fsync, "poll": self.poll}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def _open(self) -> ReplayStore:
        if self._store is None or self._store.closed:
            self._store = ReplayStore(self.path, group_key=GROUP_KEY, multi_writer=True, fsync=self.fsync)
        return self._store

    @property
    def store(self) -> ReplayStore:
        """This process's store object (opened on first use)."""
        return self._open()

    def _consumer(self) -> RolloutStream:
        if self._stream is None:
            self._stream = RolloutStream(self._open(), self.name, group_size=1)
        return self._stream

    def close(self) -> None:
        """Close this process's store (its cursor as of the last ``save`` stays committed)."""
        if self._store is not None:
            self._store.close()
        self._store, self._stream = None, None

    def __enter__(self) -> "DurableRolloutQueue":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the worker's side

    def put_nowait(self, sample: Any) -> None:
        """Commit ``sample`` (a ``RolloutSample``) durably, once; ``queue.Full`` when ``maxsize``
        samples wait. Returns when the commit is durable."""
        self.put_many([sample], block=False)

    def put(self, sample: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        """``put_nowait`` that waits (up to ``timeout`` seconds) while the queue is full."""
        self.put_many([sample], block=block, timeout=timeout)

    def put_many(self, samples: Sequence[Any], *, block: bool = True, timeout: Optional[float] = None,
                 token: Optional[str] = None) -> None:
        """Commit ``samples`` (a group's, say) in one commit, exactly once: the default token is
        their content's fingerprint and how many times this handle committed that content among its
        recent puts, so a retry after an error commits nothing twice, while a second, identical
        rollout is a row of its own. ``token``: the caller's own unique one instead."""
        if not samples:
            return
        cols = sample_columns(samples)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.full():
            if not block or (deadline is not None and time.monotonic() >= deadline):
                raise queue_module.Full
            time.sleep(self.poll)
        digest = None
        if token is None:
            digest = _digest(cols)
            token = f"trl-rollout:{digest}:{self._recent.get(digest, 0)}"
        self._open().extend(cols, token=token)
        if digest is not None:  # counted once committed: a retry after an error takes the same token
            self._recent[digest] = self._recent.pop(digest, 0) + 1
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)

    # ------------------------------------------------------------------ sizes

    def qsize(self) -> int:
        """Samples committed and not yet handed out by ``get`` (in another process than the
        consumer's: not yet consumed as of its committed cursor). Refreshed at most twice a second."""
        store = self._open()
        now = time.monotonic()
        if now - self._qsize_at >= _QSIZE_REFRESH_S:
            store.refresh()
            self._qsize_at = now
            if self._stream is None:
                cursor = store.load_state(stream_state_name(self.name)) or {}
                self._qsize_base = int(cursor.get("position", 0))
        if self._stream is None:
            return max(0, store.next_row - self._qsize_base)
        stats = self._stream.stats()
        return len(self._ahead) + stats["waiting"] + max(0, store.next_row - stats["next_row"])

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return self.maxsize > 0 and self.qsize() >= self.maxsize

    # ------------------------------------------------------------------ the trainer's side

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """The next committed sample (a ``RolloutSample``), each once; ``queue.Empty`` when none
        came within ``timeout`` seconds (``block=False``: at once)."""
        deadline = None if timeout is None or not block else time.monotonic() + timeout
        delay = min(self.poll, 0.002)
        while not self._ahead:
            self._read_ahead()
            if self._ahead:
                break
            if not block or (deadline is not None and time.monotonic() >= deadline):
                raise queue_module.Empty
            time.sleep(delay)
            delay = min(self.poll, delay * 2)
        row, sample = self._ahead.popleft()
        if self._acks:
            self._handed[row] = sample
            self._row_of[id(sample.input_ids)] = row
        if self.maxsize and time.monotonic() - self._saved_at >= self.cursor_every:
            self.save()  # the writers' back-pressure reads the committed cursor
        return sample

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def _read_ahead(self) -> None:
        stream = self._consumer()
        first = stream.next(1, timeout=0)
        if first is None:
            return
        more = min(stream.stats()["waiting"], self.read_ahead - 1)
        rest = stream.next(more, timeout=0) if more else None
        rows = first if rest is None else np.concatenate([first, rest])
        RolloutSample = _rollout_sample_class()
        data = self._open().read(rows, columns=COLUMNS)
        for i, row in enumerate(rows.tolist()):
            fields = {f: _ragged_row(data[c], i, dtype) for f, (c, dtype) in _RAGGED.items()}
            fields.update({f: json.loads(data[c][i]) for f, c in _JSON.items()})
            enqueued = float(data["enqueued_at"][i])
            self._ahead.append((row, RolloutSample(
                **fields, advantage=float(data["advantages"][i]), model_version=int(data["policy_version"][i]),
                group_id=int(data[GROUP_KEY][i]), enqueued_at=None if math.isnan(enqueued) else enqueued)))

    def acknowledge(self, samples: Iterable[Any]) -> None:
        """Mark ``samples`` (handed out by ``get``; or the dicts TRL's ``RolloutQueueDataset``
        made of them) as trained on: they and every sample handed out before them are consumed
        (those TRL dropped as stale or too long included). With ``acknowledge=True`` (or after
        :meth:`attach`) only; otherwise a sample is consumed when ``get`` hands it out."""
        upto = -1
        for s in samples:
            ids = s["input_ids"] if isinstance(s, Mapping) else s.input_ids
            upto = max(upto, self._row_of.get(id(ids), -1))
        self._consumed_upto(upto)

    def _consumed_upto(self, upto: int) -> None:
        while self._handed and next(iter(self._handed)) <= upto:
            _, sample = self._handed.popitem(last=False)
            self._row_of.pop(id(sample.input_ids), None)

    def _unconsumed(self) -> List[int]:
        return list(self._handed) + [row for row, _ in self._ahead]

    # ------------------------------------------------------------------ the cursor

    def state_dict(self) -> Dict[str, Any]:
        """The consumer's cursor for a checkpoint: every sample not consumed yet (read ahead, or
        handed out and not acknowledged) waits again in it."""
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "name": self.name,
                "stream": self._consumer().state_dict(unconsumed=self._unconsumed())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state_dict`: the samples it did not consume come
        next, then those committed since; nothing this handle read ahead or handed out since is
        kept."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT or \
                state.get("version") != STATE_VERSION:
            got = (state.get("format"), state.get("version")) if isinstance(state, Mapping) else type(state).__name__
            raise FormatError(f"Unsupported rollout buffer state {got!r}; expected format={STATE_FORMAT!r} "
                              f"version={STATE_VERSION} (DurableRolloutQueue.state_dict())")
        if state.get("name") != self.name:
            raise ArgumentError(f"the state is the cursor of stream {state.get('name')!r}, this queue's is "
                                f"{self.name!r}: make the queue with name={state.get('name')!r}")
        self._consumer().load_state_dict(state["stream"])
        self._ahead.clear()
        self._handed.clear()
        self._row_of.clear()

    def save(self) -> None:
        """Commit the cursor (:meth:`state_dict`'s) to the store: the writers' ``maxsize`` and a
        consumer started again without a checkpoint continue from it."""
        self._consumer().save(unconsumed=self._unconsumed())
        self._saved_at = time.monotonic()

    def stats(self) -> Dict[str, int]:
        """The stream's counts (:meth:`RolloutStream.stats`) and ``unconsumed``: samples read
        ahead or handed out and not acknowledged."""
        return {**self._consumer().stats(), "unconsumed": len(self._unconsumed())}

    # ------------------------------------------------------------------ TRL

    def attach(self, trainer: Any) -> Any:
        """Make ``trainer`` (an ``AsyncGRPOTrainer``, built with a ``rollout_worker`` whose
        ``rollout_buffer`` is this queue, or with TRL's own worker, not started yet) checkpoint this
        queue's cursor and continue from it on ``train(resume_from_checkpoint=...)``. Returns the
        callback it added (none on processes other than the main one, which hold no queue).

        A sample counts as consumed once the optimizer step that trained it ends: the callback
        sees TRL's micro-batches as its collator packs them (the data loader prefetches one) and
        acknowledges those of each finished step."""
        if not getattr(getattr(trainer, "accelerator", None), "is_main_process", True):
            return None
        worker = getattr(trainer, "rollout_worker", None)
        if worker is not None and getattr(worker, "rollout_buffer", None) is not self:
            worker.rollout_buffer = self  # TRL's own worker hands it to its child when it starts
        trainer.rollout_queue = self
        self._acks = True
        _ATTACHED[(self.path, self.name)] = self
        callback = _callback_class()(self)
        callback.trainer = weakref.proxy(trainer)
        trainer.add_callback(callback)
        return callback

    def __repr__(self) -> str:
        return f"DurableRolloutQueue({self.path!r}, name={self.name!r}, maxsize={self.maxsize})"


def _ragged_row(column: RaggedColumn, i: int, dtype: Any) -> np.ndarray:
    return np.array(column[i], dtype=dtype)  # a copy: the sample outlives the store's mapping


_CALLBACK: List[Any] = []


def _callback_class() -> Any:
    """``DurableRolloutCallback``, made when first needed (it imports transformers)."""
    if _CALLBACK:
        return _CALLBACK[0]
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class DurableRolloutCallback(TrainerCallback, ExportableState):
        """Carries a :class:`DurableRolloutQueue`'s cursor in the trainer's checkpoints (the
        ``stateful_callbacks`` of ``trainer_state.json``, written with it) and acknowledges the
        samples of each finished optimizer step."""

        def __init__(self, queue: Optional[DurableRolloutQueue] = None, *, path: Optional[str] = None,
                     name: Optional[str] = None) -> None:
            if queue is None:  # rebuilt by restore_callback_states_from_checkpoint from state()'s args
                queue = _ATTACHED.get((path, name))
                if queue is None:
                    raise IntegrationError(f"no DurableRolloutQueue({path!r}, name={name!r}) is attached in this "
                                           "process: call queue.attach(trainer) before train()")
            self.queue = queue
            self.trainer: Any = None  # attach() sets it: the policy version rides along in checkpoints
            self._micro_batches: Deque[int] = collections.deque()  # each packed micro-batch's newest row
            self._substeps = 0
            self._began = self._warned = False

        def state(self) -> Dict[str, Any]:
            cursor = None
            if self._began:
                cursor = _jsonable(self.queue.state_dict())
                cursor["model_version"] = int(getattr(self.trainer, "model_version", 0) or 0)
                self.queue.save()  # the store's committed cursor is the checkpoint's
            return {"args": {"path": self.queue.path, "name": self.queue.name}, "attributes": {"cursor": cursor}}

        def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None,
                           **kwargs: Any) -> None:
            saved = (state.stateful_callbacks or {}).get(type(self).__name__) if state.global_step else None
            saved = saved[0] if isinstance(saved, list) and saved else saved
            cursor = saved.get("attributes", {}).get("cursor") if isinstance(saved, dict) else None
            if cursor is not None:
                self.queue.load_state_dict(cursor)
                self._restore_version(int(cursor.get("model_version", 0)))
            elif state.global_step:
                raise IntegrationError(f"the checkpoint resumed at step {state.global_step} holds no cursor of "
                                       f"DurableRolloutQueue({self.queue.path!r}): it was written without "
                                       "queue.attach(trainer). Resume from a checkpoint written with it, or start "
                                       "a new run (a new stream name continues from the first sample)")
            loader = train_dataloader
            while getattr(loader, "base_dataloader", None) is not None:  # accelerate's adapters delegate to it
                loader = loader.base_dataloader
            collate = getattr(loader, "collate_fn", None)
            if collate is None:
                raise IntegrationError("the trainer's train_dataloader has no collate_fn to follow micro-batches "
                                       "by: this TRL's AsyncGRPOTrainer differs from 1.16's")
            self._micro_batches.clear()

            def follow(examples: Any) -> Any:
                batch = collate(examples)
                self._micro_batches.append(self._newest_row(examples))
                return batch

            loader.collate_fn = follow
            self._began = True

        def _restore_version(self, saved: int) -> None:
            """Continue the checkpoint's policy version, as TRL does for its own worker only: TRL's
            staleness rule (``max_staleness``) compares the samples' versions with it. TRL's sync at
            train begin already counted one version (and TRL's own worker restores it first)."""
            trainer = self.trainer
            if trainer is None or not saved or getattr(trainer, "model_version", saved + 1) > saved:
                return
            trainer.model_version += saved
            worker = getattr(trainer, "rollout_worker", None)
            if worker is not None:
                worker.update_model_version(trainer.model_version)

        def _newest_row(self, examples: Any) -> int:
            newest, seen = -1, 0
            for rows in examples:  # one micro-batch: a list of TreeRows (one per rank) of sample dicts
                for row in rows:
                    for sample in getattr(row, "samples", ()):
                        seen += 1
                        newest = max(newest, self.queue._row_of.get(id(sample["input_ids"]), -1))
            if seen and newest < 0 and not self._warned:
                self._warned = True  # then nothing is acknowledged: a resume would train these samples again
                warnings.warn("DurableRolloutQueue cannot find its samples in TRL's micro-batch (this TRL's "
                              "RolloutQueueDataset or batchers copy them): samples of steps a checkpoint "
                              "covers would be handed out again after a resume", RuntimeWarning, stacklevel=2)
            return newest

        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._substeps += 1

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trained = [self._micro_batches.popleft() for _ in range(min(self._substeps + 1,
                                                                          len(self._micro_batches)))]
            self._substeps = 0
            if trained:
                self.queue._consumed_upto(max(trained))

    _CALLBACK.append(DurableRolloutCallback)
    return DurableRolloutCallback


def _jsonable(value: Any) -> Any:
    """``value`` with numpy arrays and scalars as lists and numbers (trainer_state.json is JSON)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
