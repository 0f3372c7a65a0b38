"""ReplayLoader: same stream as a plain loop, buffer reuse window, shutdown, errors, resume."""

from __future__ import annotations

import collections
import gc
import os
import subprocess
import sys
import textwrap
import time
import traceback

import pytest
import torch

import diskreplay
from diskreplay import PrioritizedSampler, PromptGroupSampler, RandomSampler, ReplayStore
from diskreplay.batching.packed import collate_packed
from diskreplay.batching.padded import collate
from diskreplay.loader import ReplayLoader
from diskreplay.buffer import ReplayBuffer
from diskreplay.synthetic import rollout_stream

PAD = 7
BATCH = 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fill(store, num_groups=48, group_size=4, seed=0):
    for b in rollout_stream(num_groups, 16, group_size, seed=seed, prompt_mean=12, completion_mean=20):
        store.extend(b)


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "store"
    with ReplayStore(p) as s:
        fill(s)
    return p


@pytest.fixture
def store(path):
    with ReplayStore(path) as s:
        yield s


SAMPLERS = {
    "groups-random": lambda seed: PromptGroupSampler(num_groups=4, seed=seed),
    "groups-variance": lambda seed: PromptGroupSampler(samples_per_group=2, strategy="variance", seed=seed),
    "random": lambda seed: RandomSampler(seed=seed),
    "prioritized": lambda seed: PrioritizedSampler(alpha=0.7, seed=seed),
}


def reference(store, sampler, n, **kw):
    """What a plain loop of sample + read + collate gives."""
    out = []
    for _ in range(n):
        rows = sampler.sample(store, BATCH, **kw)
        b = collate(store.read(rows), PAD)
        b["rows"] = torch.from_numpy(rows)
        out.append(b)
    return out


def assert_batch_equal(got, want):
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype, k
            assert torch.equal(got[k].cpu(), v.cpu()), k
        else:
            assert got[k] == v, k


def cloned(batch):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# --------------------------------------------------------------------------- the stream


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_same_batches_as_direct_collate(store, kind):
    want = reference(store, SAMPLERS[kind](3), 6)
    with ReplayLoader(store, SAMPLERS[kind](3), BATCH, PAD, num_batches=6) as loader:
        got = [cloned(b) for b in loader]
    assert len(got) == 6
    for g, w in zip(got, want):
        assert_batch_equal(g, w)


