"""Root conftest: skip doctest collection of optional integrations whose extra is not installed."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("trl") is None:
    collect_ignore.append("diskreplay/integrations/trl.py")
if importlib.util.find_spec("torchrl") is None or importlib.util.find_spec("tensordict") is None:
    collect_ignore.append("diskreplay/integrations/torchrl.py")

import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_temp_dirs(request, tmp_path_factory):
    """Doctests make stores with tempfile.mkdtemp(): give each one a directory that is removed after it."""
    if type(request.node).__name__ != "DoctestItem":
        yield
        return
    where = tmp_path_factory.mktemp("doctest")
    before, tempfile.tempdir = tempfile.tempdir, str(where)
    try:
        yield
    finally:
        tempfile.tempdir = before
        shutil.rmtree(where, ignore_errors=True)
