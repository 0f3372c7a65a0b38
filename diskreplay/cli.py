"""The ``diskreplay`` command: inspect, export, import, curate, compact, verify and repair stores.

A thin layer over :mod:`diskreplay.export` (and ``ReplayStore.compact``,
:mod:`diskreplay.verify`). ``main(argv)`` returns the exit status instead of
exiting, so it can be called in-process:

- 0: success (``verify``: the store is healthy);
- 1: an expected failure (bad input, no store at PATH, existing output,
  damaged store, missing optional dependency), reported as one line on
  stderr without a traceback (set ``DISKREPLAY_DEBUG=1`` to get the traceback);
- 2: a usage error (unknown option, missing or invalid argument);
- 130: interrupted (Ctrl-C, i.e. 128 + SIGINT): one line on stderr; no
  partial output is left under the final name (``import --append`` keeps the
  chunks it committed before).

Only ``import`` creates a store; every other command refuses a path that
holds none ("no diskreplay store at PATH") and creates nothing there.

>>> main(["--version"])  # doctest: +ELLIPSIS
diskreplay ...
0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import ArgumentError, DiskReplayError, StoreNotFoundError

PROG = "diskreplay"
EXIT_CODES = ("exit status: 0 success, 1 error (one line on stderr), 2 usage error, "
              "130 interrupted by Ctrl-C (nothing partial is left)")


def _version() -> str:
    try:
        from . import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _emit(args: argparse.Namespace, result: Dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(_json_safe(result), indent=2, default=str, allow_nan=False))
    else:
        print(text)


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as null: JSON has no such numbers (``jq`` refuses ``NaN``).

    >>> _json_safe({"mean": float("-inf"), "n": [1.5, float("nan")]})
    {'mean': None, 'n': [1.5, None]}
    """
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _size(n: Optional[int]) -> str:
    if n is None:
        return "?"
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if f < 1024:
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return f"{f:.1f} TiB"


