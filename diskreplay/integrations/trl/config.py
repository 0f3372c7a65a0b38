"""``DiskReplayGRPOConfig``: TRL's ``GRPOConfig`` plus the replay options, checked when built.

>>> args = DiskReplayGRPOConfig(output_dir="/tmp/x", replay_mode="repo", replay_k=2,
...                             num_generations=4, per_device_train_batch_size=8, use_cpu=True, report_to=[])
>>> args.replay_mode, args.replay_k
('repo', 2)
>>> DiskReplayGRPOConfig(output_dir="/tmp/x", replay_mode="repo", replay_k=9, num_generations=4,
...                      per_device_train_batch_size=8, use_cpu=True, report_to=[])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
diskreplay.errors.ReplayConfigError: replay_k=9 exceeds num_generations=4: ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from ...errors import MissingDependencyError

try:
    from trl import GRPOConfig
except ImportError as exc:  # pragma: no cover - only without the extra
    raise MissingDependencyError("diskreplay.integrations.trl needs TRL; install it with pip install 'diskreplay[trl]'") from exc

from ... import PromptGroupSampler, SamplerError
from ...errors import ReplayConfigError
from .planners import GROUP_MODES, REPLAY_MODES, is_int, is_number

__all__ = ["DiskReplayGRPOConfig", "check_replay_options"]


def _help(text: str) -> Dict[str, Any]:
    return {"help": text}


@dataclass
class DiskReplayGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the replay options of :class:`~diskreplay.integrations.trl.DiskReplayGRPOTrainer`.

    The replay options are checked when the config is built and again when the
    trainer is; a bad one raises :class:`~diskreplay.ReplayConfigError` (a ``ValueError``).

    >>> DiskReplayGRPOConfig(output_dir="/tmp/x", replay_mode="ssr", ssr_replay_fraction=0.5,
    ...                      use_cpu=True, report_to=[]).ssr_replay_fraction
    0.5
    """

    replay_store_path: Optional[str] = field(default=None, metadata=_help(
        "Directory of the ReplayStore every generated row is written to (created if missing or empty, reopened "
        "if it holds a store; any other non-empty directory is refused)."))
    replay_mode: str = field(default="off", metadata=_help(
        "off (store only), repo (past generations of the same prompts: needs prompts that recur within "
        "max_policy_lag), repo_any (stored groups of any prompt: a run of about one epoch), ssr (rows by "
        "|advantage| priority) or swap_zero_std (replace zero-reward-spread groups by stored groups with spread)."))
    replay_k: int = field(default=2, metadata=_help(
        "repo, repo_any: stored rows replayed per group of the batch (at most num_generations)."))
    replay_strategy: Optional[str] = field(default=None, metadata=_help(
        "Which rows of a stored group to replay: random, recency, reward or variance. Default: recency for "
        "repo and repo_any, variance for swap_zero_std."))
    replay_min_generations: Optional[int] = field(default=None, metadata=_help(
        "Stored rows a prompt group needs before it is replayed. Default: replay_k (repo, repo_any), "
        "num_generations (swap_zero_std)."))
    replay_append: bool = field(default=False, metadata=_help(
        "Append replayed rows instead of replacing fresh ones (repo, repo_any, ssr); the batch then grows."))
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
    replay_stream: Optional[str] = field(default=None, metadata=_help(
        "Train on the rollout stream of this name (diskreplay.RolloutStream) instead of generating: every "
        "generation batch is the next whole prompt groups external generators committed to replay_store_path, "
        "each consumed once across restarts (the stream's cursor is in every checkpoint), at most "
        "max_policy_lag optimizer steps old. Needs replay_mode='off'; one store for all processes."))
    replay_stream_timeout: float = field(default=600.0, metadata=_help(
        "replay_stream: seconds a generation batch waits for the generators to commit its rows before the step "
        "fails."))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_replay_options(self)


