"""The commands that move rows in or out of a store: ``export``, ``import``, ``pairs`` and ``best-of-n``."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator

from ..errors import ArgumentError, CorruptStoreError, StoreNotFoundError
from .common import (emit, excluded_note, human_size, is_remote_arg, nothing_matched, open_remote, show_progress,
                     store_of, storage_options_of)


def cmd_export(args: argparse.Namespace) -> int:
    from ..export import export

    store = store_of(args)
    try:
        res = export(store, args.out, args.format, columns=args.columns,
                     policy_versions=args.policy_versions, min_reward=args.min_reward, limit=args.limit,
                     tokenizer=args.tokenizer, skip_special_tokens=args.skip_special_tokens,
                     reward_key=args.reward_key, overwrite=args.overwrite, progress=show_progress(args),
                     compression=args.compression, chunk_bytes=args.chunk_bytes, force=args.force,
                     include_excluded=args.include_excluded, skip_damaged=args.skip_damaged,
                     versions=dict(args.version or []))
    except CorruptStoreError as exc:
        if args.skip_damaged:
            raise
        raise CorruptStoreError(f"{exc}; or export the rows that are intact with --skip-damaged") from None
    if not isinstance(store, str):
        store.close()
    _skipped_damaged(res)
    emit(args, res, f"exported {res['rows']:,} rows to {res['path']} ({res['format']}"
                     + (f", {human_size(res.get('bytes'))})" if res.get("bytes") is not None else ")")
                     + excluded_note(args, res)
                     + "".join(f"\nwarning: {w}" for w in res.get("warnings", ()))
                     + nothing_matched(args, res["rows"]))
    return 0


def _skipped_damaged(res: Dict[str, Any]) -> None:
    """Name on stderr each damaged segment ``export --skip-damaged`` left out, with its rows."""
    skipped = res.get("skipped_damaged")
    if not skipped:
        return
    n, k = res.get("skipped_rows", 0), len(skipped)
    print(f"skipped {n:,} row{'' if n == 1 else 's'} of {k} damaged segment{'' if k == 1 else 's'} "
          "('diskreplay repair' drops them from the store):", file=sys.stderr)
    for s in skipped:
        a, b = s["rows"]
        print(f"  {s['file']} (rows {a}-{b - 1}): {s['why']}", file=sys.stderr)


def cmd_import(args: argparse.Namespace) -> int:
    from ..export import import_rollouts
    from ..export.importer import AUTO_FORMAT

    group_key: Any = None if args.no_group_key else (args.group_key or AUTO_FORMAT)

    def run(path: str, append: bool = args.append) -> Dict[str, Any]:
        return import_rollouts(args.src, path, format=args.format, mapping=args.map or None,
                               aliases=args.aliases, columns=args.columns, group_key=group_key,
                               capacity=AUTO_FORMAT if args.capacity is None else args.capacity, skip_bad=args.skip_bad,
                               chunk_rows=args.chunk_rows, append=append, overwrite=args.overwrite,
                               split=args.split, progress=show_progress(args), allow_evict=args.allow_evict,
                               fill_missing=args.fill_missing and append)

    res = _import_remote(args, lambda tmp: run(tmp, False)) if is_remote_arg(args) else run(args.path)
    text = _imported(args, res)
    if res.get("empty_columns"):
        text += (f"\nleft out column(s) {', '.join(res['empty_columns'])}: no row has a value there (a JSONL "
                 "export writes NaN and inf as null), so nothing says what they hold")
    if res.get("skipped"):
        n = res["skipped"]
        text += f"\nskipped {n:,} bad line{'' if n == 1 else 's'}"
        for line in res.get("bad_lines", []):
            print(f"  {line}", file=sys.stderr)
    emit(args, res, text)
    return 0


def _imported(args: argparse.Namespace, res: Dict[str, Any]) -> str:
    """What an import did: the rows it wrote now, apart from those an earlier run of the same
    ``import --append`` had committed (recognised by their chunk tokens and not written again)."""
    def rows(n: int) -> str:
        return f"{n:,} row{'' if n == 1 else 's'}"

    earlier = res.get("already_imported") or 0
    new = res["rows"] - earlier
    where = (f"group key: {res.get('group_key') or 'none'}; columns: {', '.join(res.get('columns', []))}")
    if earlier and not new:
        return (f"nothing to import: an earlier run of this import had imported all {rows(earlier)} of {args.src} "
                f"into {res['path']} (its chunks were recognised and skipped); the store holds "
                f"{rows(res.get('store_rows', 0))}; {where}")
    text = f"imported {rows(new)} from {args.src} ({res['format']}) into {res['path']}; {where}"
    if earlier:
        text += (f"\nthe other {rows(earlier)} of its {res['rows']:,} an earlier run had imported already (their "
                 "chunks were recognised and skipped)")
    filled = res.get("filled_columns")
    if filled:
        text += (f"\n{args.src} has no column(s) {', '.join(filled)}: the rows appended read NaN there "
                 "(not computed; --fill-missing)")
    return text


def _import_remote(args: argparse.Namespace, run: Callable[[str], Dict[str, Any]]) -> Dict[str, Any]:
    """``import`` into an ``s3://`` store: build the store in a local temporary directory
    with the importer, then append its rows to the bucket's store in commits of one
    segment each (a new store gets the same options; row ids start where the store ends)."""
    import shutil
    import tempfile

    import numpy as np

    from ..store import ReplayStore

    options = storage_options_of(args)
    tmp = tempfile.mkdtemp(prefix="diskreplay-import-")
    try:
        res = run(os.path.join(tmp, "store"))
        with ReplayStore(os.path.join(tmp, "store"), readonly=True) as src:
            if args.append:
                dst = open_remote(args, readonly=False)
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


@contextmanager
def _picked(args: argparse.Namespace) -> Iterator[Any]:
    """The command's store (a path, or an opened remote store), as a view whose reads give the
    versions ``--version COL=NAME`` picks under the columns' own names when it gives any."""
    store = store_of(args)
    versions = dict(getattr(args, "version", None) or [])
    if versions and isinstance(store, str):
        from ..store import ReplayStore

        store = ReplayStore(store, readonly=True)
    try:
        if versions:
            from ..export import VersionView

            yield VersionView(store, versions)
        else:
            yield store
    finally:
        if not isinstance(store, str):
            store.close()


