"""An endpoint nothing listens at fails at once; a server that does not answer is retried (5xx and a
server restarting mid-run: tests/test_storage.py).

Real sockets on 127.0.0.1: a closed port (the kernel refuses the connection) and a listening socket that
never accepts (the connection opens, no answer comes: a timeout)."""

from __future__ import annotations

import socket
import time

import pytest

from diskreplay import ReplayStore
from diskreplay.errors import ObjectStoreError
from diskreplay.storage import S3Storage

from .s3servers import free_port

pytest.importorskip("obstore")

_KEYS = {"access_key_id": "k", "secret_access_key": "s", "region": "us-east-1"}


def test_a_refused_connection_fails_at_once_with_the_default_retry_timeout(tmp_path):
    """It was retried like a dropped connection for retry_timeout (30 s by default) before the error."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    t = time.monotonic()
    with pytest.raises(ObjectStoreError, match=rf"^s3://bucket/store: cannot reach the object store at {endpoint} "
                                               r"\(connection refused.*AWS_ENDPOINT_URL") as info:
        ReplayStore("s3://bucket/store", storage_options={"endpoint": endpoint, **_KEYS},
                    cache_dir=str(tmp_path / "cache"))
    assert time.monotonic() - t < 5 and "\n" not in str(info.value)
    st = S3Storage("s3://bucket/p", {"endpoint": endpoint, **_KEYS}, cache_dir=str(tmp_path / "c"))  # no request
    t = time.monotonic()
    for call in (lambda: st.write_new("x", b"1"), lambda: st.read_bytes("x"), lambda: st.read_range("x", 0, 1),
                 lambda: st.put_if_absent("manifests/1.json", b"m"), lambda: st.remove_held("x", "etag")):
        with pytest.raises(ObjectStoreError, match=r"^s3://bucket/p: .*connection refused: nothing listens at 127"):
            call()
    assert time.monotonic() - t < 5


def test_a_server_that_does_not_answer_is_still_retried(tmp_path):
    """A connection that opens but gets no answer is a timeout: retried for retry_timeout, not refused at once."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes connections; nothing ever reads or answers them
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        st = S3Storage("s3://bucket/p", {"endpoint": endpoint, **_KEYS, "timeout": 0.3, "retry_timeout": 1.5},
                       cache_dir=str(tmp_path / "c"))
        t = time.monotonic()
        with pytest.raises(ObjectStoreError, match=r"cannot reach the object store.*retrying for up to 1.5 s"):
            st.read_bytes("x")
        assert time.monotonic() - t >= 1.0
