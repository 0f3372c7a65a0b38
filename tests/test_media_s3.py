"""Media columns on object storage (the ``s3_server`` fixture of ``tests/s3servers.py``): blobs are
objects created only if absent, served by one read each (nothing is mapped), checked by verify."""

from __future__ import annotations

import numpy as np
import pytest

from diskreplay import Media, MediaReader, ReplayStore
from diskreplay.verify import verify_store

from .test_media import group, image


@pytest.mark.parametrize("multi_writer", [False, True])
def test_media_on_object_storage(s3_server, s3_url, tmp_path, multi_writer):
    opts = dict(storage_options=s3_server.storage_options, cache_dir=str(tmp_path / "cache"))
    with ReplayStore(s3_url, multi_writer=multi_writer, **opts) as store:
        store.extend(group([1, 2]), token="w:0")
        store.extend(group([2, 3]), token="w:1")
        assert store.extend(group([2, 3]), token="w:1").tolist() == list(range(8, 16))
        assert len(store.manifest.media) == 3
    with ReplayStore(s3_url, readonly=True, **opts) as ro:
        got = MediaReader(ro).batch(ro.read(ro.row_ids())["image"])
        assert [bytes(v) for v in got] == [image(k) for k in (1, 2, 2, 3) for _ in range(4)]
        arr = np.arange(6, dtype=np.float64).reshape(2, 3)
        assert ro.storage.map(ro.manifest.media[0].file) is None  # (served by reads: nothing maps)
    with ReplayStore(s3_url, multi_writer=multi_writer, **opts) as store:
        store.extend({"prompt_id": np.array([4]), "completion_ids": [[1]], "image": Media([arr])})
        assert np.array_equal(MediaReader(store).get(store.read([16])["image"][0]), arr)
    assert verify_store(s3_url, storage_options=s3_server.storage_options)["ok"]
