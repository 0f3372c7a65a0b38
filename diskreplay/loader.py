"""``ReplayLoader``: sampled batches, built on a background thread, handed to the device.

The data path of one batch, stage by stage (``k`` is the batch the consumer
will ask for next):

1. **sample** (worker thread): ``sampler.sample(store, batch_size)`` gives
   row ids. Every sampler call happens on the worker, one at a time and in
   batch order, so the stream is the one a plain loop over ``sample`` would
   give. A read-only store is ``refresh()``-ed first, so a reader follows a
   live writer; ranks (a sampler's ``world_size > 1``, ``torch.distributed``
   initialised) follow it together: at each batch the consumer takes, rank
   0's newest generation is broadcast, and every rank's worker draws from a
   pinned snapshot of it from batch ``taken + prefetch + 3`` on (past any
   batch a worker has drawn ahead), so the ranks' draws stay disjoint.
   ``sampler.position()`` (the small stream position; no
   per-row data) is taken right after each draw and travels with the batch:
   the loader's own ``state_dict()`` is ``sampler.state_dict(position=...)``
   of the last batch the consumer *received*, not of the ones built ahead,
   with the live priorities.
2. **hint** (worker): the rows of batch k+1 are sampled *before* batch k is
   read, and ``store.prefetch`` asks the kernel (``madvise(WILLNEED)``) for
   their pages. On a cold page cache the reads of k+1 then proceed in
   parallel, in the background, instead of serialising on page faults when
   k+1 is read. On a warm cache a hint buys nothing and costs about as much
   as the read, so the worker hints only the first batches and those after
   a read that waited for the disk (major page faults of the worker thread).
3. **read** (worker): ``store.read(rows, columns)`` gathers just those rows'
   bytes from the memory-mapped segments into packed values + offsets.
4. **collate** (worker) into one of ``prefetch + 1`` reused sets of host
   buffers (pinned when the target is a CUDA device): ``collate`` pads there
   on the host (``collate_packed`` with ``layout="packed"``); with
   ``pad_on_device=True``, ``collate_unpadded`` only packs values + offsets
   (int32 ids stay int32): for 512 synthetic GRPO rows 4.3 MB instead of the
   56 MB of padded int64 ids, masks and log-probs. With ``max_tokens`` the
   draw is first cut to the whole groups that fit.
5. **move** (consumer thread, in ``__next__``): the tensors go to ``device``
   with ``non_blocking=True`` on a side CUDA stream; the consumer's current
   stream waits on it with an event, and the same event guards the host
   buffer: the worker does not refill it before that copy has finished. With
   ``pad_on_device=True`` the padding is done on the device by
   :func:`~diskreplay.batching.padded.pad_on_device` (packing by
   :func:`~diskreplay.batching.packed.pack_on_device`), on the side stream, with the
   widths (token counts) taken from the host offsets: no host sync.

Batch validity. On a CUDA (or other non-CPU) device, and with
``pad_on_device=True`` anywhere, every batch is a set of fresh tensors the
loader never touches again. On the host path (``device`` None or ``"cpu"``,
``pad_on_device=False``) the batch's tensors are views of a host buffer set
that is reused: **a batch stays valid until the consumer asks for**
``prefetch`` **more batches** (batch k is overwritten at the earliest while
the consumer waits for batch k + prefetch); ``.clone()`` what must live
longer. In the steady state the worker is then one built batch ahead (and
two sampled and hinted ahead); on the other paths up to ``prefetch + 1``
built ones.

Measured numbers are printed by ``tools/bench.py sample`` (warm and cold,
against an ideal numpy gather and TorchRL's padded memmap storage).

Threads. The sampler and the host buffers belong to the worker while the
loader runs: update priorities through :meth:`ReplayLoader.update_priorities`,
not on the sampler. Every ``ReplayStore`` method takes the store's re-entrant
``lock`` (:func:`store_lock`), so the training loop may keep appending to the
same store object while a loader draws from it.

One module: the loader's pipeline (the worker thread, the ring of host buffers, the hand-off
to the device); what it shares with ``ReplayBuffer`` is in :mod:`diskreplay.following`.
"""

from __future__ import annotations

