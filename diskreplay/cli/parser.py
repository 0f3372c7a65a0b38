"""The ``diskreplay`` command's argument parser: every command's options, their checks (argparse types:
a bad value is a usage error, exit status 2, before any work) and the combinations refused."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..errors import DiskReplayError
from .common import EXIT_CODES, PROG, package_version
from .exchange import cmd_best_of_n, cmd_export, cmd_import, cmd_pairs
from .rescore import cmd_rescore, meta_object, version_name
from .stores import cmd_compact, cmd_info, cmd_repair, cmd_verify


def _columns(text: str) -> List[str]:
    """``--columns A,B``: the names, none empty and none twice (argparse's type: a usage error)."""
    names = [c.strip() for c in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name; give names separated by commas")
    twice = sorted({c for c in names if names.count(c) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names {', '.join(twice)} twice")
    return names


def number(kind: Callable[[str], Any], least: float, what: str) -> Callable[[str], Any]:
    """An argparse ``type``: a finite number of ``kind`` at least ``least``, else a usage error (exit
    status 2) saying it must be ``what``. The scripts in ``tools/`` take their counts with it too.

    >>> number(int, 1, "a positive integer")("3")
    3
    >>> number(int, 0, "an integer >= 0")("-1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be an integer >= 0, got '-1'
    """
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not least <= value < math.inf:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


_positive_int = number(int, 1, "a positive integer")
_count = number(int, 0, "a non-negative integer")


def _chunk_bytes(text: str) -> int:
    """``--chunk-mb`` as bytes: a positive, finite number of MiB of at least one byte."""
    try:
        mb = float(text)
    except ValueError:
        mb = float("nan")
    if not (0 < mb < float("inf")) or int(mb * (1 << 20)) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of MiB (e.g. 64 or 0.5), got {text!r}")
    return int(mb * (1 << 20))


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _mapping(text: str) -> str:
    """One ``--map NEW=OLD``, checked while the arguments are parsed (exit status 2, before any work)."""
    from ..export.importer import parse_mapping

    try:
        parse_mapping([text])
    except DiskReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _codec(text: str) -> str:
    from ..export.writers import check_compression

    try:
        return check_compression(text)
    except DiskReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _version_range(text: str) -> str:
    """``--policy-versions``, checked while the arguments are parsed (exit status 2, before any work);
    the export parses the same text again."""
    from ..export._common import parse_version_range

    try:
        parse_version_range(text)
    except DiskReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _key_value(text: str) -> Tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. endpoint=http://127.0.0.1:9000), got {text!r}")
    return key.strip(), value


def _column_version(text: str) -> Tuple[str, str]:
    """One ``--version COL=NAME``."""
    column, sep, version = text.partition("=")
    if not sep or not column.strip() or not version.strip():
        raise argparse.ArgumentTypeError(f"expected COLUMN=VERSION (e.g. rewards=judge-v2), got {text!r}")
    return column.strip(), version.strip()


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=100)


def _sub(subs: Any, name: str, func: Callable[[argparse.Namespace], int], help: str, description: str,
         epilog: str, parents: Sequence[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subs.add_parser(name, help=help, description=description, epilog="examples:\n" + epilog,
                        formatter_class=_Formatter, parents=list(parents))
    p.set_defaults(func=func, command=name)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``diskreplay`` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bars (they are shown only when stderr is a terminal anyway)")
    common.add_argument("--json", action="store_true", help="print the result as JSON (for scripts)")
    # PATH may be s3://BUCKET/PREFIX in these commands (the export functions take a store object)
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--storage-option", action="append", type=_key_value, metavar="KEY=VALUE",
                        help="for an s3://BUCKET/PREFIX store: a client setting (endpoint, access_key_id, "
                             "secret_access_key, region, retry_timeout, ...); the AWS_* environment variables "
                             "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) fill in what is not given")

    tok = argparse.ArgumentParser(add_help=False)
    tok.add_argument("--tokenizer", metavar="DIR",
                     help="local tokenizer directory (a saved transformers tokenizer or a tokenizer.json); "
                          "adds decoded text, which the same tokenizer turns back into the stored ids "
                          "(tokenizer(prompt + completion), as TRL's trainers call it; rows where it cannot are "
                          "counted in a warning). Never downloads. e.g. --tokenizer ./Qwen2.5-0.5B")
    tok.add_argument("--skip-special-tokens", action="store_true",
                     help="drop every special token (BOS/EOS, chat markers) from decoded text: text for reading, "
                          "which no longer tokenizes back to the ids (default: keep them, less the ones the "
                          "tokenizer adds itself, such as a BOS)")

    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--overwrite", action="store_true",
                     help="replace OUT if it exists (the old one stays until the new one is complete); a "
                          "directory is replaced only if it is an earlier output of the same kind (or, by a "
                          "directory output such as hf or zarr, empty), and a file only by a file output")
    out.add_argument("--force", action="store_true",
                     help="write the --format asked even when OUT's extension names another format")

    rows = argparse.ArgumentParser(add_help=False)
    rows.add_argument("--policy-versions", metavar="A:B", type=_version_range,
                      help="keep rows whose policy_version is in A..B, inclusive; either end may be left "
                           "open (e.g. 100:, :50, 7)")
    rows.add_argument("--reward-key", default="rewards", metavar="COL",
                      help="reward column (default: rewards); a vector is averaged over reward functions")
    rows.add_argument("--version", action="append", type=_column_version, metavar="COL=NAME",
                      help="use version NAME of column COL (written by 'diskreplay rescore' or update(..., "
                           "version=NAME); 'diskreplay info' lists them) as COL, NaN/null where it has no value, "
                           "in the output and the reward filters (default: the newest values); repeatable, e.g. "
                           "--version rewards=judge-v2")
    rows.add_argument("--include-excluded", action="store_true",
                      help="also use the rows the store records as excluded (default: left out, and counted): "
                           "those a resumed TRL run discarded, committed after the checkpoint it resumed from "
                           "by policies it never had ('diskreplay info' lists them)")

    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=_Formatter,
        description="Inspect, export, import and curate diskreplay rollout stores.",
        epilog="examples:\n"
               "  diskreplay info runs/grpo/replay\n"
               "  diskreplay export runs/grpo/replay rollouts.parquet --format parquet\n"
               "  diskreplay import other_run.jsonl runs/imported --aliases\n"
               "  diskreplay pairs runs/grpo/replay dpo.jsonl --tokenizer ./tokenizer --min-margin 0.5\n"
               "  diskreplay best-of-n runs/grpo/replay sft.jsonl --k 2 --min-reward 1\n"
               "\nrun 'diskreplay COMMAND --help' for the options of a command.\n"
               "Only 'import' creates a store; the other commands refuse a PATH that holds none.\n"
               + EXIT_CODES + ".")
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    subs = parser.add_subparsers(title="commands", metavar="COMMAND")

    p = _sub(subs, "info", cmd_info, "summary of a store",
             "Rows, groups, segments, bytes on disk, bytes per completion token, columns with their\n"
             "kinds and types, reward/advantage statistics (mean/std/min/max over live rows) and the\n"
             "policy-version range. Opens the store read-only; streams it to count tokens.",
             "  diskreplay info runs/grpo/replay\n"
             "  diskreplay info runs/grpo/replay --json | jq .stats.rewards\n" + EXIT_CODES + "\n", [remote, common])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")
    p.add_argument("--include-excluded", action="store_true",
                   help="count the rows the store records as excluded (a resumed TRL run's discarded "
                        "timeline, listed as 'excluded') in the tokens and statistics (default: left out)")

    p = _sub(subs, "export", cmd_export, "export live rows to parquet / jsonl / hf / zarr",
             "Export the live rows of a store, streaming chunk by chunk (memory bounded by ~64 MiB of\n"
             "store data). The output is written under a temporary name beside OUT and renamed at the\n"
             "end: an interrupted export (an error, or Ctrl-C: exit status 130) leaves nothing behind.\n\n"
             "Without --format the format comes from OUT's name: .parquet/.pq parquet, .jsonl/.ndjson/\n"
             ".json jsonl, .zarr zarr, no extension (or an existing directory) hf; any other name needs\n"
             "--format. A --format that contradicts the extension (-f parquet out.jsonl) is refused\n"
             "unless --force; nothing is written compressed, so .gz names are refused too.\n\n"
             "  parquet  one file; token columns large_list<int32>, log-probs large_list<float32>\n"
             "           (null = not computed); readable by pyarrow, polars, duckdb, pandas\n"
             "  jsonl    one JSON object per rollout and line\n"
             "  hf       a Hugging Face datasets directory (datasets.load_from_disk(OUT))\n"
             "  zarr     a Zarr v3 archive (zstd, sharded): flat values + int64 offsets per ragged\n"
             "           column, per-row arrays, the group index, the schema in the attributes\n\n"
             "parquet, hf and zarr exports carry the store's schema: 'diskreplay import' turns them\n"
             "back into an identical store.",
             "  diskreplay export runs/grpo/replay rollouts.parquet\n"
             "  diskreplay export runs/grpo/replay rollouts.jsonl --limit 1000\n"
             "  diskreplay export runs/grpo/replay hf_ds --tokenizer ./tokenizer\n"
             "  diskreplay export runs/grpo/replay late.parquet --policy-versions 200: --min-reward 0.5 \\\n"
             "      --columns prompt_id,completion_ids,rewards\n"
             "  diskreplay export runs/grpo/replay archive.zarr --overwrite\n"
             "  diskreplay export runs/grpo/replay judged.parquet --version rewards=judge-v2\n"
             "  diskreplay export runs/grpo/replay rollouts.txt --format jsonl\n"
             + EXIT_CODES + "\n",
             [remote, common, out, rows, tok])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")
    p.add_argument("out", metavar="OUT", help="output file (parquet, jsonl) or directory (hf, zarr)")
    p.add_argument("--format", "-f", choices=["parquet", "jsonl", "hf", "zarr"],
                   help="output format (default: from OUT's name, see above)")
    p.add_argument("--columns", metavar="A,B,...", type=_columns,
                   help="comma-separated columns to export, in this order (default: all), e.g. "
                        "--columns prompt_id,completion_ids,rewards")
    p.add_argument("--min-reward", type=_finite_float, metavar="R",
                   help="keep rows whose reward is >= R (see --reward-key), e.g. --min-reward 1")
    p.add_argument("--limit", type=_count, metavar="N", help="export at most N rows (the oldest matching ones)")
    p.add_argument("--compression", type=_codec, metavar="CODEC",
                   help="parquet compression: snappy (default), zstd, gzip, brotli, lz4 or none")
    p.add_argument("--chunk-mb", type=_chunk_bytes, default=64 << 20, metavar="MB", dest="chunk_bytes",
                   help="read and write about MB (> 0) of store data at a time: the memory bound and the "
                        "Parquet row-group size (default: 64)")
    p.add_argument("--skip-damaged", action="store_true",
                   help="export the rows of a damaged store that still read and checksum, leaving out every "
                        "segment whose file is missing or fails its CRC-32C (what 'diskreplay repair' would "
                        "drop), each named with its rows on stderr; the store is not changed. Reads every "
                        "segment once more to checksum it (default: a damaged segment fails the export)")

    p = _sub(subs, "import", cmd_import, "build a store from parquet / jsonl / hf / zarr",
             "Build a store at PATH from SRC: a Parquet file (or directory of them), a JSONL rollout\n"
             "dump (.jsonl / .jsonl.gz, one object per line), a Hugging Face dataset saved with\n"
             "save_to_disk, or a Zarr archive written by 'diskreplay export'. Exports of diskreplay\n"
             "restore bit-exactly. Rows are appended in chunks; a new store is built under a temporary\n"
             "name and appears at PATH only when complete.\n\n"
             "Columns become store columns: lists of numbers are per-token (ragged) columns, numbers\n"
             "and strings per-row columns (a list column named *reward* is a per-row vector). Rename\n"
             "other frameworks' names with --map NEW=OLD, or --aliases for the common ones:\n"
             "  prompt_token_ids -> prompt_ids    response_tokens/response_ids -> completion_ids\n"
             "  logprobs -> old_per_token_logps   reward/score -> rewards   step -> policy_version\n"
             "  uid/group_id/prompt_idx -> prompt_id   advantage -> advantages",
             "  diskreplay import rollouts.parquet runs/restored\n"
             "  diskreplay import dump.jsonl runs/imported --map completion_ids=response_tokens \\\n"
             "      --map old_per_token_logps=logprobs --map rewards=reward --map policy_version=step\n"
             "  diskreplay import dump.jsonl.gz runs/imported --aliases --group-key prompt --skip-bad\n"
             "  diskreplay import hf_ds runs/restored --format hf\n"
             "  diskreplay import more.parquet runs/restored --append\n"
             "  diskreplay import runs/other_run/replay runs/merged --append --fill-missing\n"
             "  diskreplay import more.parquet runs/capped --append --allow-evict\n"
             + EXIT_CODES + "\n", [remote, common])
    p.add_argument("src", metavar="SRC", help="source file or directory")
    p.add_argument("path", metavar="PATH", help="store directory to create (or s3://BUCKET/PREFIX)")
    p.add_argument("--format", "-f", choices=["auto", "parquet", "jsonl", "hf", "zarr", "store"], default="auto",
                   help="source format (default: auto, from the layout, name or first bytes); 'store' copies "
                        "another diskreplay store (with --append: merges it)")
    p.add_argument("--map", action="append", metavar="NEW=OLD", type=_mapping,
                   help="rename source column OLD to NEW (repeatable), e.g. --map completion_ids=response_tokens")
    p.add_argument("--aliases", action="store_true",
                   help="also rename the well-known names listed above when the diskreplay name is absent")
    p.add_argument("--columns", metavar="A,B,...", type=_columns,
                   help="import only these columns (names after --map), e.g. --columns prompt_id,completion_ids")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--group-key", metavar="COL",
                     help="per-row column to index groups by (default: the exported store's key, else "
                          "prompt_id if present, else none), e.g. --group-key prompt")
    key.add_argument("--no-group-key", action="store_true", help="build a store without a group index")
    p.add_argument("--capacity", type=_positive_int, metavar="ROWS",
                   help="row capacity of the new store (default: the exported store's, else unbounded)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip and count JSONL lines that do not parse or do not fit (default: stop at the "
                        "first, naming FILE:LINE)")
    p.add_argument("--chunk-rows", type=_positive_int, default=4096, metavar="N",
                   help="rows per append/commit (default: 4096)")
    p.add_argument("--split", metavar="NAME", help="split of a saved DatasetDict, e.g. --split train")
    p.add_argument("--append", action="store_true",
                   help="append to the existing store at PATH (each chunk is its own commit); refused when "
                        "the store's capacity would evict rows it holds, unless --allow-evict")
    p.add_argument("--allow-evict", action="store_true",
                   help="with --append: go ahead even if the store's capacity evicts its oldest rows")
    p.add_argument("--fill-missing", action="store_true",
                   help="with --append: a float per-row column of the store that SRC lacks (e.g. advantages "
                        "when merging another run's store) reads NaN, 'not computed', in the rows appended "
                        "(default: refused, naming the columns; a ragged column SRC lacks is always 'not "
                        "computed'; int, bool and string columns cannot be filled: --map one of SRC's to them)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing PATH that is a store or an empty directory (the old one stays "
                        "until the new store is complete); never a file or a directory of other things")

    cur = argparse.ArgumentParser(add_help=False)
    cur.add_argument("--format", "-f", choices=["jsonl", "parquet", "hf"],
                     help="output format (default: from OUT's name: .jsonl/.ndjson/.json, .parquet/.pq, "
                          "no extension for hf)")
    cur.add_argument("--group-key", metavar="COL",
                     help="group rows by this per-row column instead of the store's group key")

    p = _sub(subs, "pairs", cmd_pairs, "chosen/rejected preference pairs (TRL DPO layout)",
             "One pair per group: the highest-reward completion (chosen) against the lowest (rejected).\n"
             "Groups with fewer than two rows, or a margin (chosen - rejected reward) not above 0 and\n"
             "at least --min-margin, give no pair; ties go to the oldest row. A group is a prompt across\n"
             "the whole run (every policy version) unless --version-window splits it.\n\n"
             "For TRL's DPOTrainer pass --tokenizer: the columns are then the text prompt, chosen,\n"
             "rejected, which DPOTrainer takes as it is (it tokenizes text itself and refuses ids) and\n"
             "which tokenizes back to the stored ids. Without --tokenizer: the token ids prompt_ids,\n"
             "chosen_ids, rejected_ids, for TRL's DataCollatorForPreference in a loop of your own.\n"
             "Always added: the group key, chosen_reward, rejected_reward, margin, chosen_row,\n"
             "rejected_row.",
             "  diskreplay pairs runs/grpo/replay dpo.jsonl --tokenizer ./tokenizer\n"
             "  diskreplay pairs runs/grpo/replay dpo.parquet --tokenizer ./tokenizer --min-margin 0.5\n"
             "  diskreplay pairs runs/grpo/replay on_policy.jsonl --tokenizer ./tokenizer --version-window 1\n"
             "  diskreplay pairs runs/grpo/replay pair_ids.jsonl   # ids: DataCollatorForPreference\n"
             "  python -c \"import datasets; print(datasets.load_dataset('json', data_files='dpo.jsonl'))\"\n"
             + EXIT_CODES + "\n", [remote, common, out, rows, tok, cur])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")
    p.add_argument("out", metavar="OUT", help="output file (jsonl, parquet) or directory (hf)")
    p.add_argument("--min-margin", type=_finite_float, default=0.0, metavar="M",
                   help="keep pairs whose reward margin is >= M (default: 0, i.e. any positive margin)")
    p.add_argument("--version-window", type=_positive_int, metavar="W",
                   help="pair only rows of the same window of W policy versions (policy_version // W; 1: the "
                        "same version), one pair per group and window, with chosen_/rejected_policy_version "
                        "columns (default: none, a group's rows of every policy version are pooled, so a "
                        "pair may set an early policy's completion against a late one's)")

    p = _sub(subs, "best-of-n", cmd_best_of_n, "top-k completions per group as an SFT set",
             "The --k highest-reward completions of each group whose reward is >= --min-reward.\n"
             "Either layout goes to TRL's SFTTrainer as it is, and its defaults train on the completion\n"
             "only. With --tokenizer: prompt / completion text (which tokenizes back to the stored\n"
             "ids). Without: prompt_ids, completion_ids, the pre-tokenized input_ids (prompt +\n"
             "completion) with labels (-100 on prompt tokens, which SFTTrainer uses as they are) and\n"
             "completion_mask (1 on completion tokens; SFTTrainer reads it only under\n"
             "completion_only_loss=True, and labels take precedence). Always added: the group key,\n"
             "reward, rank (0 = best), row.",
             "  diskreplay best-of-n runs/grpo/replay sft.jsonl --k 1 --min-reward 1 --tokenizer ./tokenizer\n"
             "  diskreplay best-of-n runs/grpo/replay sft.parquet --k 4\n"
             "  diskreplay best-of-n runs/grpo/replay sft_judged.jsonl --k 1 --version rewards=judge-v2\n"
             + EXIT_CODES + "\n", [remote, common, out, rows, tok, cur])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")
    p.add_argument("out", metavar="OUT", help="output file (jsonl, parquet) or directory (hf)")
    p.add_argument("--k", type=_positive_int, default=1, metavar="K", help="completions per group (default: 1)")
    p.add_argument("--min-reward", type=_finite_float, metavar="R",
                   help="only completions with reward >= R (default: no threshold)")

    p = _sub(subs, "rescore", cmd_rescore, "score every row again with your function, as a named version",
             "Run a scoring function of yours over the store's live rows, --chunk rows at a time, and\n"
             "commit its values as version NAME of --column (ReplayStore.update(..., version=NAME)):\n"
             "reads return the newest values, the earlier ones stay readable as COLUMN@VERSION\n"
             "('diskreplay info' lists them; export --version COLUMN=NAME exports one).\n\n"
             "The function: FUNCTION(batch) -> values. batch is a dict: store.read(rows, --columns)\n"
             "(per-row columns as numpy arrays, per-token ones as RaggedColumn: batch[c][i] is row i's)\n"
             "and batch['rows'], the int64 row ids. It returns one value per row, in that order: a\n"
             "number (or a vector of the column's width) per row, or for a per-token column one list\n"
             "per row as long as its completion. A wrong count or shape is refused naming the rows\n"
             "and the column, before anything of that chunk is written.\n\n"
             "Each chunk is one commit with the token rescore:COLUMN@NAME:FIRST_ROW. A run killed (or\n"
             "interrupted) and started again with the same NAME and --chunk skips the chunks committed\n"
             "before calling the function: every row is scored once, and new rows appended since are\n"
             "scored too. It opens the store as a writer: a single-writer store must not have another\n"
             "writer open (a multi_writer store may).",
             "  diskreplay rescore runs/grpo/replay --column rewards --version judge-v2 --python my_scorer:score\n"
             "  diskreplay rescore runs/grpo/replay --column rewards --version em --python ./scorers.py:exact_match \\\n"
             "      --columns completion_ids,answer --chunk 1024 --meta '{\"scorer\": \"exact-match\"}'\n"
             "  # my_scorer.py:\n"
             "  #   def score(batch):\n"
             "  #       return [len(batch['completion_ids'][i]) / 100 for i in range(len(batch['rows']))]\n"
             + EXIT_CODES + " (130: the chunks committed stay)\n", [remote, common])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")
    p.add_argument("--column", required=True, metavar="COL",
                   help="column the values are written to (a float or per-token column; a new one is added)")
    p.add_argument("--version", required=True, metavar="NAME", type=version_name,
                   help="name of the values (1-64 letters, digits, _ . - :), e.g. judge-v2; run again with the "
                        "same NAME to resume")
    p.add_argument("--python", required=True, metavar="MODULE:FUNCTION",
                   help="the scoring function: MODULE:FUNCTION (found on PYTHONPATH or in the working directory) "
                        "or FILE.py:FUNCTION")
    p.add_argument("--columns", metavar="A,B,...", type=_columns,
                   help="columns the function reads (default: all), e.g. --columns completion_ids,answer")
    p.add_argument("--chunk", type=_positive_int, default=512, metavar="N",
                   help="row ids per call and commit (default: 512); keep it when resuming")
    p.add_argument("--meta", type=meta_object, metavar="JSON",
                   help="a JSON object stored with the version (default: {\"scorer\": MODULE:FUNCTION, "
                        "\"started\": UTC time}; its keys are added to those)")

    p = _sub(subs, "compact", cmd_compact, "rewrite live rows into fewer, larger segments",
             "Rewrite the live rows into fewer, larger segments in one atomic commit (readers that\n"
             "have the store open keep working). Takes the writer lock: stop the writer first.",
             "  diskreplay compact runs/grpo/replay\n" + EXIT_CODES + "\n", [remote, common])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")
    p.add_argument("--multi-writer", nargs="?", const="true", choices=["true", "false"], default=None,
                   help="also convert to a multi-writer store (=false: back to one writer); stop all writers first")

    p = _sub(subs, "verify", cmd_verify, "check a store's files and checksums",
             "Check every committed file of a store (sizes, checksums, manifests, group sidecars).\n"
             "Exit status 0 when the store is healthy, 1 when problems were found.",
             "  diskreplay verify runs/grpo/replay\n"
             "  diskreplay verify runs/grpo/replay --json\n" + EXIT_CODES + " (1 also: problems found)\n",
             [remote, common])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")

    p = _sub(subs, "repair", cmd_repair, "repair what verify finds",
             "Repair a damaged store: keep the newest intact commit and every row that still reads and\n"
             "checksums (a damaged segment's rows are dropped, leaving a hole in the row ids), rebuild\n"
             "group sidecars, move garbage to quarantine/.\n"
             "--dry-run lists the actions a repair would report, without changing anything.",
             "  diskreplay repair runs/grpo/replay --dry-run\n"
             "  diskreplay repair runs/grpo/replay\n" + EXIT_CODES + "\n", [remote, common])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be done")
    p.add_argument("--force", action="store_true",
                   help="repair a multi-writer store written in the last 60 s (you have stopped every writer)")
    return parser


def misused_options(args: argparse.Namespace) -> Optional[str]:
    """A bad value, or an option that the others make meaningless: a usage error (exit status 2),
    found from the arguments alone before any work, never silently ignored. What needs a file
    read (an unknown column, a missing store) is found by the command itself (exit status 1)."""
    from ..storage import is_remote

    if getattr(args, "storage_option", None) and not is_remote(args.path):
        return f"--storage-option is for s3:// stores; {args.path} is a local path"
    if args.command == "import":
        return _misused_import_options(args)
    if args.command in ("export", "pairs", "best-of-n"):
        from ..export.outputs import output_format

        formats = ("parquet", "jsonl", "hf", "zarr") if args.command == "export" else ("jsonl", "parquet", "hf")
        if str(args.out).startswith(("s3://", "gs://", "az://")):
            return (f"OUT {args.out}: outputs are written to a local path; write it here and copy it to the "
                    "bucket")
        try:
            fmt_ = output_format(args.out, args.format, formats=formats, force=args.force)
        except DiskReplayError as exc:
            return str(exc)
        if args.command == "export" and args.compression is not None and fmt_ != "parquet":
            return f"--compression applies to parquet exports, not {fmt_}"
        if args.command == "export" and args.tokenizer is not None and fmt_ == "zarr":
            return "a zarr export holds the store's columns only; --tokenizer applies to parquet, jsonl and hf"
    return None


def _misused_import_options(args: argparse.Namespace) -> Optional[str]:
    import os

    from ..storage import is_remote

    if args.allow_evict and not args.append:
        return "--allow-evict applies to --append (a new store evicts nothing it held)"
    if args.append and args.capacity is not None:
        return "--capacity sets a new store's capacity; --append keeps the store's own"
    if args.append and args.overwrite:
        return "--append adds to the store at PATH and --overwrite replaces it: give one of them"
    if getattr(args, "fill_missing", False) and not args.append:
        return "--fill-missing applies to --append (a new store takes the columns SRC has)"
    if getattr(args, "fill_missing", False) and is_remote(args.path):
        return ("--fill-missing is for local stores; merge into a local store, then import that into "
                f"{args.path} with --append")
    if args.split is not None and args.format not in ("auto", "hf"):
        return f"--split {args.split} picks one of a saved Hugging Face DatasetDict's; --format {args.format} has none"
    if os.path.abspath(args.src) == os.path.abspath(args.path):
        return f"SRC and PATH are the same path ({args.src}); import into another directory"
    return None
