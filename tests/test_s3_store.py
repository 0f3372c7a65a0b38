"""ReplayStore on object storage, against real S3-compatible servers on 127.0.0.1.

Every test runs against seaweedfs (``weed server -s3``) and moto's server
(the ``s3_server`` fixture of ``tests/s3servers.py``); a server that cannot
start skips its tests with the reason. Writers that race, are SIGKILLed or
outlive a server restart are real processes talking to the real server.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from diskreplay import (ArgumentError, BatchError, CommitConflictError, ConditionalWriteError, CorruptStoreError,
                        ObjectStoreError, OutputExistsError, PromptGroupSampler, ReadOnlyError, ReplayLoader, ReplayStore,
                        RowsEvictedError, SchemaError, StoreNotFoundError)
from diskreplay.verify import repair_store, verify_store

from .conftest import assert_rows_equal
from .s3servers import ConditionProxy, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(writer: int, step: int, n: int = 4):
    """Rows that say who wrote them: prompt_id = writer * 100000 + step."""
    return {"prompt_id": np.full(n, writer * 100_000 + step, dtype=np.int64),
            "completion_ids": [np.full(j + 1 + step % 3, writer * 1000 + step, dtype=np.int32) for j in range(n)],
            "rewards": np.arange(n, dtype=np.float32) + step}


def _open(url, server, tmp_path, **kwargs):
    return ReplayStore(url, storage_options=server.storage_options, cache_dir=str(tmp_path / "cache"), **kwargs)


def _keys(server, url):
    bucket, prefix = url[len("s3://"):].split("/", 1)
    out = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1:] for o in out)


# -- round trips ----------------------------------------------------------------

def test_round_trip_reopen_readonly_snapshot(s3_server, s3_url, tmp_path):
    with _open(s3_url, s3_server, tmp_path, capacity=None) as store:
        assert not store.storage.can_map and store.path == s3_url
        for step in range(3):
            assert store.extend(_batch(1, step)).tolist() == list(range(4 * step, 4 * step + 4))
        want = store.read(np.arange(12))
        assert store.read([5])["completion_ids"][0].tolist() == [1001] * 3
        store.save_state("sampler", {"cursor": 7, "weights": np.arange(3.0)})
        snap = store.snapshot()
        store.extend(_batch(1, 3))
        assert len(snap) == 12 and len(store) == 16 and not snap.refresh()
        assert_rows_equal(snap.read(np.arange(12)), {"rewards": want["rewards"]})
        snap.close()
        assert store.group_keys() == [100_000 + s for s in range(4)]
        assert store.stats()["cache"]["fetched_bytes"] > 0
        sampler = PromptGroupSampler(samples_per_group=2, strategy="variance", seed=0)
        rows = sampler.sample(store, 4, groups=[100_001, 100_003])
        assert sorted(set(store.read(rows)["prompt_id"].tolist())) == [100_001, 100_003]
        with ReplayLoader(store, PromptGroupSampler(samples_per_group=4, seed=1), batch_size=8,
                          pad_token_id=0) as loader:
            batch = next(iter(loader))
        assert batch["completion_ids"].shape[0] == 8
    with _open(s3_url, s3_server, tmp_path) as again:  # the stored options, a writer again
        assert (len(again), again.capacity, again.group_key) == (16, None, "prompt_id")
        assert again.load_state("sampler")["cursor"] == 7
        got = again.read(np.arange(12))
        for name in ("prompt_id", "rewards"):
            np.testing.assert_array_equal(got[name], want[name])
        assert [r.tolist() for r in got["completion_ids"]] == [r.tolist() for r in want["completion_ids"]]
    with _open(s3_url, s3_server, tmp_path, readonly=True) as ro:
        with pytest.raises(ReadOnlyError):
            ro.extend(_batch(1, 9))
        clone = pickle.loads(pickle.dumps(ro))  # a reader travels to a Ray actor / worker process
        assert len(clone) == 16 and clone.read([15])["prompt_id"].tolist() == [100_003]
        clone.close()


def test_reader_follows_a_writer(s3_server, s3_url, tmp_path):
    with _open(s3_url, s3_server, tmp_path) as writer:
        writer.extend(_batch(2, 0))
        reader = ReplayStore(s3_url, readonly=True, storage_options=s3_server.storage_options)
        for step in range(1, 8):  # more commits than KEEP_MANIFESTS: the reader's probe must skip ahead
            writer.extend(_batch(2, step))
        assert reader.refresh() and len(reader) == len(writer) == 32
        assert reader.read([31])["prompt_id"].tolist() == [200_007]
        assert not reader.refresh()
        reader.close()


@pytest.mark.parametrize("multi_writer", [False, True])
def test_a_late_column_on_object_storage(s3_server, s3_url, tmp_path, multi_writer):
    """A nullable column added after the first commit (FORMAT.json is marked through the storage)."""
    with _open(s3_url, s3_server, tmp_path, multi_writer=multi_writer) as store:
        store.extend(_batch(1, 0))
        late = dict(_batch(1, 1), sampling_per_token_logps=[np.full(j + 2, -0.5, dtype=np.float32)
                                                              for j in range(4)])
        store.extend(late)
    with ReplayStore(s3_url, readonly=True, storage_options=s3_server.storage_options) as ro:
        got = ro.read([3, 4])["sampling_per_token_logps"]
        assert got[0] is None and got[1].tolist() == [-0.5, -0.5]
        assert ro.options.late_columns


@pytest.mark.parametrize("multi_writer", [False, True])
def test_updates_of_committed_rows_on_object_storage(s3_server, s3_url, tmp_path, multi_writer):
    """Values for committed rows (docs/FORMAT.md, "Patches"): a patch object created only if absent,
    read back by another process's reader, folded by compact, checked by verify."""
    from diskreplay.verify import verify_store
    with _open(s3_url, s3_server, tmp_path, multi_writer=multi_writer) as store:
        store.extend(_batch(1, 0))
        store.extend(_batch(1, 1))
        store.update([1, 5], {"rewards": [10.0, 50.0], "ref_logps": [np.full(2, -0.5, np.float32),
                                                                      np.full(3, -1.5, np.float32)]},
                     token="judge:0", version="judge")
        assert store.update([5, 1], {"rewards": [50.0, 10.0], "ref_logps": [np.full(3, -1.5, np.float32),
                                                                              np.full(2, -0.5, np.float32)]},
                            token="judge:0", version="judge") == 2
        assert any(k.startswith("segments/patch.") for k in _keys(s3_server, s3_url))
    with ReplayStore(s3_url, readonly=True, storage_options=s3_server.storage_options) as ro:
        got = ro.read([1, 2, 5], ["rewards", "ref_logps", "rewards@judge"])
        assert got["rewards"].tolist() == [10.0, 2.0, 50.0] and got["ref_logps"][2].tolist() == [-1.5] * 3
        assert got["ref_logps"][1] is None
    assert verify_store(s3_url, storage_options=s3_server.storage_options)["ok"]
    with _open(s3_url, s3_server, tmp_path, multi_writer=multi_writer) as store:
        store.compact()
        assert [p.folded for p in store.manifest.patches] == [True]
        assert store.read([1, 5], ["rewards"])["rewards"].tolist() == [10.0, 50.0]