def cmd_pairs(args: argparse.Namespace) -> int:
    from ..export import preference_pairs

    with _picked(args) as store:
        res = preference_pairs(store, args.out, min_margin=args.min_margin, format=args.format,
                               tokenizer=args.tokenizer, skip_special_tokens=args.skip_special_tokens,
                               group_key=args.group_key, reward_key=args.reward_key,
                               policy_versions=args.policy_versions, overwrite=args.overwrite,
                               progress=show_progress(args), force=args.force, version_window=args.version_window,
                               include_excluded=args.include_excluded)
    windows = (f" ({res['version_windows']:,} windows of {args.version_window} policy version"
               f"{'' if args.version_window == 1 else 's'})" if args.version_window else "")
    # DPOTrainer tokenizes text itself and refuses ids (KeyError: 'chosen'): say so where it would bite
    ids_note = ("" if args.tokenizer else "\nnote: token ids, for TRL's DataCollatorForPreference in a loop of your "
                "own; TRL's DPOTrainer takes text only: add --tokenizer DIR for it")
    emit(args, res, f"wrote {res['pairs']:,} pairs from {res['groups']:,} groups{windows} to {res['path']} "
                     f"({res['format']}: {', '.join(res['columns'])})" + excluded_note(args, res) + ids_note
                     + "".join(f"\nwarning: {w}" for w in res.get("warnings", ()))
                     + nothing_matched(args, res["pairs"]))
    return 0


def cmd_best_of_n(args: argparse.Namespace) -> int:
    from ..export import best_of_n

    with _picked(args) as store:
        res = best_of_n(store, args.out, k=args.k, min_reward=args.min_reward, format=args.format,
                        tokenizer=args.tokenizer, skip_special_tokens=args.skip_special_tokens,
                        group_key=args.group_key, reward_key=args.reward_key, policy_versions=args.policy_versions,
                        overwrite=args.overwrite, progress=show_progress(args), force=args.force,
                        include_excluded=args.include_excluded)
    emit(args, res, f"wrote {res['rows']:,} completions from {res['groups']:,} groups to {res['path']} "
                     f"({res['format']}: {', '.join(res['columns'])})" + excluded_note(args, res)
                     + "".join(f"\nwarning: {w}" for w in res.get("warnings", ()))
                     + nothing_matched(args, res["rows"]))
    return 0
