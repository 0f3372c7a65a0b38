"""GRPO training with TRL that records every rollout on disk and replays from it.

:class:`DiskReplayGRPOTrainer` is TRL's ``GRPOTrainer`` plus a
:class:`~diskreplay.ReplayStore`. Every generation batch is written to the
store (prompt key, policy version, rewards, advantages, the per-token
old/ref/sampling log-probs), and then, per ``replay_mode``, rows from the
store are mixed into the batch the loss sees:

``off``
    store only: a persistent, replayable record of the run.
``repo``
    RePO: for each prompt of the batch, ``replay_k`` past generations of that
    same prompt, chosen by a :class:`~diskreplay.samplers.PromptGroupSampler`
    strategy (``recency``, ``reward``, ``variance``, ``random``), once the
    prompt has ``replay_min_generations`` stored rows.
``ssr``
    SSR: ``ssr_replay_fraction`` of the batch drawn row by row with
    ``p ∝ (|advantage| + ssr_eps) ** ssr_alpha``
    (:class:`~diskreplay.samplers.PrioritizedSampler`), from the newest
    ``ssr_capacity_scalar`` generation batches when that is set. The replayed
    rows replace the fresh rows of smallest ``|advantage|`` (those carry the
    least gradient).
``swap_zero_std``
    every prompt group whose rewards all agree (zero advantage, no gradient)
    is replaced by a stored group with a non-zero reward spread.

By default replayed rows *replace* fresh rows, so the batch keeps its size and
TRL's split over gradient accumulation steps and ``num_iterations`` is
unchanged; ``replay_append=True`` appends them instead (``repo``, ``ssr``;
rounded down to a multiple of ``steps_per_generation``), as in the RePO paper.
``max_policy_lag`` never replays rows generated more than that many optimizer
steps ago.

The seam
--------
Only ``GRPOTrainer._generate_and_score_completions(inputs)`` is overridden: it
returns the padded dict the loss consumes (``prompt_ids``/``prompt_mask``
left-padded, ``completion_ids``/``completion_mask`` and per-token columns
right-padded, ``advantages`` [B], ``num_items_in_batch``, and
``old_per_token_logps`` / ``ref_per_token_logps`` /
``sampling_per_token_logps`` / ``importance_sampling_ratio`` / ``tool_mask``
when TRL computed them). The override calls the parent and post-processes its
output; no TRL method body is copied. It returns the parent's keys, dtypes and
devices; widths grow to the longest replayed row (rounded up to
``pad_to_multiple_of``); ``num_items_in_batch`` is recounted. Two more TRL
methods are used, never reimplemented: ``_calculate_rewards`` is wrapped to keep
its return value (the per-function rewards, which the parent logs but does not
return; the row reward stored is their ``reward_weights``-weighted sum, NaN as
0), and ``_get_per_token_logps_and_entropies`` computes behaviour log-probs
(below). The constructor checks that all three exist.

Behaviour log-probs
-------------------
A replayed row keeps the ``old_per_token_logps`` it was stored with, so TRL's
importance ratio and clipping are computed against the policy that generated
it. When TRL skips them (``num_iterations == 1``, generation aligned with the
optimizer step, no vLLM correction: then the loss uses
``per_token_logps.detach()``), the trainer computes them for the fresh rows with
one extra no-grad forward pass, stores them, and - in a step that replays - puts
them in the batch for every row, which gives the fresh rows the same ratio of 1
the loss would have used. ``replay_compute_old_logps=False`` skips that pass in
``off`` mode (the store then cannot be replayed later). Advantages of replayed
rows are the stored ones; ``recompute_advantages=True`` recomputes them from the
row's stored reward against a baseline from its prompt's other rewards: the
replayed group itself (``swap_zero_std``), else the prompt's fresh rows in this
batch (always there in ``repo``), else the prompt's eligible stored rows,
scaled as ``scale_rewards`` says (``batch``: by the std of the batch's rewards).

Restart
-------
At every checkpoint the sampler state is saved in the store
(``store.save_state("trl.replay", ...)``) and copied, with a small JSON naming
the store, into the checkpoint folder. ``train(resume_from_checkpoint=...)``
reopens the store and restores that state, so the replay stream continues.
Rows committed after the checkpoint (a crash between two saves) stay in the
store and stay replayable (their ``policy_version`` may exceed the resumed
step); a warning says how many.

With several processes each process writes its own store,
``<replay_store_path>/rank-<i>``, and replays from it; with ``replay_append``
every process appends as many rows as the one that drew the fewest (TRL
gathers per-row tensors across processes). Tested with TRL 1.16.0 and
transformers 5.24.0, in one process and in two (torchrun, gloo, CPU; text
models; multimodal batches can be stored in ``off`` mode only).

>>> args = DiskReplayGRPOConfig(output_dir="/tmp/x", replay_mode="repo", replay_k=2,
...                             num_generations=4, per_device_train_batch_size=8, use_cpu=True, report_to=[])
>>> args.replay_mode, args.replay_k
('repo', 2)
>>> DiskReplayGRPOConfig(output_dir="/tmp/x", replay_mode="repo", replay_k=9, num_generations=4,
...                      per_device_train_batch_size=8, use_cpu=True, report_to=[])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
diskreplay.integrations.trl.ReplayConfigError: replay_k=9 exceeds num_generations=4: ...
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional

import numpy as np
import torch

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("diskreplay.integrations.trl needs TRL; install it with pip install 'diskreplay[trl]'") from exc
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .._fileio import durable_write
from ..padding import collate
from ..errors import DiskReplayError, FormatError
from ..format import FORMAT_FILE
from ..ragged import RaggedColumn, is_int as _is_int
from ..samplers import STRATEGIES, PrioritizedSampler, PromptGroupSampler, live_column
from ..segment import decode_state, encode_state
from ..store import ReplayStore

__all__ = ["DiskReplayGRPOConfig", "DiskReplayGRPOTrainer", "REPLAY_MODES", "ReplayConfigError", "prompt_key"]

REPLAY_MODES = ("off", "repo", "ssr", "swap_zero_std")
GROUP_KEY = "prompt_id"
VERSION_KEY = "policy_version"
STATE_NAME = "trl.replay"
STATE_FORMAT = "diskreplay.trl_replay"
CHECKPOINT_FILE = "diskreplay_replay.json"
CHECKPOINT_STATE_FILE = "diskreplay_replay_state.arrow"
CHECKPOINT_FORMAT = "diskreplay.trl_checkpoint"
FORMAT_VERSION = 1
HISTORY_LENGTH = 4096

_PROMPT_SIDE = ("prompt_ids", "prompt_mask")
_COMPLETION_SIDE = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
                    "sampling_per_token_logps", "tool_mask")
_OPTIONAL = ("ref_per_token_logps", "sampling_per_token_logps", "tool_mask", "importance_sampling_ratio")
_KNOWN_KEYS = frozenset(_PROMPT_SIDE + _COMPLETION_SIDE + ("advantages", "num_items_in_batch",
                                                           "importance_sampling_ratio"))
_SEAMS = ("_generate_and_score_completions", "_calculate_rewards", "_get_per_token_logps_and_entropies")


class ReplayConfigError(DiskReplayError, ValueError):
    """A replay option, or the store, cannot serve the configured replay mode.

    >>> issubclass(ReplayConfigError, ValueError)
    True
    """


# --------------------------------------------------------------------------- configuration


def _help(text: str) -> Dict[str, Any]:
    return {"help": text}


@dataclass
class DiskReplayGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the replay options of :class:`DiskReplayGRPOTrainer`.

    The replay options are checked when the config is built and again when the
    trainer is; a bad one raises :class:`ReplayConfigError` (a ``ValueError``).

    >>> DiskReplayGRPOConfig(output_dir="/tmp/x", replay_mode="ssr", ssr_replay_fraction=0.5,
    ...                      use_cpu=True, report_to=[]).ssr_replay_fraction
    0.5
    """

    replay_store_path: Optional[str] = field(default=None, metadata=_help(
        "Directory of the ReplayStore every generated row is written to (created if missing, reopened if not)."))
    replay_mode: str = field(default="off", metadata=_help(
        "off (store only), repo (past generations of the same prompts), ssr (rows by |advantage| priority) "
        "or swap_zero_std (replace zero-reward-spread groups by stored groups with spread)."))
    replay_k: int = field(default=2, metadata=_help(
        "repo: past generations replayed per prompt (at most num_generations)."))
    replay_strategy: Optional[str] = field(default=None, metadata=_help(
        "Which rows of a stored group to replay: random, recency, reward or variance. Default: recency for "
        "repo, variance for swap_zero_std."))
    replay_min_generations: Optional[int] = field(default=None, metadata=_help(
        "Stored rows a prompt group needs before it is replayed. Default: replay_k (repo), num_generations "
        "(swap_zero_std)."))
    replay_append: bool = field(default=False, metadata=_help(
        "Append replayed rows instead of replacing fresh ones (repo, ssr); the batch then grows."))
    ssr_alpha: float = field(default=1.0, metadata=_help("ssr: priority exponent, p ∝ (|A| + eps)^alpha."))
    ssr_eps: float = field(default=1e-4, metadata=_help("ssr: added to |A| so every row keeps a chance (> 0)."))
    ssr_capacity_scalar: Optional[int] = field(default=None, metadata=_help(
        "ssr: draw only from the newest ssr_capacity_scalar x (per-process generation batch) rows. None: all."))
    ssr_replay_fraction: float = field(default=0.25, metadata=_help(
        "ssr: share of the batch filled with replayed rows, in (0, 1]."))
    max_policy_lag: Optional[int] = field(default=None, metadata=_help(
        "Never replay rows generated more than this many optimizer steps ago. None: no bound."))
    replay_capacity: Optional[int] = field(default=None, metadata=_help(
        "Row capacity (FIFO) of a newly created store. None: unbounded."))
    recompute_advantages: bool = field(default=False, metadata=_help(
        "Recompute replayed rows' advantages from their stored rewards instead of using the stored ones."))
    replay_compute_old_logps: bool = field(default=True, metadata=_help(
        "In off mode, compute behaviour log-probs when TRL skips them (one no-grad forward per generation), "
        "so that the store can be replayed later."))
    replay_seed: Optional[int] = field(default=None, metadata=_help(
        "Seed of the replay samplers. None: the run's seed."))

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_config(self)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)) \
        and math.isfinite(x)