import collections
import queue
import resource
import threading
import warnings
import weakref
from typing import Any, Dict, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from .batching.collator import LAYOUTS
from .errors import ArgumentError, LoaderError, RowsEvictedError
from .batching.packed import collate_packed, pack_on_device as _pack_on_device, packed_sizes
from .batching.columns import GrowingBuffers, check_ids_dtype, check_pad_fits
from .batching.padded import collate, collate_unpadded, pad_on_device as _pad_on_device, padded_widths
from .following import StoreFollowing, resolve_device, restore_state, state_key, store_lock
from .ragged import RaggedColumn, is_int as _is_int

__all__ = ["LoaderError", "ReplayLoader", "store_lock"]

# How often a blocked worker looks at the stop flag, in seconds: the bound on
# how long close() waits for a worker that is parked on a full queue.
_POLL_S = 0.05
# How long close() waits for a worker busy inside one read or sample.
_JOIN_S = 10.0
# A batch whose rows were evicted between sampling and reading (a reader
# following a writer with a capacity) is drawn again this many times.
_EVICTED_RETRIES = 3
# After a read that had to wait for the disk (major page faults), the worker
# hints this many following batches' pages before reading them. A hint costs
# about as much as the read itself when the pages are already cached (one
# madvise per row and column), so with a warm cache the worker stops hinting, and the first read that
# faults again turns hinting back on. Cold reads whose hints arrived in time
# fault no more, so a cold stream pays one unhinted batch per this many.
_HINT_AFTER_FAULT = 32
# A read counts as cold above this many major faults: a warm batch of 512 rows
# (~1,000 pages) still meets one or two now and then (pages the kernel dropped,
# lazily mapped code), and those must not turn hinting back on.
_COLD_FAULTS = 16

_END = object()
# getrusage of the calling thread only (Linux); elsewhere the process, which still
# tells a faulting read from a cached one
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)



class _Failure:
    __slots__ = ("exc", "batch")

    def __init__(self, exc: BaseException, batch: int) -> None:
        self.exc, self.batch = exc, batch


# --------------------------------------------------------------------------- host buffers


class _Ring:
    """``size`` reusable sets of host buffers and the rule for reusing them.

    A set is taken by the worker (``acquire``), filled, handed to the consumer
    and given back (``release``) when the batch in it may be overwritten,
    optionally with a CUDA event that must complete first (the copy out of it).
    """

    def __init__(self, size: int, pin: bool) -> None:
        self.pin = pin
        self.sets: list = [GrowingBuffers(pin_memory=pin) for _ in range(size)]
        self.events: list = [None] * size
        self.free: "queue.Queue[int]" = queue.Queue()
        for i in range(size):
            self.free.put(i)

    def acquire(self, stop: threading.Event) -> Optional[int]:
        while True:
            try:
                slot = self.free.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if stop.is_set():
                    return None
        ev, self.events[slot] = self.events[slot], None
        if ev is not None:
            ev.synchronize()
        return slot

    def release(self, slot: int, event: Any = None) -> None:
        self.events[slot] = event
        self.free.put(slot)


# --------------------------------------------------------------------------- the worker


