"""The store-vs-model state machine of ``diskreplay.testing.stateful``, for many writers and for one."""

from hypothesis import HealthCheck, settings

from diskreplay.testing.stateful import SingleWriterMachine, WritersMachine

_SETTINGS = settings(max_examples=12, stateful_step_count=12, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])

TestManyWriters = WritersMachine.TestCase
TestManyWriters.settings = _SETTINGS
TestSingleWriter = SingleWriterMachine.TestCase
TestSingleWriter.settings = settings(_SETTINGS, max_examples=5)