def _check_config(args: Any) -> None:
    """Raise :class:`ReplayConfigError` for replay options that cannot work together."""
    mode = args.replay_mode
    if mode not in REPLAY_MODES:
        raise ReplayConfigError(f"replay_mode must be one of {REPLAY_MODES}, got {mode!r}")
    g = args.num_generations
    if not _is_int(args.replay_k) or args.replay_k < 1:
        raise ReplayConfigError(f"replay_k must be a positive integer, got {args.replay_k!r}")
    if args.replay_k > g:
        raise ReplayConfigError(f"replay_k={args.replay_k} exceeds num_generations={g}: RePO replays at most one "
                                f"group's worth of past generations per prompt; lower replay_k to at most {g}")
    if args.replay_strategy is not None and args.replay_strategy not in STRATEGIES:
        raise ReplayConfigError(f"replay_strategy must be one of {STRATEGIES} or None, got {args.replay_strategy!r}")
    for name in ("replay_min_generations", "ssr_capacity_scalar", "replay_capacity"):
        v = getattr(args, name)
        if v is not None and (not _is_int(v) or v < 1):
            raise ReplayConfigError(f"{name} must be a positive integer or None, got {v!r}")
    if args.max_policy_lag is not None and (not _is_int(args.max_policy_lag) or args.max_policy_lag < 0):
        raise ReplayConfigError(f"max_policy_lag must be an integer >= 0 or None, got {args.max_policy_lag!r}")
    f = args.ssr_replay_fraction
    if not _is_number(f) or not 0 < f <= 1:
        raise ReplayConfigError(f"ssr_replay_fraction must be in (0, 1], got {f!r}")
    if not _is_number(args.ssr_alpha) or args.ssr_alpha < 0:
        raise ReplayConfigError(f"ssr_alpha must be a finite number >= 0, got {args.ssr_alpha!r}")
    if not _is_number(args.ssr_eps) or args.ssr_eps <= 0:
        raise ReplayConfigError(f"ssr_eps must be a finite number > 0 (it keeps every row drawable), got "
                                f"{args.ssr_eps!r}")
    if args.replay_seed is not None and (not _is_int(args.replay_seed) or args.replay_seed < 0):
        raise ReplayConfigError(f"replay_seed must be a non-negative integer or None, got {args.replay_seed!r}")
    if args.replay_append and mode == "swap_zero_std":
        raise ReplayConfigError("replay_append=True does not apply to replay_mode='swap_zero_std', which swaps "
                                "groups in place; drop replay_append or pick repo/ssr")
    aggregation = getattr(args, "multi_objective_aggregation", "sum_then_normalize")
    if args.recompute_advantages and aggregation != "sum_then_normalize":
        raise ReplayConfigError(f"recompute_advantages=True needs multi_objective_aggregation='sum_then_normalize' "
                                f"(got {aggregation!r}); use the stored advantages instead")
    if mode in ("repo", "swap_zero_std"):
        local = args.generation_batch_size // max(int(args.world_size), 1)
        if local % g:
            raise ReplayConfigError(f"replay_mode={mode!r} needs whole prompt groups in each process's generation "
                                    f"batch, but it holds {local} rows for num_generations={g}; make "
                                    "per_device_train_batch_size * steps_per_generation a multiple of "
                                    "num_generations")