class _Worker:
    """Everything the background thread touches; it holds no reference to the loader,
    so a loader that is dropped without ``close()`` is collected and stops its thread."""

    def __init__(self, sampler: Any, batch_size: int, sample_kwargs: Dict[str, Any],
                 columns: Optional[Sequence[str]], build: "_Build", remaining: Optional[int], ring: _Ring,
                 ready: "queue.Queue", lock: threading.Lock, following: StoreFollowing, first: int,
                 generation: Optional[int]) -> None:
        self.sampler, self.batch_size = sampler, batch_size
        # ranks following a writer together: the generation of each draw, and the moves the consumer
        # agreed on, as (first batch index it applies to, generation), oldest first
        self.following, self.first, self.generation = following, first, generation
        self.switches: "collections.deque" = collections.deque()
        self.sample_kwargs, self.columns, self.build = sample_kwargs, columns, build
        self.remaining = remaining
        self.ring, self.ready, self.lock = ring, ready, lock
        self.stop = threading.Event()
        # hint the first batches: a job that just (re)started usually meets a cold cache
        self.hints_left = 2
        # the read's value buffers, reused batch after batch: each batch is collated (copied) into
        # the ring before the next read, so one set is enough
        self.read_buffers: Dict[str, np.ndarray] = {}
        self.thread = threading.Thread(target=self.run, name="ReplayLoader-worker", daemon=True)

    def shutdown(self, timeout: Optional[float] = _JOIN_S) -> bool:
        """Stop the thread; True when it has ended."""
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def _sample(self, index: int) -> tuple:
        """(rows, sampler position, the store they were drawn from) of batch ``index``."""
        while self.switches and self.switches[0][0] <= index:
            at, self.generation = self.switches.popleft()
            if at < index:  # cannot happen: the consumer schedules a move past every batch drawn
                raise LoaderError(f"the ranks agreed on generation {self.generation} from batch {at} on, but "
                                  f"this worker drew batch {index} already")
        view = self.following.view(self.generation)
        with store_lock(view), self.lock:
            rows = self.sampler.sample(view, self.batch_size, **self.sample_kwargs)
            state = _position(self.sampler)
        return np.array(rows, dtype=np.int64), state, view  # a copy: it becomes the batch's "rows"

    def _lookahead(self, index: int) -> tuple:
        """(rows, state, store) of batch ``index``, its pages hinted while reads are cold, or (None, error, None)."""
        try:
            rows, state, view = self._sample(index)
        except Exception as exc:  # surfaces after the batch before it was delivered
            return None, exc, None
        if self.hints_left > 0:
            self.hints_left -= 1
            try:
                with store_lock(view):
                    view.prefetch(rows, self.columns)
            except (RowsEvictedError, OSError):
                pass  # only a hint: the read of these rows deals with an eviction
        return rows, state, view

    def _read(self, rows: np.ndarray, view: Any) -> Dict[str, Any]:
        faults = _major_faults()
        with store_lock(view):
            if self.build.reads_ranges and hasattr(view, "read_ranges"):
                # every value is copied once, from the maps into the stream (or the device payload)
                batch = view.read_ranges(rows, self.columns)
            else:
                batch = view.read(rows, self.columns, out=self.read_buffers)
        if _major_faults() - faults > _COLD_FAULTS:
            self.hints_left = _HINT_AFTER_FAULT
        return batch

    def run(self) -> None:
        k = 0
        try:
            if self.remaining == 0:
                self._put(_END)
                return
            index = self.first
            nxt = self._lookahead(index)
            while not self.stop.is_set():
                rows, state, view = nxt
                if rows is None:
                    raise state
                last = self.remaining is not None and k + 1 >= self.remaining
                # hint the next batch's pages before reading this one
                nxt = (None, None, None) if last else self._lookahead(index + 1)
                for attempt in range(_EVICTED_RETRIES + 1):
                    try:
                        batch = self._read(rows, view)
                        break
                    except RowsEvictedError:
                        # a writer evicted rows after they were drawn: draw this batch and the
                        # next again, in order, so each batch keeps the state of its own draw
                        if attempt == _EVICTED_RETRIES:
                            raise
                        rows, state, view = self._sample(index)
                        if not last:
                            nxt = self._lookahead(index + 1)
                self.following.keep_only(nxt[2], self.following.snapshots.get(self.generation))
                index += 1
                if self.build.max_tokens is not None:
                    n = self.build.fitting_rows(view, rows, batch)
                    rows, batch = rows[:n], _head(batch, n)
                slot = self.ring.acquire(self.stop)
                if slot is None:
                    return
                host = self.build.host(batch, self.ring.sets[slot], getattr(view, "schema", None))
                if not self._put((slot, host, rows, state)):
                    return
                k += 1
                if last:
                    self._put(_END)
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            self._put(_Failure(exc, k))


def _position(sampler: Any) -> Any:
    """The sampler's stream position (our samplers), or its whole state (a sampler without ``position()``)."""
    position = getattr(sampler, "position", None)
    return position() if position is not None else _copy_state(sampler.state_dict())


def _major_faults() -> int:
    """Major page faults (reads that waited for the disk) of the calling thread so far."""
    return resource.getrusage(_RUSAGE_THREAD).ru_majflt


