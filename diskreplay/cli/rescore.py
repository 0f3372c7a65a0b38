"""``diskreplay rescore``: a user's scoring function over a store's live rows, its values committed
chunk by chunk as a named version of a column (``ReplayStore.update(..., version=...)``), exactly once
and resumable after a kill."""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import numpy as np

from ..errors import ArgumentError, BatchError, SchemaError
from ..format import version_problem
from .common import emit, is_remote_arg, open_remote, show_progress, store_of

ROWS_KEY = "rows"  # the batch's key holding the row ids


def load_function(spec: str) -> Callable[[Dict[str, Any]], Any]:
    """The function ``spec`` names: ``module:function`` (the module found on ``sys.path``, to which
    the working directory is added, as ``python -m`` does) or ``path/to/file.py:function``.

    >>> load_function("json:dumps")([1])
    '[1]'
    """
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name:
        raise ArgumentError(f"--python must be MODULE:FUNCTION (e.g. my_scorer:score) or FILE.py:FUNCTION, got "
                            f"{spec!r}")
    try:
        if where.endswith(".py") or os.sep in where:
            path = os.path.abspath(where)
            loader = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
            module = importlib.util.module_from_spec(loader)  # type: ignore[arg-type]
            loader.loader.exec_module(module)  # type: ignore[union-attr]  (a missing file: FileNotFoundError)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except Exception as exc:
        raise ArgumentError(f"--python {spec}: cannot import {where!r} ({type(exc).__name__}: {exc}); put the "
                            "module on PYTHONPATH (or in the working directory), or give FILE.py:FUNCTION") from exc
    fn: Any = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ArgumentError(f"--python {spec}: {where!r} has no function {name!r}; name a function that takes a "
                            "batch (a dict of columns and 'rows') and returns one value per row")
    return fn


def _check_values(values: Any, rows: np.ndarray, column: str, spec: Any, what: str) -> Any:
    """``values`` if they hold one value per row of ``rows`` (and, for a per-row column the store has,
    that column's shape), else an ArgumentError naming the rows and the column."""
    where = f"rows {rows[0]}..{rows[-1]} ({len(rows)} rows)"
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
        values = values.detach().cpu().numpy()
    try:
        n = len(values)
    except TypeError:
        n = None
    if n != len(rows):
        got = f"{n} values" if n is not None else f"a {type(values).__name__}"
        raise ArgumentError(f"{what} returned {got} for {where} of column {column!r}; return one value per row "
                            f"of batch[{ROWS_KEY!r}], in its order")
    if spec is not None and spec.kind != "ragged":
        want = (len(rows),) if spec.kind == "scalar" else (len(rows), spec.width)
        try:
            shape = np.shape(values)
        except ValueError:  # ragged nested lists
            shape = None
        if shape != want:
            raise ArgumentError(f"{what} returned values of shape {shape} for {where} of column {column!r}, a "
                                f"{spec.kind} column of dtype {spec.dtype}; return an array of shape {want}")
    return values


