"""Tensor work on TRL's padded batch: the rows to record, and the batch with replayed rows mixed in.

TRL's layout: ``prompt_ids``/``prompt_mask`` left-padded; ``completion_ids``,
``completion_mask`` and the per-token columns right-padded; one value per row
for ``advantages`` (and a per-token or per-sequence ``importance_sampling_ratio``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import numpy as np
import torch

from ...errors import ReplayConfigError
from .planners import GROUP_KEY, VERSION_KEY, ReplayPlan, prompt_key

__all__ = ["COMPLETION_SIDE", "KNOWN_KEYS", "OPTIONAL_KEYS", "PROMPT_SIDE", "TRUNCATED", "assemble", "content_mask",
           "importance_ratio", "prompt_keys", "record", "sampling_logps_or_old"]

PROMPT_SIDE = ("prompt_ids", "prompt_mask")
COMPLETION_SIDE = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
                   "sampling_per_token_logps", "tool_mask")
OPTIONAL_KEYS = ("ref_per_token_logps", "sampling_per_token_logps", "tool_mask", "importance_sampling_ratio")
KNOWN_KEYS = frozenset(PROMPT_SIDE + COMPLETION_SIDE + ("advantages", "num_items_in_batch",
                                                        "importance_sampling_ratio"))


def prompt_keys(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> np.ndarray:
    """:func:`~.planners.prompt_key` of every row of a left-padded prompt batch.

    >>> ids = torch.tensor([[0, 5, 6], [5, 6, 7]]); mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    >>> prompt_keys(ids, mask).tolist() == [prompt_key([5, 6]), prompt_key([5, 6, 7])]
    True
    """
    ids = prompt_ids.detach().cpu().numpy()
    mask = prompt_mask.detach().cpu().numpy().astype(bool)
    return np.array([prompt_key(ids[i][mask[i]]) for i in range(len(ids))], dtype=np.int64)


def sequence_ratio(ratio: torch.Tensor, mode: str) -> bool:
    """Whether TRL's importance-sampling ratio holds one value per row (``sequence_*`` modes)."""
    return ratio.dim() == 2 and ratio.shape[1] == 1 and mode.startswith("sequence")


TRUNCATED = "completion_truncated"  # 1.0: TRL masked the whole completion out of the loss (truncated)


def content_mask(completion_ids: torch.Tensor, completion_mask: torch.Tensor, truncated: torch.Tensor,
                 pad_token_id: int) -> torch.Tensor:
    """``completion_mask`` with the rows of ``truncated`` covering their tokens (up to the last that is
    not padding), so that the store keeps what was generated. With ``mask_truncated_completions``,
    TRL zeroes the whole loss mask of a completion that hit ``max_completion_length`` without an
    EOS: the mask then says nothing of its tokens (such a row's mask sums to 0, an EOS-only
    completion's to 1).

    >>> ids = torch.tensor([[5, 6, 1, 0], [7, 8, 9, 0]]); mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    >>> content_mask(ids, mask, torch.tensor([0.0, 1.0]), 0).tolist()
    [[1, 1, 1, 0], [1, 1, 1, 0]]
    """
    pos = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    length = torch.where(completion_ids != pad_token_id, pos + 1, 0).max(dim=1).values
    content = (pos[None, :] < length[:, None]).to(completion_mask.dtype)
    return torch.where(truncated.to(torch.bool)[:, None], content, completion_mask)


