"""The ``diskreplay`` command: inspect, export, import, curate, rescore, compact, verify and repair stores.

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

import os
import sys
import warnings
from typing import Any, Callable, Optional, Sequence

from ..errors import DiskReplayError
from .common import EXIT_CODES, PROG
from .parser import build_parser, misused_options

__all__ = ["main", "build_parser", "PROG", "EXIT_CODES"]


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
    misuse = misused_options(args)
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
        elif args.command == "rescore":
            what = ("the chunks committed before it stay in the store; run the same command again to score the "
                    "rest (the chunks committed are skipped, their rows not scored again)")
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
