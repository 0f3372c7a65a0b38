"""``diskreplay verify``'s progress bar on a terminal that reports a 0x0 size (a pty nobody sized:
``docker exec -t``, some CI runners): tqdm's own sizing took it as -1 rows and hid the bar."""

from pathlib import Path

import numpy as np
import pytest

from diskreplay import ReplayStore

from .conftest import on_a_pty_of_no_size

ROOT = Path(__file__).resolve().parent.parent




def test_the_verify_bar_shows_on_a_terminal_that_reports_no_size(tmp_path):
    pytest.importorskip("tqdm")
    path = str(tmp_path / "s")
    rng = np.random.default_rng(0)
    with ReplayStore(path) as s:
        s.extend({"prompt_id": np.arange(4000) // 8,
                  "completion_ids": list(rng.integers(0, 30000, (4000, 64)).astype(np.int32)),
                  "rewards": rng.random(4000)})
    rc, text = on_a_pty_of_no_size(["verify", path])
    assert rc == 0, text
    assert "verify:" in text and "%|" in text and "B/s" in text, text