def record(out: Dict[str, Any], keys: np.ndarray, rewards: np.ndarray, rewards_per_func: np.ndarray,
           old: Optional[torch.Tensor], step: int, ratio_mode: str,
           truncated: Optional[torch.Tensor] = None, pad_token_id: int = 0) -> Dict[str, Any]:
    """The ``store.extend`` batch of the fresh rows (the store strips the padding with the masks).

    ``truncated`` (1.0 per row whose loss mask TRL zeroed, 0.0 for the others; None: not recorded):
    those rows are stored with their tokens (:func:`content_mask`) and ``completion_truncated`` says
    which they are, so that a replay masks them out of the loss again."""
    n = len(keys)
    mask = out["completion_mask"]
    if truncated is not None:
        mask = content_mask(out["completion_ids"], mask, truncated, pad_token_id)
    rec: Dict[str, Any] = {
        "prompt_ids": out["prompt_ids"], "prompt_mask": out["prompt_mask"],
        "completion_ids": out["completion_ids"], "completion_mask": mask,
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
        rec["importance_sampling_ratio"] = ratio[:, 0] if sequence_ratio(ratio, ratio_mode) else ratio
    if truncated is not None:
        rec[TRUNCATED] = truncated.detach().cpu().float()
    return rec


def sampling_logps_or_old(replay: Dict[str, Any]) -> torch.Tensor:
    """The replayed rows' stored sampling log-probs (collated), their old log-probs where a row has none.

    ``sampling_per_token_logps`` often starts to be recorded in the middle of a
    run (a late column): rows stored before it read "not computed" (the whole
    column ``None``, or ``False`` in ``sampling_per_token_logps_present``).
    Such a row gets its behaviour log-probs, so its importance ratio is exactly
    1 (no correction), as TRL does for tokens whose sampling log-prob vLLM
    could not give.

    >>> old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    >>> r = {"old_per_token_logps": old, "sampling_per_token_logps": torch.tensor([[-1.5, -2.5], [0.0, 0.0]]),
    ...      "sampling_per_token_logps_present": torch.tensor([True, False])}
    >>> sampling_logps_or_old(r).tolist()
    [[-1.5, -2.5], [-0.5, 0.0]]
    """
    old = replay["old_per_token_logps"]
    sampling = replay.get("sampling_per_token_logps")
    if sampling is None:
        return old.clone()
    present = replay.get("sampling_per_token_logps_present")
    if present is None:
        return sampling
    return torch.where(present.to(sampling.device)[:, None], sampling, old.to(sampling.dtype))


def importance_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str,
                     clip_min: Optional[float], clip_max: Optional[float]) -> torch.Tensor:
    """The vLLM importance-sampling correction of rows with behaviour (``old``) and sampling log-probs.

    ``mode`` is TRL's ``vllm_importance_sampling_mode``: ``token_*`` gives a
    ratio per token ([B, T]), ``sequence_*`` one per row ([B, 1], from the sum
    of the masked log-prob differences); ``*_truncate`` clamps it to
    ``[clip_min, clip_max]``, ``*_mask`` sets it to 0 outside that range. A
    NaN difference counts as 0 (ratio 1).

    >>> old, s = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -1.0]])
    >>> importance_ratio(old, s, torch.ones(1, 2), "token_truncate", None, 2.0).tolist()
    [[2.0, 1.0]]
    >>> importance_ratio(old, s, torch.ones(1, 2), "sequence_mask", None, 2.0).tolist()
    [[0.0]]
    """
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(min=lo, max=hi)
    if mode.endswith("mask"):
        return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    raise ReplayConfigError(f"vllm_importance_sampling_mode={mode!r} is not one diskreplay knows (token_truncate, "
                     "token_mask, sequence_truncate, sequence_mask)")


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


def assemble(out: Dict[str, Any], old: Optional[torch.Tensor], replay: Dict[str, Any], plan: ReplayPlan,
             pad_token_id: int, pad_to_multiple_of: Optional[int], ratio_mode: str) -> Dict[str, Any]:
    """TRL's batch ``out`` with ``plan``'s rows (collated in ``replay``) swapped in or appended.

    Every tensor keeps its dtype and device; widths grow to the longest row,
    rounded up to ``pad_to_multiple_of``. ``num_items_in_batch`` is left for
    the caller to recount.
    """
    device = out["prompt_ids"].device
    fresh = dict(out)
    if fresh.get("old_per_token_logps") is None:
        fresh["old_per_token_logps"] = old  # replayed rows need theirs, so every row gets one
    multiple = pad_to_multiple_of if isinstance(pad_to_multiple_of, int) else None
    widths = {True: _round_up(max(fresh["prompt_ids"].shape[1], replay["prompt_ids"].shape[1]), multiple),
              False: _round_up(max(fresh["completion_ids"].shape[1], replay["completion_ids"].shape[1]),
                               multiple)}
    n_fresh, n = out["prompt_ids"].shape[0], len(plan.rows)
    if plan.positions is None:
        index = torch.arange(n_fresh + n)
    else:
        index = torch.arange(n_fresh)
        index[torch.from_numpy(plan.positions)] = n_fresh + torch.arange(n)
    index = index.to(device)
    ratio = out.get("importance_sampling_ratio")
    token_ratio = ratio is not None and not sequence_ratio(ratio, ratio_mode)
    result: Dict[str, Any] = {}
    for key, f in fresh.items():
        if f is None or key == "num_items_in_batch" or not isinstance(f, torch.Tensor):
            result[key] = f
            continue
        r = replay[key].to(device=device, dtype=f.dtype)
        if key in PROMPT_SIDE or key in COMPLETION_SIDE or (key == "importance_sampling_ratio" and token_ratio):
            left = key in PROMPT_SIDE
            value = pad_token_id if key in ("prompt_ids", "completion_ids") else (1 if key == "tool_mask" else 0)
            f, r = _pad(f, widths[left], left, value), _pad(r, widths[left], left, value)
        elif f.dim() == 2 and r.dim() == 1:  # a sequence-level ratio is stored as one value per row
            r = r[:, None]
        result[key] = torch.cat([f, r])[index]
    return result