def test_environment_variables_alone(s3_server, s3_url, tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    with ReplayStore(s3_url, cache_dir=str(tmp_path / "c")) as store:
        store.extend(_batch(3, 0))
    with ReplayStore(s3_url, readonly=True) as ro:
        assert len(ro) == 4


def test_sparse_reads_fetch_about_what_they_need(s3_server, s3_url, tmp_path):
    rng = np.random.default_rng(0)
    batch = {"prompt_id": np.repeat(np.arange(64), 8),
             "completion_ids": [rng.integers(0, 50_000, int(n), dtype=np.int32) for n in rng.integers(400, 800, 512)]}
    with _open(s3_url, s3_server, tmp_path, capacity=None) as store:
        store.extend(batch)
        seg_bytes = store.manifest.segments[0].bytes
    with _open(s3_url, s3_server, tmp_path / "cold", readonly=True) as cold:
        rows = np.sort(rng.choice(512, 16, replace=False))
        got = cold.read(rows)
        for i, r in enumerate(rows.tolist()):
            np.testing.assert_array_equal(got["completion_ids"][i], batch["completion_ids"][r])
        stats = cold.stats()["cache"]
        needed = sum(len(batch["completion_ids"][r]) * 4 for r in rows.tolist())
        # pages of 8 KiB around 16 rows of ~2.4 KiB, the offsets and Arrow's header/footer
        assert needed <= stats["fetched_bytes"] < seg_bytes / 3, (stats, seg_bytes)


def test_capacity_evicts_and_collects_objects(s3_server, s3_url, tmp_path):
    with _open(s3_url, s3_server, tmp_path, capacity=10) as store:
        for step in range(12):
            store.extend(_batch(4, step, n=2))
        assert (store.head, store.next_row, len(store)) == (14, 24, 10)
        with pytest.raises(RowsEvictedError, match="evicted"):
            store.read([0])
        live = set(store.manifest.files())
        old_ids = {s.id for s in store.manifest.segments}
    keys = _keys(s3_server, s3_url)
    data = {k for k in keys if k.startswith(("segments/", "groups/"))}
    # only the files of the retained manifests remain: evicted segments' objects are deleted
    assert live <= data and len(data) <= len(live) + 2 * 4 * 2, (sorted(data), sorted(live), old_ids)
    assert "segments/000000000000.arrow" not in data


def test_cache_smaller_than_the_data(s3_server, s3_url, tmp_path):
    rng = np.random.default_rng(1)
    comp = [rng.integers(0, 1000, 300, dtype=np.int32) for _ in range(256)]
    with _open(s3_url, s3_server, tmp_path) as w:
        for i in range(4):
            w.extend({"prompt_id": np.arange(64) + 64 * i, "completion_ids": comp[64 * i: 64 * (i + 1)]})
    with ReplayStore(s3_url, readonly=True, storage_options=s3_server.storage_options,
                     cache_dir=str(tmp_path / "small"), cache_bytes=96 << 10) as ro:
        held = []
        for _ in range(6):
            rows = rng.choice(256, 48, replace=False)
            out = ro.read(rows)
            held.append((rows, out))
            assert ro.stats()["cache"]["evictions"] >= 0
        for rows, out in held:  # arrays handed out earlier stay valid after their files are evicted
            for i, r in enumerate(rows.tolist()):
                np.testing.assert_array_equal(out["completion_ids"][i], comp[r])
        assert ro.stats()["cache"]["evictions"] > 0


# -- bad input and a broken environment ----------------------------------------

def test_bad_batch_writes_nothing(s3_server, s3_url, tmp_path):
    with _open(s3_url, s3_server, tmp_path) as store:
        store.extend(_batch(5, 0))
        before = _keys(s3_server, s3_url)
        with pytest.raises(BatchError):
            store.extend({"prompt_id": [1, 2], "completion_ids": [[1]]})
        with pytest.raises(BatchError, match="completion_ids"):
            store.extend({"prompt_id": [1], "completion_ids": [[1.5]]})
        assert _keys(s3_server, s3_url) == before and store.generation == 1
    with pytest.raises(SchemaError, match="capacity"):
        _open(s3_url, s3_server, tmp_path, capacity=3)
    with pytest.raises(StoreNotFoundError, match="no diskreplay store at s3://"):
        _open(s3_url + "-missing", s3_server, tmp_path, readonly=True)
    with pytest.raises(ArgumentError, match="storage_options are for s3:// URLs"):
        ReplayStore(str(tmp_path / "local"), storage_options={"endpoint": "http://x"})


def test_missing_bucket_bad_credentials_refused_endpoint(s3_server, tmp_path):
    with pytest.raises(ObjectStoreError, match=r"s3://no-such-bucket-[0-9]+/x.*does not exist.*create it"):
        ReplayStore(f"s3://no-such-bucket-{os.getpid()}/x", storage_options=s3_server.storage_options)
    bucket = s3_server.new_bucket()
    if s3_server.name == "seaweedfs":  # moto accepts any credentials
        with pytest.raises(ObjectStoreError, match=r"refused the credentials.*AWS_ACCESS_KEY_ID"):
            ReplayStore(f"s3://{bucket}/x", storage_options={**s3_server.storage_options,
                                                             "secret_access_key": "wrong"})
    t = time.monotonic()
    with pytest.raises(ObjectStoreError, match=r"s3://.*cannot reach the object store.*AWS_ENDPOINT_URL"):
        ReplayStore(f"s3://{bucket}/x", storage_options={**s3_server.storage_options, "retry_timeout": 1,
                                                         "endpoint": f"http://127.0.0.1:{free_port()}"})
    assert time.monotonic() - t < 20


def test_server_without_conditional_writes_is_refused(s3_servers, tmp_path):
    """A server that rejects If-None-Match (a proxy answering 501) cannot hold a
    store: every commit to an object store is a conditional PUT."""
    server = s3_servers("seaweedfs")
    bucket = server.new_bucket()
    proxy = ConditionProxy(server.endpoint, "reject")
    try:
        opts = {**server.storage_options, "endpoint": proxy.endpoint, "retry_timeout": 1}
        for multi in (True, False):
            with pytest.raises(ConditionalWriteError, match=rf"s3://{bucket}/m{multi}.*conditional writes"):
                ReplayStore(f"s3://{bucket}/m{multi}", multi_writer=multi, storage_options=opts)
    finally:
        proxy.close()


def test_second_single_writer_fails_at_its_commit(s3_server, s3_url, tmp_path):
    """No lock on an object store: two single-writer opens both succeed, the
    second commit of a generation is refused, and nothing of it is visible."""
    a = _open(s3_url, s3_server, tmp_path / "a")
    b = _open(s3_url, s3_server, tmp_path / "b")
    a.extend(_batch(6, 0))
    with pytest.raises(CommitConflictError, match="another writer"):
        b.extend(_batch(7, 0))
    a.extend(_batch(6, 1))
    a.close()
    b.close()
    with _open(s3_url, s3_server, tmp_path, readonly=True) as ro:
        assert ro.read(ro.row_ids())["prompt_id"].tolist() == [600_000] * 4 + [600_001] * 4
    assert verify_store(s3_url, storage_options=s3_server.storage_options)["ok"]


# -- verify, repair, export, import ---------------------------------------------

def test_verify_and_repair(s3_server, s3_url, tmp_path):
    opts = s3_server.storage_options
    with _open(s3_url, s3_server, tmp_path) as store:
        for step in range(3):
            store.extend(_batch(8, step))
        segs = store.manifest.segments
    report = verify_store(s3_url, storage_options=opts)
    assert report["ok"] and report["rows"] == 12, report
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    client = s3_server.client()
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{segs[0].groups_file}")
    body = client.get_object(Bucket=bucket, Key=f"{prefix}/{segs[1].file}")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"{prefix}/{segs[1].file}", Body=body[:-40] + b"\0" * 40)
    problems = " ".join(verify_store(s3_url, storage_options=opts)["problems"])
    assert f"{s3_url}/{segs[0].groups_file} is missing" in problems
    assert f"{s3_url}/{segs[1].file} fails its checksum" in problems
    with _open(s3_url, s3_server, tmp_path / "r", readonly=True) as ro:  # damage is never served
        with pytest.raises(Exception, match="checksum|damaged"):
            ro.read([5])
    dry = repair_store(s3_url, storage_options=opts, dry_run=True, force=True)
    assert verify_store(s3_url, storage_options=opts)["problems"]  # a dry run changes nothing
    res = repair_store(s3_url, storage_options=opts, force=True)
    assert res["actions"] == dry["actions"] and res["rows"] == 8, res  # segments 0 and 2: segment 1's a hole
    after = verify_store(s3_url, storage_options=opts)
    assert after["ok"] and "quarantine" in " ".join(after["warnings"]), after
    assert any(k.startswith("quarantine/") for k in _keys(s3_server, s3_url))
    with _open(s3_url, s3_server, tmp_path / "w") as store:  # writable again, ids continue safely
        assert len(store) == 8 and store.holes == ((4, 8),)
        store.extend(_batch(8, 9))
        assert store.read([12])["prompt_id"].tolist() == [800_009]
    assert verify_store(s3_url, storage_options=opts)["ok"]


