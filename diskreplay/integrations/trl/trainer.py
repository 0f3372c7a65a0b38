"""``DiskReplayGRPOTrainer``: TRL's ``GRPOTrainer`` that records every rollout and replays from disk.

See the package docstring (:mod:`diskreplay.integrations.trl`) for the replay
modes, the seam into TRL and what a restart does.

One module: the trainer subclass, whose overrides of TRL's methods (generation, scoring,
logging, checkpoints) share its state and are read together against TRL's own.
"""

from __future__ import annotations

import os
import warnings
from collections import deque
from typing import Any, Deque, Dict, List, Optional

import numpy as np
import torch

from ...errors import MissingDependencyError

try:
    import trl
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - only without the extra
    raise MissingDependencyError("diskreplay.integrations.trl needs TRL; install it with pip install 'diskreplay[trl]'") from exc
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ... import PrioritizedSampler, PromptGroupSampler, RaggedColumn, ReplayStore, collate
from ...errors import IntegrationError, ReplayConfigError
from .batch import (KNOWN_KEYS, OPTIONAL_KEYS, TRUNCATED, assemble, importance_ratio, prompt_keys, record,
                    sampling_logps_or_old)
from ...stream import RolloutStream
from .checkpoint import (STATE_NAME, ReplayState, checkpoint_state_path, load_checkpoint_state,
                         load_checkpoint_stream, save_checkpoint_state)
from .config import DiskReplayGRPOConfig, check_replay_options
from .planners import (GROUP_KEY, GROUP_MODES, VERSION_KEY, FreshBatch, Planner, RepoAnyPlanner, RepoPlanner,
                       ReplayPlan, SsrPlanner, SwapZeroStdPlanner, Timeline, recompute_advantages)

__all__ = ["DiskReplayGRPOTrainer"]

HISTORY_LENGTH = 4096
_SEAMS = ("_generate_and_score_completions", "_calculate_rewards", "_get_per_token_logps_and_entropies",
          "_save_checkpoint")
#: per-row columns every step writes (so a store that lacks one cannot take this trainer's rows)
_ALWAYS_WRITTEN = (GROUP_KEY, VERSION_KEY, "rewards", "rewards_per_func", "advantages")
#: ... and those some steps write (importance-sampling ratios; the truncation flag, which a store that has it
#: gets from every later step: see _record_and_replay)
_PER_ROW_WRITES = frozenset(_ALWAYS_WRITTEN + ("importance_sampling_ratio", TRUNCATED))
#: the batch keys of TRL's importance-sampling correction; replayed rows get them from stored log-probs
_IS_KEYS = ("sampling_per_token_logps", "importance_sampling_ratio")


class DiskReplayGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that writes every rollout to a :class:`~diskreplay.ReplayStore` and replays from it.

    Takes ``GRPOTrainer``'s arguments; ``args`` must be a
    :class:`~diskreplay.integrations.trl.DiskReplayGRPOConfig`. ``replay_store``
    optionally passes an open, writable store instead of
    ``args.replay_store_path`` (the caller then owns it: the trainer never
    closes it). A store that cannot take this run's rows or serve its mode, a
    path that is a file or a non-empty directory without a store, a read-only
    store, or bad replay options raise :class:`~diskreplay.ReplayConfigError`
    here, before any training.

    After each generation, ``replay_history[-1]`` describes it: ``global_step``,
    ``fresh_rows`` (row ids written), ``replayed_rows``, ``positions`` (their
    rows in the returned batch, before TRL shuffles it), ``batch_size``,
    ``replay_fraction``, ``policy_lag_mean``, ``reward_mean``,
    ``eligible_groups`` (the stored groups the step could draw; None in
    ``ssr``). The same numbers are logged as ``replay/*`` metrics, and the
    first step that replays nothing although the store holds rows says why in
    one ``RuntimeWarning``. ``excluded_rows`` counts the stored rows
    that replay skips (committed after the checkpoint a run resumed from). The
    store stays open (it holds the writer lock) until ``train()`` returns or
    :meth:`close_replay_store` is called; it is reopened on demand.

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
            raise IntegrationError(f"TRL {trl.__version__} has no GRPOTrainer.{missing[0]}, which diskreplay's "
                                   "replay hooks into; install a TRL version within the range of diskreplay[trl]")
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DiskReplayGRPOConfig):
            raise ReplayConfigError(f"args must be a DiskReplayGRPOConfig, got {type(self.args).__name__}; build "
                                    "it with the same options plus replay_store_path / replay_mode")
        check_replay_options(self.args)
        self.replay_mode: str = self.args.replay_mode
        self.replay_history: Deque[Dict[str, Any]] = deque(maxlen=HISTORY_LENGTH)
        self.excluded_rows = 0
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
        self._seed = seed
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 1])))
        self._planner: Optional[Planner] = self._make_planner(self._make_sampler(), Timeline())
        self._pending_rewards: Optional[torch.Tensor] = None
        self._warned_keys = False
        self._warned_empty = False
        self._stream: Optional[RolloutStream] = None
        self._stream_before: Optional[Dict[str, Any]] = None  # its cursor before the newest generation batch
        # a fresh start on a store that recorded excluded rows (an earlier run resumed) keeps them excluded
        saved = self._store.load_state(STATE_NAME)
        if saved is not None:
            self._set_timeline(ReplayState.from_dict(saved, f"{self._store.path} state {STATE_NAME!r}").timeline)

    # ------------------------------------------------------------------ store

    def _resolve_path(self) -> str:
        path = self.args.replay_store_path
        if not path:
            raise ReplayConfigError("replay_store_path is not set: pass the directory the rollouts are written to "
                                    "(or a writable ReplayStore as replay_store=)")
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ReplayConfigError(f"replay_store_path={path!r} is a file, not a directory; pass the directory "
                                    "of a replay store (a new or empty one is created)")
        if self.accelerator.num_processes > 1 and self.args.replay_stream is None:  # a stream: one store for all
            path = os.path.join(path, f"rank-{self.accelerator.process_index:05d}")
        return path

    def _open_store(self, create: bool) -> ReplayStore:
        path = self._store_path
        if os.path.exists(path) and not os.path.isdir(path):
            raise ReplayConfigError(f"replay_store_path={path!r} is a file, not a directory; pass the directory "
                                    "of a replay store (a new or empty one is created)")
        try:
            existing: Optional[ReplayStore] = ReplayStore(path, readonly=True)
        except FileNotFoundError:
            existing = None
        if existing is not None:
            existing.close()
        elif os.path.isdir(path) and os.listdir(path):
            raise ReplayConfigError(f"replay_store_path={path!r} is a non-empty directory that holds no replay "
                                    f"store ({len(os.listdir(path))} entries, no diskreplay store files); pass a "
                                    "new or empty directory, or the directory of an existing store")
        elif not create:
            raise ReplayConfigError(f"the replay store at {path} is gone; the trainer reopens the store it wrote")
        probe = path
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ReplayConfigError(f"replay_store_path={path!r} is not writable ({probe} denies writes); the "
                                    "trainer writes every rollout there: pass a writable directory")
        capacity = self.args.replay_capacity
        try:
            if existing is not None:
                store = ReplayStore(path)
            else:  # a stream's store is written by the generators too
                store = ReplayStore(path, capacity=capacity, group_key=GROUP_KEY,
                                    multi_writer=self.args.replay_stream is not None)
        except PermissionError as exc:
            raise ReplayConfigError(f"replay_store_path={path!r} cannot be opened for writing ({exc}); pass a "
                                    "writable directory") from None
        if existing is not None and capacity is not None and store.capacity != capacity:
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
        self._store.save_state(STATE_NAME, self.replay_state().to_dict())
        if self._owns_store:
            self._store.close()
            self._store = None

    def _needed_columns(self) -> List[str]:
        mode = self.replay_mode
        if mode == "off":
            return []
        need = ["prompt_ids", "completion_ids", "advantages", "old_per_token_logps", VERSION_KEY, GROUP_KEY]
        if mode == "swap_zero_std" or self.args.recompute_advantages or self._strategy() in ("reward", "variance"):
            need.append("rewards")
        if self.args.beta != 0.0:
            need.append("ref_per_token_logps")
        return need

    def _check_store(self, store: ReplayStore) -> None:
        if self.args.replay_stream is not None:
            self._check_stream_store(store)
            return
        mode = self.replay_mode
        if mode in GROUP_MODES and store.group_key != GROUP_KEY:
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
        # a store's columns are fixed by its first rows: this run's rows must fit them exactly
        certain = list(_ALWAYS_WRITTEN) + ["prompt_ids", "completion_ids"] + (
            ["old_per_token_logps"] if mode != "off" or self.args.replay_compute_old_logps else []) + (
            ["ref_per_token_logps"] if self.args.beta != 0.0 else [])
        absent = [c for c in certain if c not in cols]
        if absent:
            raise ReplayConfigError(f"this run writes {absent} with every row, which the store at {store.path} has "
                                    f"no column for (its columns, fixed by its first rows: {cols}); start a new "
                                    "replay_store_path or set replay_compute_old_logps / beta as the run that "
                                    "created it")
        foreign = [c for c in cols if store.schema[c].kind != "ragged" and c not in _PER_ROW_WRITES]
        if foreign:
            raise ReplayConfigError(f"the store at {store.path} holds per-row column(s) {foreign} that this trainer "
                                    "does not write, so it cannot append to it; start a new replay_store_path")
        if store.schema["rewards_per_func"].width != len(self.reward_funcs):
            raise ReplayConfigError(f"the store at {store.path} holds {store.schema['rewards_per_func'].width} "
                                    f"reward(s) per row, this trainer has {len(self.reward_funcs)} reward "
                                    "function(s); start a new replay_store_path")

    def _check_stream_store(self, store: ReplayStore) -> None:
        if not store.multi_writer:
            raise ReplayConfigError(f"replay_stream={self.args.replay_stream!r}: the store at {store.path} takes one "
                                    "writer, so the generators cannot write it while the trainer runs; create it "
                                    "with ReplayStore(path, multi_writer=True) (or `diskreplay compact --multi-writer"
                                    " PATH`)")
        if store.group_key != GROUP_KEY:
            raise ReplayConfigError(f"replay_stream takes whole prompt groups by {GROUP_KEY!r}, but the store at "
                                    f"{store.path} groups rows by {store.group_key!r}; have the generators write "
                                    f"{GROUP_KEY!r} and create the store with group_key={GROUP_KEY!r}")
        need = ["prompt_ids", "completion_ids", "advantages", "old_per_token_logps", GROUP_KEY, VERSION_KEY,
                "rewards"] + (["ref_per_token_logps"] if self.args.beta != 0.0 else [])
        missing = [c for c in need if store.schema is not None and c not in store.columns]
        if missing:
            raise ReplayConfigError(f"replay_stream trains on the stored rows, which need {missing}; the store at "
                                    f"{store.path} lacks them (columns: {store.columns})")

    # ------------------------------------------------------------------ planners and state

    def _strategy(self) -> str:
        if self.args.replay_strategy is not None:
            return self.args.replay_strategy
        return "variance" if self.replay_mode == "swap_zero_std" else "recency"

    def _make_sampler(self) -> Any:
        mode, seed = self.replay_mode, self._seed
        if mode in ("repo", "repo_any"):
            return PromptGroupSampler(samples_per_group=self.args.replay_k, strategy=self._strategy(),
                                      reward_key="rewards", seed=seed)
        if mode == "swap_zero_std":
            return PromptGroupSampler(samples_per_group=self.args.num_generations, strategy=self._strategy(),
                                      reward_key="rewards", seed=seed)
        if mode == "ssr":
            return PrioritizedSampler(priority_key="advantages", alpha=self.args.ssr_alpha, eps=self.args.ssr_eps,
                                      seed=seed)
        return None

    def _make_planner(self, sampler: Any, timeline: Timeline) -> Optional[Planner]:
        a = self.args
        common = dict(num_generations=a.num_generations, steps_per_generation=a.steps_per_generation,
                      max_policy_lag=a.max_policy_lag, min_generations=a.replay_min_generations,
                      append=a.replay_append, timeline=timeline)
        if self.replay_mode == "repo":
            return RepoPlanner(sampler, a.replay_k, **common)
        if self.replay_mode == "repo_any":
            return RepoAnyPlanner(sampler, a.replay_k, self._rng, **common)
        if self.replay_mode == "ssr":
            window = None if a.ssr_capacity_scalar is None else \
                a.ssr_capacity_scalar * a.per_device_train_batch_size * a.steps_per_generation
            return SsrPlanner(sampler, a.ssr_replay_fraction, window=window, **common)
        if self.replay_mode == "swap_zero_std":
            return SwapZeroStdPlanner(sampler, self._rng, stored_advantages=not a.recompute_advantages, **common)
        return Planner(None, **common)  # off: only the timeline

    @property
    def _sampler(self) -> Any:
        return self._planner.sampler

    @property
    def timeline(self) -> Timeline:
        """The stored rows replay never draws (see :class:`~.planners.Timeline`)."""
        return self._planner.timeline

    def _set_timeline(self, timeline: Timeline) -> None:
        # the planner hands the excluded ranges to every draw (exclude=); the sampler and its stream stay
        self._planner.set_timeline(timeline)
        store = self.replay_store
        self.excluded_rows = timeline.count(store.head, store.next_row)

    def replay_state(self) -> ReplayState:
        """Everything that decides the future replay stream, and the rows it excludes."""
        store = self.replay_store
        return ReplayState(self.replay_mode, None if self._sampler is None else self._sampler.state_dict(),
                           self._rng, next_row=store.next_row, global_step=int(self.state.global_step),
                           store_path=store.path, timeline=self.timeline.live(store.head))

    def replay_state_dict(self) -> Dict[str, Any]:
        """:meth:`replay_state` as a dict of JSON values and arrays (what ``store.save_state`` takes)."""
        return self.replay_state().to_dict()

    def load_replay_state(self, state: ReplayState) -> None:
        """Continue the replay stream of ``state`` (a sampler of another mode starts afresh, with a warning)."""
        if state.replay_mode != self.replay_mode:
            warnings.warn(f"the saved replay state is for replay_mode={state.replay_mode!r}, this trainer runs "
                          f"{self.replay_mode!r}; its sampler starts afresh", RuntimeWarning, stacklevel=2)
            return
        if self._sampler is not None and state.sampler is not None:
            self._sampler.load_state_dict(state.sampler)
        self._rng.bit_generator.state = state.rng.bit_generator.state

    def load_replay_state_dict(self, state: Dict[str, Any]) -> None:
        """:meth:`load_replay_state` from a :meth:`replay_state_dict` (its excluded rows are not applied)."""
        self.load_replay_state(ReplayState.from_dict(state))

    def _checkpoint_state_path(self, folder: str) -> str:
        return checkpoint_state_path(folder, self.accelerator.process_index, self.accelerator.num_processes)

    def save_replay_checkpoint(self, folder: str) -> None:
        """Save the replay state into the store and into checkpoint ``folder`` (see :mod:`.checkpoint`);
        a ``replay_stream`` run saves the stream's cursor with it."""
        state = self.replay_state()
        self.replay_store.save_state(STATE_NAME, state.to_dict())
        save_checkpoint_state(self._checkpoint_state_path(folder), state, self._stream_checkpoint())

    def _stream_checkpoint(self) -> Optional[Dict[str, Any]]:
        """The cursor that matches the model of a checkpoint taken now: after the newest generation
        batch once every step of it trained, else before it (a resumed TRL makes that batch again)."""
        if self._stream is None:
            return None
        every = self.args.steps_per_generation * self.num_iterations
        if self._stream_before is not None and getattr(self, "_step", 0) % every:
            return self._stream_before
        return self._stream.state_dict()

    def load_replay_checkpoint(self, folder: str) -> None:
        """Resume the replay state saved with checkpoint ``folder``.

        Rows the store committed after that checkpoint belong to a timeline the
        resumed run discards: they stay in the store, replay skips them from
        now on, the skipped range is saved in the store's state, and a warning
        says how many there are.
        """
        path = self._checkpoint_state_path(folder)
        state = load_checkpoint_state(path)
        store = self.replay_store
        if self.args.replay_stream is not None:
            self._resume_stream(path)
            if state is not None:
                self.load_replay_state(state)
            return  # the rows committed since are the generators', not a discarded timeline
        if state is None:
            warnings.warn(f"{folder} holds no replay state ({path}): the replay sampler starts afresh and every "
                          "stored row stays replayable", RuntimeWarning, stacklevel=2)
            return
        self.load_replay_state(state)
        timeline = state.timeline
        if state.store_path and os.path.abspath(state.store_path) != store.path:
            warnings.warn(f"{path} was saved with the store at {state.store_path}, this trainer writes to "
                          f"{store.path}; no rows are excluded", RuntimeWarning, stacklevel=2)
        elif store.next_row < state.next_row:
            warnings.warn(f"the store at {store.path} ends at row {store.next_row}, but checkpoint {folder} saw "
                          f"{state.next_row} rows: is it the same store? No rows are excluded", RuntimeWarning,
                          stacklevel=2)
        elif store.next_row > state.next_row:
            timeline = timeline.resumed(state.next_row, store.next_row)
        self._set_timeline(timeline)
        new = store.next_row - state.next_row
        if new > 0 and timeline is not state.timeline:
            message = (f"resuming from {folder}: {new} row(s) [{state.next_row}, {store.next_row}) of the store at "
                       f"{store.path} were committed after that checkpoint by policies this run discards; they "
                       f"stay on disk and are excluded from replay ({self.excluded_rows} live row(s) excluded in "
                       f"all, recorded in the store's {STATE_NAME!r} state)")
            # a warning only: a logger line beside it prints the same message a second time
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        # durable before the first replayed step: a crash now must not bring the discarded rows back
        store.save_state(STATE_NAME, self.replay_state().to_dict())

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # the replay state goes in first: a checkpoint folder TRL completed always has it
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.save_replay_checkpoint(folder)
        super()._save_checkpoint(model, trial)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; resuming also resumes the replay stream (see :meth:`load_replay_checkpoint`)."""
        folder = resume_from_checkpoint
        if isinstance(folder, bool):
            out = self.args.output_dir
            folder = get_last_checkpoint(out) if folder and os.path.isdir(out) else None
            # True with no checkpoint: Trainer.train raises its own "No valid checkpoint found"
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
        if self.args.replay_stream is not None and self.model.training:
            return self._stream_batch(len(inputs))
        self._pending_rewards = None
        out = super()._generate_and_score_completions(inputs, *args, **kwargs)
        if not self.model.training:  # evaluation batches are neither stored nor mixed
            return out
        return self._record_and_replay(out)

    # ------------------------------------------------------------------ the rollout stream

    def rollout_stream(self) -> RolloutStream:
        """The :class:`~diskreplay.RolloutStream` a ``replay_stream`` run trains on (this process's rank)."""
        if self._stream is None:
            if self.args.replay_stream is None:
                raise ReplayConfigError("this trainer generates its own rollouts; set replay_stream= to train on a "
                                        "rollout stream")
            self._stream = RolloutStream(self.replay_store, self.args.replay_stream,
                                         group_size=self.args.num_generations,
                                         max_policy_lag=self.args.max_policy_lag, policy_version_key=VERSION_KEY,
                                         rank=self.accelerator.process_index,
                                         world_size=self.accelerator.num_processes)
        return self._stream

    def _resume_stream(self, path: str) -> None:
        saved = load_checkpoint_stream(path)
        stream = self.rollout_stream()
        if saved is None:
            warnings.warn(f"{path} holds no rollout stream cursor: the stream {self.args.replay_stream!r} goes on from "
                          f"the cursor committed in {self.replay_store.path} (position {stream.position})",
                          RuntimeWarning, stacklevel=3)
            return
        stream.load_state_dict(saved)
        stream.save()  # the generators' back-pressure counts from the resumed cursor

    def _stream_batch(self, n: int) -> Dict[str, Any]:
        """A generation batch of ``n`` rows from the rollout stream, in TRL's layout on this device."""
        stream = self.rollout_stream()
        step = int(self.state.global_step)
        self._stream_before = stream.state_dict()
        rows = stream.next(n, policy_version=step, timeout=self.args.replay_stream_timeout)
        if rows is None:
            raise IntegrationError(f"step {step}: the generators committed no {n} new rows of whole prompt groups "
                                   f"to {self.replay_store.path} within replay_stream_timeout="
                                   f"{self.args.replay_stream_timeout} s (stream {self.args.replay_stream!r}: "
                                   f"{stream.stats()})")
        stream.save()  # drawn: the generators may go on
        store = self.replay_store
        optional = [k for k, wanted in (("ref_per_token_logps", self.args.beta != 0.0),
                                        ("tool_mask", "tool_mask" in store.columns)) if wanted]
        replay = self._read_replay(rows, dict.fromkeys(optional, True))
        device = self.accelerator.device
        keys = ["prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                "old_per_token_logps"] + optional
        out: Dict[str, Any] = {k: replay[k].to(device) for k in keys}
        out["num_items_in_batch"] = self._count_items(out, torch.zeros((), dtype=torch.int64, device=device))
        lag = float((step - replay[VERSION_KEY].double()).mean())
        stats = stream.stats()
        self.replay_history.append({"global_step": step, "stream_rows": rows, "policy_lag_mean": lag,
                                    "reward_mean": _nanmean(replay["rewards"].double().numpy()),
                                    **{f"stream_{k}": v for k, v in stats.items()}})
        metrics = getattr(self, "_metrics", None)
        if isinstance(metrics, dict) and "train" in metrics:
            metrics["train"]["stream/policy_lag_mean"].append(lag)
            metrics["train"]["stream/stale_rows"].append(float(stats["stale"]))
            metrics["train"]["reward"].append(self.replay_history[-1]["reward_mean"])
        return out

    def _ratio_mode(self) -> str:
        return str(getattr(self.args, "vllm_importance_sampling_mode", ""))

    def _record_and_replay(self, out: Dict[str, Any]) -> Dict[str, Any]:
        store = self.replay_store
        step = int(self.state.global_step)
        n_fresh = out["prompt_ids"].shape[0]
        unknown = sorted(k for k, v in out.items() if k not in KNOWN_KEYS and v is not None)
        if unknown and self.replay_mode != "off":
            raise ReplayConfigError(f"the batch carries {unknown}, which replay cannot rebuild for stored rows "
                                    "(multimodal inputs?); use replay_mode='off' to only record such runs")
        if unknown and not self._warned_keys:
            self._warned_keys = True
            warnings.warn(f"the store does not record the batch keys {unknown}", RuntimeWarning, stacklevel=2)
        if out["advantages"].dim() != 1:
            raise ReplayConfigError(f"advantages of shape {tuple(out['advantages'].shape)} are not supported; "
                                    "diskreplay stores one advantage per row")
        keys = prompt_keys(out["prompt_ids"], out["prompt_mask"])
        rewards, rewards_per_func = self._row_rewards(n_fresh)
        fresh = FreshBatch(keys, rewards, out["advantages"].detach().float().cpu().numpy())
        old = out.get("old_per_token_logps")
        if old is None and not unknown and (self.replay_mode != "off" or self.args.replay_compute_old_logps):
            old = self._behaviour_logps(out)
        # draw before writing, so that the fresh rows are never replayed into their own batch
        plan = self._plan(store, fresh, step)
        if not len(plan) and self.replay_mode != "off" and not self._warned_empty:
            self._warn_empty(store, fresh, step)
        if self.args.replay_append and self.replay_mode != "off" and self.accelerator.num_processes > 1:
            plan = self._common_append(plan, out["prompt_ids"].device)
        truncated = None
        if getattr(self.args, "mask_truncated_completions", False) or TRUNCATED in store.columns:
            # TRL zeroed the loss mask of completions cut at max_completion_length: their tokens are
            # kept (exports, best-of-n, pairs) and flagged, so that a replay masks them out again
            truncated = (out["completion_mask"].sum(dim=1) == 0).float()
        fresh_rows = store.extend(record(out, keys, rewards, rewards_per_func, old, step, self._ratio_mode(),
                                         truncated, self._pad_token_id()))

        result = out
        replay: Dict[str, Any] = {}
        if len(plan):
            replay = self._read_replay(plan.rows, out)
            if self.args.recompute_advantages:
                adv = recompute_advantages(plan, replay["rewards"].double().numpy(), replay[GROUP_KEY].numpy(),
                                           fresh, self._planner, store, step, self.args.scale_rewards)
                replay["advantages"] = torch.from_numpy(adv).to(replay["advantages"].dtype)
            result = assemble(out, old, replay, plan, self._pad_token_id(), self.args.pad_to_multiple_of,
                              self._ratio_mode())
        if self.replay_mode != "off" and "num_items_in_batch" in out:
            # a collective: every process recounts, whether or not it replayed in this step
            result["num_items_in_batch"] = self._count_items(result, out["num_items_in_batch"])
        self._report(step, out, result, fresh_rows, plan, replay, rewards)
        return result

    def _plan(self, store: ReplayStore, fresh: FreshBatch, step: int) -> ReplayPlan:
        """The rows to replay in this generation (none in mode ``off``)."""
        if self.replay_mode == "off":
            return ReplayPlan.empty()
        return self._planner.plan(store, fresh, step)

    def _warn_empty(self, store: ReplayStore, fresh: FreshBatch, step: int) -> None:
        """Say once why a step replayed nothing although the store held rows this run could replay."""
        why = self._planner.explain(store, fresh, step)
        if why is None:
            return
        self._warned_empty = True
        warnings.warn(f"replay_mode={self.replay_mode!r} replayed nothing at step {step}: {why} (warned once per "
                      "trainer; replay/fraction and replay/eligible_groups log every step)", RuntimeWarning,
                      stacklevel=3)

    def _common_append(self, plan: ReplayPlan, device: torch.device) -> ReplayPlan:
        """Cut appended rows to the fewest any process drew (a collective: every process calls it).

        TRL's loss gathers per-row tensors across processes, which needs the same
        batch size on each; each process's store holds other rows, so ``repo`` can
        draw a different number of rows per process.
        """
        n = len(plan)
        common = int(self.accelerator.gather(torch.tensor([n], device=device)).min())
        return plan if common == n else plan.first(common)  # a multiple of steps_per_generation, as every count

    # ------------------------------------------------------------------ fresh rows

    def _row_rewards(self, n: int) -> tuple:
        """TRL's row reward ([n] float32, NaN where every reward function returned None) and per-function rewards.

        The row reward is the ``reward_weights``-weighted sum over the scorable
        functions, as TRL's ``sum_then_normalize`` computes it.
        """
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
                raise IntegrationError(f"cannot find the per-row rewards of this batch in TRL {trl.__version__} "
                                       "(GRPOTrainer._calculate_rewards was not called); diskreplay needs a TRL "
                                       "within the range of diskreplay[trl]")
        rpf = rpf.detach().float().cpu()
        if rpf.shape[0] != n:  # gathered over processes: keep this process's slice
            start = self.accelerator.process_index * n
            rpf = rpf[start:start + n]
        weights = self.reward_weights.detach().float().cpu()
        total = (rpf * weights[None, :]).nansum(dim=1)
        total[torch.isnan(rpf).all(dim=1)] = float("nan")  # unscorable: TRL leaves it out of every statistic
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

    # ------------------------------------------------------------------ replayed rows

    def _read_replay(self, rows: np.ndarray, out: Dict[str, Any]) -> Dict[str, Any]:
        store = self.replay_store
        want = ["prompt_ids", "completion_ids", "advantages", "old_per_token_logps", GROUP_KEY, VERSION_KEY,
                "rewards"] + [c for c in OPTIONAL_KEYS if out.get(c) is not None and c not in _IS_KEYS]
        absent = [c for c in want if c not in store.columns]
        if absent:
            raise ReplayConfigError(f"the batch needs {absent} for replayed rows, but the store at {store.path} "
                                    "has no such column; replay from a store written with the same settings")
        sampling = any(out.get(c) is not None for c in _IS_KEYS) and "sampling_per_token_logps" in store.columns
        # sampling log-probs are often recorded from the middle of a run on (a late column): rows without
        # them are replayed without correction, the others with a ratio from their stored log-probs
        truncated = getattr(self.args, "mask_truncated_completions", False) and TRUNCATED in store.columns
        batch = store.read(rows, columns=want + (["sampling_per_token_logps"] if sampling else [])
                           + ([TRUNCATED] if truncated else []))
        flags = batch.pop(TRUNCATED, None)
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
        replay = collate(batch, self._pad_token_id())
        if flags is not None:
            keep = torch.as_tensor(~(np.asarray(flags, dtype=np.float64) == 1.0))[:, None].to(
                replay["completion_mask"].dtype)
            replay["completion_mask"] = replay["completion_mask"] * keep.to(replay["completion_mask"].device)
        if any(out.get(c) is not None for c in _IS_KEYS):
            replay["sampling_per_token_logps"] = sampling_logps_or_old(replay)
            replay.pop("sampling_per_token_logps_present", None)
        if out.get("importance_sampling_ratio") is not None:
            ratio = importance_ratio(replay["old_per_token_logps"], replay["sampling_per_token_logps"],
                                     replay["completion_mask"], self._ratio_mode(),
                                     getattr(self, "vllm_importance_sampling_clip_min", None),
                                     getattr(self, "vllm_importance_sampling_clip_max", None))
            # stored like the fresh rows' ratio: one per row in sequence modes (assemble widens it)
            replay["importance_sampling_ratio"] = ratio[:, 0] if self._ratio_mode().startswith("sequence") else ratio
        return replay

    def _pad_token_id(self) -> int:
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        return tok.pad_token_id if tok.pad_token_id is not None else 0

    def _count_items(self, batch: Dict[str, Any], like: torch.Tensor) -> torch.Tensor:
        """TRL's ``num_items_in_batch``: loss tokens of the batch, summed over processes."""
        mask = batch["completion_mask"]
        if batch.get("tool_mask") is not None:
            mask = mask * batch["tool_mask"]
        return self.accelerator.gather(mask.sum()).sum().to(dtype=like.dtype, device=like.device)

    # ------------------------------------------------------------------ reporting

    def _report(self, step: int, out: Dict[str, Any], result: Dict[str, Any], fresh_rows: np.ndarray,
                plan: ReplayPlan, replay: Dict[str, Any], rewards: np.ndarray) -> None:
        n_out = result["prompt_ids"].shape[0]
        n = len(plan) if replay else 0
        if n:
            positions = plan.positions if plan.positions is not None else out["prompt_ids"].shape[0] + np.arange(n)
            lag = float((step - replay[VERSION_KEY].double()).mean())
            replay_reward = _nanmean(replay["rewards"].double().numpy())
        else:
            positions, lag, replay_reward = np.zeros(0, dtype=np.int64), float("nan"), float("nan")
        entry = {"global_step": step, "fresh_rows": fresh_rows, "replayed_rows": plan.rows[:n].copy(),
                 "positions": np.asarray(positions, dtype=np.int64), "batch_size": n_out,
                 "replay_fraction": n / n_out, "policy_lag_mean": lag, "reward_mean": _nanmean(rewards),
                 "replay_reward_mean": replay_reward, "store_rows": len(self.replay_store),
                 "excluded_rows": self.excluded_rows, "eligible_groups": plan.eligible_groups}
        self.replay_history.append(entry)
        metrics = getattr(self, "_metrics", None)
        if isinstance(metrics, dict) and "train" in metrics:
            metrics["train"]["replay/fraction"].append(entry["replay_fraction"])
            metrics["train"]["replay/store_rows"].append(float(entry["store_rows"]))
            metrics["train"]["replay/excluded_rows"].append(float(self.excluded_rows))
            if plan.eligible_groups is not None:
                metrics["train"]["replay/eligible_groups"].append(float(plan.eligible_groups))
            if n:
                metrics["train"]["replay/policy_lag_mean"].append(lag)
                if not np.isnan(replay_reward):
                    metrics["train"]["replay/reward_mean"].append(replay_reward)


def _nanmean(x: np.ndarray) -> float:
    """Mean of the scorable (non-NaN) values, NaN when there are none (TRL's logged reward)."""
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(x.mean()) if len(x) else float("nan")
