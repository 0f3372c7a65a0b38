import os

import numpy as np
import pytest

from diskreplay import ReplayStore

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def assert_rows_equal(got, expected):
    """Compare a ``store.read`` result with expected per-row Python/numpy values."""
    for name, want in expected.items():
        col = got[name]
        if isinstance(want, list) and want and (isinstance(want[0], np.ndarray) or want[0] is None):
            if col is None:
                assert all(w is None for w in want), name
                continue
            assert len(col) == len(want), name
            for i, w in enumerate(want):
                r = col[i]
                if w is None:
                    assert r is None, (name, i)
                else:
                    assert r is not None, (name, i)
                    np.testing.assert_array_equal(r, w, err_msg=f"{name} row {i}")
        elif isinstance(col, list):
            assert col == list(want), name
        else:
            np.testing.assert_array_equal(col, np.asarray(want), err_msg=name)


@pytest.fixture
def store(tmp_path):
    with ReplayStore(tmp_path / "store", capacity=None) as s:
        yield s


# Real S3-compatible servers on 127.0.0.1 (seaweedfs, moto), started once per session.
from .s3servers import s3_server, s3_servers, s3_url  # noqa: E402,F401