def test_repair_of_a_damaged_middle_manifest_keeps_every_commit_past_it_found(s3_server, s3_url, tmp_path):
    """Discovery probes upwards from the collection floor and stops at the first missing generation:
    repair, which moves a damaged manifest below the newest to quarantine, raises the floor past it,
    else a fresh open would stop under the hole and serve an old generation."""
    opts = s3_server.storage_options
    with _open(s3_url, s3_server, tmp_path) as store:
        for step in range(4):
            store.extend(_batch(7, step))
        newest = store.manifest.generation
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    client = s3_server.client()
    middle = f"{prefix}/manifests/{newest - 2:012d}.json"
    body = client.get_object(Bucket=bucket, Key=middle)["Body"].read()
    client.put_object(Bucket=bucket, Key=middle, Body=body[:-12] + b"x" * 12)
    res = repair_store(s3_url, storage_options=opts, force=True)
    assert res["generation"] == newest and res["rows"] == 16, res
    assert any("collection floor" in a for a in res["actions"]), res["actions"]
    with _open(s3_url, s3_server, tmp_path / "fresh", readonly=True) as ro:
        assert ro.manifest.generation == newest and len(ro) == 16
    assert verify_store(s3_url, storage_options=opts)["ok"]


def test_repair_refuses_a_live_store(s3_server, s3_url, tmp_path):
    with _open(s3_url, s3_server, tmp_path) as store:
        store.extend(_batch(9, 0))
    with pytest.raises(Exception, match="no lock"):
        repair_store(s3_url, storage_options=s3_server.storage_options)


