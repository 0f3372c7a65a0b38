"""Ray: rollout actors append exactly once across restarts; samplers, read-only stores and snapshots travel.

The cluster tests start one local Ray cluster for the module (about 10 s on 2
busy cores) and skip, saying why, only where it cannot start.
"""

import functools
import os
import pickle
import signal
import sys

import numpy as np
import pytest

from diskreplay import PromptGroupSampler, RandomSampler, ReplayStore
from diskreplay.errors import (ArgumentError, BatchError, MissingDependencyError, ReadOnlyError, SchemaError)
from diskreplay.integrations.ray import (RolloutActor, RolloutWriter, StoreFollower, rollout_actor_class,
                                         token_for_step)
from diskreplay.testing.workload import batch_for, check_rows
from diskreplay.verify import verify_store

WRITERS = 4
STEPS = 8


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'diskreplay[ray]'")
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20)
    except Exception as exc:  # noqa: BLE001 - any failure to start is a reason to skip, reported as such
        pytest.skip(f"a local Ray cluster cannot start on this machine: {type(exc).__name__}: {exc}")
    try:
        yield ray
    finally:
        ray.shutdown()


def _store(tmp_path, rows=40):
    """A single-writer store of ``rows`` workload rows (groups of up to 8 rows), open for writing."""
    store = ReplayStore(tmp_path / "store")
    for step in range(0, 2 * rows, 2):
        if len(store) >= rows:
            break
        store.extend(batch_for(0, step))
    return store


# ---------------------------------------------------------------- without a cluster


def test_writer_tokens_make_a_resent_batch_count_once(tmp_path):
    path = tmp_path / "store"
    with RolloutWriter(path, "rollout-1", capacity=1000) as writer:
        first = writer.append(0, batch_for(1, 0))
        assert writer.append(0, batch_for(1, 0)).tolist() == first.tolist()  # the same batch again: a replay
        assert len(writer.store) == len(first)
        with pytest.raises(BatchError, match="rollout-1:0"):
            writer.append(0, batch_for(1, 1))  # a step names one batch
        produced = []

        def produce():
            produced.append(1)
            return batch_for(1, 7)

        assert writer.append(0, produce).tolist() == first.tolist() and not produced  # not regenerated
        assert writer.committed(1) is None
        second = writer.append(1, produce)
        assert produced and writer.committed(1).tolist() == second.tolist()
        assert (writer.stats()["appended"], writer.stats()["replayed"]) == (2, 2)
        assert check_rows(writer.store, np.concatenate([first, second])) is None
    # a new process (a restarted actor) finds what the first one committed
    with RolloutWriter(path, "rollout-1") as again:
        assert again.committed(0).tolist() == first.tolist()
        assert again.append(1, lambda: pytest.fail("a committed step must not be produced again")).tolist() \
            == second.tolist()
    assert token_for_step("rollout-1", 3) == "rollout-1:3"


def test_bad_arguments_are_named(tmp_path):
    path = tmp_path / "store"
    for worker_id in ("", None, 3):
        with pytest.raises(ArgumentError, match="worker_id"):
            RolloutWriter(path, worker_id)
    with pytest.raises(ArgumentError, match="multi_writer"):
        RolloutWriter(path, "w", multi_writer=False)
    with RolloutWriter(path, "w") as writer:
        for step in (-1, True, 1.5, "3"):
            with pytest.raises(ArgumentError, match="step"):
                writer.append(step, batch_for(0, 0))
    with ReplayStore(path, readonly=True) as reader:
        assert reader.committed_rows("w:0") is None  # a lookup: a reader answers it too
    with ReplayStore(path) as store, pytest.raises(ArgumentError, match="token"):
        store.committed_rows(None)
    with pytest.raises(ArgumentError, match="produce"):
        RolloutActor(path, "w", produce=None)
    with pytest.raises(ArgumentError, match="sampler"):
        StoreFollower(path, sampler="random")
    ReplayStore(tmp_path / "single").close()
    with pytest.raises(SchemaError, match="multi_writer"):  # a single-writer store is refused, not taken over
        RolloutWriter(tmp_path / "single", "w")
    with ReplayStore(tmp_path / "single") as writer_store:
        with pytest.raises(ReadOnlyError, match="snapshot"):
            StoreFollower(writer_store, RandomSampler())


def test_rollout_actor_class_without_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(MissingDependencyError, match=r"diskreplay\[ray\]"):
        rollout_actor_class()


def test_follower_follows_and_a_snapshot_stays(tmp_path):
    path = tmp_path / "store"
    writer = RolloutWriter(path, "w0")
    writer.append(0, batch_for(0, 0, rows=4))
    follower = StoreFollower(path, RandomSampler(seed=1))
    pinned = StoreFollower(ReplayStore(path, readonly=True).snapshot(), RandomSampler(seed=1))
    assert follower.wait_for_rows(4, timeout=0)
    writer.append(1, batch_for(0, 1, rows=4))
    assert sorted(follower.sample(8).tolist()) == list(range(8))  # the new commit is drawn at once
    assert sorted(pinned.sample(4).tolist()) == list(range(4))
    assert not follower.wait_for_rows(9, timeout=0.05)
    rows, batch = follower.sample_batch(3, columns=["tag"])
    assert batch["tag"] == writer.store.read(rows)["tag"]
    assert follower.stats()["refreshes"] == 1 and pinned.stats()["refreshes"] == 0
    follower.close(), pinned.close(), writer.close()


