"""A reopened store's first batch: WILLNEED hints for every page it needs in the segments where a page it
reads is cold, none for those whose pages it reads are all in the page cache (the hints cost about a read
there)."""

from __future__ import annotations

import os

import pytest

from diskreplay import Collator, PromptGroupSampler, ReplayStore
from diskreplay.segment import Segment
from diskreplay.store.compaction import MergePolicy
from diskreplay.synthetic import make_rollouts


def _evict(path, only=None):
    for root, _, files in os.walk(path):
        for name in files:
            if only is not None and name != only:
                continue
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@pytest.fixture()
def store_path(tmp_path):
    path = str(tmp_path / "store")
    with ReplayStore(path, merge_policy=MergePolicy(max_bytes=1)) as store:
        for k in range(4):
            store.extend(make_rollouts(16, 4, seed=k, first_group=16 * k, prompt_mean=200, completion_mean=400))
        assert len(store.manifest.segments) == 4
    return path


def _first_batch_hints(path, monkeypatch):
    calls = []
    real = Segment.advise

    def advise(self, ranges):
        calls.append((os.path.basename(self.path), len(ranges)))
        return real(self, ranges)

    monkeypatch.setattr(Segment, "advise", advise)
    with ReplayStore(path, readonly=True) as store:
        rows = PromptGroupSampler(num_groups=32, seed=0).sample(store, 128)
        Collator(0).read(store, rows)
    monkeypatch.setattr(Segment, "advise", real)
    return calls


def test_a_reopened_store_hints_its_first_batch_only_when_its_files_are_cold(store_path, monkeypatch):
    with ReplayStore(store_path, readonly=True) as store:  # every page read once: all in the page cache
        store.read(store.row_ids())
    assert _first_batch_hints(store_path, monkeypatch) == []
    _evict(store_path)
    # opening a segment reads ahead into its evicted pages, sooner or later: which files are still out
    # of the page cache when the read asks is the kernel's, so here every one is (as on a cold start)
    monkeypatch.setattr(Segment, "in_page_cache", lambda self: False)
    monkeypatch.setattr(Segment, "rows_in_page_cache", lambda self, names, rows: False)
    cold = _first_batch_hints(store_path, monkeypatch)
    assert cold and sum(n for _, n in cold) > 0
    assert len({name for name, _ in cold}) == 4  # every touched segment (each holds rows of the batch)


def test_only_the_segments_with_pages_out_of_the_page_cache_are_hinted(store_path, monkeypatch):
    with ReplayStore(store_path, readonly=True) as store:
        store.read(store.row_ids())
        one = os.path.basename(store.manifest.segments[1].file)
    # which files the page cache holds is the kernel's (opening a segment reads ahead into the pages just
    # evicted, sooner or later): the residency of each file is given here, the choice of hints is tested
    monkeypatch.setattr(Segment, "in_page_cache", lambda self: os.path.basename(self.path) != one)
    monkeypatch.setattr(Segment, "rows_in_page_cache", lambda self, names, rows: os.path.basename(self.path) != one)
    hints = _first_batch_hints(store_path, monkeypatch)
    assert hints and {name for name, _ in hints} == {one}