def test_copy_between_bucket_and_directory_opens_unchanged(s3_server, s3_url, tmp_path):
    """Same format: a store uploaded object by object opens from the bucket, and
    downloaded again opens as a directory."""
    local = tmp_path / "local"
    with ReplayStore(str(local)) as store:
        for step in range(3):
            store.extend(_batch(10, step))
        want = store.read(store.row_ids())
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    client = s3_server.client()
    for dirpath, _, names in os.walk(local):
        for name in names:
            if name != "LOCK":
                full = os.path.join(dirpath, name)
                client.upload_file(full, bucket, f"{prefix}/{os.path.relpath(full, local)}")
    with _open(s3_url, s3_server, tmp_path, readonly=True) as remote:
        got = remote.read(remote.row_ids())
        assert got["prompt_id"].tolist() == want["prompt_id"].tolist()
    with _open(s3_url, s3_server, tmp_path) as remote:  # appended to in the bucket
        remote.extend(_batch(10, 3))
    back = tmp_path / "back"
    for key in _keys(s3_server, s3_url):
        os.makedirs(back / os.path.dirname(key), exist_ok=True)
        client.download_file(bucket, f"{prefix}/{key}", str(back / key))
    with ReplayStore(str(back), readonly=True) as store:
        assert store.read(store.row_ids())["prompt_id"].tolist()[-4:] == [1_000_003] * 4
    assert verify_store(str(back))["ok"]


def test_export_and_import_through_the_cli(s3_server, s3_url, tmp_path):
    from diskreplay.cli import main

    with _open(s3_url, s3_server, tmp_path) as store:
        for step in range(3):
            store.extend(_batch(11, step))
    opts = [f"--storage-option={k}={v}" for k, v in s3_server.storage_options.items()]
    out = tmp_path / "rows.parquet"
    assert main(["export", s3_url, str(out), *opts]) == 0
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    assert table.num_rows == 12 and table.column("prompt_id").to_pylist()[-1] == 1_100_002
    dest = f"s3://{s3_server.new_bucket()}/imported"
    assert main(["import", str(out), dest, *opts]) == 0
    assert main(["import", str(out), dest, "--append", *opts]) == 0
    with _open(dest, s3_server, tmp_path / "d", readonly=True) as store:
        assert len(store) == 24 and store.read([23])["prompt_id"].tolist() == [1_100_002]
    for cmd in (["info", dest], ["verify", dest], ["compact", dest], ["repair", dest, "--dry-run", "--force"],
                ["pairs", s3_url, str(tmp_path / "pairs.jsonl")], ["best-of-n", s3_url, str(tmp_path / "sft.jsonl")]):
        assert main([*cmd, *opts]) == 0, cmd
    assert (tmp_path / "sft.jsonl").read_text().count("\n") == 3  # one completion per prompt group


