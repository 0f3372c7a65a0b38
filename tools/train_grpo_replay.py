"""Train a tiny GRPO policy on CPU with replay from disk, and watch the replay work.

Builds a 2-layer Qwen2 from a config and a character tokenizer in code (nothing
is downloaded), rewards completions for their share of lowercase letters, and
trains with ``DiskReplayGRPOTrainer``. Every generated row is written to a
``ReplayStore``; per step the script prints the fresh reward, the share of the
loss batch that was replayed from disk and how many optimizer steps old those
rows are.

    python tools/train_grpo_replay.py                      # RePO, 60 steps, under a minute on 2 cores
    python tools/train_grpo_replay.py --mode ssr --steps 40
    python tools/train_grpo_replay.py --mode repo_any --steps 20   # stored groups of any prompt
    python tools/train_grpo_replay.py --mode swap_zero_std --store /tmp/replay --resume

Run it twice with the same ``--store`` and ``--resume`` to continue from the
last checkpoint: the store and the sampler pick up where they stopped. The
first run with ``--resume`` finds no checkpoint and starts fresh. Rows a
killed run wrote after its last checkpoint stay in the store but are never
replayed (the script prints how many).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM

# torch, transformers, TRL and diskreplay load in the functions that use them, after the arguments
# are parsed: --help and a bad value answer in a second instead of after the imports (tens of seconds)

PROMPTS = ["Write: ", "Say something: ", "Reply in lowercase: ", "Go! ", "Text: ", "const: "]


def build_model(vocab_size: int, seed: int) -> Qwen2ForCausalLM:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        tie_word_embeddings=False))


def lowercase_share(prompts, completions, **kwargs):
    """Share of lowercase letters; the 'const' prompt always gets 1.0 (a zero-spread group to swap out)."""
    return [1.0 if p.startswith("const") else sum(ch.islower() for ch in c) / max(len(c), 1)
            for p, c in zip(prompts, completions)]


def print_replay() -> Any:
    """A TrainerCallback that prints one line per generation from ``trainer.replay_history``."""
    from transformers import TrainerCallback

    class PrintReplay(TrainerCallback):
        """Prints one line per generation from ``trainer.replay_history``."""

        def __init__(self) -> None:
            self.trainer = None
            self.printed = 0
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            history = list(self.trainer.replay_history)
            for h in history[self.printed:]:
                lag = "-" if h["replayed_rows"].size == 0 else f"{h['policy_lag_mean']:.2f}"
                print(f"{h['global_step']:>5} {h['reward_mean']:>8.3f} {h['replay_fraction']:>9.0%} {lag:>6} "
                      f"{h['batch_size']:>6} {h['store_rows']:>8} {time.perf_counter() - self.start:>7.1f}s")
            self.printed = len(history)
            return control

    return PrintReplay()


def _number(kind: type, least: float, most: float, what: str) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` in [least, most] (a usage error, exit status 2, otherwise)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


def _batch_size(text: str) -> int:
    value = _number(int, 4, float("inf"), "a positive multiple of 4 (the group size)")(text)
    if value % 4:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 4 (the group size), got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _number(float, 0.0, 1.0, "a share in (0, 1]")(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a share in (0, 1], got {text!r}")
    return value


def main() -> None:
    positive = _number(int, 1, float("inf"), "a positive integer")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="repo", choices=["off", "repo", "repo_any", "ssr", "swap_zero_std"],
                   help="replay_mode: off (rows stored, none replayed), repo (past generations of the same "
                        "prompts), repo_any (stored groups of any prompt), ssr (rows by |advantage| priority), "
                        "swap_zero_std (zero-reward-spread groups replaced by stored groups with spread) "
                        "(default: %(default)s)")
    p.add_argument("--steps", type=positive, default=60, metavar="N",
                   help="optimizer steps, max_steps (default: %(default)s)")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="replay store directory (default: a new temporary one)")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="checkpoints (default: checkpoints/ beside the store)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the last checkpoint in --output-dir (start fresh if there is none; "
                        "default: start fresh)")
    p.add_argument("--save-steps", type=positive, default=10, metavar="N",
                   help="checkpoint every N steps (default: %(default)s)")
    p.add_argument("--batch-size", type=_batch_size, default=16, metavar="N",
                   help="rows per step, a multiple of 4, the group size (default: %(default)s)")
    p.add_argument("--k", type=positive, default=2, metavar="N",
                   help="repo, repo_any: stored rows replayed per group, at most 4 (default: %(default)s)")
    p.add_argument("--strategy", default=None, choices=["random", "recency", "reward", "variance"],
                   help="replay_strategy, which rows of a stored group to replay (default: recency for repo and "
                        "repo_any, variance for swap_zero_std)")
    p.add_argument("--fraction", type=_fraction, default=0.25,
                   metavar="F", help="ssr: replayed share of the batch, in (0, 1] (default: %(default)s)")
    p.add_argument("--max-lag", type=_number(int, 0, float("inf"), "an integer >= 0"), default=8, metavar="N",
                   help="never replay rows older than N optimizer steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the model's weights and of training (default: %(default)s)")
    a = p.parse_args()

    from datasets import Dataset
    from transformers import PrinterCallback
    from transformers.trainer_utils import get_last_checkpoint
    from transformers.utils import logging as hf_logging

    from diskreplay import ReplayStore
    from diskreplay.integrations.trl import DiskReplayGRPOConfig, DiskReplayGRPOTrainer
    from diskreplay.synthetic import char_tokenizer

    warnings.filterwarnings("ignore")
    hf_logging.disable_progress_bar()
    root = a.store and os.path.dirname(os.path.abspath(a.store)) or tempfile.mkdtemp(prefix="grpo-replay-")
    store_path = a.store or os.path.join(root, "replay")
    output_dir = a.output_dir or os.path.join(root, "checkpoints")
    tokenizer = char_tokenizer()
    args = DiskReplayGRPOConfig(
        output_dir=output_dir, replay_store_path=store_path, replay_mode=a.mode, replay_k=a.k,
        replay_strategy=a.strategy, ssr_replay_fraction=a.fraction, ssr_capacity_scalar=8,
        max_policy_lag=a.max_lag, per_device_train_batch_size=a.batch_size, num_generations=4, max_completion_length=16,
        max_steps=a.steps, learning_rate=3e-3, temperature=1.0, beta=0.0, report_to=[], use_cpu=True,
        bf16=False, fp16=False, logging_steps=1, disable_tqdm=True, log_level="error", seed=a.seed,
        save_strategy="steps", save_steps=a.save_steps)
    printer = print_replay()
    trainer = DiskReplayGRPOTrainer(model=build_model(len(tokenizer), a.seed), reward_funcs=lowercase_share,
                                    args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
                                    processing_class=tokenizer, callbacks=[printer])
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts; PrintReplay prints a table instead
    printer.trainer = trainer
    print(f"replay_mode={a.mode}  store={store_path}")
    # TRL's resume_from_checkpoint=True fails when there is no checkpoint yet; a first run starts fresh
    checkpoint = get_last_checkpoint(output_dir) if a.resume and os.path.isdir(output_dir) else None
    if a.resume:
        print(f"resuming from {checkpoint}" if checkpoint else f"no checkpoint in {output_dir}: starting fresh")
    print(f"{'step':>5} {'reward':>8} {'replayed':>9} {'lag':>6} {'batch':>6} {'stored':>8} {'time':>8}")
    trainer.train(resume_from_checkpoint=checkpoint)
    if trainer.excluded_rows:
        print(f"{trainer.excluded_rows} stored rows were written after the checkpoint by the run that stopped; "
              "they stay in the store and are never replayed")
    with ReplayStore(store_path, readonly=True) as store:
        print(f"done: {len(store)} rows, {store.num_groups} prompt groups, {store.nbytes / 1024:.0f} KiB on disk "
              f"at {store.path}")


if __name__ == "__main__":
    main()