def test_pickle_round_trips_reopen_by_path_and_generation(tmp_path):
    store = _store(tmp_path)
    sampler = PromptGroupSampler(samples_per_group=2, seed=3)
    sampler.sample(store, 8)  # mid-stream: the copy continues the stream, not a new one
    reader = ReplayStore(store.path, readonly=True)
    snap = store.snapshot()
    twin = pickle.loads(pickle.dumps(sampler))
    assert twin.sample(store, 8).tolist() == sampler.sample(store, 8).tolist()
    reader2, snap2 = pickle.loads(pickle.dumps(reader)), pickle.loads(pickle.dumps(snap))
    store.extend(batch_for(0, 100, rows=3))
    assert reader2.refresh() and len(reader2) == len(store)  # a reader travels as a follower
    assert not snap2.refresh() and snap2.generation == snap.generation and len(snap2) == len(snap)
    assert snap2.read(snap.row_ids())["tag"] == snap.read(snap.row_ids())["tag"]
    follower = pickle.loads(pickle.dumps(StoreFollower(store.path, PromptGroupSampler(num_groups=2, seed=0))))
    assert len(follower.sample(4)) == 4
    writer = pickle.loads(pickle.dumps(RolloutWriter(tmp_path / "multi", "w9")))  # reopens the store
    assert writer.append(0, batch_for(9, 0)).size and writer.store.multi_writer
    with pytest.raises(ArgumentError, match="snapshot"):  # a writer is never pickled
        pickle.dumps(store)
    for obj in (reader, reader2, snap, snap2, follower, writer, store):
        obj.close()


# ---------------------------------------------------------------- on a local Ray cluster


def test_sampler_reader_and_snapshot_travel_through_ray(ray_cluster, tmp_path):
    ray = ray_cluster
    store = _store(tmp_path)
    sampler = PromptGroupSampler(samples_per_group=2, seed=5)
    sampler.sample(store, 8)
    snap = store.snapshot()
    for obj in (sampler, snap):  # Ray's own serialisation (cloudpickle) honours __reduce__
        assert type(ray.get(ray.put(obj))) is type(obj)
    local = pickle.loads(pickle.dumps(sampler))
    Follower = ray.remote(StoreFollower).options(num_cpus=0)
    on_snapshot = Follower.remote(snap, sampler)
    on_reader = Follower.remote(ReplayStore(store.path, readonly=True), RandomSampler(seed=0))
    store.extend(batch_for(0, 200, rows=5))
    # the snapshot's actor draws exactly what a local copy of the sampler draws on the snapshot
    rows, batch = ray.get(on_snapshot.sample_batch.remote(8))
    assert rows.tolist() == local.sample(snap, 8).tolist()
    assert batch["tag"] == snap.read(rows)["tag"] and check_rows(snap, rows) is None
    assert ray.get(on_snapshot.stats.remote())["generation"] == snap.generation
    # the reader's actor follows the writer to its newest commit
    rows = ray.get(on_reader.sample.remote(len(store)))
    assert sorted(rows.tolist()) == store.row_ids().tolist()
    for actor in (on_snapshot, on_reader):
        ray.kill(actor)
    snap.close(), store.close()


