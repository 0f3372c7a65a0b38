"""A writer and a consumer on TransferQueue with the DiskReplay backend, SIGKILLed mid-run on a local Ray cluster.

The test process starts Ray on 127.0.0.1 and TransferQueue's controller (so the controller outlives the
killed processes, as it does in verl, where the trainer's driver owns it). Two processes attach to it, each
holding the store through its own TransferQueue client: a writer (``kv_batch_put`` of one step of four
samples: jagged token ids and log-probs, a reward, a uid string) and a consumer (``kv_batch_get`` of each
complete even step, checked, then ``kv_clear``). Both print a line for every call TransferQueue returned
from, and are killed with SIGKILL while running. The writer is restarted and sends the step it was killed in
again, then two more. Then every put acknowledged before or after the kill and not cleared is read back
through TransferQueue with identical values, every acknowledged clear stays cleared, and the store holds
no value twice (no (key, generation, digest) on two rows). Then TransferQueue and Ray are shut down, and the
store opened alone still holds every acknowledged value that was not cleared.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

SAMPLES = 4
PARTITION = "train"


def _fields(step):
    import torch
    from tensordict import TensorDict
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 40, (SAMPLES,), generator=g).tolist()
    ids = [torch.randint(0, 32000, (n,), generator=g) for n in lengths]
    logp = [-torch.rand(n, generator=g) for n in lengths]
    return TensorDict({"ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
                       "logp": torch.nested.as_nested_tensor(logp, layout=torch.jagged),
                       "reward": torch.rand(SAMPLES, generator=g),
                       "uid": [f"u{step}-{j}" for j in range(SAMPLES)]}, batch_size=SAMPLES)


def _keys(step):
    return [f"s{step}-{j}" for j in range(SAMPLES)]


def _same(got, want):
    for name in ("ids", "logp"):
        a, b = got[name].unbind(0), want[name].unbind(0)
        if len(a) != len(b) or not all(x.dtype == y.dtype and torch_equal(x, y) for x, y in zip(a, b)):
            return False
    return torch_equal(got["reward"], want["reward"]) and list(got["uid"]) == list(want["uid"])


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


def _attach(address):
    import ray
    ray.init(address=address, log_to_driver=False)
    import diskreplay.integrations.transferqueue  # noqa: F401  (registers the backend in this process)
    import transfer_queue as tq
    tq.init()
    return tq


def _say(**event):
    print(json.dumps(event), flush=True)


def writer(address, start, steps):
    tq = _attach(address)
    for step in range(start, start + steps):
        tq.kv_batch_put(keys=_keys(step), partition_id=PARTITION, fields=_fields(step),
                        tags=[{"step": step}] * SAMPLES)
        _say(put=step)
    os._exit(0)  # the store's commits are durable; skip Ray's slow teardown


def consumer(address):
    tq = _attach(address)
    done = set()
    while True:
        listed = tq.kv_list(partition_id=PARTITION).get(PARTITION, {})
        steps = {int(k.split("-")[0][1:]) for k in listed}
        # the writer puts one step at a time: a step is complete once the next one is listed
        for step in sorted(s for s in steps if s + 1 in steps and s % 2 == 0 and s not in done):
            got = tq.kv_batch_get(keys=_keys(step), partition_id=PARTITION)
            if not _same(got, _fields(step)):
                _say(bad=step)
                os._exit(1)
            _say(clearing=step)
            tq.kv_clear(keys=_keys(step), partition_id=PARTITION)
            _say(cleared=step)
            done.add(step)
        time.sleep(0.02)


def _spawn(log_dir, *args):
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    with open(os.path.join(log_dir, f"{args[0]}-{args[-2]}.log"), "w") as log:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, args)],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)


def _tail(log_dir):
    out = []
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as f:
            out.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
    return "\n".join(out)


def _events(proc, into):
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        line = proc.stdout.readline()
        if not line:
            return
        into.append(json.loads(line))


@pytest.mark.slow  # a Ray cluster (10-70 s to start on 2 busy cores) and three TransferQueue processes
def test_puts_acknowledged_before_a_sigkill_are_all_readable_after_a_restart(tmp_path):
    ray = pytest.importorskip("ray")
    pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf

    import diskreplay.integrations.transferqueue  # noqa: F401
    import transfer_queue as tq
    from diskreplay.integrations.transferqueue import FieldTable
    from diskreplay.integrations.transferqueue.values import CLEARED

    path = str(tmp_path / "tq")
    try:
        ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - any failure to start is a reason to skip, reported as such
        pytest.skip(f"a local Ray cluster cannot start on this machine: {type(exc).__name__}: {exc}")
    procs = []
    try:
        tq.init(OmegaConf.create({"controller": {"polling_mode": True},
                                  "backend": {"storage_backend": "DiskReplay", "DiskReplay": {"path": path}}}))
        address = ray.get_runtime_context().gcs_address
        logs = tmp_path / "logs"
        logs.mkdir()
        w, c = _spawn(logs, "writer", address, 0, 10_000), _spawn(logs, "consumer", address, "-")
        procs += [w, c]
        wev, cev = [], []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            _events(w, wev), _events(c, cev)
            assert not any("bad" in e for e in cev), cev
            if sum("put" in e for e in wev) >= 12 and sum("cleared" in e for e in cev) >= 3:
                break
            assert w.poll() is None and c.poll() is None, f"a process died before the kill:\n{_tail(logs)}"
            time.sleep(0.05)
        else:
            pytest.fail(f"too slow: {len(wev)} puts, {len(cev)} consumer events in 240 s:\n{_tail(logs)}")
        for p in (w, c):
            os.kill(p.pid, signal.SIGKILL)
        for p in (w, c):
            p.wait(30)
            _events(p, wev if p is w else cev)
        acked = [e["put"] for e in wev]
        killed_in = max(acked) + 1
        # the restarted writer sends the step it was killed in again, then two more
        again = _spawn(logs, "writer", address, killed_in, 3)
        procs.append(again)
        assert again.wait(240) == 0, _tail(logs)
        _events(again, wev)
        acked = sorted({e["put"] for e in wev})
        assert acked[-3:] == [killed_in, killed_in + 1, killed_in + 2]
        cleared = {e["cleared"] for e in cev if "cleared" in e}
        clearing = {e["clearing"] for e in cev if "clearing" in e}  # a clear in flight: either way

        listed = tq.kv_list(partition_id=PARTITION).get(PARTITION, {})
        where = {}  # step -> the global indexes TransferQueue gave its samples
        for step in acked:
            if step in cleared:
                assert not set(_keys(step)) & set(listed), step
            elif step not in clearing:
                assert _same(tq.kv_batch_get(keys=_keys(step), partition_id=PARTITION), _fields(step)), step
                meta = tq.get_client().kv_retrieve_meta(keys=_keys(step), partition_id=PARTITION, create=False)
                where[step] = list(meta.global_indexes)
        # the whole system goes down; the store alone still holds every acknowledged value
        tq.close()
        ray.shutdown()

        with FieldTable(path) as table:
            for step, indexes in where.items():
                want = _fields(step)
                for j, gi in enumerate(indexes):
                    ids, logp, reward, uid = table.get([f"{gi}@ids", f"{gi}@logp", f"{gi}@reward", f"{gi}@uid"])
                    assert torch_equal(ids, want["ids"][j]) and torch_equal(logp, want["logp"][j]), (step, j)
                    assert torch_equal(reward, want["reward"][j]) and uid == want["uid"][j], (step, j)
            store = table.store
            meta = store.read(store.row_ids(), columns=["tq_key", "tq_gen", "tq_kind", "tq_digest"])
            written = [(k, g, d) for k, g, kind, d in zip(meta["tq_key"], meta["tq_gen"].tolist(), meta["tq_kind"],
                                                          meta["tq_digest"]) if kind != CLEARED]
            assert len(written) == len(set(written)), "a value was written twice"
            # 4 fields per sample; the steps still live are the uncleared ones (and perhaps one in flight)
            live = {k.split("@")[0] for k in table.keys()}
            assert len(table.keys()) == 4 * len(live)
            assert len(live) >= SAMPLES * len([s for s in acked if s not in clearing])
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(30)
        tq.close()
        ray.shutdown()


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "writer":
        writer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        consumer(sys.argv[2])