def _head(batch: Mapping[str, Any], n: int) -> Dict[str, Any]:
    """The first ``n`` rows of a batch read from the store (views, no copy)."""
    out: Dict[str, Any] = {}
    for name, col in batch.items():
        if isinstance(col, RaggedColumn):
            out[name] = RaggedColumn(col.values, col.offsets[:n + 1],
                                     None if col.validity is None else col.validity[:n])
        elif col is None:
            out[name] = None
        else:
            out[name] = col[:n]
    return out


class _Build:
    """How the worker turns a read batch into host tensors: the layout, and the token budget."""

    def __init__(self, layout: str, pad_token_id: Optional[int], on_device: bool, max_tokens: Optional[int],
                 group_key: Optional[str], ids_dtype: torch.dtype = torch.int64) -> None:
        self.layout, self.pad_token_id, self.on_device = layout, pad_token_id, on_device
        self.ids_dtype = ids_dtype
        self.max_tokens, self.group_key = max_tokens, group_key
        #: the batch is read as row ranges (no copy) and packed (or, for the device, joined) straight
        #: from them
        self.reads_ranges = (layout == "packed" or on_device) and max_tokens is None

    def host(self, batch: Mapping[str, Any], bufs: GrowingBuffers, schema: Any = None) -> Dict[str, Any]:
        # schema: the read's, which lays out its per-token tensor columns (routed experts)
        if self.on_device:
            return collate_unpadded(batch, out=bufs, schema=schema)
        if self.layout == "packed":
            return collate_packed(batch, out=bufs, ids_dtype=self.ids_dtype, schema=schema)
        return collate(batch, self.pad_token_id, out=bufs, ids_dtype=self.ids_dtype, schema=schema)

    def fitting_rows(self, store: Any, rows: np.ndarray, batch: Mapping[str, Any]) -> int:
        """How many leading rows (whole groups) of the draw fit in ``max_tokens``.

        Packed, a batch costs its real tokens; padded, its rows times its
        longest prompt plus its longest completion (what the padded tensors
        hold). Groups are the runs of equal group keys in the draw (samplers
        lay a batch out group by group); without a group key, single rows.
        """
        n = len(rows)
        lengths = {}
        for name in ("prompt_ids", "completion_ids"):
            col = batch.get(name)
            lengths[name] = (np.diff(col.offsets) if isinstance(col, RaggedColumn)
                             else np.zeros(n, dtype=np.int64))
        plen, clen = lengths["prompt_ids"], lengths["completion_ids"]
        if self.layout == "packed":
            cost = np.cumsum(plen + clen)
        else:
            cost = (np.maximum.accumulate(plen) + np.maximum.accumulate(clen)) * np.arange(1, n + 1)
        ends = np.arange(1, n + 1)
        if self.group_key is not None and n:
            keys = batch.get(self.group_key)
            if keys is None:
                with store_lock(store):
                    keys = store.read(rows, [self.group_key])[self.group_key]
            keys = np.asarray(keys)
            ends = np.append(np.flatnonzero(keys[1:] != keys[:-1]) + 1, n)
        fits = ends[cost[ends - 1] <= self.max_tokens]
        if n and not fits.size:
            raise LoaderError(
                f"the first group of a draw (rows {rows[:ends[0]].tolist()}) needs {int(cost[ends[0] - 1])} "
                f"tokens in the {self.layout} layout, more than max_tokens={self.max_tokens}; "
                "raise max_tokens to at least the largest group's tokens")
        return int(fits[-1]) if fits.size else 0


def _copy_state(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _copy_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_state(v) for v in state]
    if isinstance(state, np.ndarray):
        return state.copy()
    return state


def _moved(host: Mapping[str, Any], device: torch.device, non_blocking: bool) -> Dict[str, Any]:
    """``host``'s tensors on ``device``; names that share one tensor (``cu_seqlens`` and its
    flash-attention aliases) share one copy."""
    copies: Dict[int, torch.Tensor] = {}
    out: Dict[str, Any] = {}
    for name, value in host.items():
        if isinstance(value, torch.Tensor):
            if id(value) not in copies:
                copies[id(value)] = value.to(device, non_blocking=non_blocking)
            value = copies[id(value)]
        out[name] = value
    return out


