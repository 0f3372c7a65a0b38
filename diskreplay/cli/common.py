"""What the commands share: the exit codes' text, output (text or JSON), sizes, and the store a
command's PATH names (a local path, or an ``s3://`` store opened with ``--storage-option``s)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Dict, Optional

import numpy as np

from ..errors import ArgumentError

PROG = "diskreplay"
EXIT_CODES = ("exit status: 0 success, 1 error (one line on stderr), 2 usage error, "
              "130 interrupted by Ctrl-C (nothing partial is left)")


def package_version() -> str:
    try:
        from .. import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def show_progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def emit(args: argparse.Namespace, result: Dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(json_safe(result), indent=2, default=str, allow_nan=False))
    else:
        print(text)


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as null: JSON has no such numbers (``jq`` refuses ``NaN``).

    >>> json_safe({"mean": float("-inf"), "n": [1.5, float("nan")]})
    {'mean': None, 'n': [1.5, None]}
    """
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def human_size(n: Optional[int]) -> str:
    if n is None:
        return "?"
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if f < 1024:
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return f"{f:.1f} TiB"


def store_of(args: argparse.Namespace) -> Any:
    """The command's store path, or the one-line refusal when no store is there (nothing is created).

    A store URL (``s3://``) comes back opened read-only (with ``--storage-option``s),
    since the export functions take a store or a local path.
    """
    from ..export import require_store

    if is_remote_arg(args):
        return open_remote(args, readonly=True)
    return require_store(args.path)


def is_remote_arg(args: argparse.Namespace) -> bool:
    """Whether the command's PATH is a storage URL (opened as a store), not a directory's path."""
    from ..storage import is_url

    return is_url(args.path)


def storage_options_of(args: argparse.Namespace) -> Optional[Dict[str, str]]:
    """``--storage-option KEY=VALUE`` pairs (obstore's S3 settings; AWS_* variables fill in the rest)."""
    pairs = getattr(args, "storage_option", None) or []
    if pairs and not is_remote_arg(args):
        raise ArgumentError(f"--storage-option is for s3:// stores; {args.path} is a local path")
    return dict(pairs) or None


def open_remote(args: argparse.Namespace, readonly: bool) -> Any:
    """Open the ``s3://`` store of the command; StoreNotFoundError when none is there (nothing is created)."""
    from ..store import ReplayStore

    options = storage_options_of(args)
    if not readonly:
        ReplayStore(args.path, readonly=True, storage_options=options).close()  # refuses a missing store
    return ReplayStore(args.path, readonly=readonly, storage_options=options)


def excluded_note(args: argparse.Namespace, res: Dict[str, Any]) -> str:
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


def nothing_matched(args: argparse.Namespace, n: int) -> str:
    """A line saying that the filters given kept nothing (an empty output otherwise passes unnoticed)."""
    given = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in
             ("policy_versions", "min_reward", "min_margin") if getattr(args, name, None) not in (None, 0.0)]
    return f"\nwarning: nothing matched {' and '.join(given)}: the output is empty" if n == 0 and given else ""
