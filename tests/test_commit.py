"""The commit path: the writer's open, garbage collection and its ordering, errors after the commit point."""

from __future__ import annotations

import errno
import json
import os
import warnings

import numpy as np
import pytest

from diskreplay import ReplayStore
from diskreplay import format as fmt

from .test_durability import check_live_rows, expected_rows


def _batch(store, n=4):
    return expected_rows(np.arange(store.next_row, store.next_row + n))


# --------------------------------------------------------------------------- the writer lock (issue 12.1)


@pytest.mark.parametrize("call", ["ftruncate", "write"])
def test_lock_is_released_when_writing_the_pid_fails(tmp_path, monkeypatch, call):
    path = str(tmp_path / "store")
    ReplayStore(path).close()
    real = getattr(os, call)
    lock = os.path.join(path, fmt.LOCK_FILE)

    def failing(fd, *args):
        if os.readlink(f"/proc/self/fd/{fd}") == lock:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, *args)

    monkeypatch.setattr(os, call, failing)
    with pytest.raises(OSError, match="LOCK") as info:
        ReplayStore(path)
    assert info.value.errno == errno.EIO and info.value.filename == lock
    monkeypatch.undo()
    with ReplayStore(path) as store:  # the failed open left no flock behind in this process
        store.extend(_batch(store))


# --------------------------------------------------------------------------- unreadable manifests (issue 12.2)


def test_an_unreadable_manifest_and_its_files_are_not_collected(tmp_path, monkeypatch):
    path = str(tmp_path / "store")
    with ReplayStore(path, capacity=4) as store:
        for _ in range(6):  # each append evicts the previous segment
            store.extend(_batch(store))
        retained = fmt.list_generations(path)
        oldest = fmt.load_manifest(os.path.join(path, fmt.manifest_file(retained[-1])))
    only_its = [f for f in oldest.files() if all(
        f not in fmt.load_manifest(os.path.join(path, fmt.manifest_file(g))).files() for g in retained[:-1])]
    assert only_its
    real = fmt.read_file
    target = os.path.join(path, oldest.file)

    def eio(p, *args):
        if p == target:
            raise OSError(errno.EIO, "Input/output error", p)
        return real(p, *args)

    monkeypatch.setattr(fmt, "read_file", eio)
    with pytest.warns(RuntimeWarning, match="cannot read manifest"):
        ReplayStore(path).close()
    monkeypatch.undo()
    assert os.path.exists(target)
    for f in only_its:
        assert os.path.exists(os.path.join(path, f)), f
    with ReplayStore(path) as store:  # once it reads again, normal clean-up resumes
        check_live_rows(store, 4)


# --------------------------------------------------------------------------- ordered, durable deletions (issue 12.3)


class _Trace:
    """Unlinks and fsyncs of a store, in order, by path relative to the store."""

    def __init__(self, root, monkeypatch):
        self.root, self.events = root, []
        real_unlink, real_fsync = os.unlink, os.fsync

        def unlink(p, *a, **k):
            real_unlink(p, *a, **k)
            self.events.append(("unlink", os.path.relpath(os.path.abspath(p), root)))

        def fsync(fd):
            real_fsync(fd)
            self.events.append(("fsync", os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), root)))

        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(os, "fsync", fsync)


def _naming(root):
    """data file -> manifests naming it, for every manifest on disk."""
    out = {}
    for g in fmt.list_generations(root):
        m = fmt.load_manifest(os.path.join(root, fmt.manifest_file(g)))
        for f in m.files():
            out.setdefault(f, set()).add(m.file)
    return out


def _check_power_cut_safe(trace, naming):
    """At every unlink of a data file, each manifest naming it is already unlinked *and* that unlink
    made durable by an fsync of manifests/; every unlink is made durable before the call returns."""
    gone_durably, gone = set(), set()
    pending = {}
    for kind, rel in trace.events:
        if kind == "unlink":
            if rel.startswith(fmt.MANIFEST_DIR + "/"):
                gone.add(rel)
            else:
                assert naming.get(rel, set()) <= gone_durably, \
                    f"{rel} unlinked while {naming[rel] - gone_durably} may come back after a power cut"
            pending.setdefault(os.path.dirname(rel), set()).add(rel)
        else:
            pending.pop(rel, None)
            if rel == fmt.MANIFEST_DIR:
                gone_durably |= gone
    assert not pending, f"unlinks never made durable: {pending}"


def test_deletions_are_ordered_and_durable(tmp_path, monkeypatch):
    path = str(tmp_path / "store")
    store = ReplayStore(path, capacity=4)
    for _ in range(fmt.KEEP_MANIFESTS + 1):
        store.extend(_batch(store))
    for _ in range(3):  # incremental clean-up after each commit
        naming = _naming(path)
        with monkeypatch.context() as mp:
            trace = _Trace(path, mp)
            store.extend(_batch(store))
        assert any(k == "unlink" and not r.startswith("manifests") for k, r in trace.events)
        _check_power_cut_safe(trace, naming)
    store.close()
    # the open's full sweep, with a stale manifest and an unreferenced segment left by "a crash"
    with open(os.path.join(path, fmt.manifest_file(1)), "wb") as f:
        f.write(fmt.signed_bytes(fmt.Manifest(generation=1, next_segment=1).body()))
    with open(os.path.join(path, fmt.segment_file(10 ** 9)), "wb") as f:
        f.write(b"garbage")
    naming = _naming(path)
    with monkeypatch.context() as mp:
        trace = _Trace(path, mp)
        ReplayStore(path).close()
    assert ("unlink", fmt.segment_file(10 ** 9)) in trace.events
    _check_power_cut_safe(trace, naming)
