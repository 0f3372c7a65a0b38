"""Launching a test file as a ``torchrun --standalone`` job (gloo, CPU, nothing downloaded)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
              "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def child_env() -> dict:
    """This process's environment without an enclosing job's rank variables, with this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p]),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="",
               PYTHONWARNINGS="ignore")
    return env


def torchrun(script: str, args: Sequence[str], nproc: int, timeout: float) -> str:
    """Run ``script args`` on ``nproc`` local ranks; fail the test with the job's output unless it exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.abspath(script), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the {nproc}-rank run did not finish in {timeout} s:\n{output.decode(errors='replace')[-6000:]}")
    text = output.decode(errors="replace")
    assert proc.returncode == 0, f"the {nproc}-rank run failed ({proc.returncode}):\n{text[-6000:]}"
    return text
