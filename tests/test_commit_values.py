"""A commit as a frozen value: its rebase makes a new value, and the commit loop's result says
what it published and which files it wrote (store/commits.py, store/committer.py), on a real
directory without a ReplayStore in between."""

import dataclasses
import os

import numpy as np
import pyarrow as pa
import pytest

from diskreplay import ReplayStore
from diskreplay import format as fmt
from diskreplay.errors import ConditionalWriteError
from diskreplay.format.states import encode_state
from diskreplay.storage import LocalStorage
from diskreplay.store import ops
from diskreplay.store.commits import Commit, Relocation, state_commit
from diskreplay.store.committer import Committer
from diskreplay.store.compaction import MergePolicy
from diskreplay.store.writing import SegmentWriter


def _committer(tmp_path, **kw):
    """A committer over a new store's directory (made by ReplayStore, then closed)."""
    path = str(tmp_path / "s")
    ReplayStore(path, **kw).close()
    storage = LocalStorage(path)
    manifest, _ = fmt.load_newest_manifest(storage)
    return path, Committer(storage, fmt.StoreOptions.read(storage), manifest)


def _written(path, committer, keys, defer=True):
    pieces = [pa.RecordBatch.from_pydict({"prompt_id": pa.array(k, pa.int64())}) for k in keys]
    m = committer.manifest
    written = SegmentWriter(path, MergePolicy()).write(committer, committer.options, m, pieces, m.next_segment,
                                                       m.next_row, defer=defer)
    return pieces, written


def test_an_append_commit_publishes_its_files_and_says_so(tmp_path):
    path, committer = _committer(tmp_path)
    _, written = _written(path, committer, [[1, 1, 2], [2, 3]])
    assert written.writes and not any(os.path.exists(os.path.join(path, rel)) for rel in written.files)
    commit = Commit(ops.Append(written.entries, 5), written.files, written.writes, written.dirs)
    installed = []
    result = committer.commit(commit, install=installed.append)
    assert installed == [result.manifest] and committer.manifest is result.manifest
    assert result.manifest.next_row == 5 and result.manifest.segments == written.entries
    assert result.files == written.files == (fmt.segment_file(0), fmt.groups_file(0), fmt.segment_file(1),
                                              fmt.groups_file(1))
    assert all(os.path.exists(os.path.join(path, rel)) for rel in result.files)
    assert result.commit.writes == () and commit.writes == written.writes  # the value handed in is unchanged
    assert commit.rows(result.manifest).tolist() == [0, 1, 2, 3, 4]


def test_a_commit_is_frozen(tmp_path):
    commit = Commit(ops.Evict(3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        commit.files = ("x",)
    assert commit.on(fmt.Manifest(next_row=9)) is commit and commit.rows(fmt.Manifest()) is None


def test_a_rebase_is_a_new_value_with_its_sidecars_encoded_again(tmp_path):
    """An append whose sidecars record global row ids, rebased on a base that ends elsewhere:
    new entries and sidecars for the new rows, each sidecar written once; the old value stands."""
    path, committer = _committer(tmp_path)
    pieces, written = _written(path, committer, [[1, 1, 2], [2, 3]])
    commit = Commit(ops.Append(written.entries, 5), written.files, written.writes, written.dirs,
                    relocation=Relocation(committer.options, tuple(pieces), written.checksums, 0))
    base = fmt.Manifest(generation=4, head=7, next_row=7, next_segment=2)
    moved = commit.on(base)
    assert moved is not commit and moved.on(base) is moved
    assert [e.first_row for e in moved.op.entries] == [7, 10]
    assert [e.first_row for e in commit.op.entries] == [0, 3]  # unchanged
    names = [rel for rel, _, _ in moved.writes]
    assert sorted(names) == sorted(rel for rel, _, _ in commit.writes) and len(set(names)) == len(names)
    old = dict((rel, data) for rel, data, _ in commit.writes)
    new = dict((rel, data) for rel, data, _ in moved.writes)
    assert new[fmt.segment_file(0)] is old[fmt.segment_file(0)]
    assert bytes(new[fmt.groups_file(0)]) != bytes(old[fmt.groups_file(0)])
    assert moved.files == commit.files  # the same names: rewritten in place
    # published, then rebased again: only the sidecars are left to write
    again = moved.published().on(fmt.Manifest(generation=5, next_row=12))
    assert sorted(rel for rel, _, _ in again.writes) == [fmt.groups_file(0), fmt.groups_file(1)]
    result = committer.commit(moved, install=lambda new: None)  # the real base: rows from 0 again
    assert [e.first_row for e in result.commit.op.entries] == [0, 3] and result.manifest.next_row == 5
    assert all(os.path.exists(os.path.join(path, rel)) for rel in result.files)


def test_a_segment_id_another_commit_names_is_refused_and_its_files_kept(tmp_path):
    path, committer = _committer(tmp_path)
    _, written = _written(path, committer, [[1]], defer=False)
    commit = Commit(ops.Append(written.entries, 1), written.files, reserved=True)
    other = committer.commit(Commit(ops.Append(written.entries, 1)), install=lambda new: None).manifest
    assert commit.taken(other) == (0,) and commit.removable(other) == ()
    with pytest.raises(ConditionalWriteError, match="created by two writers"):
        committer.commit(commit, install=lambda new: None)
    assert all(os.path.exists(os.path.join(path, rel)) for rel in written.files)  # the other commit's


def test_a_state_commit_is_a_value_of_the_same_kind(tmp_path):
    path, committer = _committer(tmp_path)
    commit = state_commit(committer, "sampler", encode_state({"cursor": 3, "w": np.ones(2)}), 1, False)
    assert isinstance(commit.op, ops.SaveState) and commit.files == (commit.op.entry.file,)
    assert commit.started is not None and commit.token is None
    result = committer.commit(commit, install=lambda new: None)
    assert result.manifest.states["sampler"] == commit.op.entry and result.files == commit.files


def test_a_duplicate_token_writes_nothing_and_removes_the_new_files(tmp_path):
    path, committer = _committer(tmp_path)
    token = fmt.TokenRecord("w:1", 0, 2, 0, 1)
    for attempt in range(2):
        _, written = _written(path, committer, [[1, 1]], defer=False)
        commit = Commit(ops.Append(written.entries, 2, token), written.files)
        result = committer.commit(commit, install=lambda new: None)
    assert result.duplicate is not None and result.files == () and result.manifest.next_row == 2
    assert not any(os.path.exists(os.path.join(path, rel)) for rel in written.files)