def test_exclude_and_min_row_reach_the_sampler(store):
    lo = store.head + len(store) // 4
    kw = {"exclude": [(lo, lo + len(store) // 4)], "min_row": store.head + 8}
    want = reference(store, PromptGroupSampler(num_groups=4, seed=2), 4, **kw)
    with ReplayLoader(store, PromptGroupSampler(num_groups=4, seed=2), BATCH, PAD, num_batches=4, **kw) as loader:
        got = [cloned(b) for b in loader]
    assert len(got) == 4
    for g, w in zip(got, want):
        rows = g["rows"].numpy()
        assert not ((rows >= lo) & (rows < lo + len(store) // 4)).any() and (rows >= store.head + 8).all()
        assert_batch_equal(g, w)


def test_columns_and_min_policy_version(store):
    want = reference(store, RandomSampler(seed=1), 4, min_policy_version=2)
    with ReplayLoader(store, RandomSampler(seed=1), BATCH, PAD, columns=["completion_ids", "policy_version"],
                      min_policy_version=2, num_batches=4) as loader:
        got = [cloned(b) for b in loader]
    for g, w in zip(got, want):
        assert set(g) == {"completion_ids", "completion_mask", "policy_version", "rows"}
        assert (g["policy_version"] >= 2).all()
        for k in g:
            assert torch.equal(g[k], w[k]), k


@pytest.mark.parametrize("kind", ["groups-random", "prioritized"])
def test_pad_on_device_on_cpu_equals_host_padding(store, kind):
    with ReplayLoader(store, SAMPLERS[kind](5), BATCH, PAD, device="cpu", pad_on_device=True,
                      num_batches=5) as a, \
            ReplayLoader(store, SAMPLERS[kind](5), BATCH, PAD, num_batches=5) as b:
        pairs = list(zip(a, b))
        for x, y in pairs[-1:]:  # the last pair is still inside b's validity window
            assert_batch_equal(x, y)
    assert len(pairs) == 5


def test_pad_on_device_batches_are_never_reused(store):
    with ReplayLoader(store, RandomSampler(seed=2), BATCH, PAD, device="cpu", pad_on_device=True,
                      prefetch=1, num_batches=8) as loader:
        kept = list(loader)  # kept past any window: must all stay intact
    want = reference(store, RandomSampler(seed=2), 8)
    for g, w in zip(kept, want):
        assert_batch_equal(g, w)


def test_num_batches(store):
    with ReplayLoader(store, RandomSampler(seed=0), BATCH, PAD, num_batches=3) as loader:
        assert len(list(loader)) == 3
        with pytest.raises(StopIteration):
            next(loader)
    with ReplayLoader(store, RandomSampler(seed=0), BATCH, PAD, num_batches=0) as loader:
        assert list(loader) == []


def test_endless_by_default(store):
    with ReplayLoader(store, RandomSampler(replacement=True, seed=0), BATCH, PAD) as loader:
        for _ in range(40):
            next(loader)


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(prefetch=0), dict(num_batches=-1),
                                 dict(pad_token_id=1.5), dict(sampler=object()), dict(layout="ragged"),
                                 dict(max_tokens=0), dict(pad_token_id=None)])
def test_bad_arguments(store, bad):
    kw = dict(store=store, sampler=RandomSampler(seed=0), batch_size=BATCH, pad_token_id=PAD)
    kw.update(bad)
    with pytest.raises(diskreplay.ArgumentError) as info:
        ReplayLoader(**kw)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    assert next(iter(bad)) in str(info.value)


# --------------------------------------------------------------------------- packed batches, token budgets


def packed_reference(store, sampler, n):
    out = []
    for _ in range(n):
        rows = sampler.sample(store, BATCH)
        b = collate_packed(store.read(rows))
        b["rows"] = torch.from_numpy(rows)
        out.append(b)
    return out


@pytest.mark.parametrize("pad_on_device", [False, True])
@pytest.mark.parametrize("kind", ["groups-random", "random"])
def test_packed_layout_equals_collate_packed(store, kind, pad_on_device):
    want = packed_reference(store, SAMPLERS[kind](4), 5)
    with ReplayLoader(store, SAMPLERS[kind](4), BATCH, None, layout="packed", num_batches=5,
                      device="cpu" if pad_on_device else None, pad_on_device=pad_on_device) as loader:
        got = [cloned(b) for b in loader]
    assert len(got) == 5
    for g, w in zip(got, want):
        assert_batch_equal(g, w)
        assert g["input_ids"].shape[0] == 1 and int(g["cu_seqlens"][-1]) == g["input_ids"].shape[1]


def tokens(batch, layout):
    if layout == "packed":
        return batch["input_ids"].numel()
    return batch["prompt_ids"].numel() + batch["completion_ids"].numel()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_max_tokens_keeps_the_whole_groups_that_fit(store, layout, tmp_path):
    budget = 400
    sampler = PromptGroupSampler(num_groups=4, seed=6)
    draws = [sampler.sample(store, BATCH) for _ in range(8)]
    group_size = BATCH // 4
    sizes = set()
    with ReplayLoader(store, PromptGroupSampler(num_groups=4, seed=6), BATCH, PAD, layout=layout,
                      max_tokens=budget, num_batches=8) as loader:
        for batch, drawn in zip(loader, draws):
            n = len(batch["rows"])
            sizes.add(n)
            assert n % group_size == 0 and n >= group_size  # whole groups, at least one
            assert batch["rows"].tolist() == drawn[:n].tolist()  # the leading groups of the draw
            assert tokens(batch, layout) <= budget
            if n < BATCH:  # one more group would not have fit
                bigger = store.read(drawn[:n + group_size])
                more = (collate_packed(bigger) if layout == "packed" else collate(bigger, PAD))
                assert tokens(more, layout) > budget
    assert len(sizes) > 1 or sizes != {BATCH}  # the budget really cut some draws


def test_max_tokens_below_one_group_is_an_error(store):
    with ReplayLoader(store, PromptGroupSampler(num_groups=4, seed=6), BATCH, PAD, layout="packed",
                      max_tokens=5, num_batches=2) as loader:
        with pytest.raises(diskreplay.LoaderError, match="max_tokens=5"):
            next(loader)


def test_warm_reads_stop_the_page_hints(store):
    calls = []
    prefetch = store.prefetch
    store.prefetch = lambda rows, columns=None: (calls.append(len(rows)), prefetch(rows, columns))
    try:
        for _ in range(3):  # warm the page cache
            store.read(store.row_ids())
        with ReplayLoader(store, RandomSampler(replacement=True, seed=0), BATCH, PAD, num_batches=12) as loader:
            assert len(list(loader)) == 12
    finally:
        del store.prefetch
    # the first batches are hinted (a restarted job meets a cold cache); reads that never wait
    # for the disk turn the hints off. A read that faulted (memory pressure) turns them back on.
    assert 1 <= len(calls) < 12


# --------------------------------------------------------------------------- reused buffers


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_buffer_reuse_keeps_the_documented_window(store, prefetch):
    n = 24
    want = reference(store, PromptGroupSampler(num_groups=4, seed=9), n)
    held = collections.deque(maxlen=prefetch)  # (index, batch as received, no copy)
    ptrs = set()
    with ReplayLoader(store, PromptGroupSampler(num_groups=4, seed=9), BATCH, PAD, prefetch=prefetch,
                      num_batches=n) as loader:
        for i, batch in enumerate(loader):
            held.append((i, batch))
            ptrs.add(batch["completion_ids"].untyped_storage().data_ptr())
            if i % 5 == 0:
                time.sleep(0.02)  # let the worker run ahead as far as it may
            for j, b in held:  # every batch inside the window is intact
                assert_batch_equal(b, want[j])
    assert len(ptrs) < n  # the ring really is reused


@cuda
@pytest.mark.parametrize("pad_on_device", [False, True])
def test_cuda_device(store, pad_on_device):
    want = reference(store, PromptGroupSampler(num_groups=4, seed=4), 6)
    with ReplayLoader(store, PromptGroupSampler(num_groups=4, seed=4), BATCH, PAD, device="cuda",
                      pad_on_device=pad_on_device, num_batches=6) as loader:
        got = list(loader)  # device batches are fresh tensors: keep them all
        torch.cuda.synchronize()
    for g, w in zip(got, want):
        for k, v in w.items():
            if k != "rows":
                assert g[k].device.type == "cuda", k
        assert_batch_equal(g, w)


@cuda
def test_pinned_ring_on_host(store):
    with ReplayLoader(store, RandomSampler(seed=0), BATCH, PAD, pin_memory=True, num_batches=2) as loader:
        b = next(loader)
        assert b["completion_ids"].is_pinned()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without CUDA")
@pytest.mark.parametrize("kwargs", [{"pin_memory": True}, {"device": 0}, {"device": "cuda:0"}, {"device": "cuda"}])
def test_cuda_options_without_cuda_warn_and_yield_cpu_tensors(store, kwargs):
    """As torch's DataLoader does (pin_memory=True raised; device=0, a local_rank, raised RuntimeError)."""
    with pytest.warns(RuntimeWarning, match="no CUDA") as caught:
        loader = ReplayLoader(store, RandomSampler(seed=0), BATCH, PAD, num_batches=1, **kwargs)
    assert caught[0].filename == __file__
    with loader:
        assert all(v.device.type == "cpu" and not v.is_pinned() for v in next(loader).values()
                   if isinstance(v, torch.Tensor))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without CUDA")
def test_replay_buffer_on_cuda_without_cuda_warns_and_samples_on_the_cpu(path):
    from diskreplay import ReplayBuffer

    with pytest.warns(RuntimeWarning, match="no CUDA"):
        buffer = ReplayBuffer(ReplayStore(path), RandomSampler(seed=0), BATCH, device="cuda", state_name=None)
    with buffer:
        assert buffer.sample()["completion_ids"].device.type == "cpu"


def test_a_device_that_is_none_says_so(store):
    with pytest.raises(ValueError, match="device='gpu' is not a torch device"):
        ReplayLoader(store, RandomSampler(seed=0), BATCH, PAD, device="gpu")


# --------------------------------------------------------------------------- shutdown


def test_close_and_context_manager(store):
    loader = ReplayLoader(store, RandomSampler(replacement=True, seed=0), BATCH, PAD)
    next(loader)
    thread = loader._worker.thread
    loader.close()
    assert not thread.is_alive()
    loader.close()  # idempotent
    with pytest.raises(StopIteration):
        next(loader)
    with ReplayLoader(store, RandomSampler(replacement=True, seed=0), BATCH, PAD) as loader:
        next(loader)
        thread = loader._worker.thread
    assert not thread.is_alive()


def test_close_while_worker_is_blocked(store):
    loader = ReplayLoader(store, RandomSampler(replacement=True, seed=0), BATCH, PAD, prefetch=2)
    deadline = time.monotonic() + 10
    while not (loader._ready.full() and loader._ring.free.empty()) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    # every buffer set is full and the queue too: the worker waits in a put with the last one
    assert loader._ready.full() and loader._ring.free.empty()
    thread = loader._worker.thread
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 5.0  # a blocked put must not wait for a consumer (generous for slow CI)
    assert not thread.is_alive()


def test_dropped_loader_stops_its_thread(store):
    loader = ReplayLoader(store, RandomSampler(replacement=True, seed=0), BATCH, PAD)
    next(loader)
    thread = loader._worker.thread
    del loader
    gc.collect()
    thread.join(3)
    assert not thread.is_alive()


def test_interpreter_exit_without_close(path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(os.path.dirname(diskreplay.__file__))!r})
        from diskreplay import ReplayStore, RandomSampler
        from diskreplay.loader import ReplayLoader
        store = ReplayStore({str(path)!r}, readonly=True)
        loader = ReplayLoader(store, RandomSampler(replacement=True, seed=0), 16, 0, prefetch=2)
        next(loader)
        print(time.time(), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the interpreter hung at exit with a loader left open")
    exited = time.time()
    assert proc.returncode == 0, err
    assert exited - float(out.split()[-1]) < 5.0


# --------------------------------------------------------------------------- errors


class FailingSampler:
    """Delegates to a real sampler and raises on its ``fail_on``-th call."""

    def __init__(self, fail_on):
        self.inner, self.calls, self.fail_on = RandomSampler(seed=0), 0, fail_on

    def sample(self, store, batch_size, **kw):
        self.calls += 1
        if self.calls == self.fail_on:
            raise ArithmeticError("boom from the sampler")
        return self.inner.sample(store, batch_size, **kw)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, d):
        self.inner.load_state_dict(d)


def test_worker_exception_is_reraised_with_its_traceback(store):
    loader = ReplayLoader(store, FailingSampler(fail_on=3), BATCH, PAD)
    next(loader)
    next(loader)  # drawn by the 2nd call: still delivered
    with pytest.raises(ArithmeticError, match="boom") as info:
        next(loader)
    text = "".join(traceback.format_exception(info.value))
    assert "FailingSampler" in text or "in sample" in text  # the worker's frames are kept
    assert "worker thread" in text  # the note
    with pytest.raises(ArithmeticError):  # sticky
        next(loader)
    loader.close()


def test_error_in_read_surfaces_at_first_batch(store):
    with ReplayLoader(store, RandomSampler(seed=0), BATCH, PAD, columns=["no_such_column"]) as loader:
        with pytest.raises(KeyError, match="no_such_column"):
            next(loader)


# --------------------------------------------------------------------------- state and resume


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_resume_in_a_new_process_state(path, kind):
    k, m = 3, 4
    with ReplayStore(path, readonly=True) as ro:
        want = reference(ro, SAMPLERS[kind](11), k + m)
    with ReplayStore(path) as s:
        with ReplayLoader(s, SAMPLERS[kind](11), BATCH, PAD, state_name="ld") as loader:
            for _ in range(k):
                next(loader)
            time.sleep(0.05)  # the worker has drawn ahead; the saved state must not include that
            loader.save_state()
    with ReplayStore(path) as s:  # a new store object, a sampler with another seed
        with ReplayLoader(s, SAMPLERS[kind](99), BATCH, PAD, state_name="ld", num_batches=m) as loader:
            got = [cloned(b) for b in loader]
    for g, w in zip(got, want[k:]):
        assert_batch_equal(g, w)
    assert len(got) == m


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_closing_saves_the_state_so_a_restart_continues_the_stream(path, kind):
    # README's SSR example saves nothing by hand: the end of the with block must
    with ReplayStore(path, readonly=True) as ro:
        want = reference(ro, SAMPLERS[kind](11), 5)
    with ReplayStore(path) as s:
        with ReplayLoader(s, SAMPLERS[kind](11), BATCH, PAD, state_name="ld") as loader:
            next(loader), next(loader)
            time.sleep(0.05)  # drawn ahead: not part of the saved state
        generation = s.generation
    with ReplayStore(path) as s:
        assert s.load_state("ld") is not None
        with pytest.raises(RuntimeError, match="consumer failed"):
            with ReplayLoader(s, SAMPLERS[kind](99), BATCH, PAD, state_name="ld") as loader:
                next(loader)
                raise RuntimeError("consumer failed")
        assert s.generation == generation  # an error in the block keeps the state saved before it
    with ReplayStore(path) as s:
        with ReplayLoader(s, SAMPLERS[kind](99), BATCH, PAD, state_name="ld", num_batches=3) as loader:
            got = [cloned(b) for b in loader]
    for g, w in zip(got, want[2:]):
        assert_batch_equal(g, w)


def test_closing_a_loader_of_a_closed_or_read_only_store_saves_nothing(path):
    with ReplayStore(path, readonly=True) as ro:
        with ReplayLoader(ro, RandomSampler(seed=0), BATCH, PAD, state_name="ld") as loader:
            next(loader)
        assert ro.load_state("ld") is None
    s = ReplayStore(path)
    loader = ReplayLoader(s, RandomSampler(seed=0), BATCH, PAD, state_name="ld")
    next(loader)
    s.close()
    loader.close()  # nothing to save into: no error
    with ReplayStore(path, readonly=True) as ro:
        assert ro.load_state("ld") is None


def test_load_state_dict_mid_stream(store):
    with ReplayLoader(store, PromptGroupSampler(num_groups=4, seed=2), BATCH, PAD) as loader:
        for _ in range(3):
            next(loader)
        state = loader.state_dict()
        after = [cloned(next(loader)) for _ in range(3)]
        loader.load_state_dict(state)
        again = [cloned(next(loader)) for _ in range(3)]
    for a, b in zip(after, again):
        assert_batch_equal(a, b)


def test_close_rewinds_the_sampler(store):
    sampler = PromptGroupSampler(num_groups=4, seed=6)
    want = reference(store, PromptGroupSampler(num_groups=4, seed=6), 5)
    with ReplayLoader(store, sampler, BATCH, PAD) as loader:
        next(loader), next(loader)
        time.sleep(0.05)
    with ReplayLoader(store, sampler, BATCH, PAD, num_batches=3) as loader:
        got = [cloned(b) for b in loader]
    for g, w in zip(got, want[2:]):
        assert_batch_equal(g, w)


def test_priority_updates_survive_state_dict(store):
    sampler = PrioritizedSampler(seed=0)
    with ReplayLoader(store, sampler, BATCH, PAD) as loader:
        b = next(loader)
        time.sleep(0.05)
        loader.update_priorities(b["rows"], torch.full((BATCH,), 123.0))
        prio = loader.state_dict()["data"]["priorities"]
        base = loader.state_dict()["data"]["prio_base"]
    assert (prio[b["rows"].numpy() - base] == 123.0).all()
    with pytest.raises(TypeError):
        ReplayLoader(store, RandomSampler(seed=0), BATCH, PAD, num_batches=0).update_priorities([0], [1.0])


# --------------------------------------------------------------------------- a reader following a writer


def test_readonly_store_follows_a_writer(tmp_path):
    p = tmp_path / "live"
    writer = ReplayStore(p, capacity=128)
    fill(writer, num_groups=32, group_size=4, seed=0)  # rows [0, 128)
    reader = ReplayStore(p, readonly=True)
    with ReplayLoader(reader, RandomSampler(replacement=True, seed=0), BATCH, PAD) as loader:
        assert next(loader)["rows"].max() < 128
        fill(writer, num_groups=32, group_size=4, seed=1)  # rows [128, 256); the first 128 are evicted
        fill(writer, num_groups=32, group_size=4, seed=2)  # and again: old segment files are deleted
        for _ in range(loader.prefetch + 3):  # batches built before the appends drain first
            batch = next(loader)
        rows = batch["rows"].numpy()
        assert rows.min() >= 256
        want = collate(writer.read(rows), PAD)
        for k, v in want.items():
            assert torch.equal(batch[k], v), k
    writer.close()
    reader.close()


class EvictAfterFirstDraw:
    """Draws, then (once) has the writer evict every row it drew before the loader reads them."""

    def __init__(self, writer):
        self.inner, self.writer, self.done = RandomSampler(replacement=True, seed=0), writer, False

    def sample(self, store, batch_size, **kw):
        rows = self.inner.sample(store, batch_size, **kw)
        if not self.done:
            self.done = True
            fill(self.writer, num_groups=32, group_size=4, seed=1)
            fill(self.writer, num_groups=32, group_size=4, seed=2)
            store.refresh()
        return rows

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, d):
        self.inner.load_state_dict(d)


def test_rows_evicted_between_draw_and_read_are_drawn_again(tmp_path):
    p = tmp_path / "live"
    with ReplayStore(p, capacity=128) as writer, ReplayStore(p, readonly=True) as reader:
        fill(writer, num_groups=32, group_size=4, seed=0)
        reader.refresh()
        with ReplayLoader(reader, EvictAfterFirstDraw(writer), BATCH, PAD, num_batches=3) as loader:
            got = [cloned(b) for b in loader]
        assert len(got) == 3
        for b in got:
            rows = b["rows"].numpy()
            assert rows.min() >= 256
            assert_batch_equal(b, {**collate(writer.read(rows), PAD), "rows": b["rows"]})


def test_buffer_extends_while_a_loader_reads_the_same_store(tmp_path):
    from diskreplay.buffer import ReplayBuffer
    from diskreplay.synthetic import make_rollouts

    def append(buf, seed):
        # prompt_id == row // 4, so a row read from the wrong place shows
        first = buf.store.next_row // 4
        buf.extend(make_rollouts(8, 4, seed=seed, first_group=first, prompt_mean=8, completion_mean=8))

    with ReplayBuffer(ReplayStore(tmp_path / "s", capacity=96), RandomSampler(replacement=True, seed=0),
                      BATCH) as buf:
        append(buf, 0)
        with ReplayLoader(buf.store, RandomSampler(replacement=True, seed=1), BATCH, PAD) as loader:
            for i in range(30):
                append(buf, i + 1)  # evicts as it goes
                b = next(loader)
                assert torch.equal(b["prompt_id"], b["rows"] // 4)


def test_state_dict_counts_only_the_batches_received(store):
    import numpy as np
    sampler = RandomSampler(replacement=True, seed=2)
    with ReplayLoader(store, sampler, BATCH, PAD, prefetch=3) as loader:
        got = [next(loader)["rows"].numpy().copy() for _ in range(2)]
        time.sleep(0.1)  # the worker draws batches ahead
        state = loader.state_dict()
    rows = np.concatenate(got)
    want = np.bincount(rows - state["data"]["counts_base"], minlength=len(state["data"]["counts"]))
    assert state["data"]["counts"].tolist() == want.tolist()
    assert "counts" not in state["position"] and state["position"]["draws"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_a_cuda_device_without_cuda_warns_and_yields_cpu_tensors(store):
    """DESIGN.md: on a machine without CUDA the loader yields CPU tensors, so one training script
    runs on a laptop, a CPU CI machine and the cluster."""
    want = reference(store, PromptGroupSampler(num_groups=4, seed=4), 2)
    with pytest.warns(RuntimeWarning, match="no CUDA, so the loader yields CPU tensors"):
        loader = ReplayLoader(store, PromptGroupSampler(num_groups=4, seed=4), BATCH, PAD, device="cuda",
                              num_batches=2)
    with loader:
        got = list(loader)
    assert len(got) == 2
    for a, b in zip(got, want):
        assert a["completion_ids"].device.type == "cpu"
        assert torch.equal(a["completion_ids"], b["completion_ids"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without CUDA")
def test_a_numpy_or_tensor_local_rank_is_a_cuda_index(store):
    import numpy as np

    for rank in (np.int64(0), torch.tensor(0)):
        with pytest.warns(RuntimeWarning, match="no CUDA"):
            ReplayLoader(store, RandomSampler(seed=0), BATCH, PAD, num_batches=1, device=rank).close()


@pytest.mark.parametrize("before, after", [(2, 1), (2, 4), (1, 2)])
def test_resuming_under_another_world_size_is_refused_by_every_rank(path, before, after):
    """States saved by ranks of another world size: some ranks started afresh with no word while others
    resumed or raised (2 -> 4: ranks 0-1 raised, 2-3 went on: a real job hangs in its next collective)."""
    from diskreplay import SamplerError

    with ReplayStore(path) as s:
        for r in range(before):
            with ReplayLoader(s, RandomSampler(seed=3, rank=r, world_size=before), BATCH, PAD, state_name="ld",
                              num_batches=1) as loader:
                list(loader)
        for r in range(after):
            with pytest.raises(SamplerError, match="state_name=.ld"):
                ReplayLoader(s, RandomSampler(seed=3, rank=r, world_size=after), BATCH, PAD, state_name="ld")
            with pytest.raises(SamplerError, match="state_name=.ld"):
                ReplayBuffer(s, RandomSampler(seed=3, rank=r, world_size=after), BATCH, state_name="ld")
        ReplayLoader(s, RandomSampler(seed=3, rank=0, world_size=after), BATCH, PAD, state_name="other").close()


def test_ranks_sharing_a_state_name_keep_their_own_states(path):
    """Closing now saves: two ranks of one store and one state_name would overwrite each other's."""
    with ReplayStore(path, readonly=True) as ro:
        want = {r: reference(ro, RandomSampler(seed=3, rank=r, world_size=2), 4) for r in (0, 1)}
    with ReplayStore(path) as s:
        for r in (0, 1):
            with ReplayLoader(s, RandomSampler(seed=3, rank=r, world_size=2), BATCH, PAD, state_name="ld") as loader:
                next(loader), next(loader)
        assert s.load_state("ld") is None and s.load_state("ld.rank0") and s.load_state("ld.rank1")
    with ReplayStore(path) as s:
        for r in (0, 1):
            with ReplayLoader(s, RandomSampler(seed=3, rank=r, world_size=2), BATCH, PAD, state_name="ld",
                              num_batches=2) as loader:
                got = [cloned(b) for b in loader]
            for g, w in zip(got, want[r][2:]):
                assert_batch_equal(g, w)
