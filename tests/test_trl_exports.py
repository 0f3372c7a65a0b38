"""TRL's own SFTTrainer and DPOTrainer on `best-of-n` and `pairs` exports made as docs/cli.md shows them.

Real trainers, two steps each on CPU: a 2-layer Qwen2 and a whitespace word tokenizer that adds a BOS,
both built in code (nothing downloaded). The checks are on what reached the loss: the labels (-100 on
every prompt token, the stored ids on every completion token) and the ids TRL tokenized from the text
columns (the stored ids, or the export says how many rows cannot give them back).
"""

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference  # noqa: E402

from diskreplay import ReplayStore  # noqa: E402
from diskreplay.cli import main  # noqa: E402
from diskreplay.export import best_of_n, export_jsonl, preference_pairs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAD, EOS, BOS, UNK = 0, 1, 2, 3
WORDS = 40  # w0..w39 are ids 4..43


def word_tokenizer(directory=None):
    """Whitespace-split words, joined by spaces on decode; encoding adds a BOS, as Llama's does."""
    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, "<unk>": UNK, **{f"w{i}": i + 4 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>", "<unk>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")
    if directory is not None:
        fast.save_pretrained(directory)
    return fast


def tiny_model(vocab):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def make_store(path):
    """Four prompts of four completions each, as a GRPO run stores them: the prompt starts with the
    BOS the policy's tokenizer put there, a completion ends with the EOS that stopped it."""
    rng = np.random.default_rng(0)
    batch = {"prompt_id": [], "prompt_ids": [], "completion_ids": [], "rewards": [], "policy_version": []}
    for p in range(4):
        prompt = [BOS] + (4 + rng.integers(0, WORDS, 3 + p)).tolist()
        for c in range(4):
            batch["prompt_id"].append(p)
            batch["prompt_ids"].append(prompt)
            batch["completion_ids"].append((4 + rng.integers(0, WORDS, 2 + c)).tolist() + [EOS])
            batch["rewards"].append([0.0, 1.0, 0.25, 1.0][(p + c) % 4])
            batch["policy_version"].append(c // 2)
    batch["rewards"] = np.array(batch["rewards"], np.float32)
    with ReplayStore(path, group_key="prompt_id") as s:
        s.extend(batch)
        data = s.read(s.row_ids(), ["prompt_ids", "completion_ids"])
        return [(data["prompt_ids"][i].tolist(), data["completion_ids"][i].tolist()) for i in range(len(s))]


def docs_commands(command):
    """The ``diskreplay COMMAND`` lines of docs/cli.md's command block, as written."""
    text = (ROOT / "docs" / "cli.md").read_text()
    block = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0]
    lines = [line.split("#")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(f"diskreplay {command} ")]


def run_docs_command(argv, cwd, monkeypatch):
    """The command run in ``cwd`` by the CLI's entry point (in this process: no second torch import)."""
    monkeypatch.chdir(cwd)
    assert main(argv[1:]) == 0, argv


def load_export(path):
    """An export as docs/cli.md says to hand it to a trainer."""
    kind = "parquet" if path.endswith(".parquet") else "json"
    return load_dataset(kind, data_files=path, split="train")


@pytest.fixture()
def docs_dir(tmp_path):
    """A directory holding what docs/cli.md's lines name: runs/grpo/replay and ./tokenizer."""
    rows = make_store(str(tmp_path / "runs" / "grpo" / "replay"))
    word_tokenizer(str(tmp_path / "tokenizer"))
    return tmp_path, rows


class LabelProbe(SFTTrainer):
    """Keeps the ids and labels of every batch the loss sees."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append((inputs["input_ids"].clone(), inputs["labels"].clone(), inputs["attention_mask"].clone()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def train_args(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
               report_to=[], use_cpu=True, bf16=False, fp16=False, save_strategy="no", logging_steps=1,
               disable_tqdm=True, seed=0, **kw)


def test_best_of_n_as_docs_show_it_trains_sft_trainer_on_the_completion_only(docs_dir, monkeypatch):
    """`best-of-n` without --tokenizer gave input_ids with a completion_mask, which SFTTrainer's
    defaults ignore (completion_only_loss is only on for prompt/completion columns): every prompt
    token was trained on. Each docs/cli.md best-of-n line, its output loaded with `load_dataset` and
    handed to SFTTrainer with default settings, must put -100 on every prompt token and the stored
    ids on every completion token (a --tokenizer line: TRL tokenizes the text back to those ids)."""
    tmp_path, rows = docs_dir
    by_ids = {tuple(p + c): len(p) for p, c in rows}
    tok = word_tokenizer()
    commands = docs_commands("best-of-n")
    assert commands and any("--tokenizer" not in argv for argv in commands)
    for argv in commands:
        run_docs_command(argv, tmp_path, monkeypatch)
        ds = load_export(str(tmp_path / argv[3]))
        assert len(ds) >= 2, argv
        trainer = LabelProbe(model=tiny_model(len(tok)), args=train_args(SFTConfig, tmp_path),
                             train_dataset=ds, processing_class=tok)
        trainer.train()
        assert len(trainer.seen) == 2, argv
        checked = 0
        for ids, labels, mask in trainer.seen:
            for i in range(len(ids)):
                n = int(mask[i].sum())
                seq = ids[i, :n].tolist()
                assert tuple(seq) in by_ids, (argv, "TRL trained on ids no stored row holds", seq)
                plen = by_ids[tuple(seq)]
                assert labels[i, :plen].tolist() == [-100] * plen, (argv, "a prompt token is in the loss")
                assert labels[i, plen:n].tolist() == seq[plen:], (argv, "a completion token is not")
                checked += 1
        assert checked == 4


def test_pairs_as_docs_show_them_train_dpo_trainer_on_the_stored_ids(docs_dir, monkeypatch):
    """`pairs` without --tokenizer (docs/cli.md's --version-window line) wrote prompt_ids/chosen_ids/
    rejected_ids, which DPOTrainer refuses (KeyError: 'chosen' in extract_prompt); with --tokenizer the
    text glued prompt and completion into one unknown word and doubled the BOS. Every docs/cli.md
    pairs line must train DPOTrainer two steps as is, on the stored ids."""
    tmp_path, rows = docs_dir
    tok = word_tokenizer()
    commands = docs_commands("pairs")
    assert len(commands) >= 2
    for argv in commands:
        run_docs_command(argv, tmp_path, monkeypatch)
        ds = load_export(str(tmp_path / argv[3]))
        assert len(ds) >= 1, argv
        trainer = DPOTrainer(model=tiny_model(len(tok)), ref_model=tiny_model(len(tok)),
                             args=train_args(DPOConfig, tmp_path), train_dataset=ds, processing_class=tok)
        tokenized = trainer.train_dataset
        for k in range(len(ds)):
            chosen, rejected = rows[ds[k]["chosen_row"]], rows[ds[k]["rejected_row"]]
            assert tokenized[k]["prompt_ids"] == chosen[0], argv
            assert (tokenized[k]["chosen_ids"], tokenized[k]["rejected_ids"]) == (chosen[1], rejected[1]), argv
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 2 and all(np.isfinite(losses)), argv
    # the ids layout (no --tokenizer) is for TRL's DataCollatorForPreference in a loop of one's own, as
    # docs/cli.md says: prompt+chosen and prompt+rejected, the completion mask on the stored ids
    res = preference_pairs(str(tmp_path / "runs" / "grpo" / "replay"), str(tmp_path / "ids.jsonl"))
    ds = load_export(res["path"])
    batch = DataCollatorForPreference(pad_token_id=PAD)([ds[k] for k in range(len(ds))])
    n = len(ds)
    for k in range(n):
        p, c = rows[ds[k]["chosen_row"]]
        _, r = rows[ds[k]["rejected_row"]]
        for seq, half in ((p + c, k), (p + r, n + k)):
            length = int(batch["attention_mask"][half].sum())
            assert batch["input_ids"][half, :length].tolist() == seq
            assert batch["completion_mask"][half, :length].tolist() == [0] * len(p) + [1] * (length - len(p))


def retokenized(tok, prompt, completion):
    """The ids TRL's trainers make of a prompt/completion text row: the prompt alone, and prompt + completion."""
    return tok(prompt)["input_ids"], tok(prompt + completion)["input_ids"]


def test_text_exports_tokenize_back_to_the_stored_ids(tmp_path):
    """Text exports kept special tokens and decoded prompt and completion apart: "<bos> w3 w7" and
    "w1 w2 <eos>", which tokenize (BOS added again, "w7w1" one unknown word) to other ids than the
    store's. Every text column of export, pairs and best-of-n must tokenize back to the stored ids."""
    store = str(tmp_path / "s")
    rows = make_store(store)
    tok = word_tokenizer(str(tmp_path / "tok"))
    res = export_jsonl(store, str(tmp_path / "e.jsonl"), tokenizer=str(tmp_path / "tok"))
    assert res.get("retokenize_mismatches", 0) == 0 and not res.get("warnings")
    for i, line in enumerate(open(tmp_path / "e.jsonl")):
        row = json.loads(line)
        p, c = rows[i]
        assert retokenized(tok, row["prompt"], row["completion"]) == (p, p + c)
    res = preference_pairs(store, str(tmp_path / "p.jsonl"), tokenizer=str(tmp_path / "tok"))
    assert res["pairs"] > 0 and res["retokenize_mismatches"] == 0
    for line in open(tmp_path / "p.jsonl"):
        row = json.loads(line)
        (p, c), (_, r) = rows[row["chosen_row"]], rows[row["rejected_row"]]
        assert retokenized(tok, row["prompt"], row["chosen"]) == (p, p + c)
        assert retokenized(tok, row["prompt"], row["rejected"]) == (p, p + r)
    res = best_of_n(store, str(tmp_path / "b.jsonl"), k=2, tokenizer=str(tmp_path / "tok"))
    assert res["rows"] == 8 and res["retokenize_mismatches"] == 0
    for line in open(tmp_path / "b.jsonl"):
        row = json.loads(line)
        p, c = rows[row["row"]]
        assert retokenized(tok, row["prompt"], row["completion"]) == (p, p + c)


def merging_tokenizer():
    """A BPE that merges "a b" into "ab": ids [a, b] (which a policy may sample) have no text that
    tokenizes back to them."""
    tok = Tokenizer(models.BPE({"<eos>": 0, "a": 1, "b": 2, "ab": 3, "c": 4}, [("a", "b")]))
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def test_rows_whose_text_cannot_give_back_their_ids_are_counted_and_named(tmp_path, capsys):
    """Where the tokenizer cannot give the ids back (a non-canonical split the policy sampled), the
    export says how many rows, and which, instead of handing TRL other tokens unannounced."""
    store = str(tmp_path / "s")
    with ReplayStore(store, group_key="prompt_id") as s:
        s.extend({"prompt_id": [0, 0, 0], "prompt_ids": [[4], [4], [4]],
                  "completion_ids": [[3, 0], [1, 2, 0], [4, 1, 2]],  # "ab", "a"+"b", "c"+"a"+"b"
                  "rewards": np.array([1.0, 0.5, 0.0], np.float32)})
    tok = merging_tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))
    res = export_jsonl(store, str(tmp_path / "e.jsonl"), tokenizer=str(tmp_path / "tok"))
    assert res["retokenize_mismatches"] == 2
    assert any("2 of 3 rows" in w and "row 1" in w for w in res["warnings"]), res["warnings"]
    res = best_of_n(store, str(tmp_path / "b.jsonl"), k=3, tokenizer=str(tmp_path / "tok"))
    assert res["retokenize_mismatches"] == 2 and res["warnings"]
    assert main(["pairs", store, str(tmp_path / "p.jsonl"), "--tokenizer", str(tmp_path / "tok")]) == 0
    out = capsys.readouterr().out
    assert "warning: 1 of 1 pairs" in out, out
