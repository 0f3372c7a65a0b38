"""The suite leaves nothing in the temp directory (the docstring examples make stores with
``tempfile.mkdtemp()``; the root conftest gives each test and doctest its own directory)."""

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# doctests that make stores with tempfile.mkdtemp(), and a test whose child processes use
# the temp directory too (their output files)
# (torch-free ones: importing torch in the child would triple the time)
TARGETS = [f"diskreplay/store/replay_store.py::diskreplay.store.replay_store.ReplayStore{name}"
           for name in ("", ".read", ".compact", ".save_state")] + [
    "diskreplay/_fileio.py", "diskreplay/errors.py", "diskreplay/verify/check.py", "diskreplay/verify/repair.py",
    "tests/test_durability.py::test_killed_writer_leaves_no_lock",
    "tests/test_durability.py::test_repair_needs_the_writer_lock"]


def test_a_run_leaves_nothing_in_the_temp_directory(tmp_path):
    watched = tmp_path / "tmp"
    watched.mkdir()
    env = dict(os.environ, TMPDIR=str(watched), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *TARGETS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "passed" in out.stdout
    # pytest's own tmp_path root stays (it keeps the last three runs, by design), and it stays
    # usable from one test to the next
    assert [n for n in os.listdir(watched) if not n.startswith("pytest-of-")] == []


def test_each_test_has_its_own_temp_directory(_private_tempdir):
    assert tempfile.gettempdir() == _private_tempdir == os.environ["TMPDIR"]
    assert os.listdir(_private_tempdir) == []