# --------------------------------------------------------------------------- the loader


class ReplayLoader:
    """An iterator of collated batches (dicts of tensors in TRL's layout) sampled from a store.

    Each batch holds ``batch_size`` rows drawn by ``sampler`` and read from
    ``store`` (only ``columns``, default all), padded like :func:`collate`
    (``prompt_ids`` / ``prompt_mask`` left-padded with ``pad_token_id``,
    ``completion_ids`` / ``completion_mask`` and per-token columns
    right-padded, per-row columns ``[B]``), plus ``"rows"``: the int64 row ids
    on the CPU (for ``update_priorities``). Batches are built on a background
    thread, up to ``prefetch`` ahead (see the module docstring for the data
    path), into reused host buffers (``pin_memory``; default: pinned iff
    ``device`` is CUDA), then moved to ``device`` (None: stay on the host; a
    CUDA device on a machine without CUDA warns and stays on the host too)
    with ``non_blocking=True``. ``pad_on_device=True`` ships only the unpadded
    values and offsets and pads on ``device``; the result is identical.

    **Validity**: on the host path (``device`` None or CPU, host padding) a
    batch stays valid until the consumer asks for ``prefetch`` more batches;
    copy what you keep longer. Device batches and ``pad_on_device`` batches
    are never reused.

    ``layout="packed"`` builds :func:`~diskreplay.batching.packed.collate_packed`
    batches instead (one padding-free token stream with ``position_ids`` and
    ``cu_seqlens``; ``pad_token_id`` may then be None); with
    ``pad_on_device=True`` only the unpadded payload crosses to ``device``
    and :func:`~diskreplay.batching.packed.pack_on_device` builds the stream there.
    ``ids_dtype=torch.int32`` makes the token ids int32 instead of TRL's int64
    (see :class:`~diskreplay.batching.collator.Collator`), in either layout.

    ``max_tokens`` caps a batch by tokens rather than rows (verl's dynamic
    batch size): of each draw of ``batch_size`` rows, the batch keeps the
    leading whole groups (runs of equal ``group_key``, default the store's;
    single rows without one) that fit, and drops the rest of the draw. A
    packed batch costs its real tokens, a padded one its rows times (longest
    prompt + longest completion). A first group larger than the budget raises
    :class:`~diskreplay.errors.LoaderError`. Choose ``batch_size`` near what
    fits, so that little of each draw is dropped.

    ``num_batches`` bounds the iteration (None: endless). ``min_policy_version``,
    ``exclude`` (row-id ranges never drawn) and ``min_row`` are passed to every
    ``sampler.sample`` (see :meth:`diskreplay.samplers.Sampler.eligible`). A read-only store is refreshed
    before every draw (it follows a live writer); ranks move to rank 0's newest commit together (a
    broadcast per batch taken: every rank must take the same number of batches). ``state_dict()`` is the
    sampler's state after the last batch the consumer received;
    ``state_name`` names where :meth:`save_state` keeps it in the store: the
    constructor restores it when the store has it, and :meth:`close` (the end
    of a ``with`` block) saves it; a sampler of one rank of several keeps its
    own, ``NAME.rankR``. An exception in the
    worker is re-raised (the same exception object, carrying the worker's
    traceback and a note) by the ``__next__`` that would have returned the
    batch it spoiled, and by every call after. Close with :meth:`close` or a
    ``with`` block; a loader that is dropped, or left open at interpreter
    exit, stops its thread too. ``close()`` rewinds the sampler to
    ``state_dict()``, so a new loader on it continues the consumer's stream.

    >>> import tempfile, numpy as np
    >>> from diskreplay import ReplayStore, PromptGroupSampler
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [0, 0, 1, 1], "prompt_ids": [[5], [5], [6, 7], [6, 7]],
    ...                   "completion_ids": [[1, 2], [3], [4], [5, 6, 7]],
    ...                   "rewards": np.array([1, 0, 0, 1], dtype=np.float32)})
    >>> with ReplayLoader(store, PromptGroupSampler(num_groups=1, seed=0), batch_size=2,
    ...                   pad_token_id=0, num_batches=3) as loader:
    ...     shapes = [tuple(b["completion_ids"].shape) for b in loader]
    >>> len(shapes), all(s[0] == 2 for s in shapes)
    (3, True)
    """

    def __init__(self, store: Any, sampler: Any, batch_size: int, pad_token_id: int,
                 device: Union[None, str, torch.device] = None, prefetch: int = 2,
                 pin_memory: Optional[bool] = None, pad_on_device: bool = False,
                 columns: Optional[Sequence[str]] = None, min_policy_version: Optional[float] = None,
                 state_name: Optional[str] = None, num_batches: Optional[int] = None, *,
                 layout: str = "padded", max_tokens: Optional[int] = None,
                 group_key: Optional[str] = None, exclude: Any = None, min_row: Optional[int] = None,
                 ids_dtype: torch.dtype = torch.int64) -> None:
        for name, value, low in (("batch_size", batch_size, 1), ("prefetch", prefetch, 1)):
            if not _is_int(value) or value < low:
                raise ArgumentError(f"{name} must be an integer >= {low}, got {value!r}")
        if num_batches is not None and (not _is_int(num_batches) or num_batches < 0):
            raise ArgumentError(f"num_batches must be None (endless) or an integer >= 0, got {num_batches!r}")
        if layout not in LAYOUTS:
            raise ArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not _is_int(pad_token_id) and not (layout == "packed" and pad_token_id is None):
            raise ArgumentError(f"pad_token_id must be an integer token id, got {pad_token_id!r}")
        ids_dtype = check_ids_dtype(ids_dtype)
        if pad_token_id is not None:
            check_pad_fits(int(pad_token_id), ids_dtype)
        if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
            raise ArgumentError(f"max_tokens must be None (no budget) or an integer >= 1, got {max_tokens!r}")
        if not hasattr(sampler, "sample") or not hasattr(sampler, "state_dict"):
            raise ArgumentError(f"sampler must have sample(store, batch_size) and state_dict(), got "
                                f"{type(sampler).__name__}; pass e.g. PromptGroupSampler(num_groups=8)")
        dev = resolve_device(device, "the loader yields")
        if pin_memory is None:
            pin_memory = dev is not None and dev.type == "cuda"
        if pin_memory and not torch.cuda.is_available():
            # as torch's DataLoader does: the same script runs on a CPU machine
            warnings.warn("pin_memory=True: this machine has no CUDA, so host buffers are not pinned",
                          RuntimeWarning, stacklevel=2)
            pin_memory = False
        if columns is not None:
            columns = [columns] if isinstance(columns, str) else list(columns)
        self.store, self.sampler = store, sampler
        self.batch_size = int(batch_size)
        self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        self.layout, self.max_tokens, self.ids_dtype = layout, max_tokens, ids_dtype
        self.group_key = group_key if group_key is not None else getattr(store, "group_key", None)
        self.device, self.prefetch, self.pin_memory = dev, int(prefetch), bool(pin_memory)
        self.pad_on_device, self.columns = bool(pad_on_device), columns
        self.min_policy_version, self.state_name = min_policy_version, state_name
        self.exclude, self.min_row = exclude, min_row
        self.num_batches = num_batches
        self._host = dev is None or dev.type == "cpu"
        # host-path batches alias the ring; all others are fresh tensors
        self._alias = self._host and not self.pad_on_device
        self._cuda = dev is not None and dev.type == "cuda"
        self._copy_stream = torch.cuda.Stream(dev) if self._cuda else None
        self._lock = threading.Lock()
        self._received = 0
        self._failure: Optional[_Failure] = None
        self._failure_tb: Any = None
        self._done = False
        self._closed = False
        self._worker: Optional[_Worker] = None
        self._finalizer: Optional[weakref.finalize] = None
        restore_state(store, state_name, sampler, "ReplayLoader")
        self._state = _position(sampler)
        self._following = StoreFollowing(store, sampler, "ReplayLoader")
        self._generation = self._following.agree()  # ranks following a writer: where they all start
        self._start()

    # ----------------------------------------------------------------- lifecycle

    def _start(self) -> None:
        size = self.prefetch + 1
        kwargs = {k: v for k, v in (("min_policy_version", self.min_policy_version), ("exclude", self.exclude),
                                    ("min_row", self.min_row)) if v is not None}
        remaining = None if self.num_batches is None else max(0, self.num_batches - self._received)
        self._held: collections.deque = collections.deque()
        self._start_received = self._received
        # one batch fewer than the ring: a worker with every buffer set filled waits in a put
        self._ready: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
        self._ring = _Ring(size, self.pin_memory)
        build = _Build(self.layout, self.pad_token_id, self.pad_on_device, self.max_tokens, self.group_key,
                       self.ids_dtype)
        self._worker = _Worker(self.sampler, self.batch_size, kwargs, self.columns, build,
                               remaining, self._ring, self._ready, self._lock, self._following, self._received,
                               self._generation)
        self._finalizer = weakref.finalize(self, self._worker.shutdown, 1.0)
        self._worker.thread.start()

    def _stop(self, timeout: Optional[float]) -> bool:
        """Stop the worker and drop what it built; True when the thread has ended."""
        worker, self._worker = self._worker, None
        if worker is None:
            return True
        self._finalizer.detach()
        ended = worker.shutdown(timeout)
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        return ended

    def close(self, save: bool = True) -> None:
        """Stop the worker thread (promptly, even while it waits on a full queue) and, with a
        ``state_name``, ``save=True`` and a store open for writing, :meth:`save_state`. Idempotent.

        The sampler is rewound to :meth:`state_dict` (the state after the last
        batch received), so batches built ahead are not lost from its stream,
        and a loader made with the same ``state_name`` after a restart
        continues it. Batches already received stay valid. A ``with`` block
        that ends in an exception keeps the state saved before it (the
        batch in hand may not have been trained on).
        """
        if self._closed:
            return
        self._closed = True
        if self._stop(_JOIN_S):
            self.sampler.load_state_dict(self.state_dict())
            self._following.keep_only()
        if save and self.state_name is not None and not self.store.readonly and not self.store.closed:
            self.save_state()

    def __enter__(self) -> "ReplayLoader":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(save=exc_type is None)

    def __iter__(self) -> "ReplayLoader":
        return self

    def __repr__(self) -> str:
        return (f"ReplayLoader(batch_size={self.batch_size}, layout={self.layout!r}, device={self.device}, "
                f"prefetch={self.prefetch}, pad_on_device={self.pad_on_device}, received={self._received}"
                f"{', closed' if self._closed else ''})")

    # ----------------------------------------------------------------- batches

    def __next__(self) -> Dict[str, Any]:
        if self._failure is not None:
            self._raise()
        if self._closed or self._done:
            raise StopIteration
        if self._alias and len(self._held) >= self.prefetch:
            # the consumer asks for batch k + prefetch: batch k may now be overwritten
            self._ring.release(self._held.popleft())
        item = self._get()
        if item is _END:
            self._done = True
            self._stop(_JOIN_S)
            raise StopIteration
        if isinstance(item, _Failure):
            self._failure, self._failure_tb = item, item.exc.__traceback__
            item.exc.add_note(f"(raised in the ReplayLoader worker thread while building batch "
                              f"{self._start_received + item.batch} of this loader)")
            self._stop(_JOIN_S)
            self._raise()
        slot, host, rows, state = item
        batch = self._deliver(slot, host)
        batch["rows"] = torch.from_numpy(rows)
        self._state = state
        self._received += 1
        self._follow()
        return batch

    def _follow(self) -> None:
        """Ranks following a writer: agree (every rank, at each batch it takes) on the newest commit,
        which every rank's worker draws from past every batch any of them may have drawn already
        (``prefetch`` queued, one being built and one drawn ahead)."""
        generation = self._following.agree()
        if generation is not None and generation != self._generation:
            self._generation = generation
            if self._worker is not None:
                self._worker.switches.append((self._received + self.prefetch + 3, generation))

    def _raise(self) -> None:
        # the worker's traceback, not one that grows with every re-raise
        raise self._failure.exc.with_traceback(self._failure_tb)

    def _get(self) -> Any:
        while True:
            try:
                return self._ready.get(timeout=0.5)
            except queue.Empty:
                if self._closed:  # closed from another thread
                    raise StopIteration from None
                worker = self._worker
                if worker is None or not worker.thread.is_alive():
                    try:
                        return self._ready.get_nowait()
                    except queue.Empty:
                        raise LoaderError("the ReplayLoader worker thread ended without a batch or an error; "
                                          "create a new loader") from None

    def _finisher(self, host: Dict[str, Any]):
        """What turns the moved unpadded payload into the batch, with its sizes taken from
        the host offsets now (so that padding or packing on a device needs no host sync)."""
        if not self.pad_on_device:
            return lambda moved: moved
        if self.layout == "packed":
            sizes = packed_sizes(host)
            return lambda moved: _pack_on_device(moved, sizes=sizes, ids_dtype=self.ids_dtype)
        widths = padded_widths(host)
        return lambda moved: _pad_on_device(moved, self.pad_token_id, widths=widths, ids_dtype=self.ids_dtype)

    def _deliver(self, slot: int, host: Dict[str, Any]) -> Dict[str, Any]:
        if self._alias:
            self._held.append(slot)
            return dict(host)
        finish = self._finisher(host)
        if self._host:
            out = finish(host)
            # per-row tensors pass through the finisher: copy them out of the ring
            ragged = {n[:-len(".offsets")] for n in host if n.endswith(".offsets")}
            for name, value in out.items():
                if name not in ragged and isinstance(value, torch.Tensor) and name in host:
                    out[name] = value.clone()
            self._ring.release(slot)
            return out
        if not self._cuda:
            out = _moved(host, self.device, non_blocking=False)
            self._ring.release(slot)
            return finish(out)
        stream = self._copy_stream
        current = torch.cuda.current_stream(self.device)
        # no wait on the consumer's stream: the copies only read the host buffer and write fresh
        # memory, so they overlap the consumer's queued work
        with torch.cuda.stream(stream):
            out = finish(_moved(host, self.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(stream)
        current.wait_event(done)
        for value in out.values():
            if isinstance(value, torch.Tensor):
                # allocated on the side stream, used on the consumer's: keep the allocator from
                # handing the memory out again before the consumer's work on it is done
                value.record_stream(current)
        self._ring.release(slot, done)
        return out

    # ----------------------------------------------------------------- state

    def state_dict(self) -> Dict[str, Any]:
        """The sampler's state after the last batch the consumer received.

        Loading it into a sampler (or a loader) continues exactly the stream
        this consumer would have seen next. Priorities (``PrioritizedSampler``)
        are taken from the live sampler, so updates made since are kept.
        """
        if getattr(self.sampler, "position", None) is None:
            return _copy_state(self._state)
        with self._lock:
            return self.sampler.state_dict(position=self._state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a sampler state; the next batch is the one that follows it.

        Batches built ahead are dropped (the worker restarts); batches already
        received stay valid.
        """
        state = dict(state)
        if self._closed:
            self.sampler.load_state_dict(state)
            self._state = _position(self.sampler)
            return
        self._stop(None)
        self.sampler.load_state_dict(state)
        self._state = _position(self.sampler)
        self._failure, self._done = None, False
        self._start()

    def save_state(self) -> None:
        """Persist :meth:`state_dict` in the store under ``state_name`` (a durable commit)."""
        if self.state_name is None:
            raise ArgumentError("save_state() needs a state_name; pass state_name='...' to ReplayLoader")
        state = self.state_dict()
        with store_lock(self.store):
            self.store.save_state(state_key(self.state_name, self.sampler), state)

    def update_priorities(self, rows: Any, values: Any) -> None:
        """Forward to ``sampler.update_priorities`` without racing the worker's draws.

        Batches already drawn ahead (up to ``prefetch + 1``) keep the
        priorities of their draw.
        """
        update = getattr(self.sampler, "update_priorities", None)
        if update is None:
            raise ArgumentError(f"{type(self.sampler).__name__} has no update_priorities; "
                                "use a PrioritizedSampler")
        if isinstance(rows, torch.Tensor):
            rows = rows.detach().cpu().numpy()
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().numpy()
        with self._lock:
            update(rows, values)


