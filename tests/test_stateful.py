"""The store-vs-model state machine of ``diskreplay.testing.stateful``, for many writers and for one, on
every backend: a directory, memory, and an S3 server (fewer examples there: each step is requests)."""

import pytest
from hypothesis import HealthCheck, settings

from diskreplay.testing.stateful import InMemory, SingleWriterMachine, WritersMachine

_SETTINGS = settings(max_examples=12, stateful_step_count=12, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])

TestManyWriters = WritersMachine.TestCase
TestManyWriters.settings = _SETTINGS
TestSingleWriter = SingleWriterMachine.TestCase
TestSingleWriter.settings = settings(_SETTINGS, max_examples=5)


class MemoryWriters(InMemory, WritersMachine):
    pass


class MemorySingleWriter(InMemory, SingleWriterMachine):
    pass


TestMemoryManyWriters = MemoryWriters.TestCase
TestMemoryManyWriters.settings = _SETTINGS
TestMemorySingleWriter = MemorySingleWriter.TestCase
TestMemorySingleWriter.settings = settings(_SETTINGS, max_examples=5)


class S3Writers(WritersMachine):
    """Each run's store is a fresh bucket's prefix on the test server ``server`` (set by the fixture)."""

    server = None
    cache_dir = ""

    def new_location(self) -> str:
        return f"s3://{self.server.new_bucket()}/store"

    def store_options(self):
        return {"storage_options": self.server.storage_options, "cache_dir": self.cache_dir}

    def remove_location(self, location: str) -> None:
        """The test server's buckets go with the server."""


@pytest.fixture
def seaweedfs(s3_servers, tmp_path):
    S3Writers.server = s3_servers("seaweedfs")
    S3Writers.cache_dir = str(tmp_path / "cache")
    yield
    S3Writers.server = None


TestS3ManyWriters = pytest.mark.usefixtures("seaweedfs")(S3Writers.TestCase)
TestS3ManyWriters.settings = settings(_SETTINGS, max_examples=3, stateful_step_count=8)
