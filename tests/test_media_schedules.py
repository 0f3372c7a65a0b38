"""Media columns under the many-writer schedules (docs/FORMAT.md, "Media" and "Many writers"): writer
processes that share a small pool of contents (so blobs are shared, folded by the later of two commits
that both wrote one, freed by eviction and stored again) are stopped for longer than the retention,
killed, and one runs its wall clock an hour ahead (its clean-up takes every file it may). A fresh reader
then finds every acknowledged batch once at the rows its ``extend`` returned, every row's media bit-exact,
every blob the newest manifest names on disk, and ``verify`` clean."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

from diskreplay import Media, MediaReader, ReplayStore
from diskreplay.testing.workload import batch_for, check_rows
from diskreplay.verify import verify_store
from tests.campaign import run_campaign

RETAIN = 2  # seconds: generations and unnamed blobs are collected within the run

FREQUENT, RARE = 3, 12  # contents 0-2 are in most batches; 3-14 come rarely, so eviction frees them


def content(k: int):
    """``(value, mime)`` of pool content ``k``: encoded bytes of several sizes and types, the same
    bytes under two types (two blobs), and arrays (stored with their dtype and shape)."""
    if k == 4:
        return np.arange(6 * 7 * 3, dtype=np.float32).reshape(6, 7, 3) / 7, "image/png"
    if k == 9:
        return (np.arange(40 * 30, dtype=np.int64) % 251).astype(np.uint8).reshape(40, 30), "image/png"
    if k == 3:  # content 0's bytes as another type
        return content(0)[0], "video/mp4"
    body = hashlib.sha256(b"media%d" % k).digest() * (16 + 97 * k)
    return body + bytes([k]), "audio/wav" if k % 5 == 1 else "image/png"


def media_keys(w: int, step: int, n: int):
    """The pool contents of batch ``(w, step)``'s ``n`` rows: rows come in pairs sharing one content
    (a group's samples sharing their prompt's image)."""
    rng = np.random.default_rng(7_000_003 + w * 1009 + step)
    keys = []
    for i in range(n):
        if i % 2 == 0:
            keys.append(int(rng.integers(0, FREQUENT)) if rng.random() < 0.6
                        else FREQUENT + int(rng.integers(0, RARE)))
        else:
            keys.append(keys[-1])
    return keys


def media_batch(w: int, step: int):
    """``batch_for(w, step)`` with a media column ``image``."""
    batch = batch_for(w, step)
    values = [content(k) for k in media_keys(w, step, len(batch["tag"]))]
    batch["image"] = Media([v for v, _ in values], mime=[m for _, m in values])
    return batch




def _expected_media_ok(got, k):
    want, _ = content(k)
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape \
            and np.array_equal(got, want)
    return bytes(got) == want


def _exactly_once_with_media(path, acked):
    """Every acknowledged ``(writer, step) -> rows`` is in the store once at those rows (the live part of
    them: eviction takes the oldest), nothing nobody acknowledged is, each row's media is bit-exact, one
    entry per hash and every blob file the newest manifest names is there, and verify is clean."""
    with ReplayStore(path, readonly=True) as store:
        rows = store.row_ids()
        head = store.head
        assert check_rows(store, rows) is None
        got = store.read(rows, ["tag", "image"])
        m = store.manifest
        entries = {e.hash: e for e in m.media}
        assert len(entries) == len(m.media), "a hash named twice"
        missing = [e.file for e in m.media if not os.path.exists(os.path.join(path, e.file))]
        assert not missing, f"blobs the newest manifest names are gone: {missing}"
        reader = MediaReader(store)
        values = reader.batch(got["image"])
        wrong = []
        for r, tag, value in zip(rows.tolist(), got["tag"], values):
            w, rest = tag[1:].split("s", 1)
            s, rest = rest.split("n", 1)
            n, i = rest.split("r", 1)
            k = media_keys(int(w), int(s), int(n))[int(i)]
            if not _expected_media_ok(value, k):
                wrong.append((r, tag, k))
        assert not wrong, f"rows whose media differ from what was written: {wrong[:10]}"
        reader.close()
    where = {}
    for r, tag in zip(rows.tolist(), got["tag"]):
        where.setdefault(tag[: tag.index("r")], []).append(r)
    for (w, step), ids in acked.items():
        want = batch_for(w, step)["tag"]
        live = [r for r in ids if r >= head]
        found = where.pop(want[0][: want[0].index("r")], [])
        assert found == live, ((w, step), found, ids, head)
    assert not where, f"rows nobody acknowledged: {sorted(where)}"
    report = verify_store(path)
    assert report["ok"], report["problems"]
    return len(rows), len(m.media)


def test_a_blob_first_named_by_an_append_delta_outlives_the_retention(tmp_path):
    """The smallest schedule of the campaign below: one writer on a multi-writer store appends new
    content (commits written as append deltas), and once the retention passed a clean-up (a writer's
    open sweeps) must keep every blob the newest manifest names."""
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True, retain_seconds=RETAIN).close()
    with ReplayStore(path) as store:
        for k in range(4):  # each commit names one new blob
            value, mime = content(FREQUENT + k)
            store.extend({"prompt_id": np.array([k, k]), "completion_ids": [[1], [2]],
                          "image": Media([value, value], mime=mime)}, token=f"t{k}")
        named = [e.file for e in store.manifest.media]
    time.sleep(RETAIN + 0.5)
    ReplayStore(path).close()  # a writer's open sweeps
    missing = [f for f in named if not os.path.exists(os.path.join(path, f))]
    assert not missing, f"blobs the newest manifest names were collected: {missing}"
    report = verify_store(path)
    assert report["ok"], report["problems"]
    with ReplayStore(path, readonly=True) as store:
        values = MediaReader(store).batch(store.read(store.row_ids())["image"])
        assert all(_expected_media_ok(v, FREQUENT + i // 2) for i, v in enumerate(values))


def test_an_append_whose_blob_is_evicted_and_stored_again_by_others_before_it_replans_commits(tmp_path):
    """The schedule the capacity campaign below met: an append names a blob its base names; before it
    commits, another writer's commit evicts that blob's rows (the append conflicts), and before the
    writer looks at the newest commit to plan again, a third commit stores the same content again (a new
    entry of the same hash). The append is planned again and commits (docs/FORMAT.md, "Media": the
    writer plans it again on the newest manifest), it does not fail with the conflict."""
    path = str(tmp_path / "mw")
    with ReplayStore(path, multi_writer=True, capacity=6) as a, \
            ReplayStore(path, multi_writer=True, capacity=6) as b:
        seven = lambda n: {"prompt_id": np.full(n, 7), "completion_ids": [[1]] * n,  # noqa: E731
                           "image": Media([content(5)[0]] * n, mime="image/png")}
        eight = {"prompt_id": np.full(6, 8), "completion_ids": [[2]] * 6,
                 "image": Media([content(6)[0]] * 6, mime="image/png")}
        a.extend(seven(2))  # rows 0-1 name content 7
        first_id = a.manifest.media[0].id
        real, calls = a._committer.newest, []

        def newest():
            calls.append(1)  # 1: the catch-up before planning; 2: the commit's base; 3: the look before replanning
            if len(calls) == 2:
                b.extend(eight)  # evicts rows 0-1, and content 7's entry with them: a's append conflicts
            elif len(calls) == 3:
                b.extend(seven(1))  # content 7 stored again (another entry) before a plans again
            return real()

        a._committer.newest = newest
        try:
            rows = a.extend(seven(2), token="a:1")
        finally:
            del a._committer.newest
        assert len(calls) >= 3
        a.refresh()
        [e] = [e for e in a.manifest.media if bytes(MediaReader(a).get(e.hash)) == content(5)[0]]
        assert e.id != first_id and rows.tolist() == [9, 10] and e.last_row == 10
        assert [bytes(v) for v in MediaReader(a).batch(a.read(rows)["image"])] == [content(5)[0]] * 2
    report = verify_store(path)
    assert report["ok"], report["problems"]


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, 40])
def test_media_writers_stopped_past_retention_killed_and_a_jumped_clock_every_batch_once_bit_exact(
        tmp_path, capacity):
    """4 writer processes on a store retaining 2 s and sharing media contents: writers are stopped
    (SIGSTOP) for longer than the retention at random moments, some killed, and one writer's wall clock
    runs an hour ahead; one writer sends no tokens (stopped, never killed) and none of its extends may
    fail. With a capacity, eviction frees blobs during the run and the same contents are stored again.
    Counted, not timed: the run ends once enough stops and kills landed."""
    path = str(tmp_path / "s")
    ReplayStore(path, multi_writer=True, retain_seconds=RETAIN, capacity=capacity).close()
    ids_seen = {}  # hash -> the blob ids that named it over the run (two: freed and stored again)
    reader = ReplayStore(path, readonly=True)

    def observe():
        reader.refresh()
        for e in reader.manifest.media:
            ids_seen.setdefault(e.hash, set()).add(e.id)

    try:
        acked = run_campaign(path, str(tmp_path / "stop"), seed=23, stops=4, kills=5, retain=RETAIN,
                             batches="tests.test_media_schedules:media_batch", observe=observe)
    finally:
        reader.close()
    assert len(acked) >= 30, len(acked)
    live, blobs = _exactly_once_with_media(path, acked)
    if capacity is not None:
        restored = [h for h, ids in ids_seen.items() if len(ids) > 1]
        assert restored, f"no blob was freed and stored again: {len(ids_seen)} hashes, {live} rows, {blobs} blobs"