# -- many writers, killed writers, a server restart ------------------------------

_WRITER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from diskreplay import ReplayStore
    {batch}
    url, opts, cache = sys.argv[1], json.loads(sys.argv[2]), sys.argv[5]
    writer, steps = int(sys.argv[3]), int(sys.argv[4])
    with ReplayStore(url, storage_options=opts, cache_dir=cache) as store:
        print("open", flush=True)
        for step in range(steps):
            rows = store.extend(_batch(writer, step), token=f"w{{writer}}:s{{step}}")
            print("ack", writer, step, int(rows[0]), int(rows[-1]), store.generation, flush=True)
        print("stats", json.dumps(store.stats()["conflicts"]), flush=True)
""")


def _start_writer(url, opts, writer, steps, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    script = _WRITER.format(batch=textwrap.indent(inspect.getsource(_batch), "    ").strip())
    return subprocess.Popen([sys.executable, "-c", script, url, json.dumps(opts), str(writer), str(steps),
                             str(tmp_path / f"cache{writer}")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _acks(lines):
    out = {}
    for line in lines:
        parts = line.split()
        if parts and parts[0] == "ack":
            w, s, first, last, gen = map(int, parts[1:])
            out[(w, s)] = (first, last, gen)
    return out


def _check_exactly_once(url, server, tmp_path, acks, writers):
    """Every acknowledged batch is in the store once, at the rows it was given;
    no batch appears twice; nothing partial or damaged is visible."""
    with _open(url, server, tmp_path / "check", readonly=True) as store:
        got = store.read(store.row_ids())
    pids = got["prompt_id"]
    for (w, s), (first, last, _) in acks.items():
        assert pids[first:last + 1].tolist() == [w * 100_000 + s] * 4, (w, s)
        want = _batch(w, s)
        for i, r in enumerate(range(first, last + 1)):
            np.testing.assert_array_equal(got["completion_ids"][r], want["completion_ids"][i])
    seen, counts = np.unique(pids, return_counts=True)
    assert (counts == 4).all(), dict(zip(seen.tolist(), counts.tolist()))  # no batch twice, none torn
    assert {(int(p) // 100_000, int(p) % 100_000) for p in seen} >= set(acks)
    assert {int(p) // 100_000 for p in seen} <= set(writers)
    report = verify_store(url, storage_options=server.storage_options)
    assert report["ok"], report["problems"]


# moto 5.2's server checks If-None-Match and then writes, in separate steps of a
# request handler that runs in one of its threads (moto/s3/responses.py,
# put_object): two concurrent creates of one name can both succeed. The window is
# too narrow for a probe to catch reliably, and no client can make such a server
# safe for concurrent writers, so many concurrent writers are tested on seaweedfs
# only (whose conditional PUTs the race below shows atomic); moto gets the same
# faults with one writer at a time.
ATOMIC_CONDITIONAL_PUT = {"seaweedfs"}


@pytest.mark.slow
def test_racing_writer_processes(s3_server, s3_url, tmp_path):
    """4 writer processes commit to one multi-writer store through the server
    at once: every generation is won by exactly one writer, every batch is in
    the store exactly once: seaweedfs's If-None-Match holds under concurrency."""
    if s3_server.name not in ATOMIC_CONDITIONAL_PUT:
        pytest.skip(f"{s3_server.name}'s If-None-Match is not atomic under concurrency (see ATOMIC_CONDITIONAL_PUT)")
    ReplayStore(s3_url, multi_writer=True, storage_options=s3_server.storage_options).close()
    writers, steps = (1, 2, 3, 4), 5
    procs = [_start_writer(s3_url, s3_server.storage_options, w, steps, tmp_path) for w in writers]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    acks = _acks(line for out, _ in outs for line in out.splitlines())
    assert len(acks) == len(writers) * steps
    # each append won its own generation: the row ranges handed out are disjoint and,
    # together, exactly the store's rows (a generation won twice would overlap or lose some)
    spans = sorted((first, last) for first, last, _ in acks.values())
    assert spans[0][0] == 0 and all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:])), spans
    conflicts = sum(int(line.split()[1]) for out, _ in outs for line in out.splitlines() if line.startswith("stats"))
    print(f"lost races (each retried on the newer commit): {conflicts}")
    _check_exactly_once(s3_url, s3_server, tmp_path, acks, writers)
    with _open(s3_url, s3_server, tmp_path / "n", readonly=True) as store:
        assert store.next_row == spans[-1][1] + 1