# --------------------------------------------------------------------------- helpers


def prompt_key(token_ids: Any) -> int:
    """The store key of a prompt: a stable int64 hash (BLAKE2b) of its token ids, padding removed.

    The same prompt gets the same key in every run and process, whatever its
    padding, so past generations of a prompt are found across restarts.

    >>> prompt_key([5, 6, 7]) == prompt_key(np.array([5, 6, 7], dtype=np.int32))
    True
    >>> prompt_key([5, 6, 7]) == prompt_key([5, 6])
    False
    """
    a = np.ascontiguousarray(np.asarray(token_ids).astype("<i8", copy=False).reshape(-1))
    return int.from_bytes(hashlib.blake2b(a.tobytes(), digest_size=8).digest(), "little", signed=True)


def _prompt_keys(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> np.ndarray:
    ids = prompt_ids.detach().cpu().numpy()
    mask = prompt_mask.detach().cpu().numpy().astype(bool)
    return np.array([prompt_key(ids[i][mask[i]]) for i in range(len(ids))], dtype=np.int64)


def _pad(t: torch.Tensor, width: int, left: bool, value: Any) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    fill = t.new_full((t.shape[0], extra) + tuple(t.shape[2:]), value)
    return torch.cat([fill, t] if left else [t, fill], dim=1)


def _round_up(n: int, multiple: Optional[int]) -> int:
    if not multiple or multiple <= 1:
        return n
    return -(-n // multiple) * multiple


def _group_std(x: np.ndarray) -> float:
    """TRL's ``nanstd`` (Bessel-corrected, NaN for fewer than two values)."""
    x = x[np.isfinite(x)]
    return float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")


@dataclass
class _Plan:
    """Rows to replay in one generation batch."""

    rows: np.ndarray  # store row ids, in batch order
    positions: Optional[np.ndarray]  # the fresh rows they replace; None: appended
    group_size: int = 0  # swap_zero_std: rows per replayed group


class _CheckpointCallback(TrainerCallback):
    """Writes the replay state next to every checkpoint TRL saves."""

    def __init__(self, trainer: "DiskReplayGRPOTrainer") -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.trainer.save_replay_checkpoint(folder)
        return control


# --------------------------------------------------------------------------- trainer


class DiskReplayGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that writes every rollout to a :class:`~diskreplay.ReplayStore` and replays from it.

    Takes ``GRPOTrainer``'s arguments; ``args`` must be a
    :class:`DiskReplayGRPOConfig`. ``replay_store`` optionally passes an open,
    writable store instead of ``args.replay_store_path`` (the caller then owns
    it: the trainer never closes it). A store whose schema lacks what the mode
    needs, a read-only store or path, or bad replay options raise
    :class:`ReplayConfigError` here, before any training.

    After each generation, ``replay_history[-1]`` describes it: ``global_step``,
    ``fresh_rows`` (row ids written), ``replayed_rows``, ``positions`` (their
    rows in the returned batch, before TRL shuffles it), ``batch_size``,
    ``replay_fraction``, ``policy_lag_mean``, ``reward_mean``. The same numbers
    are logged as ``replay/*`` metrics. The store stays open (it holds the
    writer lock) until ``train()`` returns or :meth:`close_replay_store` is called; it is
    reopened on demand.

    Example (a full, runnable version is ``tools/train_grpo_replay.py``)::

        args = DiskReplayGRPOConfig(output_dir="out", replay_store_path="out/replay",
                                    replay_mode="repo", replay_k=2, num_generations=4)
        trainer = DiskReplayGRPOTrainer(model=model, reward_funcs=reward, args=args,
                                        train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
    """

    def __init__(self, *args: Any, replay_store: Optional[ReplayStore] = None, **kwargs: Any) -> None:
        missing = [m for m in _SEAMS if not callable(getattr(GRPOTrainer, m, None))]
        if missing:
            raise RuntimeError(f"TRL {trl.__version__} has no GRPOTrainer.{missing[0]}, which diskreplay's "
                               "replay hooks into; install a TRL version within the range of diskreplay[trl]")
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DiskReplayGRPOConfig):
            raise ReplayConfigError(f"args must be a DiskReplayGRPOConfig, got {type(self.args).__name__}; build "
                                    "it with the same options plus replay_store_path / replay_mode")
        _check_config(self.args)
        self.replay_mode: str = self.args.replay_mode
        self.replay_history: Deque[Dict[str, Any]] = deque(maxlen=HISTORY_LENGTH)
        self._owns_store = replay_store is None
        self._store: Optional[ReplayStore] = None
        self._store_path = self._resolve_path() if replay_store is None else replay_store.path
        if replay_store is not None:
            if replay_store.readonly:
                raise ReplayConfigError(f"the store at {replay_store.path} is open read-only; the trainer writes "
                                        "every rollout to it: open it without readonly=True")
            self._store = replay_store
        else:
            self._store = self._open_store(create=True)
        try:
            self._check_store(self._store)
        except BaseException:
            if self._owns_store:  # a trainer that failed to build must not keep the writer lock
                self._store.close()
                self._store = None
            raise
        seed = self.args.replay_seed if self.args.replay_seed is not None else int(self.args.seed)
        self._sampler = self._make_sampler(seed)
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 1])))
        self._versions = live_column(VERSION_KEY)
        self._rewards = live_column("rewards")
        self._pending_rewards: Optional[torch.Tensor] = None
        self._warned_keys = False
        self.add_callback(_CheckpointCallback(self))

    # ------------------------------------------------------------------ store

    def _resolve_path(self) -> str:
        path = self.args.replay_store_path
        if not path:
            raise ReplayConfigError("replay_store_path is not set: pass the directory the rollouts are written to "
                                    "(or a writable ReplayStore as replay_store=)")
        path = os.path.abspath(os.fspath(path))
        if self.accelerator.num_processes > 1:
            path = os.path.join(path, f"rank-{self.accelerator.process_index:05d}")
        return path

    def _open_store(self, create: bool) -> ReplayStore:
        path = self._store_path
        probe = path
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ReplayConfigError(f"replay_store_path={path!r} is not writable ({probe} denies writes); the "
                                    "trainer writes every rollout there: pass a writable directory")
        exists = os.path.exists(os.path.join(path, FORMAT_FILE))
        capacity = self.args.replay_capacity
        try:
            if exists or not create:
                store = ReplayStore(path)
            else:
                store = ReplayStore(path, capacity=capacity, group_key=GROUP_KEY)
        except PermissionError as exc:
            raise ReplayConfigError(f"replay_store_path={path!r} cannot be opened for writing ({exc}); pass a "
                                    "writable directory") from None
        if exists and capacity is not None and store.capacity != capacity:
            store.close()
            raise ReplayConfigError(f"replay_capacity={capacity} disagrees with the store at {path}, created with "
                                    f"capacity={store.capacity}; leave replay_capacity=None to reuse it")
        return store

    @property
    def replay_store(self) -> ReplayStore:
        """The store this trainer writes to (reopened if :meth:`close_replay_store` released it)."""
        if self._store is None:
            self._store = self._open_store(create=False)
        return self._store

    def close_replay_store(self) -> None:
        """Save the replay state into the store and release it (if the trainer opened it)."""
        if self._store is None:
            return
        self._store.save_state(STATE_NAME, self.replay_state_dict())
        if self._owns_store:
            self._store.close()
            self._store = None

    def _needed_columns(self) -> List[str]:
        mode = self.replay_mode
        if mode == "off":
            return []
        need = ["prompt_ids", "completion_ids", "advantages", "old_per_token_logps", VERSION_KEY, GROUP_KEY]
        strategy = self._strategy()
        if mode == "swap_zero_std" or self.args.recompute_advantages or strategy in ("reward", "variance"):
            need.append("rewards")
        if self.args.beta != 0.0:
            need.append("ref_per_token_logps")
        return need

    def _check_store(self, store: ReplayStore) -> None:
        mode = self.replay_mode
        if mode in ("repo", "swap_zero_std") and store.group_key != GROUP_KEY:
            raise ReplayConfigError(f"replay_mode={mode!r} draws prompt groups, but the store at {store.path} is "
                                    f"indexed by {store.group_key!r}, not {GROUP_KEY!r}; use a store this trainer "
                                    "created")
        if store.schema is None:
            return
        cols = store.columns
        missing = [c for c in self._needed_columns() if c not in cols]
        if missing:
            raise ReplayConfigError(f"replay_mode={mode!r} needs the column(s) {missing} for replayed rows, but the "
                                    f"store at {store.path} lacks them (columns: {cols}); replay from a store "
                                    "written by this trainer, or start a new replay_store_path")
        certain = (["old_per_token_logps"] if mode != "off" or self.args.replay_compute_old_logps else []) + (
            ["ref_per_token_logps"] if self.args.beta != 0.0 else [])
        absent = [c for c in certain if c not in cols]
        if absent and len(store):
            raise ReplayConfigError(f"this run writes {absent}, which the store at {store.path} has no column for "
                                    "(its columns are fixed by its first rows); start a new replay_store_path or "
                                    "set replay_compute_old_logps / beta as the run that created it")
        writes = {GROUP_KEY, VERSION_KEY, "rewards", "rewards_per_func", "advantages", "importance_sampling_ratio"}
        foreign = [c for c in cols if store.schema[c].kind != "ragged" and c not in writes]
        if foreign:
            raise ReplayConfigError(f"the store at {store.path} holds per-row column(s) {foreign} that this trainer "
                                    "does not write, so it cannot append to it; start a new replay_store_path")
        if "rewards_per_func" in cols and store.schema["rewards_per_func"].width != len(self.reward_funcs):
            raise ReplayConfigError(f"the store at {store.path} holds {store.schema['rewards_per_func'].width} "
                                    f"reward(s) per row, this trainer has {len(self.reward_funcs)} reward "
                                    "function(s); start a new replay_store_path")

    # ------------------------------------------------------------------ samplers and state

    def _strategy(self) -> str:
        if self.args.replay_strategy is not None:
            return self.args.replay_strategy
        return "variance" if self.replay_mode == "swap_zero_std" else "recency"

    def _make_sampler(self, seed: int) -> Any:
        mode = self.replay_mode
        if mode == "repo":
            return PromptGroupSampler(samples_per_group=self.args.replay_k, strategy=self._strategy(),
                                      reward_key="rewards", seed=seed)
        if mode == "swap_zero_std":
            return PromptGroupSampler(samples_per_group=self.args.num_generations, strategy=self._strategy(),
                                      reward_key="rewards", seed=seed)
        if mode == "ssr":
            return PrioritizedSampler(priority_key="advantages", alpha=self.args.ssr_alpha, eps=self.args.ssr_eps,
                                      seed=seed)
        return None

    def replay_state_dict(self) -> Dict[str, Any]:
        """Everything that decides the future replay stream (JSON values and arrays)."""
        st = self._rng.bit_generator.state
        return {"format": STATE_FORMAT, "version": FORMAT_VERSION, "replay_mode": self.replay_mode,
                "sampler": None if self._sampler is None else self._sampler.state_dict(),
                "rng": {"state": dict(st["state"]), "has_uint32": int(st["has_uint32"]),
                        "uinteger": int(st["uinteger"])}}

    def load_replay_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`replay_state_dict` (a sampler of another mode is left as it is, with a warning)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT \
                or state.get("version") != FORMAT_VERSION:
            got = (state.get("format"), state.get("version")) if isinstance(state, dict) else type(state).__name__
            raise FormatError(f"Unsupported replay state {got!r}; expected format={STATE_FORMAT!r} "
                              f"version={FORMAT_VERSION}")
        if state.get("replay_mode") != self.replay_mode:
            warnings.warn(f"the saved replay state is for replay_mode={state.get('replay_mode')!r}, this trainer "
                          f"runs {self.replay_mode!r}; its sampler starts afresh", RuntimeWarning, stacklevel=2)
            return
        if self._sampler is not None and state.get("sampler") is not None:
            self._sampler.load_state_dict(state["sampler"])
        rng = state["rng"]
        bitgen = np.random.PCG64()
        bitgen.state = {"bit_generator": "PCG64",
                        "state": {"state": int(rng["state"]["state"]), "inc": int(rng["state"]["inc"])},
                        "has_uint32": int(rng["has_uint32"]), "uinteger": int(rng["uinteger"])}
        self._rng = np.random.Generator(bitgen)

    def save_replay_checkpoint(self, folder: str) -> None:
        """Save the replay state into the store and describe the store in ``folder``.

        Writes ``diskreplay_replay.json`` (store path, generation, row range,
        step) and a copy of the sampler state beside TRL's checkpoint files.
        """
        store = self.replay_store
        state = self.replay_state_dict()
        store.save_state(STATE_NAME, state)
        os.makedirs(folder, exist_ok=True)
        suffix = "" if self.accelerator.num_processes == 1 else f".rank-{self.accelerator.process_index:05d}"
        state_file = CHECKPOINT_STATE_FILE + suffix
        durable_write(os.path.join(folder, state_file), encode_state(state))
        doc = {"format": CHECKPOINT_FORMAT, "version": FORMAT_VERSION, "store_path": store.path,
               "store_generation": store.generation, "head": store.head, "next_row": store.next_row,
               "global_step": int(self.state.global_step), "replay_mode": self.replay_mode,
               "state_name": STATE_NAME, "state_file": state_file, "trl_version": trl.__version__}
        durable_write(os.path.join(folder, CHECKPOINT_FILE + suffix), json.dumps(doc, indent=1).encode())

    def load_replay_checkpoint(self, folder: str) -> None:
        """Restore the replay state saved by :meth:`save_replay_checkpoint` in ``folder``."""
        suffix = "" if self.accelerator.num_processes == 1 else f".rank-{self.accelerator.process_index:05d}"
        path = os.path.join(folder, CHECKPOINT_FILE + suffix)
        if not os.path.exists(path):
            warnings.warn(f"{folder} holds no {CHECKPOINT_FILE}: the replay sampler starts afresh (the store's "
                          "rows are all kept)", RuntimeWarning, stacklevel=2)
            return
        with open(path, "rb") as fh:
            try:
                doc = json.loads(fh.read())
            except ValueError as exc:
                raise FormatError(f"{path} is not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT \
                or doc.get("version") != FORMAT_VERSION:
            raise FormatError(f"Unsupported replay checkpoint {path}; expected format={CHECKPOINT_FORMAT!r} "
                              f"version={FORMAT_VERSION}")
        store = self.replay_store
        if os.path.abspath(str(doc.get("store_path"))) != store.path:
            warnings.warn(f"{path} was saved with the store at {doc.get('store_path')}, this trainer writes to "
                          f"{store.path}", RuntimeWarning, stacklevel=2)
        saved_next = int(doc.get("next_row", 0))
        if store.next_row > saved_next:
            warnings.warn(f"the store at {store.path} holds {store.next_row - saved_next} row(s) committed after "
                          f"checkpoint {folder}; they stay replayable", RuntimeWarning, stacklevel=2)
        elif store.next_row < saved_next:
            warnings.warn(f"the store at {store.path} ends at row {store.next_row}, but checkpoint {folder} saw "
                          f"{saved_next} rows: is it the same store?", RuntimeWarning, stacklevel=2)
        state_path = os.path.join(folder, str(doc.get("state_file", "")))
        if doc.get("state_file") and os.path.exists(state_path):
            with open(state_path, "rb") as fh:
                state = decode_state(fh.read(), state_path)
        else:
            state = store.load_state(STATE_NAME)
        if state is not None:
            self.load_replay_state_dict(state)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; resuming also restores the replay state saved with the checkpoint."""
        folder = resume_from_checkpoint
        if isinstance(folder, bool):
            folder = get_last_checkpoint(self.args.output_dir) if folder else None
        if folder is not None:
            self.load_replay_checkpoint(os.fspath(folder))
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.close_replay_store()

    # ------------------------------------------------------------------ the seam

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        rewards_per_func = super()._calculate_rewards(*args, **kwargs)
        self._pending_rewards = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        self._pending_rewards = None
        out = super()._generate_and_score_completions(inputs, *args, **kwargs)
        if not self.model.training:  # evaluation batches are neither stored nor mixed
            return out
        return self._record_and_replay(out)

    def _record_and_replay(self, out: Dict[str, Any]) -> Dict[str, Any]:
        store = self.replay_store
        step = int(self.state.global_step)
        n_fresh = out["prompt_ids"].shape[0]
        unknown = sorted(k for k, v in out.items() if k not in _KNOWN_KEYS and v is not None)
        if unknown and self.replay_mode != "off":
            raise ReplayConfigError(f"the batch carries {unknown}, which replay cannot rebuild for stored rows "
                                    "(multimodal inputs?); use replay_mode='off' to only record such runs")
        if unknown and not self._warned_keys:
            self._warned_keys = True
            warnings.warn(f"the store does not record the batch keys {unknown}", RuntimeWarning, stacklevel=2)
        if out["advantages"].dim() != 1:
            raise ReplayConfigError(f"advantages of shape {tuple(out['advantages'].shape)} are not supported; "
                                    "diskreplay stores one advantage per row")
        keys = _prompt_keys(out["prompt_ids"], out["prompt_mask"])
        rewards, rewards_per_func = self._row_rewards(n_fresh)
        old = out.get("old_per_token_logps")
        if old is None and not unknown and (self.replay_mode != "off" or self.args.replay_compute_old_logps):
            old = self._behaviour_logps(out)
        # draw before writing, so that the fresh rows are never replayed into their own batch
        plan = self._plan(out, keys, rewards, step)
        if self.args.replay_append and self.replay_mode != "off" and self.accelerator.num_processes > 1:
            plan = self._common_append(plan, out["prompt_ids"].device)
        record = self._record(out, keys, rewards, rewards_per_func, old, step)
        fresh_rows = store.extend(record)

        result = out
        replay: Dict[str, Any] = {}
        if plan is not None and len(plan.rows):
            replay = self._read_replay(plan.rows, out)
            if self.args.recompute_advantages:
                replay["advantages"] = self._recomputed_advantages(plan, replay, keys, rewards, step)
            result = self._assemble(out, old, replay, plan)
        if self.replay_mode != "off" and "num_items_in_batch" in out:
            # a collective: every process recounts, whether or not it replayed in this step
            result["num_items_in_batch"] = self._count_items(result, out["num_items_in_batch"])
        self._report(step, out, result, fresh_rows, plan, replay, rewards)
        return result

    # ------------------------------------------------------------------ fresh rows

    def _row_rewards(self, n: int) -> tuple:
        """Per-row total reward ([n] float32) and per-function rewards ([n, F]) of this process's rows."""
        rpf = self._pending_rewards
        if rpf is None:
            # a TRL that no longer calls _calculate_rewards: its logged per-function rewards of this batch
            logs = getattr(self, "_logs", None)
            total = n * self.accelerator.num_processes
            try:
                cols = [list(logs["rewards"][name])[-total:] for name in self.reward_func_names]
                rpf = torch.tensor(cols, dtype=torch.float32).T
            except (TypeError, KeyError, ValueError, RuntimeError):
                rpf = None
            if rpf is None or rpf.shape[0] != total:
                raise RuntimeError(f"cannot find the per-row rewards of this batch in TRL {trl.__version__} "
                                   "(GRPOTrainer._calculate_rewards was not called); diskreplay needs a TRL "
                                   "within the range of diskreplay[trl]")
        rpf = rpf.detach().float().cpu()
        if rpf.shape[0] != n:  # gathered over processes: keep this process's slice
            start = self.accelerator.process_index * n
            rpf = rpf[start:start + n]
        weights = self.reward_weights.detach().float().cpu()
        total = (rpf * weights[None, :]).nansum(dim=1)
        return total.numpy().astype(np.float32), rpf.numpy().astype(np.float32)

    def _behaviour_logps(self, out: Dict[str, Any]) -> torch.Tensor:
        """Per-token log-probs of the fresh completions under the current policy, as TRL computes them."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attention, out["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size)
        return logps.detach()

    def _record(self, out: Dict[str, Any], keys: np.ndarray, rewards: np.ndarray, rewards_per_func: np.ndarray,
                old: Optional[torch.Tensor], step: int) -> Dict[str, Any]:
        n = len(keys)
        rec: Dict[str, Any] = {
            "prompt_ids": out["prompt_ids"], "prompt_mask": out["prompt_mask"],
            "completion_ids": out["completion_ids"], "completion_mask": out["completion_mask"],
            GROUP_KEY: keys, VERSION_KEY: np.full(n, step, dtype=np.int64),
            "rewards": rewards, "rewards_per_func": rewards_per_func,
            "advantages": out["advantages"].detach().float(),
            "old_per_token_logps": old,
        }
        for name in ("ref_per_token_logps", "sampling_per_token_logps", "tool_mask"):
            if out.get(name) is not None:
                rec[name] = out[name]
        sampling = rec.get("sampling_per_token_logps")
        if sampling is not None and torch.isnan(sampling).any():
            # the store refuses NaN per-token values; vLLM marks unscorable tokens so. Take the behaviour
            # log-prob there: TRL already excluded those tokens from the importance ratio it computed.
            fill = old if old is not None else torch.zeros_like(sampling)
            rec["sampling_per_token_logps"] = torch.where(torch.isnan(sampling), fill.to(sampling.dtype), sampling)
        ratio = out.get("importance_sampling_ratio")
        if ratio is not None:
            rec["importance_sampling_ratio"] = ratio[:, 0] if self._sequence_ratio(ratio) else ratio
        return rec

    def _sequence_ratio(self, ratio: torch.Tensor) -> bool:
        mode = str(getattr(self.args, "vllm_importance_sampling_mode", ""))
        return ratio.dim() == 2 and ratio.shape[1] == 1 and mode.startswith("sequence")

    # ------------------------------------------------------------------ which rows to replay

    def _min_version(self, step: int) -> Optional[int]:
        bound = None if self.args.max_policy_lag is None else step - self.args.max_policy_lag
        scalar = self.args.ssr_capacity_scalar
        store = self.replay_store
        if self.replay_mode == "ssr" and scalar is not None and store.next_row > store.head:
            # rows are appended in step order, so "the newest W rows" is "versions >= that of row next_row - W"
            window = scalar * self.args.per_device_train_batch_size * self.args.steps_per_generation
            first = max(store.head, store.next_row - window)
            v = int(self._versions.live(store)[first - store.head])
            bound = v if bound is None else max(bound, v)
        return bound

    def _has_rows_since(self, bound: Optional[int]) -> bool:
        store = self.replay_store
        if store.next_row <= store.head:
            return False
        # versions never decrease along the rows, so the newest row decides
        return bound is None or int(self._versions.live(store)[-1]) >= bound

    def _plan(self, out: Dict[str, Any], keys: np.ndarray, rewards: np.ndarray, step: int) -> Optional[_Plan]:
        if self.replay_mode == "off":
            return None
        bound = self._min_version(step)
        if not self._has_rows_since(bound):
            return None
        if self.replay_mode == "repo":
            return self._plan_repo(keys, bound)
        if self.replay_mode == "ssr":
            return self._plan_ssr(out, bound)
        return self._plan_swap(keys, rewards, bound)

    def _group_keys(self, keys: np.ndarray) -> np.ndarray:
        g = self.args.num_generations
        groups = keys.reshape(-1, g)
        if (groups != groups[:, :1]).any():
            raise RuntimeError("the generation batch does not hold its prompt groups as consecutive rows; "
                               "this TRL version lays out batches differently than diskreplay expects")
        return groups[:, 0]

    def _plan_repo(self, keys: np.ndarray, bound: Optional[int]) -> _Plan:
        store, g, k = self.replay_store, self.args.num_generations, self.args.replay_k
        need = self.args.replay_min_generations or k
        versions = self._versions.live(store) if bound is not None else None
        chosen = []
        for j, key in enumerate(self._group_keys(keys).tolist()):
            rows = store.group_rows(key)
            count = len(rows) if versions is None else int(np.count_nonzero(versions[rows - store.head] >= bound))
            if count >= need:
                chosen.append(j)
        if not chosen:
            return _Plan(np.zeros(0, dtype=np.int64), None)
        group_keys = self._group_keys(keys)
        rows = self._sampler.sample(store, len(chosen) * k, groups=[int(group_keys[j]) for j in chosen],
                                    min_policy_version=bound)
        if self.args.replay_append:
            return _Plan(self._whole_steps(rows), None)
        # the last k rows of each chosen group give way: fresh rows are exchangeable
        positions = np.concatenate([j * g + g - k + np.arange(k) for j in chosen]).astype(np.int64)
        return _Plan(rows, positions)

    def _common_append(self, plan: Optional[_Plan], device: torch.device) -> Optional[_Plan]:
        """Cut appended rows to the fewest any process drew (a collective: every process calls it).

        TRL's loss gathers per-row tensors across processes, which needs the same
        batch size on each; each process's store holds other rows, so ``repo`` can
        draw a different number of rows per process.
        """
        n = 0 if plan is None else len(plan.rows)
        common = int(self.accelerator.gather(torch.tensor([n], device=device)).min())
        if plan is None or common == n:
            return plan
        return _Plan(plan.rows[:common], None)  # a multiple of steps_per_generation, as every process's count

    def _whole_steps(self, rows: np.ndarray) -> np.ndarray:
        # TRL splits the batch into steps_per_generation equal parts and drops a remainder
        spg = self.args.steps_per_generation
        return rows[: len(rows) - len(rows) % spg]

    def _plan_ssr(self, out: Dict[str, Any], bound: Optional[int]) -> _Plan:
        n_fresh = out["prompt_ids"].shape[0]
        n = max(1, int(round(self.args.ssr_replay_fraction * n_fresh)))
        if self.args.replay_append:
            n -= n % self.args.steps_per_generation
            if n == 0:
                return _Plan(np.zeros(0, dtype=np.int64), None)
        rows = self._sampler.sample(self.replay_store, n, min_policy_version=bound)
        if self.args.replay_append:
            return _Plan(rows, None)
        # replace the fresh rows that carry the least gradient: smallest |advantage| first
        adv = out["advantages"].detach().float().abs().cpu().numpy()
        positions = np.sort(np.argsort(adv, kind="stable")[:n]).astype(np.int64)
        return _Plan(rows, positions)

    def _plan_swap(self, keys: np.ndarray, rewards: np.ndarray, bound: Optional[int]) -> _Plan:
        g = self.args.num_generations
        grouped = rewards.reshape(-1, g).astype(np.float64)
        spread = np.nanmax(grouped, axis=1) - np.nanmin(grouped, axis=1)
        zero = np.flatnonzero(~(spread > 0))
        if not len(zero):
            return _Plan(np.zeros(0, dtype=np.int64), None)
        candidates = self._groups_with_spread(bound)
        if not candidates:
            return _Plan(np.zeros(0, dtype=np.int64), None)
        picks = self._rng.choice(len(candidates), size=len(zero), replace=len(candidates) < len(zero))
        rows = self._sampler.sample(self.replay_store, len(zero) * g, groups=[candidates[i] for i in picks],
                                    min_policy_version=bound)
        positions = np.concatenate([j * g + np.arange(g) for j in zero]).astype(np.int64)
        return _Plan(rows, positions, group_size=g)

    def _groups_with_spread(self, bound: Optional[int]) -> List[Any]:
        """Keys of stored groups with at least ``replay_min_generations`` eligible rows whose rewards differ."""
        store = self.replay_store
        gi = store.group_index()
        if not len(gi):
            return []
        idx = gi.rows - store.head
        r = self._rewards.live(store).astype(np.float64)[idx]
        ok = np.isfinite(r)
        if bound is not None:
            ok &= self._versions.live(store)[idx] >= bound
        starts = gi.offsets[:-1]
        count = np.add.reduceat(ok.astype(np.int64), starts)
        # max > min is exact where a variance from running sums would cancel
        hi = np.maximum.reduceat(np.where(ok, r, -np.inf), starts)
        lo = np.minimum.reduceat(np.where(ok, r, np.inf), starts)
        need = self.args.replay_min_generations or self.args.num_generations
        good = np.flatnonzero((count >= need) & (hi > lo))
        return [gi.keys[i] for i in good.tolist()]

    # ------------------------------------------------------------------ building the batch

    def _read_replay(self, rows: np.ndarray, out: Dict[str, Any]) -> Dict[str, Any]:
        store = self.replay_store
        want = ["prompt_ids", "completion_ids", "advantages", "old_per_token_logps", GROUP_KEY, VERSION_KEY,
                "rewards"] + [c for c in _OPTIONAL if out.get(c) is not None]
        absent = [c for c in want if c not in store.columns]
        if absent:
            raise ReplayConfigError(f"the batch needs {absent} for replayed rows, but the store at {store.path} "
                                    "has no such column; replay from a store written with the same settings")
        batch = store.read(rows, columns=want)
        for name in want:
            col, missing = batch[name], None
            if col is None:  # a ragged column that none of these rows has
                missing = 0
            elif isinstance(col, RaggedColumn) and col.validity is not None and not col.validity.all():
                missing = int(np.flatnonzero(~np.asarray(col.validity))[0])
            if missing is not None:
                raise ReplayConfigError(f"stored row {int(rows[missing])} has no {name!r} (the run that wrote it "
                                        "did not compute it), so it cannot be replayed; write the store with "
                                        "replay_compute_old_logps=True and the same beta")
        return collate(batch, self._pad_token_id())

    def _pad_token_id(self) -> int:
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        return tok.pad_token_id if tok.pad_token_id is not None else 0

    def _recomputed_advantages(self, plan: _Plan, replay: Dict[str, Any], keys: np.ndarray,
                               rewards: np.ndarray, step: int) -> torch.Tensor:
        r = replay["rewards"].double().numpy()
        rkeys = replay[GROUP_KEY].numpy()
        scale = self.args.scale_rewards
        g = self.args.num_generations
        fresh = {int(k): rewards.reshape(-1, g)[j].astype(np.float64)
                 for j, k in enumerate(self._group_keys(keys).tolist())}
        store = self.replay_store
        bound = self._min_version(step)
        adv = np.zeros(len(r))
        for i in range(len(r)):
            if self.replay_mode == "swap_zero_std":
                s = (i // plan.group_size) * plan.group_size
                ref = r[s:s + plan.group_size]
            elif int(rkeys[i]) in fresh:
                ref = fresh[int(rkeys[i])]
            else:
                rows = store.group_rows(int(rkeys[i]))
                if bound is not None:
                    rows = rows[self._versions.live(store)[rows - store.head] >= bound]
                ref = self._rewards.live(store)[rows - store.head].astype(np.float64)
            a = r[i] - np.nanmean(ref)
            if scale == "group":
                a = a / (_group_std(ref) + 1e-4)
            adv[i] = 0.0 if not np.isfinite(a) else a
        if scale == "batch":
            everything = np.concatenate([rewards.astype(np.float64), r])
            adv = adv / (_group_std(everything) + 1e-4)
        return torch.from_numpy(adv).to(replay["advantages"].dtype)

    def _assemble(self, out: Dict[str, Any], old: Optional[torch.Tensor], replay: Dict[str, Any],
                  plan: _Plan) -> Dict[str, Any]:
        """The parent's batch with ``plan``'s rows swapped in (or appended), re-padded to common widths."""
        device = out["prompt_ids"].device
        fresh = dict(out)
        if fresh.get("old_per_token_logps") is None:
            fresh["old_per_token_logps"] = old  # replayed rows need theirs, so every row gets one
        multiple = self.args.pad_to_multiple_of if isinstance(self.args.pad_to_multiple_of, int) else None
        widths = {True: _round_up(max(fresh["prompt_ids"].shape[1], replay["prompt_ids"].shape[1]), multiple),
                  False: _round_up(max(fresh["completion_ids"].shape[1], replay["completion_ids"].shape[1]),
                                   multiple)}
        pad_id = self._pad_token_id()
        n_fresh, n = out["prompt_ids"].shape[0], len(plan.rows)
        if plan.positions is None:
            index = torch.arange(n_fresh + n)
        else:
            index = torch.arange(n_fresh)
            index[torch.from_numpy(plan.positions)] = n_fresh + torch.arange(n)
        index = index.to(device)
        token_ratio = out.get("importance_sampling_ratio") is not None and \
            not self._sequence_ratio(out["importance_sampling_ratio"])
        result: Dict[str, Any] = {}
        for key, f in fresh.items():
            if f is None or key == "num_items_in_batch" or not isinstance(f, torch.Tensor):  # recounted later
                result[key] = f
                continue
            r = replay[key].to(device=device, dtype=f.dtype)
            if key in _PROMPT_SIDE or key in _COMPLETION_SIDE or (key == "importance_sampling_ratio" and token_ratio):
                left = key in _PROMPT_SIDE
                value = pad_id if key in ("prompt_ids", "completion_ids") else (1 if key == "tool_mask" else 0)
                f, r = _pad(f, widths[left], left, value), _pad(r, widths[left], left, value)
            elif f.dim() == 2 and r.dim() == 1:  # a sequence-level ratio is stored as one value per row
                r = r[:, None]
            result[key] = torch.cat([f, r])[index]
        return result

    def _count_items(self, batch: Dict[str, Any], like: torch.Tensor) -> torch.Tensor:
        """TRL's ``num_items_in_batch``: loss tokens of the batch, summed over processes."""
        mask = batch["completion_mask"]
        if batch.get("tool_mask") is not None:
            mask = mask * batch["tool_mask"]
        return self.accelerator.gather(mask.sum()).sum().to(dtype=like.dtype, device=like.device)

    # ------------------------------------------------------------------ reporting

    def _report(self, step: int, out: Dict[str, Any], result: Dict[str, Any], fresh_rows: np.ndarray,
                plan: Optional[_Plan], replay: Dict[str, Any], rewards: np.ndarray) -> None:
        n_out = result["prompt_ids"].shape[0]
        rows = plan.rows if plan is not None else np.zeros(0, dtype=np.int64)
        n = len(rows) if replay else 0
        if n:
            positions = plan.positions if plan.positions is not None else out["prompt_ids"].shape[0] + np.arange(n)
            lag = float((step - replay[VERSION_KEY].double()).mean())
            replay_reward = float(replay["rewards"].double().mean())
        else:
            positions, lag, replay_reward = np.zeros(0, dtype=np.int64), float("nan"), float("nan")
        entry = {"global_step": step, "fresh_rows": fresh_rows, "replayed_rows": rows[:n].copy(),
                 "positions": np.asarray(positions, dtype=np.int64), "batch_size": n_out,
                 "replay_fraction": n / n_out, "policy_lag_mean": lag,
                 "reward_mean": float(np.nanmean(rewards)) if len(rewards) else float("nan"),
                 "replay_reward_mean": replay_reward, "store_rows": len(self.replay_store)}
        self.replay_history.append(entry)
        metrics = getattr(self, "_metrics", None)
        if isinstance(metrics, dict) and "train" in metrics:
            metrics["train"]["replay/fraction"].append(entry["replay_fraction"])
            metrics["train"]["replay/store_rows"].append(float(entry["store_rows"]))
            if n:
                metrics["train"]["replay/policy_lag_mean"].append(lag)
                metrics["train"]["replay/reward_mean"].append(replay_reward)
