"""TransferQueue's own tests, run against the DiskReplay backend (see each file's header for what was adapted).

``KVStorageManager._merge_tensors_to_tensordict`` asks Ray for its runtime context, which starts a local Ray
cluster when none is running: that test gets one on 127.0.0.1 (2 CPUs, no dashboard), stopped after it, and
is marked slow like the end-to-end module, which starts its own.
"""

import pytest

_NEEDS_RAY = {"test_merge_tensors_to_tensordict"}


def pytest_collection_modifyitems(config, items):
    # a conftest's collection hook sees the whole session's items (doctests included), not only its own
    for item in items:
        if getattr(item, "originalname", None) in _NEEDS_RAY:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _local_ray_cluster(request):
    if getattr(request.node, "originalname", None) not in _NEEDS_RAY:
        yield
        return
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
