"""Samplers: which rows of a store to train on next.

A sampler is a small object holding an RNG and a little bookkeeping (cursor,
priorities, sample counts). ``sampler.sample(store, batch_size, ...)`` returns
an int64 array of global row ids; the caller reads them with ``store.read``.
Sampling never writes to the store. ``state_dict()`` / ``load_state_dict()``
carry everything that decides the future stream (JSON values and numpy arrays
only, no pickle), so ``store.save_state(name, sampler.state_dict())`` and a
restart resume exactly the same stream; a pickled or deep-copied sampler
continues it too.

- :class:`PromptGroupSampler` draws whole prompt groups (GRPO, RLOO, DAPO,
  RePO): ``num_groups`` groups of ``samples_per_group`` rows, laid out group by
  group, with a within-group strategy (``random``, ``recency``, ``reward``,
  ``variance``).
- :class:`RandomSampler` draws single rows: passes without replacement, or
  uniform with replacement.
- :class:`PrioritizedSampler` draws single rows with probability
  ``(|priority| + eps) ** alpha`` (SSR), on a :class:`SumTree`.

Every sampler takes ``rank`` / ``world_size``: ranks that share the seed, the
settings and the store generation draw disjoint slices of one global batch
(:func:`agree_generation` makes them share the generation).

Every ``sample()`` also takes ``min_policy_version=`` (rows of older
policies are never drawn), ``exclude=`` (row-id ranges ``[(start, stop), ...]``
never drawn, e.g. rows of a discarded timeline) and ``min_row=`` (rows below
it are never drawn: a window of the newest rows); ``sampler.eligible(store,
...)`` gives the same rule as a mask over the live rows.

Everything that depends on the store is canonical (rows in id order, groups
ordered by their oldest live row), so a store reopened in another process, even
after eviction renumbered its internal group codes, yields the same stream.

The modules: ``base`` (checks, settings, the state envelope), ``group``,
``uniform``, ``prioritized`` (one sampler each), ``kernels`` (pure array code:
reward scalars, group spread, variance ranking, the sum tree) and
``distributed`` (agreeing on a generation across ranks).
"""

from .._moved import moved
from ..errors import ReplacementWarning, SamplerError, SettingError
from .base import STATE_FORMAT, STATE_VERSION, LiveRows, Sampler, live_column
from .distributed import agree_generation
from .group import STRATEGIES, PromptGroupSampler
from .kernels import (Ranges, SumTree, changed_ranges, group_spread, in_ranges, merge_ranges, reward_scalar,
                      variance_ranking)
from .prioritized import PrioritizedSampler
from .uniform import RandomSampler


__all__ = ["LiveRows", "PrioritizedSampler", "PromptGroupSampler", "RandomSampler", "Ranges", "ReplacementWarning",
           "Sampler", "SamplerError", "SettingError", "STATE_FORMAT", "STATE_VERSION", "STRATEGIES", "SumTree",
           "agree_generation", "changed_ranges", "group_spread", "in_ranges", "live_column", "merge_ranges",
           "reward_scalar", "variance_ranking"]


# the private name of the single-module version
__getattr__ = moved(__name__, {"_variance_ranking": "diskreplay.samplers:variance_ranking"})
