"""Synthetic GRPO rollouts for the demo, the benchmarks and the tests.

The shape follows what a GRPO step produces: ``group_size`` completions per
prompt, prompt lengths log-normal around 256 tokens clipped to [16, 1024],
completion lengths log-normal around 600 clipped to [1, 4096], token ids in
[0, 151936), float32 old/ref log-probs per completion token, one reward and
one advantage per row (advantages are group-normalised rewards).

:func:`char_tokenizer` is the tiny tokenizer the TRL tests and the example
trainer build in code (nothing is downloaded).
"""

from __future__ import annotations

from typing import Dict, Iterator

import numpy as np
from .errors import ArgumentError

VOCAB = 151936


def _lognormal_lengths(rng: np.random.Generator, n: int, mean: float, lo: int, hi: int) -> np.ndarray:
    sigma = 0.6
    mu = np.log(mean) - sigma ** 2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, hi).astype(np.int64)


def make_rollouts(num_groups: int, group_size: int = 8, *, seed: int = 0, first_group: int = 0,
                  policy_version: int = 0, prompt_mean: float = 256, completion_mean: float = 600,
                  layout: str = "ragged") -> Dict[str, object]:
    """One batch of ``num_groups * group_size`` synthetic rollouts.

    ``layout="ragged"`` gives lists of 1-D numpy arrays; ``layout="trl"`` gives
    TRL's padded torch tensors with masks.

    >>> b = make_rollouts(2, 4, seed=1)
    >>> len(b["completion_ids"]), b["prompt_id"].tolist()
    (8, [0, 0, 0, 0, 1, 1, 1, 1])
    """
    rng = np.random.default_rng(seed)
    n = num_groups * group_size
    p_len = np.repeat(_lognormal_lengths(rng, num_groups, prompt_mean, 16, 1024), group_size)
    c_len = _lognormal_lengths(rng, n, completion_mean, 1, 4096)
    p_off = np.concatenate([[0], np.cumsum(p_len)])
    c_off = np.concatenate([[0], np.cumsum(c_len)])
    prompt_tokens = rng.integers(0, VOCAB, int(p_off[-1]), dtype=np.int32)
    # the completions of one group share their prompt
    for g in range(num_groups):
        s = g * group_size
        prompt_tokens[p_off[s]:p_off[s + group_size]] = np.tile(prompt_tokens[p_off[s]:p_off[s + 1]], group_size)
    completion_tokens = rng.integers(0, VOCAB, int(c_off[-1]), dtype=np.int32)
    old = -rng.exponential(1.0, int(c_off[-1])).astype(np.float32)
    ref = (old + rng.normal(0, 0.05, int(c_off[-1]))).astype(np.float32)
    rewards = rng.binomial(1, 0.4, n).astype(np.float32)
    grouped = rewards.reshape(num_groups, group_size)
    adv = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-4)).reshape(-1)
    batch: Dict[str, object] = {
        "prompt_id": np.repeat(np.arange(first_group, first_group + num_groups, dtype=np.int64), group_size),
        "policy_version": np.full(n, policy_version, dtype=np.int64),
        "rewards": rewards,
        "advantages": adv.astype(np.float32),
    }
    split = lambda flat, off: [flat[off[i]:off[i + 1]] for i in range(n)]  # noqa: E731
    ragged = {
        "prompt_ids": split(prompt_tokens, p_off),
        "completion_ids": split(completion_tokens, c_off),
        "old_per_token_logps": split(old, c_off),
        "ref_per_token_logps": split(ref, c_off),
    }
    if layout == "ragged":
        batch.update(ragged)
        return batch
    if layout != "trl":
        raise ArgumentError(f"layout must be 'ragged' or 'trl', got {layout!r}")
    import torch

    P, C = int(p_len.max()), int(c_len.max())
    for name, width, left in (("prompt_ids", P, True), ("completion_ids", C, False),
                              ("old_per_token_logps", C, False), ("ref_per_token_logps", C, False)):
        rows = ragged[name]
        out = np.zeros((n, width), dtype=rows[0].dtype)
        mask = np.zeros((n, width), dtype=np.int64)
        for i, r in enumerate(rows):
            if left:
                out[i, width - len(r):] = r
                mask[i, width - len(r):] = 1
            else:
                out[i, :len(r)] = r
                mask[i, :len(r)] = 1
        batch[name] = torch.from_numpy(out)
        if name.endswith("_ids"):
            batch[name[:-4] + "_mask"] = torch.from_numpy(mask)
    for k in ("prompt_id", "policy_version", "rewards", "advantages"):
        batch[k] = torch.from_numpy(np.asarray(batch[k]))
    return batch


def rollout_stream(num_groups: int, groups_per_step: int = 64, group_size: int = 8, *, seed: int = 0,
                   **kwargs) -> Iterator[Dict[str, object]]:
    """Batches of ``groups_per_step`` groups, as a training loop would append them."""
    step = 0
    for first in range(0, num_groups, groups_per_step):
        yield make_rollouts(min(groups_per_step, num_groups - first), group_size, seed=seed + step,
                            first_group=first, policy_version=step, **kwargs)
        step += 1


def char_tokenizer() -> object:
    """A character-level ``PreTrainedTokenizerFast`` built in code: ``<pad>`` 0, ``<eos>`` 1,
    ``<bos>`` 2, then printable ASCII (98 entries). Needs ``transformers`` and ``tokenizers``
    (``pip install 'diskreplay[trl]'``).

    >>> tok = char_tokenizer()
    >>> tok("ab")["input_ids"], tok.decode([68, 69]), len(tok)
    ([68, 69], 'ab', 98)
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
