"""Root conftest: a private temp directory per test and doctest; skip doctest collection of
optional integrations whose extra is not installed."""

import importlib.util
import os
import shutil
import tempfile

import pytest

collect_ignore = []
if importlib.util.find_spec("trl") is None:
    # planners, checkpoint and batch need no TRL; the package docstring, config and trainer do
    collect_ignore += [f"diskreplay/integrations/trl/{m}.py" for m in ("__init__", "config", "trainer")]
if importlib.util.find_spec("torchrl") is None or importlib.util.find_spec("tensordict") is None:
    collect_ignore.append("diskreplay/integrations/torchrl.py")


@pytest.fixture(autouse=True)
def _private_tempdir(tmp_path_factory):
    """Point ``tempfile`` (and ``TMPDIR``, for child processes) at a fresh directory, removed afterwards.

    The docstring examples make stores with ``tempfile.mkdtemp()``, as a user
    would; without this, every run left dozens of ``tmp*`` stores behind.
    Fixtures of a wider scope are set up before this one, so what they create
    outlives the test as they intend; so does pytest's own ``tmp_path`` root,
    made here first (it is made under the temp directory on first use).
    """
    tmp_path_factory.getbasetemp()
    saved_dir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    path = tempfile.mkdtemp(prefix="diskreplay-test-")
    tempfile.tempdir = os.environ["TMPDIR"] = path
    try:
        yield path
    finally:
        tempfile.tempdir = saved_dir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(path, ignore_errors=True)