def check_replay_options(args: Any) -> None:
    """Raise :class:`~diskreplay.ReplayConfigError` for replay options that cannot work together."""
    mode = args.replay_mode
    if mode not in REPLAY_MODES:
        raise ReplayConfigError(f"replay_mode must be one of {REPLAY_MODES}, got {mode!r}")
    g = args.num_generations
    if not is_int(args.replay_k) or args.replay_k < 1:
        raise ReplayConfigError(f"replay_k must be a positive integer, got {args.replay_k!r}")
    if mode in ("repo", "repo_any") and args.replay_k > g:  # only RePO draws replay_k rows per group
        raise ReplayConfigError(f"replay_k={args.replay_k} exceeds num_generations={g}: replay_mode={mode!r} "
                                "replays at most one group's worth of stored rows per group of the batch; lower "
                                f"replay_k to at most {g}")
    if args.replay_strategy is not None:
        try:  # the sampler owns the list of strategies
            PromptGroupSampler(samples_per_group=1, strategy=args.replay_strategy)
        except SamplerError as exc:
            raise ReplayConfigError(f"replay_strategy={args.replay_strategy!r} is not a PromptGroupSampler "
                                    f"strategy ({exc}); or pass None for the mode's default") from None
    for name in ("replay_min_generations", "ssr_capacity_scalar", "replay_capacity"):
        v = getattr(args, name)
        if v is not None and (not is_int(v) or v < 1):
            raise ReplayConfigError(f"{name} must be a positive integer or None, got {v!r}")
    if args.max_policy_lag is not None and (not is_int(args.max_policy_lag) or args.max_policy_lag < 0):
        raise ReplayConfigError(f"max_policy_lag must be an integer >= 0 or None, got {args.max_policy_lag!r}")
    f = args.ssr_replay_fraction
    if not is_number(f) or not 0 < f <= 1:
        raise ReplayConfigError(f"ssr_replay_fraction must be in (0, 1], got {f!r}")
    if not is_number(args.ssr_alpha) or args.ssr_alpha < 0:
        raise ReplayConfigError(f"ssr_alpha must be a finite number >= 0, got {args.ssr_alpha!r}")
    if not is_number(args.ssr_eps) or args.ssr_eps <= 0:
        raise ReplayConfigError(f"ssr_eps must be a finite number > 0 (it keeps every row drawable), got "
                                f"{args.ssr_eps!r}")
    if args.replay_seed is not None and (not is_int(args.replay_seed) or args.replay_seed < 0):
        raise ReplayConfigError(f"replay_seed must be a non-negative integer or None, got {args.replay_seed!r}")
    if args.replay_stream is not None:
        if mode != "off":
            raise ReplayConfigError(f"replay_stream={args.replay_stream!r} trains on the generators' rows as they "
                                    f"arrive; replay_mode={mode!r} does not combine with it yet: use "
                                    "replay_mode='off'")
        local = args.generation_batch_size // max(int(args.world_size), 1)
        if local % g:
            raise ReplayConfigError(f"replay_stream takes whole prompt groups of num_generations={g} rows, but each "
                                    f"process's generation batch holds {local}; make per_device_train_batch_size * "
                                    "steps_per_generation a multiple of num_generations")
        if not args.replay_stream_timeout > 0:
            raise ReplayConfigError(f"replay_stream_timeout must be seconds > 0, got {args.replay_stream_timeout!r}")
    if args.replay_append and mode == "swap_zero_std":
        raise ReplayConfigError("replay_append=True does not apply to replay_mode='swap_zero_std', which swaps "
                                "groups in place; drop replay_append or pick repo/repo_any/ssr")
    aggregation = getattr(args, "multi_objective_aggregation", "sum_then_normalize")
    if args.recompute_advantages and aggregation != "sum_then_normalize":
        raise ReplayConfigError(f"recompute_advantages=True needs multi_objective_aggregation='sum_then_normalize' "
                                f"(got {aggregation!r}); use the stored advantages instead")
    if mode in GROUP_MODES:
        local = args.generation_batch_size // max(int(args.world_size), 1)
        if local % g:
            raise ReplayConfigError(f"replay_mode={mode!r} needs whole prompt groups in each process's generation "
                                    f"batch, but it holds {local} rows for num_generations={g}; make "
                                    "per_device_train_batch_size * steps_per_generation a multiple of "
                                    "num_generations")
