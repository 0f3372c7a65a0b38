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
    same prompt, chosen by a :class:`~diskreplay.PromptGroupSampler`
    strategy (``recency``, ``reward``, ``variance``, ``random``), once the
    prompt has ``replay_min_generations`` stored rows. It replays only when
    prompts recur within ``max_policy_lag`` steps; a run of about one epoch
    replays nothing (the trainer warns once and logs
    ``replay/eligible_groups``, the groups it could have drawn).
``repo_any``
    RePO's off-policy replay from any prompt: for each group of the batch,
    ``replay_k`` rows of one stored group of any prompt with
    ``replay_min_generations`` eligible rows, the groups drawn uniformly
    (with the replay RNG of the checkpoints), the rows by the strategy.
``ssr``
    SSR: ``ssr_replay_fraction`` of the batch drawn row by row with
    ``p ∝ (|advantage| + ssr_eps) ** ssr_alpha``
    (:class:`~diskreplay.PrioritizedSampler`), from the newest
    ``ssr_capacity_scalar`` generation batches when that is set. The replayed
    rows replace the fresh rows of smallest ``|advantage|`` (those carry the
    least gradient).
``swap_zero_std``
    every prompt group TRL gives no gradient (fewer than two scorable rows, or
    all their rewards equal) is replaced by a stored group with reward spread.

By default replayed rows *replace* fresh rows, so the batch keeps its size and
TRL's split over gradient accumulation steps and ``num_iterations`` is
unchanged; ``replay_append=True`` appends them instead (``repo``,
``repo_any``, ``ssr``; rounded down to a multiple of
``steps_per_generation``), as in the RePO paper.
``max_policy_lag`` never replays rows generated more than that many optimizer
steps ago.

Rewards
-------
The stored ``rewards`` column is TRL's row reward: the ``reward_weights``-
weighted sum of the scorable reward functions, and NaN where every function
returned ``None`` (``rewards_per_func`` keeps the NaN of each function). NaN
rows are treated as TRL treats them everywhere: left out of a group's mean
and std, advantage 0, never a reason to call a group "with spread"
(``swap_zero_std``), ranked last by the ``reward`` and ``variance``
strategies, skipped by the reward statistics and curated exports.

Truncated completions
---------------------
With ``mask_truncated_completions``, TRL zeroes the whole loss mask of a
completion cut at ``max_completion_length``. Such a row is stored with its
tokens (up to its last non-padding token: exports, best-of-n and preference
pairs see what was generated) and ``completion_truncated`` = 1.0 (0.0 for
the others); a replay masks it out of the loss again, as TRL did.

Training on a rollout stream
----------------------------
``replay_stream="trainer"`` (with ``replay_mode="off"``) turns generation off:
each generation batch is the next whole prompt groups that external
generators committed to the store, taken once each with a
:class:`~diskreplay.RolloutStream` (``max_policy_lag`` bounds their age), and
every checkpoint carries the stream's cursor that matches its model
(docs/streams.md).

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
``pad_to_multiple_of``); ``num_items_in_batch`` is recounted. Three more
methods are used, never reimplemented: ``_calculate_rewards`` is wrapped to
keep its return value (the per-function rewards, which the parent logs but
does not return), ``_get_per_token_logps_and_entropies`` computes behaviour
log-probs (below), and ``Trainer._save_checkpoint`` is wrapped to save the
replay state first. The constructor checks that all of them exist.

vLLM's importance-sampling correction
-------------------------------------
With vLLM and ``vllm_importance_sampling_correction``, TRL returns each fresh
row's ``sampling_per_token_logps`` and ``importance_sampling_ratio``; the store
records the sampling log-probs (a late column when they start in the middle
of a run: docs/FORMAT.md, "Late columns"). A replayed row gets its ratio from
its stored behaviour and sampling log-probs with the trainer's
``vllm_importance_sampling_mode`` and clip bounds
(:func:`~diskreplay.integrations.trl.batch.importance_ratio`); a row stored
before sampling log-probs were recorded gets its behaviour log-probs in their
place, so its ratio is exactly 1 (no correction), as TRL does for tokens whose
sampling log-prob vLLM could not give.

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
Every checkpoint carries the replay state (sampler, RNG, the store's row
count, excluded rows; :mod:`.checkpoint`), saved before TRL's own files, and
the store keeps the newest copy. ``train(resume_from_checkpoint=...)``
restores it, so the replay stream continues. Rows the store committed after
that checkpoint were generated by policies the resumed run discards: they
stay in the store (offline replay, exports) but are excluded from replay from
then on; the excluded ranges are saved in the store's ``"trl.replay"`` state
and a warning says how many rows they hold (``trainer.excluded_rows``, the
``replay/excluded_rows`` metric). The ``diskreplay`` exports, pairs, best-of-n
sets and ``info`` leave them out too unless told to include them
(``--include-excluded``).

With several processes each process writes its own store,
``<replay_store_path>/rank-<i>``, and replays from it; with ``replay_append``
every process appends as many rows as the one that drew the fewest (TRL
gathers per-row tensors across processes). Tested with TRL 1.16.0 and
transformers 5.24.0, in one process and in two (torchrun, gloo, CPU; text
models; multimodal batches can be stored in ``off`` mode only).

:class:`DurableRolloutQueue` (:mod:`.async_buffer`) is the rollout buffer of TRL's
``AsyncGRPOTrainer`` in a store: rollouts committed once, consumed once across
a trainer's kill and resume (docs/integrations.md).

The package: :mod:`.config` (the options and their checks),
:mod:`.planners` (which rows to replay: pure numpy over the store's public
API, no TRL), :mod:`.rewards` (TRL's reward rules in numpy),
:mod:`.checkpoint` (the replay state), :mod:`.batch` (tensor work on TRL's
batch) and :mod:`.trainer`. Importing ``planners``, ``rewards`` or
``checkpoint`` does not import TRL; the config and trainer do.

>>> from diskreplay.integrations.trl import DiskReplayGRPOConfig
>>> DiskReplayGRPOConfig(output_dir="/tmp/x", replay_mode="repo", replay_k=2, num_generations=4,
...                      per_device_train_batch_size=8, use_cpu=True, report_to=[]).replay_k
2
"""

import importlib
from typing import Any

from ...errors import IntegrationError, ReplayConfigError
from .checkpoint import CHECKPOINT_DIR, STATE_NAME
from .planners import REPLAY_MODES, prompt_key

_LAZY = {
    "DurableRolloutQueue": "async_buffer",
    "DiskReplayGRPOConfig": "config",
    "DiskReplayGRPOTrainer": "trainer",
}

__all__ = ["CHECKPOINT_DIR", "DiskReplayGRPOConfig", "DiskReplayGRPOTrainer", "DurableRolloutQueue", "IntegrationError",
           "REPLAY_MODES", "ReplayConfigError", "STATE_NAME", "prompt_key"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