def _columns(text: str) -> List[str]:
    """``--columns A,B``: the names, none empty and none twice (argparse's type: a usage error)."""
    names = [c.strip() for c in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name; give names separated by commas")
    twice = sorted({c for c in names if names.count(c) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names {', '.join(twice)} twice")
    return names


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


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
    from .export.importer import parse_mapping

    try:
        parse_mapping([text])
    except DiskReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _codec(text: str) -> str:
    from .export.writers import check_compression

    try:
        return check_compression(text)
    except DiskReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _version_range(text: str) -> str:
    """``--policy-versions``, checked while the arguments are parsed (exit status 2, before any work);
    the export parses the same text again."""
    from .export._common import parse_version_range

    try:
        parse_version_range(text)
    except DiskReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _store(args: argparse.Namespace) -> Any:
    """The command's store path, or the one-line refusal when no store is there (nothing is created).

    An ``s3://`` store comes back opened read-only (with ``--storage-option``s),
    since the export functions take a store or a local path.
    """
    from .export import require_store

    if _remote(args):
        return _open_remote(args, readonly=True)
    return require_store(args.path)


def _remote(args: argparse.Namespace) -> bool:
    from .storage import is_remote

    return is_remote(args.path)


def _storage_options(args: argparse.Namespace) -> Optional[Dict[str, str]]:
    """``--storage-option KEY=VALUE`` pairs (obstore's S3 settings; AWS_* variables fill in the rest)."""
    pairs = getattr(args, "storage_option", None) or []
    if pairs and not _remote(args):
        raise ArgumentError(f"--storage-option is for s3:// stores; {args.path} is a local path")
    return dict(pairs) or None


def _open_remote(args: argparse.Namespace, readonly: bool) -> Any:
    """Open the ``s3://`` store of the command; StoreNotFoundError when none is there (nothing is created)."""
    from .store import ReplayStore

    options = _storage_options(args)
    if not readonly:
        ReplayStore(args.path, readonly=True, storage_options=options).close()  # refuses a missing store
    return ReplayStore(args.path, readonly=readonly, storage_options=options)


def _key_value(text: str) -> Tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. endpoint=http://127.0.0.1:9000), got {text!r}")
    return key.strip(), value


def _import_remote(args: argparse.Namespace, run: Callable[[str], Dict[str, Any]]) -> Dict[str, Any]:
    """``import`` into an ``s3://`` store: build the store in a local temporary directory
    with the importer, then append its rows to the bucket's store in commits of one
    segment each (a new store gets the same options; row ids start where the store ends)."""
    import shutil
    import tempfile

    import numpy as np

    from .store import ReplayStore

    options = _storage_options(args)
    tmp = tempfile.mkdtemp(prefix="diskreplay-import-")
    try:
        res = run(os.path.join(tmp, "store"))
        with ReplayStore(os.path.join(tmp, "store"), readonly=True) as src:
            if args.append:
                dst = _open_remote(args, readonly=False)
            else:
                try:
                    ReplayStore(args.path, readonly=True, storage_options=options).close()
                except StoreNotFoundError:
                    pass
                else:
                    raise ArgumentError(f"a store exists at {args.path}; pass --append to add rows to it "
                                        "(replacing a store in a bucket is not supported: delete it first)")
                dst = ReplayStore(args.path, capacity=src.capacity, group_key=src.group_key,
                                  capacity_bytes=src.capacity_bytes, storage_options=options)
            with dst:
                for seg in src.manifest.segments:
                    rows = np.arange(max(seg.first_row, src.head), seg.end_row, dtype=np.int64)
                    batch = src.read(rows)
                    dst.extend({k: v.to_list() if hasattr(v, "to_list") else v for k, v in batch.items()})
                res.update(path=args.path, store_rows=len(dst))
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# Commands


def cmd_info(args: argparse.Namespace) -> int:
    from .export import format_info, store_info

    store = _store(args)
    try:
        info = store_info(store, progress=_progress(args), include_excluded=args.include_excluded)
    finally:
        if not isinstance(store, str):
            store.close()
    _emit(args, info, format_info(info))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export

    store = _store(args)
    res = export(store, args.out, args.format, columns=args.columns,
                 policy_versions=args.policy_versions, min_reward=args.min_reward, limit=args.limit,
                 tokenizer=args.tokenizer, skip_special_tokens=args.skip_special_tokens,
                 reward_key=args.reward_key, overwrite=args.overwrite, progress=_progress(args),
                 compression=args.compression, chunk_bytes=args.chunk_bytes, force=args.force,
                 include_excluded=args.include_excluded)
    if not isinstance(store, str):
        store.close()
    _emit(args, res, f"exported {res['rows']:,} rows to {res['path']} ({res['format']}"
                     + (f", {_size(res.get('bytes'))})" if res.get("bytes") is not None else ")")
                     + _excluded_note(args, res)
                     + "".join(f"\nwarning: {w}" for w in res.get("warnings", ()))
                     + _nothing_matched(args, res["rows"]))
    return 0


def _excluded_note(args: argparse.Namespace, res: Dict[str, Any]) -> str:
    """A line saying what the store's recorded exclusions did to this output (nothing when it records none)."""
    ranges = res.get("excluded_ranges") or []
    if not ranges:
        return ""
    where = ", ".join(f"[{a:,}, {b:,})" for a, b in ranges[:4]) + (", ..." if len(ranges) > 4 else "")
    if args.include_excluded:
        return f"\nincluded the rows the store records as excluded (rows {where}: a resumed run's discarded timeline)"
    n = res.get("excluded_rows", 0)
    return (f"\nleft out {n:,} row{'' if n == 1 else 's'} the store records as excluded (rows {where}: a resumed "
            "run's discarded timeline); --include-excluded uses them")


def _nothing_matched(args: argparse.Namespace, n: int) -> str:
    """A line saying that the filters given kept nothing (an empty output otherwise passes unnoticed)."""
    given = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in
             ("policy_versions", "min_reward", "min_margin") if getattr(args, name, None) not in (None, 0.0)]
    return f"\nwarning: nothing matched {' and '.join(given)}: the output is empty" if n == 0 and given else ""


def cmd_import(args: argparse.Namespace) -> int:
    from .export import import_rollouts
    from .export.importer import AUTO_FORMAT

    group_key: Any = None if args.no_group_key else (args.group_key or AUTO_FORMAT)

    def run(path: str, append: bool = args.append) -> Dict[str, Any]:
        return import_rollouts(args.src, path, format=args.format, mapping=args.map or None,
                               aliases=args.aliases, columns=args.columns, group_key=group_key,
                               capacity=AUTO_FORMAT if args.capacity is None else args.capacity, skip_bad=args.skip_bad,
                               chunk_rows=args.chunk_rows, append=append, overwrite=args.overwrite,
                               split=args.split, progress=_progress(args), allow_evict=args.allow_evict)

    res = _import_remote(args, lambda tmp: run(tmp, False)) if _remote(args) else run(args.path)
    rows = f"{res['rows']:,} row{'' if res['rows'] == 1 else 's'}"
    text = (f"imported {rows} from {args.src} ({res['format']}) into {res['path']}; "
            f"group key: {res.get('group_key') or 'none'}; columns: {', '.join(res.get('columns', []))}")
    if res.get("already_imported"):
        n = res["already_imported"]
        text += f"\n{n:,} of them an earlier run had imported already (its chunks were recognised and skipped)"
    if res.get("empty_columns"):
        text += (f"\nleft out column(s) {', '.join(res['empty_columns'])}: no row has a value there (a JSONL "
                 "export writes NaN and inf as null), so nothing says what they hold")
    if res.get("skipped"):
        n = res["skipped"]
        text += f"\nskipped {n:,} bad line{'' if n == 1 else 's'}"
        for line in res.get("bad_lines", []):
            print(f"  {line}", file=sys.stderr)
    _emit(args, res, text)
    return 0


def cmd_pairs(args: argparse.Namespace) -> int:
    from .export import preference_pairs

    res = preference_pairs(_store(args), args.out, min_margin=args.min_margin, format=args.format,
                           tokenizer=args.tokenizer, skip_special_tokens=args.skip_special_tokens,
                           group_key=args.group_key, reward_key=args.reward_key,
                           policy_versions=args.policy_versions, overwrite=args.overwrite,
                           progress=_progress(args), force=args.force, version_window=args.version_window,
                           include_excluded=args.include_excluded)
    windows = (f" ({res['version_windows']:,} windows of {args.version_window} policy version"
               f"{'' if args.version_window == 1 else 's'})" if args.version_window else "")
    _emit(args, res, f"wrote {res['pairs']:,} pairs from {res['groups']:,} groups{windows} to {res['path']} "
                     f"({res['format']}: {', '.join(res['columns'])})" + _excluded_note(args, res)
                     + _nothing_matched(args, res["pairs"]))
    return 0


def cmd_best_of_n(args: argparse.Namespace) -> int:
    from .export import best_of_n

    res = best_of_n(_store(args), args.out, k=args.k, min_reward=args.min_reward, format=args.format,
                    tokenizer=args.tokenizer, skip_special_tokens=args.skip_special_tokens,
                    group_key=args.group_key, reward_key=args.reward_key, policy_versions=args.policy_versions,
                    overwrite=args.overwrite, progress=_progress(args), force=args.force,
                    include_excluded=args.include_excluded)
    _emit(args, res, f"wrote {res['rows']:,} completions from {res['groups']:,} groups to {res['path']} "
                     f"({res['format']}: {', '.join(res['columns'])})" + _excluded_note(args, res)
                     + _nothing_matched(args, res["rows"]))
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    from .store import ReplayStore

    multi = {None: None, "true": True, "false": False}[getattr(args, "multi_writer", None)]
    if _remote(args):
        with _open_remote(args, readonly=False) as store:
            res = store.compact(multi_writer=multi)
    else:
        with ReplayStore(_store(args)) as store:  # the check first: a writer's open creates a missing store
            res = store.compact(multi_writer=multi)
    parts = []
    for what in ("segments", "bytes"):
        if f"{what}_before" in res and f"{what}_after" in res:
            b, a = res[f"{what}_before"], res[f"{what}_after"]
            parts.append(f"{what} {b:,} -> {a:,}" if what == "segments" else f"{what} {_size(b)} -> {_size(a)}")
    parts += [f"{k} {v}" for k, v in res.items() if not k.startswith(("segments_", "bytes_"))]
    if multi is not None:
        parts.append(f"now a {'multi' if multi else 'single'}-writer store")
    _emit(args, res, f"compacted {args.path}: " + ", ".join(parts))
    return 0


def _verify_module() -> Any:
    from . import verify

    return verify


def cmd_verify(args: argparse.Namespace) -> int:
    if _remote(args):
        _store(args).close()  # the one-line refusal of a missing store
        res = _verify_module().verify_store(args.path, progress=_progress(args),
                                            storage_options=_storage_options(args))
    else:
        res = _verify_module().verify_store(_store(args), progress=_progress(args))
    ok = bool(res.get("ok"))
    problems = list(res.get("problems", []))
    text = f"{args.path}: ok" if ok else f"{args.path}: {len(problems)} problem(s)\n" + "\n".join(
        f"  - {p}" for p in problems)
    warnings_ = list(res.get("warnings", []))
    if warnings_:
        text += "\nwarnings:\n" + "\n".join(f"  - {w}" for w in warnings_)
    _emit(args, res, text)
    return 0 if ok else 1


def cmd_repair(args: argparse.Namespace) -> int:
    if _remote(args):
        _store(args).close()  # the one-line refusal of a missing store
        res = _verify_module().repair_store(args.path, dry_run=args.dry_run, progress=_progress(args),
                                            force=getattr(args, "force", False),
                                            storage_options=_storage_options(args))
    else:
        res = _verify_module().repair_store(_store(args), dry_run=args.dry_run, progress=_progress(args),
                                            force=getattr(args, "force", False))
    actions = list(res.get("actions", []))
    if not actions:
        text = f"{args.path}: nothing to repair"
    elif args.dry_run:
        # the actions are a repair's log (past tense); a dry run shows that log without acting
        text = (f"{args.path}: dry run, nothing was changed; 'diskreplay repair {args.path}' would report:\n"
                + "\n".join(f"  - {a}" for a in actions))
    else:
        text = f"{args.path}: repaired:\n" + "\n".join(f"  - {a}" for a in actions)
    _emit(args, res, text)
    return 0 if res.get("ok", True) else 1


# ---------------------------------------------------------------------------
# The parser


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
                          "adds decoded text. Never downloads. e.g. --tokenizer ./Qwen2.5-0.5B")
    tok.add_argument("--skip-special-tokens", action="store_true",
                     help="drop special tokens (BOS/EOS, chat markers) from decoded text")

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
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
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
             "  diskreplay import runs/other_run/replay runs/merged --append\n"
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
             "With --tokenizer the columns are TRL DPOTrainer's text columns prompt, chosen, rejected;\n"
             "without, the token ids prompt_ids, chosen_ids, rejected_ids (what TRL's\n"
             "DataCollatorForPreference reads). Always added: the group key, chosen_reward,\n"
             "rejected_reward, margin, chosen_row, rejected_row.",
             "  diskreplay pairs runs/grpo/replay dpo.jsonl --tokenizer ./tokenizer\n"
             "  diskreplay pairs runs/grpo/replay dpo.parquet --format parquet --min-margin 0.5\n"
             "  diskreplay pairs runs/grpo/replay on_policy.jsonl --version-window 1\n"
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
             "With --tokenizer the columns are TRL SFTTrainer's prompt / completion text; without,\n"
             "prompt_ids, completion_ids and the pre-tokenized input_ids (prompt + completion) with\n"
             "completion_mask. Always added: the group key, reward, rank (0 = best), row.",
             "  diskreplay best-of-n runs/grpo/replay sft.jsonl --k 1 --min-reward 1 --tokenizer ./tokenizer\n"
             "  diskreplay best-of-n runs/grpo/replay sft.parquet --k 4\n"
             + EXIT_CODES + "\n", [remote, common, out, rows, tok, cur])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")
    p.add_argument("out", metavar="OUT", help="output file (jsonl, parquet) or directory (hf)")
    p.add_argument("--k", type=_positive_int, default=1, metavar="K", help="completions per group (default: 1)")
    p.add_argument("--min-reward", type=_finite_float, metavar="R",
                   help="only completions with reward >= R (default: no threshold)")

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
             "Repair a damaged store (fall back to the newest intact commit, remove garbage).\n"
             "--dry-run lists the actions a repair would report, without changing anything.",
             "  diskreplay repair runs/grpo/replay --dry-run\n"
             "  diskreplay repair runs/grpo/replay\n" + EXIT_CODES + "\n", [remote, common])
    p.add_argument("path", metavar="PATH", help="store directory (or s3://BUCKET/PREFIX)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be done")
    p.add_argument("--force", action="store_true",
                   help="repair a multi-writer store written in the last 60 s (you have stopped every writer)")
    return parser