@pytest.mark.slow
def test_sigkilled_writer_and_restarted_server(s3_server, s3_url, tmp_path):
    """A writer SIGKILLed mid-run (mid-upload or mid-commit) and the server
    killed and restarted under a live writer: nothing acknowledged is lost,
    nothing partial is visible, and the killed writer's retry with the same
    tokens adds nothing twice."""
    opts = s3_server.storage_options
    ReplayStore(s3_url, multi_writer=True, storage_options=opts).close()
    concurrent = s3_server.name in ATOMIC_CONDITIONAL_PUT
    steady = _start_writer(s3_url, opts, 1, 12, tmp_path) if concurrent else None
    victim = _start_writer(s3_url, opts, 2, 1000, tmp_path)
    lines = []
    while len(_acks(lines)) < 3:
        line = victim.stdout.readline()
        assert line, victim.stderr.read()[-3000:]
        lines.append(line)
    time.sleep(np.random.default_rng().uniform(0, 0.3))
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    lines += victim.stdout.read().splitlines()
    if steady is None:  # one writer at a time: it meets the restart instead
        steady = _start_writer(s3_url, opts, 1, 12, tmp_path)
    # the steady writer has opened the store and committed (on a loaded machine its start-up can
    # outlast the victim's run: the server must go down under a writer, not under its open)
    while not _acks(lines[-1:]) or not lines[-1].startswith("ack 1 "):
        line = steady.stdout.readline()
        assert line, steady.stderr.read()[-3000:]
        lines.append(line)
    s3_server.stop()
    time.sleep(1.0)
    s3_server.restart()
    out = steady.stdout.read()  # (not communicate(): the lines read above left the rest in this buffer)
    steady.wait(timeout=300)
    err = steady.stderr.read()
    assert steady.returncode == 0, err[-3000:]
    acks = _acks(lines + out.splitlines())
    assert sum(1 for w, _ in acks if w == 1) == 12
    _check_exactly_once(s3_url, s3_server, tmp_path, acks, (1, 2))
    # the killed writer runs again with its tokens: the acknowledged batches are replayed, not added
    killed = sorted(s for w, s in acks if w == 2)
    again = _start_writer(s3_url, opts, 2, killed[-1] + 1, tmp_path)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    replayed = _acks(out.splitlines())
    for s in killed:
        assert replayed[(2, s)][:2] == acks[(2, s)][:2]
    _check_exactly_once(s3_url, s3_server, tmp_path, {**acks, **replayed}, (1, 2))


def test_a_reserved_id_taken_twice_is_never_committed(s3_server, s3_url, tmp_path):
    """If the server lets two writers create one segment name (If-None-Match not
    atomic), the second commit is refused with ConditionalWriteError instead of
    publishing a manifest naming the id twice. What the second writer overwrote
    meanwhile (here the group sidecar) is damage: named by its URL, never served,
    and repaired."""
    ReplayStore(s3_url, multi_writer=True, storage_options=s3_server.storage_options).close()
    a = _open(s3_url, s3_server, tmp_path / "a")
    b = _open(s3_url, s3_server, tmp_path / "b")
    a.extend(_batch(12, 0))
    taken = a.manifest.segments[0]

    def both_created(rel_of, first, **kwargs):  # what a check-then-write server answers
        return taken.id, rel_of(taken.id)

    b.storage.reserve = both_created
    with pytest.raises(ConditionalWriteError, match=r"created by two writers.*not check the condition atomically"):
        b.extend(_batch(13, 0))
    a.close()
    b.close()
    opts = s3_server.storage_options
    # b's data is uploaded before the check when b writes it ahead of its manifest (under
    # contention), with the manifest otherwise: either nothing was overwritten, or the damage
    # is named by its URL, never served, and repaired
    with _open(s3_url, s3_server, tmp_path / "c", readonly=True) as store:
        assert store.generation == 1
        try:
            damaged = False
            store.read(store.row_ids())
        except CorruptStoreError as exc:
            damaged = True
            assert f"{s3_url}/{taken.groups_file}" in str(exc) and "checksum" in str(exc)
    assert verify_store(s3_url, storage_options=opts)["ok"] is not damaged
    if damaged:
        assert repair_store(s3_url, storage_options=opts, force=True)["actions"]
        assert verify_store(s3_url, storage_options=opts)["ok"]
    with _open(s3_url, s3_server, tmp_path / "d", readonly=True) as store:
        assert store.read(store.row_ids())["prompt_id"].tolist() == [1_200_000] * 4