def rescore(store: Any, column: str, function: Callable[[Dict[str, Any]], Any], *, version: str,
            columns: Optional[Sequence[str]] = None, chunk: int = 512, meta: Optional[Mapping[str, Any]] = None,
            progress: bool = False, name: Optional[str] = None) -> Dict[str, Any]:
    """Score the live rows of ``store`` (a writer) with ``function`` and commit its values as version
    ``version`` of ``column``, one ``update`` per chunk of ``chunk`` row ids.

    ``function(batch)`` gets ``store.read(rows, columns)`` (default: every column) plus
    ``batch["rows"]``, the row ids, and returns one value per row, in that order (a per-token
    column: one list per row, as long as the row's completion). Each chunk is committed with the
    token ``rescore:COLUMN@VERSION:FIRST_ROW``; rows a committed token holds are skipped before the
    function is called, so a run killed anywhere and started again with the same ``version`` and
    ``chunk`` scores each row once and redoes no chunk. Returns counts (``scored``: rows scored now,
    ``skipped``: rows an earlier run scored).

    >>> import tempfile
    >>> from diskreplay import ReplayStore
    >>> store = ReplayStore(tempfile.mkdtemp())
    >>> _ = store.extend({"prompt_id": [0, 0, 1], "completion_ids": [[5, 6], [7], [8]], "rewards": [0.0] * 3})
    >>> def length(batch):
    ...     return [len(batch["completion_ids"][i]) for i in range(len(batch["rows"]))]
    >>> res = rescore(store, "rewards", length, version="length", chunk=2)
    >>> res["scored"], store.read([0, 1, 2], ["rewards@length"])["rewards@length"].tolist()
    (3, [2.0, 1.0, 1.0])
    >>> rescore(store, "rewards", length, version="length", chunk=2)["skipped"]
    3
    """
    what = f"--python {name}" if name else "the scoring function"
    why = version_problem(version)
    if why is not None:  # refused before the function runs, not by the first chunk's commit
        raise ArgumentError(f"version: {why}")
    if chunk < 1:
        raise ArgumentError(f"chunk must be a positive number of rows, got {chunk}")
    schema = store.schema
    fixed = {store.group_key, "prompt_ids", "completion_ids"}
    if column in fixed:
        raise ArgumentError(f"--column {column!r}: the group key and the token ids are what a row is and cannot be "
                            "rescored; write the scores to another column (e.g. --column rewards)")
    names = list(store.columns if columns is None else columns)
    if ROWS_KEY in names:
        raise ArgumentError(f"--columns names {ROWS_KEY!r}, the batch key that holds the row ids; leave it out")
    spec = schema[column] if schema is not None and column in schema.names else None
    rows_all = np.asarray(store.row_ids(), dtype=np.int64)
    res: Dict[str, Any] = {"path": store.path, "column": column, "version": version, "rows": len(rows_all),
                           "scored": 0, "skipped": 0, "chunks": 0, "meta": dict(meta or {})}
    from ..export.outputs import progress_bar

    # chunks aligned on row ids (not on positions among live rows), so that a run after eviction or
    # appends cuts the rows it shares with an earlier run where the earlier run did: its tokens match
    cuts = np.flatnonzero(np.diff(rows_all // chunk)) + 1
    with progress_bar(len(rows_all), f"rescore {column}@{version}", progress) as bar:
        for rows in np.split(rows_all, cuts) if len(rows_all) else []:
            while len(rows):
                token = f"rescore:{column}@{version}:{rows[0]}"
                done = store.committed_rows(token)
                if done is None:
                    break
                left = rows[~np.isin(rows, done)]
                res["skipped"] += len(rows) - len(left)
                bar.update(len(rows) - len(left))
                rows = left
            if not len(rows):
                continue
            batch = dict(store.read(rows, names)) if names else {}
            batch[ROWS_KEY] = rows
            try:
                values = function(batch)
            except Exception as exc:
                raise ArgumentError(f"{what} raised {type(exc).__name__}: {exc} on rows {rows[0]}..{rows[-1]} of "
                                    f"column {column!r}; fix it (DISKREPLAY_DEBUG=1 shows the traceback) and run "
                                    "the same command again: the chunks committed are skipped") from exc
            values = _check_values(values, rows, column, spec, what)
            try:
                store.update(rows, {column: values}, token=token, version=version, meta=meta)
            except (BatchError, SchemaError) as exc:
                raise ArgumentError(f"{what}: its values for rows {rows[0]}..{rows[-1]} of column {column!r} were "
                                    f"refused: {exc}") from exc
            if spec is None and store.schema is not None:
                spec = store.schema[column]
            res["scored"] += len(rows)
            res["chunks"] += 1
            bar.update(len(rows))
    return res


def version_name(text: str) -> str:
    """``--version``: a version name (argparse's type: anything else is a usage error)."""
    why = version_problem(text)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return text


def meta_object(text: str) -> Dict[str, Any]:
    """``--meta``: a JSON object (argparse's type: anything else is a usage error)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object (e.g. '{{\"scorer\": \"judge-v2\"}}'): {exc}")
    if not isinstance(doc, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object (e.g. '{{\"scorer\": \"judge-v2\"}}'), got {text!r}")
    return doc


def cmd_rescore(args: argparse.Namespace) -> int:
    from ..store import ReplayStore

    function = load_function(args.python)
    meta = {"scorer": args.python,
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    meta.update(args.meta or {})
    if is_remote_arg(args):
        store = open_remote(args, readonly=False)
    else:
        store = ReplayStore(store_of(args))  # the check first: a writer's open creates a missing store
    with store:
        res = rescore(store, args.column, function, version=args.version, columns=args.columns,
                      chunk=args.chunk, meta=meta, progress=show_progress(args), name=args.python)
    text = (f"rescored {res['scored']:,} of {res['rows']:,} live rows of {args.path}: {res['column']}@{res['version']}"
            f" ({res['chunks']} chunk{'' if res['chunks'] == 1 else 's'} committed")
    if res["skipped"]:
        text += f"; {res['skipped']:,} rows an earlier run scored were skipped"
    emit(args, res, text + ")")
    return 0
