"""The commands on a store in place: ``info``, ``compact``, ``verify`` and ``repair``."""

from __future__ import annotations

import argparse

from .common import emit, human_size, is_remote_arg, open_remote, show_progress, store_of, storage_options_of


def cmd_info(args: argparse.Namespace) -> int:
    from ..export import format_info, store_info

    store = store_of(args)
    try:
        info = store_info(store, progress=show_progress(args), include_excluded=args.include_excluded)
    finally:
        if not isinstance(store, str):
            store.close()
    emit(args, info, format_info(info))
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    from ..store import ReplayStore

    multi = {None: None, "true": True, "false": False}[getattr(args, "multi_writer", None)]
    if is_remote_arg(args):
        with open_remote(args, readonly=False) as store:
            res = store.compact(multi_writer=multi)
    else:
        with ReplayStore(store_of(args)) as store:  # the check first: a writer's open creates a missing store
            res = store.compact(multi_writer=multi)
    parts = []
    for what in ("segments", "bytes"):
        if f"{what}_before" in res and f"{what}_after" in res:
            b, a = res[f"{what}_before"], res[f"{what}_after"]
            parts.append(f"{what} {b:,} -> {a:,}" if what == "segments" else f"{what} {human_size(b)} -> {human_size(a)}")
    parts += [f"{k} {v}" for k, v in res.items() if not k.startswith(("segments_", "bytes_"))]
    if multi is not None:
        parts.append(f"now a {'multi' if multi else 'single'}-writer store")
    emit(args, res, f"compacted {args.path}: " + ", ".join(parts))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .. import verify

    if is_remote_arg(args):
        store_of(args).close()  # the one-line refusal of a missing store
        res = verify.verify_store(args.path, progress=show_progress(args),
                                            storage_options=storage_options_of(args))
    else:
        res = verify.verify_store(store_of(args), progress=show_progress(args))
    ok = bool(res.get("ok"))
    problems = list(res.get("problems", []))
    text = f"{args.path}: ok" if ok else f"{args.path}: {len(problems)} problem(s)\n" + "\n".join(
        f"  - {p}" for p in problems)
    warnings_ = list(res.get("warnings", []))
    if warnings_:
        text += "\nwarnings:\n" + "\n".join(f"  - {w}" for w in warnings_)
    emit(args, res, text)
    return 0 if ok else 1


def cmd_repair(args: argparse.Namespace) -> int:
    from .. import verify

    if is_remote_arg(args):
        store_of(args).close()  # the one-line refusal of a missing store
        res = verify.repair_store(args.path, dry_run=args.dry_run, progress=show_progress(args),
                                            force=getattr(args, "force", False),
                                            storage_options=storage_options_of(args))
    else:
        res = verify.repair_store(store_of(args), dry_run=args.dry_run, progress=show_progress(args),
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
    emit(args, res, text)
    return 0 if res.get("ok", True) else 1