@pytest.mark.slow  # 20-30 s: five actor processes and two restarts on 2 busy cores
def test_rollout_actors_exactly_once_across_restarts(ray_cluster, tmp_path):
    """4 rollout actors append with tokens; one SIGKILLs itself right after its 5th commit (committed,
    not acknowledged), another is SIGKILLed from outside mid-run; Ray restarts both and sends their
    calls again. Every acknowledged batch is in the store exactly once, bit-exact; a trainer actor
    following the store meanwhile draws only valid rows."""
    ray = ray_cluster
    path = str(tmp_path / "store")
    ReplayStore(path, multi_writer=True).close()  # created once, by the driver
    Actor = rollout_actor_class(max_restarts=10, num_cpus=0)
    actors = []
    for w in range(WRITERS):
        options = {}
        if w == 0:
            options["runtime_env"] = {"env_vars": {"DISKREPLAY_CRASH_AT": "manifest.committed#5"}}
        actors.append(Actor.options(**options).remote(path, f"w{w}", functools.partial(batch_for, w)))
    first = ray.get([a.info.remote() for a in actors])
    assert not any(i["restarted"] for i in first)

    trainer = ray.remote(StoreFollower).options(num_cpus=0).remote(
        path, PromptGroupSampler(samples_per_group=2, seed=0), verify_reads=True)
    # the follower holds generation 0 before any rollout: on 2 busy cores its actor could otherwise
    # start after the writers' last commit, and never need a refresh (the check below was flaky)
    assert ray.get(trainer.stats.remote())["generation"] == 0
    pending = {(w, s): actors[w].rollout.remote(s) for w in range(WRITERS) for s in range(STEPS)}
    waited = trainer.wait_for_rows.remote(8, timeout=60)
    draws = [trainer.sample_batch.remote(8) for _ in range(12)]

    victim = [pending[(1, s)] for s in range(STEPS)]
    ready, _ = ray.wait(victim, num_returns=2, timeout=60)
    assert len(ready) == 2
    os.kill(first[1]["pid"], signal.SIGKILL)

    acked = dict(zip(pending, ray.get(list(pending.values()), timeout=120)))
    assert ray.get(waited)
    draws = ray.get(draws) + [ray.get(trainer.sample_batch.remote(8))]  # the last one after every writer
    final = ray.get([a.info.remote() for a in actors])

    with ReplayStore(path, readonly=True) as reader:
        total = sum(len(r) for r in acked.values())
        # exactly once: the store holds the acknowledged rows and nothing else, each row in one batch
        assert (len(reader), reader.head, reader.next_row) == (total, 0, total)
        assert np.sort(np.concatenate(list(acked.values()))).tolist() == list(range(total))
        for (w, s), rows in acked.items():
            assert reader.read(rows, ["tag"])["tag"] == batch_for(w, s)["tag"], (w, s)
        assert check_rows(reader, reader.row_ids()) is None  # bit-exact
        # the trainer drew whole valid rows, and followed the writers to their last commit
        for rows, batch in draws:
            assert len(rows) == 8 and check_rows(reader, rows) is None
            got = reader.read(rows)
            assert batch["tag"] == got["tag"]
            assert all(np.array_equal(a, b) for a, b in zip(batch["completion_ids"], got["completion_ids"]))
        stats = ray.get(trainer.stats.remote())
        assert stats["generation"] == reader.generation and stats["refreshes"] >= 1
    report = verify_store(path)
    assert report["ok"], report["problems"]

    # actor 0 died after a commit it never acknowledged; its restart found it by token
    assert final[0]["restarted"] and final[0]["replayed"] >= 1
    assert final[1]["restarted"] and final[1]["pid"] != first[1]["pid"]
    assert not final[2]["restarted"] and not final[3]["restarted"]
    for actor in actors + [trainer]:
        ray.kill(actor)



@pytest.mark.slow  # ~15 s: three actor processes, one restart, a seaweedfs server
@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
def test_rollout_actors_write_a_store_in_object_storage(ray_cluster, s3_server, s3_url, tmp_path):
    """The product's distributed case end to end: Ray actors append to one store in S3-compatible
    storage (a real seaweedfs), signing in from storage_options; one dies right after a commit it
    never acknowledged, Ray restarts it and sends the call again. Every batch is in the bucket
    exactly once, bit-exact, as a reader on another machine would open it."""
    ray = ray_cluster
    options = s3_server.storage_options
    ReplayStore(s3_url, multi_writer=True, storage_options=options, cache_dir=str(tmp_path / "c")).close()
    Actor = rollout_actor_class(max_restarts=3, num_cpus=0)
    writers, steps = 3, 4
    actors = []
    for w in range(writers):
        env = {"DISKREPLAY_CRASH_AT": "manifest.committed#2"} if w == 0 else {}
        actors.append(Actor.options(runtime_env={"env_vars": env}).remote(
            s3_url, f"w{w}", functools.partial(batch_for, w), storage_options=options,
            cache_dir=str(tmp_path / f"cache-w{w}")))
    calls = {(w, s): actors[w].rollout.remote(s) for w in range(writers) for s in range(steps)}
    acked = dict(zip(calls, ray.get(list(calls.values()), timeout=180)))
    final = ray.get([a.info.remote() for a in actors])
    assert final[0]["restarted"] and final[0]["replayed"] >= 1  # its unacknowledged commit was found by token
    with ReplayStore(s3_url, readonly=True, storage_options=options, cache_dir=str(tmp_path / "r")) as reader:
        total = sum(len(r) for r in acked.values())
        assert (len(reader), reader.next_row) == (total, total)
        assert np.sort(np.concatenate(list(acked.values()))).tolist() == list(range(total))
        for (w, s), rows in acked.items():
            assert reader.read(rows, ["tag"])["tag"] == batch_for(w, s)["tag"], (w, s)
        assert check_rows(reader, reader.row_ids()) is None
    report = verify_store(s3_url, storage_options=options)
    assert report["ok"], report["problems"]
    for actor in actors:
        ray.kill(actor)


def test_example_explains_itself_and_refuses_bad_counts():
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "ray_rollouts.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--storage-option" in out.stdout and "exactly once" in out.stdout
    bad = subprocess.run([sys.executable, script, "--actors", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--actors must be at least 1" in bad.stderr
