"""Training sets curated from groups: chosen/rejected preference pairs and best-of-n SFT sets.

Both read one reward per live row (streamed, a vector reward averaged over
reward functions), pick rows per group with one vectorised sort, then read
only the picked rows, a bounded batch at a time.

Layouts follow TRL (1.16). ``DPOTrainer`` takes text only: ``prompt``,
``chosen``, ``rejected``, which it tokenizes itself (a pre-tokenized set is
refused: ``KeyError: 'chosen'``), so a pair set for it needs a tokenizer;
without one a pair set holds ``prompt_ids``, ``chosen_ids``,
``rejected_ids``, what TRL's ``DataCollatorForPreference`` reads in a loop of
one's own. ``SFTTrainer`` takes ``prompt`` / ``completion`` text (its default
then trains on the completion only), or a pre-tokenized set: ``input_ids``
with ``labels``, used as they are; a ``completion_mask`` alone counts only
under ``completion_only_loss=True``, which is off by default for such a set.
So a best-of-n set without a tokenizer carries ``labels`` (-100 on the prompt
tokens): TRL's defaults train on the completion only.

Text is decoded by :meth:`TextDecoder.texts`: ``prompt + completion``
tokenizes back to the stored ids where the tokenizer allows it, and the
result counts (``retokenize_mismatches``) and names the rows where it does not.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from ..schema import RAGGED
from ..store import ReplayStore
from ._common import (CHUNK_BYTES, Exclusions, Retokenized, StoreLike, make_filter, open_store, per_row_value,
                      plan_chunks, resolve_tokenizer)
from .outputs import ExportError, output_format, progress_bar
from .writers import write_tables

CURATE_FORMATS = ("jsonl", "parquet", "hf")
#: the label of a token left out of the loss (PyTorch's cross-entropy default, which TRL's trainers use)
IGNORE_INDEX = -100
_READ_BATCH = 4096


def _selection(st: ReplayStore, group_key: Optional[str], reward_key: str, policy_versions: Any,
               progress: bool, what: str, excluded: Exclusions, version_key: Optional[str] = None
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, List[Any], str, Optional[np.ndarray]]:
    """``(rows, rewards, group ids, group keys, key name, policy versions)`` of the eligible live rows.

    Rows are listed group by group in the group index's order (groups by first
    appearance, rows oldest first within a group). A row without a reward, or
    without ``prompt_ids`` where the store added that column after its first
    commit (its older rows have none: a pair or an SFT example without its
    prompt would train on the wrong thing), is not eligible; nor is a row
    ``excluded`` leaves out (counted there). The versions (of ``version_key``)
    are read only when it is given.
    """
    if not len(st):
        raise ExportError(f"the store at {st.path} is empty")
    key = group_key or st.group_key
    if key is None:
        raise ExportError(f"the store at {st.path} has no group key; pass --group-key COLUMN to group rows")
    if reward_key not in st.columns:
        raise ExportError(f"the store has no reward column {reward_key!r} (columns: {', '.join(st.columns)}); "
                          "pass --reward-key")
    spec = st.schema[reward_key]
    if spec.kind == RAGGED or spec.dtype in ("string", "bool"):
        raise ExportError(f"reward column {reward_key!r} is a {spec.kind} column of {spec.dtype}; expected "
                          "a number (or a vector of numbers) per row")
    if "completion_ids" not in st.columns:
        raise ExportError(f"{what} needs a completion_ids column; the store has {', '.join(st.columns)}")
    per_row = [c for c in st.columns if st.schema[c].kind == "scalar"]
    if key not in per_row:
        what = "not a column of the store" if key not in st.columns else f"a {st.schema[key].kind} column"
        raise ExportError(f"cannot group by {key!r}: it is {what}; --group-key takes a per-row column "
                          f"({', '.join(per_row)})")
    if version_key is not None and (version_key not in st.columns or st.schema[version_key].kind != "scalar"
                                    or st.schema[version_key].dtype != "int64"):
        raise ExportError(f"pairing within policy versions needs an int64 per-row column {version_key!r}; the "
                          f"store has {', '.join(st.columns)} (leave the version window out to pair across them)")
    gi = st.group_index(key)
    flt = make_filter(policy_versions, None, None, reward_key)
    flt.check(st)
    head = st.head
    span = st.next_row - head  # (len(st) but for the rows of holes, which no group holds)
    rewards = np.empty(span, dtype=np.float64)
    versions = np.empty(span, dtype=np.int64) if version_key is not None else None
    eligible = np.ones(span, dtype=bool)
    cols = [reward_key] + flt.columns() + ([version_key] if version_key is not None else [])
    late_prompt = "prompt_ids" in st.schema.late
    with progress_bar(len(st), f"{what}: rewards", progress) as bar:
        for lo, hi in (piece for chunk in plan_chunks(st, CHUNK_BYTES) for piece in chunk):
            data = st.read(np.arange(lo, hi), list(dict.fromkeys(cols + (["prompt_ids"] if late_prompt else []))))
            rewards[lo - head:hi - head] = per_row_value(data[reward_key])
            if versions is not None:
                versions[lo - head:hi - head] = data[version_key]
            if flt.active:
                eligible[lo - head:hi - head] = flt.mask(data, hi - lo)
            if late_prompt:
                prompt = data["prompt_ids"]
                has = (np.zeros(hi - lo, dtype=bool) if prompt is None else
                       np.ones(hi - lo, dtype=bool) if prompt.validity is None else np.asarray(prompt.validity))
                eligible[lo - head:hi - head] &= has
            bar.update(hi - lo)
    gid = np.repeat(np.arange(len(gi), dtype=np.int64), gi.counts)
    rows = gi.rows
    keep = eligible[rows - head] & ~np.isnan(rewards[rows - head])
    out = keep & excluded.mask(rows)
    excluded.left_out += int(out.sum())
    keep &= ~out
    return (rows[keep], rewards[rows - head][keep], gid[keep], list(gi.keys), key,
            None if versions is None else versions[rows - head][keep])


def _version_windows(gid: np.ndarray, versions: np.ndarray, window: int) -> Tuple[np.ndarray, np.ndarray]:
    """Split each group by windows of ``window`` policy versions (``version // window``: 1 is one version
    each): ``(sub-group id of each row, group id of each sub-group)``, sub-groups ordered by group, then window.

    >>> sub, group = _version_windows(np.array([0, 0, 0, 1]), np.array([3, 0, 3, 7]), 1)
    >>> sub.tolist(), group.tolist()
    ([1, 0, 1, 2], [0, 0, 1])
    """
    if not len(gid):
        return gid, np.zeros(0, dtype=np.int64)
    pairs, sub = np.unique(np.stack([gid, versions // window]), axis=1, return_inverse=True)
    return sub.reshape(-1).astype(np.int64), pairs[0].astype(np.int64)


def _ranked(gid: np.ndarray, r: np.ndarray, descending: bool) -> Tuple[np.ndarray, np.ndarray]:
    """Order by (group, reward, position) and each row's rank inside its group.

    Position breaks ties, so on equal rewards the oldest row ranks first.
    """
    pos = np.arange(len(gid))
    order = np.lexsort((pos, -r if descending else r, gid))
    g = gid[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if len(g) else np.zeros(0, dtype=np.int64)
    rank = pos - np.repeat(starts, np.diff(np.r_[starts, len(g)]))
    return order, rank


def _key_array(keys: List[Any], gid: np.ndarray) -> pa.Array:
    return pa.array([keys[g] for g in gid.tolist()])


def _batches(n: int) -> Iterator[slice]:
    for a in range(0, n, _READ_BATCH):
        yield slice(a, min(n, a + _READ_BATCH))


def _ids(col: Any, n: int) -> pa.Array:
    if col is None:
        return pa.nulls(n, pa.list_(pa.int32()))
    off = col.offsets - col.offsets[0]
    vals = col.values[int(col.offsets[0]):int(col.offsets[-1])]
    mask = None if col.validity is None else pa.array(~col.validity)
    return pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), pa.array(vals.astype(np.int32, copy=False)),
                                    mask=mask)


def _prompt_column(st: ReplayStore, key: str, text: bool) -> Optional[str]:
    if "prompt_ids" in st.columns:
        return "prompt_ids"
    if text and st.schema[key].dtype == "string":
        return None  # the group key is the prompt text
    if text:
        raise ExportError("the store has no prompt_ids column and its group key is not prompt text; "
                          "nothing to decode as the prompt")
    return None


def _key_field(key: str, taken: List[str]) -> str:
    """The output name of the group key column: its own, unless an output column has it (a store
    grouped by its ``prompt`` text: two ``prompt`` columns made a Parquet file pyarrow cannot read).

    >>> _key_field("prompt_id", ["prompt"]), _key_field("prompt", ["prompt", "chosen"])
    ('prompt_id', 'group_prompt')
    """
    name = key
    while name in taken:
        name = f"group_{name}"
    return name


def preference_pairs(store: StoreLike, out: Any, *, min_margin: float = 0.0, format: Optional[str] = None,
                     tokenizer: Any = None, skip_special_tokens: bool = False, group_key: Optional[str] = None,
                     reward_key: str = "rewards", policy_versions: Any = None, overwrite: bool = False,
                     progress: bool = False, force: bool = False, version_window: Optional[int] = None,
                     version_key: str = "policy_version", include_excluded: bool = False) -> Dict[str, Any]:
    """Write one chosen/rejected pair per group: its highest- vs lowest-reward completion.

    Groups with fewer than two eligible rows, or whose margin (highest minus
    lowest reward) is not above 0 and at least ``min_margin``, give no pair;
    on equal rewards the oldest row is picked. By default a group pools its
    rows of every policy version, so a pair may set a completion of an early
    policy against one of a late policy; ``version_window=W`` pairs only rows
    of the same window of ``W`` policy versions (``version_key // W``; ``1``:
    the same version), one pair per group and window, and adds the
    ``chosen_policy_version`` / ``rejected_policy_version`` columns. Rows the
    store records as excluded (a resumed TRL run's discarded timeline) are
    never paired unless ``include_excluded`` (the result's ``excluded_rows``
    counts the eligible rows left out). With a ``tokenizer`` (local
    directory) the columns are ``prompt``, ``chosen``, ``rejected`` text, which
    TRL's ``DPOTrainer`` takes as it is, and which tokenizes back to the stored
    ids (:meth:`TextDecoder.texts`; ``retokenize_mismatches`` counts the pairs
    where it cannot, and ``warnings`` names them); without, ``prompt_ids``,
    ``chosen_ids``, ``rejected_ids``: what TRL's ``DataCollatorForPreference``
    reads in a training loop of one's own (``DPOTrainer`` refuses ids). Always added: the group
    key, ``chosen_reward``, ``rejected_reward``, ``margin``, ``chosen_row``,
    ``rejected_row``. ``format`` is ``jsonl``, ``parquet`` or ``hf``; by default
    it comes from ``out``'s name as for :func:`export` (``force`` as there).

    >>> import tempfile, os, json
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(os.path.join(d, "s")) as s:
    ...     _ = s.extend({"prompt_id": [1, 1, 1], "prompt_ids": [[9], [9], [9]],
    ...                   "completion_ids": [[5], [6], [7]], "rewards": [0.2, 1.0, 0.0]})
    >>> preference_pairs(os.path.join(d, "s"), os.path.join(d, "p.jsonl"))["pairs"]
    1
    >>> row = json.loads(open(os.path.join(d, "p.jsonl")).readline())
    >>> row["prompt_ids"], row["chosen_ids"], row["rejected_ids"], row["margin"]
    ([9], [6], [7], 1.0)
    """
    format = output_format(out, format, formats=CURATE_FORMATS, force=force)
    if version_window is not None and (isinstance(version_window, bool) or not isinstance(
            version_window, (int, np.integer)) or version_window <= 0):
        raise ExportError(f"version_window (--version-window) must be a positive number of policy versions, got "
                          f"{version_window!r}")
    with open_store(store) as st:
        excluded = Exclusions.of(st, include_excluded)
        rows, r, gid, keys, key, versions = _selection(st, group_key, reward_key, policy_versions, progress,
                                                       "pairs", excluded,
                                                       version_key if version_window is not None else None)
        decoder = resolve_tokenizer(tokenizer, skip_special_tokens)
        text = decoder is not None
        prompt_col = _prompt_column(st, key, text)
        # the pools a pair is drawn from: the groups, or each group's windows of policy versions
        if versions is None:
            pool, group_of = gid, np.arange(len(keys), dtype=np.int64)
        else:
            pool, group_of = _version_windows(gid, versions, int(version_window))
        desc, rank_d = _ranked(pool, r, True)
        asc, rank_a = _ranked(pool, r, False)
        best, worst = desc[rank_d == 0], asc[rank_a == 0]  # one each per pool, in pool order
        counts = np.bincount(pool, minlength=len(group_of))
        with np.errstate(invalid="ignore"):  # inf - inf: a group of +inf rewards has no pair (NaN margin)
            margin = r[best] - r[worst]
        # at the precision rewards are stored in (float32): 0.5 - 0.1 is 0.39999999 in float64, and
        # --min-margin 0.4 must keep that pair
        ok = (counts[pool[best]] >= 2) & (margin > 0) & (margin.astype(np.float32) >= np.float32(min_margin))
        best, worst, margin = best[ok], worst[ok], margin[ok]
        key_type = st.schema[key].arrow_type
        seq = pa.string() if text else pa.list_(pa.int32())
        names = ["prompt", "chosen", "rejected"] if text else ["prompt_ids", "chosen_ids", "rejected_ids"]
        extra = ["chosen_reward", "rejected_reward", "margin", "chosen_row", "rejected_row"]
        version_cols = ["chosen_policy_version", "rejected_policy_version"] if versions is not None else []
        fields = [pa.field(names[0], seq)] if (prompt_col is not None or text) else []
        fields += [pa.field(names[1], seq), pa.field(names[2], seq),
                   pa.field(_key_field(key, names + extra + version_cols), key_type),
                   pa.field("chosen_reward", pa.float64()), pa.field("rejected_reward", pa.float64()),
                   pa.field("margin", pa.float64()), pa.field("chosen_row", pa.int64()),
                   pa.field("rejected_row", pa.int64())] + [pa.field(c, pa.int64()) for c in version_cols]
        schema = pa.schema(fields)
        checked = Retokenized()

        def tables() -> Iterator[pa.Table]:
            with progress_bar(len(best), "pairs", progress, unit="pairs") as bar:
                for sl in _batches(len(best)):
                    b, w = best[sl], worst[sl]
                    n = len(b)
                    cols = ["completion_ids"] + ([prompt_col] if prompt_col else [])
                    cd = st.read(rows[b], cols)
                    rd = st.read(rows[w], ["completion_ids"])
                    gk = _key_array(keys, group_of[pool[b]])
                    if text:
                        prompt, (chosen, rejected), bad = decoder.texts(
                            cd[prompt_col] if prompt_col else None, [cd["completion_ids"], rd["completion_ids"]], n,
                            [prompt_col or key, "completion_ids", "completion_ids"])
                        checked.add(bad, [f"chosen_row {a} / rejected_row {z}" for a, z in zip(rows[b], rows[w])])
                        arrays = [pa.array(prompt if prompt_col else gk.to_pylist(), pa.string()),
                                  pa.array(chosen, pa.string()), pa.array(rejected, pa.string())]
                    else:
                        arrays = ([_ids(cd[prompt_col], n)] if prompt_col else []) + [
                            _ids(cd["completion_ids"], n), _ids(rd["completion_ids"], n)]
                    arrays += [gk.cast(key_type), pa.array(r[b]), pa.array(r[w]), pa.array(margin[sl]),
                               pa.array(rows[b]), pa.array(rows[w])]
                    if versions is not None:
                        arrays += [pa.array(versions[b]), pa.array(versions[w])]
                    bar.update(n)
                    yield pa.Table.from_arrays(arrays, schema=schema)

        n = write_tables(format, out, schema, tables(), overwrite=overwrite)
    res = {"path": os.path.abspath(os.fspath(out)), "format": format, "pairs": n, "groups": len(keys),
           "columns": schema.names, "excluded_rows": excluded.left_out,
           "excluded_ranges": excluded.report()["ranges"]}
    if versions is not None:
        res["version_windows"] = len(group_of)  # the pools pairs were drawn from
    return _retokenize_report(res, decoder, checked, "pairs")


def _retokenize_report(res: Dict[str, Any], decoder: Any, checked: Retokenized, unit: str) -> Dict[str, Any]:
    """``res`` with how many rows of a text export do not tokenize back to their ids (and a warning naming them)."""
    if decoder is not None:
        res["retokenize_mismatches"] = checked.bad
        note = checked.warning(unit, decoder.path, decoder.skip_special_tokens)
        if note:
            res.setdefault("warnings", []).append(note)
    return res


def best_of_n(store: StoreLike, out: Any, *, k: int = 1, min_reward: Optional[float] = None,
              format: Optional[str] = None, tokenizer: Any = None, skip_special_tokens: bool = False,
              group_key: Optional[str] = None, reward_key: str = "rewards", policy_versions: Any = None,
              overwrite: bool = False, progress: bool = False, force: bool = False,
              include_excluded: bool = False) -> Dict[str, Any]:
    """Write the ``k`` highest-reward completions of each group (reward ``>= min_reward``) as an SFT set.

    With a ``tokenizer`` the columns are ``prompt`` / ``completion`` text,
    which tokenizes back to the stored ids (:meth:`TextDecoder.texts`;
    ``retokenize_mismatches`` counts the rows where it cannot); TRL's
    ``SFTTrainer`` trains on the completion only by default on it. Without,
    ``prompt_ids``, ``completion_ids`` and the pre-tokenized ``input_ids``
    (prompt + completion) with ``labels`` (-100 on prompt tokens, the ids on
    completion tokens: ``SFTTrainer`` uses them as they are, so its defaults
    train on the completion only) and ``completion_mask`` (1 on completion
    tokens, for other trainers). Always
    added: the group key, ``reward``, ``rank`` (0 = best in its group) and
    ``row``. Ties go to the oldest row. Rows the store records as excluded (a
    resumed TRL run's discarded timeline) are never picked unless
    ``include_excluded`` (``excluded_rows`` in the result counts the eligible
    rows left out). ``format`` is ``jsonl``, ``parquet`` or ``hf``; by default
    it comes from ``out``'s name as for :func:`export`.

    >>> import tempfile, os, json
    >>> from diskreplay import ReplayStore
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(os.path.join(d, "s")) as s:
    ...     _ = s.extend({"prompt_id": [1, 1, 2], "prompt_ids": [[9], [9], [8]],
    ...                   "completion_ids": [[5], [6], [7]], "rewards": [0.2, 1.0, 0.0]})
    >>> best_of_n(os.path.join(d, "s"), os.path.join(d, "b.jsonl"), k=1, min_reward=0.1)["rows"]
    1
    >>> row = json.loads(open(os.path.join(d, "b.jsonl")).readline())
    >>> row["input_ids"], row["labels"], row["completion_mask"], row["reward"]
    ([9, 6], [-100, 6], [0, 1], 1.0)
    """
    format = output_format(out, format, formats=CURATE_FORMATS, force=force)
    if not isinstance(k, (int, np.integer)) or k <= 0:
        raise ExportError(f"k must be a positive number of completions per group, got {k!r}")
    with open_store(store) as st:
        excluded = Exclusions.of(st, include_excluded)
        rows, r, gid, keys, key, _ = _selection(st, group_key, reward_key, policy_versions, progress, "best-of-n",
                                                excluded)
        decoder = resolve_tokenizer(tokenizer, skip_special_tokens)
        text = decoder is not None
        prompt_col = _prompt_column(st, key, text)
        if min_reward is not None:
            sel = r >= float(min_reward)
            rows, r, gid = rows[sel], r[sel], gid[sel]
        order, rank = _ranked(gid, r, True)
        pick = order[rank < k]
        ranks = rank[rank < k]
        key_type = st.schema[key].arrow_type
        if text:
            fields = [pa.field("prompt", pa.string()), pa.field("completion", pa.string())]
        else:
            ids = pa.list_(pa.int32())
            fields = ([pa.field("prompt_ids", ids)] if prompt_col else []) + [pa.field("completion_ids", ids)]
            if prompt_col:
                fields += [pa.field("input_ids", ids), pa.field("labels", ids),
                           pa.field("completion_mask", pa.list_(pa.int8()))]
        fields += [pa.field(_key_field(key, [f.name for f in fields] + ["reward", "rank", "row"]), key_type),
                   pa.field("reward", pa.float64()), pa.field("rank", pa.int64()), pa.field("row", pa.int64())]
        schema = pa.schema(fields)
        checked = Retokenized()

        def tables() -> Iterator[pa.Table]:
            with progress_bar(len(pick), "best-of-n", progress) as bar:
                for sl in _batches(len(pick)):
                    p = pick[sl]
                    n = len(p)
                    data = st.read(rows[p], ["completion_ids"] + ([prompt_col] if prompt_col else []))
                    gk = _key_array(keys, gid[p])
                    if text:
                        prompt, (completion,), bad = decoder.texts(
                            data[prompt_col] if prompt_col else None, [data["completion_ids"]], n,
                            [prompt_col or key, "completion_ids"])
                        checked.add(bad, [f"row {i}" for i in rows[p]])
                        arrays = [pa.array(prompt if prompt_col else gk.to_pylist(), pa.string()),
                                  pa.array(completion, pa.string())]
                    else:
                        comp = _ids(data["completion_ids"], n)
                        arrays = [comp]
                        if prompt_col:
                            prm = _ids(data[prompt_col], n)
                            arrays = [prm, comp] + list(_sft_ids(data[prompt_col], data["completion_ids"], n))
                    arrays += [gk.cast(key_type), pa.array(r[p]), pa.array(ranks[sl]), pa.array(rows[p])]
                    bar.update(n)
                    yield pa.Table.from_arrays(arrays, schema=schema)

        n = write_tables(format, out, schema, tables(), overwrite=overwrite)
    res = {"path": os.path.abspath(os.fspath(out)), "format": format, "rows": n, "groups": len(keys),
           "columns": schema.names, "excluded_rows": excluded.left_out,
           "excluded_ranges": excluded.report()["ranges"]}
    return _retokenize_report(res, decoder, checked, "rows")


def _sft_ids(prompt: Any, completion: Any, n: int) -> Tuple[pa.Array, pa.Array, pa.Array]:
    """``input_ids`` (prompt then completion), ``labels`` (-100 on prompt tokens: TRL's and PyTorch's
    ignore index) and ``completion_mask``, without a per-token loop."""
    def parts(col: Any) -> Tuple[np.ndarray, np.ndarray]:
        if col is None:
            return np.zeros(0, dtype=np.int32), np.zeros(n, dtype=np.int64)
        lengths = np.diff(col.offsets).astype(np.int64)
        if col.validity is not None:
            lengths = np.where(col.validity, lengths, 0)
            keep = np.repeat(col.validity, np.diff(col.offsets))
            vals = col.values[int(col.offsets[0]):int(col.offsets[-1])][keep]
        else:
            vals = col.values[int(col.offsets[0]):int(col.offsets[-1])]
        return vals.astype(np.int32, copy=False), lengths

    pv, pl = parts(prompt)
    cv, cl = parts(completion)
    total = pl + cl
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(total, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=np.int32)
    mask = np.zeros(int(offsets[-1]), dtype=np.int8)
    # element j of row i sits at offsets[i] + j; prompt tokens first, then completion tokens
    p_dst = np.repeat(offsets[:-1], pl) + (np.arange(len(pv)) - np.repeat(np.cumsum(pl) - pl, pl))
    c_dst = np.repeat(offsets[:-1] + pl, cl) + (np.arange(len(cv)) - np.repeat(np.cumsum(cl) - cl, cl))
    values[p_dst] = pv
    values[c_dst] = cv
    mask[c_dst] = 1
    labels = np.full(len(values), IGNORE_INDEX, dtype=np.int32)
    labels[c_dst] = cv
    off32 = pa.array(offsets.astype(np.int32))
    return (pa.ListArray.from_arrays(off32, pa.array(values)), pa.ListArray.from_arrays(off32, pa.array(labels)),
            pa.ListArray.from_arrays(off32, pa.array(mask)))