@pytest.mark.slow
@pytest.mark.parametrize("multi_writer", [True, False])
def test_state_machine_on_object_storage(s3_server, monkeypatch, multi_writer):
    """The store-vs-model state machine of ``diskreplay.testing.stateful`` (writers
    interleaving appends with and without tokens, retries, compactions, merges,
    reopens; a fresh reader checked against the model after every step) with its
    store in the bucket, configured by the AWS_* variables alone."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from diskreplay.testing.stateful import SingleWriterMachine, WritersMachine

    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    bucket = s3_server.new_bucket()
    runs = iter(range(1000))

    class OnS3(WritersMachine if multi_writer else SingleWriterMachine):
        def new_location(self) -> str:
            return f"s3://{bucket}/run{next(runs)}"

    run_state_machine_as_test(OnS3, settings=settings(
        max_examples=3, stateful_step_count=8, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


def test_a_store_whose_manifests_were_deleted_keeps_its_objects(s3_server, s3_url, tmp_path):
    """As on a disk: with no manifest left, a writer's open moves the data objects to quarantine/
    rather than deleting them (they may be the rows of a store whose manifests were lost)."""
    with _open(s3_url, s3_server, tmp_path, retain_seconds=1) as store:
        for step in range(3):
            store.extend(_batch(1, step))
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    client = s3_server.client()
    segments = [k for k in _keys(s3_server, s3_url) if k.startswith("segments/")]
    for key in _keys(s3_server, s3_url):
        if key.startswith("manifests/"):
            client.delete_object(Bucket=bucket, Key=f"{prefix}/{key}")
    time.sleep(1.2)  # older than retain_seconds: no commit of them can be in flight
    with pytest.warns(RuntimeWarning, match="moved to quarantine/"):
        store = _open(s3_url, s3_server, tmp_path, retain_seconds=1)
    store.close()
    kept = _keys(s3_server, s3_url)
    assert segments and all(f"quarantine/{k}" in kept and k not in kept for k in segments), kept


def test_a_single_writers_reopen_keeps_what_a_pinned_snapshot_reads(s3_server, s3_url, tmp_path):
    """The sweep at a single writer's open on object storage kept the newest 4 manifests only (not every
    one superseded less than retain_seconds ago, as a local store does), and judged unnamed objects by
    their own age: a snapshot pinned 2 s before lost its segments, and its generation could not be opened."""
    with _open(s3_url, s3_server, tmp_path, capacity=8, retain_seconds=30) as store:
        for step in range(2):
            store.extend(_batch(1, step, n=1))
        pinned = store.generation
        snap = store.snapshot()
        for step in range(2, 10):
            store.extend(_batch(1, step, n=1))  # evicts the snapshot's rows; superseded just now
        assert store.head > 0
    _open(s3_url, s3_server, tmp_path).close()  # reopened at once: the snapshot's files stay
    assert snap.read([0, 1])["prompt_id"].tolist() == [100_000, 100_001]
    with _open(s3_url, s3_server, tmp_path, readonly=True, generation=pinned) as old:
        assert old.read([0, 1])["prompt_id"].tolist() == [100_000, 100_001]
    snap.close()


@pytest.mark.parametrize("multi_writer", [False, True])
def test_creating_a_store_at_a_prefix_holding_other_objects_is_refused(s3_server, s3_url, tmp_path, multi_writer):
    """A store was created inside a prefix holding other objects, and its open moved those that sat in
    a store-named folder (segments/checkpoint-0001.bin) into quarantine/; a local directory is refused."""
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key=f"{prefix}/segments/checkpoint-0001.bin", Body=b"weights")
    with pytest.raises(OutputExistsError, match="segments/checkpoint-0001.bin"):
        _open(s3_url, s3_server, tmp_path, multi_writer=multi_writer)
    assert _keys(s3_server, s3_url) == ["segments/checkpoint-0001.bin"]  # nothing written, nothing moved
    client.delete_object(Bucket=bucket, Key=f"{prefix}/segments/checkpoint-0001.bin")
    client.put_object(Bucket=bucket, Key=f"{prefix}/notes.txt", Body=b"notes")
    with pytest.raises(OutputExistsError, match="notes.txt"):
        _open(s3_url, s3_server, tmp_path, multi_writer=multi_writer)
    client.delete_object(Bucket=bucket, Key=f"{prefix}/notes.txt")
    with _open(s3_url, s3_server, tmp_path, multi_writer=multi_writer) as store:  # an empty prefix: fine
        store.extend(_batch(1, 0))


def test_unusable_storage_options_are_named():
    """A non-numeric retry_timeout / timeout / multipart_threshold raised a bare ValueError, and
    allow_http=false with an http:// endpoint failed later with "check that the server is running"."""
    for key, value in (("retry_timeout", "abc"), ("timeout", "soon"), ("multipart_threshold", "1.5e6x"),
                       ("max_retries", -1)):
        with pytest.raises(ObjectStoreError, match=rf"storage option {key}={value!r} is not a non-negative"):
            ReplayStore("s3://bucket/x", storage_options={"endpoint": "http://127.0.0.1:1", key: value})
    with pytest.raises(ObjectStoreError, match="plain HTTP but allow_http is false"):
        ReplayStore("s3://bucket/x", storage_options={"endpoint": "http://127.0.0.1:1", "allow_http": "false"})