def _misused_options(args: argparse.Namespace) -> Optional[str]:
    """An option that the others make meaningless (a usage error, not silently ignored)."""
    if args.command == "import" and args.allow_evict and not args.append:
        return "--allow-evict applies to --append (a new store evicts nothing it held)"
    if args.command == "import" and args.append and args.capacity is not None:
        return "--capacity sets a new store's capacity; --append keeps the store's own"
    if args.command == "export" and args.compression is not None:
        from .export._common import output_format

        try:
            fmt_ = output_format(args.out, args.format, force=args.force)
        except DiskReplayError:
            return None  # the export names the problem
        if fmt_ != "parquet":
            return f"--compression applies to parquet exports, not {fmt_}"
    return None


def _one_line_warnings(command: str) -> Callable[..., None]:
    """Warnings as the command's own lines on stderr, each once (not Python's two-line form with the
    source line, once per place that raised it)."""
    shown: set = set()

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        text = f"{PROG} {command}: warning: {message}"
        if text not in shown:
            shown.add(text)
            print(text, file=sys.stderr)
    return show


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``diskreplay`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    misuse = _misused_options(args)
    if misuse:
        print(f"{PROG} {args.command}: error: {misuse}", file=sys.stderr)
        return 2
    # tokenizers are loaded from local directories only; make sure nothing reaches for the hub
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(args.command)
            return args.func(args)
    except KeyboardInterrupt:
        if args.command == "import" and args.append:
            what = ("the chunks committed before it stay in the store; run the same command again to import the "
                    "rest (the chunks already committed are recognised and skipped)")
        elif args.command in ("export", "import", "pairs", "best-of-n"):
            what = "no partial output was left"
        else:
            what = "the store is as it was or fully updated, never half"
        print(f"{PROG} {args.command}: interrupted; {what}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout piped into e.g. head: the work is done, stop writing quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (DiskReplayError, OSError, ValueError, KeyError) as exc:
        if os.environ.get("DISKREPLAY_DEBUG"):
            raise
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        if isinstance(exc, OSError) and not isinstance(exc, DiskReplayError) and exc.filename and \
                str(exc.filename) not in msg:
            msg = f"{msg}: {exc.filename}"
        print(f"{PROG} {args.command}: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
