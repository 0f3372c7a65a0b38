"""``diskreplay verify``'s progress bar on a terminal that reports a 0x0 size (a pty nobody sized:
``docker exec -t``, some CI runners): tqdm's own sizing took it as -1 rows and hid the bar."""

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy as np
import pytest

from diskreplay import ReplayStore

ROOT = Path(__file__).resolve().parent.parent


def _on_a_pty_of_no_size(args):
    """Run ``python -m diskreplay *args`` with stdin, stdout and stderr on a 0x0 pty; its exit code and output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
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


def test_the_verify_bar_shows_on_a_terminal_that_reports_no_size(tmp_path):
    pytest.importorskip("tqdm")
    path = str(tmp_path / "s")
    rng = np.random.default_rng(0)
    with ReplayStore(path) as s:
        s.extend({"prompt_id": np.arange(4000) // 8,
                  "completion_ids": list(rng.integers(0, 30000, (4000, 64)).astype(np.int32)),
                  "rewards": rng.random(4000)})
    rc, text = _on_a_pty_of_no_size(["verify", path])
    assert rc == 0, text
    assert "verify:" in text and "%|" in text and "B/s" in text, text
