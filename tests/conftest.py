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


def flip_byte(path, rel, at):
    """Damage a store's file: flip one bit of the byte at offset ``at`` of ``path/rel``."""
    with open(os.path.join(path, rel), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def race_before_publish(monkeypatch, loser, rival, times=1):
    """Let ``rival`` (a store) commit right before ``loser`` publishes a manifest, ``times`` times:
    ``loser`` loses the race for that generation. Returns the count of races still to come."""
    from diskreplay import format as fmt
    from diskreplay.storage import LocalStorage
    from diskreplay.testing.workload import batch_for

    real = LocalStorage.link_new
    left = [times]

    def put(self, src, rel):
        if self is loser._committer.storage and rel.startswith(fmt.MANIFEST_DIR) and left[0]:
            left[0] -= 1
            rival.extend(batch_for(9, 100 + left[0]))
        return real(self, src, rel)

    monkeypatch.setattr(LocalStorage, "link_new", put)
    return left


def package_at(commit, dest):
    """The ``diskreplay`` package as it was at ``commit``, extracted from git under ``dest`` (the
    directory to put first on ``sys.path``); skips the test where that history is unavailable."""
    import io
    import subprocess
    import tarfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        raw = subprocess.run(["git", "-C", root, "archive", commit, "diskreplay"], capture_output=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"git history with {commit} is not available")
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        tar.extractall(dest)
    return str(dest)


def format_md_table(store_path):
    """Run docs/FORMAT.md's plain-pyarrow reader verbatim on the store at ``store_path``; its table."""
    import textwrap

    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "FORMAT.md")).read()
    start = doc.index("import json, os, pyarrow as pa")
    start = doc.rindex("\n", 0, start) + 1
    recipe = textwrap.dedent(doc[start:doc.index("```", start)])
    scope = {}
    cwd = os.getcwd()
    try:
        os.chdir(os.path.dirname(os.path.abspath(store_path)))
        exec(compile(recipe.replace("STORE", os.path.basename(store_path)), "FORMAT.md", "exec"), scope)
    finally:
        os.chdir(cwd)
    return scope["table"]


@pytest.fixture
def store(tmp_path):
    with ReplayStore(tmp_path / "store", capacity=None) as s:
        yield s


# Real S3-compatible servers on 127.0.0.1 (seaweedfs, moto), started once per session.
def on_a_pty_of_no_size(args):
    """Run ``python -m diskreplay *args`` with stdin, stdout and stderr on a 0x0 pty; its exit code and output."""
    import fcntl
    import pty
    import select
    import struct
    import subprocess
    import sys
    import termios

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = b""
    master, slave = pty.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        p = subprocess.Popen([sys.executable, "-m", "diskreplay", *args], stdin=slave, stdout=slave, stderr=slave,
                             env=env, close_fds=True)
        os.close(slave)
        slave = None
        while select.select([master], [], [], 60)[0]:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # the child closed the pty
                break
            if not chunk:
                break
            out += chunk
        return p.wait(timeout=60), out.decode(errors="replace")
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)


from .s3servers import s3_server, s3_servers, s3_url  # noqa: E402,F401


@pytest.fixture(scope="module")
def paged_small_segments():
    """Segments of every size carry page checksums (they begin at 64 KiB otherwise): for the tests of
    page checks, cold hints and persisted page tables, whose stores hold segments of a few rows."""
    from diskreplay import segment

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(segment, "PAGED_SEGMENT_BYTES", 0)
        yield
