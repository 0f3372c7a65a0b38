"""A process that exits with stores, streams and writers still open (never closed) exits quietly: nothing
of diskreplay runs while the interpreter tears its modules down."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What docs/streams.md's block leaves to the reader: a generator, a train step, a loop condition.
_PRELUDE = """
from diskreplay.synthetic import make_rollouts
i, step, version = 0, 0, 0
def generate(step):
    return make_rollouts(32, seed=step)
def train_step(batch):
    return 0.0
class _Training:
    left = 1
    def __bool__(self):
        self.left -= 1
        return self.left >= 0
training = _Training()
"""

# Objects alive until the interpreter clears module dicts: a library that keeps ``__main__`` alive (dill,
# multiprocessing's __mp_main__) leaves the script's globals to be cleared after ``os``'s. Parking them
# on ``os`` forces that order every run (a non-underscore name: cleared after os.getpid and os.close).
_KEEP_UNTIL_TEARDOWN = """
import os
os.diskreplay_kept = [writer, store, stream, collator]
"""


def _streams_block() -> str:
    doc = (ROOT / "docs" / "streams.md").read_text()
    return re.findall(r"```python\n(.*?)```", doc, flags=re.S)[0]


def test_the_streams_block_leaves_nothing_on_stderr_at_exit(tmp_path):
    """``Exception ignored in: <function WriterLock.__del__> ... TypeError: 'NoneType' object is not
    callable`` was printed when a store's lock outlived the clearing of ``os``'s module dict."""
    script = (f"path = {str(tmp_path / 'store')!r}\n" + _PRELUDE + _streams_block().replace("next(256", "next(8")
              + _KEEP_UNTIL_TEARDOWN + "print('trained')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "trained\n"
    assert done.stderr == ""


def test_a_lock_held_at_exit_is_not_released_by_python_and_the_next_process_opens(tmp_path):
    """At exit the kernel drops the flock with the process, as after SIGKILL: the next process opens
    the store for writing at once."""
    path = str(tmp_path / "s")
    script = textwrap.dedent(f"""
        import os
        from diskreplay import ReplayStore
        store = ReplayStore({path!r})
        store.extend({{"prompt_id": [1, 2]}})
        os.diskreplay_kept = store
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    from diskreplay import ReplayStore

    with ReplayStore(path) as store:
        assert len(store) == 2