def test_a_shared_cache_dir_stays_near_its_bound_across_processes(s3_server, s3_url, tmp_path):
    """Copies a process published in a shared cache_dir stayed after it closed, and no later process
    counted or removed them: four readers one after another left 4x cache_bytes behind."""
    rng = np.random.default_rng(2)
    with _open(s3_url, s3_server, tmp_path) as w:
        for i in range(8):
            w.extend({"prompt_id": np.arange(32) + 32 * i,
                      "completion_ids": [rng.integers(0, 1000, 300, dtype=np.int32) for _ in range(32)]})
        biggest = max(s.bytes + s.groups_bytes for s in w.manifest.segments)
    shared, bound = tmp_path / "shared", 96 << 10

    def used():  # disk blocks, each inode once
        return sum(st.st_blocks * 512 for st in {p.stat().st_ino: p.stat() for p in shared.iterdir()}.values())

    for reader in range(4):
        with ReplayStore(s3_url, readonly=True, storage_options=s3_server.storage_options,
                         cache_dir=str(shared), cache_bytes=bound) as ro:
            ro.read(np.arange(64 * reader, 64 * (reader + 1)))  # each reader other segments
        assert used() <= bound + 3 * biggest, (reader, used())


def test_a_delta_whose_base_manifest_is_gone_is_named_on_object_storage(s3_server, s3_url, tmp_path):
    """The open probed and re-read 1000 times, blaming "something deleting them"."""
    with _open(s3_url, s3_server, tmp_path, multi_writer=True) as store:
        for step in range(3):
            store.extend(_batch(1, step))
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/manifests/000000000001.json")
    with pytest.raises(CorruptStoreError, match="000000000003.json is an append delta, but .*000000000001.json"):
        _open(s3_url, s3_server, tmp_path, readonly=True)


def test_no_credentials_at_all_says_so(monkeypatch):
    """No key anywhere: the client asks the cloud instance metadata service for one, and the error was
    about http://169.254.169.254/latest/api/token, with no fix."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    with socket.socket() as silent, pytest.raises(ObjectStoreError) as info:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # an endpoint that takes connections (a closed port is refused before credentials)
        ReplayStore("s3://bucket/x", storage_options={"endpoint": f"http://127.0.0.1:{silent.getsockname()[1]}",
                                                      "retry_timeout": 2})
    if "cannot reach" in str(info.value):
        pytest.skip("this machine's network never answers the metadata service's address")
    assert "no credentials" in str(info.value) and "AWS_ACCESS_KEY_ID" in str(info.value)


def test_a_cache_trim_during_compact_maps_again(s3_server, s3_url, tmp_path, monkeypatch):
    """A whole-object fetch that finds its cache file gone (a trim by another process sharing the cache)
    is retried inside compact(); no private signal escapes, and every row survives."""
    with _open(s3_url, s3_server, tmp_path, capacity=None) as w:
        for step in range(5):  # five small segments (fewer than a merge folds)
            w.extend(_batch(0, step))
        expected = w.read(np.arange(len(w)))
    with _open(s3_url, s3_server, tmp_path, capacity=None) as store:  # its segments come through the cache
        real, mapped, forced = store.storage.fetch_ranges, set(), []

        def trimmed(rel, ranges, **kwargs):
            path = real(rel, ranges, **kwargs)
            if rel in mapped and ranges is None and not forced:  # its whole bytes, checked before the copy:
                forced.append(rel)  # as if a trim dropped the mapped file meanwhile, and it came back anew
                return path + ".trimmed"
            mapped.add(rel)  # (the first fetch maps the segment)
            return path

        monkeypatch.setattr(store.storage, "fetch_ranges", trimmed)
        done = store.compact()
        monkeypatch.undo()
        assert done["segments_before"] == 5 and done["segments_after"] == 1
        assert forced
        got = store.read(np.arange(len(store)))
    assert got["prompt_id"].tolist() == expected["prompt_id"].tolist()
    assert [c.tolist() for c in got["completion_ids"]] == [c.tolist() for c in expected["completion_ids"]]


# -- rollout streams --------------------------------------------------------------


def test_stream_and_back_pressure_on_object_storage(s3_server, s3_url, tmp_path):
    import threading

    from diskreplay.stream import RolloutStream

    bound, commit, commits = 8, 4, 12
    with _open(s3_url, s3_server, tmp_path, multi_writer=True, group_key=None) as trainer_store:
        stream = RolloutStream(trainer_store, "trainer")
        stream.save()
        ahead, errors = [], []

        def write():
            try:
                with _open(s3_url, s3_server, tmp_path / "w") as writer:
                    for step in range(commits):
                        assert writer.wait_for_consumers(bound, timeout=30, poll=0.02)
                        writer.extend({"rewards": np.full(commit, float(step))}, token=f"w:{step}")
                        ahead.append(writer.next_row - writer.consumers()["trainer"].position)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        thread = threading.Thread(target=write)
        thread.start()
        taken = []
        while thread.is_alive() or (not errors and len(taken) < commit * commits):
            rows = stream.next(commit, timeout=0.1)
            if rows is not None:
                taken.extend(rows.tolist())
                stream.save()
        thread.join()
        assert not errors, errors
        assert taken == list(range(commit * commits))        # each once, in commit order
        assert max(ahead) <= bound + commit
        again = RolloutStream(trainer_store, "trainer")
        assert again.position == commit * commits and again.next(1, timeout=0) is None
