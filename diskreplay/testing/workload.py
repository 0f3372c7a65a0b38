"""Batches whose content is a pure function of ``(writer, step)``, so that any row read back
can be checked bit-exact after crashes, rebases and retries, wherever it landed."""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ..store import ReplayStore


def batch_for(writer: int, step: int, rows: Optional[int] = None) -> Dict[str, Any]:
    """The batch writer ``writer`` sends at ``step`` (1-8 rows unless ``rows`` is given).

    >>> b = batch_for(2, 5, rows=3); b["tag"][0], len(b["completion_ids"])
    ('w2s5n3r0', 3)
    """
    rng = np.random.default_rng(writer * 1_000_003 + step)
    drawn = int(rng.integers(1, 9))  # always drawn: the content must not depend on whether rows is given
    n = int(rows) if rows is not None else drawn
    lens = rng.integers(0, 12, size=n)
    return {
        "prompt_id": np.full(n, writer * 1_000_000 + step // 2, dtype=np.int64),
        "completion_ids": [rng.integers(0, 50_000, size=int(k)).astype(np.int32) for k in lens],
        "rewards": rng.random(n).astype(np.float32),
        "tag": [f"w{writer}s{step}n{n}r{i}" for i in range(n)],
    }


def token_for(writer: int, step: int) -> str:
    return f"w{writer}:{step}"


def check_rows(store: ReplayStore, rows: Any) -> Optional[str]:
    """None when every row in ``rows`` is bit-exact for the batch its tag names, else what differs."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return None
    got = store.read(rows)
    for i, tag in enumerate(got["tag"]):
        w, rest = tag[1:].split("s", 1)
        s, rest = rest.split("n", 1)
        n, r = rest.split("r", 1)
        want = batch_for(int(w), int(s), int(n))
        j = int(r)
        if got["prompt_id"][i] != want["prompt_id"][j] or got["rewards"][i] != want["rewards"][j] \
                or not np.array_equal(got["completion_ids"][i], want["completion_ids"][j]):
            return f"row {int(rows[i])} ({tag}) differs from what was written"
    return None


def expected_rows(ids):
    """The batch whose rows are exactly the rows with these ids (content is a function of the id).

    The durability tests and ``tools/faults.py`` write these rows and, after any fault, check every
    row a store serves against them (numpy only: the tests also paste its source into child scripts).

    >>> rows = expected_rows([0, 1])
    >>> rows["tag"], [len(c) for c in rows["completion_ids"]]
    (['row-0', 'row-1'], [0, 3])
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)

    def tokens(r, salt, n):
        return ((np.arange(n, dtype=np.int64) * 2654435761 + int(r) * 40503 + salt * 977) % 50021).astype(np.int32)

    plen = 1 + (ids * 5) % 7
    clen = (ids * 3) % 10  # some completions are empty
    return {
        "prompt_id": ids // 3,
        "prompt_ids": [tokens(r, 1, n) for r, n in zip(ids, plen)],
        "completion_ids": [tokens(r, 2, n) for r, n in zip(ids, clen)],
        "old_per_token_logps": [tokens(r, 3, n).astype(np.float32) / np.float32(-50021.0) for r, n in zip(ids, clen)],
        "rewards": ((ids * 7) % 11).astype(np.float32) / np.float32(10),
        "tag": [f"row-{r}" for r in ids.tolist()],
    }


def rows_mismatch(got, ids):
    """None when ``got`` (a ``store.read`` result) is bit-exact for ``ids``, else what differs
    (numpy only, like :func:`expected_rows`: the tests paste its source into child scripts).

    >>> import tempfile, shutil
    >>> d = tempfile.mkdtemp()
    >>> with ReplayStore(d) as store:
    ...     _ = store.extend(expected_rows([0, 1, 2]))
    ...     rows_mismatch(store.read([1, 2]), [1, 2]) is None, rows_mismatch(store.read([1]), [2])
    (True, 'prompt_ids: row 2 has 6 elements, expected 4')
    >>> shutil.rmtree(d)
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return None
    for name, want in expected_rows(ids).items():
        col = got.get(name, "missing")
        if isinstance(col, str):
            return f"column {name} missing"
        if name == "tag":
            if list(col) != want:
                return f"{name} differs"
        elif isinstance(want, list):
            if col is None or len(col) != len(want):
                return f"{name}: wrong number of rows"
            lengths = np.array([len(w) for w in want], dtype=np.int64)
            got_lengths = np.diff(np.asarray(col.offsets))
            if not np.array_equal(got_lengths, lengths):
                bad = int(np.flatnonzero(got_lengths != lengths)[0])
                return f"{name}: row {int(ids[bad])} has {got_lengths[bad]} elements, expected {lengths[bad]}"
            values = np.asarray(col.values)[int(col.offsets[0]):int(col.offsets[-1])]
            flat = np.concatenate(want)
            if values.dtype != flat.dtype or values.tobytes() != flat.tobytes():
                return f"{name}: values differ"
        else:
            arr = np.asarray(col)
            if arr.dtype != want.dtype or arr.tobytes() != want.tobytes():
                return f"{name} differs"
    return None
